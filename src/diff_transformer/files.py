"""Atomic file writes: a reader (or a run killed mid-write) sees the old file or the new one,
never part of one.

Every result, log, report, plot and tokenizer file of the project is written through
``write_atomically``: the content goes to a unique temporary file beside the target, is flushed
to disk, gets the usual permissions (0666 minus the umask), and is renamed over the target. On
an error the temporary file is removed and the target is untouched. Checkpoint directories are
swapped in as a whole by ``checkpoint.py``, which builds on the same rename.

Output directories never replace what the project did not write (:func:`check_output_dir`):
a directory the project writes is known by its checkpoint's config.json or its dataset's
meta.json, or else by a small marker file, ``.diff-transformer``, naming the kind of output it
holds; a non-empty directory with neither is refused, as are the current directory, its
ancestors, and the sources being read.

``cache_root`` is where the project keeps what it builds once and reuses (the default
corpus's shards, the compiled CPU kernels).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

CACHE_ENV = "DIFF_TRANSFORMER_CACHE"
OUTPUT_MARKER = ".diff-transformer"  # JSON {"kind": ...}: which of the project's writers made a directory
# Output kinds: a model or training checkpoint, a transformers export, a prepared token dataset, a
# training run's logs, a comparison, evaluation results.
OUTPUT_KINDS = ("checkpoint", "hf-export", "dataset", "train-run", "compare", "eval")
# Kinds whose own file says what they are (file name, its "format"), so they need no marker.
SELF_IDENTIFYING = {"checkpoint": ("config.json", "diff-transformer"), "dataset": ("meta.json", "diff-transformer-tokens")}


class OutputPathError(ValueError):
    """An output path that would replace or delete what the project did not write (the message
    names the path and what is there)."""


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


def project_output_kind(directory: str | Path) -> str | None:
    """The kind of project output ``directory`` holds (one of OUTPUT_KINDS), or None: its marker,
    else the file that identifies a checkpoint or a dataset (SELF_IDENTIFYING)."""
    directory = Path(directory)
    for name, key, value, kind in ((OUTPUT_MARKER, "kind", None, None),
                                   *((name, "format", fmt, kind) for kind, (name, fmt) in SELF_IDENTIFYING.items())):
        try:
            found = json.loads((directory / name).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if kind is None and found in OUTPUT_KINDS:
            return found
        if kind is not None and found == value:
            return kind
    return None


def check_output_dir(directory: str | Path, kind: str, *, overwrite: bool = False, reuse: bool = False,
                     reading: Iterable[str | Path] = (), hint: str = "pass --overwrite to replace it") -> Path:
    """Refuse ``directory`` as the place to write an output of ``kind`` if that could destroy
    something the project did not write; returns it as a Path.

    Refused: an existing file; the current directory or one of its ancestors; a path among
    ``reading`` (the sources of this command) or one containing them; a non-empty directory that
    holds no project output, or one of another kind. A directory holding an output of this kind
    is refused too unless ``overwrite`` (it will be replaced; ``hint`` says how to ask for that)
    or ``reuse`` (the writer adds to it and replaces only its own files: logs, results).
    """
    path = Path(directory)
    resolved = path.resolve()
    if path.is_file() or (path.is_symlink() and not path.is_dir()):  # a dangling link counts as a file
        raise OutputPathError(f"{path}: an existing file; the output {kind} needs a directory path")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise OutputPathError(f"{path}: the current directory{' or one containing it' if resolved != cwd else ''}; "
                              f"write the {kind} into a new directory")
    for source in reading:
        source = Path(source).resolve()
        if resolved == source or resolved in source.parents:
            what = "is" if resolved == source else "contains"
            raise OutputPathError(f"{path}: {what} {source}, which this command reads; choose another output directory")
    if path.is_dir() and any(path.iterdir()):
        found = project_output_kind(path)
        if found is None:
            names = sorted(p.name for p in path.iterdir())
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise OutputPathError(f"{path}: a non-empty directory that diff-transformer did not write (it holds "
                                  f"{shown}); choose a new or empty directory")
        if found != kind:
            raise OutputPathError(f"{path}: holds a diff-transformer {found}, not a {kind}; choose another directory")
        if not (overwrite or reuse):
            raise OutputPathError(f"{path}: already holds a diff-transformer {kind}; {hint}")
    return path


def mark_output_dir(directory: str | Path, kind: str) -> None:
    """Write ``directory``'s marker (see :func:`check_output_dir`) if it has none."""
    marker = Path(directory) / OUTPUT_MARKER
    if not marker.is_file():
        write_text_atomically(marker, json.dumps({"kind": kind}) + "\n")


def claim_output_dir(directory: str | Path, kind: str, **checks) -> Path:
    """:func:`check_output_dir` with ``reuse=True`` (unless given), then create the directory and
    mark it: for outputs filled file by file (training logs, comparisons, evaluation results)."""
    path = check_output_dir(directory, kind, **{"reuse": True, **checks})
    path.mkdir(parents=True, exist_ok=True)
    mark_output_dir(path, kind)
    return path
