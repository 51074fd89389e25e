"""The trainer's diagnostics (train/diagnostics.py) against values computed here another way: λ
from the formula by hand, the attention-branch RMS from a forward written out block by block,
the negative share of maps counted entry by entry, the first-token share row by row, spikes of a
made-up sequence of norms."""

import json
import math

import pytest
import torch

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.train import train
from diff_transformer.train import diagnostics
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


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_symmetric", "diff_v2", "gated", "gated_headwise", "mta",
                                  "xsa"])
def test_probe_values_match_the_formulas(kind):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind))
    with torch.no_grad():  # large λ vectors and peaked maps (large q, k): maps that go negative
        for name, p in model.named_parameters():
            if "lambda_" in name:
                p.normal_(0.0, 0.4)
            elif any(proj in name for proj in ("q_proj", "k_proj", "qk_proj")):
                p.normal_(0.0, 0.5)
            elif "head_mix" in name:  # MTA's maps mixed across heads with negative weights
                p.add_(torch.randn_like(p) * 0.5)
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

    with torch.no_grad(), model.tap_attention(_Maps()) as tap:
        model(tokens)

    # the first-token share, row by row: each query i >= 1 of the head-mean map, divided by the row's sum
    # (rows summing to less than 0.05 left out), its entry at key 0; the mean over the queries, then the sequences
    expected = []
    for layer in range(len(model.layers)):
        mean_map = tap.combined[layer].double().mean(dim=1)  # (B, T, T)
        per_sequence = []
        for rows in mean_map:
            shares = [rows[i, 0].item() / rows[i].sum().item()
                      for i in range(1, rows.shape[0]) if rows[i].sum() >= 0.05]
            per_sequence.append(sum(shares) / len(shares))
        expected.append(sum(per_sequence) / len(per_sequence))
    assert found["first_token_share"] == pytest.approx(expected, abs=1e-6)
    uniform = sum(1 / (i + 1) for i in range(1, 24)) / 23  # the check is not of uniform maps
    assert max(abs(x - uniform) for x in expected) > 0.01
    assert probe(model, tokens, maps=False)["first_token_share"] == found["first_token_share"]

    # the negative share, counted entry by entry over the visible (causal) entries
    if kind in ("standard", "gated", "gated_headwise"):  # softmax maps (the gate acts after them): never negative
        assert "negative_share" not in found
        return
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
    assert max(expected) > (0.02 if kind == "xsa" else 0.05)  # not of zeros (XSA: at most each row's own key)
    assert "negative_share" not in probe(model, tokens, maps=False)
    assert model.training and all(layer.attn.tap is None for layer in model.layers)
    assert all(not layer.attn._forward_hooks for layer in model.layers)


def naive_negative_shares(model, tokens, n):
    """The share of negative visible entries of each DIFF layer's p1 − λ·p2 over the first ``n``
    tokens, in float64 from the weights and each layer's input (the paper's §2.1, the authors' layout)."""
    from test_model import causal_softmax, rope_complex

    inputs = {}
    hooks = [layer.attn.register_forward_pre_hook(lambda m, args, i=i: inputs.setdefault(i, args[0]))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    shares, cfg = [], model.config
    for i, layer in enumerate(model.layers):
        a, x, d = layer.attn, inputs[i][:, :n].double(), cfg.head_dim
        q = rope_complex((x @ a.q_proj.weight.double().T).unflatten(-1, (-1, d)), cfg.rope_theta)  # (B, n, 2H, d)
        k = rope_complex((x @ a.k_proj.weight.double().T).unflatten(-1, (-1, d)), cfg.rope_theta)  # (B, n, 2Hkv, d)
        lam, rep = a.lam().double().item(), cfg.n_heads // cfg.n_kv_heads
        maps = torch.stack([causal_softmax(q[:, :, 2 * h] @ k[:, :, 2 * (h // rep)].mT / math.sqrt(d))
                            - lam * causal_softmax(q[:, :, 2 * h + 1] @ k[:, :, 2 * (h // rep) + 1].mT / math.sqrt(d))
                            for h in range(cfg.n_heads)])  # (H, B, n, n)
        visible = torch.ones(n, n, dtype=torch.bool).tril()
        shares.append(((maps < 0) & visible).sum().item() / (visible.sum().item() * maps.shape[0] * maps.shape[1]))
    return shares


def test_the_maps_are_taken_on_a_bounded_prefix_of_a_long_probe(monkeypatch):
    """The negative share of a probe longer than MAP_PROBE_TOKENS is that of its first
    MAP_PROBE_TOKENS tokens (float64 oracle), no map is ever built beyond them, and λ and the RMS
    still come from the whole window."""
    assert diagnostics.MAP_PROBE_TOKENS == 2048  # a 64K window's maps would need ~206 GB per layer
    bound = 16
    monkeypatch.setattr(diagnostics, "MAP_PROBE_TOKENS", bound)
    shapes = []
    record = diagnostics._MapSharesTap.record
    monkeypatch.setattr(diagnostics._MapSharesTap, "record",
                        lambda self, i, maps: (shapes.append(tuple(maps.combined.shape)), record(self, i, maps)))
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff", n_kv_heads=1))
    with torch.no_grad():  # λ ≈ 1.1 to 1.2 and peaked maps (large q, k): maps that go negative in every layer
        for name, p in model.named_parameters():
            if "lambda_" in name:
                p.fill_(0.2 if name.endswith("1") else 0.0)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, 0.5)
    tokens = torch.randint(0, 512, (2, 40))
    found = probe(model, tokens, maps=True)
    assert shapes and all(shape[-2:] == (bound, bound) for shape in shapes)
    expected = naive_negative_shares(model, tokens, bound)
    assert found["negative_share"] == pytest.approx(expected, abs=1e-12)
    assert min(expected) > 0.05 and expected != pytest.approx(naive_negative_shares(model, tokens, 40), abs=1e-3)
    whole = probe(model, tokens, maps=False)  # λ and the RMS of the whole window, as before
    assert found["lambda"] == whole["lambda"] and found["attn_rms"] == pytest.approx(whole["attn_rms"], rel=1e-5)
    assert model.training and all(not layer.attn._forward_hooks and layer.attn.tap is None for layer in model.layers)

    shapes.clear()  # a probe no longer than the bound: its maps are those of the same, single forward
    short = probe(model, tokens[:, :bound], maps=True)
    assert shapes == [(2, 2, bound, bound)] * 2 and short["negative_share"] == found["negative_share"]


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_a_run_logs_the_diagnostics(kind, byte_dataset, tmp_path):  # noqa: F811
    """Records at every log step (λ, RMS and first-token share per layer), the negative share at
    evaluation steps, the final λ those of the saved checkpoint, TensorBoard scalars per layer."""
    out = tmp_path / "run"
    config = debug_config(byte_dataset, out, models={"m": {"attention": kind}},
                          run={"steps": 4, "log_every": 2, "eval_every": 3, "tensorboard": True})
    result = train(config)
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "diagnostics"]
    assert [r["step"] for r in records] == [2, 3, 4]  # log steps 2, 4 and evaluation steps 3, 4
    for r in records:
        assert len(r["attn_rms"]) == 2 and all(x > 0 for x in r["attn_rms"])
        assert len(r["first_token_share"]) == 2 and all(0 < x < 1 for x in r["first_token_share"])
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
    assert {"attn_rms/layer_0", "attn_rms/layer_1", "first_token_share/layer_1", "diagnostics/grad_norm_spikes",
            "train/loss"} <= tags
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
