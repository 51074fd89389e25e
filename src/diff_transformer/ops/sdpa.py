"""Differential attention from PyTorch's ``scaled_dot_product_attention`` (the paper's appendix).

- ``sdpa_diff_attention`` is FlashDiffAttn_1: two calls, q/k of width d and v of width 2d.
  On CUDA the memory-efficient kernel accepts that; on CPU PyTorch falls back to the math
  kernel, which materialises the T x S map.
- ``sdpa_split_diff_attention`` is FlashDiffAttn_2: v split into halves so that q, k and v have
  equal widths and PyTorch's flash kernels apply (on CPU too), memory staying linear in T. The
  paper's four calls become two by stacking Q1/Q2 and K1/K2 as heads (same arithmetic, half the
  calls); :func:`split_diff_attention_stacked` takes that stacked layout directly.
- ``sdpa_gda_attention`` / ``sdpa_split_gda_attention``: grouped differential attention (N noise
  heads for H signal heads) in the same two ways, each noise map computed once (H + N maps, not 2H),
  as vLLM's GDA backend computes it with flash attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import visible_mask


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    attn_mask: Tensor | None,
    scale: float | None = None,
) -> Tensor:
    """One SDPA call with this project's mask convention (causal aligned to the end, GQA)."""
    t, s = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if causal and attn_mask is None and t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = visible_mask(t, s, causal=causal, attn_mask=attn_mask, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _lam_view(lam: Tensor, like: Tensor) -> Tensor:
    """lam 0-d or (H,) -> broadcastable against (B, H, T, w), in the output's dtype."""
    lam = lam.to(like.dtype)
    return lam.reshape(1, -1, 1, 1) if lam.dim() else lam


def sdpa_diff_attention(
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
    a1 = sdpa(q1, k1, v, causal=causal, attn_mask=attn_mask, scale=scale)  # (B, H, T, 2d)
    a2 = sdpa(q2, k2, v, causal=causal, attn_mask=attn_mask, scale=scale)
    return a1 - _lam_view(lam, a1) * a2


def sdpa_split_diff_attention(
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
    return split_diff_attention_stacked(
        torch.cat([q1, q2], dim=1), torch.cat([k1, k2], dim=1), v, lam, causal=causal, attn_mask=attn_mask, scale=scale
    )


def split_diff_attention_stacked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """FlashDiffAttn_2 on the two groups stacked group-major: q (B, 2H, T, d) = [Q1 heads; Q2 heads],
    k (B, 2Hkv, S, d) = [K1; K2], v (B, Hkv, S, 2d) -> (B, H, T, 2d).

    Two SDPA calls over all 2H heads (one per half of v) instead of four over H: fewer calls and
    no strided per-group slices. In this order SDPA's GQA rule (query head j reads KV head
    j // n_rep) sends Q1 of head h to K1 of group h // n_rep and Q2 to K2, as it must. A v of
    width d (``value_factor=1``) already has q's width: one call.
    """
    h = q.shape[1] // 2
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] == h > 1:
        attn_mask = attn_mask.repeat(1, 2, 1, 1)  # a per-head mask covers both groups of the head
    kw = dict(causal=causal, attn_mask=attn_mask, scale=scale)
    parts = v.chunk(2, dim=-1) if v.shape[-1] == 2 * q.shape[-1] else (v,)
    halves = [sdpa(q, k, part.repeat(1, 2, 1, 1), **kw) for part in parts]  # (B, 2H, T, d) each
    out = torch.cat(halves, dim=-1).unflatten(1, (2, h))  # (B, 2, H, T, 2d): map 1, map 2
    return out[:, 0] - _lam_view(lam, out) * out[:, 1]


def _noise_to_signal(a2: Tensor, h: int) -> Tensor:
    """(B, N, T, w) per noise head -> (B, H, T, w): signal head g·r + j reads noise head g."""
    return a2 if a2.shape[1] == h else a2.repeat_interleave(h // a2.shape[1], dim=1)


def sdpa_gda_attention(
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
    """GDA from two SDPA calls with v of width 2d: signal q1 (B, H, T, d) against K1, noise q2 (B, N, T, d)
    against K2; SDPA's GQA rule reads KV head i // (H / Hkv) and g // (N / Hkv), the same group."""
    a1 = sdpa(q1, k1, v, causal=causal, attn_mask=attn_mask, scale=scale)  # (B, H, T, 2d)
    a2 = sdpa(q2, k2, v, causal=causal, attn_mask=attn_mask, scale=scale)  # (B, N, T, 2d)
    return a1 - _lam_view(lam, a1) * _noise_to_signal(a2, a1.shape[1])


def sdpa_split_gda_attention(
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
    """GDA from SDPA calls of equal widths: v halved, each map against each half (four calls, as
    vLLM's backend), so that flash kernels apply."""
    kw = dict(causal=causal, attn_mask=attn_mask, scale=scale)
    parts = v.chunk(2, dim=-1) if v.shape[-1] == 2 * q1.shape[-1] else (v,)
    a1 = torch.cat([sdpa(q1, k1, part, **kw) for part in parts], dim=-1)  # (B, H, T, 2d)
    a2 = torch.cat([sdpa(q2, k2, part, **kw) for part in parts], dim=-1)  # (B, N, T, 2d)
    return a1 - _lam_view(lam, a1) * _noise_to_signal(a2, a1.shape[1])
