"""Training batches from a prepared dataset: :class:`TokenShards`.

Sample index i (0, 1, 2, ...) maps to a window of ``seq_len + 1`` tokens of the split, and the map
depends on nothing but the seed and i. The trainer gives each rank and micro-batch its own
global sample indices (step * global_batch + ...), so a global batch can be cut any way across
ranks, and resuming at step s reproduces the data exactly, with no data-loader state to save.

The map walks the split in epochs. Epoch e = i // W (W windows per epoch) starts at a seeded
offset in [0, seq_len) and cuts the split into W back-to-back windows; sample i takes window
perm_e(i % W), where perm_e is a seeded pseudo-random permutation of range(W) (a small Feistel
network, so no permutation table is stored). Every epoch thus sees every token once, in a new
order and with new window boundaries.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..tokenizer import load_tokenizer
from .prepare import SPLITS, read_meta

# Streams of the keyed hash, so that the order, the offsets and the mixture draw independent numbers.
STREAM_ORDER, STREAM_OFFSET, STREAM_MIX_CHOICE, STREAM_MIX_EXAMPLE = 1, 2, 3, 4

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 arrays that scrambles every bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_hash(*words) -> np.ndarray:
    """A pseudo-random uint64 array from integers or integer arrays (broadcast together); equal
    inputs give equal outputs on every machine. Words must be non-negative."""
    h = np.zeros(1, dtype=np.uint64)
    for word in words:
        w = np.asarray(word)
        if w.dtype != np.uint64:
            w = np.asarray(word, dtype=np.int64)
            if (w < 0).any():
                raise ValueError("keyed_hash takes non-negative integers")
            w = w.astype(np.uint64)
        h = _mix64((h ^ w) + _GOLDEN)
    return h


def seed_word(seed: int) -> np.uint64:
    """Any Python int seed (negative or huge too) as one uint64."""
    return np.uint64(int(seed) % 2**64)


def permute(x: np.ndarray, n: int, key: np.ndarray) -> np.ndarray:
    """perm_key(x) for each x in [0, n): a keyed pseudo-random permutation of range(n).

    A 4-round Feistel network permutes the smallest power-of-4 domain holding n; values that land
    outside [0, n) are permuted again ("cycle walking") until inside, which keeps it a bijection.
    """
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    x = np.asarray(x, dtype=np.uint64).copy()
    key = np.broadcast_to(np.asarray(key, dtype=np.uint64), x.shape)
    pending = np.ones(x.shape, dtype=bool)
    while pending.any():
        y, k = x[pending], key[pending]
        left, right = y >> half, y & mask
        for round_ in range(4):
            left, right = right, left ^ (keyed_hash(k, round_, right) & mask)
        y = (left << half) | right
        x[pending] = y
        pending[pending] = y >= np.uint64(n)
    return x.astype(np.int64)


def as_sample_indices(sample_indices) -> np.ndarray:
    """Sample indices (a list, range, array or tensor) as a 1-D int64 array, checked non-negative."""
    if isinstance(sample_indices, torch.Tensor):
        sample_indices = sample_indices.cpu().numpy()
    indices = np.asarray(sample_indices, dtype=np.int64)
    if indices.ndim != 1:
        raise ValueError(f"sample_indices must be 1-D, got shape {indices.shape}")
    if (indices < 0).any():
        raise ValueError("sample_indices must be non-negative")
    return indices


class TokenShards:
    """One split ("train" or "val") of a prepared dataset, memory-mapped.

        train = TokenShards("data/corpus", "train")
        inputs, targets = train.get_batch(range(0, 8), seq_len=256, seed=0)   # (8, 256) int64 each
    """

    def __init__(self, directory: str | Path, split: str = "train") -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.directory, self.split = Path(directory), split
        self.meta = read_meta(self.directory)
        self.vocab_size: int = self.meta["vocab_size"]
        self.eos_id: int = self.meta["eos_id"]
        self.dtype = np.dtype(self.meta["dtype"])
        self.num_tokens: int = self.meta[split]["tokens"]
        path = self.directory / self.meta[split]["file"]
        expected = self.num_tokens * self.dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            size = path.stat().st_size if path.is_file() else "no"
            raise ValueError(
                f"{path}: {size} bytes, but meta.json says {self.num_tokens} {self.dtype.name} tokens "
                f"({expected} bytes): the dataset is incomplete; prepare it again"
            )
        # np.memmap cannot map an empty file (a split of 0 tokens, e.g. --val-fraction 0).
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r") if self.num_tokens else np.zeros(0, self.dtype)

    def __repr__(self) -> str:
        return f"TokenShards({str(self.directory)!r}, {self.split!r}: {self.num_tokens:,} tokens, vocab {self.vocab_size})"

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer the dataset was prepared with (saved beside the shards)."""
        return load_tokenizer(self.directory)

    def _epoch_layout(self, seq_len: int) -> tuple[int, int]:
        """(windows per epoch, largest epoch offset) for windows of ``seq_len + 1`` tokens."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        usable = self.num_tokens - 1  # consecutive windows share their boundary token
        windows = usable // seq_len
        if windows < 1:
            raise ValueError(
                f"the {self.split} split of {self.directory} has {self.num_tokens} tokens, too few for one "
                f"window of seq_len {seq_len} (+1 target); use a shorter seq_len or more text"
            )
        if windows >= 2:
            windows -= 1  # leave room for an offset of up to seq_len - 1
        return windows, min(seq_len - 1, usable - windows * seq_len)

    def windows_per_epoch(self, seq_len: int) -> int:
        """How many samples one pass over the split takes at this ``seq_len``."""
        return self._epoch_layout(seq_len)[0]

    def window_starts(self, sample_indices, seq_len: int, *, seed: int) -> np.ndarray:
        """The first token position of each sample's window (see the module docstring)."""
        indices = as_sample_indices(sample_indices)
        windows, max_offset = self._epoch_layout(seq_len)
        epochs, positions = indices // windows, indices % windows
        key = keyed_hash(seed_word(seed), STREAM_ORDER, epochs)
        offsets = keyed_hash(seed_word(seed), STREAM_OFFSET, epochs) % np.uint64(max_offset + 1)
        return offsets.astype(np.int64) + permute(positions, windows, key) * seq_len

    def read_windows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (B, seq_len) int64: tokens [s, s+T) and [s+1, s+T+1) per start s."""
        window = self.tokens[np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1)]  # (B, T+1)
        window = torch.from_numpy(window.astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def get_batch(self, sample_indices: Sequence[int], seq_len: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(sample_indices), seq_len) int64, on the CPU.

        Row r is sample ``sample_indices[r]``, which depends only on (seed, that index): a batch
        cut into parts gives the same rows as the whole. Corpus windows have no target excluded
        from the loss (targets of -100 come only from generated examples, see MixedBatches).
        """
        return self.read_windows(self.window_starts(sample_indices, seq_len, seed=seed), seq_len)

    def val_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed list of ``num_batches`` (inputs, targets) batches of ``batch_size`` windows,
        evenly spaced from the start to the end of the split (no seed: every model evaluated with
        the same arguments sees identical tokens). Windows overlap only if the split is too short
        to hold them all side by side."""
        if num_batches < 1 or batch_size < 1:
            raise ValueError(f"num_batches and batch_size must be >= 1, got {num_batches} and {batch_size}")
        last_start = self.num_tokens - seq_len - 1
        if last_start < 0:
            raise ValueError(
                f"the {self.split} split of {self.directory} has {self.num_tokens} tokens, too few for a "
                f"window of seq_len {seq_len} (+1 target)"
            )
        starts = np.linspace(0, last_start, num_batches * batch_size).round().astype(np.int64)
        return [self.read_windows(chunk, seq_len) for chunk in starts.reshape(num_batches, batch_size)]

    def read(self, start: int, length: int) -> list[int]:
        """``length`` tokens from position ``start``, wrapping around the end of the split."""
        if self.num_tokens == 0:
            raise ValueError(f"the {self.split} split of {self.directory} is empty")
        positions = (start + np.arange(length)) % self.num_tokens
        return self.tokens[positions].astype(np.int64).tolist()
