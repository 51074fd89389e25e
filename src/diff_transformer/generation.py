"""Autoregressive generation with the KV cache: greedy, temperature, top-k, top-p, stop tokens.

Prompts of different lengths are left-padded; the padding is masked out of attention, and since
RoPE only sees relative positions, a padded row generates exactly what it would alone.

``compile=True`` decodes into a :class:`~diff_transformer.cache.StaticKVCache` and runs every
one-token step through ``torch.compile(model)`` (``mode="reduce-overhead"``, i.e. CUDA graphs, on
CUDA; the prompt's forward stays eager). Every step has the same shapes, so one graph serves them
all without ``dynamic=True``; on small models, where operator calls cost about half of an eager
decoding step, the fused step is what makes DIFF decode as fast as the Transformer
(BENCHMARKS.md). The first call compiles (seconds).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Iterator, Sequence

import torch
from torch import Tensor


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits (B, V) -> next tokens (B,). temperature 0 means greedy (argmax)."""
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not _is_number(temperature) or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and not (_is_int(top_k) and top_k >= 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (_is_number(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def _is_int(value) -> bool:
    """An integer, a NumPy one included (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_array(value) -> bool:
    """A tensor or an array (NumPy's, or any with a shape and tolist)."""
    return isinstance(value, Tensor) or (hasattr(value, "shape") and hasattr(value, "tolist"))


def check_generation_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens) -> list[int]:
    """A TypeError / ValueError naming the argument and its value for anything :func:`stream`
    cannot take; returns ``stop_tokens`` as a list."""
    vocab = model.config.vocab_size
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts must be a list of token-id lists, got a {type(prompts).__name__}; "
                        f"encode the text first: [tokenizer.encode(text)]")
    if _is_array(prompts):
        kind = "tensor" if isinstance(prompts, Tensor) else "array"
        raise TypeError(f"prompts must be a list of token-id lists, got {'a' if kind == 'tensor' else 'an'} {kind} of "
                        f"shape {tuple(prompts.shape)}; pass {kind}.tolist() (one list per row, no padding)")
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r}")
    for i, prompt in enumerate(prompts):
        if _is_int(prompt):
            raise TypeError(f"prompts[{i}] is the integer {prompt}: prompts is a list of prompts, each a list of "
                            f"token ids, e.g. [[1, 2, 3]], not [1, 2, 3]")
        if isinstance(prompt, (str, bytes)) or _is_array(prompt) or not isinstance(prompt, Sequence):
            hint = "; pass .tolist()" if _is_array(prompt) else ""
            raise TypeError(f"prompts[{i}] must be a list of token ids, got {type(prompt).__name__}{hint}")
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token (e.g. end-of-text)")
        for j, token in enumerate(prompt):
            if not _is_int(token) or not 0 <= token < vocab:
                raise ValueError(f"prompts[{i}][{j}] = {token!r} is not a token id in [0, vocab_size={vocab})")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    context, longest = model.config.max_seq_len, max(len(p) for p in prompts)  # rows are left-padded to it
    if longest + max_new_tokens > context:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len="
                         f"{context}, the model's context: at most {max(context - longest, 0)} new tokens fit after "
                         f"this prompt")
    _check_sampling(temperature, top_k, top_p)
    if isinstance(stop_tokens, (str, bytes, Tensor)) or not isinstance(stop_tokens, Iterable):
        raise TypeError(f"stop_tokens must be a list of token ids, e.g. [eos_id], got {stop_tokens!r}")
    stops = list(stop_tokens)
    for token in stops:
        if not _is_int(token) or not 0 <= token < vocab:
            raise ValueError(f"stop_tokens: {token!r} is not a token id in [0, vocab_size={vocab})")
    return stops


def _left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    real = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            real[i, width - len(p) :] = True
    return tokens, real


def stream(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    compile: bool = False,
    vocab_limit: int | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row, (B,), until all rows stopped or max_new_tokens.

    A row that produced a stop token keeps being padded with that token in later steps. With
    ``vocab_limit``, only ids below it are sampled: a tokenizer of fewer ids than the model's
    vocabulary (padded, or trained on a smaller one) has no text for the others. Every argument is
    checked first (:func:`check_generation_arguments`), when ``stream`` is called: the prompt and
    the new tokens must fit in the model's context (``max_seq_len``).
    """
    stop_tokens = check_generation_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens)
    _check_vocab_limit(model, vocab_limit)
    return _stream(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, generator, compile,
                   vocab_limit)


def _check_vocab_limit(model, vocab_limit) -> None:
    vocab = model.config.vocab_size
    if vocab_limit is not None and (not _is_int(vocab_limit) or not 1 <= vocab_limit <= vocab):
        raise ValueError(f"vocab_limit must be an integer in [1, vocab_size={vocab}], got {vocab_limit!r}")


@torch.no_grad()
def _stream(
    model, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, generator, compile, vocab_limit
) -> Iterator[Tensor]:
    """:func:`stream` on checked arguments."""
    if max_new_tokens == 0:
        return
    device = model.embed.weight.device
    tokens, real = _left_pad(prompts, device)
    total = tokens.shape[1] + max_new_tokens
    cache = model.new_cache(len(prompts), total, static=compile)
    stops = torch.tensor(stop_tokens, dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    padding = None if bool(real.all()) else real
    logits, _ = model(tokens, cache=cache, padding_mask=padding, logits_to_keep=1)  # the prompt's last row only
    if compile:  # the static cache keeps the padding flags: later steps pass none
        padding = None
        mode = "reduce-overhead" if device.type == "cuda" else None
        one_token_step = torch.compile(model, mode=mode)  # dynamo caches per model
    else:
        one_token_step = model
    for step in range(max_new_tokens):
        last = logits[:, -1]  # (B, V)
        if vocab_limit is not None and vocab_limit < last.shape[-1]:
            last = last.clone()
            last[:, vocab_limit:] = float("-inf")  # ids the tokenizer has no text for are never drawn
        nxt = sample_next(last, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        nxt = torch.where(done, tokens[:, -1], nxt)
        done |= torch.isin(nxt, stops)
        yield nxt
        if step == max_new_tokens - 1 or bool(done.all()):
            return
        tokens = nxt[:, None]
        if padding is not None:
            padding = torch.cat([padding, torch.ones_like(padding[:, :1])], dim=1)
        logits, _ = one_token_step(tokens, cache=cache, padding_mask=padding, check_ids=False)  # ids it sampled


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    generator: torch.Generator | None = None,
    compile: bool = False,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (a list of token ids), stop token excluded; ``vocab_limit`` as
    for :func:`stream`."""
    stop_tokens = check_generation_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens)
    was_training = model.training
    model.eval()
    rows: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    stop_set = set(stop_tokens)
    try:
        for step in stream(
            model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_tokens=stop_tokens, generator=generator, compile=compile, vocab_limit=vocab_limit,
        ):
            for i, tok in enumerate(step.tolist()):
                if finished[i]:
                    continue
                if tok in stop_set:
                    finished[i] = True
                else:
                    rows[i].append(tok)
    finally:
        model.train(was_training)
    return rows
