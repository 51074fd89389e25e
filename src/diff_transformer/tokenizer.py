"""Tokenizers: raw bytes (needs nothing) and byte-level BPE (Hugging Face ``tokenizers`` JSON).

Both have ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``bos_id`` and ``save(directory)``;
:func:`load_tokenizer` reads back what ``save`` wrote (a checkpoint directory holds one).

A BPE tokenizer's special tokens: the end-of-text token (which ends every document in the token
shards) and the begin token (None if it has none) are named by the caller, or by the
``tokenizer_config.json`` beside the JSON file (``eos_token``, ``bos_token``: transformers' fields),
or by the ``config.json`` beside it (``eos_token_id``, ``bos_token_id``, taken only where the id is a
special token of this tokenizer: transformers writes default ids, bos 1 and eos 2, into the config of
a model built beside any tokenizer, where they are ordinary tokens); failing those, the
end-of-text token is ``<|endoftext|>`` (this project's own and GPT-2's). So Llama 3's
(``<|end_of_text|>``, ``<|begin_of_text|>``), Qwen's and Motif's tokenizers are read as released.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from .checks import integer, string

EOS_TOKEN = "<|endoftext|>"
BYTES_CONFIG = "tokenizer_config.json"  # {"type": "bytes"} for the byte tokenizer
SPECIAL_TOKENS_FILE = "tokenizer_config.json"  # beside a tokenizer.json: transformers' eos_token / bos_token
MODEL_CONFIG_FILE = "config.json"  # beside a tokenizer.json in a transformers directory: eos/bos_token_id
BPE_FILE = "tokenizer.json"  # a Hugging Face tokenizers file


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-text token 256."""

    vocab_size = 257
    eos_id = 256
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        Path(directory, BYTES_CONFIG).write_text(json.dumps({"type": "bytes"}) + "\n")


def _token_name(value: Any, field: str, where: Path) -> str | None:
    """A special token as transformers writes it: a string, or {"content": string, ...} (older files);
    None for null; anything else a ValueError naming ``where`` and ``field`` (checks.string)."""
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else string(value, field, str(where)) or None


def _token_id(value: Any, field: str, where: Path) -> int | None:
    """An id as config.json writes it: an integer, or a list of them (the first is the end-of-text);
    None for null or []; anything else a ValueError naming ``where`` and ``field`` (checks.integer)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else integer(value, field, str(where), minimum=0)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


class BPETokenizer:
    """A byte-level BPE from a Hugging Face ``tokenizers`` JSON file.

    ``eos_token`` / ``bos_token``: the end-of-text and begin tokens by name; None = as the files
    beside it say (see the module docstring). A named token missing from the vocabulary, or no
    end-of-text token found, is a ValueError naming the file and saying how to name one.
    """

    def __init__(self, path: str | Path, *, eos_token: str | None = None, bos_token: str | None = None) -> None:
        from .extras import import_optional

        HFTokenizer = import_optional("tokenizers", "a byte-level BPE tokenizer").Tokenizer
        self.path = Path(path)
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises plain Exceptions with terse messages
            raise ValueError(f"{self.path}: not a readable tokenizers JSON file ({exc})") from exc
        named = self._named_beside()
        self.eos_token = self._special("eos", eos_token, named, fallback=EOS_TOKEN)
        self.bos_token = self._special("bos", bos_token, named, fallback=None)
        self.eos_id = self._tok.token_to_id(self.eos_token)
        self.bos_id = None if self.bos_token is None else self._tok.token_to_id(self.bos_token)
        self.vocab_size = self._tok.get_vocab_size()

    def _named_beside(self) -> dict[str, tuple[str, str]]:
        """{"eos"/"bos": (token, where it was named)} from tokenizer_config.json, else config.json, beside."""
        named: dict[str, tuple[str, str]] = {}
        special = self.path.parent / SPECIAL_TOKENS_FILE
        if special.is_file():
            fields = _read_json_object(special)
            for kind in ("eos", "bos"):
                token = _token_name(fields.get(f"{kind}_token"), f"{kind}_token", special)
                if token is not None:
                    named[kind] = (token, f"{special} ({kind}_token)")
        model_config = self.path.parent / MODEL_CONFIG_FILE
        if model_config.is_file():
            fields = _read_json_object(model_config)
            specials = {i for i, added in self._tok.get_added_tokens_decoder().items() if added.special}
            for kind in ("eos", "bos"):
                index = _token_id(fields.get(f"{kind}_token_id"), f"{kind}_token_id", model_config)
                token = None if index not in specials else self._tok.id_to_token(index)
                if kind not in named and token is not None:
                    named[kind] = (token, f"{model_config} ({kind}_token_id {index})")
        return named

    def _special(self, kind: str, given: str | None, named: dict[str, tuple[str, str]],
                 fallback: str | None) -> str | None:
        option = "--eos-token" if kind == "eos" else "--bos-token"
        if given is not None:
            token, where = given, f"{option} {given!r}"
        elif kind in named:
            token, where = named[kind]
        elif fallback is not None and self._tok.token_to_id(fallback) is not None:
            return fallback
        elif kind == "eos":
            raise ValueError(f"{self.path}: no end-of-text token: none is named in {SPECIAL_TOKENS_FILE} (eos_token) "
                             f"or {MODEL_CONFIG_FILE} (eos_token_id) beside it, and it has no {EOS_TOKEN}; name the "
                             f"token that ends a document with {option}")
        else:
            return None
        if self._tok.token_to_id(token) is None:
            raise ValueError(f"{self.path}: {kind} token {token!r} (from {where}) is not in its vocabulary; "
                             f"name another with {option}")
        return token

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        """tokenizer.json, and tokenizer_config.json naming the special tokens unless they are the
        defaults (``<|endoftext|>``, no begin token), as transformers' fields."""
        self._tok.save(str(Path(directory, BPE_FILE)))
        if self.eos_token != EOS_TOKEN or self.bos_token is not None:
            fields = {"eos_token": self.eos_token, "bos_token": self.bos_token}
            Path(directory, SPECIAL_TOKENS_FILE).write_text(json.dumps(fields) + "\n")


def load_tokenizer(path: str | Path, *, eos_token: str | None = None,
                   bos_token: str | None = None) -> ByteTokenizer | BPETokenizer:
    """A tokenizer from "bytes", "default" (the shipped BPE), a tokenizers JSON file, or a directory
    holding either file; ``eos_token``/``bos_token`` name a BPE's special tokens (see
    :class:`BPETokenizer`)."""
    if (eos_token is not None or bos_token is not None) and str(path) in ("bytes", "default"):
        raise ValueError(f"tokenizer {str(path)!r} has its own end-of-text token and no begin token: "
                         "--eos-token and --bos-token name those of a tokenizers JSON file")
    if str(path) == "bytes":
        return ByteTokenizer()
    if str(path) == "default":
        return default_tokenizer()
    path = Path(path)
    special = dict(eos_token=eos_token, bos_token=bos_token)
    if path.is_dir():
        if (path / BPE_FILE).exists():
            return BPETokenizer(path / BPE_FILE, **special)
        if (path / BYTES_CONFIG).exists():
            kind = json.loads((path / BYTES_CONFIG).read_text()).get("type")
            if kind != "bytes":
                raise ValueError(f"{path / BYTES_CONFIG}: unknown tokenizer type {kind!r}")
            return ByteTokenizer()
        raise FileNotFoundError(f"{path}: no {BPE_FILE} or {BYTES_CONFIG} in this directory")
    if path.is_file():
        return BPETokenizer(path, **special)
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
    a probe text (BPE tokenizers trained on other text split it differently). The begin token is
    not compared: no text is encoded with it (``add_special_tokens=False``)."""
    return (type(a) is type(b) and a.vocab_size == b.vocab_size and a.eos_id == b.eos_id
            and a.encode(_PROBE_TEXT) == b.encode(_PROBE_TEXT))


ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_FILE = ASSETS / "tokenizer" / "tokenizer.json"


def default_tokenizer() -> BPETokenizer:
    """The shipped byte-level BPE (vocab 8192) trained on the embedded corpus (data/bpe.py)."""
    if not DEFAULT_TOKENIZER_FILE.is_file():
        raise FileNotFoundError(f"{DEFAULT_TOKENIZER_FILE} is missing: the package was installed without its assets")
    return BPETokenizer(DEFAULT_TOKENIZER_FILE)
