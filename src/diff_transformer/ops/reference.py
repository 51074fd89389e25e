"""Readable reference attention: materialises the T x S maps in fp32.

Every fast backend is tested against these functions. They are also the only path that can
hand the maps and the pre-softmax logits to the evaluation suite (``return_maps=True``) or let
it rewrite the logits before the softmax (``logits_transform``, used for quantisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# (logits (B, H, T, S) fp32, visible (.., T, S) bool or None) -> new logits of the same shape.
LogitsTransform = Callable[[Tensor, Tensor | None], Tensor]


@dataclass
class AttentionMaps:
    """What one attention call looked at, all (B, H, T, S) fp32.

    ``logits`` are the scaled pre-softmax scores (one tensor for standard attention, two for
    differential attention); ``probs`` the softmax maps; ``combined`` the effective map that
    multiplies V: ``probs[0]`` for standard attention, ``probs[0] - lam * probs[1]`` for DIFF.
    Masked positions hold -inf in ``logits`` and 0 in ``probs``. Grouped differential attention:
    the second maps have one head per noise head (N, not H), and ``combined`` pairs each signal
    head with its noise head's map.
    """

    logits: tuple[Tensor, ...]
    probs: tuple[Tensor, ...]
    combined: Tensor


def visible_mask(
    t: int, s: int, *, causal: bool, attn_mask: Tensor | None, device: torch.device
) -> Tensor | None:
    """Boolean mask (.., T, S), True where a query may attend to a key, or None for all-visible.

    The causal mask is aligned to the end: query i sits at absolute position S - T + i, which is
    what a KV cache holding S - T earlier tokens needs.
    """
    mask = None
    if causal and t > 1:  # a single query at the end sees every key
        mask = torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)
    if attn_mask is not None:
        mask = attn_mask if mask is None else mask & attn_mask
    return mask


def _masked_softmax(
    logits: Tensor, mask: Tensor | None, logits_transform: LogitsTransform | None
) -> tuple[Tensor, Tensor]:
    if logits_transform is not None:
        logits = logits_transform(logits, mask)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits, torch.softmax(logits, dim=-1)


def _expand_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, S, w) -> (B, Hkv * n_rep, S, w): query head h reads KV head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    logits_transform: LogitsTransform | None = None,
) -> tuple[Tensor, AttentionMaps]:
    """softmax(q kᵀ * scale) v. q (B, H, T, d), k (B, Hkv, S, d), v (B, Hkv, S, dv)."""
    n_rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    mask = visible_mask(q.shape[2], k.shape[2], causal=causal, attn_mask=attn_mask, device=q.device)
    logits, probs = _masked_softmax((q.float() @ k.float().transpose(-1, -2)) * scale, mask, logits_transform)
    out = probs @ v.float()
    return out.to(q.dtype), AttentionMaps(logits=(logits,), probs=(probs,), combined=probs)


def check_diff_inputs(q1, q2, k1, k2, v, lam, causal: bool) -> None:
    """A TypeError / ValueError naming the argument and its shape unless q1, q2 (B, H, T, d),
    k1, k2 (B, Hkv, S, d), v (B, Hkv, S, 2d) and lam (0-d or (H,)) fit together, with T, S >= 1.
    v may also be (B, Hkv, S, d): a Transformer's heads converted to DIFF (``value_factor=1``)."""
    named = {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": v}
    for name, x in named.items():
        if not isinstance(x, Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, heads, length, width), got {shape}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
        if x.dtype != q1.dtype or x.device != q1.device:
            raise TypeError(f"{name} is {x.dtype} on {x.device} but q1 is {q1.dtype} on {q1.device}")
    b, h, t, d = q1.shape
    bk, hkv, s, dk = k1.shape
    if q2.shape != q1.shape:
        raise ValueError(f"q2 shape {tuple(q2.shape)} != q1 shape {tuple(q1.shape)}")
    if k2.shape != k1.shape:
        raise ValueError(f"k2 shape {tuple(k2.shape)} != k1 shape {tuple(k1.shape)}")
    if bk != b or dk != d:
        raise ValueError(f"k1 {tuple(k1.shape)} must be (B={b}, Hkv, S, d={d}) to match q1 {tuple(q1.shape)}")
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads Hkv={hkv}")
    if v.shape not in ((b, hkv, s, 2 * d), (b, hkv, s, d)):
        raise ValueError(f"v must be (B, Hkv, S, 2d) = {(b, hkv, s, 2 * d)} (or (B, Hkv, S, d) = {(b, hkv, s, d)}), "
                         f"got {tuple(v.shape)}")
    if t == 0 or s == 0:
        raise ValueError(f"q1 has {t} queries and k1 {s} keys: both need at least one")
    if causal and t > s:
        raise ValueError(f"causal attention needs T <= S, got T={t} queries and S={s} keys")
    if not isinstance(lam, Tensor) or not lam.is_floating_point():
        raise TypeError(f"lam must be a floating-point tensor, 0-d or (H,), got {type(lam).__name__}")
    if lam.dim() != 0 and lam.shape != (h,):
        raise ValueError(f"lam must be 0-d or shape (H,) = ({h},), got {tuple(lam.shape)}")



def reference_diff_attention(
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
    logits_transform: LogitsTransform | None = None,
) -> tuple[Tensor, AttentionMaps]:
    """(softmax(q1 k1ᵀ s) - lam * softmax(q2 k2ᵀ s)) v, with s = 1/sqrt(d) by default.

    q1, q2 (B, H, T, d); k1, k2 (B, Hkv, S, d); v (B, Hkv, S, 2d) (or d wide); lam 0-d or (H,).
    Returns the (B, H, T, 2d) output (v's width) in q's dtype, before the per-head norm, and the maps.
    The inputs are checked as :func:`~diff_transformer.ops.diff_attention` checks them.
    """
    check_diff_inputs(q1, q2, k1, k2, v, lam, causal)
    n_rep = q1.shape[1] // k1.shape[1]
    scale = q1.shape[-1] ** -0.5 if scale is None else scale
    mask = visible_mask(q1.shape[2], k1.shape[2], causal=causal, attn_mask=attn_mask, device=q1.device)
    logits1, p1 = _masked_softmax(
        (q1.float() @ _expand_kv(k1, n_rep).float().transpose(-1, -2)) * scale, mask, logits_transform
    )
    logits2, p2 = _masked_softmax(
        (q2.float() @ _expand_kv(k2, n_rep).float().transpose(-1, -2)) * scale, mask, logits_transform
    )
    lam = lam.float().reshape(-1, 1, 1) if lam.dim() else lam.float()  # (H, 1, 1) broadcasts over B
    combined = p1 - lam * p2
    out = combined @ _expand_kv(v, n_rep).float()
    return out.to(q1.dtype), AttentionMaps(logits=(logits1, logits2), probs=(p1, p2), combined=combined)


def check_gda_inputs(q1, q2, k1, k2, v, lam, causal: bool) -> None:
    """As :func:`check_diff_inputs`, with the noise queries q2 (B, N, T, d): N a divisor of the
    signal heads H and a multiple of the key/value heads Hkv (a signal head and its noise head
    read the same K/V group)."""
    check_diff_inputs(q1, q1, k1, k2, v, lam, causal)  # everything but q2, which has its own head count
    if not isinstance(q2, Tensor) or q2.dim() != 4:
        shape = tuple(q2.shape) if isinstance(q2, Tensor) else type(q2).__name__
        raise ValueError(f"q2 must be a 4-D tensor (B, noise heads, length, width), got {shape}")
    if q2.dtype != q1.dtype or q2.device != q1.device:
        raise TypeError(f"q2 is {q2.dtype} on {q2.device} but q1 is {q1.dtype} on {q1.device}")
    b, h, t, d = q1.shape
    n, hkv = q2.shape[1], k1.shape[1]
    if (q2.shape[0], q2.shape[2], q2.shape[3]) != (b, t, d) or n == 0 or h % n or n % hkv:
        raise ValueError(f"q2 {tuple(q2.shape)} must be (B={b}, N, T={t}, d={d}) with N dividing the signal heads "
                         f"H={h} and a multiple of the key/value heads Hkv={hkv}")


def _noise_to_signal(x: Tensor, h: int) -> Tensor:
    """(B, N, ...) per noise head -> (B, H, ...) per signal head: signal head g·r + j takes noise head g."""
    return x if x.shape[1] == h else x.repeat_interleave(h // x.shape[1], dim=1)


def reference_gda_attention(
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
    logits_transform: LogitsTransform | None = None,
) -> tuple[Tensor, AttentionMaps]:
    """Grouped differential attention: (softmax(q1_i k1ᵀ s) − lam · softmax(q2_g k2ᵀ s)) v for every
    signal head i, paired with noise head g = i // r (r = H / N), s = 1/sqrt(d) by default.

    q1 (B, H, T, d) signal queries; q2 (B, N, T, d) noise queries; k1, k2 (B, Hkv, S, d); v
    (B, Hkv, S, 2d); lam 0-d or (H,); ``attn_mask`` broadcastable to (B, 1, T, S) (one mask for
    every head: noise heads serve several signal heads). Returns the (B, H, T, 2d) output in q's
    dtype, before the head norm, and the maps: p1 (B, H, T, S), p2 (B, N, T, S), combined (B, H, T, S).
    """
    check_gda_inputs(q1, q2, k1, k2, v, lam, causal)
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] != 1:
        raise ValueError(f"attn_mask {tuple(attn_mask.shape)}: grouped differential attention takes one mask for "
                         "every head (B, 1, T, S), since a noise head serves several signal heads")
    h, n, hkv = q1.shape[1], q2.shape[1], k1.shape[1]
    scale = q1.shape[-1] ** -0.5 if scale is None else scale
    mask = visible_mask(q1.shape[2], k1.shape[2], causal=causal, attn_mask=attn_mask, device=q1.device)
    logits1, p1 = _masked_softmax(
        (q1.float() @ _expand_kv(k1, h // hkv).float().transpose(-1, -2)) * scale, mask, logits_transform
    )
    logits2, p2 = _masked_softmax(
        (q2.float() @ _expand_kv(k2, n // hkv).float().transpose(-1, -2)) * scale, mask, logits_transform
    )
    lam = lam.float().reshape(-1, 1, 1) if lam.dim() else lam.float()  # (H, 1, 1) broadcasts over B
    combined = p1 - lam * _noise_to_signal(p2, h)
    out = combined @ _expand_kv(v, h // hkv).float()
    return out.to(q1.dtype), AttentionMaps(logits=(logits1, logits2), probs=(p1, p2), combined=combined)
