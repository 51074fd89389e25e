"""Attention maps handed to an AttentionTap, and the attention-noise evaluation built on them."""

import math
import random

import pytest
import torch

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.data.synthetic import ICL_WORDS, build_needle_example
from diff_transformer.evaluation import EvalText, ModelUnderTest
from diff_transformer.evaluation import attention_noise, attention_sink
from diff_transformer.evaluation.stats import decimals
from diff_transformer.tokenizer import ByteTokenizer

KINDS = ["standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise", "gda", "mta", "xsa"]
TOK = ByteTokenizer()
TEXT = EvalText([" ".join(random.Random(0).choices(ICL_WORDS, k=6000))])


def model(kind: str) -> LanguageModel:
    torch.manual_seed(0)
    gda = {"n_heads": 4, "gda_ratio": 2} if kind == "gda" else {}  # 4 signal heads sharing 2 noise heads
    return LanguageModel(ModelConfig.from_preset("debug", attention=kind, max_seq_len=256, **gda)).eval()


class Recorder(AttentionTap):
    def __init__(self):
        self.maps = {}

    def record(self, layer_index, maps):
        self.maps[layer_index] = maps


@pytest.mark.parametrize("kind", KINDS)
def test_effective_map_rows_sum_as_expected(kind):
    """Softmax rows sum to 1 (gated attention's too: its gate acts after the map; MTA's at init, its mixing
    the identity); DIFF rows to 1 − λ (GDA's signed map of each signal head too); DIFF V2 rows to
    1 − σ(λ_h(x_t)); XSA's map is the softmax map but at each query's own key."""
    m = model(kind)
    inputs = {}
    hooks = [layer.attn.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(m.layers)]
    tokens = torch.randint(0, 257, (2, 40))
    with torch.no_grad(), m.tap_attention(Recorder()) as tap:
        m(tokens)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(m.layers):
        maps = tap.maps[i]
        for probs in maps.probs:
            torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)), atol=1e-5, rtol=0)
        sums = maps.combined.sum(-1)  # (B, H, T)
        if kind == "xsa":
            off_own = ~torch.eye(40, dtype=torch.bool)
            torch.testing.assert_close(maps.combined[..., off_own], maps.probs[0][..., off_own], atol=0, rtol=0)
            expected = sums
        elif kind in ("standard", "gated", "gated_headwise", "mta"):
            expected = torch.ones_like(sums)
        elif kind in ("diff", "diff_symmetric", "gda"):
            expected = torch.full_like(sums, 1.0 - float(layer.attn.lam().detach()))
        else:
            lam = torch.sigmoid(layer.attn.lambda_proj(inputs[i]).float()).transpose(1, 2)  # (B, H, T)
            expected = 1.0 - lam
        torch.testing.assert_close(sums, expected, atol=1e-5, rtol=0)
        for logits in maps.logits:  # masked (future) positions are -inf
            assert torch.isinf(logits[..., 0, 1:]).all() and torch.isfinite(logits[..., -1, :]).all()


def test_column_groups_partition_the_document():
    filler = TEXT.filler(TOK)
    ex = build_needle_example(random.Random(0), TOK, filler, length=400, n_needles=3, n_queries=2, depth=0.5)
    groups = attention_noise.column_groups(ex)
    stacked = torch.stack([groups[g] for g in attention_noise.GROUPS]).int()
    assert (stacked.sum(0) == 1).all()
    for i in ex.queried_needles:
        start, end = ex.needle_number_spans[i]
        assert groups["answer"][start:end].all()
    assert groups["answer"].sum() == sum(e - s for s, e in (ex.needle_number_spans[i] for i in ex.queried_needles))
    rows = attention_noise.answer_rows(ex)
    assert [ex.tokens[r + 1] for r in rows] == [t for s, e in ex.answer_spans for t in ex.tokens[s:e]]


@pytest.mark.parametrize("kind", KINDS)
def test_attention_noise_masses_are_normalised(kind):
    mut = ModelUnderTest(kind, model(kind), TOK)
    options = attention_noise.AttentionNoiseOptions(depths=(0.0, 1.0), samples=2, length=200)
    result = attention_noise.run(mut, options, TEXT, progress=False)
    assert result["depths"] == [0.0, 1.0] and len(result["answer"]) == 2
    for entry in result["by_depth"]:
        assert entry["answer"] + entry["noise"] + entry["other"] == pytest.approx(1.0, abs=1e-5)
        assert 0.0 < entry["answer"] < 1.0 and 0.0 < entry["noise"] < 1.0
        assert len(entry["per_layer"]["answer"]) == 2 and entry["layers_left_out"] == [0, 0]
    assert len(result["profile"]["attention"]) == 200


@pytest.mark.parametrize("kind", KINDS)
def test_attention_sink_runs_on_every_kind(kind):
    """Per layer a mean and a spread over the windows; for the softmax kinds (gated ones included: the
    gate acts after the map) shares in (0, 1], the untrained models' close to uniform attention's."""
    mut = ModelUnderTest(kind, model(kind), TOK)
    result = attention_sink.run(mut, attention_sink.AttentionSinkOptions(windows=3, seq_len=32), TEXT, progress=False)
    n_layers = mut.model.config.n_layers
    assert result["windows"] == 3 and len(result["per_window"]["per_layer"]) == 3
    assert len(result["per_layer"]["mean"]) == len(result["per_layer"]["std"]) == n_layers
    assert result["rows_left_out"] == [0] * n_layers
    if kind in ("standard", "gated", "gated_headwise"):
        assert all(0 < x <= 1 for x in result["per_layer"]["mean"])
    assert result["mean_over_layers"]["mean"] == pytest.approx(result["uniform_share"], abs=0.05)


def test_the_attention_sink_verdict_is_printed_with_the_digits_that_show_it():
    """The issue's "−0.000 ± 0.000 … : lower": a difference of 1.2e-4 beyond its noise of ~8e-6
    (two standard errors of the paired per-window differences, by hand below) is printed to two
    significant figures of the noise, so that the verdict can be read off the figures."""
    base = [0.1, 0.1002, 0.0998, 0.1]
    cand = [b + d for b, d in zip(base, [0.00012, 0.00011, 0.00013, 0.00012])]

    def entry(kind, shares):
        mean = sum(shares) / len(shares)
        return {"model": {"attention": kind}, "windows": 4, "seq_len": 32, "first_query": 1, "uniform_share": 0.1,
                "per_layer": {"mean": [mean], "std": [0.0]}, "mean_over_layers": {"mean": mean, "std": 0.0},
                "per_window": {"mean_over_layers": shares}, "windows_fingerprint": "same"}

    text = attention_sink.report({"standard": entry("standard", base), "diff": entry("diff", cand)},
                                 attention_sink.AttentionSinkOptions(windows=4, seq_len=32))
    line = next(line for line in text.splitlines() if line.startswith("First-token share"))
    diffs = [c - b for b, c in zip(base, cand)]
    mean = sum(diffs) / 4
    noise = 2 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3 / 4)
    assert f"{mean:+.7f} ± {noise:.7f}" in line and line.endswith(": higher."), line
    assert "+0.0001200 ± 0.0000082" in line


@pytest.mark.parametrize("values, at_least, places", [
    ((0.12, 0.03), 3, 3), ((-0.0001, 0.00004), 3, 6), ((0.0, None, float("nan")), 3, 3), ((1e-12,), 3, 10),
    ((123.0,), 4, 4), ((0.0049,), 2, 4),
])
def test_decimals_show_two_significant_figures_of_every_value(values, at_least, places):
    assert decimals(*values, at_least=at_least) == places
