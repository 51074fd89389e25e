"""The training loop: one entry point for one CPU, one GPU, or K processes under torchrun.

    diff-transformer train --config tiny --model diff                        # one process
    torchrun --nproc_per_node 4 -m diff_transformer train --config tiny --model diff
    diff-transformer train --config tiny --model diff --resume               # continue a run
    diff-transformer train --config tiny --model diff --init-from RUN/checkpoint --set model.max_seq_len=1024 ...
                                          # a new run from another's weights (a longer context, another RoPE θ)

    from diff_transformer.train import load_config, train
    result = train(load_config("tiny", ["run.steps=100"]), "diff")

Each optimizer step takes the global batch of ``data.batch_size`` sequences, samples
step·B … step·B + B − 1 of the dataset, cut into equal parts per process and into micro-batches
of ``data.micro_batch_size`` (gradient accumulation). The loss of a step is the mean over every
counted target token of the global batch, however it is cut, so K processes follow the same
curve as one. A run writes into ``run.out_dir``:

    metrics.jsonl       one JSON record per logged training step ("train"), per evaluation ("val"), per
                        gradient-norm spike ("grad_spike") and per diagnostics probe ("diagnostics":
                        λ, attention-branch RMS and negative map share per layer; see diagnostics.py)
    tensorboard/        the same curves for TensorBoard (run.tensorboard; per-layer lists as NAME/layer_i)
    summary.json        the result: final validation loss, tokens/s, peak memory, status
    checkpoint/         the training checkpoint (unless run.checkpoint_dir points elsewhere)
    .lock               while the run lasts: its pid (one run at a time writes into a directory)

A second process started on the same ``run.out_dir`` (or ``run.checkpoint_dir``) is refused,
naming the pid that holds it (:func:`~diff_transformer.files.lock_output_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from ..config import DIFF_HEAD_KINDS, ConfigError, ModelConfig
from ..loss import IGNORE_INDEX
from ..checkpoint import remove_abandoned_temporaries
from ..files import (
    LOCK_FILE, OutputLock, OutputPathError, check_output_dir, check_unlocked, claim_output_dir,
    ending_signals_to_catch, lock_file,
    lock_output_dir, naming_os_errors, write_text_atomically,
)
from ..model import LanguageModel
from .budget import RunLength, flops_per_token, resolve_steps
from .config import ModelEntry, OptimConfig, TrainConfig
from .diagnostics import PROBE_SEQUENCES, GradientSpikes, probe
from .distributed import (
    Environment, all_gather, all_reduce_sum, broadcast_from_main, parallelize, resolve_device, setup, teardown, unwrap,
)
from .events import EventFile
from .optim import WarmupLinearSchedule, build_optimizer
from .step import advance, clip_gradients, forward_backward, token_loss_sum
from .state import (
    DatasetRecord, Progress, ResumePoint, check_initial_tokenizer, check_initializable, check_resumable,
    check_same_dataset, check_same_save, find_checkpoint, load_training_checkpoint, load_weights, read_training_state,
    save_training_checkpoint, saved_step,
)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STUDY_RUN_ENV = "DIFF_TRANSFORMER_STUDY_RUN"  # set in a study's runs (experiments.runner): the study reports a stop
# Training steps whose window starts DataPlan draws in one call (a block: 64 × the batch's samples)
STARTS_AHEAD = 64
# The clock that times each training step (tokens/s, a budget in seconds); tests put a fake one here.
step_clock = time.perf_counter


class TrainingError(RuntimeError):
    """The run cannot start or cannot go on (the message says why)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk...); the message says what remains."""


@dataclass
class TrainResult:
    """What a run reports (also written to out_dir/summary.json by rank 0)."""

    model: str
    attention: str
    parameters: int
    status: str  # "completed"; "interrupted" (by a signal) or "paused" (run.stop_at_step), both with a
    #              checkpoint saved; "diverged" (NaN/inf loss: stopped, the last good checkpoint kept);
    #              "finished" (returned, never written: --resume of a run that had finished did nothing)
    steps: int  # optimizer steps done
    tokens: int  # training tokens consumed, over all processes
    final_val_loss: float | None
    # Throughput and time over every invocation of the run (a resumed run's include the earlier ones',
    # up to the checkpoint it resumed from): tokens/s over all processes, evaluation and saving excluded
    # (each invocation's first step warms up and is not timed); train_seconds, the timed steps' time.
    tokens_per_s: float
    peak_memory_bytes: int  # this invocation's
    peak_memory_kind: str  # "peak RSS" (CPU; the process's, including Python and torch) or "max allocated" (CUDA)
    train_seconds: float
    wall_seconds: float
    load_average: float | None  # mean 1-minute load average seen at logging steps (None where unknown)
    device: str
    world_size: int
    checkpoint: str | None
    message: str = ""
    stopped_by: str | None = None  # "SIGINT", "SIGTERM" or "SIGHUP" when a signal interrupted the run
    # steps whose gradient norm exceeded 5x the median of the previous 50 (metrics.jsonl names them)
    grad_norm_spikes: int = 0
    init_from: str | None = None  # the checkpoint whose weights started the run (run.init_from), if any
    resumed_from: int | None = None  # the checkpoint step this invocation went on from; None: it started the run
    # What the run's length was counted in: "steps" (run.steps), or run.budget's "tokens", "flops", "seconds"
    budget_kind: str = "steps"
    # Training FLOPs per token and spent (tokens × that: diff_transformer.flops); None for an attention
    # kind the formula has no term for
    flops_per_token: float | None = None
    flops: float | None = None
    # the loss on the data.heldout_sequences windows when the run completed (None: none configured, or not completed)
    final_heldout_loss: float | None = None


# --- data ---------------------------------------------------------------------------------------


class DataPlan:
    """Which samples each process reads at each step, and the fixed validation set."""

    def __init__(self, config: TrainConfig, seq_len: int, env: Environment) -> None:
        from ..data import MixedBatches, TokenShards, dataset_directory

        data = config.data
        directory = dataset_directory(data.dataset, data.cache_dir, progress=env.is_main)
        try:
            shards = TokenShards(directory, "train", within_documents=data.within_documents,
                                 long_document_tokens=data.long_document_tokens,
                                 long_document_weight=data.long_document_weight)
            self.validation = TokenShards(directory, "val", within_documents=data.within_documents)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"data.dataset: {exc}") from None
        self.directory = directory
        self._shards = shards
        self.train = MixedBatches(shards, data.mix) if data.mix else shards
        # data.packing=documents: a document starts at each end-of-text token (model.document_ids)
        self.separator = shards.eos_id if data.packing == "documents" else None
        self.tokenizer = shards.tokenizer
        self.vocab_size = shards.vocab_size
        self.seq_len, self.seed = seq_len, config.run.data_seed
        self.batch_size = data.batch_size
        if data.batch_size % env.world_size:
            raise ConfigError(f"data.batch_size={data.batch_size} must be divisible by the {env.world_size} processes")
        self.per_process = data.batch_size // env.world_size
        self.micro_batch_size = data.micro_batch_size or self.per_process
        if self.per_process % self.micro_batch_size:
            raise ConfigError(
                f"data.micro_batch_size={self.micro_batch_size} must divide the {self.per_process} sequences "
                f"per process (data.batch_size={data.batch_size} over {env.world_size} processes)"
            )
        self.accumulation = self.per_process // self.micro_batch_size
        if data.eval_sequences % env.world_size:
            raise ConfigError(f"data.eval_sequences={data.eval_sequences} must be divisible by the "
                              f"{env.world_size} processes")
        if data.heldout_sequences % env.world_size:
            raise ConfigError(f"data.heldout_sequences={data.heldout_sequences} must be divisible by the "
                              f"{env.world_size} processes")
        self.eval_sequences = data.eval_sequences
        self.heldout_sequences = data.heldout_sequences
        self.world_size = env.world_size
        self.rank = env.rank
        self._corpus_only = type(self.train) is TokenShards  # no data.mix: every sample a corpus window
        self._starts: np.ndarray | None = None  # the window starts of STARTS_AHEAD steps (_window_starts)
        self._starts_block: int | None = None

    @functools.cached_property
    def record(self) -> DatasetRecord:
        """The dataset as checkpoints record it (its fingerprint: computed from the files, one read,
        for a dataset prepared before meta.json carried one; asked by rank 0 only)."""
        from ..data.prepare import dataset_fingerprint

        splits = self._shards.meta
        return DatasetRecord(dataset_fingerprint(self.directory), splits["train"]["tokens"], splits["val"]["tokens"],
                             splits["train"].get("documents", 0), splits["val"].get("documents", 0))

    def check_train_windows(self, examples: int = 16) -> None:
        """A ValueError naming what would fail at the first steps: a train split too short for one
        window of seq_len (+1 target), or a task of data.mix whose examples (the first ``examples`` of
        each) do not fit seq_len. A task with no share is never drawn: not checked."""
        from ..data import MixedBatches

        corpus = self.train.shards if isinstance(self.train, MixedBatches) else self.train
        corpus.window_starts([0], self.seq_len, seed=self.seed)
        if isinstance(self.train, MixedBatches):
            for name, share in self.train.mix.items():
                try:
                    for index in range(examples if share > 0 else 0):
                        self.train.generate(name, index, self.seq_len, seed=self.seed)
                except ValueError as exc:
                    raise ConfigError(f"data.mix: the {name!r} task at data.seq_len={self.seq_len}: {exc}; raise "
                                      f"data.seq_len or take {name!r} out of data.mix") from None

    def micro_batches(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's micro-batches of optimizer step ``step`` (0-based): (inputs, targets) (b, T)."""
        if self._corpus_only:  # corpus windows: their starts drawn STARTS_AHEAD steps at a time
            starts = self._window_starts(step)
            for m in range(self.accumulation):
                part = starts[m * self.micro_batch_size:(m + 1) * self.micro_batch_size]
                yield self.train.read_windows(part, self.seq_len)
            return
        first = step * self.batch_size + self.rank * self.per_process
        for m in range(self.accumulation):
            start = first + m * self.micro_batch_size
            yield self.train.get_batch(range(start, start + self.micro_batch_size), self.seq_len, seed=self.seed)

    def _window_starts(self, step: int) -> np.ndarray:
        """This process's window starts of step ``step``. A sample's window depends on (seed, its index)
        alone (TokenShards.window_starts), so drawing those of STARTS_AHEAD steps in one call gives the
        same windows as get_batch step by step, for the cost of one step's Python and NumPy calls (the
        draw was ~10% of a small model's step)."""
        block = step // STARTS_AHEAD
        if self._starts_block != block:
            steps = np.arange(block * STARTS_AHEAD, (block + 1) * STARTS_AHEAD, dtype=np.int64)
            indices = (steps[:, None] * self.batch_size + self.rank * self.per_process
                       + np.arange(self.per_process, dtype=np.int64))
            starts = self.train.window_starts(indices.reshape(-1), self.seq_len, seed=self.seed)
            self._starts, self._starts_block = starts.reshape(STARTS_AHEAD, self.per_process), block
        return self._starts[step - block * STARTS_AHEAD]

    def probe_tokens(self, sequences: int) -> torch.Tensor:
        """The first ``sequences`` validation windows' inputs (B, T), the same on every process."""
        inputs, _ = self.validation.val_batches(1, self.eval_sequences, self.seq_len)[0]
        return inputs[:sequences]

    def validation_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's share of the fixed validation windows, in micro-batches."""
        inputs, targets = self.validation.val_batches(1, self.eval_sequences, self.seq_len)[0]
        return self._share(inputs, targets)

    def heldout_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's share of the held-out windows (data.heldout_sequences, between the validation
        windows), in micro-batches; none when there are none."""
        if not self.heldout_sequences:
            return []
        return self._share(*self.validation.heldout_windows(self.eval_sequences, self.heldout_sequences,
                                                            self.seq_len))

    def _share(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's part of the windows (B, T), in micro-batches."""
        per_process = len(inputs) // self.world_size
        mine = slice(self.rank * per_process, (self.rank + 1) * per_process)
        return list(zip(inputs[mine].split(self.micro_batch_size), targets[mine].split(self.micro_batch_size)))


# --- the loop ------------------------------------------------------------------------------------


class _StopSignal:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal; not where it is ignored, as under nohup) set a flag;
    the loop saves a checkpoint and stops after the current step. A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        if not os.environ.get(STUDY_RUN_ENV):  # a study's run: the study says it in one line
            print(f"\n{signal.Signals(signum).name} received: saving a checkpoint after this step", file=sys.stderr)

    def __enter__(self) -> "_StopSignal":
        if _in_main_thread():
            for signum in ending_signals_to_catch():
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def process_peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what) — CUDA max allocated, or this process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"  # Linux reports KiB


class MetricsLog:
    """metrics.jsonl (and TensorBoard) on rank 0; a resumed run first drops records past its step."""

    def __init__(self, out_dir: Path, env: Environment, tensorboard: bool, resume_step: int | None) -> None:
        self.enabled = env.is_main
        self.path = out_dir / METRICS_FILE
        self.writer = None
        if not self.enabled:
            return
        claim_output_dir(out_dir, "train-run")
        # The file is created by the first record (a run that fails to start leaves no empty file).
        kept = [] if resume_step is None else [line for line in read_metrics(self.path) if line["step"] <= resume_step]
        if kept:
            write_text_atomically(self.path, "".join(json.dumps(record) + "\n" for record in kept))
        else:
            self.path.unlink(missing_ok=True)
        if tensorboard:
            # A resumed run drops TensorBoard events after its checkpoint's step, as metrics.jsonl does.
            purge = None if resume_step is None else resume_step + 1
            self.writer = EventFile(out_dir / "tensorboard", purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        size = self.path.stat().st_size if self.path.exists() else None
        try:
            with naming_os_errors(self.path), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:  # a full disk: no partial record, and no empty file, is left
            with contextlib.suppress(OSError):
                if size is None:
                    self.path.unlink(missing_ok=True)
                else:
                    os.truncate(self.path, size)
            raise
        if self.writer is not None:
            scalars = {}
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)):
                    scalars[f"{record['kind']}/{key}"] = value
                elif isinstance(value, list):  # one value per layer: lambda/layer_0, lambda/layer_1, ...
                    scalars.update({f"{key}/layer_{i}": x for i, x in enumerate(value)})
            self.writer.add_scalars(scalars, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (an empty list if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _autocast(env: Environment, precision: str):
    if precision == "auto":
        precision = "bf16" if env.device.type == "cuda" else "fp32"
    if precision == "bf16":
        return torch.autocast(device_type=env.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, batches, env: Environment, autocast, separator: int | None = None) -> float:
    """Mean validation loss per counted target token over all processes' batches (``separator``:
    packed documents, as in training)."""
    model.eval()
    loss_sum, count = 0.0, 0
    for inputs, targets in batches:
        inputs, targets = inputs.to(env.device), targets.to(env.device)
        with autocast:
            loss_sum += float(token_loss_sum(model, inputs, targets, separator))
        count += int((targets != IGNORE_INDEX).sum())
    model.train()
    loss_sum, count = all_reduce_sum([loss_sum, count], env)
    return loss_sum / max(count, 1)


def train(config: TrainConfig, model_name: str | None = None, *, resume: bool = False,
          lengthen: bool = False) -> TrainResult:
    """Train one model of ``config`` (the only one, or the entry ``model_name``); see the module docstring.

    ``resume`` continues the run from its checkpoint: with the settings it was started with (any
    that changes the numbers and differs is refused by name, see ``state.RESUME_RULES``), except
    that ``lengthen`` lets a larger run.steps lengthen it (the schedule is recomputed for the new
    length; a note says what that does). A finished run's resume returns its result (status
    "finished") and writes nothing. Everything :func:`check_training` checks is checked before
    any file or directory is created. Under torchrun every process calls this; the result is the
    same on all of them.
    """
    entry = config.model(model_name)
    model_config = entry.model_config()
    run = config.run
    env = setup(run.device)
    try:
        return _train(config, entry, model_config, env, resume, lengthen)
    finally:
        teardown(env)


@dataclass
class TrainingPlan:
    """What :func:`check_training` found, before anything was written: a run that can start, or
    go on from its checkpoint."""

    config: TrainConfig  # as the run uses it (a resumed run keeps its run.init_from)
    entry: ModelEntry
    model_config: ModelConfig
    out_dir: Path
    checkpoint_dir: Path
    data: DataPlan
    validation: list  # this process's validation micro-batches (DataPlan.validation_batches)
    heldout: list  # this process's held-out micro-batches (DataPlan.heldout_batches; empty: none)
    init_from: Path | None  # the weights a new run starts from (run.init_from)
    resume: ResumePoint | None  # where a resumed run goes on; None for a new run

    @property
    def reading(self) -> list[Path]:
        """What the run reads: the dataset, and the checkpoint whose weights start it."""
        return [self.data.directory] + ([self.init_from] if self.init_from is not None else [])

    def go_on_from(self, point: ResumePoint | None) -> None:
        """Resume at ``point`` (None: a new run); a resumed run is the run that was started, with the
        run.init_from that started it."""
        self.resume = point
        if point is not None:
            self.config = dataclasses.replace(self.config, run=dataclasses.replace(self.config.run,
                                                                                   init_from=point.init_from))


def check_training(config: TrainConfig, model_name: str | None = None, *, resume: bool = False,
                   lengthen: bool = False, processes: int = 1) -> TrainingPlan:
    """Every check :func:`train` makes before it creates anything, for a run of ``processes``
    processes (torchrun's): the config against the model, the attention backend on this device,
    the dataset (readable, its vocabulary within the model's, its validation split big enough),
    run.init_from's checkpoint, the output paths (new or this run's, not inside what it reads),
    and with ``resume`` the checkpoint (there, of this run, its settings those of the config).
    Raises the error ``train`` would (ConfigError, CheckpointError, OutputPathError,
    TrainingError); writes nothing (but for the corpus cache of ``data.dataset: default``), so
    that ``compare`` can check every run before it starts one."""
    entry = config.model(model_name)
    env = Environment(rank=0, world_size=processes, local_rank=0, device=resolve_device(config.run.device))
    return _check(config, entry, entry.model_config(), env, resume=resume, lengthen=lengthen)


def check_inputs(config: TrainConfig, model_name: str | None = None, *, processes: int = 1,
                 data: bool = True) -> None:
    """The checks of :func:`check_training` that read (the config against the model, the backend on this
    device, run.init_from's checkpoint, the dataset), not those of the output paths: what a study checks
    of each of its runs before it creates anything (its runner owns the runs' directories). Without
    ``data``, the settings alone: nothing is read or tokenized (a study checks every run's settings so
    before the first run's data)."""
    entry = config.model(model_name)
    env = Environment(rank=0, world_size=processes, local_rank=0, device=resolve_device(config.run.device))
    model_config = entry.model_config()
    if data:
        _check_inputs(config, entry, model_config, env, resume=False)
    else:
        _check_settings(config, entry, model_config, env, resume=False)


def _check(config: TrainConfig, entry: ModelEntry, model_config: ModelConfig, env: Environment, *, resume: bool,
           lengthen: bool) -> TrainingPlan:
    """:func:`check_training` for the process ``env`` describes: every process checks what it
    reads, rank 0 the directories and the checkpoint too."""
    plan = _check_inputs(config, entry, model_config, env, resume=resume)
    if env.is_main:
        plan.go_on_from(_check_outputs(plan, env, resume=resume, lengthen=lengthen))
    return plan


def _check_together(config: TrainConfig, entry: ModelEntry, model_config: ModelConfig, env: Environment, *,
                    resume: bool, lengthen: bool) -> TrainingPlan:
    """:func:`_check` in every process of a run: all of them raise if one refuses (a TrainingError
    with the first refusal where a process had none of its own), so that none waits for the others
    in a collective; rank 0's resume point is every process's."""
    error: Exception | None = None
    try:
        plan = _check(config, entry, model_config, env, resume=resume, lengthen=lengthen)
    except (ValueError, OSError, TrainingError) as exc:  # the project's errors are ValueErrors (ConfigError...)
        error = exc
    refusals = all_gather(None if error is None else str(error), env)
    if error is not None:
        raise error
    first = next((message for message in refusals if message is not None), None)
    if first is not None:
        raise TrainingError(first)
    point = broadcast_from_main(plan.resume, env)
    if not env.is_main:
        plan.go_on_from(point)
    return plan


@dataclass
class _Settings:
    """What :func:`_check_settings` resolved: the config (a budget in tokens or FLOPs made its run.steps),
    the run's directories, sequence length and starting weights."""

    config: TrainConfig
    out_dir: Path
    checkpoint_dir: Path
    seq_len: int
    init_from: Path | None  # the weights a new run starts from (None when resuming)


def _check_settings(config: TrainConfig, entry: ModelEntry, model_config: ModelConfig, env: Environment, *,
                    resume: bool) -> _Settings:
    """The config against itself, the model and this device, and run.init_from's checkpoint: nothing
    of the dataset is read (so a contradiction in the config is refused before a corpus is tokenized)."""
    run, data = config.run, config.data
    out_dir = Path(run.out_dir)
    checkpoint_dir = out_dir / "checkpoint" if run.checkpoint_dir is None else Path(run.checkpoint_dir)
    target, logs = checkpoint_dir.resolve(), out_dir.resolve()
    if target == logs or target in logs.parents:  # each save replaces the checkpoint directory as a whole
        raise ConfigError(f"run.checkpoint_dir: {checkpoint_dir} is run.out_dir {out_dir} or contains it, and every "
                          f"save replaces it as a whole; leave it unset (run.out_dir/checkpoint) or choose another")
    seq_len = data.seq_len or model_config.max_seq_len
    if seq_len > model_config.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's max_seq_len={model_config.max_seq_len}")
    config = resolve_steps(config, entry.name, model_config, seq_len)  # a budget in tokens or FLOPs: its steps
    problem = backend_problem(run.attn_backend, env.device, model_config, seq_len, packing=data.packing)
    if problem is not None:
        raise ConfigError(problem)
    # A resumed run continues from its own checkpoint: run.init_from only starts a new one.
    init_from = None if resume or run.init_from is None else Path(run.init_from)
    if init_from is not None:
        check_initializable(init_from, model_config)  # before the data: a missing checkpoint is named first
        source = init_from.resolve()
        if target == source or target in source.parents:
            raise ConfigError(f"run.init_from: {init_from} is this run's checkpoint directory {checkpoint_dir} "
                              f"or inside it, which the run would replace; choose another run.out_dir / "
                              f"run.checkpoint_dir")
    return _Settings(config, out_dir, checkpoint_dir, seq_len, init_from)


def _check_inputs(config: TrainConfig, entry: ModelEntry, model_config: ModelConfig, env: Environment, *,
                  resume: bool) -> TrainingPlan:
    """The settings (:func:`_check_settings`), then the dataset against them (every process): its
    vocabulary within the model's, a validation window and a training batch in its splits."""
    settings = _check_settings(config, entry, model_config, env, resume=resume)
    config = settings.config
    plan = DataPlan(config, settings.seq_len, env)
    if plan.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"dataset {plan.directory} has a vocabulary of {plan.vocab_size} tokens, more than model "
            f"{entry.name!r}'s vocab_size={model_config.vocab_size}: give the model the dataset's vocabulary "
            f"(--set model.vocab_size={plan.vocab_size})"
        )
    try:
        validation = plan.validation_batches()
        heldout = plan.heldout_batches()
        plan.check_train_windows()
    except ConfigError:  # data.mix: named as such
        raise
    except ValueError as exc:  # a split too short for one window, or for held-out windows between the validation ones
        raise ConfigError(f"data.dataset: {exc}") from None
    if settings.init_from is not None:
        check_initial_tokenizer(settings.init_from, plan.tokenizer)
    return TrainingPlan(config=config, entry=entry, model_config=model_config, out_dir=settings.out_dir,
                        checkpoint_dir=settings.checkpoint_dir, data=plan, validation=validation, heldout=heldout,
                        init_from=settings.init_from, resume=None)


def backend_problem(backend: str, device: torch.device, model_config: ModelConfig, seq_len: int, *,
                    packing: str = "none") -> str | None:
    """Why run.attn_backend ``backend`` cannot train ``model_config`` on ``device`` at ``seq_len``
    tokens (with data.packing ``packing``), or None. The attention kinds without DIFF heads call
    SDPA (or the reference, or FlexAttention) whatever the name (diff_transformer.ops.attention);
    the others dispatch to the backend."""
    if backend == "flex" and device.type != "cuda":
        return (f"run.attn_backend=flex trains on CUDA only (FlexAttention has no backward on the {device.type}); "
                "choose another backend (auto)")
    if model_config.attention not in DIFF_HEAD_KINDS:
        return None
    if backend == "triton" and packing == "documents":
        return ("run.attn_backend=triton takes no attention mask, and data.packing=documents confines attention to "
                "each document with one; choose another backend (auto, or flex on CUDA)")
    if backend == "decode" and seq_len > 1:
        return ("run.attn_backend=decode takes one query per sequence (decoding with a KV cache), not training "
                f"windows of {seq_len} tokens; choose another backend (auto)")
    if backend != "triton":
        return None
    from .. import ops

    missing = ops.triton_import_error()
    if missing is not None:
        return f"run.attn_backend=triton: {missing}; choose another backend (auto)"
    from ..ops import triton_diff

    if device.type != "cuda" and not triton_diff.INTERPRET:
        return (f"run.attn_backend=triton needs a CUDA GPU, and this run is on the {device.type}; choose another "
                "backend (auto), or run.device=cuda on a machine with a GPU")
    if model_config.head_dim not in ops.TRITON_HEAD_DIMS:
        return (f"run.attn_backend=triton takes head dims {', '.join(map(str, ops.TRITON_HEAD_DIMS))}, and the "
                f"model's is {model_config.head_dim}; choose another backend (auto)")
    return None


def _check_outputs(plan: TrainingPlan, env: Environment, *, resume: bool, lengthen: bool) -> ResumePoint | None:
    """run.out_dir and run.checkpoint_dir, and with ``resume`` the checkpoint (rank 0; reads only):
    where a resumed run goes on."""
    config, out_dir, checkpoint_dir = plan.config, plan.out_dir, plan.checkpoint_dir
    elsewhere = "choose another run.out_dir / run.checkpoint_dir"
    # A run another process is training is answered as such (its files are in flux): the locks
    # _lock_run takes, looked at without taking them.
    check_unlocked(out_dir / LOCK_FILE, f"{out_dir}: in use by another diff-transformer process")
    check_unlocked(checkpoint_lock_file(checkpoint_dir),
                   f"{checkpoint_dir}: in use by another diff-transformer process")
    # Neither directory may hold anything the project did not write, nor be, hold or lie inside
    # the data or the weights the run reads.
    for directory, setting in ((out_dir, "run.out_dir"), (checkpoint_dir, "run.checkpoint_dir")):
        for source in plan.reading:
            if source.resolve() in directory.resolve().parents:
                raise OutputPathError(f"{setting}: {directory} lies inside {source}, which this run reads; {elsewhere}")
    check_output_dir(out_dir, "train-run", reuse=True, reading=plan.reading, hint=elsewhere)
    # (own_training_state: this run replaces only its own training checkpoint, found and checked below)
    check_output_dir(checkpoint_dir, "checkpoint", overwrite=True, reading=plan.reading, hint=elsewhere,
                     own_training_state=True)
    existing = find_checkpoint(checkpoint_dir)
    if resume and existing is None:
        raise TrainingError(f"--resume: no training checkpoint at {checkpoint_dir}")
    if not resume and existing is not None:
        raise TrainingError(
            f"{existing} already holds a training checkpoint: pass --resume to continue it, "
            f"or choose another run.out_dir / run.checkpoint_dir"
        )
    # A new run would replace an earlier run's logs (one whose checkpoint lies elsewhere, or one
    # that ended before its first checkpoint): they are results too, so the run is refused.
    earlier = [] if resume else [name for name in (METRICS_FILE, SUMMARY_FILE) if (out_dir / name).is_file()]
    if earlier:
        raise TrainingError(
            f"{out_dir} holds the logs of an earlier run ({', '.join(earlier)}), and there is no checkpoint of it "
            f"in {checkpoint_dir} to resume; choose another run.out_dir, or move them out of it to start a new "
            "run there"
        )
    # Each save replaces the checkpoint directory: one that holds files the project did not write
    # there (the user's, an export made inside it) is refused now, not deleted by the first save.
    check_output_dir(checkpoint_dir, "checkpoint", overwrite=existing is not None, reading=plan.reading,
                     hint=elsewhere, own_training_state=True)
    if existing is None:
        return None
    state = read_training_state(existing, mmap=True)  # the step and the save's id; the rest is read to resume
    check_same_save(existing, state)
    progress = Progress(**state["progress"])
    check_initial_tokenizer(existing, plan.data.tokenizer, where="--resume")
    note = check_same_dataset(existing, state, plan.data.directory, lambda: plan.data.record)
    point = check_resumable(existing, config, plan.entry.name, plan.model_config, progress=progress,
                            device_type=env.device.type, lengthen=lengthen)
    if note is not None:
        point = dataclasses.replace(point, note=note if point.note is None else f"{note}\n{point.note}")
    return point


def _train(config: TrainConfig, entry: ModelEntry, model_config, env: Environment, resume: bool,
           lengthen: bool) -> TrainResult:
    wall_start = time.perf_counter()
    plan = _check_together(config, entry, model_config, env, resume=resume, lengthen=lengthen)
    if plan.resume is not None and plan.resume.finished:
        return _finished(plan, env)
    with contextlib.ExitStack() as held:  # the run directory's lock, released however the run ends
        return _train_holding(plan, env, held, wall_start)


def _finished(plan: TrainingPlan, env: Environment) -> TrainResult:
    """A finished run's resume: says so (rank 0) and writes nothing; its result as summary.json
    holds it, with status "finished" (from the checkpoint where that file is missing)."""
    point, length = plan.resume, RunLength.of(plan.config)
    if length.seconds is None:
        message = (f"{point.checkpoint}: the run is finished (step {point.step} of {length.describe()}); nothing "
                   f"done, nothing written. To train it longer, --set "
                   + (f"run.steps=N (N > {point.steps})" if length.kind == "steps" else "run.budget.amount=N (more)"))
    else:
        message = (f"{point.checkpoint}: the run is finished ({point.progress.train_seconds:.1f} seconds of training "
                   f"of {length.describe()}); nothing done, nothing written. To train it longer, --set "
                   "run.budget.amount=N (more seconds)")
    summary = _read_summary(plan.out_dir / SUMMARY_FILE)
    if summary is None or summary.status != "completed" or summary.steps != point.step:
        message += f"; {plan.out_dir / SUMMARY_FILE} does not hold its result (the run stopped after its last save)"
        progress = point.progress
        summary = TrainResult(
            model=plan.entry.name, attention=plan.model_config.attention,
            parameters=LanguageModel(plan.model_config, device="meta").num_parameters(), status="completed",
            steps=progress.step, tokens=progress.tokens, final_val_loss=None,
            tokens_per_s=progress.timed_tokens / progress.train_seconds if progress.train_seconds else 0.0,
            peak_memory_bytes=0, peak_memory_kind="not measured", train_seconds=progress.train_seconds,
            wall_seconds=progress.wall_seconds, load_average=None, device=str(env.device.type),
            world_size=env.world_size, checkpoint=str(point.checkpoint), init_from=point.init_from,
            **_cost(plan, progress.tokens),
        )
    if env.is_main:
        print(message, file=sys.stderr)
    return dataclasses.replace(summary, status="finished", message=message)


def _cost(plan: TrainingPlan, tokens: int) -> dict[str, Any]:
    """The TrainResult fields of a run's cost beside its tokens and time: the budget's kind, the
    training FLOPs per token and those spent (None for a kind without a FLOPs term)."""
    per_token = flops_per_token(plan.model_config, plan.data.seq_len)
    return dict(budget_kind=RunLength.of(plan.config).kind, flops_per_token=per_token,
                flops=None if per_token is None else per_token * tokens)


def _read_summary(path: Path) -> TrainResult | None:
    """The TrainResult a summary.json holds, or None (missing, unreadable, or from another version)."""
    try:
        return TrainResult(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _train_holding(plan: TrainingPlan, env: Environment, held: contextlib.ExitStack, wall_start: float) -> TrainResult:
    run = _Run.prepare(plan, env, held, wall_start)
    status, message, final_val = _loop(run)
    final_heldout = None
    if status == "completed" and plan.heldout:  # scored once, on the final weights
        final_heldout = evaluate(run.eval_model, plan.heldout, env, run.autocast, run.plan.separator)
        run.log.write(dict(kind="heldout", step=run.progress.step, tokens=run.progress.tokens, loss=final_heldout))
    run.log.close()
    run.account()
    saved = run.last_saved or find_checkpoint(run.checkpoint_dir)  # diverged, or a rank other than 0
    if status == "diverged" and env.is_main:
        print(message, file=sys.stderr)
    memory, memory_kind = process_peak_memory(env.device)
    progress, meter = run.progress, run.meter
    result = TrainResult(
        model=plan.entry.name,
        attention=plan.model_config.attention,
        parameters=run.raw_model.num_parameters(),
        status=status,
        steps=progress.step,
        tokens=progress.tokens,
        final_val_loss=final_val,
        tokens_per_s=meter.tokens_per_s,
        peak_memory_bytes=memory,
        peak_memory_kind=memory_kind,
        train_seconds=progress.train_seconds,
        wall_seconds=progress.wall_seconds,
        load_average=sum(meter.load_samples) / len(meter.load_samples) if meter.load_samples else None,
        device=str(env.device.type),
        world_size=env.world_size,
        checkpoint=str(saved) if saved is not None else None,
        message=message,
        stopped_by=run.stopped_by,
        grad_norm_spikes=run.spikes.count,
        init_from=run.config.run.init_from,
        resumed_from=plan.resume.step if plan.resume is not None else None,
        final_heldout_loss=final_heldout,
        **_cost(plan, progress.tokens),
    )
    if env.is_main:
        write_text_atomically(run.out_dir / SUMMARY_FILE, json.dumps(asdict(result), indent=2) + "\n")
    return result


def _lock_run(plan: TrainingPlan, env: Environment) -> list[OutputLock]:
    """Rank 0 creates, marks and locks run.out_dir, locks run.checkpoint_dir through a lock file
    beside it when it lies elsewhere, and checks both again under the locks (another process may
    have written there since :func:`check_training`); a refusal is raised on every process alike
    (only rank 0 looks: the others would see its marker half-written)."""
    out_dir, checkpoint_dir = plan.out_dir, plan.checkpoint_dir
    locks: list[OutputLock] = []
    error: Exception | None = None
    if env.is_main:
        try:
            locks.append(lock_output_dir(claim_output_dir(out_dir, "train-run", reading=plan.reading,
                                                          hint="choose another run.out_dir / run.checkpoint_dir")))
            if not checkpoint_dir.resolve().is_relative_to(out_dir.resolve()):
                checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
                locks.append(lock_file(checkpoint_lock_file(checkpoint_dir),
                                       f"{checkpoint_dir}: in use by another diff-transformer process"))
            found = find_checkpoint(checkpoint_dir)
            expected = plan.resume.checkpoint if plan.resume is not None else None
            if found != expected:
                raise TrainingError(f"{checkpoint_dir}: its checkpoint changed while this run started (another "
                                    f"process wrote there); run the command again")
        except (OutputPathError, OSError, TrainingError) as exc:
            for lock in locks:
                lock.release()
            error = exc
    message = broadcast_from_main(None if error is None else str(error), env)
    if error is not None:
        raise error
    if message is not None:
        raise TrainingError(message)
    return locks


def checkpoint_lock_file(checkpoint_dir: Path) -> Path:
    """The lock file beside a run.checkpoint_dir that lies outside run.out_dir."""
    return checkpoint_dir.with_name(f".{checkpoint_dir.name}.lock")


@dataclass
class _Run:
    """What one training run holds while it runs: data, model, optimizer, progress and logs."""

    config: TrainConfig
    entry: ModelEntry
    env: Environment
    out_dir: Path
    checkpoint_dir: Path
    plan: DataPlan
    model: nn.Module  # what the step calls backward through (DDP / FSDP wrapped)
    raw_model: LanguageModel  # state dicts and checkpoints
    forward_model: nn.Module  # model, or torch.compile(model)
    optim: OptimConfig  # the model's: the optim section with its own fields over it
    optimizer: torch.optim.Optimizer
    schedule: WarmupLinearSchedule
    length: RunLength  # run.steps, or the budget (train/budget.py)
    progress: Progress
    log: MetricsLog
    validation: list
    autocast: Any
    probe_tokens: torch.Tensor  # the diagnostics' forward (diagnostics.py)
    spikes: GradientSpikes
    meter: "_Meter"  # throughput over the run's invocations, and the loss window
    started: float  # time.perf_counter() when this invocation began
    earlier_wall_seconds: float  # the wall time of the run's earlier invocations (up to their last save)
    last_saved: Path | None = None
    stopped_by: str | None = None  # the signal that interrupted the run

    @functools.cached_property
    def parameters(self) -> list[nn.Parameter]:
        """raw_model's parameters, listed once (clipping reads their gradients every step)."""
        return list(self.raw_model.parameters())

    @classmethod
    def prepare(cls, checked: TrainingPlan, env: Environment, held: contextlib.ExitStack,
                started: float | None = None) -> "_Run":
        """Lock the run's directories (their locks go into ``held``), build everything, and load
        the checkpoint when resuming; ``checked`` is what :func:`check_training` found."""
        config, entry, model_config = checked.config, checked.entry, checked.model_config
        run, plan, init_from, point = config.run, checked.data, checked.init_from, checked.resume
        for lock in _lock_run(checked, env):
            held.callback(lock.release)
        if env.is_main:  # a save killed mid-write left its temporary directory: nobody else will remove it
            for leftover in remove_abandoned_temporaries(checked.checkpoint_dir):
                print(f"note: removed {leftover}, left by a checkpoint write that was interrupted", file=sys.stderr)

        build = lambda device: LanguageModel(model_config, device=device, attn_backend=run.attn_backend)  # noqa: E731
        model = parallelize(build, env, run.parallel, run.seed)
        raw_model = unwrap(model)
        if init_from is not None:
            load_weights(init_from, raw_model, env)
            if env.is_main:
                print(f"starting from the weights of {init_from}", file=sys.stderr)
        optim = config.optim_for(entry.name)  # the optim section with the model's own fields (its lr) over it
        optimizer = build_optimizer(raw_model, optim, env.device)
        length = RunLength.of(config)
        schedule = WarmupLinearSchedule(optimizer, optim, length.steps, total_seconds=length.seconds)
        progress = Progress()
        if point is not None:
            progress = load_training_checkpoint(point.checkpoint, raw_model, optimizer, schedule, env)
            if env.is_main:
                print(f"resuming from {point.checkpoint} at step {progress.step}", file=sys.stderr)
                if point.note is not None:
                    print(point.note, file=sys.stderr)
        log = MetricsLog(checked.out_dir, env, run.tensorboard, progress.step if point is not None else None)
        # A resumed run keeps counting the spikes its earlier invocations logged (rank 0 reports them).
        resumed = point is not None and log.enabled
        earlier_spikes = sum(r["kind"] == "grad_spike" for r in read_metrics(log.path)) if resumed else 0
        meter = _Meter(tokens_per_step=plan.batch_size * plan.seq_len, train_seconds=progress.train_seconds,
                       timed_tokens=progress.timed_tokens)
        return cls(
            config=config, entry=entry, env=env, out_dir=checked.out_dir, checkpoint_dir=checked.checkpoint_dir,
            plan=plan, model=model, raw_model=raw_model,
            forward_model=torch.compile(model) if run.compile_training(length.steps) else model,
            optim=optim, optimizer=optimizer, schedule=schedule, length=length, progress=progress, log=log,
            validation=checked.validation, autocast=_autocast(env, run.precision),
            probe_tokens=plan.probe_tokens(PROBE_SEQUENCES).to(env.device),
            spikes=GradientSpikes(earlier=earlier_spikes), meter=meter,
            started=time.perf_counter() if started is None else started, earlier_wall_seconds=progress.wall_seconds,
        )

    def account(self) -> None:
        """Bring the time in ``progress`` up to now: the meter's timed steps, and the wall time."""
        self.progress.train_seconds = self.meter.train_seconds
        self.progress.timed_tokens = self.meter.timed_tokens
        self.progress.wall_seconds = self.earlier_wall_seconds + time.perf_counter() - self.started

    def save(self) -> Path | None:
        """Write the training checkpoint (rank 0 writes; every rank takes part under FSDP)."""
        self.account()
        train_config = {**self.config.to_dict(), "trained_model": self.entry.name}
        # The precision autocast ran in ("auto" resolved on this device), which a resumed run must keep.
        train_config["run"]["precision"] = self.config.run.resolved_precision(self.env.device.type)
        try:
            self.last_saved = save_training_checkpoint(
                self.checkpoint_dir, self.raw_model, self.optimizer, self.schedule, self.progress,
                tokenizer=self.plan.tokenizer, train_config=train_config, env=self.env,
                dataset=self.plan.record if self.env.is_main else None,
            )
            return self.last_saved
        except (OSError, OutputPathError) as exc:  # a full disk, a lost mount, files of the user's put into
            # the checkpoint directory since the run started: the atomic write left the old version
            previous = find_checkpoint(self.checkpoint_dir)
            kept = (f"the previous checkpoint {previous} (step {saved_step(previous)}) is intact" if previous
                    else "there is no earlier checkpoint")
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CheckpointWriteError(
                f"step {self.progress.step}: could not write the checkpoint to {self.checkpoint_dir} "
                f"({reason}); {kept}"
            ) from exc

    @property
    def eval_model(self) -> nn.Module:
        """What evaluation calls: forward_model, but for run.compile=auto (its training step only: evaluating
        a few times a run, eager, costs less than compiling the evaluation's graphs)."""
        return self.model if self.config.run.compile == "auto" else self.forward_model

    def evaluate(self) -> float:
        return evaluate(self.eval_model, self.validation, self.env, self.autocast, self.plan.separator)

    def diagnose(self, *, maps: bool) -> dict[str, list[float]]:
        """λ and the attention-branch RMS per layer, and with ``maps`` the negative map share (diagnostics.py);
        every process runs it (FSDP gathers the shards in its forward), rank 0 logs it."""
        return probe(self.raw_model, self.probe_tokens, maps=maps, autocast=self.autocast)

    def gradients(self, stop_requested: bool) -> tuple[float, float, int]:
        """Forward and backward over this step's global batch, then clip:
        (mean loss per target token, gradient norm before clipping, processes asking to stop)."""
        batches = list(self.plan.micro_batches(self.progress.step))
        local_loss_sum, global_count = forward_backward(
            self.model, self.forward_model, batches, self.env, self.config.run.parallel, self.autocast,
            self.plan.separator,
        )
        grad_norm = clip_gradients(self.parameters, self.optim.grad_clip)
        step_loss_sum, stop_votes = all_reduce_sum([local_loss_sum, float(stop_requested)], self.env)
        return step_loss_sum / max(global_count, 1), float(grad_norm), stop_votes

    def update(self) -> None:
        """The optimizer and schedule step, and the counters of the step just taken."""
        advance(self.optimizer, self.schedule)
        self.progress.step += 1
        self.progress.samples += self.plan.batch_size
        self.progress.tokens += self.plan.batch_size * self.plan.seq_len


@dataclass
class _Meter:
    """Training throughput (the first step of an invocation warms up and is not timed; a resumed
    run starts from the earlier invocations' totals) and the loss window between two log lines."""

    tokens_per_step: int
    train_seconds: float = 0.0
    timed_tokens: int = 0
    window_loss: float = 0.0
    window_steps: int = 0
    window_start: float = 0.0
    load_samples: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.train_seconds if self.train_seconds else 0.0

    def add(self, seconds: float, loss: float, timed: bool) -> None:
        if timed:
            self.train_seconds += seconds
            self.timed_tokens += self.tokens_per_step
        self.window_loss += loss
        self.window_steps += 1

    def close_window(self) -> dict[str, float]:
        """The window's mean loss and tokens/s; starts the next window."""
        now = time.perf_counter()
        out = {"loss": self.window_loss / self.window_steps,
               "tokens_per_s": self.window_steps * self.tokens_per_step / max(now - self.window_start, 1e-9)}
        self.window_loss, self.window_steps, self.window_start = 0.0, 0, now
        if hasattr(os, "getloadavg"):  # how busy the machine was: throughput figures depend on it
            self.load_samples.append(os.getloadavg()[0])
        return out


def _report_spike(run: _Run, spike: dict[str, float]) -> None:
    """A gradient-norm spike: one metrics.jsonl record and one line on stderr (rank 0)."""
    ratio = spike["grad_norm"] / spike["median"]
    run.log.write(dict(kind="grad_spike", step=spike["step"], tokens=run.progress.tokens, grad_norm=spike["grad_norm"],
                       median=spike["median"], ratio=ratio))
    if run.env.is_main:
        print(f"step {spike['step']}: gradient norm {spike['grad_norm']:.4g} is {ratio:.1f}x the median of the "
              f"previous {spike['window']} steps ({spike['median']:.4g}): a spike ({run.spikes.count} so far)",
              file=sys.stderr)


def _loop(run: _Run) -> tuple[str, str, float | None]:
    """Steps until the end (run.steps, or the budget: train/budget.py), a signal, a pause or
    divergence; saves at the end (not when diverged). Returns (status, message, final validation loss)."""
    settings, progress, env, meter, length = run.config.run, run.progress, run.env, run.meter, run.length
    meter.window_start = time.perf_counter()
    bar = None
    if env.is_main and settings.progress:
        from ..progress import progress as progress_bar

        bar = progress_bar(total=length.steps, initial=progress.step, desc=run.entry.name, unit="step",
                           dynamic_ncols=True, mininterval=1.0)
    status, message, final_val = "completed", "", None
    first_step = progress.step
    run.model.train()
    with _StopSignal() as stop:
        while not length.spent(progress.step, meter.train_seconds):
            step_start = step_clock()
            step_loss, grad_norm, stop_votes = run.gradients(stop.received is not None)
            if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
                last_good = find_checkpoint(run.checkpoint_dir)
                status = "diverged"
                message = (
                    f"step {progress.step + 1}: loss {step_loss} / gradient norm {grad_norm} is not finite; "
                    f"stopped without saving, the last good checkpoint is kept"
                    + (f" ({last_good})" if last_good else "")
                )
                break
            lr = run.schedule.current_lr
            run.update()
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            # the first step of an invocation warms up and is not timed (unless it is the only one)
            timed = progress.step > first_step + 1 or length.steps == first_step + 1
            step_seconds = step_clock() - step_start
            if length.seconds is not None:  # every process follows rank 0's clock: one schedule, one last step
                step_seconds = broadcast_from_main(step_seconds, env)
            meter.add(step_seconds, step_loss, timed)
            if length.seconds is not None:
                run.schedule.spend(meter.train_seconds)
            last = length.spent(progress.step, meter.train_seconds)
            spike = run.spikes.observe(progress.step, grad_norm)
            if spike is not None:
                _report_spike(run, spike)
            log_now = progress.step % settings.log_every == 0 or last
            eval_now = progress.step % settings.eval_every == 0 or last
            seconds = round(meter.train_seconds, 6)  # the training time the record's tokens took
            if log_now:
                window = meter.close_window()
                run.log.write(dict(kind="train", step=progress.step, tokens=progress.tokens, loss=window["loss"],
                                   lr=lr, grad_norm=grad_norm, tokens_per_s=window["tokens_per_s"],
                                   train_seconds=seconds))
            if eval_now:
                final_val = run.evaluate()
                run.log.write(dict(kind="val", step=progress.step, tokens=progress.tokens, loss=final_val,
                                   train_seconds=seconds))
            if settings.diagnostics and (log_now or eval_now):
                run.log.write(dict(kind="diagnostics", step=progress.step, tokens=progress.tokens,
                                   **run.diagnose(maps=eval_now), grad_norm=grad_norm,
                                   grad_norm_median=run.spikes.median, grad_norm_spikes=run.spikes.count))
            if bar is not None:
                postfix = {"loss": f"{step_loss:.3f}",
                           "tok/s": f"{meter.tokens_per_s:,.0f}" if meter.train_seconds else "-"}
                if final_val is not None:
                    postfix["val"] = f"{final_val:.3f}"
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
            if stop_votes > 0 and not last:  # (a signal during the last step: completed)
                # Every process stops when one received a signal; each reports its own, if any.
                run.stopped_by = signal.Signals(stop.received).name if stop.received is not None else None
                status = "interrupted"
                message = (f"stopped at step {progress.step} by {run.stopped_by or 'a signal to another process'}, "
                           "checkpoint saved; continue with --resume")
                break
            if progress.step == settings.stop_at_step and not last:
                status = "paused"
                message = f"stopped at step {progress.step} (run.stop_at_step); continue with --resume"
                break
            if settings.checkpoint_every and progress.step % settings.checkpoint_every == 0 and not last:
                run.save()
        if bar is not None:
            bar.close()
        if status != "diverged":
            run.save()
    return status, message, final_val
