"""Differential attention from PyTorch's ``scaled_dot_product_attention`` (the paper's appendix).

- ``sdpa_diff_attention`` is FlashDiffAttn_1: two calls, q/k of width d and v of width 2d.
  On CUDA the memory-efficient kernel accepts that; on CPU PyTorch falls back to the math
  kernel, which materialises the T x S map.
- ``sdpa_split_diff_attention`` is FlashDiffAttn_2: v split into halves, four calls of equal
  widths, so PyTorch's flash kernels apply (on CPU too) and memory stays linear in T.
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
    v1, v2 = v.chunk(2, dim=-1)  # (B, Hkv, S, d) each
    kw = dict(causal=causal, attn_mask=attn_mask, scale=scale)
    a1 = torch.cat([sdpa(q1, k1, v1, **kw), sdpa(q1, k1, v2, **kw)], dim=-1)  # (B, H, T, 2d)
    a2 = torch.cat([sdpa(q2, k2, v1, **kw), sdpa(q2, k2, v2, **kw)], dim=-1)
    return a1 - _lam_view(lam, a1) * a2
