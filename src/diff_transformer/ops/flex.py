"""The "flex" backend: FlexAttention (``torch.nn.attention.flex_attention``) with block masks.

A block mask records, per tile of 128 queries × 128 keys, whether the tile is empty, full or
partly masked: the kernel skips the empty tiles, which for documents packed into one sequence
(``LanguageModel(..., document_ids=...)``) are most of them. Differential attention is two calls
with the same block mask, q of width d and v of width 2d, the difference taken after.

Opt-in (``backend="flex"``; "auto" never picks it): on CUDA it runs the kernel torch.compile
generates, not yet measured on a GPU; on the CPU it runs PyTorch's unfused implementation,
forward only (FlexAttention has no CPU backward), which the tests check against the reference.
Off CUDA, where autograd would need that backward (an input requires grad, grad mode on: a model
in eval mode called without ``torch.no_grad()``), the same attention is computed by SDPA on the
block mask's dense mask, which has one.

``attn_mask`` is a :class:`BlockMask` used as it is (it holds the causal rule itself, as
:func:`document_block_mask` builds it), or a bool mask (True = may attend, with ``causal``: the
ops' convention) from which a block mask is built at each call, or None: causal (cached per shape).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from .reference import visible_mask


@functools.cache
def _compiled_flex_attention():
    """FlexAttention's fused kernel: flex_attention compiled (on CUDA; eagerly it materialises the scores)."""
    return torch.compile(flex_attention, dynamic=False)


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float | None) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cuda" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _dense(q, k, v, block_mask, scale, gqa)  # no CPU backward in FlexAttention
    if q.device.type == "cuda":
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # the unfused path is the CPU's on purpose: no advice to compile it
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _dense(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float | None, gqa: bool) -> Tensor:
    """What FlexAttention computes, by SDPA on the dense mask (B|1, H|1, T, S) of ``block_mask``'s
    mask_mod (None: every key visible), with a backward on every device."""
    mask = None
    if block_mask is not None:
        batches, heads = block_mask.kv_num_blocks.shape[:2]
        mask = create_mask(block_mask.mask_mod, batches, heads, q.shape[2], k.shape[2], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@functools.lru_cache(maxsize=16)
def _causal_block_mask(t: int, s: int, device: torch.device) -> BlockMask:
    """Query i at position S − T + i sees keys up to it (the ops' end-aligned causal mask)."""
    return create_block_mask(lambda b, h, q, kv: q + (s - t) >= kv, None, None, t, s, device=device)


def block_mask_for(attn_mask: Tensor | BlockMask | None, t: int, s: int, *, causal: bool,
                   device: torch.device) -> BlockMask | None:
    """The block mask of the ops' (causal, attn_mask) pair; None where every key is visible."""
    if isinstance(attn_mask, BlockMask):
        return attn_mask
    if attn_mask is None:
        return _causal_block_mask(t, s, device) if causal and t > 1 else None
    visible = visible_mask(t, s, causal=causal, attn_mask=attn_mask, device=device)
    visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))  # (B|1, H|1, T, S)
    batches, heads = visible.shape[0], visible.shape[1]

    def mask_mod(b, h, q, kv):
        return visible[b if batches > 1 else 0, h if heads > 1 else 0, q, kv]

    return create_block_mask(mask_mod, batches if batches > 1 else None, heads if heads > 1 else None, t, s,
                             device=device)


def document_block_mask(document_ids: Tensor) -> BlockMask:
    """(B, T) ids, a document being a run of equal ids -> the block mask of causal attention within
    each document (the block-diagonal causal mask)."""
    b, t = document_ids.shape
    runs = torch.ones_like(document_ids, dtype=torch.long)
    runs[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    runs = runs.cumsum(dim=1)  # (B, T) the run each token belongs to

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (runs[b, q] == runs[b, kv])

    return create_block_mask(mask_mod, b, None, t, t, device=document_ids.device)


def flex_attention_op(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, attn_mask: Tensor | BlockMask | None,
                      scale: float | None = None) -> Tensor:
    """Standard attention through FlexAttention: q (B, H, T, d), k (B, Hkv, S, d), v (B, Hkv, S, dv)."""
    block_mask = block_mask_for(attn_mask, q.shape[2], k.shape[2], causal=causal, device=q.device)
    return _flex(q, k, v, block_mask, scale)


def flex_diff_attention(q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor, v: Tensor, lam: Tensor, *, causal: bool = True,
                        attn_mask: Tensor | BlockMask | None = None, scale: float | None = None) -> Tensor:
    """Differential attention, two FlexAttention calls sharing one block mask: q1, q2 (B, H, T, d);
    k1, k2 (B, Hkv, S, d); v (B, Hkv, S, 2d) -> (B, H, T, 2d)."""
    block_mask = block_mask_for(attn_mask, q1.shape[2], k1.shape[2], causal=causal, device=q1.device)
    a1 = _flex(q1, k1, v, block_mask, scale)
    a2 = _flex(q2, k2, v, block_mask, scale)
    lam = lam.to(a1.dtype)
    return a1 - (lam.reshape(1, -1, 1, 1) if lam.dim() else lam) * a2
