"""The language-modelling loss without the (tokens × vocabulary) logits: the LM head and the
cross-entropy fused, in chunks of tokens.

    loss = linear_cross_entropy(hidden, weight, targets)   # = F.cross_entropy(hidden @ weightᵀ, targets)

At a small model's shapes the logits are the largest tensor of a training step (tiny: 2,048 tokens
× 8,192 words = 67 MB in fp32) and F.cross_entropy passes over them five times (log-softmax, the
zero-filled gradient, the scatter, the log-softmax backward, the product with the head). Here each
chunk's logits are made, reduced to their log-sum-exp and, when a gradient is wanted, turned into
their gradient softmax − onehot in place, while they are still in cache; the chunk's share of the
gradients of ``hidden`` and ``weight`` is taken at once, so nothing of size (N, V) outlives a
chunk. The gradients are therefore computed in the forward and only scaled in the backward: call
it when the loss will be backpropagated, or without gradients (then it computes the loss only).

The same FLOPs as the plain path (three products with the head), in fp32 logits for fp32, fp16
and bf16 inputs; the plain path stays in :class:`~diff_transformer.model.LanguageModel` for callers
that want the logits too, and under torch.compile (inductor fuses that one itself).
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100  # a target excluded from the loss (torch cross_entropy's ignore_index)
# Logits per chunk on CPU: 8 MiB of fp32, 256 rows of 8,192 words (measured on 2 cores, head +
# loss forward + backward, 15 alternating rounds: 1.06-1.09x faster than 128 rows at E = 192,
# 2,048 tokens and 1.09-1.10x at E = 512, 1,024 tokens; 512 rows 0.99-1.10x, 1,024 rows 0.91-1.13x;
# BENCHMARKS.md). On a GPU a chunk only bounds memory, so it is larger there (fewer launches;
# not timed on a GPU).
CHUNK_BYTES = {"cpu": 8 << 20}
DEFAULT_CHUNK_BYTES = 256 << 20
MIN_CHUNK_ROWS = 32


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Token rows per chunk: as many fp32 logit rows as fit CHUNK_BYTES, at least MIN_CHUNK_ROWS."""
    budget = CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES)
    return max(MIN_CHUNK_ROWS, budget // (4 * vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, rows: int) -> Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        grad_weight = torch.zeros_like(weight, dtype=acc) if want_weight else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start : start + rows], targets[start : start + rows]
            # The chunk's logits transposed, (V, c): W·hᵀ runs faster than h·Wᵀ on CPU for a few rows
            # against a large vocabulary (see model.FEW_HEAD_ROWS); reductions run over dim 0.
            logits = (weight @ h.t()).to(acc)
            counted = y != IGNORE_INDEX
            picked = y.masked_fill(~counted, 0)[None, :]  # (1, c)
            target_logits = logits.gather(0, picked).squeeze(0)
            peak = logits.amax(dim=0, keepdim=True)  # (1, c)
            exps = logits.sub_(peak).exp_()  # exp(logit − max), in place of the logits: one pass of exp
            sums = exps.sum(dim=0, keepdim=True)
            lse = (peak + sums.log()).squeeze(0)  # log-sum-exp of each token's logits
            total += torch.where(counted, lse - target_logits, 0.0).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            grad = exps.div_(sums)  # softmax
            grad.scatter_add_(0, picked, torch.full_like(lse, -1.0)[None, :])
            grad.mul_(counted[None, :])  # ignored targets: no gradient
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad.t(), weight.to(hidden.dtype), out=grad_hidden[start : start + rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad.to(acc), h.to(acc))
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, reduction: str = "mean", rows: int | None = None
) -> Tensor:
    """Cross-entropy of the logits ``hidden @ weightᵀ`` against ``targets``, never materialised whole.

    hidden (N, E), weight (V, E), targets (N,) long with IGNORE_INDEX (-100) for positions that do
    not count. ``reduction`` "mean" (over counted targets; NaN when none counts, as F.cross_entropy)
    or "sum". ``rows``: tokens per chunk (default :func:`chunk_rows`). Returns a 0-d tensor in fp32
    (fp64 for fp64 inputs).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, E) and weight (V, E) must share E, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},) for hidden {tuple(hidden.shape)}, "
                         f"got {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    rows = chunk_rows(weight.shape[0], hidden.device) if rows is None else rows
    total = _LinearCrossEntropy.apply(hidden, weight, targets, rows)
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum()
