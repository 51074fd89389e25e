"""Turn text into token shards: ``diff-transformer prepare`` and :func:`prepare`.

A prepared dataset is a directory:

    DIR/train.bin, DIR/val.bin   token ids, flat, uint16 (vocab <= 65536) or uint32, native order;
                                 each document is followed by the end-of-text token
    DIR/train.document_ends.npy, DIR/val.document_ends.npy
                                 where each document ends: the position after its end-of-text token
                                 (uint64, one per document, ascending; the last is the split's length)
    DIR/meta.json                dtype, token and document counts, tokenizer, sources, split, and the
                                 dataset's fingerprint
    DIR/tokenizer.json           the tokenizer used (tokenizer_config.json for raw bytes)

The fingerprint ("sha256:" and 64 hex digits) names the content: a SHA-256 of the line
``"{dtype} train {tokens} {documents} {T} val {tokens} {documents} {V}\n"``, where T and V are the
SHA-256 (hex) of each split's ``.bin`` bytes followed by its document ends as little-endian uint64.
It is computed as the shards are written; a dataset prepared before it existed has none in its
meta.json, and :func:`dataset_fingerprint` computes it from its files (one read of them). A
training checkpoint stores it, and a resumed run refuses a dataset whose fingerprint differs.

The train/validation split is by document, deterministic given the seed: documents are taken in a
seeded random order and each joins validation while validation stays within ``val_fraction`` of
the bytes. If no document fits (one big file, or few large ones), the first document in that order
is cut at a line break and its tail, ``val_fraction`` of all bytes, becomes the validation split.
"""

from __future__ import annotations

import array
import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..checkpoint import write_directory_atomically
from ..files import check_output_dir, lock_output
from ..tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from .bpe import default_tokenizer
from .inputs import Documents, check_output_outside_inputs, scan_documents

FORMAT = "diff-transformer-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
DOCUMENT_ENDS_SUFFIX = ".document_ends.npy"  # DIR/<split>.document_ends.npy; older datasets have none
DEFAULT_VAL_FRACTION = 0.05
ENCODE_BATCH_CHARS = 4 << 20  # text handed to the tokenizer at once (it encodes them in parallel), or to a process
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"  # Hugging Face tokenizers' switch of its threads
ENCODE_PIECE_CHARS = 1 << 14  # documents are encoded in pieces of about this size (faster, parallel)
FINGERPRINT_READ_BYTES = 16 << 20  # a shard is read this much at a time to compute a fingerprint
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def resolve_tokenizer(spec, *, eos_token: str | None = None,
                      bos_token: str | None = None) -> tuple[ByteTokenizer | BPETokenizer, str]:
    """(tokenizer, description) from "default" (the shipped BPE), "bytes", a tokenizers JSON file or
    a directory holding one (its special tokens named by ``eos_token``/``bos_token`` or the files
    beside it: :class:`~diff_transformer.tokenizer.BPETokenizer`), or a tokenizer object."""
    if not isinstance(spec, (str, Path)):
        if eos_token is not None or bos_token is not None:
            raise ValueError("eos_token and bos_token name the special tokens of a tokenizer file, not of a tokenizer "
                             "object (make it with them)")
        return spec, type(spec).__name__
    if str(spec) == "default" and eos_token is None and bos_token is None:
        return default_tokenizer(), "default"
    return load_tokenizer(spec, eos_token=eos_token, bos_token=bos_token), str(spec)


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


def default_workers() -> int:
    """The cores this process may run on: prepare's default number of tokenizing processes."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def encode_texts(tokenizer, texts: Sequence[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of every text one after the other, in ``dtype``; how many ids each text has)."""
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [text.encode("utf-8") for text in texts]
        return np.frombuffer(b"".join(encoded), np.uint8).astype(dtype), np.array([len(e) for e in encoded])
    pieces = [text_pieces(text) for text in texts]  # at least one per text
    flat = [piece for of_text in pieces for piece in of_text]
    if hasattr(tokenizer, "encode_batch"):
        ids = tokenizer.encode_batch(flat)
    else:
        ids = [tokenizer.encode(piece) for piece in flat]
    piece_lengths = np.array([len(x) for x in ids], dtype=np.int64)
    first_pieces = np.cumsum([0] + [len(of_text) for of_text in pieces[:-1]])
    lengths = np.add.reduceat(piece_lengths, first_pieces) if texts else np.zeros(0, np.int64)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(piece_lengths.sum())), lengths


@dataclass
class _Batch:
    """Texts encoded together: each with the split it goes to; their UTF-8 bytes (for the progress)."""

    splits: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    bytes: int = 0
    chars: int = 0


def _split_texts(documents: Documents, plan: SplitPlan) -> Iterator[tuple[str, str, int]]:
    """(split, text, UTF-8 bytes) of every document in order; the cut document's head and tail. The
    texts are read to their end (where a file that changed since the check is found), not only as
    many as were counted."""
    sizes = documents.sizes.tolist()
    for index, text in enumerate(documents.texts()):
        size = sizes[index]
        if index == plan.cut:
            head, tail = cut_text(text, plan.cut_bytes)
            head_bytes = len(head.encode("utf-8"))
            yield "train", head, head_bytes
            yield "val", tail, size - head_bytes
        else:
            yield ("val" if index in plan.val else "train"), text, size


def _batches(items: Iterable[tuple[str, str, int]]) -> Iterator[_Batch]:
    """The texts in batches of about ENCODE_BATCH_CHARS characters, in order."""
    batch = _Batch()
    for split, text, size in items:
        batch.splits.append(split)
        batch.texts.append(text)
        batch.bytes += size
        batch.chars += len(text)
        if batch.chars >= ENCODE_BATCH_CHARS:
            yield batch
            batch = _Batch()
    if batch.texts:
        yield batch


_worker_encoder: tuple | None = None  # (tokenizer, dtype) in a tokenizing process


def _start_worker(tokenizer, dtype: np.dtype) -> None:
    global _worker_encoder
    _worker_encoder = tokenizer, dtype
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle: it stops the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool's terminate() ends the process, whatever the parent set
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held while the pool was made (_stop_signals_held)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is left (then act as they would have): the processes
    of a pool are all started, and known to the pool, before a signal can stop the work and the
    pool with it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tokenizer, dtype = _worker_encoder
    return encode_texts(tokenizer, texts, dtype)


@contextlib.contextmanager
def _tokenizers_single_threaded() -> Iterator[None]:
    """Processes started within take tokenizers' one-thread mode: one process per core already
    (and no warning from a child forked after the parent's tokenizer used its threads)."""
    before = os.environ.get(TOKENIZERS_PARALLELISM)
    os.environ[TOKENIZERS_PARALLELISM] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[TOKENIZERS_PARALLELISM]
        else:
            os.environ[TOKENIZERS_PARALLELISM] = before


def encoded_batches(batches: Iterable[_Batch], tokenizer, dtype: np.dtype,
                    workers: int) -> Iterator[tuple[_Batch, np.ndarray, np.ndarray]]:
    """(batch, ids, ids per text) of each batch, in order: encoded in this process (``workers`` 1),
    or in ``workers`` processes with at most two batches each in flight, so that memory holds a few
    batches whatever the corpus size. The result is the same either way, id for id."""
    if workers <= 1:
        for batch in batches:
            yield batch, *encode_texts(tokenizer, batch.texts, dtype)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")  # fork: no re-import of torch
    pool = None
    try:
        with _tokenizers_single_threaded(), _stop_signals_held():
            pool = context.Pool(workers, _start_worker, (tokenizer, dtype))
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(_encode_in_worker, (batch.texts,))))
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield done, *result.get()
        while pending:
            done, result = pending.popleft()
            yield done, *result.get()
    finally:
        if pool is not None:  # every result is in, or the work stopped (an error, a signal): nothing is left to do
            pool.terminate()
            pool.join()


def fingerprint_of(dtype: str, splits: dict[str, tuple[int, int, str]]) -> str:
    """The dataset fingerprint (module docstring) from each split's (tokens, documents, SHA-256 hex
    of its tokens and ends)."""
    line = " ".join([dtype] + [f"{split} {tokens} {documents} {digest}"
                               for split, (tokens, documents, digest) in splits.items()]) + "\n"
    return "sha256:" + hashlib.sha256(line.encode()).hexdigest()


class _ShardWriter:
    """Appends encoded texts (each followed by EOS) to the split files and records where each ends;
    hashes what it writes (the fingerprint)."""

    def __init__(self, directory: Path, dtype: np.dtype, eos_id: int) -> None:
        self.directory = directory
        self.dtype = dtype
        self.eos = np.array([eos_id], dtype=dtype).tobytes()
        self.files = {split: open(directory / f"{split}.bin", "wb") for split in SPLITS}
        self.digests = {split: hashlib.sha256() for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.document_ends = {split: array.array("Q") for split in SPLITS}

    def write(self, splits: Sequence[str], ids: np.ndarray, lengths: np.ndarray) -> None:
        offset = 0
        for split, length in zip(splits, lengths.tolist()):
            for data in (ids[offset:offset + length].tobytes(), self.eos):
                self.files[split].write(data)
                self.digests[split].update(data)
            offset += length
            self.tokens[split] += length + 1
            self.document_ends[split].append(self.tokens[split])

    def close(self) -> str:
        """Close the files, write the document ends; the dataset's fingerprint."""
        for f in self.files.values():
            f.close()
        for split, ends in self.document_ends.items():
            ends = np.frombuffer(ends, dtype=np.uint64)
            np.save(self.directory / f"{split}{DOCUMENT_ENDS_SUFFIX}", ends)
            self.digests[split].update(ends.astype("<u8").tobytes())
        return fingerprint_of(self.dtype.name, {split: (self.tokens[split], len(self.document_ends[split]),
                                                        self.digests[split].hexdigest()) for split in SPLITS})


def write_shards(documents: Documents, directory: Path, tokenizer, *, tokenizer_source: str, sources: list[dict],
                 val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 0, progress: bool = True,
                 workers: int = 1) -> dict:
    """Tokenize ``documents`` into an existing empty ``directory`` in ``workers`` processes (fewer
    for a corpus of fewer batches); returns the meta.json dict."""
    from ..progress import progress as progress_bar

    dtype = token_dtype(tokenizer.vocab_size)
    plan = plan_split(documents.sizes.tolist(), val_fraction, seed)
    start = time.perf_counter()
    total_bytes = documents.total_bytes
    workers = max(1, min(workers, -(-total_bytes // ENCODE_BATCH_CHARS)))  # at most one per batch
    writer = _ShardWriter(directory, dtype, tokenizer.eos_id)
    with progress_bar(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        batches = _batches(_split_texts(documents, plan))
        for batch, ids, lengths in encoded_batches(batches, tokenizer, dtype, workers):
            writer.write(batch.splits, ids, lengths)
            tokens = sum(writer.tokens.values())
            bar.set_postfix_str(f"{tokens:,} tokens, {tokens / (time.perf_counter() - start):,.0f} tokens/s")
            bar.update(batch.bytes)  # as the tokens are written: the rate is the tokenizing's
        fingerprint = writer.close()
    tokenizer.save(directory)
    seconds = time.perf_counter() - start
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer_source,
        "fingerprint": fingerprint,
        **{split: {"file": f"{split}.bin", "tokens": writer.tokens[split],
                   "documents": len(writer.document_ends[split]), "document_ends": f"{split}{DOCUMENT_ENDS_SUFFIX}"}
           for split in SPLITS},
        "documents": len(documents),
        "bytes": total_bytes,
        "split": {
            "by": "document",
            "seed": seed,
            "val_fraction": val_fraction,
            # validation document names, listed when there are not too many to read
            "val_documents": ([documents.name(i) for i in sorted(plan.val)] if len(plan.val) <= 1000
                              else f"{len(plan.val)} documents"),
            "cut_document": None if plan.cut is None else documents.name(plan.cut),
        },
        "sources": sources,
        "seconds": round(seconds, 3),
    }
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare(inputs: Sequence[str | Path], out: str | Path, *, tokenizer="default", text_field: str = "text",
            val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 0, overwrite: bool = False,
            progress: bool = True, workers: int | None = None, eos_token: str | None = None,
            bos_token: str | None = None) -> dict:
    """Tokenize text files, folders or files of records into token shards in ``out`` (see the module
    docstring) in ``workers`` processes (None: one per core; the dataset is the same for any
    number); returns the meta.json dict. ``out`` must be new or empty, or with ``overwrite`` a
    dataset of this project (never one of the inputs, a directory containing them, or a directory
    inside an input folder). An input file that changes while it is read is an InputError naming
    it, and nothing is written (see :mod:`.inputs`). ``eos_token``/``bos_token`` name a tokenizer
    file's end-of-text (which ends every document) and begin tokens; None = as the files beside it say."""
    out = check_output_dir(out, "dataset", overwrite=overwrite, reading=inputs)  # before the work
    check_output_outside_inputs(out, inputs, "dataset")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"--workers must be a positive integer, got {workers!r}")
    meta: dict = {}
    with lock_output(out):  # one writer per dataset: a second prepare to ``out`` is refused with this one's pid
        tok, source = resolve_tokenizer(tokenizer, eos_token=eos_token, bos_token=bos_token)
        documents = scan_documents(inputs, text_field)

        def write(tmp: Path) -> None:
            os.chmod(tmp, 0o755)  # a temporary directory is private; the result need not be
            meta.update(write_shards(documents, tmp, tok, tokenizer_source=source,
                                     sources=documents.describe_sources(), val_fraction=val_fraction, seed=seed,
                                     progress=progress, workers=workers or default_workers()))
            documents.check_unchanged()  # the last look before the dataset is published

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


def dataset_fingerprint(directory: str | Path) -> str:
    """The fingerprint of the prepared dataset ``directory`` (module docstring): its meta.json's, or
    for a dataset prepared before fingerprints, computed from its files."""
    directory = Path(directory)
    meta = read_meta(directory)
    if isinstance(meta.get("fingerprint"), str):
        return meta["fingerprint"]
    splits = {}
    for split in SPLITS:
        digest = hashlib.sha256()
        with open(directory / meta[split]["file"], "rb") as f:
            while chunk := f.read(FINGERPRINT_READ_BYTES):
                digest.update(chunk)
        ends = meta[split].get("document_ends")
        if ends is not None:
            digest.update(np.load(directory / ends, allow_pickle=False).astype("<u8").tobytes())
        splits[split] = meta[split]["tokens"], meta[split].get("documents", 0), digest.hexdigest()
    return fingerprint_of(meta["dtype"], splits)
