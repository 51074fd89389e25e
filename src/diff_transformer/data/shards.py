"""Training batches from a prepared dataset: :class:`TokenShards`.

Sample index i (0, 1, 2, ...) maps to a window of ``seq_len + 1`` tokens of the split, and the map
depends on nothing but the seed and i. The trainer gives each rank and micro-batch its own
global sample indices (step * global_batch + ...), so a global batch can be cut any way across
ranks, and resuming at step s reproduces the data exactly, with no data-loader state to save.

By default the map walks the split in epochs. Epoch e = i // W (W windows per epoch) starts at a
seeded offset in [0, seq_len) and cuts the split into W back-to-back windows; sample i takes
window perm_e(i % W), where perm_e is a seeded pseudo-random permutation of range(W) (a small
Feistel network, so no permutation table is stored). Every epoch thus sees every token once, in
a new order and with new window boundaries. Windows run across document boundaries.

Within documents (``within_documents=True``, for long-context training) a window never crosses
a document boundary: only documents of at least seq_len + 1 tokens (their end-of-text token
included) give windows, and sample i draws one independently, from (seed, i) alone: a document
with probability proportional to weight × its number of window starts (length − seq_len), then
a start uniformly among those. The weight is ``long_document_weight`` for documents of at least
``long_document_tokens`` tokens and 1 for the others, so a weight above 1 up-samples long
documents. Up-sampling works on windows across documents too: a window then starts anywhere it
fits in the split, in document d with probability proportional to weight × the starts in d.
Where each document ends is stored beside the shards (DIR/<split>.document_ends.npy).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..tokenizer import load_tokenizer
from .prepare import SPLITS, read_meta

# Streams of the keyed hash, so that the order, the offsets, the mixture and the documents draw
# independent numbers.
STREAM_ORDER, STREAM_OFFSET, STREAM_MIX_CHOICE, STREAM_MIX_EXAMPLE = 1, 2, 3, 4
STREAM_DOCUMENT, STREAM_DOCUMENT_START = 5, 6

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


def keyed_uniform(*words) -> np.ndarray:
    """A uniform float64 in [0, 1) per element of the broadcast words (53 bits of :func:`keyed_hash`)."""
    return (keyed_hash(*words) >> np.uint64(11)).astype(np.float64) / 2.0**53


def document_windows(document_ends: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents that hold a window of ``seq_len + 1`` tokens: (first token, number of window
    starts = length − seq_len, length), each an int64 array over those documents, in order."""
    ends = np.asarray(document_ends, dtype=np.int64)
    firsts = np.concatenate([[0], ends[:-1]])
    counts = ends - firsts - seq_len
    fits = counts > 0
    return firsts[fits], counts[fits], (ends - firsts)[fits]


def spread_document_windows(document_ends: np.ndarray, seq_len: int, n: int, *, heldout: int = 0) -> np.ndarray:
    """``n`` window starts evenly spaced over every start of a ``seq_len + 1`` window that lies within
    one document (all of them, documents in order, counted together), deterministic: fixed
    evaluation windows; with ``heldout``, that many starts between those n instead
    (:func:`heldout_positions`). A ValueError if no document is long enough."""
    firsts, counts, _ = document_windows(document_ends, seq_len)
    if not len(counts):
        longest = int(np.diff(np.concatenate([[0], np.asarray(document_ends, dtype=np.int64)])).max(initial=0))
        raise ValueError(f"no document holds a window of seq_len {seq_len} (+1 target): the longest has "
                         f"{longest} tokens; use a shorter seq_len or longer documents")
    last = int(counts.sum()) - 1
    if heldout:
        positions = heldout_positions(last, n, heldout, seq_len)
    else:
        positions = np.linspace(0, last, n).round().astype(np.int64)
    before = np.cumsum(counts) - counts  # valid starts of the documents before each one
    document = np.searchsorted(before, positions, side="right") - 1
    return firsts[document] + positions - before[document]


def heldout_positions(last: int, validation: int, count: int, seq_len: int) -> np.ndarray:
    """``count`` window positions in [0, ``last``] that none of the ``validation`` windows evenly spaced
    over it (np.linspace(0, last, validation)) overlaps: each midway between two consecutive ones, the
    gaps taken evenly (``count`` ≤ ``validation`` − 1). A ValueError when a gap is too short to hold a
    window of ``seq_len + 1`` tokens clear of both neighbours."""
    if not 1 <= count < validation:
        raise ValueError(f"held-out windows lie between the {validation} validation windows: at most "
                         f"{validation - 1}, got {count}")
    spacing = last / (validation - 1)
    if spacing / 2 < seq_len + 2:  # each start rounded: a token to spare either side
        raise ValueError(f"{validation} validation windows lie {spacing:,.0f} tokens apart, too close for held-out "
                         f"windows of seq_len {seq_len} (+1 target) between them; use fewer eval windows or a "
                         "longer validation split")
    gaps = np.linspace(0, validation - 2, count).round()
    return ((gaps + 0.5) * spacing).round().astype(np.int64)


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
        long = TokenShards("data/corpus", "train", within_documents=True,     # windows inside documents,
                           long_document_tokens=4096, long_document_weight=4)  # those of 4,096+ tokens 4x as often

    ``within_documents`` also makes :meth:`val_batches` take its windows within documents.
    """

    def __init__(self, directory: str | Path, split: str = "train", *, within_documents: bool = False,
                 long_document_tokens: int | None = None, long_document_weight: float = 1.0) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not long_document_weight > 0:
            raise ValueError(f"long_document_weight must be positive, got {long_document_weight}")
        if long_document_weight != 1.0 and long_document_tokens is None:
            raise ValueError("long_document_weight up-samples the long documents: it needs long_document_tokens "
                             "(how many tokens make a document long)")
        if long_document_tokens is not None and long_document_tokens <= 0:
            raise ValueError(f"long_document_tokens must be positive, got {long_document_tokens}")
        self.directory, self.split = Path(directory), split
        self.within_documents = within_documents
        self.long_document_tokens, self.long_document_weight = long_document_tokens, float(long_document_weight)
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
        if (within_documents or long_document_weight != 1.0) and self.document_ends is None:
            raise ValueError(f"{self.directory} records no document boundaries (it was prepared by an earlier "
                             f"version of diff-transformer): prepare it again to sample windows within documents "
                             f"or to up-sample long documents")
        self._samplers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # seq_len -> see _document_sampler

    @functools.cached_property
    def document_ends(self) -> np.ndarray | None:
        """Where each document of the split ends (the position after its end-of-text token), int64
        ascending; None for a dataset prepared before they were recorded."""
        name = self.meta[self.split].get("document_ends")
        if name is None:
            return None
        path = self.directory / name
        try:
            ends = np.load(path, allow_pickle=False).astype(np.int64)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable document ends ({exc}); prepare the dataset again") from None
        documents = self.meta[self.split]["documents"]
        if (len(ends) != documents or (len(ends) and ends[-1] != self.num_tokens)
                or (np.diff(ends, prepend=0) <= 0).any()):
            raise ValueError(f"{path}: does not describe the {documents} documents of {self.num_tokens} tokens in "
                             f"meta.json; prepare the dataset again")
        return ends

    def __repr__(self) -> str:
        return (f"TokenShards({str(self.directory)!r}, {self.split!r}: {self.num_tokens:,} tokens, "
                f"vocab {self.vocab_size})")

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

    def _document_sampler(self, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first token, number of window starts, cumulative weight of the starts) per document that
        holds one, for the weighted draw at this ``seq_len``: starts that keep the window inside the
        document (within documents), or any start that fits in the split (windows across documents,
        long documents up-sampled)."""
        if seq_len not in self._samplers:
            if seq_len < 1:
                raise ValueError(f"seq_len must be >= 1, got {seq_len}")
            if self.within_documents:
                firsts, counts, lengths = document_windows(self.document_ends, seq_len)
                if not len(counts):
                    longest = int(np.diff(self.document_ends, prepend=0).max(initial=0))
                    raise ValueError(f"no document of the {self.split} split of {self.directory} holds a window of "
                                     f"seq_len {seq_len} (+1 target): the longest has {longest} tokens")
            else:
                self._epoch_layout(seq_len)  # the split holds a window: else its error
                ends = self.document_ends
                firsts = np.concatenate([[0], ends[:-1]])
                counts, lengths = np.minimum(ends, self.num_tokens - seq_len) - firsts, ends - firsts
                fits = counts > 0
                firsts, counts, lengths = firsts[fits], counts[fits], lengths[fits]
            long = lengths >= self.long_document_tokens if self.long_document_tokens else np.zeros(len(counts), bool)
            weights = np.where(long, self.long_document_weight, 1.0)
            self._samplers[seq_len] = firsts, counts, np.cumsum(counts * weights)
        return self._samplers[seq_len]

    def window_starts(self, sample_indices, seq_len: int, *, seed: int) -> np.ndarray:
        """The first token position of each sample's window (see the module docstring)."""
        indices = as_sample_indices(sample_indices)
        if self.within_documents or self.long_document_weight != 1.0:
            firsts, counts, cumulative = self._document_sampler(seq_len)
            drawn = keyed_uniform(seed_word(seed), STREAM_DOCUMENT, indices) * cumulative[-1]
            document = np.minimum(np.searchsorted(cumulative, drawn, side="right"), len(counts) - 1)
            offset = keyed_uniform(seed_word(seed), STREAM_DOCUMENT_START, indices) * counts[document]
            return firsts[document] + np.minimum(offset.astype(np.int64), counts[document] - 1)
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
        to hold them all side by side. Within documents, evenly spaced over the windows that lie
        within one document (every document weighs by its length: no up-sampling)."""
        if num_batches < 1 or batch_size < 1:
            raise ValueError(f"num_batches and batch_size must be >= 1, got {num_batches} and {batch_size}")
        if self.within_documents:
            try:
                starts = spread_document_windows(self.document_ends, seq_len, num_batches * batch_size)
            except ValueError as exc:
                raise ValueError(f"the {self.split} split of {self.directory}: {exc}") from None
            return [self.read_windows(chunk, seq_len) for chunk in starts.reshape(num_batches, batch_size)]
        last_start = self.num_tokens - seq_len - 1
        if last_start < 0:
            raise ValueError(
                f"the {self.split} split of {self.directory} has {self.num_tokens} tokens, too few for a "
                f"window of seq_len {seq_len} (+1 target)"
            )
        starts = np.linspace(0, last_start, num_batches * batch_size).round().astype(np.int64)
        return [self.read_windows(chunk, seq_len) for chunk in starts.reshape(num_batches, batch_size)]

    def heldout_windows(self, validation: int, count: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of ``count`` windows that none of the ``validation`` windows of
        ``val_batches(1, validation, seq_len)`` overlaps: a second held-out set (:func:`heldout_positions`;
        within documents, between them in the same way)."""
        try:
            if self.within_documents:
                starts = spread_document_windows(self.document_ends, seq_len, validation, heldout=count)
            else:
                starts = heldout_positions(self.num_tokens - seq_len - 1, validation, count, seq_len)
        except ValueError as exc:
            raise ValueError(f"the {self.split} split of {self.directory}: {exc}") from None
        return self.read_windows(starts, seq_len)

    def read(self, start: int, length: int) -> list[int]:
        """``length`` tokens from position ``start``, wrapping around the end of the split."""
        if self.num_tokens == 0:
            raise ValueError(f"the {self.split} split of {self.directory} is empty")
        positions = (start + np.arange(length)) % self.num_tokens
        return self.tokens[positions].astype(np.int64).tolist()
