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
ancestors, and the sources being read. An output replaced as a whole (a checkpoint, an export, a
dataset) is replaced only if it holds nothing but what the project writes there, and nothing is
ever written inside one. A training checkpoint (its ``training_state.pt``) is replaced only by
the run that owns it, never by a weights-only write, ``overwrite`` or not.

One writer per output: a training run or a comparison holds an exclusive lock on its directory,
``DIR/.lock`` (:func:`lock_output_dir`); a dataset, an export, a checkpoint or an evaluation's
results are locked through a file beside them, ``.NAME.lock`` (:func:`lock_output`), which exists
before the output does. The lock is ``fcntl.flock``, which the kernel releases when the process
ends, however it ends; the file names the holder's pid and host. A second process is refused
with the holder's pid, and so is a write inside a directory another process is writing (a running
training run); a lock file left by a process that was killed is taken over, with a note.

Files that make one result together (an evaluation's plot and its JSON) are written by
:func:`write_files_together`: all of them or, on a failure, none.

A writer's failure that comes from the operating system (a full disk, a read-only file system, no
permission), including the failures torch, safetensors and tokenizers report in their own
exception types, reaches the caller as an :class:`OSError` naming the file it was writing.

``cache_root`` is where the project keeps what it builds once and reuses (the default
corpus's shards).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import fnmatch
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

CACHE_ENV = "DIFF_TRANSFORMER_CACHE"
OUTPUT_MARKER = ".diff-transformer"  # JSON {"kind": ...}: which of the project's writers made a directory
# Output kinds: a model or training checkpoint, a transformers export, a prepared token dataset, a
# training run's logs, a comparison, evaluation results, a benchmark report.
OUTPUT_KINDS = ("checkpoint", "hf-export", "dataset", "train-run", "compare", "eval", "bench")
# How the messages name each kind.
OUTPUT_NAMES = {"checkpoint": "checkpoint", "hf-export": "Hugging Face export", "dataset": "dataset",
                "train-run": "training run", "compare": "comparison", "eval": "evaluation", "bench": "benchmark report"}
# Kinds whose own file says what they are (file name, its "format"), so they need no marker.
SELF_IDENTIFYING = {"checkpoint": ("config.json", "diff-transformer"),
                    "dataset": ("meta.json", "diff-transformer-tokens")}
# Kinds written as a whole, atomically (checkpoint.write_directory_atomically): every write replaces the
# directory, so nothing may be written inside one.
WRITTEN_WHOLE = ("checkpoint", "hf-export", "dataset")
# What makes a checkpoint a training run's (train/state.py): replaced only by that run's own saves.
TRAINING_STATE_FILE = "training_state.pt"
LOCK_FILE = ".lock"  # JSON {"pid", "host", "since"} of the process writing into the directory
# What the project writes into the outputs it replaces as a whole (fnmatch patterns, beside the marker):
# a model or training checkpoint, a transformers export (the names transformers gives its files), a
# token dataset. Anything else in such a directory was put there by someone else, and replacing the
# directory would delete it: the replacement is refused (check_output_dir).
REPLACED_OUTPUT_FILES = {
    "checkpoint": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training_state.pt",
                   "train_config.yaml"),
    "hf-export": ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "chat_template.*", "vocab.json", "merges.txt", "configuration_diff_transformer.py",
                  "modeling_diff_transformer.py"),
    "dataset": ("meta.json", "*.bin", "*.document_ends.npy", "tokenizer.json", "tokenizer_config.json"),
    # A training run as compare lays it out (compare replaces an earlier run of the same model, lr and seed).
    "train-run": ("config.yaml", "metrics.jsonl", "summary.json", "tensorboard", "checkpoint", ".lock",
                  ".checkpoint.tmp-*", ".checkpoint.lock"),
}


class OutputPathError(ValueError):
    """An output path that would replace or delete what the project did not write (the message
    names the path and what is there)."""


class OutputLockedError(OutputPathError):
    """Another process is writing into the output directory (the message names its pid and host)."""


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
    return write_files_together([(Path(path), write)])[0]


def write_files_together(files: Sequence[tuple[Path, Callable[[Path], None]]], *,
                         remove: Iterable[Path] = ()) -> list[Path]:
    """Create or replace several files as one result (:func:`write_atomically` for each): every
    ``write(tmp)`` writes its temporary beside its target first, so a failure (a full disk) leaves
    every target as it was and no temporary; then the files in ``remove`` (a stale part of an
    earlier result) are deleted and the temporaries renamed over their targets, in order. Give
    last the file readers take as the sign that the result exists (an evaluation's JSON)."""
    written: list[tuple[Path, Path]] = []  # (target, its temporary)
    try:
        for path, write in files:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
            except OSError as exc:  # names the temporary file, which the user never asked for
                raise os_error_naming(path, exc) from exc
            os.close(fd)
            tmp = Path(name)
            written.append((path, tmp))
            with naming_os_errors(path, tmp):
                write(tmp)
                with open(tmp, "rb+") as fh:  # durable before it becomes visible
                    os.fsync(fh.fileno())
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private
        for path in remove:
            with naming_os_errors(path):
                Path(path).unlink(missing_ok=True)
        for path, tmp in written:
            with naming_os_errors(path, tmp):
                os.replace(tmp, path)
    except BaseException:
        for _, tmp in written:
            tmp.unlink(missing_ok=True)
        raise
    return [path for path, _ in written]


def write_text_atomically(path: str | Path, text: str) -> Path:
    """``write_atomically`` for a string (UTF-8)."""
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def os_error_naming(path: str | Path, exc: OSError) -> OSError:
    """``exc`` (the failure to create a temporary file or directory beside ``path``, which names
    that temporary) as an OSError naming ``path``, the output being written."""
    code = exc.errno if exc.errno is not None else errno.EIO
    return OSError(code, exc.strerror or os.strerror(code), str(path))


# "(os error 28)": how the Rust writers (safetensors, tokenizers) end the message of an I/O failure.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def underlying_os_error(exc: BaseException) -> OSError | None:
    """The operating-system failure behind ``exc``: itself if an OSError, else one in its chain
    (torch's checkpoint writer raises a RuntimeError from an OSError), else the errno that a Rust
    writer's message ends with. None if the failure was not the operating system's."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        suppressed = current.__suppress_context__  # raise ... from None: the context is not the cause
        current = current.__cause__ if current.__cause__ is not None else (None if suppressed else current.__context__)
    match = _RUST_OS_ERROR.search(str(exc))
    if match:
        code = int(match.group(1))
        return OSError(code, os.strerror(code))
    return None


ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def ending_signals_to_catch() -> tuple[int, ...]:
    """The ending signals a long job catches to stop cleanly: SIGINT, SIGTERM and SIGHUP (a closed
    terminal), but not SIGHUP where it is ignored (under nohup), so that closing the terminal leaves
    the job running as its user asked."""
    hangup = getattr(signal, "SIGHUP", None)
    return tuple(signum for signum in ENDING_SIGNALS
                 if not (signum == hangup and signal.getsignal(signum) == signal.SIG_IGN))


class OutputComplete:
    """Marks an interruption raised once ``path`` was complete (:func:`signals_held`): the command
    that wrote it as its last step has its result, and exits as if no signal had come."""

    def __init__(self, path: Path) -> None:
        self.path = path


@contextmanager
def signals_held(path: Path) -> Iterator[None]:
    """The block (a swap of ``path`` into place) runs to its end whatever signal comes: SIGINT, SIGTERM
    and SIGHUP landing within it are delivered when it ends, to the handlers in force before, and the
    exception a handler raises then carries ``output_complete`` (an :class:`OutputComplete` of
    ``path``). Outside the main thread nothing is held (signals reach the main thread only)."""
    held: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in ENDING_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler):
                previous[signum] = signal.signal(signum, lambda number, frame: held.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        try:
            previous[held[0]](held[0], None)
        except BaseException as exc:
            exc.output_complete = OutputComplete(path)
            raise


@contextmanager
def naming_os_errors(path: str | Path, temporary: str | Path | None = None) -> Iterator[None]:
    """Within the block, a failure of the operating system (see :func:`underlying_os_error`) is
    raised as an OSError naming ``path``, the file or directory being written; a name under
    ``temporary`` (where the content is written before it takes its name) is given as the same
    name under ``path``. Other errors pass unchanged."""
    try:
        yield
    except Exception as exc:
        found = underlying_os_error(exc)
        if found is None:
            raise
        name = str(path)
        if found.filename is not None:
            name = str(found.filename)
            if temporary is not None and (name == str(temporary) or name.startswith(f"{temporary}{os.sep}")):
                name = str(path) + name[len(str(temporary)):]
        if found is exc and str(exc.filename) == name:
            raise
        raise OSError(found.errno, found.strerror or os.strerror(found.errno), name) from exc


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
                     reading: Iterable[str | Path] = (), hint: str = "pass --overwrite to replace it",
                     own_training_state: bool = False) -> Path:
    """Refuse ``directory`` as the place to write an output of ``kind`` if that could destroy
    something the project did not write; returns it as a Path.

    Refused: an existing file; the current directory or one of its ancestors; a path among
    ``reading`` (the sources of this command) or one containing them; a path inside an output that
    is written as a whole (WRITTEN_WHOLE: a checkpoint, an export, a dataset), or inside (or at) a
    directory another process is writing (:func:`writing_process`); a directory holding a training
    state (or whose ``.NAME.old``, left by an interrupted save, holds one) unless
    ``own_training_state``, which only the training run that owns it passes (its saves replace its
    previous checkpoint); a non-empty directory that holds no project output, or one of another
    kind. A directory holding an output of this kind is refused too unless ``overwrite`` (it will
    be replaced; ``hint`` says how to ask for that) or ``reuse`` (the writer adds to it and replaces
    only its own files: logs, results); and, overwrite or not, one that is replaced as a whole
    (REPLACED_OUTPUT_FILES) while it also holds files the project did not write there (the user's
    notes, an export made inside a checkpoint). A missing ``directory`` whose ``.NAME.old`` holds an
    output (the only complete version after an interrupted swap) is checked as that output.
    """
    path = Path(directory)
    resolved = path.resolve()
    name = _output_name(kind)
    if path.is_file() or (path.is_symlink() and not path.is_dir()):  # a dangling link counts as a file
        raise OutputPathError(f"{path}: an existing file; the {name} needs a directory path")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise OutputPathError(f"{path}: the current directory{' or one containing it' if resolved != cwd else ''}; "
                              f"write the {name} into a new directory")
    for source in reading:
        source = Path(source).resolve()
        if resolved == source or resolved in source.parents:
            what = "is" if resolved == source else "contains"
            raise OutputPathError(f"{path}: {what} {source}, which this command reads; choose another output directory")
    check_output_place(path, name)
    old = resolved.with_name(f".{resolved.name}.old")  # (resolved: the root, which has no name, is refused above)
    if not own_training_state:
        for place in (path, old):
            if (place / TRAINING_STATE_FILE).is_file():
                where = "holds" if place is path else (f"has its previous version in {old} (left by an interrupted "
                                                       "save), which holds")
                raise OutputPathError(f"{path}: {where} the training state of a run ({TRAINING_STATE_FILE}), which "
                                      f"only that run replaces (train --resume continues it), --overwrite or not; "
                                      f"write the {name} to another directory")
    current = old if not path.exists() and old.is_dir() and project_output_kind(old) is not None else path
    note = "" if current == path else f" (as {old}, left by an interrupted write)"
    if current.is_dir() and any(current.iterdir()):
        found = project_output_kind(current)
        if found is None:
            names = sorted(p.name for p in current.iterdir())
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise OutputPathError(f"{path}: a non-empty directory that diff-transformer did not write (it holds "
                                  f"{shown}); choose a new or empty directory")
        if found != kind:
            other = _output_name(found)
            raise OutputPathError(f"{path}: holds a diff-transformer {other}{note}, not {_article(name)} {name}; "
                                  "choose another directory")
        foreign = [] if reuse else foreign_entries(current, kind)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise OutputPathError(f"{path}: holds a diff-transformer {name}{note} and also {shown}, which are not part "
                                  f"of it and would be deleted with it when it is replaced; move them out, or choose "
                                  "another directory")
        if not (overwrite or reuse):
            raise OutputPathError(f"{path}: already holds a diff-transformer {name}{note}; {hint}")
    return path


def check_output_place(path: str | Path, what: str) -> None:
    """Refuse ``path`` (a directory or a file to write, ``what`` names it) if it lies inside an output
    written as a whole (WRITTEN_WHOLE: the next write of that output would delete it, and the output
    would no longer be the project's alone), or inside, or at, a directory another process is
    writing (:func:`writing_process`)."""
    path = Path(path)
    resolved = path.resolve()
    for parent in resolved.parents:
        found = project_output_kind(parent)
        if found in WRITTEN_WHOLE:
            raise OutputPathError(f"{path}: inside {parent}, a diff-transformer {_output_name(found)}, which is "
                                  f"written as a whole (each write replaces the directory); write the {what} "
                                  "outside it")
    for place in reversed((resolved, *resolved.parents)):  # the outermost first: a run, not its checkpoint
        holder = writing_process(place)
        if holder is not None:
            raise OutputPathError(f"{place}: in use by another diff-transformer process ({_describe_holder(holder)}); "
                                  "wait for it to end, or choose another directory")


def _output_name(kind: str) -> str:
    return OUTPUT_NAMES.get(kind, kind)


def _article(noun: str) -> str:
    return "an" if noun[:1].lower() in "aeiou" else "a"


def foreign_entries(directory: str | Path, kind: str) -> list[str]:
    """The names in ``directory``, an output of ``kind`` that is replaced as a whole, that the project
    does not write there (sorted; none for the other kinds)."""
    patterns = REPLACED_OUTPUT_FILES.get(kind)
    if patterns is None:
        return []
    return sorted(p.name for p in Path(directory).iterdir()
                  if p.name != OUTPUT_MARKER and not any(fnmatch.fnmatchcase(p.name, pattern) for pattern in patterns))


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


def unclaim_output_dir(directory: str | Path) -> None:
    """Remove ``directory``, which :func:`claim_output_dir` created for a writer that then failed,
    if it holds nothing but its marker: a failed command leaves the file system as it was."""
    directory = Path(directory)
    try:
        if [p.name for p in directory.iterdir()] == [OUTPUT_MARKER]:
            (directory / OUTPUT_MARKER).unlink()
            directory.rmdir()
    except OSError:  # gone, or not ours to remove: left as it is
        pass


# --- one writer per directory -------------------------------------------------------------------


_HELD_LOCKS: set[str] = set()  # the lock files this process holds (absolute paths)
_BUSY_TRIES = 5  # attempts at a lock another process holds before it is refused (about 0.1 s in all)


def _lock_key(path: Path) -> str:
    return os.path.abspath(path)


class OutputLock:
    """An exclusive lock held on ``path`` by this process (see :func:`lock_output_dir`);
    :meth:`release` (or leaving the ``with`` block) removes the lock file and lets the lock go, then
    removes the folders made to hold the file (``created``, deepest first) if they are empty. One
    with no descriptor stands for a lock this process already held: releasing it does nothing."""

    def __init__(self, path: Path, fd: int | None, created: Sequence[Path] = ()) -> None:
        self.path = path
        self._fd = fd
        self.created = list(created)
        if fd is not None:
            _HELD_LOCKS.add(_lock_key(path))

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: the next holder creates a fresh file
        except OSError:
            pass
        _HELD_LOCKS.discard(_lock_key(self.path))
        os.close(self._fd)
        self._fd = None
        _remove_empty(self.created)

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output_dir(directory: str | Path) -> OutputLock:
    """Take the lock of the existing directory ``directory`` (``DIR/.lock``) for this process, or
    raise :class:`OutputLockedError` naming the process that holds it. A lock file left by a
    process that ended without releasing it (killed) is taken over, with a note on stderr."""
    directory = Path(directory)
    return lock_file(directory / LOCK_FILE, f"{directory}: in use by another diff-transformer process")


def output_lock_file(path: str | Path) -> Path:
    """The lock file of the output ``path`` (see :func:`lock_output`): ``.NAME.lock`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def lock_output(path: str | Path) -> OutputLock:
    """Take the lock of the output ``path`` (a directory written as a whole, or the results one
    command writes) for this process, or raise :class:`OutputLockedError` naming the process that
    holds it. The lock file lies beside the output (:func:`output_lock_file`), so it exists before
    the output and outlives its replacement; folders made to hold it are removed again on release
    if they stay empty. A lock this process already holds (a writer called by the command that took
    it) is returned as one that releases nothing."""
    path = Path(path)
    lock_path = output_lock_file(path)
    if _lock_key(lock_path) in _HELD_LOCKS:
        return OutputLock(lock_path, None)
    parent = Path(os.path.abspath(path.parent))
    created = [folder for folder in (parent, *parent.parents) if not folder.exists()]  # deepest first
    try:
        with naming_os_errors(path, lock_path):  # a read-only or full file system: named by the output asked for
            parent.mkdir(parents=True, exist_ok=True)
            lock = lock_file(lock_path, f"{path}: in use by another diff-transformer process")
    except BaseException:
        _remove_empty(created)
        raise
    lock.created = created
    return lock


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty: one that is not (an output went
    there) stops it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def writing_process(directory: str | Path) -> dict | None:
    """The process (its lock record: pid, host, since) that is writing into ``directory`` now, or
    None: another process holding the lock beside it (:func:`lock_output`), or, for a training run,
    its ``DIR/.lock``. A lock this process holds, one that another rank of this torchrun job holds,
    or one left by a killed process, is None. (The lock is probed by taking it shared for an instant.)"""
    directory = Path(directory)
    if not directory.name:  # the root
        return None
    candidates = [output_lock_file(directory)]
    if project_output_kind(directory) == "train-run":  # a comparison's .lock does not cover its runs
        candidates.append(directory / LOCK_FILE)
    for lock_path in candidates:
        if _lock_key(lock_path) in _HELD_LOCKS:
            continue
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(lock_path)
            if _job() is None or holder.get("job") != _job():  # (rank 0 of this torchrun job writes for every rank)
                return holder
        finally:
            os.close(fd)  # releases the shared lock, if taken
    return None


def _job() -> str | None:
    """The torchrun job this process is a rank of (its rendezvous: run id, master address and port,
    which every rank of one job shares and no two running jobs do), or None outside one."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or not os.environ.get("MASTER_PORT"):
        return None
    return (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}@{os.environ.get('MASTER_ADDR', '')}:"
            f"{os.environ['MASTER_PORT']}")


def lock_file(path: str | Path, busy: str) -> OutputLock:
    """:func:`lock_output_dir` for the lock file ``path`` itself; ``busy`` opens the refusal."""
    path = Path(path)
    with naming_os_errors(path):
        busy_tries = 0
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                busy_tries += 1
                if busy_tries < _BUSY_TRIES:  # perhaps only writing_process's probe, which lets go at once
                    time.sleep(0.01 * busy_tries)
                    continue
                raise OutputLockedError(f"{busy} ({_describe_holder(_read_holder(path))}); wait for it to end, "
                                        "or choose another directory") from None
            except BaseException:
                os.close(fd)
                raise
            try:  # the previous holder may have removed the file between our open and our lock
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise OSError(errno.EAGAIN, "could not take the lock", str(path))
        try:
            previous = _read_holder(path)
            if previous:
                print(f"note: {path}: taking over the lock of {_describe_holder(previous)}, which ended without "
                      "releasing it", file=sys.stderr)
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "since": datetime.datetime.now().isoformat(timespec="seconds")}
            if _job() is not None:
                record["job"] = _job()
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
    return OutputLock(path, fd)


def check_unlocked(path: str | Path, busy: str) -> None:
    """The refusal :func:`lock_file` would give if another process holds the lock file ``path``
    (``busy`` opens it), without creating the file or keeping a lock: a look before anything is
    written."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: nobody holds it (any other trouble is lock_file's to report)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go of at once, when fd closes
    except BlockingIOError:
        raise OutputLockedError(f"{busy} ({_describe_holder(_read_holder(path))}); wait for it to end, "
                                "or choose another directory") from None
    finally:
        os.close(fd)


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "a process that has not yet written its pid"
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder['pid']} on {holder.get('host', 'an unknown host')}{since}"
