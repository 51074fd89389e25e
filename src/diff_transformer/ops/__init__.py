"""Attention ops: one function per attention kind, many backends behind one signature.

    from diff_transformer.ops import diff_attention, reference_diff_attention
    out = diff_attention(q1, q2, k1, k2, v, lam)             # (B, H, T, 2d), before the head norm
    out, maps = reference_diff_attention(q1, q2, k1, k2, v, lam)   # and both maps, fp32

Return types are fixed: the fast ops return the output only; the reference functions return
(output, :class:`AttentionMaps`) and alone take a ``logits_transform``. :func:`diff_attention_packed`
takes the model's own layout (the two groups interleaved as sub-heads) and is what
``DiffAttention`` calls: one dispatcher for prefill, training and single-token decoding.

Backends of ``diff_attention``:
    "reference"   materialises both maps in fp32 (``reference_diff_attention`` returns them)
    "sdpa"        two SDPA calls with v of width 2d            (the paper's FlashDiffAttn_1)
    "sdpa_split"  SDPA calls of equal widths (v halved)      (the paper's FlashDiffAttn_2; two
                  calls over Q1/Q2 stacked as heads rather than its four)
    "math"        both maps materialised once, V read once, a hand-written backward, in
                  tiles of query rows that stay in cache (materialized.py): half the split's
                  products with V, memory O(T·S) (the causal half)
    "triton"      one fused Triton kernel, forward and backward (triton_diff.py); CUDA, or CPU
                  under TRITON_INTERPRET=1 (tests); no attn_mask (a key_padding_mask is fused);
                  d in {16, 32, 64, 96, 128, 256}. Opt-in only: verified in Triton's interpreter
                  and compiled for sm_90, not yet measured on a GPU (``diff-transformer bench gpu``
                  checks and times it on yours)
    "decode"      one query per sequence (T = 1) against a KV cache, K1/K2/V read once (decode.py)
    "flex"        FlexAttention with block masks (flex.py): the tiles a mask leaves empty are
                  skipped, documents packed into one sequence most of all. Opt-in only: on CUDA
                  compiled, not yet measured on a GPU; on the CPU unfused and forward only
    "auto"        (:func:`choose_backend`) "decode" for a single query; on CUDA "sdpa" (PyTorch
                  picks flash / cuDNN / memory-efficient), never "triton"; on CPU "math" for
                  fp32 up to MATH_MAX_KEYS keys (measured faster than "sdpa_split" there,
                  BENCHMARKS.md), else "sdpa_split"

Grouped differential attention (:func:`gda_attention`: H signal heads, N = H / r noise heads) runs
on every backend: "reference", "sdpa" and "sdpa_split" compute each noise map once; the others take
one second map per first map, so the noise queries are repeated for their r signal heads (the same
numbers, each noise map computed r times).

``triton_diff`` imports Triton, so it is imported on first use of the "triton" backend only.
Multi-token attention has its own module, ``ops.mta`` (a fast path and a reference, both on
materialised maps: no SDPA or flash kernel computes its convolutions of the logits).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

import torch
from torch import Tensor

from .limits import TRITON_HEAD_DIMS
from .decode import decode_diff_attention, decode_diff_attention_packed
from .flex import BlockMask, document_block_mask, flex_attention_op, flex_diff_attention
from .materialized import materialized_diff_attention, materialized_diff_attention_grouped
from .reference import (AttentionMaps, LogitsTransform, reference_attention, reference_diff_attention,
                        reference_gda_attention)
from .reference import check_diff_inputs as _check_diff_inputs
from .reference import check_gda_inputs as _check_gda_inputs
from .reference import visible_mask
from .sdpa import (sdpa, sdpa_diff_attention, sdpa_gda_attention, sdpa_split_diff_attention,
                   sdpa_split_gda_attention, split_diff_attention_stacked)

__all__ = [
    "AttentionMaps",
    "BACKEND_NAMES",
    "DIFF_BACKENDS",
    "LogitsTransform",
    "MATH_MAX_KEYS",
    "TRITON_HEAD_DIMS",
    "attention",
    "check_every_query_sees_a_key",
    "choose_backend",
    "diff_attention",
    "diff_attention_packed",
    "document_block_mask",
    "gda_attention",
    "key_padding_to_attn_mask",
    "reference_attention",
    "reference_diff_attention",
    "reference_gda_attention",
    "resolve_backend",
]

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # read once at import
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's test-only CPU mode

# Longest keys for which "auto" picks "math" on CPU: at the tiny model's shapes (batch 8), in
# forward + backward, it is 2.3–2.5x faster than "sdpa_split" up to 512 keys, 1.2–1.7x at 1,024
# and slower at 2,048, where its query tiles get short (BENCHMARKS.md). It keeps the causal half
# of the maps for the backward (about twice the split's peak memory at 1,024 keys); longer
# sequences keep the flash-style split (linear memory).
MATH_MAX_KEYS = 1024
_triton_import: list[str | None] = []  # [error message or None] once the import was tried


def triton_import_error() -> str | None:
    """Why ``triton_diff`` cannot be imported (an old Triton, a broken install), or None; tried once."""
    if not TRITON_INSTALLED:
        return "the 'triton' package is not installed"
    if not _triton_import:
        try:
            importlib.import_module(f"{__name__}.triton_diff")
        except Exception as e:  # any failure means: not usable
            _triton_import.append(f"{type(e).__name__}: {e}")
        else:
            _triton_import.append(None)
    return _triton_import[0]


def triton_available() -> bool:
    """Whether backend="triton" can run on a GPU here: installed, not the interpreter, and it
    imports (``bench gpu`` reports it; "auto" never picks the kernel)."""
    return TRITON_INSTALLED and not _TRITON_INTERPRET and triton_import_error() is None


def _triton_diff_attention(q1, q2, k1, k2, v, lam, *, causal, attn_mask, scale, key_padding_mask=None) -> Tensor:
    """The "triton" backend, importing Triton on first use (see triton_diff.py)."""
    if not TRITON_INSTALLED:
        raise RuntimeError("backend 'triton' needs the 'triton' package (pip install triton), which is not installed")
    from .triton_diff import triton_diff_attention

    return triton_diff_attention(
        q1, q2, k1, k2, v, lam, causal=causal, attn_mask=attn_mask, scale=scale, key_padding_mask=key_padding_mask
    )


# name -> function(q1, q2, k1, k2, v, lam, *, causal, attn_mask, scale) -> (B, H, T, 2d)
DIFF_BACKENDS: dict[str, Callable[..., Tensor]] = {
    "reference": lambda *a, **kw: reference_diff_attention(*a, **kw)[0],
    "sdpa": sdpa_diff_attention,
    "sdpa_split": sdpa_split_diff_attention,
    "math": materialized_diff_attention,
    "triton": _triton_diff_attention,
    "decode": decode_diff_attention,
    "flex": flex_diff_attention,
}
BACKEND_NAMES = ("auto", *DIFF_BACKENDS)
STANDARD_BACKENDS = ("auto", "reference", "sdpa", "flex")  # what attention() (standard softmax attention) runs


def choose_backend(
    device_type: str,
    *,
    dtype: torch.dtype | None = None,
    queries: int | None = None,
    keys: int | None = None,
) -> str:
    """What "auto" means, as a pure function (testable without CUDA).

    device_type "cuda"/"cpu"/...; dtype of q; queries T (1 = decoding); keys S (None = not known).
    "auto" never picks "triton" or "flex", whose kernels have not been measured on a GPU yet (they
    are opt-in, ``backend="triton"``, ``backend="flex"``); on CUDA it picks "sdpa", where PyTorch
    chooses flash, cuDNN or memory-efficient attention.
    """
    if queries == 1:
        return "decode"
    if device_type == "cuda":
        return "sdpa"
    short = keys is not None and keys <= MATH_MAX_KEYS
    return "math" if short and dtype == torch.float32 else "sdpa_split"


def resolve_backend(
    backend: str,
    device: torch.device,
    *,
    queries: int | None = None,
    keys: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Map "auto" to a concrete backend (:func:`choose_backend`); check any other name exists."""
    if backend == "auto":
        return choose_backend(device.type, dtype=dtype, queries=queries, keys=keys)
    if backend not in DIFF_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return backend


def _check_mask(attn_mask: Tensor | BlockMask | None, b: int, h: int, t: int, s: int, backend: str) -> None:
    if attn_mask is None:
        return
    if isinstance(attn_mask, BlockMask):
        if backend != "flex":
            raise TypeError(f"attn_mask is a FlexAttention BlockMask, which only backend 'flex' takes, not {backend!r}")
        return
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor (True = may attend), got {attn_mask.dtype}")
    try:
        torch.broadcast_shapes(attn_mask.shape, (b, h, t, s))
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, T, S) = {(b, h, t, s)}"
        ) from None


def check_every_query_sees_a_key(attn_mask: Tensor, t: int, s: int, *, causal: bool) -> None:
    """A ValueError naming the first query that ``attn_mask`` (bool, broadcastable to (B, H, T, S),
    True = may attend), with the causal mask when ``causal``, leaves without a visible key: its
    softmax would be 0 / 0, NaN in the output and every gradient. One pass over the mask (at
    most B·H·T·S bools, the size of one attention map; B·H·S for a key-padding mask) and one read
    back."""
    if attn_mask.shape[-2] == 1:  # the same keys for every query: the first sees the fewest under the causal mask
        blind = ~attn_mask[..., : s - t + 1 if causal else s].any(dim=-1)  # (.., 1): query 0 blind in these rows
    else:
        visible = visible_mask(t, s, causal=causal, attn_mask=attn_mask, device=attn_mask.device)
        blind = ~visible.any(dim=-1)  # (.., T): True where a query sees no key
    if not bool(blind.any()):
        return
    where = blind.nonzero()[0].tolist()  # the first blind query: its index along each of blind's dims
    names = ["batch", "head", "query"][-len(where):]  # blind's dims, aligned to the right as broadcasting aligns
    place = ", ".join(f"{name} {i}" for dim, (name, i) in enumerate(zip(names, where))
                      if name == "query" or blind.shape[dim] > 1)  # a dim the mask broadcasts over says nothing
    causal_note = " (with the causal mask)" if causal else ""
    raise ValueError(f"attn_mask hides every key from {place}{causal_note}: every query must keep at least one "
                     f"visible key (its softmax would be 0/0, NaN)")


def key_padding_to_attn_mask(key_padding_mask: Tensor, t: int, s: int) -> Tensor:
    """(B, S) bool, True = a real key -> (B, 1, T, S) attn_mask: real keys, plus each query's own
    position S − T + i, so that a padded query (left padding) still has one key and stays finite.
    The one place this mask is built: :func:`diff_attention` and ``LanguageModel.forward`` call it
    (the "triton" kernel applies the same rule without this tensor)."""
    keys = torch.arange(s, device=key_padding_mask.device)
    own = keys[None, :] == torch.arange(s - t, s, device=keys.device)[:, None]  # (T, S): query i at S − T + i
    return key_padding_mask[:, None, None, :] | own[None, None]


def _check_key_padding(key_padding_mask: Tensor | None, b: int, s: int) -> None:
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError("key_padding_mask must be a bool tensor (B, S), True = a real key")
    if key_padding_mask.shape != (b, s):
        raise ValueError(f"key_padding_mask must be (B, S) = {(b, s)}, got {tuple(key_padding_mask.shape)}")


def diff_attention(
    q1: Tensor,
    q2: Tensor,
    k1: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | BlockMask | None = None,
    backend: str = "auto",
    scale: float | None = None,
    check: bool = True,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Differential attention ``(softmax(q1 k1ᵀ/√d) − λ·softmax(q2 k2ᵀ/√d)) v``, before the head norm.

    Args:
        q1, q2: (B, H, T, d) the two query groups.
        k1, k2: (B, Hkv, S, d) the two key groups; query head h reads KV head h // (H / Hkv).
        v: (B, Hkv, S, 2d), or (B, Hkv, S, d) (a converted Transformer's heads, ``value_factor=1``;
            not the "triton" backend).
        lam: λ, a 0-d tensor or one value per head (H,); gradients flow into it.
        causal: mask future keys. With S > T the mask is aligned to the end (KV cache):
            query i sits at position S − T + i.
        attn_mask: optional bool mask broadcastable to (B, H, T, S), True = may attend;
            combined with the causal mask. Every query must keep at least one visible key. With
            backend "flex", a FlexAttention BlockMask instead, the whole mask (causality included:
            :func:`document_block_mask`).
        backend: "auto", "reference", "sdpa", "sdpa_split", "math", "triton", "decode" or "flex"
            (see the module docstring).
        scale: softmax scale, default 1/√d with d the width of ONE group.
        check: validate shapes, dtypes and the mask. Modules whose tensors are right by
            construction pass False to save the checks' overhead on every decoding step.
        key_padding_mask: optional (B, S) bool, True = a real key (batched generation with left
            padding); a query always keeps its own position visible (see
            :func:`key_padding_to_attn_mask`). Fused by "triton"; the other backends get it as an
            attn_mask (combined with ``attn_mask`` if both are given).

    Returns:
        (B, H, T, 2d) (v's width) in q1's dtype. For the maps, call :func:`reference_diff_attention`.
    """
    if check:
        _check_diff_inputs(q1, q2, k1, k2, v, lam, causal)
    t = q1.shape[2]
    name = resolve_backend(backend, q1.device, queries=t, keys=k1.shape[2], dtype=q1.dtype)
    if check:
        _check_mask(attn_mask, q1.shape[0], q1.shape[1], q1.shape[2], k1.shape[2], name)
        _check_key_padding(key_padding_mask, q1.shape[0], k1.shape[2])
        if isinstance(attn_mask, BlockMask) and key_padding_mask is not None:
            raise ValueError("a BlockMask attn_mask is the whole mask: give the key padding inside it, not as "
                             "key_padding_mask")
        if isinstance(attn_mask, Tensor):
            check_every_query_sees_a_key(attn_mask, q1.shape[2], k1.shape[2], causal=causal)
    if key_padding_mask is not None and name == "triton":
        return _triton_diff_attention(
            q1, q2, k1, k2, v, lam, causal=causal, attn_mask=attn_mask, scale=scale, key_padding_mask=key_padding_mask
        )
    if key_padding_mask is not None:  # every other backend takes it as an attn_mask (B, 1, T, S)
        padding = key_padding_to_attn_mask(key_padding_mask, t, k1.shape[2])
        attn_mask = padding if attn_mask is None else attn_mask & padding
    return DIFF_BACKENDS[name](q1, q2, k1, k2, v, lam, causal=causal, attn_mask=attn_mask, scale=scale)


def diff_attention_packed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | BlockMask | None = None,
    backend: str = "auto",
    scale: float | None = None,
) -> Tensor:
    """:func:`diff_attention` in the model's layout, unchecked (the module's shapes are right by
    construction): q (B, 2H, T, d) with Q1, Q2 of DIFF head h at sub-heads 2h, 2h+1; k (B, 2Hkv, S, d)
    likewise; v (B, Hkv, S, 2d) -> (B, H, T, 2d). A single query goes to the packed decode path
    (both maps from one product); everything else to the chosen backend on strided views."""
    t, s = q.shape[2], k.shape[2]
    name = resolve_backend(backend, q.device, queries=t, keys=s, dtype=q.dtype)
    if name == "decode":
        return decode_diff_attention_packed(q, k, v, lam, attn_mask=attn_mask, scale=scale)
    if name == "math":  # views: sub-head 2h + c of head h = g·R + r is (g, r, c); K/V broadcast over r
        g = k.shape[1] // 2
        q, k, v = q.unflatten(1, (g, -1, 2)), k.unflatten(1, (g, 1, 2)), v.unflatten(1, (g, 1))
        return materialized_diff_attention_grouped(q, k, v, lam, causal=causal, attn_mask=attn_mask, scale=scale)
    if name == "sdpa_split":  # sub-heads 2h, 2h+1 -> group-major [Q1 heads; Q2 heads] (one copy each)
        q, k = (x.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2) for x in (q, k))
        return split_diff_attention_stacked(q, k, v, lam, causal=causal, attn_mask=attn_mask, scale=scale)
    return DIFF_BACKENDS[name](
        q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2], v, lam, causal=causal, attn_mask=attn_mask, scale=scale
    )


# backends of gda_attention that compute each noise map once; the others get the noise queries repeated
_GDA_BACKENDS: dict[str, Callable[..., Tensor]] = {
    "reference": lambda *a, **kw: reference_gda_attention(*a, **kw)[0],
    "sdpa": sdpa_gda_attention,
    "sdpa_split": sdpa_split_gda_attention,
}


def gda_attention(
    q1: Tensor,
    q2: Tensor,
    k1: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | BlockMask | None = None,
    backend: str = "auto",
    scale: float | None = None,
    check: bool = True,
) -> Tensor:
    """Grouped differential attention, before the head norm: for signal head i = g·r + j,
    ``(softmax(q1_i k1ᵀ/√d) − λ·softmax(q2_g k2ᵀ/√d)) v`` (:func:`reference_gda_attention`).

    q1 (B, H, T, d) signal queries, q2 (B, N, T, d) noise queries (r = H / N signal heads per noise
    head; N a multiple of Hkv), k1, k2 (B, Hkv, S, d), v (B, Hkv, S, 2d), lam 0-d or (H,). Conventions
    (causal alignment, ``attn_mask`` (one for every head: (B, 1, T, S)), ``backend``, ``scale``,
    ``check``) as :func:`diff_attention`. With N = H it is :func:`diff_attention`. Returns (B, H, T, 2d).
    """
    if check:
        _check_gda_inputs(q1, q2, k1, k2, v, lam, causal)
    t, s = q1.shape[2], k1.shape[2]
    name = resolve_backend(backend, q1.device, queries=t, keys=s, dtype=q1.dtype)
    if check:
        _check_mask(attn_mask, q1.shape[0], 1, t, s, name)
        if isinstance(attn_mask, Tensor) and attn_mask.dim() == 4 and attn_mask.shape[1] != 1:
            raise ValueError(f"attn_mask {tuple(attn_mask.shape)}: grouped differential attention takes one mask "
                             "for every head (B, 1, T, S), since a noise head serves several signal heads")
        if isinstance(attn_mask, Tensor):
            check_every_query_sees_a_key(attn_mask, t, s, causal=causal)
    kw = dict(causal=causal, attn_mask=attn_mask, scale=scale)
    if name in _GDA_BACKENDS:
        return _GDA_BACKENDS[name](q1, q2, k1, k2, v, lam, **kw)
    q2 = q2.repeat_interleave(q1.shape[1] // q2.shape[1], dim=1)  # noise query g for signal heads g·r … g·r + r − 1
    return DIFF_BACKENDS[name](q1, q2, k1, k2, v, lam, **kw)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    attn_mask: Tensor | BlockMask | None = None,
    backend: str = "auto",
    scale: float | None = None,
    check: bool = True,
) -> Tensor:
    """Standard softmax attention with the same conventions as :func:`diff_attention`.

    q (B, H, T, d), k (B, Hkv, S, d), v (B, Hkv, S, dv) -> (B, H, T, dv). Backends: "reference",
    q (B, H, T, d), k (B, Hkv, S, d), v (B, Hkv, S, dv) -> (B, H, T, dv). Backends: "reference",
    "flex" (FlexAttention), or "auto" / "sdpa": PyTorch SDPA (it picks flash / memory-efficient
    itself); the others are DIFF kernels (:func:`diff_attention`) and are refused here. For the maps,
    call :func:`reference_attention`. (The model's layers of standard attention pass their model's
    backend with ``check=False``: SDPA for every one of them but "reference" and "flex".)
    """
    if check:
        for name, x in {"q": q, "k": k, "v": v}.items():
            if x.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor (B, heads, length, width), got {tuple(x.shape)}")
        if q.shape[1] % k.shape[1] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if causal and q.shape[2] > k.shape[2]:
            raise ValueError(f"causal attention needs T <= S, got T={q.shape[2]} and S={k.shape[2]}")
        resolve_backend(backend, q.device)
        _check_mask(attn_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], backend)
        if isinstance(attn_mask, Tensor):
            check_every_query_sees_a_key(attn_mask, q.shape[2], k.shape[2], causal=causal)
    if check and backend not in STANDARD_BACKENDS:
        raise ValueError(f"backend {backend!r} is a kernel of differential attention (diff_attention), which "
                         "attention() would not run; for standard attention choose one of "
                         f"{', '.join(STANDARD_BACKENDS)}")
    if backend == "reference":
        return reference_attention(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale)[0]
    if backend == "flex":
        return flex_attention_op(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale)
    return sdpa(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale)
