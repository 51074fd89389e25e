"""Model checkpoints are directories:

    DIR/config.json          {"format": "diff-transformer", "format_version": 1, "model": {ModelConfig}}
    DIR/model.safetensors    the weights (no pickle); a tied LM head is not stored twice
    DIR/tokenizer.json       the tokenizer, when one was given (or tokenizer_config.json for bytes)

Directories are written atomically: into a temporary sibling, then renamed into place, so a
crash mid-write never leaves a half-written checkpoint under the final name. The writer holds a
lock on its temporary directory while it writes; one whose writer was killed is removed by the
next write of the same directory (or by :func:`remove_abandoned_temporaries`).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import ConfigError, ModelConfig
from .files import (OUTPUT_MARKER, SELF_IDENTIFYING, check_output_dir, lock_output, naming_os_errors, signals_held,
                    os_error_naming)
from .tokenizer import BPE_FILE, BYTES_CONFIG, as_tokenizer, load_tokenizer, same_tokenizer

FORMAT = "diff-transformer"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# A model's vocabulary may be its tokenizer's padded up to a multiple of this (cl100k's 100,277 ids -> the
# paper presets' 100,288): the padding ids are never trained, so the tokenizer still fits the model.
VOCAB_PADDING = 64


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted, or does not fit the model."""


def fault_point(point: str) -> None:
    """A hook at the two moments a killed writer could leave a directory write half-done: "written" (the
    new version is complete in its temporary directory) and "swapped" (the old version renamed aside,
    the new one not yet named). Does nothing; tests replace it in a child process to stop it there
    (tests/test_faults.py)."""


def write_directory_atomically(directory: str | Path, write: Callable[[Path], None], *, kind: str,
                               overwrite: bool = False, reading: Iterable[str | Path] = (),
                               hint: str = "pass --overwrite to replace it", own_training_state: bool = False) -> Path:
    """Call ``write(tmp_dir)`` then move tmp_dir to ``directory``, replacing an old version.

    The writer holds the lock of ``directory`` (:func:`~diff_transformer.files.lock_output`, a file
    beside it) from the check to the swap: a second writer is refused with the first's pid instead
    of replacing its output. ``directory`` is checked by
    :func:`~diff_transformer.files.check_output_dir` (``kind``, ``overwrite``, ``reading``, ``hint``,
    ``own_training_state`` as there): only an output of the same kind that the project wrote is
    ever replaced, only with ``overwrite``, and a training checkpoint only by its own run. The new
    directory carries the marker, unless its own files say what it is (a checkpoint's config.json,
    a dataset's meta.json). The old directory is renamed aside before the new one takes its name
    and deleted after, so at every moment one complete version exists under ``directory`` or its
    ``.old`` sibling. A failure of the operating system (a full disk...) is an OSError naming the
    file under ``directory`` that was being written; nothing of the attempt is left.
    """
    check_output_dir(directory, kind, overwrite=overwrite, reading=reading, hint=hint,
                     own_training_state=own_training_state)  # refused before anything is created
    with lock_output(directory):
        return _write_directory_locked(Path(directory), write, kind=kind, overwrite=overwrite, reading=reading,
                                       hint=hint, own_training_state=own_training_state)


def _write_directory_locked(directory: Path, write: Callable[[Path], None], *, kind: str, overwrite: bool,
                            reading: Iterable[str | Path], hint: str, own_training_state: bool) -> Path:
    """:func:`write_directory_atomically` once its lock is held: checked again (another writer may
    have finished since the first check), then written and swapped in."""
    directory = check_output_dir(directory, kind, overwrite=overwrite, reading=reading, hint=hint,
                                 own_training_state=own_training_state)
    with naming_os_errors(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_temporaries(directory)
        tmp, tmp_lock = _locked_temporary_directory(directory)
    try:
        with naming_os_errors(directory, tmp):
            write(tmp)
            if not SELF_IDENTIFYING.get(kind):
                (tmp / OUTPUT_MARKER).write_text(json.dumps({"kind": kind}) + "\n")
            mask = os.umask(0)
            os.umask(mask)
            for f in tmp.iterdir():
                os.chmod(f, 0o666 & ~mask)  # writers that use temporary files (safetensors) leave 0600
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700
            fault_point("written")
            old = directory.with_name(f".{directory.name}.old")
        with signals_held(directory):  # the swap runs to its end: a signal then finds the new version whole
            with naming_os_errors(directory, tmp):
                if directory.exists():
                    if old.exists():
                        shutil.rmtree(old)
                    os.replace(directory, old)
                # else: an ``.old`` left by an interrupted swap is the only complete version; it stays until
                # the new one has its name
                fault_point("swapped")
                os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(tmp_lock)
    return directory


def _temporary_prefix(directory: Path) -> str:
    return f".{directory.name}.tmp-"


def _locked_temporary_directory(directory: Path) -> tuple[Path, int]:
    """A new temporary sibling of ``directory`` and an open descriptor holding its lock (flock: the
    kernel releases it if this process dies, which tells :func:`remove_abandoned_temporaries`)."""
    for _ in range(100):
        try:
            tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(directory), dir=directory.parent))
        except OSError as exc:  # a read-only or full file system: named by the directory being written
            raise os_error_naming(directory, exc) from exc
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # removed by another process's clean-up between the two calls
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):  # still ours, still there
                return tmp, fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
    raise OSError(f"could not create a temporary directory beside {directory}")


def remove_abandoned_temporaries(directory: str | Path) -> list[Path]:
    """Remove the temporary directories that writes of ``directory`` left when their process was
    killed (``.NAME.tmp-*`` siblings whose lock no process holds); returns those removed. One that
    a running writer holds is left alone."""
    directory = Path(directory)
    removed = []
    for name in sorted(glob.glob(glob.escape(str(directory.parent / _temporary_prefix(directory))) + "*")):
        tmp = Path(name)
        if tmp.is_symlink() or not tmp.is_dir():
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # what cannot be removed (no permission) stays
        finally:
            os.close(fd)
        if not tmp.exists():
            removed.append(tmp)
    return removed


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the weights, ready for safetensors."""
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def save_pretrained(
    model,
    directory: str | Path,
    *,
    tokenizer=None,
    extra: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
    extra_files: Callable[[Path], None] | None = None,
    overwrite: bool = False,
    reading: Iterable[str | Path] = (),
    hint: str = "pass overwrite=True (--overwrite) to replace it",
    own_training_state: bool = False,
) -> Path:
    """Write ``model`` (a LanguageModel) and optionally its tokenizer to ``directory``.

    ``tokenizer`` is a tokenizer or its name or path ("bytes", "default", a tokenizers JSON file).
    ``state`` replaces the model's own state dict (e.g. full weights gathered from FSDP shards);
    ``extra_files(tmp_dir)`` writes more files into the same atomically written directory.
    ``directory`` must be new, empty, or (with ``overwrite``) a checkpoint of this project; any
    other path is an :class:`~diff_transformer.files.OutputPathError` (``reading``, ``hint``: see
    :func:`write_directory_atomically`). A directory holding a training state (``training_state.pt``)
    is refused, ``overwrite`` or not: only the run that owns it replaces it, passing
    ``own_training_state`` (train/state.py's save, compare's copy of its own run).
    """
    if tokenizer is not None:
        tokenizer = as_tokenizer(tokenizer)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    if state is None:
        state = model_state_dict(model)

    def write(tmp: Path) -> None:
        write_config(tmp, model.config, extra)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        if tokenizer is not None:
            tokenizer.save(tmp)
        if extra_files is not None:
            extra_files(tmp)

    return write_directory_atomically(directory, write, kind="checkpoint", overwrite=overwrite, reading=reading,
                                      hint=hint, own_training_state=own_training_state)


def write_config(directory: Path, config: ModelConfig, extra: dict[str, Any] | None = None) -> None:
    """DIR/config.json of a checkpoint: the format, its version, the ModelConfig and ``extra``."""
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": config.to_dict(), **(extra or {})}
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


# safetensors' names of the dtypes this project writes
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file, before its values exist."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def write_safetensors_streaming(path: Path, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                                metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file whose tensors arrive one at a time, in the order of ``specs``.

    The format is an 8-byte little-endian header length, the JSON header (every tensor's dtype,
    shape and byte range; padded with spaces to 8 bytes, as safetensors pads it) and the tensors'
    bytes. ``save_file`` needs every tensor in memory at once (and copies each into a bytes object
    first); here the header comes from ``specs`` and each tensor is written as it arrives, so the
    memory held is one tensor's: what importing a large model needs. A tensor that is not the
    next spec (name, shape, dtype) is a RuntimeError (a bug of the caller)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    remaining = iter(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, tensor in tensors:
            spec = next(remaining, None)
            if spec is None or (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
                raise RuntimeError(f"{path}: tensor {name} {tuple(tensor.shape)} {tensor.dtype} arrived where "
                                   f"{spec} was planned")
            f.write(memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
    left = next(remaining, None)
    if left is not None:
        raise RuntimeError(f"{path}: the tensors ended before {left.name}")


def read_config(directory: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The ModelConfig of a checkpoint directory and the whole config.json."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a checkpoint directory (no {CONFIG_FILE})")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # invalid JSON or not UTF-8
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "model" not in meta:
        raise CheckpointError(f"{path}: not a {FORMAT} config (expected keys 'format' and 'model')")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{path}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is newer than this library reads ({FORMAT_VERSION}); "
            "upgrade diff-transformer"
        )
    try:
        # Checkpoints written before the backend became a runtime setting carry it: not architecture.
        fields = meta["model"]
        if isinstance(fields, dict):
            fields = {k: v for k, v in fields.items() if k != "attn_backend"}
        return ModelConfig.from_dict(fields), meta
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{path}: invalid model config: {exc}") from exc


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file; a truncated or corrupted file, or one holding NaN/Inf values
    (safetensors has no checksum: damaged bytes show up as such), is a CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file is missing")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupted safetensors file ({exc})") from exc
    non_finite = sorted(k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if non_finite:
        raise CheckpointError(f"{path}: corrupted weights, NaN or Inf values in {', '.join(non_finite)}")
    return tensors


def load_state_dict_checked(model: nn.Module, state: dict[str, torch.Tensor], source: str = "weights") -> None:
    """``model.load_state_dict`` that names every missing, unexpected, mis-shaped or mis-typed tensor.

    A floating tensor of the model takes a floating tensor of any precision (fp16 and bf16 weights
    are converted, as load_state_dict converts them); an integer, bool or complex one is refused:
    converting it would load other values (an int32 file's weights become whole numbers, mostly 0).
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    common = sorted(set(state) & set(expected))
    mis_shaped = [
        f"{k}: {tuple(state[k].shape)} in {source}, {tuple(expected[k].shape)} in the model"
        for k in common
        if state[k].shape != expected[k].shape
    ]
    mis_typed = [
        f"{k} is {state[k].dtype} (the model's {expected[k].dtype})"
        for k in common
        if expected[k].is_floating_point() and not state[k].is_floating_point()
    ]
    problems = []
    if missing:
        problems.append(f"missing from {source}: {', '.join(missing)}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected)}")
    if mis_shaped:
        problems.append("shape mismatch: " + "; ".join(mis_shaped))
    if mis_typed:  # a file of the wrong dtype has it everywhere: the first few tell
        more = f"; and {len(mis_typed) - 3} more" if len(mis_typed) > 3 else ""
        problems.append("not floating point: " + "; ".join(mis_typed[:3]) + more)
    if problems:
        raise CheckpointError(f"{source} cannot be loaded into this model config — " + " | ".join(problems))
    model.load_state_dict(state)


def load_checkpoint_tokenizer(directory: str | Path, vocab_size: int | None = None):
    """The tokenizer stored in a checkpoint directory, or None; checked against ``vocab_size``."""
    directory = Path(directory)
    if not ((directory / BPE_FILE).exists() or (directory / BYTES_CONFIG).exists()):
        return None
    try:
        tokenizer = load_tokenizer(directory)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{directory}: unreadable tokenizer ({exc})") from exc
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise CheckpointError(
            f"{directory}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab_size}"
        )
    return tokenizer


def tokenizer_for_model(directory: str | Path, vocab_size: int, given=None, *, what: str = "tokenizer"):
    """The tokenizer to read the model of checkpoint ``directory`` (``vocab_size`` ids) with:
    ``given`` (a tokenizer, or its name or path) when there is one, else the checkpoint's own, or None.

    ``given`` must be the tokenizer the model was trained with: the checkpoint's own when it holds
    one (the same kind, size, end-of-text id and merges); else one of ``vocab_size`` ids, or fewer
    that ``vocab_size`` pads up to a multiple of VOCAB_PADDING. Anything else is a CheckpointError
    naming ``what`` and both sizes: the model would generate ids the tokenizer drops, or read its
    ids as other tokens.
    """
    stored = load_checkpoint_tokenizer(directory, vocab_size)
    if given is None:
        return stored
    tokenizer = as_tokenizer(given, what)
    named = f"{what} {given}" if isinstance(given, (str, Path)) else what
    size = f"{type(tokenizer).__name__} of {tokenizer.vocab_size:,} tokens"
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(f"{named}: {size}, more than the model's vocab_size {vocab_size:,} (not the tokenizer "
                              f"of this model)")
    if stored is not None and not same_tokenizer(stored, tokenizer):
        alike = type(stored) is type(tokenizer) and stored.vocab_size == tokenizer.vocab_size
        raise CheckpointError(
            f"{named}: {size}, but {directory} holds the tokenizer its model was trained with ({type(stored).__name__} "
            f"of {stored.vocab_size:,} tokens{', other merges' if alike else ''}): leave {what} out to use it"
        )
    padded = -(-tokenizer.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    if stored is None and vocab_size not in (tokenizer.vocab_size, padded):
        raise CheckpointError(
            f"{named}: {size} for a model of vocab_size {vocab_size:,}: ids {tokenizer.vocab_size:,} to "
            f"{vocab_size - 1:,} would have no text (not the tokenizer of this model; a model's vocabulary is its "
            f"tokenizer's, or that padded up to a multiple of {VOCAB_PADDING})"
        )
    return tokenizer
