"""The "math" backend: both maps materialised once, V read once, a hand-written backward.

    P_c = softmax(Q_c K_cᵀ s + bias)      c = 1, 2      (B, G, R, 2, T, S) fp32, one product
    A   = P_1 − λ P_2                                   (B, G, R, T, S)
    out = A V                                           (B, G, R, T, 2d), one product with V

G key/value groups, R query heads per group (GQA without copying K or V: the R dimension
broadcasts). Against the flash-style split it does half the products with V and half the
exponentials (each map is computed once, not once per half of V), at the price of keeping the
maps for the backward: memory O(T·S), which is why "auto" uses it for short keys on CPU only
(up to ``MATH_MAX_KEYS``).

The backward needs no autograd graph over the maps. With dA = dO Vᵀ and r_c = rowsum(P_c ⊙ dA):
    dV = Aᵀ dO
    dS_1 = P_1 ⊙ (dA − r_1),   dS_2 = −λ P_2 ⊙ (dA − r_2)     (softmax backward, λ factored out)
    dQ_c = s dS_c K_c,   dK_c = s dS_cᵀ Q_c,   dλ = −Σ r_2      (summed per head for a per-head λ)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import visible_mask


class _MaterializedDiffAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, bias: Tensor | None, scale: float) -> Tensor:
        """q (B, G, R, 2, T, d); k (B, G, 1, 2, S, d); v (B, G, 1, S, 2d); lam (G, R, 1, 1) or 0-d
        fp32; bias additive fp32 broadcastable to (B, G, R, 2, T, S) or None -> (B, G, R, T, 2d)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # copied once, for both passes' products
        if bias is not None and bias.dim() == 2 and q.dtype == torch.float32 and q.shape[2] == 1:
            # causal, one query head per group: scale, product and mask in one call over (B·G·2, T, S)
            b, g, r, _, t, d = q.shape
            logits = torch.baddbmm(bias, q.view(-1, t, d), k.view(-1, k.shape[-2], d).transpose(-1, -2), alpha=scale)
            logits = logits.view(b, g, r, 2, t, -1)
        else:
            logits = torch.matmul(q, k.transpose(-1, -2)).float()  # (B, G, R, 2, T, S)
            logits = logits.mul_(scale) if bias is None else torch.add(bias, logits, alpha=scale)
        probs = torch.softmax(logits, dim=-1)
        del logits
        combined = torch.addcmul(probs[:, :, :, 0], probs[:, :, :, 1], lam, value=-1.0)  # (B, G, R, T, S)
        combined = combined.to(v.dtype)
        ctx.save_for_backward(q, k, v, lam, probs, combined)
        ctx.scale = scale
        return torch.matmul(combined, v)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, lam, probs, combined = ctx.saved_tensors
        grad_v = torch.matmul(combined.transpose(-1, -2), grad_out).sum(2, keepdim=True)  # R heads share v
        grad_a = torch.matmul(grad_out, v.transpose(-1, -2)).float().unsqueeze(3)  # (B, G, R, 1, T, S)
        grad_s = probs * grad_a  # (B, G, R, 2, T, S)
        rows = grad_s.sum(-1, keepdim=True)  # r_c
        grad_s.addcmul_(probs, rows, value=-1.0)  # P_c ⊙ (dA − r_c); map 2's −λ is applied below
        grad_s = grad_s.to(q.dtype)
        # per (group, head, map) factor s and −λ s, (G, R, 2, 1, 1)
        lam4 = lam.reshape(1, 1, 1, 1) if lam.dim() == 0 else lam
        coef = torch.stack([torch.ones_like(lam4), -lam4], dim=2) * ctx.scale
        grad_q = torch.matmul(grad_s, k) * coef.to(q.dtype)
        grad_k = (torch.matmul(grad_s.transpose(-1, -2), q) * coef.to(q.dtype)).sum(2, keepdim=True)
        r2 = rows[:, :, :, 1]  # (B, G, R, T, 1)
        grad_lam = -(r2.sum() if lam.dim() == 0 else r2.sum(dim=(0, 3, 4)).reshape(lam.shape))
        return grad_q, grad_k, grad_v, grad_lam, None, None


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
    mask = visible_mask(t, s, causal=causal, attn_mask=attn_mask, device=q.device)
    bias = None
    if mask is not None:
        if mask.dim() > 2:  # (B|1, H|1, T, S) -> (B|1, G|1, R|1, 1, T, S)
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            mask = mask.unflatten(1, (g, r) if mask.shape[1] > 1 else (1, 1)).unsqueeze(3)
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
    lam = lam.float()
    lam = lam.reshape(g, r, 1, 1) if lam.dim() else lam
    out = _MaterializedDiffAttention.apply(q, k, v, lam, bias, d**-0.5 if scale is None else scale)
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
