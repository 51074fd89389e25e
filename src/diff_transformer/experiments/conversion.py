"""The conversion study: ``diff-transformer compare --config convert``.

What does it cost to turn a pretrained Transformer into a DIFF model (:mod:`diff_transformer.convert`)
rather than to keep training the Transformer, and what does it gain? On the engine's runner and sweep:

1. **The source**: the Transformer ``convert.source_model`` trained from scratch for run.steps, one
   per seed, or the checkpoint ``convert.source`` (this project's, or a transformers
   LlamaForCausalLM directory, imported once) for every seed. One source per seed makes each seed a
   whole replicate (pretraining, conversion, fine-tuning): the intervals then cover the draw of the
   source as well as the conversion's new parameters. With one source, the continued Transformer
   would be the same run at every seed (no dropout, the same data order), its spread zero.
2. **The conversions** (:func:`~diff_transformer.convert.convert_checkpoint`): DIFF ``exact`` and
   ``split`` (``convert.inits``) and DIFF V2 exact (``convert.diff_v2``) of each seed's source, the
   seed drawing the new parameters; each scored before any training on the fine-tuning's validation
   windows (:func:`~diff_transformer.convert.compare_start`): the curve's point at 0 tokens.
3. **Fine-tuning**: the Transformer continued (``run.init_from`` its own checkpoint) and every
   conversion (``run.init_from`` the converted checkpoint, the model entry set by
   :func:`~diff_transformer.convert.finetune_fields`), ``convert.steps`` steps each on the same data
   (``convert.data_seed``), a fresh warmup and decay, each at its own best lr of ``convert.lr_grid``
   (the lowest mean final validation loss; an empty grid: each at its ``convert.lr_by_model`` lr, a
   pilot's best, else the source's). For reference, ``convert.scratch_model`` (the matched
   DIFF) trained from scratch on as many tokens as the source and the fine-tuning together (its
   first run.steps read exactly the source's batches, the rest the corpus further in the same
   order), at its best of ``convert.scratch_lr_grid``.
4. **Retrieval before and after**: the suite's ``convert.retrieval`` (AR-Hit: the loss on tokens that
   complete a bigram seen earlier in the window) on every source, every converted checkpoint and every
   fine-tuned seed.
5. **The report**: per model, the tokens it needs to recover the source's loss (per seed, linear
   between evaluations; mean and Student's 95% interval), its final loss against the continued
   Transformer's (Welch's 95% interval over seeds: below, above or level), the from-scratch reference,
   retrieval before and after, the lr sweep; ``conversion_loss.png``.

The output directory:

    OUT/report.md, OUT/metrics.json, OUT/conversion_loss.png, OUT/config.yaml
    OUT/source/runs/<model>/lr-<lr>/seed-<s>/   each seed's source (OUT/source/imported/: a Llama, read once)
    OUT/converted/<arm>/seed-<s>/               the converted checkpoints; seed-<s>.json their step-0 figures
    OUT/finetune/runs/<arm>/lr-<lr>/seed-<s>/   the fine-tuning runs (arm: continued, exact, split, diff_v2)
    OUT/scratch/runs/<model>/lr-<lr>/seed-<s>/  the from-scratch reference
    OUT/retrieval/                              the retrieval evaluation's JSON and plot
    OUT/eval/                                   compare.evaluations on the fine-tuned models, if any
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint_tokenizer
from ..convert import (
    check_convertible, compare_start, convert_checkpoint, converted_config, finetune_fields, source_config,
)
from ..data import EMBEDDED_DATASETS, TokenShards, dataset_directory
from ..evaluation.ngram import NgramReference, ngram_reference
from ..evaluation.stats import Difference, MeanStd, mean_interval, welch_difference
from ..evaluation.suite import EVALUATIONS, run_suite
from ..files import check_output_dir
from ..interop.hf import import_hf, load_hf, load_hf_tokenizer
from ..model import LanguageModel
from ..tokenizer import as_tokenizer, same_tokenizer
from ..train.config import ConfigError, TrainConfig
from ..train.state import INIT_CHANGEABLE
from .comparison import Evaluation, study_record
from .config import CONTINUED, ExperimentConfig
from .language_models import Machine, check_runs, plan_runs, run_config, train_language_models
from .output import check_study_output, open_study
from .report import interval_text, label_axes, pyplot, save_plot, signed, stats_cell, tokens_text, write_study
from .results import TrainingRun, diagnostics_of, seed_curves
from .runner import PoolJob, run_jobs
from .study import Axes, RunKey, Sweep

# Two losses of one set of windows closer than this (nats) are the same: fp32 rounding of the same
# function (an exact conversion's logits are its source's to ~1e-6).
SAME_LOSS = 1e-5
CONVERTED_NAMES = {"diff": "DIFF", "diff_v2": "DIFF V2"}  # convert --to, in words
# What each retrieval evaluation reports per model (a key of its JSON), in words, and which way is better.
RETRIEVAL_FIGURES = {"ar-hit": ("ar_hit", "loss on AR-hit tokens (nats)", "lower"),
                     "mqar": ("accuracy", "MQAR accuracy", "higher")}


# --- the plan: the study's models and the trainer's configs of its phases ---------------------------


@dataclass(frozen=True)
class Arm:
    """One fine-tuned model: the Transformer continued (``to`` None) or a conversion of it."""

    name: str  # its model entry in the fine-tuning config and its folder: continued, exact, split, diff_v2
    label: str
    to: str | None = None  # convert --to
    init: str | None = None  # convert --init


@dataclass
class ConversionPlan:
    """The trainer's configs of the study's phases: the sources (one model), the fine-tuning (every
    arm, its model entry describing its converted checkpoint) and the from-scratch reference."""

    arms: list[Arm]
    source: TrainConfig
    finetune: TrainConfig
    scratch: TrainConfig | None
    source_steps: int  # the source's training steps (a given source: its tokens in steps of this data)

    @property
    def tokens_per_step(self) -> int:
        return self.finetune.data.batch_size * sequence_length(self.finetune, CONTINUED)

    @property
    def source_tokens(self) -> int:
        return self.source_steps * self.tokens_per_step

    @property
    def finetune_tokens(self) -> int:
        return self.finetune.run.steps * self.tokens_per_step


def sequence_length(train: TrainConfig, model: str) -> int:
    return train.data.seq_len or train.model(model).model_config().max_seq_len


def study_arms(config: ExperimentConfig) -> list[Arm]:
    """The continued Transformer, then each conversion the convert section asks for."""
    settings = config.convert
    source_label = config.model_name(settings.source_model)
    arms = [Arm(CONTINUED, f"{source_label}, continued")]
    conversions = [("diff", init) for init in settings.inits] + ([("diff_v2", "exact")] if settings.diff_v2 else [])
    arms += [Arm(init if to == "diff" else to, f"{CONVERTED_NAMES[to]}, converted {init}", to, init)
             for to, init in conversions]
    return arms


def conversion_plan(config: ExperimentConfig) -> ConversionPlan:
    """The study's arms and the trainer's config of each phase (see the module docstring)."""
    settings, train = config.convert, config.train
    source = train.model(settings.source_model)
    source_model = source.model_config()
    arms = study_arms(config)
    entries = {}
    own_optim = {k: v for k, v in source.optim.items() if k != "warmup_steps"}  # the fine-tuning's warmup rules
    for arm in arms:
        if arm.to is None:
            entries[arm.name] = dataclasses.replace(source, name=arm.name, label=arm.label, paper_row=None,
                                                    optim=own_optim)
            continue
        fields = finetune_fields(converted_config(source_model, arm.to, arm.init))  # what the checkpoint holds
        attention = fields.pop("attention")
        entries[arm.name] = dataclasses.replace(source, name=arm.name, attention=attention, label=arm.label,
                                                paper_row=None, diff_heads=False, optim=own_optim,
                                                fields={**source.fields, **fields})
    finetune = dataclasses.replace(
        train, models=entries, optim=dataclasses.replace(train.optim, warmup_steps=settings.warmup_steps),
        run=dataclasses.replace(train.run, steps=settings.steps, eval_every=settings.eval_every,
                                log_every=min(train.run.log_every, settings.eval_every), data_seed=settings.data_seed,
                                stop_at_step=None, init_from=None))
    tokens_per_step = train.data.batch_size * sequence_length(train, settings.source_model)
    source_steps = (train.run.steps if settings.source is None
                    else math.ceil(settings.source_tokens / tokens_per_step) if settings.source_tokens else 0)
    scratch = None
    if settings.scratch_model is not None:
        entry = train.model(settings.scratch_model)
        scratch = dataclasses.replace(train, models={entry.name: entry}, run=dataclasses.replace(
            train.run, steps=source_steps + settings.steps, stop_at_step=None, init_from=None))
    sources = dataclasses.replace(train, models={source.name: source})
    return ConversionPlan(arms, sources, finetune, scratch, source_steps)


def own_lr_axes(train: TrainConfig, names: Sequence[str], seeds: Sequence[int], grid: Sequence[float],
                by_model: Mapping[str, float] | None = None) -> Axes:
    """Every model and seed at every lr of ``grid``; empty: each model at its ``by_model`` lr, else its own."""
    by_model = by_model or {}
    return Axes(models=tuple(names), seeds=tuple(seeds),
                lrs={(name, None): tuple(grid) or (by_model.get(name, train.optim_for(name).lr),) for name in names})


def fine_tuning_axes(config: ExperimentConfig, plan: ConversionPlan, seeds: Sequence[int]) -> Axes:
    """Every arm and seed at every lr of convert.lr_grid; an empty grid: each arm at its
    convert.lr_by_model lr, else the source's."""
    settings = config.convert
    return own_lr_axes(plan.finetune, [arm.name for arm in plan.arms], seeds, settings.lr_grid, settings.lr_by_model)


# --- the source and its conversions -----------------------------------------------------------------


def check_given_source(config: ExperimentConfig) -> None:
    """A ConfigError unless convert.source is a Transformer checkpoint (or Llama directory) of the model
    that models.<source_model> describes (but for the context and RoPE θ, which a run started from it
    may change), read from its config.json alone, and the study knows its tokenizer (its own, or
    convert.source_tokenizer: the two agree where both are given)."""
    settings = config.convert
    try:
        found, _ = source_config(settings.source)
        check_convertible(found, "diff", "exact", settings.source)
    except (ValueError, CheckpointError) as exc:
        raise ConfigError(f"convert.source: {exc}") from None
    ours = config.train.model(settings.source_model).model_config().to_dict()
    differing = [f"{key}: {value!r} in the source, {ours[key]!r} in models.{settings.source_model}"
                 for key, value in found.to_dict().items() if key not in INIT_CHANGEABLE and value != ours[key]]
    if differing:
        raise ConfigError(f"convert.source: {settings.source} holds another model than models.{settings.source_model} "
                          f"describes ({'; '.join(differing)}); set the model's fields to the source's")
    given_source_tokenizer(config)


def given_source_tokenizer(config: ExperimentConfig):
    """The tokenizer the given convert.source reads: its own, else convert.source_tokenizer; a ConfigError
    if it has none and none is named (advice: that field), or if the two differ."""
    settings = config.convert
    named = None
    if settings.source_tokenizer is not None:
        try:
            named = as_tokenizer(settings.source_tokenizer, "convert.source_tokenizer")
        except (ValueError, OSError) as exc:
            raise ConfigError(f"convert.source_tokenizer: {exc}") from None
    try:
        own = source_tokenizer(settings.source)
    except (ValueError, OSError) as exc:
        if named is not None:  # the source's file is unreadable here; the named one stands for it
            return named
        raise ConfigError(f"convert.source: {exc}; set convert.source_tokenizer to the tokenizer the source was "
                          "trained with (a tokenizers JSON file, 'default' or 'bytes')") from None
    if own is None and named is None:
        raise ConfigError(f"convert.source: {settings.source} holds no tokenizer, and the study must read the source "
                          "with the one it was trained with (data.dataset must be prepared with it too): set "
                          "convert.source_tokenizer to it (a tokenizers JSON file, 'default' or 'bytes'), e.g. "
                          "--set convert.source_tokenizer=path/to/tokenizer.json")
    if own is not None and named is not None and not same_tokenizer(own, named):
        raise ConfigError(f"convert.source_tokenizer: {settings.source_tokenizer} is not the tokenizer "
                          f"{settings.source} holds; leave it unset (null) to use the source's own")
    return own if own is not None else named


def source_tokenizer(path: str | Path):
    """The tokenizer a source directory holds (a checkpoint's, or a Llama directory's tokenizer.json), or None."""
    if source_config(path)[1] == "checkpoint":
        return load_checkpoint_tokenizer(path)
    return load_hf_tokenizer(Path(path))


def check_source_data(config: ExperimentConfig) -> None:
    """A ConfigError unless the given source reads data.dataset's tokens (once the dataset is ready)."""
    data = config.train.data
    tokenizer = TokenShards(dataset_directory(data.dataset, data.cache_dir, progress=False), "val").tokenizer
    if not same_tokenizer(given_source_tokenizer(config), tokenizer):
        raise ConfigError(f"convert.source: {config.convert.source} reads another tokenizer than data.dataset "
                          f"{data.dataset!r} was prepared with; prepare the dataset with the source's tokenizer "
                          "(diff-transformer prepare ... --tokenizer path/to/tokenizer.json)")


def given_source(path: str, imported: Path, *, tokenizer=None, resume: bool, progress: bool) -> Path:
    """The checkpoint of this project every seed starts from: ``path`` itself, or ``imported``: a
    transformers Llama directory imported there (``run.init_from`` reads checkpoints of this project),
    or a source that holds no tokenizer saved there with ``tokenizer`` (convert.source_tokenizer). With
    ``resume`` an earlier import is reused."""
    kind = source_config(path)[1]
    own = tokenizer is None or source_tokenizer(path) is not None
    if kind == "checkpoint" and own:
        return Path(path)
    if resume and (imported / CONFIG_FILE).is_file():
        return imported
    if progress:
        print(f"importing {path} -> {imported}", file=sys.stderr, flush=True)
    if own:
        return Path(import_hf(path, imported, overwrite=True))
    model = load_hf(path, with_tokenizer=False)[0] if kind == "llama" else LanguageModel.from_pretrained(path)
    return Path(model.save_pretrained(imported, tokenizer, overwrite=True, reading=[path]))


def validation_windows(train: TrainConfig, model: str) -> torch.Tensor:
    """The windows the trainer validates a run of ``train`` on: data.eval_sequences windows of
    seq_len + 1 tokens of the validation split, (N, T + 1)."""
    data = train.data
    directory = dataset_directory(data.dataset, data.cache_dir, progress=False)
    shards = TokenShards(directory, "val", within_documents=data.within_documents)
    inputs, targets = shards.val_batches(1, data.eval_sequences, sequence_length(train, model))[0]
    return torch.cat([inputs, targets[:, -1:]], dim=1)


@dataclass
class ConvertedRun:
    """One seed's source converted by one arm: where the checkpoint is and how it starts, on the
    fine-tuning's validation windows before any training."""

    arm: str
    seed: int
    checkpoint: str
    source_parameters: int
    parameters: int
    added: dict[str, int]  # what the construction added (convert's record)
    source_loss: float
    start_loss: float
    max_logit_difference: float

    @property
    def loss_change(self) -> float:
        return self.start_loss - self.source_loss


def convert_one(source: Path, out: Path, arm: str, to: str, init: str, seed: int, windows: torch.Tensor,
                device: str) -> ConvertedRun:
    """Convert checkpoint ``source`` into ``out`` (an earlier conversion there is replaced, said aloud),
    ``seed`` drawing the new parameters, and score both on ``windows`` (N, T + 1) on ``device``."""
    if out.exists():
        check_output_dir(out, "checkpoint", overwrite=True)  # only a checkpoint is replaced
        print(f"{out}: replacing the earlier conversion", file=sys.stderr)
        shutil.rmtree(out)
    result = convert_checkpoint(source, out, to=to, init=init, seed=seed)
    original = LanguageModel.from_pretrained(source, device=device).eval()
    start = compare_start(original, result.conversion.model.to(device), windows.to(device))
    conversion = result.conversion
    return ConvertedRun(arm, seed, str(out), conversion.source_parameters, conversion.parameters,
                        dict(conversion.added), start.source_loss, start.converted_loss, start.max_logit_difference)


def load_converted(data: dict) -> ConvertedRun | None:
    """A conversion's saved figures, if its checkpoint is still there (else it is made again)."""
    run = ConvertedRun(**data)
    return run if (Path(run.checkpoint) / CONFIG_FILE).is_file() else None


def study_device(train: TrainConfig) -> str:
    """Where the study scores models itself (step 0, retrieval): the runs' device."""
    wanted = train.run.device
    return "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"


# --- the measurements -------------------------------------------------------------------------------


def recovery_tokens(tokens: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """The fine-tuning tokens after which the loss stays at or below ``target`` (the source's loss),
    read off the curve ``losses`` at ``tokens`` (the first at 0, before any step) linearly between
    evaluations: where it last comes down through ``target``; 0 when it never rises above it, None
    when it ends above it (not recovered within the budget). A loss within SAME_LOSS of ``target``
    is not above it: an exact conversion starts at its source's loss to float rounding."""
    if losses[-1] > target + SAME_LOSS:
        return None
    above = [i for i, loss in enumerate(losses) if loss > target + SAME_LOSS]
    if not above:
        return 0.0
    i = above[-1]  # the curve is above the target here and at or below it at every later point
    t0, t1, l0, l1 = tokens[i], tokens[i + 1], losses[i], losses[i + 1]
    return t0 + (l0 - target) / (l0 - l1) * (t1 - t0)


@dataclass
class Recovery:
    """The tokens a model needs to recover the source's loss, per seed (None: not within the budget),
    their mean and Student's 95% interval of it (when every seed recovered, two or more)."""

    per_seed: list[float | None]
    budget: int  # the fine-tuning's tokens
    mean: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, per_seed: Sequence[float | None], budget: int) -> "Recovery":
        values = list(per_seed)
        if any(v is None for v in values) or not values:
            return cls(values, budget, None, None, None)
        interval = mean_interval(values)
        return cls(values, budget, statistics.fmean(values), *(interval or (None, None)))

    @property
    def recovered(self) -> int:
        return sum(v is not None for v in self.per_seed)


@dataclass
class Versus:
    """A model's figure against the continued Transformer's: the difference of their means over
    seeds with Welch's 95% interval, and what it says."""

    difference: Difference
    words: str


def versus(ours: Sequence[float], base: Sequence[float], better: str,
           against: str = "the continued Transformer") -> Versus:
    """mean(ours) − mean(base) with Welch's interval; "below" / "above" ``against`` (the base) when
    the interval excludes 0 on that side (better or worse as ``better`` says), else "level"."""
    difference = welch_difference(ours, base)
    if difference.sign is None:
        return Versus(difference, "no interval (one seed)")
    if difference.sign == 0:
        return Versus(difference, f"level with {against} (the interval holds 0)")
    lower = difference.sign < 0
    good = lower == (better == "lower")
    return Versus(difference, f"{'below' if lower else 'above'} {against} ({'better' if good else 'worse'})")


@dataclass
class Curve:
    """Validation loss along training, every seed: ``values[seed][point]`` after ``tokens[point]``
    tokens (of the fine-tuning; for the from-scratch reference, of its whole run)."""

    tokens: list[int]
    values: list[list[float]]

    def mean(self) -> list[float]:
        return [statistics.fmean(point) for point in zip(*self.values)]

    def std(self) -> list[float]:
        return [statistics.stdev(point) if len(point) > 1 else 0.0 for point in zip(*self.values)]


def run_curve(runs: Sequence[TrainingRun], starts: Sequence[float] | None) -> Curve:
    """The runs' validation curve on the evaluations every seed logged, with ``starts`` (per seed, the
    loss before any step) as the point at 0 tokens."""
    curves = seed_curves([run.log.val for run in runs])
    if starts is None:
        return Curve(curves.tokens, curves.values)
    return Curve([0, *curves.tokens], [[start, *values] for start, values in zip(starts, curves.values)])


@dataclass
class ArmResult:
    """One fine-tuned model at its best lr, over its seeds."""

    name: str
    label: str
    conversion: str  # "DIFF exact", ...; "" for the continued Transformer
    attention: str
    lr: float
    grid: dict[float, MeanStd]  # the mean final loss at every lr tried
    parameters: int
    added: dict[str, int]  # the conversion's new parameters (none for the continued Transformer)
    start: MeanStd  # the loss before any fine-tuning step
    max_logit_difference: float | None  # the largest over seeds, against the source (a conversion)
    final: MeanStd
    curve: Curve
    recovery: Recovery
    final_versus: Versus | None  # against the continued Transformer (None: it is the continued Transformer)
    recovery_versus: Versus | None
    tokens_per_s: MeanStd
    lambdas: list[float] | None  # λ per layer at the end, mean over seeds (the DIFF kinds)
    retrieval_before: MeanStd | None  # the source (continued) or the converted checkpoint
    retrieval_after: MeanStd | None
    retrieval_versus: Versus | None  # after, against the continued Transformer after


@dataclass
class ScratchResult:
    """The from-scratch reference at its best lr, over its seeds."""

    name: str
    label: str
    lr: float
    grid: dict[float, MeanStd]
    parameters: int
    tokens: int
    final: MeanStd
    curve: Curve  # over its whole run
    final_versus: Versus
    conversions: dict[str, Versus]  # each conversion's final loss − this reference's, by arm
    tokens_per_s: MeanStd
    retrieval_after: MeanStd | None
    retrieval_versus: Versus | None


@dataclass
class SourceSummary:
    """The Transformer the study converts: trained here (one per seed) or given."""

    label: str
    given: str | None  # the path of a given source; None: trained by the study
    steps: int
    tokens: int
    lr: float | None  # the lr it was trained at (a given source: unknown)
    parameters: int
    loss: MeanStd  # on the fine-tuning's validation windows, per seed: what each model must recover


@dataclass
class RetrievalInfo:
    """The retrieval evaluation run before and after: its name and title, the figure read and which
    way is better, the models it could not run on."""

    evaluation: str
    title: str
    measure: str
    better: str
    options: dict[str, Any]
    errors: dict[str, str]


@dataclass
class ConversionMetrics:
    """Everything the conversion report shows (metrics.json is its JSON)."""

    config: str
    description: str
    budget_note: str
    seeds: list[int]
    source: SourceSummary
    finetune_steps: int
    finetune_tokens: int
    warmup_steps: int
    data_seed: int
    arms: list[ArmResult]
    scratch: ScratchResult | None
    retrieval: RetrievalInfo
    machine: Machine
    wall_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    load_average: tuple[float, float, float] | None = None
    reference: NgramReference | None = None  # the fine-tuning data's unigram and bigram loss


def final_losses(runs: Sequence[TrainingRun]) -> list[float]:
    return [run.summary.final_val_loss for run in runs]


def end_lambdas(runs: Sequence[TrainingRun]) -> list[float] | None:
    """λ per layer at the last diagnostics record, mean over the runs (None without λ)."""
    diagnostics = diagnostics_of(runs)
    if diagnostics is None or diagnostics.lambdas is None:
        return None
    return [statistics.fmean(layer) for layer in zip(*(seed[-1] for seed in diagnostics.lambdas))]


def arm_result(arm: Arm, sweep: Sweep[TrainingRun], starts: Sequence[float], targets: Sequence[float],
               converted: Sequence[ConvertedRun], continued: ArmResult | None, budget: int,
               retrieval: tuple[list[float] | None, list[float] | None], better: str) -> ArmResult:
    """An arm's figures: ``starts`` its loss before fine-tuning, ``targets`` the source's (per seed, the
    seeds of ``sweep.chosen``); ``continued`` the continued Transformer's result to set it against
    (None for that arm itself); ``retrieval`` its figure per seed before and after."""
    runs = sweep.chosen
    curve = run_curve(runs, starts)
    recovery = Recovery.of([recovery_tokens(curve.tokens, values, target)
                            for values, target in zip(curve.values, targets)], budget)
    finals = final_losses(runs)
    before, after = retrieval
    final_vs = recovery_vs = retrieval_vs = None
    if continued is not None:
        final_vs = versus(finals, continued.final.per_seed, "lower")
        if recovery.mean is not None and continued.recovery.mean is not None:
            recovery_vs = versus(recovery.per_seed, continued.recovery.per_seed, "lower")
        if after is not None and continued.retrieval_after is not None:
            retrieval_vs = versus(after, continued.retrieval_after.per_seed, better)
    return ArmResult(
        name=arm.name, label=arm.label, conversion=f"{CONVERTED_NAMES[arm.to]} {arm.init}" if arm.to else "",
        attention=runs[0].summary.attention, lr=sweep.lr,
        grid=dict(sweep.scores[None]), parameters=runs[0].summary.parameters,
        added=dict(converted[0].added) if converted else {},
        start=MeanStd.of(starts), max_logit_difference=max((r.max_logit_difference for r in converted), default=None),
        final=MeanStd.of(finals), curve=curve, recovery=recovery, final_versus=final_vs, recovery_versus=recovery_vs,
        tokens_per_s=MeanStd.of(run.summary.tokens_per_s for run in runs), lambdas=end_lambdas(runs),
        retrieval_before=None if before is None else MeanStd.of(before),
        retrieval_after=None if after is None else MeanStd.of(after), retrieval_versus=retrieval_vs,
    )


def scratch_result(config: ExperimentConfig, sweep: Sweep[TrainingRun], arms: Sequence[ArmResult],
                   after: list[float] | None, better: str) -> ScratchResult:
    """The from-scratch reference against the continued Transformer (``arms[0]``; final loss and
    retrieval ``after``), and each conversion's final loss against it."""
    runs = sweep.chosen
    finals = final_losses(runs)
    continued = arms[0]
    label = f"{config.model_name(sweep.model)}, from scratch"
    retrieval_vs = None
    if after is not None and continued.retrieval_after is not None:
        retrieval_vs = versus(after, continued.retrieval_after.per_seed, better)
    return ScratchResult(
        name=sweep.model, label=label, lr=sweep.lr,
        grid=dict(sweep.scores[None]), parameters=runs[0].summary.parameters, tokens=runs[0].summary.tokens,
        final=MeanStd.of(finals), curve=run_curve(runs, None),
        final_versus=versus(finals, continued.final.per_seed, "lower"),
        conversions={arm.name: versus(arm.final.per_seed, finals, "lower", against=label) for arm in arms[1:]},
        tokens_per_s=MeanStd.of(run.summary.tokens_per_s for run in runs),
        retrieval_after=None if after is None else MeanStd.of(after), retrieval_versus=retrieval_vs)


def retrieval_checkpoints(sources: dict[int, Path], converted: dict[RunKey, ConvertedRun],
                          sweeps: dict[str, Sweep[TrainingRun]], scratch: Sweep[TrainingRun] | None
                          ) -> dict[str, Path]:
    """Every checkpoint the retrieval evaluation reads, by label: "source s<seed>", "<arm> s<seed>
    before" (a conversion) and "after" (fine-tuned at its best lr), "scratch s<seed>"."""
    labels = {f"source s{seed}": path for seed, path in sources.items()}
    labels.update({f"{key.model} s{key.seed} before": Path(run.checkpoint) for key, run in converted.items()})
    for name, sweep in sweeps.items():
        labels.update({f"{name} s{run.key.seed} after": run.checkpoint_dir for run in sweep.chosen})
    if scratch is not None:
        labels.update({f"scratch s{run.key.seed}": run.checkpoint_dir for run in scratch.chosen})
    return labels


def measure_retrieval(config: ExperimentConfig, checkpoints: dict[str, Path], out_dir: Path, device: str,
                      progress: bool) -> tuple[dict[str, float], RetrievalInfo]:
    """The retrieval evaluation (convert.retrieval) on every checkpoint, each directory read once (a
    given source is every seed's): its figure by label (none where it could not run) and what it is."""
    settings = config.convert
    key, measure, better = RETRIEVAL_FIGURES[settings.retrieval]
    first: dict[Path, str] = {}  # a directory -> the label it is evaluated under
    for label, path in checkpoints.items():
        first.setdefault(Path(path).resolve(), label)
    suite = run_suite({label: path for path, label in first.items()}, out_dir, evaluations=[settings.retrieval],
                      options={settings.retrieval: settings.retrieval_options}, device=device, progress=progress,
                      overwrite=True)  # OUT/retrieval is the study's own: a rerun replaces its result
    data = suite.data[settings.retrieval]
    figures = {}
    for label, path in checkpoints.items():
        result = data["models"].get(first[Path(path).resolve()])
        if result is not None and result.get(key) is not None:
            figures[label] = result[key]
    return figures, RetrievalInfo(settings.retrieval, EVALUATIONS[settings.retrieval].title, measure, better,
                                  data["options"], data["errors"])


def per_seed(figures: dict[str, float], labels: Sequence[str]) -> list[float] | None:
    """The figures of ``labels`` (one per seed), or None if any is missing."""
    values = [figures.get(label) for label in labels]
    return None if any(v is None for v in values) else values


def analyse(config: ExperimentConfig, plan: ConversionPlan, seeds: Sequence[int], converted: dict[RunKey, ConvertedRun],
            sweeps: dict[str, Sweep[TrainingRun]], scratch: Sweep[TrainingRun] | None, source_lr: float | None,
            retrieval: dict[str, float], info: RetrievalInfo, machine: Machine) -> ConversionMetrics:
    """The study's figures from its runs (see the module docstring)."""
    settings = config.convert
    seeds = list(seeds)
    by_seed = {seed: next(run for key, run in converted.items() if key.seed == seed) for seed in seeds}
    targets = [by_seed[seed].source_loss for seed in seeds]  # the source's loss, what every model must recover
    source = SourceSummary(config.model_name(settings.source_model), settings.source, plan.source_steps,
                           plan.source_tokens, source_lr, by_seed[seeds[0]].source_parameters, MeanStd.of(targets))
    better = info.better
    continued = None
    arms = []
    for arm in plan.arms:  # the continued Transformer first: the others are set against it
        sweep = sweeps[arm.name]
        order = [run.key.seed for run in sweep.chosen]
        if order != seeds:
            raise RuntimeError(f"{arm.name}: runs of seeds {order}, expected {seeds}")
        mine = [converted[RunKey(arm.name, seed, 0.0)] for seed in seeds] if arm.to else []
        starts = [run.start_loss for run in mine] if mine else targets
        before = per_seed(retrieval, [f"{arm.name} s{seed} before" for seed in seeds] if mine
                          else [f"source s{seed}" for seed in seeds])
        after = per_seed(retrieval, [f"{arm.name} s{seed} after" for seed in seeds])
        result = arm_result(arm, sweep, starts, targets, mine, continued, plan.finetune_tokens, (before, after), better)
        continued = continued or result
        arms.append(result)
    reference = None
    if scratch is not None:
        reference = scratch_result(config, scratch, arms, per_seed(retrieval, [f"scratch s{s}" for s in seeds]),
                                   better)
    return ConversionMetrics(config.name, config.train.description, config.compare.budget_note, seeds, source,
                             settings.steps, plan.finetune_tokens, settings.warmup_steps, settings.data_seed, arms,
                             reference, info, machine,
                             reference=ngram_reference(config.train.data.dataset, config.train.data.cache_dir))


# --- the study ----------------------------------------------------------------------------------------


def run_conversion(config: ExperimentConfig, out_dir: Path, seeds: Sequence[int], *, resume: bool = False,
                   nproc: int = 1, jobs: int = 1, evaluation: Evaluation | None = None,
                   progress: bool = True, overwrite: bool = False) -> ConversionMetrics:
    """The whole study into ``out_dir`` (see the module docstring); returns its metrics (also
    OUT/metrics.json). ``evaluation`` (compare.evaluations) runs on every fine-tuned model at its best."""
    start = time.perf_counter()
    settings = config.convert
    plan = conversion_plan(config)
    show = progress and jobs == 1  # a run's own progress bar, when it trains alone
    source_axes = own_lr_axes(plan.source, [settings.source_model], seeds, [])
    finetune_axes = fine_tuning_axes(config, plan, seeds)
    scratch_axes = None if plan.scratch is None else own_lr_axes(plan.scratch, [settings.scratch_model], seeds,
                                                                  settings.scratch_lr_grid)
    # The whole plan before anything is created: the given source and its tokenizer, every run of every
    # phase, the output folder, then what the runs read (the weights a fine-tuning run starts from do not
    # exist yet: the trainer checks them when it starts).
    if settings.source is not None:
        check_given_source(config)
    phases = [(source_axes, plan.source, "source")] if settings.source is None else []
    phases.append((finetune_axes, plan.finetune, "finetune"))
    if scratch_axes is not None:
        phases.append((scratch_axes, plan.scratch, "scratch"))
    runs = [run for axes, train, where in phases
            for run in plan_runs(axes.keys(), out_dir / where / "runs", partial(run_config, train, progress=False))]
    reading = ([] if config.train.data.dataset in EMBEDDED_DATASETS else [config.train.data.dataset]) + (
        [settings.source] if settings.source else [])
    record = study_record(config, seeds=len(seeds), jobs=jobs)
    check_study_output(out_dir, record, resume=resume, overwrite=overwrite, reading=reading)
    check_runs(runs, nproc=nproc)
    if settings.source is not None:
        check_source_data(config)
    validation_windows(plan.finetune, CONTINUED)  # the windows every conversion is scored on
    with open_study(out_dir, record, resume=resume, overwrite=overwrite, reading=reading, progress=progress):
        seconds = {}

        # 1. The sources.
        source_lr = None
        if settings.source is None:
            sweeps = train_language_models(source_axes.keys(), out_dir / "source" / "runs",
                                           partial(run_config, plan.source, progress=show), resume=resume, nproc=nproc,
                                           jobs=jobs, progress=progress, name=config.model_name, phase="source")
            chosen = sweeps[settings.source_model, None, None].chosen
            sources = {run.key.seed: run.checkpoint_dir for run in chosen}
            source_lr = chosen[0].key.lr
        else:
            path = given_source(settings.source, out_dir / "source" / "imported", resume=resume, progress=progress,
                                tokenizer=given_source_tokenizer(config))
            sources = {seed: path for seed in seeds}
        seconds["source"] = time.perf_counter() - start

        # 2. The conversions, each scored before any training on the fine-tuning's validation windows.
        mark = time.perf_counter()
        device = study_device(config.train)
        windows = validation_windows(plan.finetune, CONTINUED)
        folder = out_dir / "converted"
        pool = [PoolJob(RunKey(arm.name, seed, 0.0), f"{arm.label} (seed {seed})",
                        folder / arm.name / f"seed-{seed}.json", convert_one,
                        (sources[seed], folder / arm.name / f"seed-{seed}", arm.name, arm.to, arm.init, seed, windows,
                         device), load_converted)
                for seed in seeds for arm in plan.arms if arm.to is not None]

        def describe(job: PoolJob, run: ConvertedRun) -> str:
            return (f"convert {job.label}: loss before training {run.start_loss:.4f} (source {run.source_loss:.4f}, "
                    f"{signed(run.loss_change)}), largest logit difference {run.max_logit_difference:.2g}")

        converted: dict[RunKey, ConvertedRun] = run_jobs(pool, resume=resume, at_once=jobs, progress=progress,
                                                         describe=describe)
        seconds["conversion"] = time.perf_counter() - mark

        # 3. Fine-tuning: every arm and seed at every lr, from its own starting checkpoint.
        mark = time.perf_counter()
        starts = {arm.name: ({seed: Path(converted[RunKey(arm.name, seed, 0.0)].checkpoint) for seed in seeds}
                             if arm.to else sources) for arm in plan.arms}

        def configure(key: RunKey, log_dir: Path) -> TrainConfig:
            return run_config(plan.finetune, key, log_dir, progress=show, init_from=starts[key.model][key.seed])

        finetuned = train_language_models(finetune_axes.keys(), out_dir / "finetune" / "runs", configure, resume=resume,
                                          nproc=nproc, jobs=jobs, progress=progress, phase="fine-tune")
        sweeps_by_arm = {arm.name: finetuned[arm.name, None, None] for arm in plan.arms}
        seconds["fine-tuning"] = time.perf_counter() - mark

        # 4. The from-scratch reference.
        scratch = None
        if scratch_axes is not None:
            mark = time.perf_counter()
            scratch = train_language_models(scratch_axes.keys(), out_dir / "scratch" / "runs",
                                            partial(run_config, plan.scratch, progress=show), resume=resume,
                                            nproc=nproc, jobs=jobs, progress=progress, name=config.model_name,
                                            phase="from scratch")[settings.scratch_model, None, None]
            seconds["from scratch"] = time.perf_counter() - mark

        # 5. Retrieval before and after, and compare.evaluations on the fine-tuned models.
        mark = time.perf_counter()
        checkpoints = retrieval_checkpoints(sources, converted, sweeps_by_arm, scratch)
        figures, info = measure_retrieval(config, checkpoints, out_dir / "retrieval", device, progress)
        seconds["retrieval"] = time.perf_counter() - mark
        suite = None
        if evaluation is not None:
            mark = time.perf_counter()
            suite = evaluation({f"{arm.label} s{run.key.seed}": run.checkpoint_dir for arm in plan.arms
                                for run in sweeps_by_arm[arm.name].chosen}, out_dir / "eval")
            seconds["evaluations"] = time.perf_counter() - mark

        device_name = sweeps_by_arm[CONTINUED].chosen[0].summary.device
        metrics = analyse(config, plan, seeds, converted, sweeps_by_arm, scratch, source_lr, figures, info,
                          Machine.of(device_name, nproc, jobs))
        metrics.wall_seconds = time.perf_counter() - start
        metrics.phase_seconds = seconds
        metrics.load_average = os.getloadavg() if hasattr(os, "getloadavg") else None
        write_plot(metrics, out_dir / "conversion_loss.png")
        write_study(out_dir, metrics, render_report(metrics), suite)
        return metrics


# --- the plot and the report ----------------------------------------------------------------------------


def write_plot(metrics: ConversionMetrics, path: Path) -> Path:
    """conversion_loss.png: the validation loss along fine-tuning of every model (mean ± std over
    seeds), the source's loss, and the from-scratch reference over the same last tokens."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, arm in enumerate(metrics.arms):
        mean, std = arm.curve.mean(), arm.curve.std()
        ax.plot(arm.curve.tokens, mean, "o-", color=f"C{i}", markersize=3, label=f"{arm.label} (lr {arm.lr:g})")
        ax.fill_between(arm.curve.tokens, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=f"C{i}", alpha=0.2)
    reference = metrics.scratch
    if reference is not None:
        shifted = [(t - metrics.source.tokens, m) for t, m in zip(reference.curve.tokens, reference.curve.mean())
                   if t >= metrics.source.tokens]
        if shifted:
            ax.plot(*zip(*shifted), "s--", color="grey", markersize=3,
                    label=f"{reference.label} (its last {tokens_text(metrics.finetune_tokens)} tokens)")
    ax.axhline(metrics.source.loss.mean, color="black", linestyle=":", label="the source's loss")
    label_axes(ax, "fine-tuning tokens", "validation loss (nats/token)",
               f"Fine-tuning after conversion, mean ± std over {len(metrics.seeds)} seeds", 7)
    fig.tight_layout()
    return save_plot(fig, path)


def _tokens(x: float) -> str:
    return f"{round(x):,}"


def _token_interval(d: Difference) -> str:
    """A difference of token counts: "+6,258 [+1,103, +11,413]"."""
    return f"{round(d.delta):+,}" + (f" [{round(d.low):+,}, {round(d.high):+,}]" if d.low is not None else "")


def recovery_text(r: Recovery) -> str:
    """"12,345 [9,876, 14,321]", or how many seeds did not recover within the budget."""
    if r.mean is None:
        missing = len(r.per_seed) - r.recovered
        others = ", ".join(_tokens(v) for v in r.per_seed if v is not None)
        return (f"not within {_tokens(r.budget)} tokens in {missing} of {len(r.per_seed)} seeds"
                + (f" (the others: {others})" if others else ""))
    return _tokens(r.mean) + (f" [{_tokens(r.low)}, {_tokens(r.high)}]" if r.low is not None else "")


def render_report(metrics: ConversionMetrics) -> str:
    """report.md: what converting costs and gains against continuing the Transformer, then the curves,
    retrieval before and after, the conversions and the learning rates."""
    source, seeds, arms = metrics.source, metrics.seeds, metrics.arms
    continued, reference = arms[0], metrics.scratch
    env = metrics.machine
    load = metrics.load_average
    origin = (f"{source.given} (given; {tokens_text(source.tokens)} tokens of pretraining)" if source.given
              else f"trained here, one per seed, {source.steps} steps ({tokens_text(source.tokens)} tokens, lr "
                   f"{source.lr:g})")
    lines = [f"# Conversion: {metrics.config}", ""]
    if metrics.description:
        lines += [metrics.description + ".", ""]
    lines += [
        f"The source, {source.label} ({source.parameters:,} parameters): {origin}. Each seed's source converted "
        f"({', '.join(a.conversion for a in arms[1:])}), then every model fine-tuned for {metrics.finetune_steps} "
        "steps "
        f"({tokens_text(metrics.finetune_tokens)} tokens, a fresh {metrics.warmup_steps}-step warmup and linear decay, "
        f"data order {metrics.data_seed}: the same batches for every model) from its own starting weights, "
        f"{_lr_choice(arms)}; {len(seeds)} seeds ({', '.join(map(str, seeds))}: a seed is a whole replicate, "
        "its source and the conversion's new parameters)"
        + (f"; for reference {reference.label} on {tokens_text(reference.tokens)} tokens (as many as the source "
           "and the fine-tuning together, its first steps the source's batches)" if reference else "")
        + f". Wall time {metrics.wall_seconds / 60:.1f} min for this command ("
        + ", ".join(f"{what} {sec / 60:.1f}" for what, sec in metrics.phase_seconds.items()) + " min)"
        + (f", load average at the end {load[0]:.1f} on {env.cpu_count} cores" if load else "")
        + f"; device {env.device} ({env.jobs} run{'s' if env.jobs > 1 else ''} at a time), torch {env.torch}.",
        "",
        *([f"**The budget.** {metrics.budget_note}", ""] if metrics.budget_note else []),
        *([f"**Trivial baselines.** {metrics.reference.text()[0].upper()}{metrics.reference.text()[1:]}: every "
           "loss below is to be read against them (a model above the bigram has learned little of the data).", ""]
          if metrics.reference else []),
        "## What converting costs and gains",
        "",
        f"Validation loss on the same {tokens_text(metrics.finetune_tokens)}-token budget, mean ± std over seeds. "
        f"*Recover*: the fine-tuning tokens after which a model's loss stays at or below its source's "
        f"({stats_cell(source.loss)} on the fine-tuning's validation windows), per seed, linear between evaluations "
        "(every model restarts its optimizer and warmup, so even the continued Transformer may rise first); mean "
        "[Student's 95% interval]. *Against continuing*: the model − the continued Transformer, Welch's 95% interval "
        "over seeds.",
        "",
        "| Model | Parameters | Loss before fine-tuning | Tokens to recover | Final loss | Against continuing "
        "[95% CI] | Verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for arm in arms:
        change = "" if arm is continued else f" ({signed(arm.start.mean - source.loss.mean)})"
        verdict = "the baseline" if arm.final_versus is None else arm.final_versus.words
        lines.append(f"| {arm.label} | {arm.parameters:,} | {stats_cell(arm.start)}{change} | "
                     f"{recovery_text(arm.recovery)} | {stats_cell(arm.final)} | "
                     f"{interval_text(arm.final_versus.difference if arm.final_versus else None)} | **{verdict}** |")
    if reference is not None:
        lines.append(f"| {reference.label} ({tokens_text(reference.tokens)} tokens) | {reference.parameters:,} | – "
                     f"| – | {stats_cell(reference.final)} | {interval_text(reference.final_versus.difference)} | "
                     f"**{reference.final_versus.words}** |")
    if reference is not None:
        lines += ["", f"Each conversion against {reference.label} (final loss, Welch's 95% interval): "
                  + "; ".join(f"{a.label} {interval_text(reference.conversions[a.name].difference)}, "
                              f"{reference.conversions[a.name].words}" for a in arms[1:]) + "."]
    recovery_rows = [a for a in arms if a.recovery_versus is not None]
    if recovery_rows:
        lines += ["", "Tokens to recover against the continued Transformer's (Welch's 95% interval): "
                  + "; ".join(f"{a.label} {_token_interval(a.recovery_versus.difference)}" for a in recovery_rows)
                  + "."]
    lines += ["", "![validation loss along fine-tuning](conversion_loss.png)", ""]
    lines += _curve_lines(metrics) + _retrieval_lines(metrics) + _conversion_lines(metrics) + _lr_lines(metrics)
    lines += ["## How to read this", "",
              "- *Tokens to recover* counts from the start of fine-tuning; it is 0 for a model that never rises above "
              "its source's loss, and only the evaluations bound it (every "
              f"{tokens_text(metrics.finetune_tokens // max(len(continued.curve.tokens) - 1, 1))} tokens here).",
              "- The verdicts compare models fine-tuned on the same data for the same tokens, each at its own lr; "
              "they say nothing about longer budgets, larger models or other data, and a model *level* with the "
              "continued Transformer is one whose difference these seeds cannot tell from zero.",
              "- The from-scratch reference trained on as many tokens as the source and the fine-tuning together, "
              "in one run with one schedule: it says what the same total compute buys without a pretrained start.",
              ""]
    return "\n".join(lines)


def _curve_lines(metrics: ConversionMetrics) -> list[str]:
    tokens = metrics.arms[0].curve.tokens
    lines = ["## Along fine-tuning", "", "Validation loss after each number of fine-tuning tokens, mean ± std over "
             "seeds (0: the starting weights).", "",
             "| Model | " + " | ".join(tokens_text(t) for t in tokens) + " |", "|---|" + "---:|" * len(tokens)]
    for arm in metrics.arms:
        cells = [stats_cell(MeanStd.of(point), 3) for point in zip(*arm.curve.values)]
        lines.append(f"| {arm.label} | " + " | ".join(cells) + " |")
    return lines + [""]


def _retrieval_lines(metrics: ConversionMetrics) -> list[str]:
    info = metrics.retrieval
    lines = [f"## Retrieval before and after: {info.title}", "",
             f"The suite's `{info.evaluation}` evaluation ({info.measure}, {info.better} is better; options "
             f"{', '.join(f'{k} {v}' for k, v in info.options.items())}) on every seed's model: *before* the source "
             "(for the continued Transformer) or the converted checkpoint, *after* the fine-tuned model at its best "
             "lr; mean ± std over seeds, and after − the continued Transformer after with Welch's 95% interval.", "",
             "| Model | Before | After | After, against continuing [95% CI] | Verdict |", "|---|---:|---:|---:|---|"]
    for arm in metrics.arms:
        verdict = "the baseline" if arm is metrics.arms[0] else (arm.retrieval_versus.words if arm.retrieval_versus
                                                                 else "–")
        difference = arm.retrieval_versus.difference if arm.retrieval_versus else None
        lines.append(f"| {arm.label} | {stats_cell(arm.retrieval_before)} | {stats_cell(arm.retrieval_after)} | "
                     f"{interval_text(difference)} | {verdict} |")
    reference = metrics.scratch
    if reference is not None:
        versus = reference.retrieval_versus
        lines.append(f"| {reference.label} | – | {stats_cell(reference.retrieval_after)} | "
                     f"{interval_text(versus.difference if versus else None)} | {versus.words if versus else '–'} |")
    if info.errors:
        lines += ["", "Not run on: " + "; ".join(f"{label} ({why})" for label, why in info.errors.items()) + "."]
    return lines + [""]


def _conversion_lines(metrics: ConversionMetrics) -> list[str]:
    lines = ["## The conversions", "", "What each construction added to the source's parameters, its loss change "
             "before training and its largest logit difference from the source (over seeds) on the fine-tuning's "
             "validation windows (`diff-transformer convert`; docs/training.md, \"From a pretrained Transformer\"), "
             "and λ per layer after fine-tuning (mean over seeds; an exact conversion starts at 0).", "",
             "| Model | Parameters | Added | Loss change before training | Largest logit difference | λ at the end |",
             "|---|---:|---|---:|---:|---|"]
    for arm in metrics.arms[1:]:
        added = "; ".join(f"{what} {n:,}" for what, n in arm.added.items())
        change = MeanStd.of(s - t for s, t in zip(arm.start.per_seed, metrics.source.loss.per_seed))
        lambdas = ", ".join(f"{x:.3f}" for x in arm.lambdas) if arm.lambdas else "–"
        lines.append(f"| {arm.label} | {arm.parameters:,} | {added} | {stats_cell(change)} | "
                     f"{arm.max_logit_difference:.2g} | {lambdas} |")
    return lines + [""]


def _lr_choice(arms: Sequence[ArmResult]) -> str:
    """How the fine-tuning lrs were chosen: searched here (several tried), or given (one each:
    convert.lr_by_model, a pilot's best, or the source's)."""
    if all(len(arm.grid) > 1 for arm in arms):
        return "each at its own best learning rate of those tried"
    given = "; ".join(f"{arm.label} at {arm.lr:g}" for arm in arms if len(arm.grid) == 1)
    searched = any(len(arm.grid) > 1 for arm in arms)
    return (f"each at its own learning rate: one given, not searched here ({given}; from convert.lr_by_model, a "
            "pilot's best, else the source's)" + ("; the others at their best of those tried" if searched else ""))


def _lr_lines(metrics: ConversionMetrics) -> list[str]:
    rows = [(arm.label, arm.grid, arm.lr) for arm in metrics.arms]
    if metrics.scratch is not None:
        rows.append((metrics.scratch.label, metrics.scratch.grid, metrics.scratch.lr))
    grid = sorted({lr for _, by_lr, _ in rows for lr in by_lr})
    lines = ["## Learning rates", "", "Final validation loss at every peak lr tried (min_lr keeps its ratio), mean "
             "± std over seeds; each model's best in bold (a model tried at one lr ran at the one given it).", "",
             "| Model | " + " | ".join(f"lr {lr:g}" for lr in grid) + " |", "|---|" + "---:|" * len(grid)]
    for label, by_lr, best in rows:
        cells = []
        for lr in grid:
            stats = by_lr.get(lr)
            cell = "–" if stats is None else stats_cell(stats)
            cells.append(f"**{cell}**" if lr == best else cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


__all__ = ["ConversionMetrics", "analyse", "conversion_plan", "recovery_tokens", "run_conversion", "versus"]
