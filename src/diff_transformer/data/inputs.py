"""Reading a user's text: text files, folders of text files, JSON Lines and JSON.

Every input becomes a list of :class:`Document` (one per text file, one per record), found and
checked by :func:`scan_documents` before any tokenizing starts, so that a binary or empty file is
reported at once, by name. :func:`iter_texts` then yields their texts in the same order.

- A text file (any name without a suffix of RECORD_READERS) is one document; it must be UTF-8
  without NUL bytes, and not empty.
- A file of records is read by the reader of its suffix (RECORD_READERS); each record's
  ``text_field`` (a string) is one document, and records whose text is empty are skipped.
  ``.jsonl``: one JSON object per line (blank lines allowed). ``.json``: one JSON document, an
  object (one record) or a list of objects (one record each); a ``.json`` file that is not one
  JSON document is read as JSON Lines.
- A folder contributes its .txt, .text, .md, .rst, .jsonl and .json files (recursively, sorted by
  path, hidden files and folders left out).
- What the project wrote (a prepared dataset, a checkpoint, an export, a run's or an evaluation's
  outputs: :func:`~diff_transformer.files.project_output_kind`) is not text to prepare: given as
  an input, inside an input folder, or holding an input file, it is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ..files import OUTPUT_NAMES, project_output_kind

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")


class InputError(ValueError):
    """An input file is missing, binary, empty or malformed; the message names it."""


@dataclass(frozen=True)
class Document:
    """One document: an in-memory text, a whole text file, or one record of a JSONL file."""

    name: str  # "path/to/file.txt", "data.jsonl:17" (record number, as in ``line``), or a given name
    size: int  # UTF-8 bytes of its text (what the split and the progress bar count)
    path: Path | None = None  # the file it comes from (None for an in-memory text)
    line: int | None = None  # 1-based number of its record: the line of a .jsonl file, the index in a .json list
    text: str | None = None  # the text itself, only for in-memory documents


def in_memory_documents(named_texts: Iterable[tuple[str, str]]) -> list[Document]:
    """Documents for texts already in memory, e.g. the embedded corpus."""
    return [Document(name=name, size=len(text.encode("utf-8")), text=text) for name, text in named_texts]


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def find_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files the inputs name: files as given, folders expanded to their text and JSONL files.
    An output of the project (see the module docstring) among them is an InputError naming it."""
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
            found = []
            for p in sorted(path.rglob("*")):
                if any(part.startswith(".") for part in p.relative_to(path).parts):
                    continue
                if p.is_dir() and (what := _project_output(p)) is not None:
                    raise InputError(f"{p}: {what} inside the input folder {path}, not text to prepare; move it "
                                     "out, or give the text files or folders alone")
                if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES:
                    found.append(p)
            if not found:
                suffixes = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES)
                raise InputError(f"{path}: folder holds no text files ({suffixes})")
            files.extend(found)
        else:
            raise InputError(f"{path}: no such file or folder")
    return files


def _project_output(directory: Path) -> str | None:
    """"a diff-transformer dataset" (its kind) if ``directory`` is an output of the project, else None."""
    kind = project_output_kind(directory)
    return None if kind is None else f"a diff-transformer {OUTPUT_NAMES[kind]}"


def decode_text_file(path: Path) -> str:
    """The file's text; an InputError naming the file if it is binary (NUL bytes, not UTF-8)."""
    data = path.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise InputError(f"{path}: binary file (NUL byte at offset {nul}); give UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start}); give UTF-8 text") from None


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


def _jsonl_records(path: Path, text_field: str, text: str | None = None) -> Iterator[tuple[int, str]]:
    """(line number, text) of every record of a JSON Lines file (its ``text`` if already read)."""
    for number, line in enumerate((decode_text_file(path) if text is None else text).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        yield number, _record_text(record, f"{path}:{number}", text_field)


def _json_records(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    """(record number, text) of a .json file: one JSON document, an object (record 1) or a list of
    objects; a file that is not one JSON document is read as JSON Lines (JSONL saved as .json)."""
    text = decode_text_file(path)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole:
        try:
            yield from list(_jsonl_records(path, text_field, text))
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


# The reader of each file of records, by suffix: (path, text field) -> (record number, text) of each record.
RECORD_READERS: dict[str, Callable[[Path, str], Iterator[tuple[int, str]]]] = {
    ".jsonl": _jsonl_records, ".json": _json_records,
}
JSONL_SUFFIXES = tuple(RECORD_READERS)  # files of records


def _records(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    return RECORD_READERS[path.suffix.lower()](path, text_field)


def scan_documents(inputs: Sequence[str | Path], text_field: str = "text") -> list[Document]:
    """Every document of the inputs, each file checked (readable UTF-8 text, not empty)."""
    documents: list[Document] = []
    for path in find_input_files(inputs):
        if is_jsonl(path):
            found = [
                Document(name=f"{path}:{number}", size=len(text.encode("utf-8")), path=path, line=number)
                for number, text in _records(path, text_field)
                if text.strip()
            ]
            if not found:
                raise InputError(f"{path}: empty input (no record with a non-empty {text_field!r} field)")
            documents.extend(found)
        else:
            text = decode_text_file(path)
            if not text.strip():
                raise InputError(f"{path}: empty input (the file holds no text)")
            documents.append(Document(name=str(path), size=len(text.encode("utf-8")), path=path))
    return documents


def iter_texts(documents: Sequence[Document], text_field: str = "text") -> Iterator[str]:
    """The texts of ``documents``, in order; a JSONL file is read once for its consecutive records."""
    index = 0
    while index < len(documents):
        doc = documents[index]
        if doc.text is not None:
            yield doc.text
            index += 1
        elif doc.line is None:
            yield decode_text_file(doc.path)
            index += 1
        else:
            # The run of consecutive documents from this JSONL file, matched by line number.
            wanted: set[int] = set()
            while index < len(documents) and documents[index].path == doc.path and documents[index].line is not None:
                wanted.add(documents[index].line)
                index += 1
            for number, text in _records(doc.path, text_field):
                if number in wanted:
                    yield text
