"""Turn text into token shards: ``diff-transformer prepare`` and :func:`prepare`.

A prepared dataset is a directory:

    DIR/train.bin, DIR/val.bin   token ids, flat, uint16 (vocab <= 65536) or uint32, native order;
                                 each document is followed by the end-of-text token
    DIR/train.document_ends.npy, DIR/val.document_ends.npy
                                 where each document ends: the position after its end-of-text token
                                 (uint64, one per document, ascending; the last is the split's length)
    DIR/meta.json                dtype, token and document counts, tokenizer, sources, split
    DIR/tokenizer.json           the tokenizer used (tokenizer_config.json for raw bytes)

The train/validation split is by document, deterministic given the seed: documents are taken in a
seeded random order and each joins validation while validation stays within ``val_fraction`` of
the bytes. If no document fits (one big file, or few large ones), the first document in that order
is cut at a line break and its tail, ``val_fraction`` of all bytes, becomes the validation split.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..checkpoint import write_directory_atomically
from ..files import check_output_dir, lock_output
from ..tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from .bpe import default_tokenizer
from .inputs import Document, is_jsonl, iter_texts, scan_documents

FORMAT = "diff-transformer-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
DOCUMENT_ENDS_SUFFIX = ".document_ends.npy"  # DIR/<split>.document_ends.npy; older datasets have none
DEFAULT_VAL_FRACTION = 0.05
ENCODE_BATCH_CHARS = 4 << 20  # text handed to the tokenizer at once (it encodes them in parallel)
ENCODE_PIECE_CHARS = 1 << 14  # documents are encoded in pieces of about this size (faster, parallel)


def resolve_tokenizer(spec) -> tuple[ByteTokenizer | BPETokenizer, str]:
    """(tokenizer, description) from "default" (the shipped BPE), "bytes", a tokenizers JSON file or
    a directory holding one, or a tokenizer object."""
    if not isinstance(spec, (str, Path)):
        return spec, type(spec).__name__
    if str(spec) == "default":
        return default_tokenizer(), "default"
    return load_tokenizer(spec), str(spec)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class SplitPlan:
    """Which documents go to validation; ``cut`` is the document whose tail does instead (or None)."""

    val: frozenset[int]
    cut: int | None = None
    cut_bytes: int = 0  # bytes of the cut document's tail that go to validation


def plan_split(sizes: Sequence[int], val_fraction: float, seed: int) -> SplitPlan:
    """The train/validation split of documents of ``sizes`` bytes (see the module docstring)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    target = val_fraction * sum(sizes)
    if target <= 0:
        return SplitPlan(frozenset())
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    val, taken = set(), 0
    for index in order:
        if taken + sizes[index] <= target:
            val.add(index)
            taken += sizes[index]
    if val:
        return SplitPlan(frozenset(val))
    return SplitPlan(frozenset(), cut=order[0], cut_bytes=max(1, round(target)))


def cut_text(text: str, tail_bytes: int) -> tuple[str, str]:
    """(head, tail) of ``text`` cut at the line break nearest to leaving ``tail_bytes`` in the tail
    (at the exact character if the text has no line break); both parts non-empty when possible."""
    position = max(1, len(text) - round(tail_bytes * len(text) / max(1, len(text.encode("utf-8")))))
    before, after = text.rfind("\n", 0, position), text.find("\n", position)
    candidates = [p + 1 for p in (before, after) if 0 <= p < len(text) - 1]
    if candidates:
        position = min(candidates, key=lambda p: abs(p - position))
    return text[:position], text[position:]


_PIECE_BOUNDARY = re.compile(r"\n(?=\S)")


def text_pieces(text: str, max_chars: int = ENCODE_PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of at least ``max_chars`` just after a newline that is followed by
    a non-space: the byte-level pre-tokenizer starts a new word there anyway, so encoding the
    pieces separately gives exactly the tokens of the whole."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        boundary = _PIECE_BOUNDARY.search(text, start + max_chars - 1)
        if boundary is None:
            break
        pieces.append(text[start:boundary.end()])
        start = boundary.end()
    pieces.append(text[start:])
    return pieces


class _ShardWriter:
    """Encodes texts in batches and appends their tokens (each text followed by EOS) to a split file."""

    def __init__(self, tokenizer, directory: Path, dtype: np.dtype) -> None:
        self.tokenizer, self.dtype, self.directory = tokenizer, dtype, directory
        self.files = {split: open(directory / f"{split}.bin", "wb") for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.documents = dict.fromkeys(SPLITS, 0)
        self.document_ends: dict[str, list[int]] = {split: [] for split in SPLITS}
        self.pending: list[tuple[str, str]] = []  # (split, text)
        self.pending_chars = 0

    def add(self, split: str, text: str) -> None:
        self.pending.append((split, text))
        self.pending_chars += len(text)
        if self.pending_chars >= ENCODE_BATCH_CHARS:
            self.flush()

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        if isinstance(self.tokenizer, ByteTokenizer):
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        pieces = [text_pieces(t) for t in texts]
        flat = [p for ps in pieces for p in ps]
        if hasattr(self.tokenizer, "encode_batch"):
            ids = self.tokenizer.encode_batch(flat)
        else:
            ids = [self.tokenizer.encode(p) for p in flat]
        out, i = [], 0
        for ps in pieces:
            out.append(np.concatenate([np.asarray(x, dtype=np.int64) for x in ids[i:i + len(ps)]]))
            i += len(ps)
        return out

    def flush(self) -> None:
        if not self.pending:
            return
        eos = np.array([self.tokenizer.eos_id], dtype=self.dtype)
        for (split, _), ids in zip(self.pending, self._encode([t for _, t in self.pending])):
            self.files[split].write(ids.astype(self.dtype).tobytes())
            self.files[split].write(eos.tobytes())
            self.tokens[split] += len(ids) + 1
            self.documents[split] += 1
            self.document_ends[split].append(self.tokens[split])
        self.pending, self.pending_chars = [], 0

    def close(self) -> None:
        self.flush()
        for f in self.files.values():
            f.close()
        for split, ends in self.document_ends.items():
            np.save(self.directory / f"{split}{DOCUMENT_ENDS_SUFFIX}", np.asarray(ends, dtype=np.uint64))


def write_shards(documents: Sequence[Document], directory: Path, tokenizer, *, tokenizer_source: str,
                 sources: list[dict], text_field: str = "text", val_fraction: float = DEFAULT_VAL_FRACTION,
                 seed: int = 0, progress: bool = True) -> dict:
    """Tokenize ``documents`` into an existing empty ``directory``; returns the meta.json dict."""
    from ..progress import progress as progress_bar

    dtype = token_dtype(tokenizer.vocab_size)
    plan = plan_split([d.size for d in documents], val_fraction, seed)
    start = time.perf_counter()
    writer = _ShardWriter(tokenizer, directory, dtype)
    total_bytes = sum(d.size for d in documents)
    with progress_bar(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        for index, (doc, text) in enumerate(zip(documents, iter_texts(documents, text_field))):
            if index == plan.cut:
                head, tail = cut_text(text, plan.cut_bytes)
                writer.add("train", head)
                writer.add("val", tail)
            else:
                writer.add("val" if index in plan.val else "train", text)
            bar.update(doc.size)
        writer.close()
    tokenizer.save(directory)
    seconds = time.perf_counter() - start
    val_names = [documents[i].name for i in sorted(plan.val)]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer_source,
        **{split: {"file": f"{split}.bin", "tokens": writer.tokens[split], "documents": writer.documents[split],
                   "document_ends": f"{split}{DOCUMENT_ENDS_SUFFIX}"} for split in SPLITS},
        "documents": len(documents),
        "bytes": total_bytes,
        "split": {
            "by": "document",
            "seed": seed,
            "val_fraction": val_fraction,
            # validation document names, listed when there are not too many to read
            "val_documents": val_names if len(val_names) <= 1000 else f"{len(val_names)} documents",
            "cut_document": None if plan.cut is None else documents[plan.cut].name,
        },
        "sources": sources,
        "seconds": round(seconds, 3),
    }
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def describe_sources(documents: Sequence[Document]) -> list[dict]:
    """One entry per input file: path, kind, documents, bytes."""
    by_file: dict[Path, dict] = {}
    for doc in documents:
        entry = by_file.setdefault(doc.path, {
            "path": str(doc.path), "kind": "jsonl" if is_jsonl(doc.path) else "text", "documents": 0, "bytes": 0,
        })
        entry["documents"] += 1
        entry["bytes"] += doc.size
    return list(by_file.values())


def prepare(inputs: Sequence[str | Path], out: str | Path, *, tokenizer="default", text_field: str = "text",
            val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 0, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Tokenize text files, folders or JSONL files into token shards in ``out`` (see the module
    docstring); returns the meta.json dict. ``out`` must be new or empty, or with ``overwrite`` a
    dataset of this project (never one of the inputs or a directory containing them)."""
    out = check_output_dir(out, "dataset", overwrite=overwrite, reading=inputs)  # before the work
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    meta: dict = {}
    with lock_output(out):  # one writer per dataset: a second prepare to ``out`` is refused with this one's pid
        tok, source = resolve_tokenizer(tokenizer)
        documents = scan_documents(inputs, text_field)

        def write(tmp: Path) -> None:
            os.chmod(tmp, 0o755)  # a temporary directory is private; the result need not be
            meta.update(write_shards(documents, tmp, tok, tokenizer_source=source, sources=describe_sources(documents),
                                     text_field=text_field, val_fraction=val_fraction, seed=seed, progress=progress))

        write_directory_atomically(out, write, kind="dataset", overwrite=overwrite, reading=inputs)
    return meta


def read_meta(directory: str | Path) -> dict:
    """The meta.json of a prepared dataset, checked for the fields the readers need."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a prepared dataset (no {META_FILE}); run `diff-transformer prepare`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ValueError(f"{path}: unreadable ({exc}); prepare the dataset again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a {FORMAT} version {FORMAT_VERSION} file")
    return meta
