"""Atomic file writes: a reader (or a run killed mid-write) sees the old file or the new one,
never part of one.

Every result, log, report, plot and tokenizer file of the project is written through
``write_atomically``: the content goes to a unique temporary file beside the target, is flushed
to disk, gets the usual permissions (0666 minus the umask), and is renamed over the target. On
an error the temporary file is removed and the target is untouched. Checkpoint directories are
swapped in as a whole by ``checkpoint.py``, which builds on the same rename.

``cache_root`` is where the project keeps what it builds once and reuses (the default
corpus's shards).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

CACHE_ENV = "DIFF_TRANSFORMER_CACHE"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else $DIFF_TRANSFORMER_CACHE, else ~/.cache/diff-transformer."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "diff-transformer"


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Create or replace ``path`` with what ``write(tmp)`` writes to the temporary path ``tmp``
    (which keeps ``path``'s suffix, so writers that infer a format from it still can)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:  # durable before it becomes visible
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: str | Path, text: str) -> Path:
    """``write_atomically`` for a string (UTF-8)."""
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
