"""The trainer's diagnostics (train/diagnostics.py) against values computed here another way: λ
from the formula by hand, the attention-branch RMS from a forward written out block by block,
the negative share of maps counted entry by entry, spikes of a made-up sequence of norms."""

import json
import math

import pytest
import torch

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.train import train
from diff_transformer.train import trainer as trainer_module
from diff_transformer.train.diagnostics import GradientSpikes, negative_share, probe
from diff_transformer.train.trainer import read_metrics
from test_train import byte_dataset, debug_config  # noqa: F401  (byte_dataset is a fixture)


def test_spikes_are_norms_above_five_times_the_median_of_the_previous_fifty():
    spikes = GradientSpikes()
    norms = [1.0] * 9 + [50.0]  # 9 previous norms: too few for a verdict
    norms += [1.0] * 5 + [5.0, 5.01]  # median 1: exactly 5x is not a spike, 5.01x is
    for step, norm in enumerate(norms, start=1):
        spikes.observe(step, norm)
    assert [s["step"] for s in spikes.spikes] == [17] and spikes.spikes[0]["median"] == 1.0
    # The median is of the previous 50 only: after 50 norms of 0.1 the ones have left the window.
    spikes = GradientSpikes()
    for step in range(1, 51):
        spikes.observe(step, 1.0)
    for step in range(51, 101):
        spikes.observe(step, 0.1)
    assert spikes.observe(101, 0.6) == {"step": 101, "grad_norm": 0.6, "median": 0.1, "window": 50}
    assert spikes.count == 1 and GradientSpikes(earlier=3).count == 3


def test_negative_share_counts_only_the_visible_entries():
    # One map, T = 3 queries over S = 4 keys, end-aligned: query i sees keys 0 … i + 1.
    combined = torch.tensor([[0.6, -0.1, -9.0, -9.0],   # 1 negative of 2 visible (the -9s are hidden)
                             [0.5, 0.2, -0.3, -9.0],    # 1 of 3
                             [-0.2, -0.1, 0.4, 0.0]])   # 2 of 4 (0 is not negative)
    assert negative_share(combined[None, None]) == pytest.approx(4 / 9)
    # Batch and heads: the share over all of them.
    two = torch.stack([combined, combined.abs()])[None]  # (1, 2, 3, 4)
    assert negative_share(two) == pytest.approx(4 / 18)


class _Maps(AttentionTap):
    def __init__(self):
        self.combined = {}

    def record(self, layer_index, maps):
        self.combined[layer_index] = maps.combined


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_symmetric", "diff_v2"])
def test_probe_values_match_the_formulas(kind):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind))
    with torch.no_grad():  # large λ vectors and peaked maps (large q, k): maps that go negative
        for name, p in model.named_parameters():
            if "lambda_" in name:
                p.normal_(0.0, 0.4)
            elif any(proj in name for proj in ("q_proj", "k_proj", "qk_proj")):
                p.normal_(0.0, 0.5)
    tokens = torch.randint(0, 512, (2, 24))
    found = probe(model, tokens, maps=True)

    # λ by hand from the four vectors and the depth schedule
    if kind in ("diff", "diff_symmetric"):
        expected = []
        for i, layer in enumerate(model.layers):
            a = layer.attn
            dot = lambda u, v: sum(x * y for x, y in zip(u.tolist(), v.tolist()))  # noqa: E731
            expected.append(math.exp(dot(a.lambda_q1, a.lambda_k1)) - math.exp(dot(a.lambda_q2, a.lambda_k2))
                            + 0.8 - 0.6 * math.exp(-0.3 * i))
        assert found["lambda"] == pytest.approx(expected, abs=1e-5)
    else:
        assert "lambda" not in found

    # the RMS of each attention branch, from the forward written out block by block in float64
    with torch.no_grad():
        x = model.embed(tokens)
        expected = []
        for layer in model.layers:
            branch = layer.attn(layer.attn_norm(x))
            expected.append(branch.double().pow(2).mean().sqrt().item())
            x = x + branch
            x = x + layer.ffn(layer.ffn_norm(x))
    assert found["attn_rms"] == pytest.approx(expected, rel=1e-5)

    # the negative share, counted entry by entry over the visible (causal) entries
    if kind == "standard":
        assert "negative_share" not in found
        return
    with torch.no_grad(), model.tap_attention(_Maps()) as tap:
        model(tokens)
    expected = []
    for layer in range(len(model.layers)):
        maps = tap.combined[layer]  # (B, H, T, T)
        negative = visible = 0
        for row in maps.flatten(0, 1):
            for i in range(row.shape[0]):
                for j in range(i + 1):
                    visible += 1
                    negative += row[i, j].item() < 0
        expected.append(negative / visible)
    assert found["negative_share"] == pytest.approx(expected, abs=1e-12)
    assert max(expected) > 0.05  # the check is not of zeros
    assert "negative_share" not in probe(model, tokens, maps=False)
    assert model.training and all(layer.attn.tap is None for layer in model.layers)
    assert all(not layer.attn._forward_hooks for layer in model.layers)


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_a_run_logs_the_diagnostics(kind, byte_dataset, tmp_path):  # noqa: F811
    """Records at every log step (λ and RMS per layer), the negative share at evaluation steps, the
    final λ those of the saved checkpoint, TensorBoard scalars per layer."""
    out = tmp_path / "run"
    config = debug_config(byte_dataset, out, models={"m": {"attention": kind}},
                          run={"steps": 4, "log_every": 2, "eval_every": 3, "tensorboard": True})
    result = train(config)
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "diagnostics"]
    assert [r["step"] for r in records] == [2, 3, 4]  # log steps 2, 4 and evaluation steps 3, 4
    for r in records:
        assert len(r["attn_rms"]) == 2 and all(x > 0 for x in r["attn_rms"])
        assert r["grad_norm_spikes"] == 0 and r["grad_norm_median"] > 0
        assert ("lambda" in r) == (kind == "diff") and ("negative_share" in r) == (kind == "diff" and r["step"] != 2)
    assert read_metrics(out / "metrics.jsonl")[0]["kind"] == "train"  # readers of the first record keep working
    if kind == "diff":
        final = LanguageModel.from_pretrained(out / "checkpoint").lambdas()
        assert records[-1]["lambda"] == pytest.approx(final, abs=1e-6)
    assert result.grad_norm_spikes == 0 and json.loads((out / "summary.json").read_text())["grad_norm_spikes"] == 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"attn_rms/layer_0", "attn_rms/layer_1", "diagnostics/grad_norm_spikes", "train/loss"} <= tags
    assert ({"lambda/layer_0", "lambda/layer_1", "negative_share/layer_1"} <= tags) == (kind == "diff")
    assert [e.value for e in events.Scalars("attn_rms/layer_1")] == pytest.approx([r["attn_rms"][1] for r in records])


@pytest.mark.slow  # a 13-step run
def test_a_gradient_spike_is_named_and_counted(byte_dataset, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A step whose gradient norm jumps (made so here) gets a grad_spike record, a line on stderr,
    and counts in summary.json; run.diagnostics=false leaves the probe out, not the count."""
    gradients = trainer_module._Run.gradients

    def jump_at_step_12(self, stop_requested):
        loss, norm, votes = gradients(self, stop_requested)
        return loss, (norm * 100 if self.progress.step + 1 == 12 else norm), votes

    monkeypatch.setattr(trainer_module._Run, "gradients", jump_at_step_12)
    out = tmp_path / "run"
    config = debug_config(byte_dataset, out, run={"steps": 13, "log_every": 1, "eval_every": 13, "diagnostics": False})
    result = train(config)
    spikes = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "grad_spike"]
    assert [r["step"] for r in spikes] == [12] and spikes[0]["ratio"] > 5
    assert result.grad_norm_spikes == 1 and json.loads((out / "summary.json").read_text())["grad_norm_spikes"] == 1
    assert "step 12: gradient norm" in capsys.readouterr().err
    assert not any(r["kind"] == "diagnostics" for r in read_metrics(out / "metrics.jsonl"))
