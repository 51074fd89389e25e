"""Reading a user's text: text files, folders, and files of records as corpora ship them.

Every input is found and checked by :func:`scan_documents` before any tokenizing starts, so that a
binary, empty, corrupt or misnamed file is reported at once, by name. It returns the
:class:`Documents`: per input file, the size of each of its documents (no text is kept), whose
``texts()`` then reads them again, in the same order, streaming.

- A text file (any name without a suffix of RECORD_READERS) is one document; it must be UTF-8
  without NUL bytes, and not empty.
- A file of records is read by the reader of its suffix (RECORD_READERS); each record's
  ``text_field`` (a string) is one document, and records whose text is empty are skipped. Record
  numbers start at 1: the line of a JSON Lines file, the index in a .json list, the row of a
  Parquet or Arrow file.
  ``.jsonl`` (and ``.jsonl.gz``, ``.jsonl.xz``, ``.jsonl.zst`` compressed): one JSON object per
  line (blank lines allowed). ``.json``: one JSON document, an object (one record) or a list of
  objects (one record each); a ``.json`` file that is not one JSON document is read as JSON Lines.
  ``.parquet``: the column ``text_field`` of every row, in row groups. ``.arrow``: an Arrow IPC
  file or stream (what ``datasets`` writes). Parquet, Arrow and ``.jsonl.zst`` need pyarrow (the
  train extra).
- A folder contributes its .txt, .text, .md, .rst files and its files of records (recursively,
  sorted by path, hidden files and folders left out). A folder that ``datasets.save_to_disk``
  wrote (its state.json lists the data-*.arrow files) contributes those files in that order, and
  a DatasetDict's folder (dataset_dict.json) each split's, in its order.
- What the project wrote (a prepared dataset, a checkpoint, an export, a run's or an evaluation's
  outputs: :func:`~diff_transformer.files.project_output_kind`) is not text to prepare: given as
  an input, inside an input folder, or holding an input file, it is refused by name.
- Every file is read once, known by its device and inode (so a symbolic link, a ``..`` or a hard
  link is the file it leads to): an input named twice, or inside a folder also named, is refused
  by name (the command line says it twice); within the folders, a second way to a file or folder
  already found (a link to it, a link back up the tree: a loop) is skipped, all of them in one
  warning line. A FIFO, socket, device, broken link or link loop given, or in a folder under a
  text or record suffix, is refused as what it is (:func:`~diff_transformer.user_text.not_a_file`).
- What is text is :mod:`diff_transformer.user_text`'s one rule (UTF-8, no NUL), applied to a text
  file's bytes, a JSON Lines line, and each record's text (a JSON string, a Parquet or Arrow
  value, read as bytes): a refusal names the file, the record and field, and the byte offset.
- A file that changes while it is read is named, and nothing is written: its state (device,
  inode, size, mtime_ns) and a SHA-256 of its documents are taken by the check, and compared when
  it is read again, and its state once more before the output is published
  (:meth:`Documents.check_unchanged`).

Memory: the texts are streamed (a JSON Lines file line by line, Parquet and Arrow files a batch of
RECORD_BATCH_ROWS rows at a time); what is kept per document is 16 bytes (its record number and
size).
"""

from __future__ import annotations

import array
import gzip
import hashlib
import io
import json
import lzma
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..extras import import_optional
from ..files import OUTPUT_NAMES, OutputPathError, project_output_kind
from ..user_text import InputError, checked_text, decode_text, json_line, not_a_file

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
RECORD_BATCH_ROWS = 256  # rows of a Parquet or Arrow file converted to Python strings at once
ARROW_DATASET_STATE = "state.json"  # a `datasets.save_to_disk` folder: {"_data_files": [{"filename": ...}]}
ARROW_DATASET_DICT = "dataset_dict.json"  # a DatasetDict's folder: {"splits": [...]}, a folder per split


# (path, text field) -> (record number, text, its UTF-8 bytes) of each record, both checked text
RecordReader = Callable[[Path, str], Iterator[tuple[int, str, bytes]]]


# --- text ----------------------------------------------------------------------------------------


def _record_text(record, where: str, text_field: str) -> tuple[str, bytes]:
    """The ``text_field`` string of one record and its UTF-8 bytes, checked text; ``where``
    ("file:line", "file: record N") opens the error."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise InputError(f"{where}: no field {text_field!r} (fields: {keys}); choose one with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise InputError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text, checked_text(text, f"{where}: field {text_field!r}")


# --- JSON Lines, plain or compressed, and JSON ----------------------------------------------------


def _json_lines(path: Path, lines: Iterable[bytes], text_field: str) -> Iterator[tuple[int, str, bytes]]:
    """(line number, text, its bytes) of every record of the lines of a JSON Lines file (bytes, each
    with its newline), checked as they come: binary, not UTF-8 (named by line and by byte offset
    in the file, decompressed), not JSON, not an object with the field."""
    offset = 0
    for number, raw in enumerate(lines, start=1):
        line = decode_text(raw, f"{path}:{number}", offset)
        offset += len(raw)
        if not line.strip():
            continue
        yield number, *_record_text(json_line(line, f"{path}:{number}"), f"{path}:{number}", text_field)


def _zstd_stream(path: Path) -> IO[bytes]:
    pa = import_optional("pyarrow", f"reading {path.name} (zstd)")
    return io.BufferedReader(pa.input_stream(str(path), compression="zstd"))


# How a JSON Lines file of each suffix is opened: a binary stream of its uncompressed bytes.
JSONL_OPENERS: dict[str, Callable[[Path], IO[bytes]]] = {
    ".jsonl": lambda path: open(path, "rb"),
    ".jsonl.gz": lambda path: gzip.open(path, "rb"),
    ".jsonl.xz": lambda path: lzma.open(path, "rb"),
    ".jsonl.zst": _zstd_stream,
}


def _jsonl_reader(suffix: str) -> RecordReader:
    def read(path: Path, text_field: str) -> Iterator[tuple[int, str, bytes]]:
        with _read_errors_named(path, f"{suffix} file"), JSONL_OPENERS[suffix](path) as lines:
            yield from _json_lines(path, lines, text_field)

    return read


def _json_records(path: Path, text_field: str) -> Iterator[tuple[int, str, bytes]]:
    """(record number, text, its bytes) of a .json file: one JSON document, an object (record 1) or a list of
    objects; a file that is not one JSON document is read as JSON Lines (JSONL saved as .json)."""
    data = path.read_bytes()
    text = decode_text(data, path)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole:
        try:
            yield from list(_json_lines(path, io.BytesIO(data), text_field))
        except InputError as lines:
            rest = str(lines)[len(f"{path}:"):]  # "N: what" of the line that failed
            raise InputError(f"{path}: neither one JSON document (line {whole.lineno}: {whole.msg}) nor JSON Lines "
                             f"(line {rest})") from None
        return
    if isinstance(document, dict):
        yield 1, *_record_text(document, str(path), text_field)
    elif isinstance(document, list):
        for number, record in enumerate(document, start=1):
            yield number, *_record_text(record, f"{path}: record {number}", text_field)
    else:
        raise InputError(f"{path}: a JSON {type(document).__name__}; expected an object with a {text_field!r} field, "
                         "or a list of them")


# --- Parquet and Arrow ----------------------------------------------------------------------------


@contextmanager
def _read_errors_named(path: Path, what: str) -> Iterator[None]:
    """What a reader of compressed, Parquet or Arrow data raises on a corrupt or truncated file, as
    an InputError naming the file, ``what`` it was read as, and the library's words."""
    try:
        yield
    except (InputError, ModuleNotFoundError):
        raise
    except Exception as exc:
        if not isinstance(exc, (OSError, EOFError, lzma.LZMAError)) and not type(exc).__module__.startswith("pyarrow"):
            raise
        detail = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
        raise InputError(f"{path}: not a readable {what} ({detail or type(exc).__name__})") from None


def _checked_text_column(schema, path: Path, text_field: str) -> None:
    """An InputError naming the file and its fields if ``text_field`` is not a string column."""
    pa = import_optional("pyarrow", f"reading {path.name}")
    if schema.get_field_index(text_field) < 0:
        names = ", ".join(schema.names) or "none"
        raise InputError(f"{path}: no field {text_field!r} (fields: {names}); choose one with --text-field")
    kind = schema.field(text_field).type
    value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(value_kind)):
        raise InputError(f"{path}: field {text_field!r} is {kind}, not a string")


def _column_texts(path: Path, batches: Iterable, text_field: str) -> Iterator[tuple[int, str, bytes]]:
    """(row number, text, its bytes) of the ``text_field`` column of record batches, each value
    read as bytes and checked as text (pyarrow does not check that a string column holds UTF-8);
    a null is an InputError."""
    pa = import_optional("pyarrow", f"reading {path.name}")
    number = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        as_bytes = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        for data in as_bytes.to_pylist():
            number += 1
            if data is None:
                raise InputError(f"{path}:{number}: field {text_field!r} is null, not a string")
            yield number, decode_text(data, f"{path}:{number}: field {text_field!r}"), data


def _parquet_records(path: Path, text_field: str) -> Iterator[tuple[int, str, bytes]]:
    pq = import_optional("pyarrow.parquet", "reading Parquet")
    with _read_errors_named(path, "Parquet file"):
        parquet = pq.ParquetFile(path)
        _checked_text_column(parquet.schema_arrow, path, text_field)
        batches = parquet.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=[text_field])
        yield from _column_texts(path, batches, text_field)


ARROW_FILE_MAGIC = b"ARROW1"  # an Arrow IPC file; a stream (what `datasets` writes) has none


def _arrow_records(path: Path, text_field: str) -> Iterator[tuple[int, str, bytes]]:
    pa = import_optional("pyarrow", "reading Arrow files")
    with _read_errors_named(path, "Arrow file"):
        source = pa.memory_map(str(path))  # batches are views of the mapped file: read as they are used
        if source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        _checked_text_column(reader.schema, path, text_field)
        rows = (batch.slice(start, RECORD_BATCH_ROWS) for batch in batches
                for start in range(0, batch.num_rows, RECORD_BATCH_ROWS))
        yield from _column_texts(path, rows, text_field)


# The reader of each file of records, by suffix (the longest that the file's name ends with).
RECORD_READERS: dict[str, RecordReader] = {
    **{suffix: _jsonl_reader(suffix) for suffix in JSONL_OPENERS},
    ".json": _json_records,
    ".parquet": _parquet_records,
    ".arrow": _arrow_records,
}


def record_suffix(path: Path) -> str | None:
    """The suffix of RECORD_READERS that ``path``'s name ends with (the longest), or None: a text file."""
    name = path.name.lower()
    found = [suffix for suffix in RECORD_READERS if name.endswith(suffix)]
    return max(found, key=len) if found else None


# --- finding the files ----------------------------------------------------------------------------


def _identity(path: Path) -> tuple[int, int]:
    """(device, inode) of the file or folder ``path`` leads to: one thing however it is reached."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


def _wanted(path: Path) -> bool:
    """Whether a file of this name in an input folder is read: a text file's suffix, or a record reader's."""
    return path.suffix.lower() in TEXT_SUFFIXES or record_suffix(path) is not None


def find_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files the inputs name, each once: files as given, folders expanded to their text files
    and files of records (see the module docstring for what is refused and what is skipped, with
    one warning line on stderr). An output of the project among them is an InputError naming it."""
    if not inputs:
        raise InputError("no input given")
    paths = [Path(item) for item in inputs]
    given: dict[tuple[int, int], Path] = {}
    for path in paths:
        what = not_a_file(path)
        if what is not None:
            raise InputError(f"{path}: {what}, not a file or folder to read")
        first = given.setdefault(_identity(path), path)
        if first is not path:
            same = "given twice" if str(first) == str(path) else f"the same {_noun(path)} as {first}, given before"
            raise InputError(f"{path}: {same}; give each input once")
    real = [path.resolve() for path in paths]
    for path, path_real in zip(paths, real):
        for folder, folder_real in zip(paths, real):
            if folder_real in path_real.parents:
                raise InputError(f"{path}: inside the input folder {folder}, which is also given (its files would be "
                                 "read twice); give each input once")
    walk = _Walk(given)
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            if (what := _project_output(path.parent)) is not None:
                raise InputError(f"{path}: part of {what} ({path.parent}), not text to prepare")
            files.append(path)
        else:
            if (what := _project_output(path)) is not None:
                raise InputError(f"{path}: {what}, not text to prepare; give the text it was made from")
            found = walk.folder_files(path, path)
            if not found:
                suffixes = ", ".join(TEXT_SUFFIXES + tuple(RECORD_READERS))
                raise InputError(f"{path}: folder holds no text files ({suffixes})")
            files.extend(found)
    walk.warn()
    return files


def _noun(path: Path) -> str:
    return "folder" if path.is_dir() else "file"


class _Walk:
    """The input files of folders, each file and folder taken once: by identity (device, inode), so
    that a link to what was already found, or back up the tree (a loop), is skipped and noted."""

    SHOWN = 3  # skipped paths the warning line names

    def __init__(self, given: dict[tuple[int, int], Path]) -> None:
        self.found = dict(given)  # identity -> the path it was first found under
        self.skipped: list[str] = []  # "PATH -> what it leads to, already found"

    def _first_time(self, path: Path) -> bool:
        """Whether ``path`` leads to a file or folder not found before; else it is noted as skipped."""
        first = self.found.setdefault(_identity(path), path)
        if first is not path:
            self.skipped.append(f"{path} -> {first}")
        return first is path

    def folder_files(self, folder: Path, top: Path) -> list[Path]:
        """The input files of ``folder`` (inside the input folder ``top``), depth first, sorted by name."""
        listed = _arrow_dataset_files(folder)
        if listed is not None:
            for path in listed:
                if (what := not_a_file(path)) is not None or not path.is_file():
                    raise InputError(f"{path}: listed as a data file of the datasets folder {folder}, but "
                                     f"{what or 'a folder'}")
            return [path for path in listed if self._first_time(path)]
        files: list[Path] = []
        for path in sorted(folder.iterdir()):
            if path.name.startswith("."):
                continue
            what = not_a_file(path)
            if what is not None:
                if _wanted(path):  # a FIFO would block the reading, a broken link would drop a file unsaid
                    raise InputError(f"{path}: {what}, not a file (in the input folder {top})")
                continue
            if path.is_dir():
                if (what := _project_output(path)) is not None:
                    raise InputError(f"{path}: {what} inside the input folder {top}, not text to prepare; move it "
                                     "out, or give the text files or folders alone")
                if self._first_time(path):
                    files.extend(self.folder_files(path, top))
            elif _wanted(path) and self._first_time(path):
                files.append(path)
        return files

    def warn(self) -> None:
        """One line on stderr naming what was skipped, if anything was."""
        if not self.skipped:
            return
        count = len(self.skipped)
        shown = ", ".join(self.skipped[:self.SHOWN]) + (f" and {count - self.SHOWN} more" if count > self.SHOWN else "")
        print(f"warning: {count} {'path leads' if count == 1 else 'paths lead'} to a file or folder already found, "
              f"skipped (each is read once): {shown}", file=sys.stderr)


def check_output_outside_inputs(out: str | Path, inputs: Sequence[str | Path], what: str) -> None:
    """Refuse ``out`` (where the ``what`` will be written) inside an input folder: the next run on
    that folder would find it among the inputs."""
    target = Path(out).resolve()
    for item in inputs:
        folder = Path(item)
        if folder.is_dir() and folder.resolve() in target.parents:
            raise OutputPathError(f"{out}: inside the input folder {folder}, which this command reads (the next run on "
                                  f"that folder would read the {what} as input); write the {what} outside it")


def _arrow_dataset_files(folder: Path) -> list[Path] | None:
    """The data files of a folder ``datasets.save_to_disk`` wrote, in its order (a DatasetDict's:
    each split's, in the order of its splits); None for any other folder."""
    state, splits = folder / ARROW_DATASET_STATE, folder / ARROW_DATASET_DICT
    if splits.is_file():
        names = _json_field(splits, "splits")
        if names is not None:
            return [file for name in names for file in (_arrow_dataset_files(folder / str(name)) or [])]
    if state.is_file():
        entries = _json_field(state, "_data_files")
        if entries is None and (folder / "dataset_info.json").is_file():  # save_to_disk's pair, its state damaged
            raise InputError(f"{state}: not a JSON object with _data_files (damaged?), beside dataset_info.json as "
                             "datasets.save_to_disk writes them; save the dataset again")
        if entries is not None:
            try:
                return [folder / entry["filename"] for entry in entries]
            except (TypeError, KeyError):
                raise InputError(f"{state}: _data_files is not a list of {{\"filename\": ...}}; is this folder what "
                                 "datasets.save_to_disk wrote?") from None
    return None


def _json_field(path: Path, key: str):
    """``key`` of the JSON object in ``path``, or None if it is not such an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def _project_output(directory: Path) -> str | None:
    """"a diff-transformer dataset" (its kind) if ``directory`` is an output of the project, else None."""
    kind = project_output_kind(directory)
    return None if kind is None else f"a diff-transformer {OUTPUT_NAMES[kind]}"


# --- the documents --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileState:
    """What tells that a file changed without reading it: which file is under the name (device,
    inode), its size and its modification time."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> "FileState":
        found = os.stat(path)
        return cls(found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)

    def changes(self, now: "FileState") -> list[str]:
        """What differs in ``now``, in words (nothing: the same)."""
        changes = []
        if (self.device, self.inode) != (now.device, now.inode):
            changes.append("another file under its name")
        if self.size != now.size:
            changes.append(f"size {self.size:,} -> {now.size:,} bytes")
        if self.mtime_ns != now.mtime_ns:
            changes.append("modified")
        return changes


def _documents(path: Path, suffix: str | None, text_field: str) -> Iterator[tuple[int, str, bytes]]:
    """(record number, text, its UTF-8 bytes) of each document of one input file, checked text: a
    text file's one (record number 0), or each record whose text is not empty or white space."""
    if suffix is None:
        data = path.read_bytes()
        text = decode_text(data, path)
        if text.strip():
            yield 0, text, data
        return
    for number, text, data in RECORD_READERS[suffix](path, text_field):
        if text.strip():
            yield number, text, data


def _add_document(digest, number: int, data: bytes) -> None:
    """Add one document (its record number, its UTF-8 bytes) to a SHA-256 of a file's documents."""
    digest.update(number.to_bytes(8, "little") + len(data).to_bytes(8, "little"))
    digest.update(data)


def _changed(path: Path, changes: list[str]) -> InputError:
    return InputError(f"{path}: changed while it was being read ({'; '.join(changes)}), so nothing was written; run "
                      "again once it no longer changes")


@dataclass(frozen=True)
class InputFile:
    """One input file and the documents :func:`scan_documents` found in it."""

    path: Path
    suffix: str | None  # its key of RECORD_READERS, or None: a text file (one document)
    text_field: str
    records: np.ndarray  # (documents,) int64: the record number of each (a text file's one document: 0)
    sizes: np.ndarray  # (documents,) int64: UTF-8 bytes of each document's text
    state: FileState  # the file's when it was checked
    digest: str  # SHA-256 of its documents (_add_document) as they were checked

    @property
    def kind(self) -> str:
        """"text", or the record format: "jsonl", "jsonl.gz", "json", "parquet", "arrow", ..."""
        return "text" if self.suffix is None else self.suffix[1:]

    def name(self, index: int) -> str:
        """"path/to/file.txt", or "data.parquet:17" for record 17 of a file of records."""
        return str(self.path) if self.suffix is None else f"{self.path}:{self.records[index]}"

    def texts(self) -> Iterator[str]:
        """The text of each document, in order, read again: a file whose state, documents or their
        SHA-256 differ from the check's is an InputError once its last document is read (or at once,
        if its state already differs)."""
        self.check_unchanged()
        digest, count = hashlib.sha256(), 0
        for number, text, data in _documents(self.path, self.suffix, self.text_field):
            count += 1
            _add_document(digest, number, data)
            if count <= len(self.records):
                yield text
        changes = self.state.changes(FileState.of(self.path))
        if count != len(self.records):
            changes.append(f"{len(self.records)} documents when it was checked, {count} now")
        elif digest.hexdigest() != self.digest:
            changes.append("its text differs from what was checked")
        if changes:
            raise _changed(self.path, changes)

    def check_unchanged(self) -> None:
        """An InputError naming the file if its state differs from the check's."""
        changes = self.state.changes(FileState.of(self.path))
        if changes:
            raise _changed(self.path, changes)


@dataclass(frozen=True)
class InMemoryTexts:
    """Texts already in memory, each one document under its name (the embedded corpus)."""

    names: tuple[str, ...]
    contents: tuple[str, ...]
    sizes: np.ndarray  # (documents,) int64: UTF-8 bytes of each
    kind: str = "memory"

    def name(self, index: int) -> str:
        return self.names[index]

    def texts(self) -> Iterator[str]:
        return iter(self.contents)

    def check_unchanged(self) -> None:
        """Texts in memory do not change."""


class Documents:
    """The documents of the inputs, in order: of each file (or in-memory source), its documents'
    sizes and names; ``texts()`` streams their texts."""

    def __init__(self, sources: Sequence[InputFile | InMemoryTexts]) -> None:
        self.sources = list(sources)
        self.sizes = np.concatenate([np.zeros(0, np.int64)] + [source.sizes for source in self.sources])
        # documents up to the end of each source
        self._ends = np.cumsum([len(source.sizes) for source in self.sources], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def name(self, index: int) -> str:
        """The name of document ``index`` (0-based, over all sources)."""
        source = int(np.searchsorted(self._ends, index, side="right"))
        first = int(self._ends[source - 1]) if source else 0
        return self.sources[source].name(index - first)

    def texts(self) -> Iterator[str]:
        for source in self.sources:
            yield from source.texts()

    def check_unchanged(self) -> None:
        """An InputError naming the first input file that changed since the check (its state): the
        last look before what was made of them is published."""
        for source in self.sources:
            source.check_unchanged()

    def describe_sources(self) -> list[dict]:
        """One entry per input file: path, kind, documents, bytes (meta.json's "sources")."""
        return [{"path": str(source.path), "kind": source.kind, "documents": len(source.sizes),
                 "bytes": int(source.sizes.sum())} for source in self.sources if isinstance(source, InputFile)]


def in_memory_documents(named_texts: Iterable[tuple[str, str]]) -> Documents:
    """Documents for texts already in memory, e.g. the embedded corpus."""
    pairs = list(named_texts)
    sizes = np.array([len(text.encode("utf-8")) for _, text in pairs], dtype=np.int64)
    return Documents([InMemoryTexts(tuple(name for name, _ in pairs), tuple(text for _, text in pairs), sizes)])


def scan_file(path: Path, text_field: str = "text") -> InputFile:
    """Every document of one input file, each checked (readable UTF-8 text, not empty), with the
    file's state and the SHA-256 of its documents (a file that changes while it is read is an
    InputError naming it)."""
    suffix = record_suffix(path)
    state = FileState.of(path)
    records, sizes, digest = array.array("q"), array.array("q"), hashlib.sha256()
    for number, _, data in _documents(path, suffix, text_field):
        records.append(number)
        sizes.append(len(data))
        _add_document(digest, number, data)
    if not records:
        raise InputError(f"{path}: empty input (the file holds no text)" if suffix is None else
                         f"{path}: empty input (no record with a non-empty {text_field!r} field)")
    changes = state.changes(FileState.of(path))
    if changes:
        raise _changed(path, changes)
    return InputFile(path, suffix, text_field, np.frombuffer(records, np.int64), np.frombuffer(sizes, np.int64),
                     state, digest.hexdigest())


def scan_documents(inputs: Sequence[str | Path], text_field: str = "text") -> Documents:
    """Every document of the inputs, each file checked (readable UTF-8 text or records, not empty)."""
    return Documents([scan_file(path, text_field) for path in find_input_files(inputs)])
