"""Tokenizers: raw bytes (needs nothing) and byte-level BPE (Hugging Face ``tokenizers`` JSON).

Both have ``encode``, ``decode``, ``vocab_size``, ``eos_id`` and ``save(directory)``;
:func:`load_tokenizer` reads back what ``save`` wrote (a checkpoint directory holds one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

EOS_TOKEN = "<|endoftext|>"
BYTES_CONFIG = "tokenizer_config.json"  # {"type": "bytes"} for the byte tokenizer
BPE_FILE = "tokenizer.json"  # a Hugging Face tokenizers file


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-text token 256."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        Path(directory, BYTES_CONFIG).write_text(json.dumps({"type": "bytes"}) + "\n")


class BPETokenizer:
    """A byte-level BPE from a Hugging Face ``tokenizers`` JSON file with an ``<|endoftext|>`` token."""

    def __init__(self, path: str | Path) -> None:
        from .extras import import_optional

        HFTokenizer = import_optional("tokenizers", "a byte-level BPE tokenizer").Tokenizer
        self.path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises plain Exceptions with terse messages
            raise ValueError(f"{self.path}: not a readable tokenizers JSON file ({exc})") from exc
        eos = self._tok.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"{self.path}: tokenizer has no {EOS_TOKEN} token")
        self.eos_id = eos
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        self._tok.save(str(Path(directory, BPE_FILE)))


def load_tokenizer(path: str | Path) -> ByteTokenizer | BPETokenizer:
    """A tokenizer from "bytes", "default" (the shipped BPE), a tokenizers JSON file, or a directory
    holding either file."""
    if str(path) == "bytes":
        return ByteTokenizer()
    if str(path) == "default":
        return default_tokenizer()
    path = Path(path)
    if path.is_dir():
        if (path / BPE_FILE).exists():
            return BPETokenizer(path / BPE_FILE)
        if (path / BYTES_CONFIG).exists():
            kind = json.loads((path / BYTES_CONFIG).read_text()).get("type")
            if kind != "bytes":
                raise ValueError(f"{path / BYTES_CONFIG}: unknown tokenizer type {kind!r}")
            return ByteTokenizer()
        raise FileNotFoundError(f"{path}: no {BPE_FILE} or {BYTES_CONFIG} in this directory")
    if path.is_file():
        return BPETokenizer(path)
    from .user_text import not_a_file

    what = not_a_file(path)
    if what != "no such file or folder":  # a FIFO (a read would wait for a writer), a device, a broken link
        raise ValueError(f"tokenizer {path}: {what}, not a file (give 'bytes', a JSON file or a directory)")
    raise FileNotFoundError(f"tokenizer {path} does not exist (give 'bytes', a JSON file or a directory)")


def as_tokenizer(spec, what: str = "tokenizer") -> ByteTokenizer | BPETokenizer | Tokenizer:
    """A tokenizer object as it is, or one loaded from a name or path (:func:`load_tokenizer`);
    anything else is a TypeError naming ``what`` and saying what to pass."""
    if isinstance(spec, (str, Path)):
        return load_tokenizer(spec)
    if all(hasattr(spec, name) for name in ("vocab_size", "eos_id", "encode", "decode", "save")):
        return spec
    raise TypeError(f"{what} must be a tokenizer (ByteTokenizer, BPETokenizer, load_tokenizer(...)) or its name or "
                    f"path ('bytes', 'default', a tokenizers JSON file), got {type(spec).__name__} {spec!r}")


_PROBE_TEXT = "The quick brown fox, 1234 — naïve café; ROMEO. O, she doth teach the torches to burn bright!\n"


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers agree: the same kind, vocabulary size, end-of-text id and encoding of
    a probe text (BPE tokenizers trained on other text split it differently)."""
    return (type(a) is type(b) and a.vocab_size == b.vocab_size and a.eos_id == b.eos_id
            and a.encode(_PROBE_TEXT) == b.encode(_PROBE_TEXT))


ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_FILE = ASSETS / "tokenizer" / "tokenizer.json"


def default_tokenizer() -> BPETokenizer:
    """The shipped byte-level BPE (vocab 8192) trained on the embedded corpus (data/bpe.py)."""
    if not DEFAULT_TOKENIZER_FILE.is_file():
        raise FileNotFoundError(f"{DEFAULT_TOKENIZER_FILE} is missing: the package was installed without its assets")
    return BPETokenizer(DEFAULT_TOKENIZER_FILE)
