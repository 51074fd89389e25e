"""Byte-level BPE: the shipped tokenizer, and training one on any text with Hugging Face ``tokenizers``.

The shipped tokenizer (assets/tokenizer/tokenizer.json) was trained by scripts/build_corpus.py
with :func:`train_bpe` on the embedded corpus: vocab 8192 = 256 byte tokens + the end-of-text
token "<|endoftext|>" + 7,935 merges. Byte-level means any UTF-8 text encodes without unknown
tokens and decodes back exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ..files import OutputPathError, check_output_place, lock_output, write_atomically
from ..tokenizer import ASSETS, DEFAULT_TOKENIZER_FILE, EOS_TOKEN, default_tokenizer

DEFAULT_VOCAB_SIZE = 8192

__all__ = ["ASSETS", "DEFAULT_TOKENIZER_FILE", "check_tokenizer_out", "default_tokenizer", "save_tokenizer_file",
           "train_bpe"]


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *, min_frequency: int = 2,
              show_progress: bool = True):
    """A byte-level BPE (a ``tokenizers.Tokenizer``) trained on ``texts``, with "<|endoftext|>" as id 0.

    The vocabulary holds the 256 byte symbols, the end-of-text token, and merges up to
    ``vocab_size`` (fewer if the text has no more pairs seen ``min_frequency`` times).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    minimum = 256 + 1
    if vocab_size < minimum or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be between {minimum} (bytes + end-of-text) and 2**32, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def check_tokenizer_out(path: str | Path, *, overwrite: bool = False) -> Path:
    """Refuse ``path`` as the file to write a tokenizer to if it exists, unless ``overwrite`` and it
    is a tokenizers JSON file: any other file (the user's) is never replaced; nor is a file inside
    a checkpoint, an export or a dataset (:func:`~diff_transformer.files.check_output_place`)."""
    path = Path(path)
    check_output_place(path, "tokenizer")
    if not path.exists():
        return path
    if not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
    if not _is_tokenizer_file(path):
        raise OutputPathError(f"{path}: not a tokenizers JSON file, which is all --overwrite replaces; choose another "
                              "--out")
    return path


def _is_tokenizer_file(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and "added_tokens" in data


def save_tokenizer_file(tokenizer, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write a ``tokenizers.Tokenizer`` to ``path`` atomically (temporary file, then rename); an
    existing file is replaced only with ``overwrite`` and only if it is a tokenizer. One writer at
    a time (:func:`~diff_transformer.files.lock_output`): the check and the write hold its lock."""
    path = check_tokenizer_out(path, overwrite=overwrite)
    with lock_output(path):
        check_tokenizer_out(path, overwrite=overwrite)  # as it is now: another writer may have just finished
        return write_atomically(path, lambda tmp: tokenizer.save(str(tmp)))
