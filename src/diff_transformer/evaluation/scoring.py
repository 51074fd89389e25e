"""Batched scoring of a model: per-token NLL of windows, log-probabilities of choices and
sequences, greedy decoding, and a fingerprint of the scored windows."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import LanguageModel


@torch.no_grad()
def token_nll(model: LanguageModel, windows: Tensor, batch_size: int = 8) -> Tensor:
    """Per-token negative log-likelihood (N, T) fp32 of windows (N, T + 1): NLL of windows[:, t+1]."""
    device = model.embed.weight.device
    out = []
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        logits, _ = model(batch[:, :-1])
        nll = F.cross_entropy(logits.float().transpose(1, 2), batch[:, 1:], reduction="none")
        out.append(nll.cpu())
    return torch.cat(out)


@torch.no_grad()
def score_choices(
    model: LanguageModel,
    prefix: Sequence[int],
    queries: Sequence[Sequence[int]],
    choices: Sequence[Sequence[int]],
    *,
    batch_size: int = 64,
) -> list[list[float]]:
    """``scores[i][c]``: the summed log-probability of ``choices[c]`` after ``prefix + queries[i]``.

    Constrained decoding without re-running shared context: the prefix runs once into a KV cache,
    queries of equal length run together on copies of it, and every choice branches off its
    query's cache (choices of one token need no further pass: the query's last logits score them).
    """
    if not prefix or any(len(q) == 0 for q in queries) or any(len(c) == 0 for c in choices):
        raise ValueError("score_choices needs a non-empty prefix, queries and choices")
    device = model.embed.weight.device
    n_choices, width = len(choices), max(len(c) for c in choices)
    capacity = len(prefix) + max(len(q) for q in queries) + width
    if capacity > model.config.max_seq_len:
        raise ValueError(f"prefix + query + choice ({capacity} tokens) exceeds max_seq_len={model.config.max_seq_len}")
    prefix_cache = model.new_cache(1, capacity)
    model(torch.tensor([list(prefix)], device=device), cache=prefix_cache, logits_to_keep=1)  # only the cache is wanted
    choice_rows = torch.zeros(n_choices, width, dtype=torch.long, device=device)  # right padding is inert (causal)
    for c, tokens in enumerate(choices):
        choice_rows[c, : len(tokens)] = torch.tensor(list(tokens), device=device)
    scores: list[list[float]] = [[] for _ in queries]
    by_length: dict[int, list[int]] = {}
    for i, q in enumerate(queries):
        by_length.setdefault(len(q), []).append(i)
    per_chunk = max(1, batch_size // n_choices)
    for _length, indices in by_length.items():
        for start in range(0, len(indices), per_chunk):
            chunk = indices[start : start + per_chunk]
            b = len(chunk)
            query_cache = prefix_cache.expand(b)
            queries_in = torch.tensor([list(queries[i]) for i in chunk], device=device)
            query_logits, _ = model(queries_in, cache=query_cache, logits_to_keep=1)  # (b, 1, V)
            rows = choice_rows.repeat(b, 1)  # (b·C, W): query i's choices are rows i·C … i·C + C − 1
            last = query_logits.float().repeat_interleave(n_choices, dim=0)  # predicts each choice's first token
            if width > 1:
                choice_cache = query_cache.expand(n_choices)
                choice_logits, _ = model(rows[:, :-1], cache=choice_cache)
                last = torch.cat([last, choice_logits.float()], dim=1)
            token_logp = last.log_softmax(-1).gather(-1, rows[..., None]).squeeze(-1)  # (b·C, W)
            lengths = torch.tensor([len(c) for c in choices], device=device).repeat(b)
            token_logp = token_logp.masked_fill(torch.arange(width, device=device) >= lengths[:, None], 0.0)
            for j, i in enumerate(chunk):
                scores[i] = token_logp[j * n_choices : (j + 1) * n_choices].sum(-1).tolist()
    return scores


@torch.no_grad()
def score_sequences(
    model: LanguageModel, sequences: Sequence[Sequence[int]], scored_from: Sequence[int], *, batch_size: int = 16
) -> list[float]:
    """Sum of log-probabilities of ``sequence[scored_from:]`` given what precedes it, one full
    forward pass per sequence (batched, right-padded; causal attention makes the padding inert)."""
    device = model.embed.weight.device
    scores: list[float] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        rows = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        for i, seq in enumerate(chunk):
            rows[i, : len(seq)] = torch.tensor(list(seq), device=device)
        logits, _ = model(rows[:, :-1])
        token_logp = logits.float().log_softmax(-1).gather(-1, rows[:, 1:, None]).squeeze(-1)  # (b, W - 1)
        for i, seq in enumerate(chunk):
            first = scored_from[start + i]
            if not 1 <= first < len(seq):
                raise ValueError(f"scored_from={first} must be in [1, {len(seq) - 1}]")
            scores.append(float(token_logp[i, first - 1 : len(seq) - 1].sum()))
    return scores


def greedy_decode(model: LanguageModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop: Sequence[int] = ()) -> list[list[int]]:
    """Greedy continuation of each prompt (temperature 0)."""
    return model.generate([list(p) for p in prompts], max_new_tokens, temperature=0.0, stop_tokens=list(stop))


def windows_fingerprint(windows: Tensor) -> str:
    """A short digest of the token windows, to tell whether two models were scored on the same text."""
    import hashlib

    return hashlib.sha1(windows.to(torch.int64).numpy().tobytes()).hexdigest()[:12]
