"""Training checkpoints: a model checkpoint directory plus what resuming needs.

    CKPT/config.json, model.safetensors, tokenizer.json   LanguageModel.from_pretrained(CKPT) loads these
    CKPT/training_state.pt    optimizer (full, keyed by parameter name), schedule, step and data
                              position, RNG states; torch.save of tensors and plain data only,
                              read back with torch.load(weights_only=True): nothing is unpickled
    CKPT/train_config.yaml    the resolved training config of the run

The whole directory is written atomically (checkpoint.write_directory_atomically): the previous
checkpoint stays under CKPT until the new one is complete, and under the hidden sibling
``.CKPT.old`` for the instant of the swap, where :func:`find_checkpoint` also looks. A run that
stops on a NaN loss simply does not save, so the last good checkpoint is what remains.

The data position is the number of optimizer steps taken: the batches of step s are the samples
s·B … s·B + B − 1 of the dataset (see diff_transformer.data.shards), so nothing else is needed.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from ..checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, save_pretrained
from ..files import TRAINING_STATE_FILE
from ..tokenizer import same_tokenizer
from .distributed import Environment

TRAIN_CONFIG_FILE = "train_config.yaml"
STATE_VERSION = 1


@dataclass
class Progress:
    """Where a run is: optimizer steps done, and samples and tokens consumed."""

    step: int = 0
    samples: int = 0
    tokens: int = 0


def _full_options(env: Environment, *, loading: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        full_state_dict=True,
        cpu_offload=not loading,
        broadcast_from_rank0=loading and env.distributed,
    )


def rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_as_tuples(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _as_tuples(value: Any) -> Any:
    """random.setstate wants the nested tuples it gave; torch.load keeps them, this makes sure."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def save_training_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule,
    progress: Progress,
    *,
    tokenizer,
    train_config: dict[str, Any],
    env: Environment,
) -> Path | None:
    """Write a training checkpoint (collective under torchrun: every rank calls it; rank 0 writes).

    ``model`` is the LanguageModel itself or its FSDP2-sharded form (not a DDP wrapper).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _full_options(env, loading=False)
    weights = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    written = None
    if env.is_main:
        weights = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        # One id per save, in config.json and in training_state.pt: a training state copied in from
        # another run (or another save of this one) is refused when resuming.
        identity = {"checkpoint_id": uuid.uuid4().hex, "step": progress.step}
        extra = {"training": {**identity, "tokens": progress.tokens}}  # config.json: what readers may want to know
        state = {
            "version": STATE_VERSION,
            **identity,
            "progress": asdict(progress),
            "optimizer": optimizer_state,
            "schedule": schedule.state_dict(),
            "rng": rng_states(),
            "world_size": env.world_size,
        }

        def write_training_files(tmp: Path) -> None:
            # Through a Python file: a failed write (a full disk) is then an OSError, which torch's own
            # file writer would report as "enforce fail at inline_container.cc".
            with open(tmp / TRAINING_STATE_FILE, "wb") as fh:
                torch.save(state, fh)
            (tmp / TRAIN_CONFIG_FILE).write_text(yaml.safe_dump(train_config, sort_keys=False))

        written = save_pretrained(  # replaces this run's previous checkpoint (checked when the run started)
            model, directory, tokenizer=tokenizer, state=weights, extra_files=write_training_files,
            extra=extra, overwrite=True, own_training_state=True,
        )
    if env.distributed:
        torch.distributed.barrier()
    return written


def find_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete training checkpoint at ``directory`` (or its ``.old`` sibling left by an
    interrupted swap), or None."""
    directory = Path(directory)
    for candidate in (directory, directory.with_name(f".{directory.name}.old")):
        if all((candidate / name).is_file() for name in (CONFIG_FILE, WEIGHTS_FILE, TRAINING_STATE_FILE)):
            return candidate
    return None


def read_training_state(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / TRAINING_STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {directory} is not a training checkpoint") from None
    except Exception as exc:  # torch.load raises a variety of errors on a truncated or foreign file
        raise CheckpointError(f"{path}: unreadable training state ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise CheckpointError(f"{path}: not a version-{STATE_VERSION} training state")
    missing = [k for k in ("progress", "optimizer", "schedule", "rng") if k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a complete training state (no {', '.join(missing)})")
    return state


def check_same_save(directory: str | Path, state: dict[str, Any]) -> None:
    """A CheckpointError unless training_state.pt and config.json were written by the same save."""
    from ..checkpoint import read_config

    _, meta = read_config(directory)
    saved = meta.get("training") or {}
    ours, theirs = state.get("checkpoint_id"), saved.get("checkpoint_id")
    if ours is None and theirs is None:  # written before checkpoints carried an id
        return
    if ours != theirs:
        raise CheckpointError(
            f"{Path(directory) / TRAINING_STATE_FILE}: from another run or another save (its step "
            f"{state.get('progress', {}).get('step')}, id {ours}; config.json: step {saved.get('step')}, id {theirs}); "
            f"the weights and the optimizer state must come from the same checkpoint"
        )


def saved_step(directory: str | Path) -> int | None:
    """The step a training checkpoint was saved at, from its config.json (None if unknown)."""
    from ..checkpoint import read_config

    try:
        return read_config(directory)[1].get("training", {}).get("step")
    except CheckpointError:
        return None


def read_train_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / TRAIN_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not a training checkpoint")
    return yaml.safe_load(path.read_text())


# What must not change between a run and its resumption: the model, and what decides the data.
RESUME_INVARIANTS = {
    "data": ("dataset", "seq_len", "batch_size", "mix", "within_documents", "long_document_tokens", "long_document_weight"),
    "run": ("data_seed",),
}


def check_resumable(directory: str | Path, config, model_config) -> None:
    """A CheckpointError naming what differs if ``config`` cannot continue the run saved in ``directory``
    (another model, or another dataset, sequence length, global batch, mixture or data seed)."""
    from ..checkpoint import read_config

    saved_model, _ = read_config(directory)
    ours, theirs = model_config.to_dict(), saved_model.to_dict()
    differing = [f"model.{k}: {theirs[k]!r} -> {ours[k]!r}" for k in ours if ours[k] != theirs.get(k)]
    saved = read_train_config(directory)
    current = config.to_dict()
    for section, keys in RESUME_INVARIANTS.items():
        defaults = asdict(type(getattr(config, section))())  # what a config saved without the key meant
        for key in keys:
            before, now = saved.get(section, {}).get(key, defaults[key]), current[section][key]
            if before != now:
                differing.append(f"{section}.{key}: {before!r} -> {now!r}")
    if differing:
        raise CheckpointError(f"{directory}: cannot resume with a different " + "; ".join(differing))


# What a run started from another checkpoint's weights (run.init_from) may change in the model: the
# context and RoPE's base. Neither is in the state dict (the RoPE table is computed from them), so
# the weights fit unchanged; any other ModelConfig field would change what the weights mean.
INIT_CHANGEABLE = ("max_seq_len", "rope_theta")


def check_initializable(directory: str | Path, model_config) -> None:
    """A ConfigError naming the problem unless the weights of checkpoint ``directory`` (a training
    checkpoint or a ``save_pretrained`` one) can start a run of ``model_config``: the same model
    but for :data:`INIT_CHANGEABLE`."""
    from ..checkpoint import read_config
    from ..config import ConfigError

    path = Path(directory)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        what = "no such directory" if not path.exists() else f"no {CONFIG_FILE} and {WEIGHTS_FILE}"
        raise ConfigError(f"run.init_from: {directory} is not a checkpoint ({what}); set run.init_from "
                          f"(--init-from) to a checkpoint directory of this project")
    try:
        saved, _ = read_config(path)
    except CheckpointError as exc:
        raise ConfigError(f"run.init_from: {exc}") from None
    ours, theirs = model_config.to_dict(), saved.to_dict()
    differing = [f"model.{k}: {theirs[k]!r} in the checkpoint, {ours[k]!r} in this config"
                 for k in ours if k not in INIT_CHANGEABLE and ours[k] != theirs.get(k)]
    if differing:
        raise ConfigError(f"run.init_from: {directory} holds another model (" + "; ".join(differing) + "); "
                          f"a run started from a checkpoint may change only {' and '.join(INIT_CHANGEABLE)}")


def check_initial_tokenizer(directory: str | Path, tokenizer) -> None:
    """A ConfigError if checkpoint ``directory`` holds a tokenizer other than ``tokenizer`` (the
    dataset's): its weights would read other tokens."""
    from ..checkpoint import load_checkpoint_tokenizer
    from ..config import ConfigError

    try:
        saved = load_checkpoint_tokenizer(directory)
    except CheckpointError as exc:
        raise ConfigError(f"run.init_from: {exc}") from None
    if saved is not None and not same_tokenizer(saved, tokenizer):
        raise ConfigError(f"run.init_from: {directory} was trained with another tokenizer than the dataset's "
                          f"({type(saved).__name__} of {saved.vocab_size} tokens against "
                          f"{type(tokenizer).__name__} of {tokenizer.vocab_size}, or other merges)")



def load_weights(directory: str | Path, model: nn.Module, env: Environment) -> None:
    """Load the weights of checkpoint ``directory`` into ``model`` in place: when resuming, and when
    a new run starts from another checkpoint (run.init_from, checked by :func:`check_initializable`;
    its optimizer, schedule and step count stay fresh).

    Every rank calls it; under torchrun rank 0 reads the file and broadcasts into the shards.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from ..checkpoint import read_weights

    directory = Path(directory)
    read_here = env.is_main or not env.distributed
    weights = read_weights(directory / WEIGHTS_FILE) if read_here else {}
    try:
        set_model_state_dict(model, weights, options=_full_options(env, loading=True))
    except RuntimeError as exc:
        raise CheckpointError(f"{directory}: weights do not fit the model of this config ({exc})") from exc


def load_training_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule,
    env: Environment,
) -> Progress:
    """Restore model, optimizer, schedule and RNG states in place; returns the progress to resume at.

    Every rank calls it; under torchrun rank 0 reads the files and broadcasts into the shards.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    directory = Path(directory)
    state = read_training_state(directory)
    check_same_save(directory, state)
    options = _full_options(env, loading=True)
    read_here = env.is_main or not env.distributed
    load_weights(directory, model, env)
    try:
        set_optimizer_state_dict(model, optimizer, state["optimizer"] if read_here else {}, options=options)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{directory / TRAINING_STATE_FILE}: optimizer state does not fit the model ({exc})") from exc
    schedule.load_state_dict(state["schedule"])
    set_rng_states(state["rng"])
    return Progress(**state["progress"])
