"""diff_attention and attention: every backend against the reference, forward and gradients."""

import math

import pytest
import torch

from diff_transformer.ops import (
    attention,
    diff_attention,
    diff_attention_packed,
    materialized,
    reference_diff_attention,
)

FAST_BACKENDS = ["sdpa", "sdpa_split", "math"]
TOL = 1e-5  # fp32, absolute, outputs and gradients

# (B, H, Hkv, T, S, d): MHA, GQA, T < S (KV cache), odd lengths, a single query
CASES = [
    (2, 4, 4, 17, 17, 16),
    (1, 4, 2, 33, 33, 8),
    (2, 6, 3, 5, 23, 16),
    (1, 2, 1, 1, 9, 8),
    (2, 4, 1, 31, 31, 32),
]


def make_inputs(b, h, hkv, t, s, d, *, per_head_lambda=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(b * 1000 + h * 100 + t * 10 + s)
    q1, q2 = (torch.randn(b, h, t, d, generator=g, dtype=dtype) for _ in range(2))
    k1, k2 = (torch.randn(b, hkv, s, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, hkv, s, 2 * d, generator=g, dtype=dtype)
    lam = (torch.rand(h, generator=g) if per_head_lambda else torch.tensor(0.37)).to(dtype)
    return [x.requires_grad_() for x in (q1, q2, k1, k2, v, lam)]


def assert_grads_close(ref_inputs, fast_inputs):
    """The gradients of q1, q2, k1, k2, v and λ agree to TOL, relative to the largest reference entry."""
    for name, a, b in zip(["q1", "q2", "k1", "k2", "v", "lam"], ref_inputs, fast_inputs):
        err = (a.grad - b.grad).abs().max().item()
        assert err < TOL * max(1.0, a.grad.abs().max().item()), f"grad {name}: {err}"


def naive_diff_attention(q1, q2, k1, k2, v, lam, causal=True, mask=None):
    """The paper's formula head by head with Python loops: an oracle for the reference itself."""
    b, h, t, d = q1.shape
    hkv, s = k1.shape[1], k1.shape[2]
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hkv)
            a1 = q1[bi, hi].double() @ k1[bi, g].double().T / math.sqrt(d)
            a2 = q2[bi, hi].double() @ k2[bi, g].double().T / math.sqrt(d)
            visible = torch.ones(t, s, dtype=torch.bool)
            if causal:
                visible &= torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
            if mask is not None:
                visible &= mask[bi, hi if mask.shape[1] > 1 else 0]
            a1 = a1.masked_fill(~visible, float("-inf")).softmax(-1)
            a2 = a2.masked_fill(~visible, float("-inf")).softmax(-1)
            lam_h = lam[hi] if lam.dim() else lam
            out[bi, hi] = (a1 - lam_h.double() * a2) @ v[bi, g].double()
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_head_lambda", [False, True])
def test_reference_matches_the_formula_head_by_head(case, per_head_lambda):
    inputs = make_inputs(*case, per_head_lambda=per_head_lambda)
    out = diff_attention(*inputs, backend="reference")
    expected = naive_diff_attention(*inputs)
    assert out.shape == expected.shape
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_head_lambda", [False, True])
def test_backend_matches_reference_forward_and_gradients(backend, case, per_head_lambda):
    ref_inputs = make_inputs(*case, per_head_lambda=per_head_lambda)
    fast_inputs = make_inputs(*case, per_head_lambda=per_head_lambda)
    ref = diff_attention(*ref_inputs, backend="reference")
    out = diff_attention(*fast_inputs, backend=backend)
    assert out.shape == ref.shape == (case[0], case[1], case[3], 2 * case[5])
    assert (out - ref).abs().max().item() < TOL
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    out.backward(grad_out)
    assert_grads_close(ref_inputs, fast_inputs)


@pytest.mark.parametrize("backend", [*FAST_BACKENDS, "auto"])
@pytest.mark.parametrize("case", [(2, 4, 2, 9, 9, 8), (1, 6, 2, 4, 11, 16), (2, 4, 2, 1, 1, 8), (1, 4, 1, 1, 7, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_packed_layout_matches_the_reference_forward_and_gradients(backend, case, causal):
    """diff_attention_packed (the model's interleaved sub-heads, GQA, a padding mask), causal or not,
    against the reference on the separate groups, outputs and gradients of q, k, v and λ. A single
    query (T = 1) goes to the decode path under "auto", which is right causal or not: the one query
    sees every key either way."""
    b, h, hkv, t, s, d = case
    q1, q2, k1, k2, v, lam = make_inputs(*case)
    q = torch.stack([q1, q2], dim=2).flatten(1, 2).detach().requires_grad_()  # sub-heads 2h, 2h + 1
    k = torch.stack([k1, k2], dim=2).flatten(1, 2).detach().requires_grad_()
    v_packed, lam_packed = v.detach().requires_grad_(), lam.detach().requires_grad_()
    mask = torch.ones(b, 1, t, s, dtype=torch.bool)
    mask[0, :, :, 1:3] = False  # key 0 stays: every query keeps a visible key
    ref = diff_attention(q1, q2, k1, k2, v, lam, causal=causal, attn_mask=mask, backend="reference")
    out = diff_attention_packed(q, k, v_packed, lam_packed, causal=causal, attn_mask=mask, backend=backend)
    assert (out - ref).abs().max().item() < TOL
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    out.backward(grad_out)
    expected = {
        "q": torch.stack([q1.grad, q2.grad], dim=2).flatten(1, 2),
        "k": torch.stack([k1.grad, k2.grad], dim=2).flatten(1, 2),
        "v": v.grad, "lam": lam.grad,
    }
    for name, got in {"q": q.grad, "k": k.grad, "v": v_packed.grad, "lam": lam_packed.grad}.items():
        err = (got - expected[name]).abs().max().item()
        assert err < TOL * max(1.0, expected[name].abs().max().item()), f"grad {name}: {err}"


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("case", [(2, 4, 2, 9, 9, 8), (1, 4, 1, 6, 11, 16)])
def test_a_value_of_width_d_forward_and_gradients(backend, case):
    """v (B, Hkv, S, d), a Transformer's heads converted to DIFF (value_factor=1): the formula head by
    head, and the gradients of the reference."""
    d = case[-1]
    ref_inputs, fast_inputs = make_inputs(*case), make_inputs(*case)
    for inputs in (ref_inputs, fast_inputs):
        inputs[4] = inputs[4].detach()[..., :d].clone().requires_grad_()
    out = diff_attention(*fast_inputs, backend=backend)
    assert out.shape == (case[0], case[1], case[3], d)
    assert (out.double() - naive_diff_attention(*fast_inputs)).abs().max().item() < TOL
    ref = diff_attention(*ref_inputs, backend="reference")
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    out.backward(grad_out)
    assert_grads_close(ref_inputs, fast_inputs)


@pytest.fixture
def four_row_tiles(monkeypatch):
    """The "math" backend in query tiles of at most 4 rows, so that short sequences cross several."""
    monkeypatch.setattr(materialized, "TILE_BYTES", 1)
    monkeypatch.setattr(materialized, "MIN_TILE_ROWS", 4)


def test_query_tiles_by_hand():
    # tiny's training step: 8 rows x 3 groups x 2 maps, 256 keys: 4 MiB holds 85 rows -> 4 tiles of 64
    assert materialized.TILE_BYTES == 4 << 20
    assert materialized.tile_rows(maps=48, keys=256, queries=256) == 64
    assert materialized.tile_rows(maps=48, keys=256, queries=40) == 40  # one tile
    # at most 16 rows (the floor) -> 7 tiles, evened out to 15 rows (the last of 10)
    assert materialized.tile_rows(maps=1000, keys=4096, queries=100) == 15
    # end-aligned causal: query i of 50 sits at 10 + i of 60 keys, so tile rows [13, 26) need keys [0, 36)
    assert materialized._tiles(50, 60, 13, causal=True) == [(0, 13, 23), (13, 26, 36), (26, 39, 49), (39, 50, 60)]
    assert materialized._tiles(5, 9, 2, causal=False) == [(0, 2, 9), (2, 4, 9), (4, 5, 9)]


@pytest.mark.parametrize("case", [*CASES, (1, 2, 2, 26, 41, 8)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask_kind", [None, "keys", "per-head"])
def test_math_backend_in_query_tiles_matches_the_reference(four_row_tiles, case, causal, mask_kind):
    """Forward and gradients of every input across tiles: the causal key ends, masks that broadcast
    over the queries (B, 1, 1, S) or differ per head, GQA, per-head λ."""
    b, h, hkv, t, s, d = case
    ref_inputs = make_inputs(*case, per_head_lambda=True)
    fast_inputs = make_inputs(*case, per_head_lambda=True)
    mask = None
    if mask_kind == "keys":
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
        mask[0, ..., s // 3 : s // 2] = False  # keeps the first and last keys: no row goes empty
    elif mask_kind == "per-head":
        mask = torch.ones(b, h, t, s, dtype=torch.bool)
        for head in range(h):
            mask[-1, head, :, (head + 1) % s] = False
        mask[..., 0] = True
    ref = diff_attention(*ref_inputs, causal=causal, attn_mask=mask, backend="reference")
    out = diff_attention(*fast_inputs, causal=causal, attn_mask=mask, backend="math")
    assert (out - ref).abs().max().item() < TOL
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    out.backward(grad_out)
    assert_grads_close(ref_inputs, fast_inputs)


@pytest.mark.parametrize("causal", [True, False])
def test_math_backend_in_query_tiles_without_gradients(four_row_tiles, causal):
    """Under no_grad the tiles' maps are not kept (inference): the output is the same."""
    inputs = [x.detach() for x in make_inputs(2, 4, 2, 23, 30 if causal else 23, 8)]
    with torch.no_grad():
        out = diff_attention(*inputs, causal=causal, backend="math")
        ref = diff_attention(*inputs, causal=causal, backend="reference")
    assert (out - ref).abs().max().item() < TOL


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("causal", [True, False])
def test_attn_mask_combines_with_causal(backend, causal):
    b, h, hkv, t, s, d = 2, 6, 2, 7, 12, 8  # three heads per KV group
    inputs = make_inputs(b, h, hkv, t, s, d)
    mask = torch.ones(b, 1, t, s, dtype=torch.bool)
    mask[0, :, :, :3] = False  # batch row 0: three padded keys
    out = diff_attention(*inputs, causal=causal, attn_mask=mask, backend=backend)
    expected = naive_diff_attention(*inputs, causal=causal, mask=mask)
    assert (out.double() - expected).abs().max() < 1e-5
    per_head_mask = mask.repeat(1, h, 1, 1)
    for head in range(h):
        per_head_mask[1, head, :, head] = False  # batch row 1: head j also hides key j
    per_head = diff_attention(*inputs, causal=causal, attn_mask=per_head_mask, backend=backend)
    assert (per_head.double() - naive_diff_attention(*inputs, causal=causal, mask=per_head_mask)).abs().max() < 1e-5


def test_reference_maps_are_consistent():
    q1, q2, k1, k2, v, lam = make_inputs(2, 4, 2, 6, 10, 8)
    out, maps = reference_diff_attention(q1, q2, k1, k2, v, lam)
    p1, p2 = maps.probs
    assert p1.shape == p2.shape == maps.combined.shape == (2, 4, 6, 10)
    torch.testing.assert_close(p1.sum(-1), torch.ones(2, 4, 6), atol=1e-6, rtol=0)
    # each differential row sums to 1 - λ
    torch.testing.assert_close(maps.combined.sum(-1), torch.full((2, 4, 6), 1 - 0.37), atol=1e-6, rtol=0)
    # end-aligned causal: query 0 sits at position 4 and cannot see keys 5..9
    assert torch.isinf(maps.logits[0][..., 0, 5:]).all() and (p1[..., 0, 5:] == 0).all()
    assert torch.isfinite(maps.logits[1][..., -1, :]).all()
    # the maps reproduce the output
    v_rep = v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, maps.combined @ v_rep, atol=1e-6, rtol=0)


def test_logits_transform_is_applied_before_softmax():
    inputs = make_inputs(1, 2, 2, 5, 5, 8)
    _, maps = reference_diff_attention(*inputs, logits_transform=lambda logits, visible: logits * 0)
    # all-zero logits -> uniform over the visible keys: row i has i + 1 keys
    expected = 1.0 / torch.arange(1, 6, dtype=torch.float32)
    torch.testing.assert_close(maps.probs[0][0, 0].max(-1).values, expected)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_standard_attention_matches_naive(backend):
    b, h, hkv, t, s, d = 2, 4, 2, 9, 13, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    out = attention(q, k, v, backend=backend)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    logits = (q @ kr.transpose(-1, -2)) / math.sqrt(d)
    visible = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    expected = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ vr
    assert (out - expected).abs().max() < TOL


def test_input_errors_name_the_problem():
    q1, q2, k1, k2, v, lam = (x.detach() for x in make_inputs(1, 4, 2, 5, 5, 8))
    with pytest.raises(ValueError, match=r"v must be \(B, Hkv, S, 2d\)"):
        diff_attention(q1, q2, k1, k2, v[..., :12], lam)
    with pytest.raises(ValueError, match="q2 shape"):
        diff_attention(q1, q2[:, :2], k1, k2, v, lam)
    with pytest.raises(TypeError, match="k1 is torch.float64"):
        diff_attention(q1, q2, k1.double(), k2, v, lam)
    with pytest.raises(TypeError, match="must be floating point"):
        diff_attention(q1, q2, k1.long(), k2, v, lam)
    with pytest.raises(ValueError, match=r"lam must be 0-d or shape \(H,\)"):
        diff_attention(q1, q2, k1, k2, v, torch.ones(3))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        diff_attention(q1[:, :3], q2[:, :3], k1, k2, v, lam)
    with pytest.raises(ValueError, match="T <= S"):
        diff_attention(q1, q2, k1[:, :, :3], k2[:, :, :3], v[:, :, :3], lam)
    with pytest.raises(ValueError, match="4-D tensor"):
        diff_attention(q1[0], q2, k1, k2, v, lam)
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        diff_attention(q1, q2, k1, k2, v, lam, backend="flash3")
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor"):
        diff_attention(q1, q2, k1, k2, v, lam, attn_mask=torch.ones(5, 5))
    with pytest.raises(ValueError, match="does not broadcast"):
        diff_attention(q1, q2, k1, k2, v, lam, attn_mask=torch.ones(3, 5, dtype=torch.bool))


def test_attention_refuses_a_backend_it_would_not_run():
    """Standard attention runs SDPA or the reference: a DIFF kernel's name is an error naming it, not a
    silent SDPA."""
    from diff_transformer.ops import attention

    q = torch.randn(1, 2, 4, 8)
    for name in ("triton", "math", "sdpa_split", "decode"):
        with pytest.raises(ValueError, match=f"backend '{name}' is a kernel of differential attention"):
            attention(q, q, q, backend=name)
    expected = attention(q, q, q, backend="reference")
    for name in ("auto", "sdpa"):
        torch.testing.assert_close(attention(q, q, q, backend=name), expected, rtol=1e-5, atol=1e-6)
