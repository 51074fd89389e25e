"""Absmax quantisation of attention logits; at 16 bits the model's loss must not move (< 1e-4 nats)."""

import random

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.data.synthetic import ICL_WORDS
from diff_transformer.evaluation import EvalText, ModelUnderTest, quantization
from diff_transformer.evaluation.scoring import token_nll
from diff_transformer.tokenizer import ByteTokenizer

TEXT = EvalText([" ".join(random.Random(0).choices(ICL_WORDS, k=3000))])
LOSS_TOLERANCE_16_BITS = 1e-4  # nats; the rounding error of 16-bit logits is absmax / 65534


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("granularity", ["row", "head"])
def test_quantize_absmax_levels_and_error(bits, granularity):
    logits = torch.randn(2, 3, 16, 16) * 5
    visible = torch.ones(16, 16, dtype=torch.bool).tril()
    out = quantization.quantize_absmax(logits, visible, bits, granularity)
    dims = (-1,) if granularity == "row" else (-2, -1)
    absmax = logits.abs().masked_fill(~visible, 0).amax(dim=dims, keepdim=True)
    step = absmax / (2 ** (bits - 1) - 1)
    err = (out - logits).abs().masked_fill(~visible, 0)
    assert (err <= step / 2 + 1e-5).all()
    levels = torch.round(out / step)
    assert (levels.abs() <= 2 ** (bits - 1) - 1).all()
    torch.testing.assert_close(levels, torch.round(levels))


def test_masked_positions_do_not_set_the_scale():
    logits = torch.tensor([[1.0, 0.6, 100.0]])
    visible = torch.tensor([[True, True, False]])
    out = quantization.quantize_absmax(logits, visible, 4, "row")
    assert out[0, 0] == pytest.approx(1.0) and out[0, 1] == pytest.approx(4 / 7)  # scale from 1.0, not 100


def test_bad_bits_and_granularity_are_clear_errors():
    with pytest.raises(ValueError, match="bits"):
        quantization.quantize_absmax(torch.zeros(2, 2), None, 1)
    with pytest.raises(ValueError, match="granularity"):
        quantization.quantize_absmax(torch.zeros(2, 2), None, 8, "tensor")


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2", "gda"])
def test_16_bits_changes_nothing_and_4_bits_changes_something(kind):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind, max_seq_len=64,
                                     **({"n_heads": 4, "gda_ratio": 2} if kind == "gda" else {}))).eval()
    with torch.no_grad():  # larger logits than at init, so that 4 bits is coarse
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(20)
    windows = TEXT.windows(ByteTokenizer(), 64, 4)
    plain = token_nll(model, windows)
    with model.tap_attention(quantization.QuantizeTap(None)):
        reference = token_nll(model, windows)
    with model.tap_attention(quantization.QuantizeTap(16)):
        q16 = token_nll(model, windows)
    with model.tap_attention(quantization.QuantizeTap(4)):
        q4 = token_nll(model, windows)
    assert (reference.mean() - plain.mean()).abs() < 1e-5  # the reference path is the same model
    assert (q16.mean() - reference.mean()).abs() < LOSS_TOLERANCE_16_BITS
    assert (q16 - reference).abs().max() < 1e-3
    assert (q4 - reference).abs().max() > 1e-3


@pytest.mark.slow  # every bit width through both models
def test_quantization_run_reports_every_bit_width():
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug", attention="diff", max_seq_len=256)
    mut = ModelUnderTest("diff", LanguageModel(config).eval(), ByteTokenizer())
    options = quantization.QuantizationOptions(bits=(16, 4), loss_windows=2, cloze_items=4, needle_setting="1:1",
                                               needle_samples=2)
    result = quantization.run(mut, options, TEXT, progress=False)
    rows = result["results"]
    assert [r["bits"] for r in rows] == [None, 16, 4]
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], abs=LOSS_TOLERANCE_16_BITS)
    assert rows[1]["cloze_correct"] == rows[0]["cloze_correct"]
    assert all(0.0 <= r["cloze_accuracy"] <= 1.0 and 0.0 <= r["needle_accuracy"] <= 1.0 for r in rows)
    assert result["needle"]["documents"] == 2 and result["cloze"]["items"] == 4


def test_cloze_items_hold_the_true_continuation():
    stream = TEXT.stream(ByteTokenizer(), 1000)
    options = quantization.QuantizationOptions(cloze_items=5, cloze_context=20, cloze_continuation=8)
    tokens = stream.tolist()
    for context, choices, answer in quantization.cloze_items(stream, options):
        assert len(context) == 20 and len(choices) == 4 and all(len(c) == 8 for c in choices)
        joined = context + choices[answer]
        assert any(tokens[i : i + 28] == joined for i in range(len(tokens) - 27))
