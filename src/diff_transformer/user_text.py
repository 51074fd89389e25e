"""The one check of a user's text and of the path it is read from, wherever the project reads one:
``prepare`` and ``tokenizer train`` inputs (``data.inputs``), ``--text`` of ``eval`` and ``convert``,
the JSON Lines ``--data`` files of ``eval icl`` and ``eval context-qa``.

Text is UTF-8 without NUL. The threshold is one NUL byte or one invalid UTF-8 sequence: no prose,
code or markup needs U+0000, while a binary file (or UTF-16 text) has NUL bytes within its first
bytes, so a looser rule (a share of NULs, a sniffed prefix) would only let some binary files
through as "text" that tokenizes to nothing meaningful. Other control characters (a form feed,
an escape) are text. Every refusal is an :class:`InputError` naming the file (and the record and
field, for a file of records) and the byte offset.

A path is read only if it is a regular file (or a folder, where folders are taken): a FIFO, a
socket or a device would block or never end, a broken link or a link loop names nothing; each is
named as what it is (:func:`not_a_file`).

Light on purpose (no numpy, no torch): the command line's argument types use it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from typing import Any
from pathlib import Path

GIVE_TEXT = "give UTF-8 text"


class InputError(ValueError):
    """An input file is missing, binary, empty, corrupt or malformed; the message names it."""


def not_a_file(path: str | Path) -> str | None:
    """What ``path`` is if it is neither a regular file nor a folder (links followed): "a FIFO",
    "a socket", "a character device", "a block device", "a link loop", "a broken link to TARGET",
    "no such file or folder"; None for a file or a folder."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a link loop (a symbolic link that leads back to itself)"
        if os.path.islink(path):
            return f"a broken link (to {os.readlink(path)}, which does not exist)"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "no such file or folder"
        raise
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def checked_file(path: str | Path) -> Path:
    """``path`` if it is a regular file; else an InputError saying what it is."""
    path = Path(path)
    what = not_a_file(path)
    if what is None and path.is_dir():
        what = "a folder"
    if what is not None:
        raise InputError(f"{path}: {what}, not a file")
    return path


def decode_text(data: bytes, where: str | Path, start: int = 0) -> str:
    """``data`` (bytes of ``where`` from offset ``start``) as text; an InputError naming ``where``
    and the offset of the first invalid UTF-8 byte, else of the first NUL byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text (invalid byte at offset {start + exc.start}); {GIVE_TEXT}") from None
    nul = text.find("\x00")
    if nul >= 0:
        offset = start + len(text[:nul].encode("utf-8"))
        raise InputError(f"{where}: binary data (a NUL byte at offset {offset}), not text; {GIVE_TEXT}")
    return text


def checked_text(text: str, where: str) -> bytes:
    """The UTF-8 bytes of ``text``, a string decoded from an escaped form (a JSON string, a column
    of strings), checked as :func:`decode_text` checks bytes: an InputError naming ``where`` (the
    record and field) for a NUL character or an unpaired surrogate (``\\ud800``: no UTF-8 exists)."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where}: not UTF-8 text (an unpaired surrogate, U+{ord(text[exc.start]):04X}, at character "
                         f"{exc.start}); {GIVE_TEXT}") from None
    nul = data.find(b"\x00")
    if nul >= 0:
        raise InputError(f"{where}: binary data (a NUL character at byte {nul}), not text; {GIVE_TEXT}")
    return data


def read_text_file(path: str | Path, *, nonempty: bool = False) -> str:
    """The text of the regular file ``path``; an InputError naming it if it is not one
    (:func:`checked_file`), not text (:func:`decode_text`), or, where ``nonempty``, blank."""
    path = checked_file(path)
    text = decode_text(path.read_bytes(), path)
    if nonempty and not text.strip():
        raise InputError(f"{path}: empty (no text in it); {GIVE_TEXT}")
    return text


def json_line(line: str, where: str) -> Any:
    """One line of a JSON Lines file (``where``: its file and line number) parsed; an InputError naming
    ``where`` if it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})") from None


def json_objects(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number from 1, object) for each non-blank line of the JSON Lines file ``path``, read by
    :func:`read_text_file`; an InputError naming the file and line for a line that is not JSON or not
    an object."""
    for number, line in enumerate(read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        record = json_line(line, f"{path}:{number}")
        if not isinstance(record, dict):
            raise InputError(f"{path}:{number}: expected an object, got {type(record).__name__}")
        yield number, record
