"""The "math" backend: both maps materialised once, V read once, a hand-written backward.

    P_c = softmax(Q_c K_cᵀ s + bias)      c = 1, 2      (B, G, R, 2, T, S) fp32, one product
    A   = P_1 − λ P_2                                   (B, G, R, T, S)
    out = A V                                           (B, G, R, T, 2d), one product with V

G key/value groups, R query heads per group (GQA without copying K or V: the R dimension
broadcasts). Against the flash-style split it does half the products with V and half the
exponentials (each map is computed once, not once per half of V), at the price of keeping the
maps for the backward: memory O(T·S), which is why "auto" uses it on CPU only, up to
``MATH_MAX_KEYS`` keys.

The queries go through in tiles of rows, sized so that one tile's maps stay in the CPU's
caches while softmax, combine and product pass over them (``tile_rows``). A causal tile needs
only the keys up to its last query: the key blocks above the diagonal are never computed, and
only the tiles' maps are kept for the backward.

The backward needs no autograd graph over the maps. With dA = dO Vᵀ and r_c = rowsum(P_c ⊙ dA):
    dV = Aᵀ dO      (A recomputed from the kept maps, in cache)
    dS_1 = P_1 ⊙ (dA − r_1),   dS_2 = −λ P_2 ⊙ (dA − r_2)     (softmax backward, λ factored out)
    dQ_c = s dS_c K_c,   dK_c = s dS_cᵀ Q_c,   dλ = −Σ r_2      (summed per head for a per-head λ)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import visible_mask

# One tile's fp32 maps (every batch row and head, its query rows, its keys) are kept about this
# size: small enough that the passes over a tile stay in the caches (this machine: 1 MiB L2 per
# core, 32 MiB shared L3), large enough that the per-tile calls stay few. Measured on the tiny
# model's training step, 2–8 MiB were within noise of each other, 4 MiB ahead; 1 MiB was slower
# than no tiles (BENCHMARKS.md).
TILE_BYTES = 4 << 20
MIN_TILE_ROWS = 16  # a floor: 16-row tiles at tiny (1 MiB) were already slower than no tiles


def tile_rows(maps: int, keys: int, queries: int) -> int:
    """Query rows per tile for ``maps`` (T, S) maps: the fewest tiles of at most about TILE_BYTES
    of fp32 each (or MIN_TILE_ROWS rows), all of the same height but the last."""
    most = max(MIN_TILE_ROWS, TILE_BYTES // (4 * maps * keys))
    tiles = -(-queries // most)
    return -(-queries // tiles)


def _tiles(t: int, s: int, rows: int, causal: bool) -> list[tuple[int, int, int]]:
    """(first row, end row, end key) per tile; a causal query i sees keys up to S − T + i."""
    return [(t0, min(t, t0 + rows), min(t, t0 + rows) + s - t if causal else s) for t0 in range(0, t, rows)]


def _bias_tile(bias: Tensor | None, t0: int, t1: int, e: int) -> Tensor | None:
    """The tile's rows (unless the bias broadcasts over T) and first e keys."""
    if bias is None:
        return None
    return bias[..., :e] if bias.shape[-2] == 1 else bias[..., t0:t1, :e]


class _MaterializedDiffAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lam, bias, scale: float, causal: bool) -> Tensor:
        """q (B, G, R, 2, T, d); k (B, G, 1, 2, S, d); v (B, G, 1, S, 2d); lam (G, R, 1, 1) or 0-d
        fp32; bias additive fp32 broadcastable to (B, G, R, 2, T, S) or None -> (B, G, R, T, 2d)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # copied once, for every tile's products
        b, g, r, _, t, d = q.shape
        s = k.shape[-2]
        tiles = _tiles(t, s, tile_rows(b * g * r * 2, s, t), causal)
        one_call = bias is not None and bias.dim() == 2 and q.dtype == torch.float32 and r == 1
        keep = any(ctx.needs_input_grad)  # the maps are kept for a backward only: without one, a tile at a time
        outs, probs = [], []
        for t0, t1, e in tiles:
            qt, kt, bt = q[..., t0:t1, :], k[..., :e, :], _bias_tile(bias, t0, t1, e)
            if one_call:  # causal, one query head per group: scale, product and mask in one call
                logits = torch.baddbmm(bt, qt.flatten(0, 3), kt.flatten(0, 3).transpose(-1, -2), alpha=scale)
                logits = logits.view(b, g, r, 2, t1 - t0, e)
            else:
                logits = torch.matmul(qt, kt.transpose(-1, -2)).float()  # (B, G, R, 2, rows, e)
                logits = logits.mul_(scale) if bt is None else torch.add(bt, logits, alpha=scale)
            p = torch.softmax(logits, dim=-1)
            combined = torch.addcmul(p[:, :, :, 0], p[:, :, :, 1], lam, value=-1.0).to(v.dtype)
            outs.append(torch.matmul(combined, v[..., :e, :]))
            if keep:
                probs.append(p)
        ctx.save_for_backward(q, k, v, lam, *probs)
        ctx.scale, ctx.tiles = scale, tiles
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, lam, *probs = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.empty_like(q), None, None
        # per (group, head, map) factor s and −λ s, (G, R, 2, 1, 1)
        lam4 = lam.reshape(1, 1, 1, 1) if lam.dim() == 0 else lam
        coef = (torch.stack([torch.ones_like(lam4), -lam4], dim=2) * ctx.scale).to(q.dtype)
        rows2 = []
        # The last tile reaches every key: going backwards, it sets dK and dV and the others add to them.
        for (t0, t1, e), p in zip(reversed(ctx.tiles), reversed(probs)):
            go = grad_out[..., t0:t1, :].contiguous()  # a tile's rows: copied once here, not in each product
            qt, kt, vt = q[..., t0:t1, :], k[..., :e, :], v[..., :e, :]
            combined = torch.addcmul(p[:, :, :, 0], p[:, :, :, 1], lam, value=-1.0).to(v.dtype)
            grad_v = _add_keys(grad_v, _sum_heads(torch.matmul(combined.transpose(-1, -2), go)))
            grad_a = torch.matmul(go, vt.transpose(-1, -2)).float().unsqueeze(3)  # (B, G, R, 1, rows, e)
            grad_s = p * grad_a  # (B, G, R, 2, rows, e)
            rows = grad_s.sum(-1, keepdim=True)  # r_c
            grad_s.addcmul_(p, rows, value=-1.0)  # P_c ⊙ (dA − r_c); map 2's −λ is in coef
            grad_s = grad_s.to(q.dtype)
            # no out= into a strided tile: compile traces it
            grad_q[..., t0:t1, :] = torch.matmul(grad_s, kt).mul_(coef)
            grad_k = _add_keys(grad_k, _sum_heads(torch.matmul(grad_s.transpose(-1, -2), qt) * coef))
            rows2.append(rows[:, :, :, 1])  # (B, G, R, rows, 1)
        r2 = torch.cat(rows2, dim=-2)
        grad_lam = -(r2.sum() if lam.dim() == 0 else r2.sum(dim=(0, 3, 4)).reshape(lam.shape))
        return grad_q, grad_k, grad_v, grad_lam, None, None, None


def _sum_heads(x: Tensor) -> Tensor:
    """Sum over the R query heads that share a key/value group (dim 2), kept as size 1."""
    return x if x.shape[2] == 1 else x.sum(2, keepdim=True)


def _add_keys(total: Tensor | None, part: Tensor) -> Tensor:
    """Add a tile's gradient for the first e keys into the total (the first tile seen sets it)."""
    if total is None:
        return part
    total[..., : part.shape[-2], :].add_(part)  # not `+=`, whose item assignment copies the slice onto itself
    return total


def _additive_bias(mask: Tensor | None, g: int, r: int) -> Tensor | None:
    """A bool mask (T, S) or (B|1, H|1, T, S) -> fp32 0 / -inf, (T, S) or (B|1, G|1, R|1, 1, T, S)."""
    if mask is None:
        return None
    if mask.dim() > 2:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mask = mask.unflatten(1, (g, r) if mask.shape[1] > 1 else (1, 1)).unsqueeze(3)
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def materialized_diff_attention_grouped(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """q (B, G, R, 2, T, d), k (B, G, 1, 2, S, d), v (B, G, 1, S, 2d), lam 0-d or (H = G·R,)
    -> (B, H, T, 2d). ``causal`` and ``attn_mask`` (broadcastable to (B, H, T, S)) as in
    :func:`diff_transformer.ops.diff_attention`."""
    b, g, r, _, t, d = q.shape
    s = k.shape[-2]
    if causal and attn_mask is None and t > 1:  # the usual case: -inf above the end-aligned diagonal
        bias = torch.full((t, s), float("-inf"), device=q.device).triu_(s - t + 1)
    else:
        bias = _additive_bias(visible_mask(t, s, causal=causal, attn_mask=attn_mask, device=q.device), g, r)
    lam = lam.float()
    lam = lam.reshape(g, r, 1, 1) if lam.dim() else lam
    out = _MaterializedDiffAttention.apply(q, k, v, lam, bias, d**-0.5 if scale is None else scale, causal)
    return out.flatten(1, 2)


def materialized_diff_attention(
    q1: Tensor,
    q2: Tensor,
    k1: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The "math" backend on the op's separate groups: q1, q2 (B, H, T, d); k1, k2 (B, Hkv, S, d);
    v (B, Hkv, S, 2d) -> (B, H, T, 2d)."""
    g = k1.shape[1]
    q = torch.stack([q1, q2], dim=2).unflatten(1, (g, -1))  # (B, G, R, 2, T, d)
    k = torch.stack([k1, k2], dim=2).unsqueeze(2)  # (B, G, 1, 2, S, d)
    return materialized_diff_attention_grouped(
        q, k, v.unsqueeze(2), lam, causal=causal, attn_mask=attn_mask, scale=scale
    )
