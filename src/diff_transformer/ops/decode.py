"""Differential attention for one new token per sequence against a KV cache (the "decode" backend).

    p   = softmax(q1 K1ᵀ s) − λ · softmax(q2 K2ᵀ s)      (B, H, 1, S), fp32
    out = p V                                            (B, H, 1, 2d), one product with V

Each cached K1, K2 and V is read once per token: the query heads that share a KV head (GQA)
become the rows of one matrix product instead of repeating the cache, and V is multiplied once
by the combined map rather than once per map. Plain PyTorch: it runs on any device and under
torch.compile.

Two entry points share the softmax-combine-V tail: :func:`decode_diff_attention` takes the op's
separate q1, q2, k1, k2; :func:`decode_diff_attention_packed` takes the model's own layout
(sub-heads 2h, 2h+1 interleaved, as DiffAttention projects and caches them), where both maps
come out of a single product — fewer operator calls per layer, which cost about half of a
decoding step on small models (the other half is matrix products).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _combine_maps_and_read_v(
    logits: Tensor, v: Tensor, lam: Tensor, attn_mask: Tensor | None, scale: float, out_dtype: torch.dtype
) -> Tensor:
    """logits (B·Hkv·2, n_rep, S) unscaled and fresh (scaled in place): row r of batch (b, g, c) is
    map c of query head g·n_rep + r. -> (B, H, 1, 2d). Products on 3-D views, and no call that
    changes nothing: operator calls cost about half of a decoding step on a small model."""
    b, hkv, s, width = v.shape
    n_rep = logits.shape[1]
    logits = logits.mul_(scale) if logits.dtype == torch.float32 else logits.float().mul_(scale)
    if attn_mask is not None:  # broadcastable to (B, H, 1, S), True = may attend
        hidden = ~attn_mask.expand(b, hkv * n_rep, 1, s).reshape(b, hkv, 1, n_rep, s)
        logits = logits.view(b, hkv, 2, n_rep, s).masked_fill(hidden, float("-inf"))
    probs1, probs2 = torch.softmax(logits, dim=-1).view(b, hkv, 2, n_rep, s).unbind(2)
    lam = lam.float().reshape(hkv, n_rep, 1) if lam.dim() else lam.float()
    combined = torch.addcmul(probs1, probs2, lam, value=-1.0)  # (B, Hkv, n_rep, S)
    if combined.dtype != v.dtype:
        combined = combined.to(v.dtype)
    out = torch.bmm(combined.view(b * hkv, n_rep, s), v.reshape(b * hkv, s, width))  # (B·Hkv, n_rep, 2d)
    out = out.view(b, hkv * n_rep, 1, width)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _check_single_query(t: int) -> None:
    if t != 1:
        raise ValueError(
            f"backend 'decode' takes one query per sequence (T = 1), got T={t}; "
            "use backend='auto', which picks 'decode' only for single queries"
        )


def decode_diff_attention(
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
    """q1, q2 (B, H, 1, d); k1, k2 (B, Hkv, S, d); v (B, Hkv, S, 2d); lam 0-d or (H,).

    ``causal`` changes nothing here: the single query sits at the last position and sees every
    cached key. ``attn_mask`` (broadcastable to (B, H, 1, S), True = may attend) hides padding.
    Returns (B, H, 1, 2d) in q1's dtype.
    """
    b, h, t, d = q1.shape
    _check_single_query(t)
    hkv = k1.shape[1]
    # (B, H, 1, d) -> (B, Hkv, n_rep, d): query head h = g * n_rep + r reads KV head g.
    logits1 = torch.matmul(q1.reshape(b, hkv, h // hkv, d), k1.transpose(-1, -2))  # (B, Hkv, n_rep, S)
    logits2 = torch.matmul(q2.reshape(b, hkv, h // hkv, d), k2.transpose(-1, -2))
    logits = torch.stack([logits1, logits2], dim=2)  # (B, Hkv, 2, n_rep, S)
    return _combine_maps_and_read_v(logits.flatten(0, 2), v, lam, attn_mask, d**-0.5 if scale is None else scale,
                                    q1.dtype)


def decode_diff_attention_packed(
    q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, attn_mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """The model's layout: q (B, 2H, 1, d) with Q1, Q2 of DIFF head h at sub-heads 2h, 2h+1;
    k (B, 2Hkv, S, d) with K1, K2 of group g at 2g, 2g+1; v (B, Hkv, S, 2d) -> (B, H, 1, 2d)."""
    b, two_h, t, d = q.shape
    _check_single_query(t)
    hkv, s = k.shape[1] // 2, k.shape[2]
    n_rep = two_h // (2 * hkv)
    # (B, 2H, 1, d) -> (B·Hkv·2, n_rep, d): batch (b, g, c) holds sub-head c of heads g·n_rep + r;
    # k (B, 2Hkv, S, d) -> (B·Hkv·2, S, d), a view of the cache.
    if n_rep == 1:
        q = q.reshape(b * two_h, 1, d)  # a view
    else:
        q = q.reshape(b, hkv, n_rep, 2, d).transpose(2, 3).reshape(b * hkv * 2, n_rep, d)
    logits = torch.bmm(q, k.reshape(b * hkv * 2, s, d).transpose(1, 2))  # both maps in one product
    return _combine_maps_and_read_v(logits, v, lam, attn_mask, d**-0.5 if scale is None else scale, q.dtype)
