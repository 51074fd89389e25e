"""Multi-token attention (MTA; Golovneva, Wang, Weston and Sukhbaatar 2025, arXiv 2504.00927; the
authors' code: facebookresearch/RAM, projects/mta/mta_transformer.py): softmax attention whose
logits and maps are convolved over nearby queries and keys and mixed across heads.

    Z   = mask_0(q kᵀ s)                  (B, H, R, S) fp32, hidden (query, key) pairs set to 0
    Z'  = conv(Z; θ_pre)                  on layers with the key-query convolution only
    L   = W_pre Z'                        head mixing before the softmax: (H, H) over the heads
    P   = softmax(mask_−∞(L))
    P'  = mask_0(conv(P; θ_post))         on layers with the key-query convolution only
    A   = K_post P'                       head mixing after the softmax, in groups of c_h heads
    out = A v                             (B, H, R, w)

The key-query convolution of a map X by θ (H, c_q, c_k), one kernel per head, is the authors'
conv2d over X padded with c_q − 1 rows of zeros above and (c_k − 1)/2 columns on either side:

    conv(X)[i, j] = Σ_{a < c_q} Σ_{b < c_k} θ[a, b] · X[i − δ, j + b − (c_k − 1)/2] · ok[δ, i],   δ = c_q − 1 − a

so θ[c_q − 1, (c_k − 1)/2] weighs the pair itself, the rows above are the earlier queries (never a
later one: the convolution is causal in the queries) and the keys come from both sides (a key
after a query is hidden, so 0). ``ok[δ, i]`` (:func:`row_sources`) says whether row i may read row
i − δ: it exists, and query i sees the key at its own position minus δ. With the plain causal mask
that is the authors' zero padding at the start of a sequence; with left padding, packed documents
or a KV cache's earlier rows it keeps a query from reading the rows of padding or of another
document (as the authors cut their inputs at each sequence's start, ``chunk_start_ids``, when they
generate). R rows are R consecutive positions; with a KV cache they include earlier queries, whose
rows the convolutions read (``MultiTokenAttention``).

Both functions materialise the maps (several T × S maps per head are kept for the backward): MTA
has no flash-style backend. SDPA and flash attention compute softmax(q kᵀ) v without ever holding
the logits, while MTA convolves the logits of neighbouring queries and keys before the softmax and
mixes the maps of the heads after it. :func:`mta_attention` is the fast path (one conv2d per
convolution, the head mixing as matrix products); :func:`reference_mta_attention` the readable
statement (the convolution as the sum of its shifted maps) that returns the maps to a tap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import AttentionMaps, LogitsTransform, _expand_kv


@dataclass
class MTAWeights:
    """One MTA layer's mixing weights (any float dtype; used in fp32).

    kq_pre, kq_post: (H, c_q, c_k) kernels of the key-query convolutions before and after the
        softmax, or None on a layer without them.
    head_pre: (H, H), logits of head m = Σ_n head_pre[m, n] · logits of head n (the authors' ``wpsm``,
        a Linear over the heads).
    head_post: (H/c_h, c_h, c_h), map of head g·c_h + m = Σ_n head_post[g, n, m] · map of head
        g·c_h + n (the authors' ``head_kernel``).
    """

    kq_pre: Tensor | None
    kq_post: Tensor | None
    head_pre: Tensor
    head_post: Tensor

    @property
    def query_kernel(self) -> int:
        """c_q, or 1 without the key-query convolution."""
        return 1 if self.kq_pre is None else self.kq_pre.shape[1]


def causal_visible(r: int, s: int, device: torch.device) -> Tensor:
    """(R, S) bool: the causal mask aligned to the end (row i is the query at position S − R + i)."""
    return torch.ones(r, s, dtype=torch.bool, device=device).tril(diagonal=s - r)


def _four_dims(mask: Tensor | None) -> Tensor | None:
    """A mask (.., R, S) as (B|1, 1, R, S)."""
    return None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def row_sources(visible: Tensor, reach: int) -> Tensor:
    """ok (.., reach, R) bool from visible (.., R, S): ok[.., δ, i] whether row i may read row i − δ.

    Row i − δ must exist and query i must see the key at its own position minus δ. A row's own
    position is the last key it sees (every query sees its own position and nothing after it)."""
    r, s = visible.shape[-2:]
    keys = torch.arange(s, device=visible.device)
    own = torch.where(visible, keys, -1).amax(dim=-1)  # (.., R) each row's own position
    rows = torch.arange(r, device=visible.device)
    sources = []
    for delta in range(reach):
        source = own - delta
        seen = visible.gather(-1, source.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        sources.append(seen & (source >= 0) & (rows >= delta))
    return torch.stack(sources, dim=-2)


class _DepthwiseConv(torch.autograd.Function):
    """F.conv2d(x, weight, groups=C) for x (B, C, H, W) and weight (C·m, 1, kh, kw), stride 1, no padding,
    with a faster weight gradient on a CPU. oneDNN's own took 2 to 3 times its forward on the alternatives
    study's maps (batch 4, 6 heads, 128 tokens, 6 × 11 kernels: 10-17 ms against 5); the same sums as one
    grouped convolution of x by the output gradient, each (sample, channel) its own group with its
    gradient as the kernel, take about the forward's time (4-6 ms, the copy included)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, groups: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.groups = groups
        return F.conv2d(x, weight, groups=groups)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        c, m = ctx.groups, weight.shape[0] // ctx.groups
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:  # first: its copies of x and the gradient are freed before grad_x exists
            b, _, h, w = x.shape
            # grad_weight[c·m + k, 0, a, e] = Σ_{n,i,j} x[n, c, i + a, j + e] · grad[n, c·m + k, i, j]
            inputs = x.transpose(0, 1).reshape(1, c * b, h, w)  # channels (c, n)
            kernels = grad.reshape(b, c, m, *grad.shape[-2:]).transpose(0, 1).reshape(c * b * m, 1, *grad.shape[-2:])
            sums = F.conv2d(inputs, kernels, groups=c * b)  # (1, C·B·m, kh, kw), channels (c, n, k)
            grad_weight = sums.view(c, b, m, *weight.shape[-2:]).sum(1).reshape(weight.shape)
            del inputs, kernels
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(grad, x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0],
                                                         c, [True, False, False])[0]
        return grad_x, grad_weight, None


def _depthwise(x: Tensor, weight: Tensor, groups: int) -> Tensor:
    """F.conv2d(x, weight, groups=groups); on a CPU through :class:`_DepthwiseConv` (elsewhere the stock
    kernels: ours is measured on a CPU only)."""
    return _DepthwiseConv.apply(x, weight, groups) if x.device.type == "cpu" else F.conv2d(x, weight, groups=groups)


def _conv(x: Tensor, kernel: Tensor, ok: Tensor | None) -> Tensor:
    """The key-query convolution of x (B, H, R, S) fp32 by kernel (H, c_q, c_k) fp32; ``ok`` from
    :func:`row_sources` (B|1, 1, c_q, R), or None: every earlier row of the block (plain causal)."""
    h, cq, ck = kernel.shape
    c = (ck - 1) // 2
    # The heads as channels last: the CPU's (oneDNN) depthwise convolution runs about 4x faster so, forward and
    # backward, copies included (tiny's maps, batch 8, 256 tokens: 59 against 204 ms).
    if ok is None:  # rows above the block are zeros: the authors' conv2d as it is
        padded = F.pad(x, (c, c, cq - 1, 0)).contiguous(memory_format=torch.channels_last)
        return _depthwise(padded, kernel.unsqueeze(1), h).contiguous()
    # along the keys for every row offset δ at once, (B, H, c_q, R, S); then each offset's rows moved
    # down by δ where row i may read row i − δ
    r = x.shape[-2]
    padded = F.pad(x, (c, c)).contiguous(memory_format=torch.channels_last)
    y = _depthwise(padded, kernel.flip(1).reshape(h * cq, 1, 1, ck), h).contiguous().unflatten(1, (h, cq))
    out = y[:, :, 0].clone()  # δ = 0: a row reads itself
    for delta in range(1, min(cq, r)):
        out[..., delta:, :] += y[:, :, delta, :-delta] * ok[:, :, delta, delta:, None]
    return out


def mta_attention(
    q: Tensor, k: Tensor, v: Tensor, weights: MTAWeights, *, visible: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """MTA's output, the fast path. q (B, H, R, d) rows of consecutive positions, k (B, Hkv, S, d),
    v (B, Hkv, S, w); query head h reads key/value head h // (H / Hkv). ``visible`` (B|1, 1, R, S)
    bool, True = may attend, the whole mask (causality included), every row seeing its own
    position; None = the causal mask aligned to the end. -> (B, H, R, w) in q's dtype."""
    b, h, r, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    visible = _four_dims(visible)
    # query heads that share a key/value head are rows of one product: no copy of K or V
    logits = torch.matmul(q.reshape(b, hkv, -1, d), k.transpose(-1, -2)).view(b, h, r, s).float().mul_(scale)
    seen = causal_visible(r, s, q.device) if visible is None else visible
    # the mask as a factor (1 seen, 0 hidden) and a bias (0, -inf) of the maps: a multiply or an add over the
    # maps runs about 10 times faster on a CPU than masked_fill with a broadcast mask, and the add's backward
    # is free (its inputs are finite logits, so the two agree)
    keep = seen.float()
    bias = torch.zeros_like(keep).masked_fill_(~seen, float("-inf"))
    ok = None if visible is None or weights.kq_pre is None else row_sources(visible, weights.query_kernel)
    x = logits
    if weights.kq_pre is not None:
        x = _conv(x * keep, weights.kq_pre.float(), ok)
    # a batch of (H, H) products: a 2-D matrix times the 3-D maps would be folded into one (B·R·S, H) × (H, H)
    # product with copies on either side, about 4 times slower on a CPU
    x = torch.bmm(weights.head_pre.float().expand(b, h, h), x.reshape(b, h, r * s)).view(b, h, r, s)
    p = torch.softmax(x + bias, dim=-1)
    if weights.kq_post is not None:
        p = _conv(p, weights.kq_post.float(), ok) * keep
    g, c, _ = weights.head_post.shape
    a = torch.matmul(weights.head_post.float().transpose(1, 2), p.reshape(b, g, c, r * s))  # (B, G, c_h, R·S)
    out = torch.matmul(a.to(v.dtype).view(b, hkv, -1, s), v)  # (B, Hkv, n_rep·R, w)
    return out.view(b, h, r, -1).to(q.dtype)


def _shifted_conv(x: Tensor, kernel: Tensor, ok: Tensor) -> Tensor:
    """conv(x) as the sum over the kernel's c_q·c_k entries of x shifted (the module docstring's formula)."""
    h, cq, ck = kernel.shape
    c = (ck - 1) // 2
    r, s = x.shape[-2:]
    out = torch.zeros_like(x)
    for a in range(cq):
        delta = cq - 1 - a
        if delta >= r:
            continue
        rows = F.pad(x, (0, 0, delta, 0))[..., :r, :] * ok[..., delta, :, None]  # row i holds x[i − δ] where allowed
        padded = F.pad(rows, (c, c))
        for b in range(ck):
            out += kernel[:, a, b].view(h, 1, 1) * padded[..., b : b + s]  # key j reads key j + b − c
    return out


def reference_mta_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weights: MTAWeights,
    *,
    visible: Tensor | None = None,
    scale: float | None = None,
    logits_transform: LogitsTransform | None = None,
) -> tuple[Tensor, AttentionMaps]:
    """:func:`mta_attention` written out in fp32, with the maps: ``logits`` the pre-softmax logits
    (convolved and mixed; -inf where hidden; ``logits_transform`` rewrites them first), ``probs``
    their softmax, ``combined`` the map A that multiplies V (convolved and mixed again)."""
    b, h, r, d = q.shape
    n_rep = h // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    k, v = _expand_kv(k, n_rep).float(), _expand_kv(v, n_rep).float()
    mask = _four_dims(causal_visible(r, k.shape[2], q.device) if visible is None else visible)
    ok = row_sources(mask, weights.query_kernel)
    x = (q.float() @ k.transpose(-1, -2)) * scale
    if weights.kq_pre is not None:
        x = _shifted_conv(torch.where(mask, x, 0.0), weights.kq_pre.float(), ok)
    x = torch.einsum("mn,bnij->bmij", weights.head_pre.float(), x)
    if logits_transform is not None:
        x = logits_transform(x, mask)
    logits = x.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    p = probs
    if weights.kq_post is not None:
        p = torch.where(mask, _shifted_conv(p, weights.kq_post.float(), ok), 0.0)
    g, c, _ = weights.head_post.shape
    combined = torch.einsum("gnm,bgnij->bgmij", weights.head_post.float(), p.unflatten(1, (g, c))).flatten(1, 2)
    out = combined @ v
    return out.to(q.dtype), AttentionMaps(logits=(logits,), probs=(probs,), combined=combined)
