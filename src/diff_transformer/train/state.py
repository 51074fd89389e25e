"""Training checkpoints: a model checkpoint directory plus what resuming needs.

    CKPT/config.json, model.safetensors, tokenizer.json   LanguageModel.from_pretrained(CKPT) loads these
    CKPT/training_state.pt    optimizer (full, keyed by parameter name), schedule, step and data
                              position, RNG states, the dataset trained on (its fingerprint and
                              sizes: DatasetRecord); torch.save of tensors and plain data only,
                              read back with torch.load(weights_only=True): nothing is unpickled
    CKPT/train_config.yaml    the resolved training config of the run

The whole directory is written atomically (checkpoint.write_directory_atomically): the previous
checkpoint stays under CKPT until the new one is complete, and under the hidden sibling
``.CKPT.old`` for the instant of the swap, where :func:`find_checkpoint` also looks. A run that
stops on a NaN loss simply does not save, so the last good checkpoint is what remains.

The data position is the number of optimizer steps taken: the batches of step s are the samples
s·B … s·B + B − 1 of the dataset (see diff_transformer.data.shards), so nothing else is needed,
as long as the dataset is the same: a resumed run compares the dataset's fingerprint (a SHA-256
of its shards, diff_transformer.data.prepare) with the checkpoint's and refuses another
(:func:`check_same_dataset`). A checkpoint saved before checkpoints recorded it is resumed with
a note saying that the data could not be compared.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from torch import nn

from ..checkpoint import (
    CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_checkpoint_tokenizer, read_config, read_weights, save_pretrained,
)
from ..config import ConfigError
from ..files import TRAINING_STATE_FILE
from ..tokenizer import same_tokenizer
from .distributed import Environment

TRAIN_CONFIG_FILE = "train_config.yaml"
STATE_VERSION = 1


@dataclass(frozen=True)
class DatasetRecord:
    """The dataset a run trains on, as its checkpoints record it (training_state.pt's "dataset")."""

    fingerprint: str  # diff_transformer.data.prepare's: "sha256:..." of the shards
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int

    def differences(self, now: "DatasetRecord") -> list[str]:
        """What differs in ``now``, in words: the sizes that differ, else the tokens themselves."""
        sizes = [f"{name.replace('_', ' ')} {before:,} -> {after:,}" for name in
                 ("train_tokens", "val_tokens", "train_documents", "val_documents")
                 if (before := getattr(self, name)) != (after := getattr(now, name))]
        if sizes or self.fingerprint == now.fingerprint:
            return sizes
        return [f"the same sizes, other tokens (fingerprint {self.fingerprint[:19]}... -> {now.fingerprint[:19]}...)"]


@dataclass
class Progress:
    """Where a run is: optimizer steps done, samples and tokens consumed, and the time its
    invocations took to get there (so that a resumed run reports the run's throughput)."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    train_seconds: float = 0.0  # timed training steps (each invocation's first step warms up, untimed)
    timed_tokens: int = 0  # the tokens of those timed steps
    wall_seconds: float = 0.0  # the invocations' wall time, up to the save


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
    dataset: DatasetRecord | None,  # rank 0's (the others write nothing)
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
        # config.json: what readers may want to know (a study's runner: whether a run is finished)
        extra = {"training": {**identity, "tokens": progress.tokens, "train_seconds": progress.train_seconds}}
        state = {
            "version": STATE_VERSION,
            **identity,
            "progress": asdict(progress),
            "optimizer": optimizer_state,
            "schedule": schedule.state_dict(),
            "rng": rng_states(),
            "world_size": env.world_size,
            "dataset": asdict(dataset),
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


def read_training_state(directory: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """The training state of checkpoint ``directory``, checked for its parts; ``mmap`` maps the
    file instead of reading it (a check that looks at the step and id only)."""
    path = Path(directory) / TRAINING_STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
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


def check_same_dataset(directory: str | Path, state: dict[str, Any], dataset: Path,
                       record: Callable[[], DatasetRecord]) -> str | None:
    """A CheckpointError naming ``dataset`` and what differs unless it is the dataset the run whose
    training state ``state`` (of checkpoint ``directory``) trained on; ``record()`` gives it as it
    is now (asked only if the checkpoint holds a record). A checkpoint from before records were
    kept: the note to give (the run goes on)."""
    saved = state.get("dataset")
    if saved is None:
        return (f"note: {directory} was saved before checkpoints recorded their dataset's fingerprint: whether "
                f"{dataset} still holds the data the run trained on cannot be checked")
    try:
        saved = DatasetRecord(**saved)
    except TypeError:
        raise CheckpointError(f"{Path(directory) / TRAINING_STATE_FILE}: an unreadable dataset record "
                              f"({saved!r})") from None
    differences = saved.differences(record())
    if differences:
        raise CheckpointError(f"--resume: the dataset {dataset} is not the one the run trained on "
                              f"({'; '.join(differences)}): it was prepared again, from other text or with other "
                              "settings; resume with the data the run started with, or start a new run in another "
                              "run.out_dir")
    return None


def saved_step(directory: str | Path) -> int | None:
    """The step a training checkpoint was saved at, from its config.json (None if unknown)."""

    try:
        return read_config(directory)[1].get("training", {}).get("step")
    except CheckpointError:
        return None


def saved_train_seconds(directory: str | Path) -> float | None:
    """The seconds of training a checkpoint holds (TrainResult.train_seconds), from its config.json
    (None if unknown): what a budget in seconds spends."""
    try:
        return read_config(directory)[1].get("training", {}).get("train_seconds")
    except CheckpointError:
        return None


def read_train_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / TRAIN_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not a training checkpoint")
    return yaml.safe_load(path.read_text())


# --- what a resumed run may change ---------------------------------------------------------------
#
# How --resume treats each field of a config: every field of every config dataclass is classified
# here once (tests/test_train.py checks that none is missing, so a field added later is too).
SAME = "same"  # decides the numbers the run computes: a resumed run must have the checkpoint's value
FREE = "free"  # observes, or says where, how fast or how often: may differ; the new value is used
LENGTHEN = "lengthen"  # run.steps, run.budget: the checkpoint's, or more on purpose (``lengthen``, see check_resumable)
KEPT = "kept"  # decided the first weights only (run.init_from): unset, or the checkpoint's value, which is kept

RESUME_RULES: dict[str, str | dict[str, str]] = {
    "name": FREE, "description": FREE, "source": FREE,  # the config's names and file
    # The trained model's entry: attention, preset and fields are compared as the ModelConfig they
    # make (every field, "model.NAME") with the checkpoint's config.json; its own optim fields as the
    # optimizer settings the model trains with ("optim.NAME").
    "models": {
        "name": FREE, "label": FREE, "paper_row": FREE,  # names in reports
        "attention": SAME, "preset": SAME, "fields": SAME, "optim": SAME,
        "diff_heads": SAME,  # a preset's head count kept (the wide-head Transformer): compared as the ModelConfig
        # The model's own fields in the small retrieval and grounded models: no language-model run reads
        # them, and a study's --resume compares them (its small runs were trained with them).
        "small_model": SAME,
    },
    "data": {
        "dataset": SAME,
        "cache_dir": FREE,  # where "default" is prepared: the same corpus wherever it lies
        "seq_len": SAME,  # compared resolved (unset = the model's max_seq_len)
        "batch_size": SAME,
        "micro_batch_size": FREE,  # how the global batch is cut: the same mean loss, to rounding (tested)
        "mix": SAME,
        "eval_sequences": SAME,  # the validation windows every "val" record measures: the run keeps one curve
        "heldout_sequences": FREE,  # scored once, at the end: observes only
        "within_documents": SAME, "long_document_tokens": SAME, "long_document_weight": SAME,
        "packing": SAME,  # the attention masks and positions of every sequence
    },
    "optim": {
        "recipe": FREE,  # a name for the values below, which are compared
        "lr": SAME, "min_lr": SAME, "warmup_steps": SAME, "betas": SAME, "weight_decay": SAME, "eps": SAME,
        "grad_clip": SAME,
    },
    "run": {
        "steps": LENGTHEN,
        "budget": LENGTHEN,  # its kind the checkpoint's; its amount the same or, on purpose, more
        "seed": SAME,  # the initial weights: the run's, whatever a resumed invocation says
        "data_seed": SAME,
        "eval_every": FREE, "log_every": FREE, "diagnostics": FREE,  # evaluation, logging and the probe only observe
        "checkpoint_every": FREE,
        "stop_at_step": FREE,  # ends one invocation (it must lie after the checkpoint's step)
        "out_dir": FREE, "checkpoint_dir": FREE, "tensorboard": FREE, "progress": FREE,
        "init_from": KEPT,
        "device": FREE,
        "precision": SAME,  # compared as what autocast ran: "auto" is bf16 on CUDA and fp32 on CPU
        "compile": FREE, "attn_backend": FREE, "parallel": FREE,  # the same sums, to rounding (tested)
    },
}


@dataclass
class ResumePoint:
    """Where a resumed run continues (see :func:`check_resumable`)."""

    checkpoint: Path
    progress: Progress  # the checkpoint's
    steps: int | None  # the run's length: the checkpoint's run.steps, or the longer one of a lengthened run
    init_from: str | None  # the run's run.init_from (kept: it decided the first weights)
    note: str | None = None  # said on stderr when the run goes on (a lengthened run: what its schedule does)
    seconds: float | None = None  # a budget in seconds (then ``steps`` is None)

    @property
    def step(self) -> int:
        """Optimizer steps the checkpoint holds."""
        return self.progress.step

    @property
    def finished(self) -> bool:
        if self.seconds is not None:
            return self.progress.train_seconds >= self.seconds
        return self.step >= self.steps


def trajectory_settings(config, model_name: str, model_config, device_type: str) -> dict[str, Any]:
    """The values of the SAME fields of ``config`` for model ``model_name`` (whose ModelConfig is
    ``model_config``), as the run uses them: "model.NAME", "data.NAME", "optim.NAME", "run.NAME"."""
    values = {f"model.{key}": value for key, value in model_config.to_dict().items()}
    optim = config.optim_for(model_name)  # the optim section with the model's own fields over it
    for section in ("data", "optim", "run"):
        source = optim if section == "optim" else getattr(config, section)
        values.update({f"{section}.{name}": getattr(source, name)
                       for name, rule in RESUME_RULES[section].items() if rule == SAME})
    values["data.seq_len"] = config.data.seq_len or model_config.max_seq_len
    values["run.precision"] = config.run.resolved_precision(device_type)
    return values


def check_resumable(directory: str | Path, config, model_name: str, model_config, *, progress: Progress,
                    device_type: str, lengthen: bool = False) -> ResumePoint:
    """Whether ``config`` (training ``model_name``, whose ModelConfig is ``model_config``, on a
    device of ``device_type``) continues the run whose checkpoint ``directory`` holds ``progress``:
    a CheckpointError naming each SAME setting that differs (field, the checkpoint's value, this
    config's), else where the run goes on.

    run.steps may differ only when ``lengthen`` (``train --set run.steps=N``) makes the run longer:
    the learning-rate schedule is then recomputed for the new length (the decay to min_lr ends at
    the new run.steps), which the returned note spells out. A shorter run, or one that ends before
    the checkpoint's step, is refused; so is a run.stop_at_step at or before that step.
    """
    from .config import config_from_dict

    directory, step = Path(directory), progress.step
    saved_model, _ = read_config(directory)
    saved_data = dict(read_train_config(directory))
    saved_name = saved_data.pop("trained_model", model_name)
    try:
        saved = config_from_dict(saved_data)
        saved.model(saved_name)
    except ConfigError as exc:
        raise CheckpointError(f"{directory / TRAIN_CONFIG_FILE}: not a config this version reads ({exc})") from None
    before = trajectory_settings(saved, saved_name, saved_model, device_type)
    now = trajectory_settings(config, model_name, model_config, device_type)
    differing = [f"{key}: {before.get(key)!r} -> {now[key]!r}" for key in now if now[key] != before.get(key)]
    kept, given = saved.run.init_from, config.run.init_from
    if given is not None and given != kept:
        differing.append(f"run.init_from: {kept!r} -> {given!r}")
    budget_differs, note = _budget_change(saved.run.budget, config.run.budget, lengthen)
    differing += budget_differs
    saved_steps, steps = saved.run.steps, config.run.steps  # a budget in tokens or FLOPs: its steps
    in_seconds = config.run.budget is not None and config.run.budget.kind == "seconds"
    if in_seconds or budget_differs:
        pass  # a budget in seconds has no step count; a budget refused says so once
    elif steps < step:
        differing.append(f"run.steps: {saved_steps} -> {steps}, before the checkpoint's step {step}")
    elif steps < saved_steps:
        differing.append(f"run.steps: {saved_steps} -> {steps} (a run is not shortened: its schedule decays over "
                         f"{saved_steps} steps)")
    elif steps > saved_steps and not lengthen:
        differing.append(f"run.steps: {saved_steps} -> {steps} (to lengthen the run on purpose, "
                         f"--set run.steps={steps})")
    elif steps > saved_steps:
        note = _lengthening_note(config.optim_for(model_name), saved_steps, steps, step)
    if differing:
        raise CheckpointError(f"{directory}: cannot resume with a different " + "; ".join(differing)
                              + "; a resumed run is the run that was started: resume with its settings, or start a "
                              "new run in another run.out_dir")
    stop = config.run.stop_at_step
    seconds = config.run.budget.amount if in_seconds else None
    point = ResumePoint(directory, progress, None if in_seconds else steps, kept, note, seconds)
    if stop is not None and stop <= step and not point.finished:
        raise CheckpointError(f"run.stop_at_step={stop}: the checkpoint {directory} is already at step {step}; set "
                              f"a later step, or unset it (null) to train to the end of the run")
    return point


def _budget_change(saved, budget, lengthen: bool) -> tuple[list[str], str | None]:
    """How run.budget changed from the checkpoint's ``saved`` to ``budget``: the differences a resume
    refuses, and the note of one it allows (more seconds, ``lengthen``). A budget in tokens or FLOPs
    lengthened on purpose lengthens run.steps, whose note :func:`check_resumable` gives."""
    def text(b) -> str:
        return "null (run.steps)" if b is None else f"{b.amount:g} {b.kind}"

    if (saved and saved.kind) != (budget and budget.kind):
        return [f"run.budget: {text(saved)} -> {text(budget)}"], None
    if budget is None or budget.amount == saved.amount:
        return [], None
    change = f"run.budget.amount: {saved.amount:g} -> {budget.amount:g} {budget.kind}"
    if budget.amount < saved.amount:
        return [f"{change} (a run is not shortened)"], None
    if not lengthen:
        return [f"{change} (to lengthen the run on purpose, --set run.budget.amount={budget.amount:g})"], None
    if budget.kind != "seconds":
        return [], None
    return [], (f"note: lengthening the run from {saved.amount:g} to {budget.amount:g} seconds: the learning-rate "
                f"decay is recomputed to end at {budget.amount:g} seconds, from where the run is")


def _lengthening_note(optim, saved_steps: int, steps: int, step: int) -> str:
    """What lengthening a run from ``saved_steps`` to ``steps`` at checkpoint ``step`` does to its
    learning-rate schedule: whether the steps taken had the rates of a run started at ``steps``."""
    from .optim import warmup_linear_lr

    def rate(s: int, total: int) -> float:
        return warmup_linear_lr(s, optim.lr, optim.min_lr, optim.warmup_steps, total)

    head = (f"note: lengthening the run from run.steps={saved_steps} to {steps}: the learning-rate schedule is "
            f"recomputed for {steps} steps (the decay to optim.min_lr now ends at step {steps})")
    if all(rate(s, saved_steps) == rate(s, steps) for s in range(step)):
        return (f"{head}; the {step} steps taken had the same rates under both lengths, so the run goes on as one "
                f"started with run.steps={steps}")
    return (f"{head}; the {step} steps taken followed the {saved_steps}-step schedule, so the run is not one "
            f"started with run.steps={steps}: its lr goes from {rate(step, saved_steps):.4g} (the {saved_steps}-step "
            f"schedule) to {rate(step, steps):.4g} at step {step + 1}")


# What a run started from another checkpoint's weights (run.init_from) may change in the model: the
# context and RoPE's base. Neither is in the state dict (the RoPE table is computed from them), so
# the weights fit unchanged; any other ModelConfig field would change what the weights mean.
INIT_CHANGEABLE = ("max_seq_len", "rope_theta")


def check_initializable(directory: str | Path, model_config) -> None:
    """A ConfigError naming the problem unless the weights of checkpoint ``directory`` (a training
    checkpoint or a ``save_pretrained`` one) can start a run of ``model_config``: the same model
    but for :data:`INIT_CHANGEABLE`."""

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
    problem = weights_problem(path / WEIGHTS_FILE, model_config)
    if problem is not None:
        raise ConfigError(f"run.init_from: {problem}")


def weights_problem(path: Path, model_config) -> str | None:
    """What keeps the safetensors file ``path`` from loading into a model of ``model_config``, from
    its header alone (unreadable or truncated, a tensor missing, foreign or of another shape), or
    None. Their values (NaN...) are checked when they are read."""
    from safetensors import SafetensorError, safe_open

    from ..model import LanguageModel

    try:
        with safe_open(str(path), "pt") as weights:
            shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except (SafetensorError, OSError) as exc:
        return f"{path}: truncated or corrupted safetensors file ({exc})"
    expected = {name: tuple(t.shape) for name, t in LanguageModel(model_config, device="meta").state_dict().items()}
    wrong = sorted(set(shapes) ^ set(expected)) + sorted(n for n in set(shapes) & set(expected)
                                                         if shapes[n] != expected[n])
    if wrong:
        return f"{path}: its tensors do not fit the model ({', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''})"
    return None


def check_initial_tokenizer(directory: str | Path, tokenizer, where: str = "run.init_from") -> None:
    """A ConfigError if checkpoint ``directory`` holds a tokenizer other than ``tokenizer`` (the
    dataset's): its weights would read other tokens. ``where`` opens the message (what names the
    checkpoint: run.init_from, or --resume)."""

    try:
        saved = load_checkpoint_tokenizer(directory)
    except CheckpointError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if saved is not None and not same_tokenizer(saved, tokenizer):
        raise ConfigError(f"{where}: {directory} was trained with another tokenizer than the dataset's "
                          f"({type(saved).__name__} of {saved.vocab_size} tokens against "
                          f"{type(tokenizer).__name__} of {tokenizer.vocab_size}, or other merges)")



def load_weights(directory: str | Path, model: nn.Module, env: Environment) -> None:
    """Load the weights of checkpoint ``directory`` into ``model`` in place: when resuming, and when
    a new run starts from another checkpoint (run.init_from, checked by :func:`check_initializable`;
    its optimizer, schedule and step count stay fresh).

    Every rank calls it; under torchrun rank 0 reads the file and broadcasts into the shards.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict


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
        raise CheckpointError(f"{directory / TRAINING_STATE_FILE}: optimizer state does not fit the model "
                              f"({exc})") from exc
    schedule.load_state_dict(state["schedule"])
    set_rng_states(state["rng"])
    return Progress(**state["progress"])
