"""Every map of every attention kind through every evaluation that transforms or reads the maps.

Table-driven: each attention kind (``ATTENTION_KINDS``: a kind added later fails here until it has
its row in ``SHAPES`` and ``MAP_HEADS`` and its maps in the oracle) × quantisation (which rewrites the
logits) and the readers: outliers (the logits), attention noise, the lookback ratio (in one forward
and continuing a KV cache) and the attention sink (the effective map). The oracle is below, apart
from the code under test: every map of a layer recomputed in float64 from its weights and its input
(caught by a hook), as the module docstrings state each kind, with the maps each kind computes
counted by hand in ``MAP_HEADS``. Each case checks that the measurement sees every one of those maps
and nothing else: the quantiser is handed each map once and the softmax reads each map quantised (a
map that escaped would stay off the levels, and leaving any one map unquantised gives another
output); a reader's figures are those of the oracle's maps, and differ from what it would find with
any one map flattened (so a map that escaped the reader would show). The models are tiny and their
attention weights pushed off their initial values (sharp maps, mixed MTA kernels, gates away from
0.5), so that every map matters.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.config import ATTENTION_KINDS
from diff_transformer.evaluation import attention_noise, attention_sink, lookback, outliers, quantization

B, T = 2, 16
CAUSAL = torch.ones(T, T, dtype=torch.bool).tril()
# Each kind's heads: GQA where the kind has it, GDA's 4 signal heads sharing 2 noise heads, MTA with a
# convolved layer (layer 1) and an unconvolved one, and its heads mixed in groups of 2; XSA gated.
SHAPES = {
    "standard": dict(n_heads=4, n_kv_heads=2),
    "gated": dict(n_heads=4, n_kv_heads=2),
    "gated_headwise": dict(n_heads=4, n_kv_heads=2),
    "xsa": dict(n_heads=4, n_kv_heads=2, xsa_gate=True),
    "mta": dict(n_heads=4, n_kv_heads=2, mta_query_kernel=3, mta_key_kernel=3, mta_conv_every=2, mta_head_group=2),
    "diff_v2": dict(n_heads=4, n_kv_heads=2),
    "diff": dict(n_heads=2, n_kv_heads=1),
    "diff_symmetric": dict(n_heads=2),
    "gda": dict(n_heads=4, n_kv_heads=1, gda_ratio=2),
}
# The maps (pre-softmax logits) one layer computes, as head counts, by hand: DIFF two per head, GDA H
# signal and H / r noise maps, DIFF V2 one over its 2H query heads, the others one per head.
MAP_HEADS = {"standard": [4], "gated": [4], "gated_headwise": [4], "xsa": [4], "mta": [4], "diff_v2": [8],
             "diff": [2, 2], "diff_symmetric": [2, 2], "gda": [4, 2]}


def build(kind: str) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, max_seq_len=32, attention=kind,
                                      **SHAPES[kind])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attn." in name and ".lambda_" not in name:  # λ stays near λ_init: DIFF rows sum to about 0.8
                p.add_(torch.randn_like(p) * 0.3)
    return model


def forward(kind: str, tap, prefill: int = 0) -> tuple[LanguageModel, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The model of ``kind`` run once under ``tap``; per layer its attention's input and output (float64).
    With ``prefill``, as context-qa reads an answer: the first ``prefill`` tokens run into a KV cache on
    the fast path, untapped, and the rest continue it under the tap (inputs and outputs joined)."""
    model = build(kind)
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    seen: dict[int, list] = {}
    hooks = [layer.attn.register_forward_hook(lambda m, args, out, i=i: seen.setdefault(i, []).append((args[0], out)))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        cache = model.new_cache(B, T) if prefill else None
        if prefill:
            model(tokens[:, :prefill], cache=cache)
        with model.tap_attention(tap):
            model(tokens[:, prefill:], cache=cache)
    for hook in hooks:
        hook.remove()
    assert sorted(seen) == list(range(model.config.n_layers))
    return model, {i: tuple(torch.cat(parts, dim=1).double() for parts in zip(*calls)) for i, calls in seen.items()}


# --- the oracle: float64, from the weights ----------------------------------------------------------------


def linear(x, lin):
    return x @ lin.weight.double().T + (0.0 if lin.bias is None else lin.bias.double())


def rope(x, theta):
    """(B, T, n, d): the pair (2j, 2j + 1) at position p turned by the angle p·θ^(−2j/d)."""
    d = x.shape[-1]
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None, None] * theta ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()], -1).flatten(-2)


def conv(x, kernel):
    """MTA's key-query convolution as the authors' conv2d: c_q − 1 rows of zeros above, (c_k − 1)/2 columns
    each side, one kernel per head."""
    h, cq, ck = kernel.shape
    return F.conv2d(F.pad(x, ((ck - 1) // 2, (ck - 1) // 2, cq - 1, 0)), kernel.double().unsqueeze(1), groups=h)


def convolved(attn) -> bool:
    every = attn.config.mta_conv_every
    return attn.layer_index % every == every // 2


@torch.no_grad()
def oracle_maps(attn, x) -> list[torch.Tensor]:
    """Every map's pre-softmax logits (B, heads, T, T), in the kind's order (first maps, then second ones)."""
    cfg, d = attn.config, attn.head_dim
    kind = cfg.attention

    def heads(lin):  # (B, n, T, d) after RoPE
        return rope(linear(x, lin).unflatten(-1, (-1, d)), cfg.rope_theta).transpose(1, 2)

    def scores(q, k):  # query head h reads key head h // (n / n_k)
        return q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / math.sqrt(d)

    q, k = (heads(attn.qk_proj),) * 2 if kind == "diff_symmetric" else (heads(attn.q_proj), heads(attn.k_proj))
    if kind in ("diff", "diff_symmetric"):  # sub-heads 2h and 2h + 1 of DIFF head h
        return [scores(q[:, 0::2], k[:, 0::2]), scores(q[:, 1::2], k[:, 1::2])]
    if kind == "gda":  # N groups of r signal sub-heads and their noise sub-head
        groups = q.unflatten(1, (-1, cfg.gda_ratio + 1))
        return [scores(groups[:, :, :-1].flatten(1, 2), k[:, 0::2]), scores(groups[:, :, -1], k[:, 1::2])]
    logits = scores(q, k)
    if kind == "mta":
        if convolved(attn):
            logits = conv(logits.masked_fill(~CAUSAL, 0.0), attn.kq_conv_pre)
        logits = torch.einsum("mn,bnij->bmij", attn.head_mix_pre.double(), logits)
    return [logits]


@torch.no_grad()
def oracle_output(attn, x, logits) -> tuple[torch.Tensor, torch.Tensor]:
    """From the maps' logits: the effective map that multiplies V (B, H, T, T) and the module's output (B, T, E)."""
    cfg = attn.config
    kind, t = cfg.attention, x.shape[1]
    p = [torch.softmax(m.masked_fill(~CAUSAL, -math.inf), dim=-1) for m in logits]
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * attn.layer_index)
    if kind in ("diff", "diff_symmetric", "gda"):  # p1 − λ·p2, GDA's signal head i with noise head i // r
        lam = (torch.dot(attn.lambda_q1.double(), attn.lambda_k1.double()).exp()
               - torch.dot(attn.lambda_q2.double(), attn.lambda_k2.double()).exp() + lambda_init)
        combined = p[0] - lam * p[1].repeat_interleave(p[0].shape[1] // p[1].shape[1], 1)
    elif kind == "diff_v2":  # p_2h − σ(x W_λ)_h · p_2h+1
        combined = p[0][:, 0::2] - torch.sigmoid(linear(x, attn.lambda_proj)).transpose(1, 2)[..., None] * p[0][:, 1::2]
    elif kind == "mta":  # convolved after the softmax too, then mixed within groups of heads
        a = conv(p[0], attn.kq_conv_post).masked_fill(~CAUSAL, 0.0) if convolved(attn) else p[0]
        g, c, _ = attn.head_mix_post.shape
        combined = torch.einsum("gnm,bgnij->bgmij", attn.head_mix_post.double(), a.unflatten(1, (g, c))).flatten(1, 2)
    else:
        combined = p[0]
    h = combined.shape[1]
    v = linear(x, attn.v_proj).unflatten(-1, (cfg.n_kv_heads, -1)).transpose(1, 2).repeat_interleave(
        h // cfg.n_kv_heads, 1)  # (B, H, T, w)
    if kind == "xsa":  # each output less g_h times its component along the token's own value
        y = combined @ v
        c = (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)
        c = c * torch.sigmoid(attn.xsa_gate.double())[:, None, None] if cfg.xsa_gate else c
        combined = combined - c * torch.eye(t, dtype=torch.float64)
    out = combined @ v
    if kind in ("gated", "gated_headwise"):
        out = out * torch.sigmoid(linear(x, attn.gate_proj)).unflatten(-1, (h, -1)).transpose(1, 2)
    if cfg.head_norm:
        scale = 1 - lambda_init if kind in ("diff", "diff_symmetric", "gda") else 1.0
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + cfg.head_norm_eps) * attn.head_norm.weight.double()
        out = out * scale
    if kind == "mta":
        out = out * torch.sigmoid(linear(out, attn.gate_proj))
    return combined, linear(out.transpose(1, 2).flatten(2), attn.o_proj)


def exact_maps(model, seen, i, *, untransformed: bool = True) -> list[torch.Tensor]:
    """Layer i's maps by the oracle, checked to be the kind's maps (by hand) and, when the tap left the
    logits as they were, to give the layer's output."""
    attn = model.layers[i].attn
    x, out = seen[i]
    maps = oracle_maps(attn, x)
    assert [tuple(m.shape) for m in maps] == [(B, h, T, T) for h in MAP_HEADS[attn.config.attention]]
    if untransformed:
        torch.testing.assert_close(oracle_output(attn, x, maps)[1], out, atol=1e-5, rtol=1e-4)
    return maps


def flattened(maps, j):
    """The maps with map j's logits all 0: a uniform map, as if the measurement had not seen map j."""
    return [torch.zeros_like(m) if n == j else m for n, m in enumerate(maps)]


def assert_every_map_read(read, got, model, seen, i, atol=1e-5):
    """``got``, what the reader found in layer i, is ``read(effective map)`` of the oracle's maps, and
    differs from what the reader would find with any one of the maps flattened."""
    attn, x = model.layers[i].attn, seen[i][0]
    maps = exact_maps(model, seen, i)
    expected = read(oracle_output(attn, x, maps)[0])
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)
    for j in range(len(maps)):
        other = read(oracle_output(attn, x, flattened(maps, j))[0])
        assert (other - expected).abs().max() > 1e-3, f"map {j} of layer {i} does not show in the reading"


# --- quantisation: every map's logits rewritten, and read by the softmax so ---------------------------------


class WatchedQuantizeTap(quantization.QuantizeTap):
    """The evaluation's tap, which also notes every map it is handed and keeps the maps it saw used."""

    def __init__(self, bits, granularity):
        super().__init__(bits, granularity)
        self.handed: dict[int, list[tuple[int, ...]]] = {}
        self.maps = {}

    def transform_logits(self, layer_index, logits, visible):
        self.handed.setdefault(layer_index, []).append(tuple(logits.shape))
        return super().transform_logits(layer_index, logits, visible)

    def record(self, layer_index, maps):
        self.maps[layer_index] = maps


@pytest.mark.parametrize("granularity", quantization.GRANULARITIES)
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_quantisation_rewrites_every_map(kind, granularity):
    """Each map the kind computes is handed to the quantiser once; the logits the softmax read are each the
    oracle's logits rounded to the nearest of the 4-bit levels (the absmax of each visible row, or of each
    head's map, over 7); the output is the one those quantised maps give, and leaving any one map
    unquantised would give another."""
    levels = 2 ** (4 - 1) - 1
    tap = WatchedQuantizeTap(4, granularity)
    model, seen = forward(kind, tap)
    for i, layer in enumerate(model.layers):
        x, out = seen[i]
        exact = exact_maps(model, seen, i, untransformed=False)
        assert tap.handed[i] == [tuple(m.shape) for m in exact]
        used = [m.double() for m in tap.maps[i].logits]
        assert [m.shape for m in used] == [m.shape for m in exact]
        for j, (got, want) in enumerate(zip(used, exact)):
            dims = (-1,) if granularity == "row" else (-2, -1)
            # the top level is the absmax itself, so the quantised logits give their own step
            step = got.abs().masked_fill(~CAUSAL, 0.0).amax(dim=dims, keepdim=True) / levels
            units = (got / step)[..., CAUSAL]
            assert (units - units.round()).abs().max() < 1e-4, f"map {j} of layer {i} is off the 4-bit levels"
            error = ((got - want).abs() - 0.5 * step)[..., CAUSAL]  # within half a step of the exact logit
            assert error.max() < 1e-5 and ((got - want) / step)[..., CAUSAL].abs().max() > 0.05, f"map {j}, layer {i}"
            assert torch.isinf(got[..., ~CAUSAL]).all()  # the future stays hidden
        torch.testing.assert_close(oracle_output(layer.attn, x, used)[1], out, atol=1e-5, rtol=1e-4)
        for j in range(len(used)):
            one_left = [exact[n] if n == j else m for n, m in enumerate(used)]
            assert (oracle_output(layer.attn, x, one_left)[1] - out).abs().max() > 1e-3, f"map {j} of layer {i}"


# --- the readers -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_outliers_read_every_maps_logits(kind):
    """The logit statistics are those of every visible logit of every map of every layer: the count, the
    top values, the median, each layer's and each window's largest."""
    stats = outliers.MagnitudeStats(1.0, seed=0)
    model, seen = forward(kind, outliers.LogitTap(stats))
    summary = stats.summary()
    layers = [exact_maps(model, seen, i) for i in range(model.config.n_layers)]
    per_layer = [torch.cat([m[..., CAUSAL].abs().flatten() for m in maps]) for maps in layers]
    everything = torch.cat(per_layer).sort(descending=True).values
    assert summary["count"] == everything.numel() == 2 * B * sum(MAP_HEADS[kind]) * T * (T + 1) // 2
    for rank in outliers.RANKS:
        assert summary[f"top{rank}"] == pytest.approx(float(everything[rank - 1]), rel=1e-5)
    assert summary["median"] == pytest.approx(float(everything.flip(0)[(everything.numel() - 1) // 2]), rel=1e-5)
    assert summary["per_layer_top1"] == pytest.approx([float(v.max()) for v in per_layer], rel=1e-5)
    windows = [max(float(m[b][..., CAUSAL].abs().max()) for m in maps) for b in range(B) for maps in layers]
    assert sum(summary["per_window_layer_top1"], []) == pytest.approx(windows, rel=1e-5)  # (windows, layers)


def noise_groups() -> list[dict[str, torch.Tensor]]:
    """Each key of each sequence in one of the three column groups, at random."""
    picks = torch.randint(0, 3, (B, T), generator=torch.Generator().manual_seed(2))
    return [{g: picks[b] == n for n, g in enumerate(attention_noise.GROUPS)} for b in range(B)]


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_attention_noise_reads_every_map(kind):
    """Each layer's mass per column group over the chosen rows is that of the oracle's effective map
    (head mean, rows divided by their sums, a row below MIN_ROW_SUM left out)."""
    rows, groups = [[3, 9, 15], [6, 12]], noise_groups()
    tap = attention_noise.GroupMassTap(rows, groups, n_layers=2)
    model, seen = forward(kind, tap)
    stacked = torch.stack([torch.stack([g[k] for k in attention_noise.GROUPS]) for g in groups]).double()

    def read(combined):  # (3,) mass and the count of rows kept
        mean = combined.mean(dim=1)
        mass, kept = torch.zeros(3, dtype=torch.float64), 0
        for b, picked in enumerate(rows):
            sums = mean[b, picked].sum(-1)
            usable = sums >= attention_noise.MIN_ROW_SUM
            mass += ((mean[b, picked][usable] / sums[usable, None]) @ stacked[b].T).sum(0)
            kept += int(usable.sum())
        return torch.cat([mass, torch.tensor([float(kept)], dtype=torch.float64)])

    for i in range(model.config.n_layers):
        got = torch.cat([tap.mass[i].double(), tap.count[i : i + 1].double()])
        assert_every_map_read(read, got, model, seen, i)


@pytest.mark.parametrize("prefill", [0, 8], ids=["full", "kv-cache"])
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_lookback_reads_every_map(kind, prefill):
    """Each head's lookback ratio at each probe is C / (C + N) of the oracle's effective map: the mean
    magnitude before the context end against the mean from there to the row's own position. In one
    forward (the grounded task) and continuing a KV cache filled on the fast path (context-qa)."""
    probes = [[(9, 4), (15, 6)], [(12, 3)]]
    tap = lookback.LookbackTap(probes)
    model, seen = forward(kind, tap, prefill)
    heads = model.config.n_heads

    def read(combined):  # (H, 3): every probe of both sequences
        ratios = []
        for b, ps in enumerate(probes):
            for position, end in ps:
                row = combined[b, :, position].abs()
                context, new = row[:, :end].mean(-1), row[:, end : position + 1].mean(-1)
                ratios.append(context / (context + new))
        return torch.stack(ratios, dim=1)

    for i in range(model.config.n_layers):
        assert [tuple(r.shape) for r in tap.ratios[i]] == [(heads, len(ps)) for ps in probes]
        assert_every_map_read(read, torch.cat(tap.ratios[i], dim=1), model, seen, i)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_attention_sink_reads_every_map(kind):
    """Each window's first-token share is that of the oracle's effective map (head mean, rows from query 1
    on divided by their sums, a row below MIN_ROW_SUM left out)."""
    tap = attention_sink.FirstTokenShareTap()
    model, seen = forward(kind, tap)

    def read(combined):  # (B,)
        rows = combined.mean(dim=1)[:, 1:]
        sums = rows.sum(-1)
        kept = sums >= attention_noise.MIN_ROW_SUM
        return torch.where(kept, rows[..., 0] / sums, 0.0).sum(-1) / kept.sum(-1)

    for i in range(model.config.n_layers):
        assert_every_map_read(read, tap.shares[i], model, seen, i)
