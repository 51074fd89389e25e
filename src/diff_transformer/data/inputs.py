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

Memory: the texts are streamed (a JSON Lines file line by line, Parquet and Arrow files a batch of
RECORD_BATCH_ROWS rows at a time); what is kept per document is 16 bytes (its record number and
size).
"""

from __future__ import annotations

import array
import gzip
import io
import json
import lzma
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..extras import import_optional
from ..files import OUTPUT_NAMES, project_output_kind

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
RECORD_BATCH_ROWS = 256  # rows of a Parquet or Arrow file converted to Python strings at once
ARROW_DATASET_STATE = "state.json"  # a `datasets.save_to_disk` folder: {"_data_files": [{"filename": ...}]}
ARROW_DATASET_DICT = "dataset_dict.json"  # a DatasetDict's folder: {"splits": [...]}, a folder per split


class InputError(ValueError):
    """An input file is missing, binary, empty, corrupt or malformed; the message names it."""


RecordReader = Callable[[Path, str], Iterator[tuple[int, str]]]  # (path, text field) -> (record number, text)...


# --- text ----------------------------------------------------------------------------------------


def decode_text(data: bytes, path: Path, start: int = 0) -> str:
    """``data`` (bytes of ``path`` from offset ``start``) as text; an InputError naming the file and
    the offset if it is binary (NUL bytes, not UTF-8)."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise InputError(f"{path}: binary file (NUL byte at offset {start + nul}); give UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (invalid byte at offset {start + exc.start}); give UTF-8 "
                         "text") from None


def decode_text_file(path: Path) -> str:
    """The file's text; an InputError naming the file if it is binary (NUL bytes, not UTF-8)."""
    return decode_text(path.read_bytes(), path)


def _record_text(record, where: str, text_field: str) -> str:
    """The ``text_field`` string of one record; ``where`` ("file:line", "file: record N") opens the error."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise InputError(f"{where}: no field {text_field!r} (fields: {keys}); choose one with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise InputError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text


# --- JSON Lines, plain or compressed, and JSON ----------------------------------------------------


def _json_lines(path: Path, lines: Iterable[bytes], text_field: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every record of the lines of a JSON Lines file (bytes, each with its
    newline), checked as they come: binary, not UTF-8, not JSON, not an object with the field."""
    offset = 0
    for number, raw in enumerate(lines, start=1):
        line = decode_text(raw, path, offset)
        offset += len(raw)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        yield number, _record_text(record, f"{path}:{number}", text_field)


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
    def read(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
        with _read_errors_named(path, f"{suffix} file"), JSONL_OPENERS[suffix](path) as lines:
            yield from _json_lines(path, lines, text_field)

    return read


def _json_records(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    """(record number, text) of a .json file: one JSON document, an object (record 1) or a list of
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
        yield 1, _record_text(document, str(path), text_field)
    elif isinstance(document, list):
        for number, record in enumerate(document, start=1):
            yield number, _record_text(record, f"{path}: record {number}", text_field)
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


def _column_texts(path: Path, batches: Iterable, text_field: str) -> Iterator[tuple[int, str]]:
    """(row number, text) of the ``text_field`` column of record batches; a null is an InputError."""
    number = 0
    for batch in batches:
        for text in batch.column(batch.schema.get_field_index(text_field)).to_pylist():
            number += 1
            if text is None:
                raise InputError(f"{path}:{number}: field {text_field!r} is null, not a string")
            yield number, text


def _parquet_records(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    pq = import_optional("pyarrow.parquet", "reading Parquet")
    with _read_errors_named(path, "Parquet file"):
        parquet = pq.ParquetFile(path)
        _checked_text_column(parquet.schema_arrow, path, text_field)
        batches = parquet.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=[text_field])
        yield from _column_texts(path, batches, text_field)


ARROW_FILE_MAGIC = b"ARROW1"  # an Arrow IPC file; a stream (what `datasets` writes) has none


def _arrow_records(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
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


def find_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files the inputs name: files as given, folders expanded to their text files and files of
    records. An output of the project (see the module docstring) among them is an InputError naming it."""
    if not inputs:
        raise InputError("no input given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            if (what := _project_output(path.parent)) is not None:
                raise InputError(f"{path}: part of {what} ({path.parent}), not text to prepare")
            files.append(path)
        elif path.is_dir():
            if (what := _project_output(path)) is not None:
                raise InputError(f"{path}: {what}, not text to prepare; give the text it was made from")
            found = _folder_files(path, path)
            if not found:
                suffixes = ", ".join(TEXT_SUFFIXES + tuple(RECORD_READERS))
                raise InputError(f"{path}: folder holds no text files ({suffixes})")
            files.extend(found)
        else:
            raise InputError(f"{path}: no such file or folder")
    return files


def _folder_files(folder: Path, top: Path) -> list[Path]:
    """The input files of ``folder`` (inside the input folder ``top``), depth first, sorted by name."""
    listed = _arrow_dataset_files(folder)
    if listed is not None:
        return listed
    files: list[Path] = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir():
            if (what := _project_output(path)) is not None:
                raise InputError(f"{path}: {what} inside the input folder {top}, not text to prepare; move it "
                                 "out, or give the text files or folders alone")
            files.extend(_folder_files(path, top))
        elif path.is_file() and (path.suffix.lower() in TEXT_SUFFIXES or record_suffix(path) is not None):
            files.append(path)
    return files


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
class InputFile:
    """One input file and the documents :func:`scan_documents` found in it."""

    path: Path
    suffix: str | None  # its key of RECORD_READERS, or None: a text file (one document)
    text_field: str
    records: np.ndarray  # (documents,) int64: the record number of each (a text file's one document: 0)
    sizes: np.ndarray  # (documents,) int64: UTF-8 bytes of each document's text

    @property
    def kind(self) -> str:
        """"text", or the record format: "jsonl", "jsonl.gz", "json", "parquet", "arrow", ..."""
        return "text" if self.suffix is None else self.suffix[1:]

    def name(self, index: int) -> str:
        """"path/to/file.txt", or "data.parquet:17" for record 17 of a file of records."""
        return str(self.path) if self.suffix is None else f"{self.path}:{self.records[index]}"

    def texts(self) -> Iterator[str]:
        """The text of each document, in order, read again (a file changed since the scan is an error)."""
        if self.suffix is None:
            yield decode_text_file(self.path)
            return
        count = 0
        for _, text in RECORD_READERS[self.suffix](self.path, self.text_field):
            if text.strip():
                count += 1
                if count <= len(self.records):
                    yield text
        if count != len(self.records):
            raise InputError(f"{self.path}: changed while it was being prepared ({len(self.records)} documents when "
                             f"it was checked, {count} now)")


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
    """Every document of one input file, each checked (readable UTF-8 text, not empty)."""
    suffix = record_suffix(path)
    if suffix is None:
        text = decode_text_file(path)
        if not text.strip():
            raise InputError(f"{path}: empty input (the file holds no text)")
        return InputFile(path, None, text_field, np.zeros(1, np.int64),
                         np.array([len(text.encode("utf-8"))], dtype=np.int64))
    records, sizes = array.array("q"), array.array("q")
    for number, text in RECORD_READERS[suffix](path, text_field):
        if text.strip():
            records.append(number)
            sizes.append(len(text.encode("utf-8")))
    if not records:
        raise InputError(f"{path}: empty input (no record with a non-empty {text_field!r} field)")
    return InputFile(path, suffix, text_field, np.frombuffer(records, np.int64), np.frombuffer(sizes, np.int64))


def scan_documents(inputs: Sequence[str | Path], text_field: str = "text") -> Documents:
    """Every document of the inputs, each file checked (readable UTF-8 text or records, not empty)."""
    return Documents([scan_file(path, text_field) for path in find_input_files(inputs)])
