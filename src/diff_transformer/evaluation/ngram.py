"""The trivial baselines of language modelling: the validation cross-entropy of a unigram and of a
bigram table fitted on a dataset's training split.

A language model that has not passed the bigram table has learned little beyond which token tends to
follow which; its attention has hardly been used, so a comparison of attention kinds there says
nothing about attention. Every language-modelling figure of the project's reports stands beside
these two numbers, and a verdict is drawn only where the models are below the bigram by a margin
(:data:`LEARNED_MARGIN`).

- unigram: p(b) = (c(b) + 1) / (N + V), add-one smoothing over the vocabulary V;
- bigram: p(b | a) = (c(a, b) + α · p_uni(b)) / (c(a) + α), the counts interpolated with the
  unigram by a Dirichlet prior of strength α (MacKay & Peto 1995), α the best of a grid of powers
  of ten on the validation split itself (so the reference is, if anything, stronger than a bigram
  fitted without seeing it).

Both are measured on every token of the validation split after the first (the bigram needs the one
before), in nats per token, computed once per dataset and cached beside the embedded corpus
(keyed by the dataset's content fingerprint). A split longer than :data:`MAX_TRAIN_TOKENS` /
:data:`MAX_VAL_TOKENS` is read as evenly spaced stretches of that many tokens in all (the pair keys
are int64: a corpus of billions of tokens would not fit in memory otherwise); the reference says how
many it read.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..files import cache_root, write_text_atomically

LEARNED_MARGIN = 0.1  # nats: a language model is judged only this far below its data's bigram or further
ALPHAS = tuple(10.0 ** k for k in range(-2, 5))  # the Dirichlet strengths tried (0.01 … 10,000)
CACHE_VERSION = 2
MAX_TRAIN_TOKENS = 50_000_000  # the tables' counts: more changes a bigram's loss by far less than its margin
MAX_VAL_TOKENS = 5_000_000
STRETCHES = 64  # a long split is read as this many evenly spaced stretches


@dataclass(frozen=True)
class NgramReference:
    """The unigram and bigram validation cross-entropy of one dataset, in nats per token."""

    dataset: str  # the dataset as the config names it (or its folder)
    unit: str  # "token" or "byte": what a nat is per
    vocab_size: int
    train_tokens: int
    val_tokens: int
    unigram: float
    bigram: float
    bigram_alpha: float  # the Dirichlet strength chosen
    margin: float = LEARNED_MARGIN  # how far below the bigram a model must be to be judged

    @property
    def learned_below(self) -> float:
        """The loss under which a model counts as having learned past the bigram."""
        return self.bigram - self.margin

    def learned(self, loss: float | None) -> bool:
        return loss is not None and math.isfinite(loss) and loss <= self.learned_below

    def text(self) -> str:
        """"unigram 3.24, bigram 2.44 nats/byte" (the bigram's smoothing in words)."""
        return (f"the data's unigram {self.unigram:.3f} and bigram {self.bigram:.3f} nats/{self.unit} "
                f"(tables fitted on the {self.train_tokens:,} training tokens, measured on the "
                f"{self.val_tokens:,} validation tokens; the bigram interpolated with the unigram, "
                f"Dirichlet α = {self.bigram_alpha:g})")

    def to_dict(self) -> dict:
        return asdict(self)


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Mean −ln p(b) over ``val[1:]`` (the tokens the bigram also predicts), add-one smoothing."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    p = (counts + 1.0) / (len(train) + vocab_size)
    return float(-np.log(p[val[1:]]).mean())


def bigram_cross_entropies(train: np.ndarray, val: np.ndarray, vocab_size: int,
                           alphas: Sequence[float] = ALPHAS) -> dict[float, float]:
    """Mean −ln p(val[i] | val[i−1]) over i ≥ 1 for each Dirichlet strength α (module docstring).

    Sparse: the pairs are counted by sorting their keys a·V + b, so a vocabulary of 100K costs no
    V² table."""
    train, val = train.astype(np.int64), val.astype(np.int64)
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    unigram = (counts + 1.0) / (len(train) + vocab_size)
    keys, pair_counts = np.unique(train[:-1] * vocab_size + train[1:], return_counts=True)
    context = np.bincount(train[:-1], minlength=vocab_size).astype(np.float64)  # c(a): pairs starting at a
    asked = val[:-1] * vocab_size + val[1:]
    where = np.minimum(np.searchsorted(keys, asked), len(keys) - 1)
    seen = np.where(keys[where] == asked, pair_counts[where], 0).astype(np.float64)
    prior, c_a = unigram[val[1:]], context[val[:-1]]
    return {alpha: float(-np.log((seen + alpha * prior) / (c_a + alpha)).mean()) for alpha in alphas}


def ngram_reference_of(train: np.ndarray, val: np.ndarray, vocab_size: int, *, dataset: str = "",
                       unit: str = "token") -> NgramReference:
    """The reference of token arrays (each split one stream, documents back to back)."""
    if len(train) < 2 or len(val) < 2:
        raise ValueError(f"n-gram reference of {dataset or 'the data'}: needs two tokens or more in each split "
                         f"(train {len(train)}, val {len(val)})")
    bigrams = bigram_cross_entropies(train, val, vocab_size)
    alpha = min(bigrams, key=bigrams.get)
    unigram = unigram_cross_entropy(train, val, vocab_size)
    return NgramReference(dataset, unit, vocab_size, len(train), len(val), unigram, bigrams[alpha], alpha)


def spread_stretches(tokens: np.ndarray, limit: int, stretches: int = STRETCHES) -> np.ndarray:
    """``tokens`` whole when it holds at most ``limit``, else ``stretches`` evenly spaced runs of
    ``limit // stretches`` tokens back to back (the pairs across their joins: 63 in 50M, nothing)."""
    if len(tokens) <= limit:
        return np.asarray(tokens)
    length = limit // stretches
    starts = np.linspace(0, len(tokens) - length, stretches).astype(np.int64)
    return np.concatenate([np.asarray(tokens[s:s + length]) for s in starts])


def _dataset_key(directory: Path) -> str:
    """The dataset's content fingerprint (meta.json records one; else meta.json's own bytes)."""
    meta = (directory / "meta.json").read_bytes()
    fingerprint = json.loads(meta).get("fingerprint") or hashlib.sha256(meta).hexdigest()
    return hashlib.sha256(f"{fingerprint} ngram {CACHE_VERSION} {ALPHAS}".encode()).hexdigest()[:16]


def ngram_reference(dataset: str, cache_dir: str | Path | None = None) -> NgramReference:
    """The n-gram reference of data.dataset ``dataset`` (the embedded corpus by name, or a prepared
    folder), computed once and cached (a few seconds for the embedded corpus)."""
    from ..data.corpus import dataset_directory
    from ..data.shards import TokenShards

    directory = dataset_directory(dataset, cache_dir, progress=False)
    cached = cache_root(cache_dir) / f"ngram-{_dataset_key(directory)}.json"
    if cached.is_file():
        try:
            return NgramReference(**{**json.loads(cached.read_text()), "dataset": dataset, "margin": LEARNED_MARGIN})
        except (ValueError, TypeError):
            pass  # a damaged cache entry: computed again and replaced below
    train, val = TokenShards(directory, "train"), TokenShards(directory, "val")
    unit = "byte" if train.meta.get("tokenizer") == "bytes" else "token"
    reference = ngram_reference_of(spread_stretches(train.tokens, MAX_TRAIN_TOKENS),
                                   spread_stretches(val.tokens, MAX_VAL_TOKENS), train.vocab_size,
                                   dataset=dataset, unit=unit)
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(cached, json.dumps(reference.to_dict(), indent=1))
    return reference
