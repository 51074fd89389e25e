"""The language-model phase of a study: every run of its axes trained by the trainer, in its own
process (:class:`~.runner.TrainingJob`), with the same config but for the run's coordinates (seed,
learning rate with min_lr keeping its ratio, init recipe, and whatever a study's own axes set: a
model size, a budget, the weights it starts from); each model then read at its best
(:func:`~.study.sweep`) and summarised over its seeds (:class:`ModelSummary`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..evaluation.ngram import NgramReference, ngram_reference
from ..evaluation.stats import MeanStd
from ..paper import PAPER_TABLE6
from ..train.budget import resolve_steps
from ..train.config import TrainConfig
from ..train.trainer import check_inputs
from .config import ExperimentConfig, recipe_fields
from .results import Diagnostics, SeedCurves, TrainingRun, diagnostics_of, seed_curves
from .runner import TrainingJob, run_jobs
from .study import Axes, RunKey, Sweep, extended_sweep

RunConfig = Callable[[RunKey, Path], TrainConfig]  # a run's exact config, given its key and directory


def run_config(train: TrainConfig, key: RunKey, log_dir: Path, *, progress: bool,
               init_from: Path | None = None) -> TrainConfig:
    """The exact config of one run: ``train`` with this seed, these directories, this learning rate
    (min_lr keeping its ratio) and this init recipe's fields for the run's model; ``init_from`` the
    checkpoint whose weights start it. A budget in tokens or FLOPs (run.budget) sets run.steps to
    the model's own count (train/budget.py), which the runner reads to tell a finished run."""
    entry = train.model(key.model)
    optim = train.optim_for(key.model, key.lr)
    entry = dataclasses.replace(entry, optim={**entry.optim, "lr": optim.lr, "min_lr": optim.min_lr},
                                fields=recipe_fields(entry, key.recipe))
    run = dataclasses.replace(train.run, seed=key.seed, out_dir=str(log_dir),
                              checkpoint_dir=str(log_dir / "checkpoint"),
                              progress=progress, init_from=None if init_from is None else str(init_from))
    config = dataclasses.replace(train, models={**train.models, key.model: entry}, run=run)
    model_config = entry.model_config()
    return resolve_steps(config, key.model, model_config, train.data.seq_len or model_config.max_seq_len)


def plan_runs(keys: Sequence[RunKey], out_dir: Path, configure: RunConfig) -> list[tuple[RunKey, TrainConfig]]:
    """Every run of ``keys`` with its exact config (into OUT/<key path>): a config a run cannot have
    (a model field that contradicts its init recipe) is refused here, before anything is read."""
    return [(key, configure(key, out_dir / key.path)) for key in keys]


def check_runs(runs: Sequence[tuple[RunKey, TrainConfig]], *, nproc: int) -> None:
    """What every run reads, checked as the trainer checks it before the study creates anything
    (:func:`~diff_transformer.train.trainer.check_inputs`): first every run's settings (the model, the
    backend on this device), which read nothing, then the dataset of each, which may have to be
    tokenized first (the embedded corpus, once per cache). Runs that differ only in seed, learning
    rate and folders read the same inputs: checked once. The weights a run starts from
    (run.init_from) may not exist yet: not read here."""
    groups: dict[str, tuple[RunKey, TrainConfig]] = {}
    for key, config in runs:
        check_inputs(config, key.model, processes=nproc, data=False)
        alike = dataclasses.replace(config.run, seed=0, out_dir="", checkpoint_dir=None, init_from=None)
        groups.setdefault(repr((config.data, config.model(key.model), config.optim.recipe, alike)), (key, config))
    for key, config in groups.values():
        check_inputs(dataclasses.replace(config, run=dataclasses.replace(config.run, init_from=None)), key.model,
                     processes=nproc)


def train_language_models(keys: Sequence[RunKey], out_dir: Path, configure: RunConfig, *, resume: bool, nproc: int,
                          jobs: int, progress: bool, name: Callable[[str], str] = str, phase: str = "",
                          extend_lrs: int = 0) -> dict[tuple, Sweep[TrainingRun]]:
    """Train every run of ``keys`` into OUT/<key path> with ``configure(key, log_dir)``; each
    (model, size, budget) swept for its best (recipe, lr) by final validation loss, its lr grid
    extended outward up to ``extend_lrs`` steps at an end where the best lies there
    (:func:`~.study.extended_sweep`). ``name(model)`` names a model in the messages, ``phase``
    prefixes the runs' labels."""
    prefix = f"{phase} " if phase else ""

    def describe(job: TrainingJob, run: TrainingRun) -> str:
        loss = run.summary.final_val_loss
        return (f"{prefix}{job.key.describe()}: {run.summary.status}, final validation loss "
                f"{'-' if loss is None else f'{loss:.4f}'}, {run.summary.tokens_per_s:,.0f} tokens/s -> {job.log_dir}")

    def train(batch: Sequence[RunKey]) -> dict[RunKey, TrainingRun]:
        training = [TrainingJob(key, f"[{prefix}{i}/{len(batch)}] {key.describe()}", out_dir / key.path, key.model,
                                configure(key, out_dir / key.path)) for i, key in enumerate(batch, 1)]
        return run_jobs(training, resume=resume, at_once=jobs, nproc=nproc, progress=progress,
                        describe=describe if jobs > 1 else None)

    return extended_sweep(keys, train, lambda run: run.final_val_loss, lower_is_better=True, limit=extend_lrs,
                          what=lambda key: name(key.model), progress=progress)


def axes_for(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int], grid: Sequence[float],
             recipes: Sequence[str | None]) -> Axes:
    """The language-model axes of a comparison: every model, seed and init recipe at every lr of
    ``grid`` (empty: each model's own lr under that recipe)."""
    recipes = tuple(recipes) or (None,)
    lrs = {(m, r): tuple(grid) or (config.lr_for(m, r, "lm"),) for m in names for r in recipes}
    return Axes(models=tuple(names), seeds=tuple(seeds), recipes=recipes, lrs=lrs)


@dataclass
class ModelSummary:
    """One language model at its best (recipe, lr), over its seeds."""

    name: str
    label: str
    attention: str
    recipe: str | None
    lr: float
    parameters: int
    tokens: int  # per run (every seed trains on the same)
    seeds: list[int]
    status: list[str]
    messages: list[str]
    final_val_loss: MeanStd
    tokens_per_s: MeanStd
    peak_memory_bytes: int
    peak_memory_kind: str
    train_seconds: list[float]
    load_average: list[float | None]
    paper_table6: dict[str, Any] | None  # the paper's Table 6 row this model corresponds to (its paper_row)
    train_curve: SeedCurves
    val_curve: SeedCurves
    diagnostics: Diagnostics | None
    steps: int | None = None  # optimizer steps per run (a budget in seconds: the first seed's)
    flops_per_token: float | None = None  # training FLOPs per token (diff_transformer.flops); None: no term
    flops: float | None = None  # training FLOPs per run (mean over seeds)

    @classmethod
    def of(cls, config: ExperimentConfig, sweep: Sweep[TrainingRun]) -> "ModelSummary":
        runs = sweep.chosen
        entry = config.train.model(sweep.model)
        summaries = [run.summary for run in runs]
        finished = [s.final_val_loss for s in summaries if s.status == "completed" and s.final_val_loss is not None]
        return cls(
            name=sweep.model, label=entry.display_name, attention=entry.attention, recipe=sweep.best_recipe,
            lr=sweep.lr, parameters=summaries[0].parameters, tokens=summaries[0].tokens,
            seeds=[run.key.seed for run in runs], status=[s.status for s in summaries],
            messages=[s.message for s in summaries if s.message], final_val_loss=MeanStd.of(finished),
            tokens_per_s=MeanStd.of(s.tokens_per_s for s in summaries),
            peak_memory_bytes=max(s.peak_memory_bytes for s in summaries),
            peak_memory_kind=summaries[0].peak_memory_kind,
            train_seconds=[s.train_seconds for s in summaries], load_average=[s.load_average for s in summaries],
            paper_table6=dict(PAPER_TABLE6[entry.paper_row], key=entry.paper_row) if entry.paper_row else None,
            train_curve=seed_curves([run.log.train for run in runs]),
            val_curve=seed_curves([run.log.val for run in runs]), diagnostics=diagnostics_of(runs),
            steps=summaries[0].steps, flops_per_token=summaries[0].flops_per_token,
            flops=None if summaries[0].flops is None else statistics.fmean(s.flops for s in summaries),
        )


@dataclass
class Budget:
    """The language models' budget: steps × batch × sequence length, the data order; or, with
    run.budget, an amount of tokens, training FLOPs or seconds that each model spends in its own
    number of steps (``steps`` is then run.steps of the config, not what the models trained)."""

    steps: int
    batch_size: int
    seq_len: int
    data_seed: int
    data_mix: dict[str, float]
    kind: str = "steps"  # what the length counts: "steps" (run.steps), or run.budget's tokens, flops, seconds
    amount: float | None = None  # run.budget's amount

    @property
    def tokens_per_model(self) -> int:
        """The tokens of a run of ``steps`` steps (with run.budget: what run.steps would have given)."""
        return self.steps * self.batch_size * self.seq_len

    @classmethod
    def of(cls, train: TrainConfig, model: str) -> "Budget":
        seq_len = train.data.seq_len or train.model(model).model_config().max_seq_len
        budget = train.run.budget
        return cls(train.run.steps, train.data.batch_size, seq_len, train.run.data_seed, dict(train.data.mix),
                   "steps" if budget is None else budget.kind, None if budget is None else budget.amount)


@dataclass
class Machine:
    """Where the runs trained: the device, processes per run, runs at a time, torch, the CPU."""

    device: str
    processes: int
    jobs: int
    torch: str
    cpu_threads: int
    cpu_count: int | None
    machine: str

    @classmethod
    def of(cls, device: str, nproc: int, jobs: int) -> "Machine":
        return cls(device, nproc, jobs, torch.__version__, torch.get_num_threads(), os.cpu_count(), platform.machine())


def busy_load_average(models: Sequence[ModelSummary], cpu_count: int | None) -> float | None:
    """The highest mean load average of any run if it shows other work competing for the CPU
    (more than one runnable task beyond the cores), else None. A run's own threads count up to
    the number of cores, so only the excess means that the throughput figures are not its own."""
    loads = [x for m in models for x in m.load_average if x is not None]
    if not loads or not cpu_count:
        return None
    return max(loads) if max(loads) > cpu_count + 1 else None


@dataclass
class LanguageModelling:
    """The language-model phase of a comparison: the budget, every model at its best and its sweep."""

    budget: Budget
    models: dict[str, ModelSummary]
    sweeps: dict[str, Sweep[TrainingRun]]
    recipes: list[str]  # the init recipes searched (none: every model as configured)
    reference: NgramReference | None = None  # the data's unigram and bigram loss (None: not measured)

    def learned(self, losses: Sequence[float]) -> bool:
        """Whether a model with these losses (one per seed) has passed its data's bigram table by the
        margin (evaluation.ngram.LEARNED_MARGIN): their mean below it. Without a reference, True."""
        if self.reference is None:
            return True
        return bool(losses) and self.reference.learned(statistics.fmean(losses))

    @classmethod
    def of(cls, config: ExperimentConfig, sweeps: dict[tuple, Sweep[TrainingRun]], names: Sequence[str],
           recipes: Sequence[str | None], train: TrainConfig | None = None) -> "LanguageModelling":
        """The summary of ``sweeps`` at the config's own size and budget (``train``: the config the runs
        were trained with, default the experiment's)."""
        by_name = {name: sweeps[name, None, None] for name in names}
        train = train or config.train
        return cls(Budget.of(train, names[0]),
                   {name: ModelSummary.of(config, s) for name, s in by_name.items()}, by_name,
                   [r for r in recipes if r is not None], ngram_reference(train.data.dataset, train.data.cache_dir))
