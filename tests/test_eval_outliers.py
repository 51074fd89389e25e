"""Activation outliers: exact top values, masked logits excluded, every attention kind."""

import random

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.data.synthetic import ICL_WORDS
from diff_transformer.evaluation import EvalText, ModelUnderTest, outliers
from diff_transformer.tokenizer import ByteTokenizer

TEXT = EvalText([" ".join(random.Random(0).choices(ICL_WORDS, k=3000))])


def test_magnitude_stats_match_brute_force():
    values = [torch.randn(1000) * 3, torch.randn(37), torch.randn(5000) * 0.1]
    stats = outliers.MagnitudeStats(1.0, seed=0)
    for i, v in enumerate(values):
        stats.update(v, layer_index=i)
    everything = torch.cat(values).abs()
    top = everything.sort(descending=True).values
    summary = stats.summary()
    for rank in outliers.RANKS:
        assert summary[f"top{rank}"] == pytest.approx(float(top[rank - 1]))
    assert summary["median"] == pytest.approx(float(everything.median()))
    assert summary["count"] == everything.numel() and summary["median_exact"]
    assert summary["per_layer_top1"] == pytest.approx([float(v.abs().max()) for v in values])


def test_subsampled_median_is_close():
    values = torch.randn(200_000)
    # A seed other than the global one: the same seed would make the kept draws correlate with randn's.
    stats = outliers.MagnitudeStats(0.1, seed=1234)
    stats.update(values, 0)
    summary = stats.summary()
    assert not summary["median_exact"]
    assert summary["median"] == pytest.approx(float(values.abs().median()), rel=0.03)
    assert summary["top1"] == pytest.approx(float(values.abs().max()))


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2", "gda", "mta", "xsa"])
def test_outliers_run(kind):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug", attention=kind, max_seq_len=64,
                                     **({"n_heads": 4, "gda_ratio": 2} if kind == "gda" else {}))
    mut = ModelUnderTest(kind, LanguageModel(config).eval(), ByteTokenizer())
    result = outliers.run(mut, outliers.OutlierOptions(tokens=128, batch_size=2), TEXT, progress=False)
    logits, hidden = result["attention_logits"], result["hidden_states"]
    # DIFF: two maps per head; V2: 2H query heads; GDA: H signal and H / r noise maps; MTA, XSA: one per head
    maps = {"standard": config.n_heads, "mta": config.n_heads, "xsa": config.n_heads,
            "gda": config.n_heads + config.n_heads // 2}.get(kind, 2 * config.n_heads)
    assert logits["count"] == 2 * config.n_layers * maps * 64 * 65 // 2  # only the visible (causal) logits
    assert hidden["count"] == 2 * config.n_layers * 64 * config.d_model
    for stats in (logits, hidden):
        tops = [stats[c] for c in outliers.COLUMNS[:-1]]
        assert tops == sorted(tops, reverse=True) and stats["median"] <= tops[-1]
        assert all(v is not None and v >= 0 for v in tops)
        assert (len(stats["per_layer_top1"]) == config.n_layers
                and max(stats["per_layer_top1"]) == pytest.approx(stats["top1"]))
