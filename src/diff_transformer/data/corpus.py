"""The embedded corpus (public-domain English shipped with the package) and its prepared cache.

assets/corpus/*.jsonl.xz hold one JSON object per line, {"name", "title", "text"}, one per work:
Shakespeare's plays and poems, the books of the King James Bible, and Jane Austen's six novels
(sources and licences: assets/corpus/README.md; rebuilt by scripts/build_corpus.py).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from ..files import cache_root, naming_os_errors, os_error_naming
from ..tokenizer import ByteTokenizer
from .bpe import ASSETS, DEFAULT_TOKENIZER_FILE, default_tokenizer
from .inputs import in_memory_documents
from .prepare import DEFAULT_VAL_FRACTION, FORMAT_VERSION, META_FILE, write_shards

CORPUS_DIR = ASSETS / "corpus"
CORPUS_FILES = ("shakespeare.jsonl.xz", "kjv.jsonl.xz", "austen.jsonl.xz")
DEFAULT_SPLIT_SEED = 0


@functools.lru_cache(maxsize=1)
def _corpus_records() -> tuple[dict, ...]:
    records = []
    for name in CORPUS_FILES:
        path = CORPUS_DIR / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the package was installed without its assets")
        with lzma.open(path, "rt", encoding="utf-8") as f:
            records.extend(json.loads(line) for line in f)
    return tuple(records)


def corpus_documents() -> list[tuple[str, str]]:
    """(name, text) of every document of the embedded corpus, e.g. ("shakespeare/hamlet", "HAMLET...")."""
    return [(r["name"], r["text"]) for r in _corpus_records()]


def corpus_titles() -> dict[str, str]:
    """Document name -> title, e.g. "kjv/19_psalms" -> "The Book of Psalms"."""
    return {r["name"]: r["title"] for r in _corpus_records()}


# The embedded corpus as a dataset name (data.dataset): tokenized with the shipped BPE, or byte by byte
# (257 tokens: small models spend their parameters on the network rather than the embedding).
EMBEDDED_DATASETS = {"default": "bpe", "default-bytes": "bytes"}


def _fingerprint(tokenizer: str = "bpe") -> str:
    """What the prepared corpus depends on: corpus files, tokenizer, format, split settings."""
    digest = hashlib.sha256()
    for path in [CORPUS_DIR / name for name in CORPUS_FILES] + ([DEFAULT_TOKENIZER_FILE] if tokenizer == "bpe" else []):
        digest.update(path.read_bytes())
    if tokenizer != "bpe":
        digest.update(f"tokenizer {tokenizer}".encode())
    # The layout written: token shards with their document ends (another layout, another directory).
    digest.update(f"format {FORMAT_VERSION} document ends val {DEFAULT_VAL_FRACTION} "
                  f"seed {DEFAULT_SPLIT_SEED}".encode())
    return digest.hexdigest()[:16]


def dataset_directory(name: str, cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """The directory of data.dataset ``name``: the embedded corpus (``default``, ``default-bytes``),
    prepared on first use, or a ``prepare``d folder."""
    if name in EMBEDDED_DATASETS:
        return default_dataset(cache_dir, progress=progress, tokenizer=EMBEDDED_DATASETS[name])
    return Path(name)


def default_dataset(cache_dir: str | Path | None = None, *, progress: bool = True, tokenizer: str = "bpe") -> Path:
    """The embedded corpus prepared with the shipped BPE (``tokenizer="bytes"``: byte by byte): a
    dataset directory for TokenShards.

    Built once (about ten seconds) into ``cache_root(cache_dir)/corpus-<fingerprint>`` and reused.
    Safe when several processes ask at once (torchrun ranks): they take turns under a file lock,
    the first builds into a temporary directory and renames it into place, the others find it.
    """
    root = cache_root(cache_dir)
    target = root / f"corpus-{_fingerprint(tokenizer)}"
    if (target / META_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".corpus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / META_FILE).is_file():
            return target  # another process built it while this one waited
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        except OSError as exc:
            raise os_error_naming(target, exc) from exc
        try:
            # a full disk (the shard writers' errors name no file) or no permission: named by the cache
            # directory being built
            with naming_os_errors(target, tmp):
                os.chmod(tmp, 0o755)
                write_shards(
                    in_memory_documents(corpus_documents()), tmp,
                    default_tokenizer() if tokenizer == "bpe" else ByteTokenizer(),
                    tokenizer_source="default" if tokenizer == "bpe" else "bytes",
                    sources=[{"path": "embedded corpus", "kind": "corpus", "documents": len(_corpus_records())}],
                    val_fraction=DEFAULT_VAL_FRACTION, seed=DEFAULT_SPLIT_SEED, progress=progress,
                )
                os.rename(tmp, target)  # atomic; fails if the target appeared meanwhile (a lock-less writer)
        except OSError:
            if not (target / META_FILE).is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
