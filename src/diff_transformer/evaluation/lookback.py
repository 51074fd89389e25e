"""The lookback ratio (Chuang et al. 2024, "Lookback Lens", arXiv 2407.07071): how much of a head's
attention, at the rows that produce an answer, lies on the context rather than on the answer so far.

For the row i of an answer token (the query position that predicts it) in one head,

    LR = C / (C + N),   C = mean |A[i, j]| over the context,   j < m,
                        N = mean |A[i, j]| over the new tokens, m <= j <= i,

where m is the first position of the answer marker ("\\nAnswer:" in ``eval context-qa``, ASK in the
grounded task): the context is everything before it (document and question), the new tokens the
marker and the answer generated so far, as in the authors' code (their context ends where the
"#Answer#:" prefix starts; they take means, not sums). An answer's ratio is the mean over its rows.

A is the map the model really uses, ``AttentionMaps.combined`` from the attention tap: the softmax
map of standard and gated attention (the gate acts after the map), p1 − λ·p2 for DIFF and
symmetric DIFF, p₂ₕ − σ(λₜ)·p₂ₕ₊₁ for DIFF V2; a kind added later reports its own through the same
tap. The differential maps are signed, so the ratio needs a definition there; this one takes the
magnitude |A|: a negative weight subtracts that position's value from the output, in proportion to
|A|, so the head reads that position as surely as with a positive weight. The alternatives were
weighed: the positive part would call a head that cancels the context's noise "not looking at the
context", and a ratio per softmax map would measure maps the model never uses alone (p2 is only
ever subtracted). For softmax maps |A| = A, so the definition is the paper's there.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..attention import AttentionTap
from ..ops import AttentionMaps

LOOKBACK_DEFINITION = (
    "lookback ratio (Chuang et al. 2024): per layer and head, for each row i that produces an answer token, "
    "LR = C / (C + N) with C the mean of |A[i, j]| over the context j < m and N the mean of |A[i, j]| over "
    "m <= j <= i, m the first position of the answer marker (the context is everything before it, the new "
    "tokens the marker and the answer so far); A the effective map the model uses (softmax; p1 - lambda*p2 for "
    "DIFF; p_2h - sigmoid(lambda)*p_2h+1 for DIFF V2), its magnitude |A| because differential maps are signed "
    "(a negative weight subtracts that position's value: the head reads it); |A| = A for softmax maps. An "
    "answer's ratio is the mean over its rows."
)

Probe = tuple[int, int]  # (absolute position of a row that produces an answer token, context end m)


def head_means(ratios: Sequence[Tensor]) -> Tensor:
    """(N, L): each answer's lookback ratio per layer, the mean over its heads ((L, H) each), a head
    whose ratio is undefined (NaN: no attention on context or new tokens) left out of the mean."""
    return torch.stack(list(ratios)).double().nanmean(dim=2)


def lookback_ratios(rows: Tensor, positions: Sequence[int], context_ends: Sequence[int]) -> Tensor:
    """The lookback ratio of rows of one example's map: ``rows`` (H, R, S) holds row r of every head,
    the query at absolute position ``positions[r]`` over keys 0 … S − 1 (later keys are masked: 0);
    ``context_ends[r]`` is that row's m. Returns (H, R) fp32; NaN where the row is all zero."""
    if rows.dim() != 3 or rows.shape[1] != len(positions) or len(positions) != len(context_ends):
        raise ValueError(f"rows {tuple(rows.shape)} must be (H, R, S) with R = {len(positions)} positions and "
                         f"{len(context_ends)} context ends")
    keys = torch.arange(rows.shape[-1], device=rows.device)
    at = torch.tensor(list(positions), device=rows.device)[:, None]  # (R, 1)
    end = torch.tensor(list(context_ends), device=rows.device)[:, None]
    if bool((end < 1).any()) or bool((end > at).any()) or bool((at >= rows.shape[-1]).any()):
        raise ValueError(f"need 1 <= context end <= position < S={rows.shape[-1]}, got positions "
                         f"{list(positions)} and context ends {list(context_ends)}")
    context, new = (keys < end).float(), ((keys >= end) & (keys <= at)).float()  # (R, S) each
    magnitude = rows.float().abs()
    on_context = (magnitude * context).sum(-1) / context.sum(-1)  # (H, R): the mean per context token
    on_new = (magnitude * new).sum(-1) / new.sum(-1)
    return on_context / (on_context + on_new)  # 0 / 0 = NaN for an all-zero row


class LookbackTap(AttentionTap):
    """Records, per layer, the lookback ratio of chosen rows: ``probes[b]`` lists (position, context
    end) of batch row b, positions absolute in the sequence. The call may continue a KV cache: its
    T queries are then the last T of the S positions the maps cover. ``ratios[layer][b]`` is (H, R_b)."""

    def __init__(self, probes: Sequence[Sequence[Probe]]) -> None:
        self.probes = [list(p) for p in probes]
        self.ratios: dict[int, list[Tensor]] = {}

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        combined = maps.combined  # (B, H, T, S)
        if combined.shape[0] != len(self.probes):
            raise ValueError(f"{len(self.probes)} probe lists for a batch of {combined.shape[0]}")
        offset = combined.shape[-1] - combined.shape[-2]  # absolute position of the call's first query
        out = []
        for b, probes in enumerate(self.probes):
            positions = [p for p, _ in probes]
            queries = torch.tensor([p - offset for p in positions], device=combined.device)
            rows = combined[b].index_select(1, queries)  # (H, R, S)
            out.append(lookback_ratios(rows, positions, [m for _, m in probes]).cpu())
        self.ratios[layer_index] = out

    def per_example(self) -> list[Tensor]:
        """Every example's ratios (L, H, R_b), layers in order."""
        layers = sorted(self.ratios)
        return [torch.stack([self.ratios[layer][b] for layer in layers]) for b in range(len(self.probes))]
