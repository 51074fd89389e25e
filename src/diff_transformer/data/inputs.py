"""Reading a user's text: text files, folders of text files, and JSON Lines.

Every input becomes a list of :class:`Document` (one per text file, one per JSONL record), found
and checked by :func:`scan_documents` before any tokenizing starts, so that a binary or empty
file is reported at once, by name. :func:`iter_texts` then yields their texts in the same order.

- A text file (any name not ending in .jsonl/.json) is one document; it must be UTF-8 without
  NUL bytes, and not empty.
- A JSONL file holds one JSON object per line; each record's ``text_field`` (a string) is one
  document. Records whose text is empty are skipped; blank lines are allowed.
- A folder contributes its .txt, .text, .md, .rst and .jsonl files (recursively, sorted by
  path, hidden files and folders left out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json")


class InputError(ValueError):
    """An input file is missing, binary, empty or malformed; the message names it."""


@dataclass(frozen=True)
class Document:
    """One document: an in-memory text, a whole text file, or one record of a JSONL file."""

    name: str  # "path/to/file.txt", "data.jsonl:17" (line number), or a given name
    size: int  # UTF-8 bytes of its text (what the split and the progress bar count)
    path: Path | None = None  # the file it comes from (None for an in-memory text)
    line: int | None = None  # 1-based line number within a JSONL file
    text: str | None = None  # the text itself, only for in-memory documents


def in_memory_documents(named_texts: Iterable[tuple[str, str]]) -> list[Document]:
    """Documents for texts already in memory, e.g. the embedded corpus."""
    return [Document(name=name, size=len(text.encode("utf-8")), text=text) for name, text in named_texts]


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def find_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files the inputs name: files as given, folders expanded to their text and JSONL files."""
    if not inputs:
        raise InputError("no input given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file()
                and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                suffixes = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES)
                raise InputError(f"{path}: folder holds no text files ({suffixes})")
            files.extend(found)
        else:
            raise InputError(f"{path}: no such file or folder")
    return files


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


def _jsonl_records(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every record of a JSONL file, checking each one."""
    for number, line in enumerate(decode_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        if text_field not in record:
            keys = ", ".join(sorted(record)) or "none"
            raise InputError(f"{path}:{number}: no field {text_field!r} (fields: {keys}); choose one with --text-field")
        text = record[text_field]
        if not isinstance(text, str):
            raise InputError(f"{path}:{number}: field {text_field!r} is {type(text).__name__}, not a string")
        yield number, text


def scan_documents(inputs: Sequence[str | Path], text_field: str = "text") -> list[Document]:
    """Every document of the inputs, each file checked (readable UTF-8 text, not empty)."""
    documents: list[Document] = []
    for path in find_input_files(inputs):
        if is_jsonl(path):
            found = [
                Document(name=f"{path}:{number}", size=len(text.encode("utf-8")), path=path, line=number)
                for number, text in _jsonl_records(path, text_field)
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
            for number, text in _jsonl_records(doc.path, text_field):
                if number in wanted:
                    yield text
