"""Held-out evaluation text: the embedded corpus' validation documents (or a user's own text),
tokenized per tokenizer into streams, windows and filler."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor


def corpus_validation_texts() -> list[str]:
    """The validation documents of the embedded corpus: the same split as ``default_dataset()``
    (by document, seeded), so models trained on the default data never saw this text."""
    from ..data import corpus_documents
    from ..data.corpus import DEFAULT_SPLIT_SEED
    from ..data.prepare import DEFAULT_VAL_FRACTION, cut_text, plan_split

    documents = [text for _, text in corpus_documents()]
    plan = plan_split([len(t.encode("utf-8")) for t in documents], DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED)
    texts = [documents[i] for i in sorted(plan.val)]
    if plan.cut is not None:
        texts.append(cut_text(documents[plan.cut], plan.cut_bytes)[1])
    return texts


def first_chars(texts: Iterable[str], max_chars: int) -> list[str]:
    """The documents of ``texts`` in order up to ``max_chars`` characters in all, the last one cut."""
    out, chars = [], 0
    for text in texts:
        if chars >= max_chars:
            break
        out.append(text[: max_chars - chars])
        chars += len(out[-1])
    return out


class EvalText:
    """Held-out text (the corpus' validation documents by default), tokenized per tokenizer on demand.

    Documents are joined with the end-of-text token, as in training. ``texts`` replaces the
    corpus (tests, or a user's own text), each checked text (no NUL: :mod:`diff_transformer.user_text`).
    """

    def __init__(self, texts: Sequence[str] | None = None, *, max_chars: int = 4_000_000) -> None:
        from ..user_text import checked_text

        for number, text in enumerate(texts or [], start=1):
            checked_text(text, f"evaluation text {number}")
        self._texts = list(texts) if texts is not None else None
        self.max_chars = max_chars
        self._streams: dict[tuple, Tensor] = {}
        self._document_ends: dict[tuple, list[int]] = {}  # per stream: the position after each end-of-text token

    def _load_texts(self) -> list[str]:
        if self._texts is None:
            self._texts = first_chars(corpus_validation_texts(), self.max_chars)
        if not self._texts or not any(t.strip() for t in self._texts):
            raise ValueError("evaluation text is empty")
        return self._texts

    @staticmethod
    def _key(tokenizer) -> tuple:
        return type(tokenizer).__name__, tokenizer.vocab_size, str(getattr(tokenizer, "path", ""))

    def stream(self, tokenizer, min_tokens: int) -> Tensor:
        """At least ``min_tokens`` token ids (1-D int64) of held-out text, or a clear error."""
        key = self._key(tokenizer)
        cached = self._streams.get(key)
        if cached is None:  # the whole text, once per tokenizer
            ids: list[int] = []
            ends = self._document_ends[key] = []
            for text in self._load_texts():
                ids += tokenizer.encode(text) + [tokenizer.eos_id]
                ends.append(len(ids))
            cached = torch.tensor(ids, dtype=torch.long)
            self._streams[key] = cached
        if cached.numel() < min_tokens:
            raise ValueError(
                f"the evaluation text holds {cached.numel()} tokens; this evaluation needs {min_tokens} "
                f"(lower its token budget or give more text)"
            )
        return cached

    def windows(self, tokenizer, length: int, count: int) -> Tensor:
        """``count`` non-overlapping windows of ``length + 1`` tokens, spread evenly over the
        text (so that they sample all of its documents): (count, length + 1)."""
        stream = self.stream(tokenizer, count * (length + 1))
        stride = stream.numel() // count
        starts = torch.arange(count) * stride
        return stream[starts[:, None] + torch.arange(length + 1)]

    def document_windows(self, tokenizer, length: int, count: int) -> Tensor:
        """``count`` windows of ``length + 1`` tokens that each lie within one document (its
        end-of-text token included), evenly spread over every such window of the text: (count,
        length + 1). Documents shorter than ``length + 1`` tokens give none; with too few long
        documents the windows overlap."""
        from ..data.shards import spread_document_windows

        stream = self.stream(tokenizer, 0)  # too little text: the documents' lengths say so below
        ends = self._document_ends[self._key(tokenizer)]
        try:
            starts = torch.from_numpy(spread_document_windows(ends, length, count))
        except ValueError as exc:
            raise ValueError(f"the evaluation text: {exc}") from None
        return stream[starts[:, None] + torch.arange(length + 1)]

    def filler(self, tokenizer, min_tokens: int = 4096) -> Callable[[random.Random, int], list[int]]:
        """``filler(rng, n)``: n consecutive tokens from a random place of the text."""
        stream = self.stream(tokenizer, min_tokens).tolist()

        def fill(rng: random.Random, n: int) -> list[int]:
            if n > len(stream):
                raise ValueError(f"filler asked for {n} tokens; the evaluation text holds {len(stream)}")
            start = rng.randrange(len(stream) - n + 1)
            return stream[start : start + n]

        return fill
