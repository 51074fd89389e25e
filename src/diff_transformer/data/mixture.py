"""Mixing generated examples into corpus batches: :class:`MixedBatches`.

For a mixture such as {"needle": 0.1}, each sample index i is replaced, with probability 0.1
decided by (seed, i) alone, by an example from ``synthetic.GENERATORS["needle"]``; the other
samples are the corpus windows of :class:`TokenShards`. Like the corpus windows, a generated
example depends only on (seed, i), so batches cut across ranks and resumed runs stay exact.
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence

import numpy as np
import torch

from ..loss import IGNORE_INDEX
from . import synthetic
from .shards import (
    STREAM_MIX_CHOICE, STREAM_MIX_EXAMPLE, TokenShards, as_sample_indices, keyed_hash, keyed_uniform, seed_word,
)


class MixedBatches:
    """Corpus batches from ``shards`` with a fraction of samples replaced by generated examples.

        train = MixedBatches(TokenShards(data_dir, "train"), {"needle": 0.1})
        inputs, targets = train.get_batch(range(8), seq_len=256, seed=0)  # same interface as TokenShards

    ``mix`` maps generator names (keys of ``synthetic.GENERATORS``) to fractions in [0, 1] that sum
    to at most 1. A generated example's ``loss_mask`` turns the excluded targets into -100. Its
    ``filler`` draws corpus tokens from the same split.
    """

    def __init__(self, shards: TokenShards, mix: Mapping[str, float], tokenizer=None) -> None:
        unknown = [name for name in mix if name not in synthetic.GENERATORS]
        if unknown:
            known = ", ".join(sorted(synthetic.GENERATORS)) or "none registered"
            raise ValueError(f"unknown generator(s) {', '.join(map(repr, unknown))} in the mixture (known: {known})")
        for name, fraction in mix.items():
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"mixture fraction of {name!r} must be in [0, 1], got {fraction}")
        if sum(mix.values()) > 1.0 + 1e-9:
            raise ValueError(f"mixture fractions sum to {sum(mix.values())}, more than 1")
        self.shards = shards
        self.mix = {name: float(mix[name]) for name in sorted(mix)}  # sorted: the draw ignores dict order
        self.tokenizer = tokenizer if tokenizer is not None else shards.tokenizer
        self.num_tokens, self.vocab_size, self.eos_id = shards.num_tokens, shards.vocab_size, shards.eos_id

    def __repr__(self) -> str:
        return f"MixedBatches({self.shards!r}, {self.mix})"

    def choices(self, sample_indices, *, seed: int) -> list[str | None]:
        """The generator name that replaces each sample, or None where the corpus window stays."""
        indices = as_sample_indices(sample_indices)
        uniform = keyed_uniform(seed_word(seed), STREAM_MIX_CHOICE, indices)  # compared with cumulative fractions
        bounds = np.cumsum(list(self.mix.values()))
        names = list(self.mix)
        return [names[k] if k < len(names) else None for k in np.searchsorted(bounds, uniform, side="right")]

    def _filler(self, rng: random.Random, n: int) -> list[int]:
        """``n`` consecutive corpus tokens of the split, from a position drawn with ``rng``."""
        return self.shards.read(rng.randrange(max(1, self.shards.num_tokens - n)), n)

    def generate(self, name: str, sample_index: int, seq_len: int, *, seed: int) -> tuple[list[int], list[bool] | None]:
        """The generated example (tokens, loss_mask) for one sample, checked against the protocol."""
        example_seed = int(keyed_hash(seed_word(seed), STREAM_MIX_EXAMPLE, sample_index)[0])
        tokens, loss_mask = synthetic.GENERATORS[name](random.Random(example_seed), self.tokenizer, seq_len,
                                                       self._filler)
        if len(tokens) != seq_len + 1:
            raise ValueError(f"generator {name!r} returned {len(tokens)} tokens; expected length + 1 = {seq_len + 1}")
        if loss_mask is not None and len(loss_mask) != seq_len:
            raise ValueError(f"generator {name!r} returned a loss_mask of {len(loss_mask)}; "
                             f"expected length = {seq_len}")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"generator {name!r} returned token ids outside [0, {self.vocab_size})")
        return tokens, loss_mask

    def get_batch(self, sample_indices: Sequence[int], seq_len: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (B, seq_len) int64: corpus windows, some replaced by generated examples."""
        indices = as_sample_indices(sample_indices)
        inputs, targets = self.shards.get_batch(indices, seq_len, seed=seed)
        for row, name in enumerate(self.choices(indices, seed=seed)):
            if name is None:
                continue
            tokens, loss_mask = self.generate(name, int(indices[row]), seq_len, seed=seed)
            example = torch.tensor(tokens, dtype=torch.int64)
            inputs[row], targets[row] = example[:-1], example[1:]
            if loss_mask is not None:
                targets[row, ~torch.tensor(loss_mask, dtype=torch.bool)] = IGNORE_INDEX
        return inputs, targets

    def windows_per_epoch(self, seq_len: int) -> int:
        return self.shards.windows_per_epoch(seq_len)

    def val_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The corpus validation windows of the underlying shards (no generated examples)."""
        return self.shards.val_batches(num_batches, batch_size, seq_len)
