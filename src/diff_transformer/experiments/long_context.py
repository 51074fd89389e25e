"""The long-context study: ``diff-transformer compare --config long-context``.

The paper extends its 3B models to 64K tokens (1.5B more tokens, RoPE θ 640,000, lr 8e-5) and
then shows, at that length, that DIFF's cumulative average NLL falls further with position
(Figure 4), that its multi-needle retrieval holds up (Figure 5) and that it puts more attention
on the answer (Table 3). This study runs the same pipeline at CPU scale, for every model of
the comparison alike (same data, budget, schedule and seeds; each at its own best learning rate):

1. **Short**: every model trained at ``data.seq_len`` exactly as the comparison trains it
   (``OUT/short/`` is that comparison, with its own report).
2. **Extension**: each seed's short model continues from its weights (``run.init_from``) at
   ``long_context.seq_len`` tokens with RoPE θ ``long_context.rope_theta``, on windows inside
   documents, at each model's extension learning rate (every lr of ``long_context.lr_grid`` when
   given; a model is reported at the lr of its lowest mean final validation loss).
   ``OUT/extend/runs/<model>/lr-<lr>/seed-<s>/`` as the comparison's runs.
3. **Position-NLL** (Figure 4): the cumulative average NLL up to the new context, on the same
   held-out windows inside documents for every model, before the extension (the short weights with
   the context raised and θ unchanged) and after.
4. **Retrieval by length** (Figure 5, Table 3): the retrieval models of the ``retrieval`` section,
   trained at ``retrieval.length`` tokens, tested at each of ``long_context.retrieval_lengths``
   before and after their own extension (``retrieval_seq_len`` tokens, θ ``retrieval_rope_theta``);
   accuracy per task and where the answer row's attention goes, per length.
5. The evaluations (when given, as compare's ``evaluation``) on every seed's extended model.

``OUT/report.md`` opens with the claims (DIFF − Transformer, Welch's 95% interval, a verdict), then
the tables and ``position_nll.png`` and ``retrieval_length.png``; ``OUT/metrics.json`` holds it all.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from ..data import EMBEDDED_DATASETS, TokenShards, dataset_directory
from ..evaluation.models import load_with_context  # a checkpoint read at another context and θ
from ..evaluation.position_nll import checkpoints as nll_points, cumulative_average
from ..evaluation.scoring import token_nll
from ..evaluation.stats import MeanStd
from ..files import claim_output_dir, write_text_atomically
from ..model import LanguageModel
from ..paper import ATTENTION_TABLE3, PAPER_REFERENCE
from ..train.config import TrainConfig, config_from_dict
from .claims import Claim, Figures, deepest_measured_layer, make_claim, seed_label
from .comparison import CompareMetrics, Evaluation, run_comparison, study_record
from .config import ExperimentConfig, LongContextConfig, RetrievalConfig
from .language_models import LanguageModelling, axes_for, check_runs, plan_runs, run_config, train_language_models
from .output import check_study_output, open_study
from .report import (
    budget_lines, heading_lines, label_axes, pyplot, reference_lines, render_claims, save_plot, stats_cell, write_study,
)
from .results import AnswerShares
from .retrieval import TASKS, accuracy, attention_allocation, evaluation_sets, retrieval_fields, train_model, \
    with_length
from .runner import PoolJob, run_jobs
from .study import Axes, RunKey


# --- the extension --------------------------------------------------------------------------------


def extension_config(config: ExperimentConfig) -> TrainConfig:
    """The trainer's config of the extension runs: every model at long_context.seq_len and rope_theta,
    the extension's data, budget and warmup; evaluation at the end only."""
    settings = config.long_context
    data = config.train.to_dict()
    for entry in data["models"].values():
        entry.update(max_seq_len=settings.seq_len, rope_theta=settings.rope_theta)
    data["data"].update(seq_len=settings.seq_len, batch_size=settings.batch_size, micro_batch_size=None,
                        eval_sequences=settings.eval_sequences, within_documents=settings.within_documents,
                        long_document_tokens=settings.long_document_tokens,
                        long_document_weight=settings.long_document_weight)
    data["optim"]["warmup_steps"] = settings.warmup_steps
    data["run"].update(steps=settings.steps, eval_every=settings.steps, log_every=1, stop_at_step=None,
                       checkpoint_every=0)
    return config_from_dict(data, config.train.source)


def extension_axes(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int]) -> Axes:
    """Every model and seed at each extension lr (long_context.lr_grid, else its own extension lr)."""
    settings = config.long_context
    lrs = {(name, None): tuple(settings.lr_grid) or (settings.lr.get(name, config.train.optim_for(name).lr),)
           for name in names}
    return Axes(models=tuple(names), seeds=tuple(seeds), lrs=lrs)


# --- position-NLL -----------------------------------------------------------------------------------


def validation_windows(train: TrainConfig, seq_len: int, count: int) -> torch.Tensor:
    """``count`` fixed windows of ``seq_len + 1`` tokens inside documents of the dataset's validation
    split (:meth:`TokenShards.val_batches`): (count, seq_len + 1)."""
    directory = dataset_directory(train.data.dataset, train.data.cache_dir, progress=False)
    inputs, targets = TokenShards(directory, "val", within_documents=True).val_batches(1, count, seq_len)[0]
    return torch.cat([inputs, targets[:, -1:]], dim=1)


def position_nll_curve(checkpoint: str | Path, config: ExperimentConfig, seq_len: int) -> list[float]:
    """The cumulative average NLL C(t) = mean(NLL(0..t)), t < seq_len, of a checkpoint at context
    ``seq_len`` (its own θ), over long_context.position_nll_windows held-out windows inside documents."""
    model = load_with_context(checkpoint, seq_len)
    windows = validation_windows(config.train, seq_len, config.long_context.position_nll_windows)
    return cumulative_average(token_nll(model, windows, batch_size=4).mean(dim=0).tolist())


@dataclass
class PositionNLL:
    """C(t) per seed of one model, before the extension (the short weights at the long context, θ
    unchanged) and after."""

    before: list[list[float]]
    after: list[list[float]]


def far_nll(cumulative: list[float], short_len: int) -> float:
    """The mean NLL of the positions past ``short_len`` (t ≥ short_len), from the cumulative average C."""
    n = len(cumulative)
    return (cumulative[-1] * n - cumulative[short_len - 1] * short_len) / (n - short_len)


# --- retrieval by length ------------------------------------------------------------------------------


@dataclass
class AtLength:
    """A retrieval model tested at one length: accuracy per task and cell, per task's mean, and where
    the answer row looks per layer (the hardest needle cells, every depth)."""

    accuracy: dict[str, dict[str, float]]
    mean_accuracy: dict[str, float]
    attention: list[AnswerShares | None]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AtLength":
        shares = [None if s is None else AnswerShares(**s) for s in data["attention"]]
        return cls(data["accuracy"], data["mean_accuracy"], shares)


@dataclass
class LengthRun:
    """One retrieval model of the study: trained short, measured at every test length ("before"), then
    extended at each lr (from the same short weights) and measured again ("after", by lr)."""

    seed: int
    short_lr: float
    short_seconds: float
    before: dict[int, AtLength]
    after: dict[float, dict[int, AtLength]]
    extension_seconds: dict[float, float]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LengthRun":
        def lengths(by_length: dict) -> dict[int, AtLength]:
            return {int(n): AtLength.from_dict(at) for n, at in by_length.items()}

        return cls(data["seed"], data["short_lr"], data["short_seconds"], lengths(data["before"]),
                   {float(lr): lengths(at) for lr, at in data["after"].items()},
                   {float(lr): s for lr, s in data["extension_seconds"].items()})


@torch.no_grad()
def measure_at_lengths(model: LanguageModel, settings: RetrievalConfig, lengths: Sequence[int]) -> dict[int, AtLength]:
    """Per test length: accuracy per task (mean over its difficulty cells) and per cell, and the
    answer row's attention split (per layer) on the hardest needle cells at every depth."""
    out = {}
    for length in lengths:
        sets = evaluation_sets(with_length(settings, length))
        cells = {task: {cell: accuracy(model, examples) for cell, examples in by_cell.items()}
                 for task, by_cell in sets.items()}
        hardest = max(settings.needles)
        probe = [e for d in settings.depths for e in sets["needle"][f"N={hardest},depth={d:g}"]]
        out[length] = AtLength(cells, {task: statistics.fmean(c.values()) for task, c in cells.items()},
                               attention_allocation(model, probe))
    return out


def retrieval_run(config: ExperimentConfig, name: str, seed: int, extension_lrs: Sequence[float]) -> LengthRun:
    """One retrieval model (``seed`` sets its initialisation) of model ``name``'s attention kind:
    trained at retrieval.length, measured at every test length, then extended at each lr of
    ``extension_lrs`` (each from the same short weights) and measured again."""
    settings, lc = config.retrieval, config.long_context
    longest = max([*lc.retrieval_lengths, lc.retrieval_seq_len, settings.length])
    torch.manual_seed(seed)
    model_config = settings.model_config(config.attention(name), diff_heads=config.train.model(name).diff_heads,
                                         **retrieval_fields(config, name, None))
    model = LanguageModel(dataclasses.replace(model_config, max_seq_len=longest))
    short_lr = config.lr_for(name, None, "retrieval")
    start = time.perf_counter()
    train_model(model, settings, config.retrieval_optim(short_lr))
    run = LengthRun(seed, short_lr, time.perf_counter() - start,
                    measure_at_lengths(model, settings, lc.retrieval_lengths), {}, {})
    # The extension: the same weights, θ raised, trained on examples of retrieval_seq_len tokens with a
    # tenth of the steps as warmup (as the retrieval experiment's own 40 of 400).
    warmup = lc.retrieval_steps // 10
    extended_settings = dataclasses.replace(settings, length=lc.retrieval_seq_len, steps=lc.retrieval_steps,
                                            warmup_steps=warmup)
    for lr in extension_lrs:
        extended = LanguageModel(dataclasses.replace(model.config, rope_theta=lc.retrieval_rope_theta))
        extended.load_state_dict(model.state_dict())
        start = time.perf_counter()
        train_model(extended, extended_settings, config.retrieval_optim(lr, warmup_steps=warmup))
        run.extension_seconds[lr] = time.perf_counter() - start
        run.after[lr] = measure_at_lengths(extended, settings, lc.retrieval_lengths)
    return run


@dataclass
class LengthModel:
    """One model's retrieval runs by length: the extension at its best lr (the highest mean accuracy
    over tasks, test lengths and seeds) and the score of each lr."""

    short_lr: float
    best_lr: float
    sweep: dict[float, float]
    before: list[dict[int, AtLength]]  # per seed
    after: list[dict[int, AtLength]]  # per seed, at the best lr


@dataclass
class RetrievalByLength:
    lengths: list[int]
    train_length: int
    extension_length: int
    rope_theta: float
    steps: int
    chance: float
    models: dict[str, LengthModel]


def retrieval_by_length(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int], out_dir: Path, *,
                        resume: bool = False, jobs: int = 1, progress: bool = True) -> RetrievalByLength:
    """Every model and seed (:func:`retrieval_run`, ``jobs`` at a time); each model's extension
    reported at its best lr. OUT/<model>/seed-<s>.json holds each run; with ``resume`` a result already
    there for the same lrs is reused."""
    lc = config.long_context
    lrs = {name: list(lc.retrieval_lr_grid) or [lc.retrieval_lr.get(name, config.lr_for(name, None, "retrieval"))]
           for name in names}

    def loader(name: str):  # a result measured at other lrs is not reused
        def load(data: dict) -> LengthRun | None:
            run = LengthRun.from_dict(data)
            return run if set(run.after) == set(lrs[name]) else None
        return load

    # A run trains at its model's retrieval lr, then extends at each of lrs[name]: the key holds the first.
    keys = [RunKey(name, seed, config.lr_for(name, None, "retrieval")) for name in names for seed in seeds]
    pool = [PoolJob(key, f"{key.model} (seed {key.seed})", out_dir / key.model / f"seed-{key.seed}.json", retrieval_run,
                    (config, key.model, key.seed, lrs[key.model]), loader(key.model)) for key in keys]

    def describe(job: PoolJob, run: LengthRun) -> str:
        return f"retrieval by length {job.label}: " + "; ".join(
            f"{length}: " + ", ".join(f"{t} {at.mean_accuracy[t]:.2f}" for t in TASKS)
            for length, at in run.before.items()) + " before the extension"

    results = run_jobs(pool, resume=resume, at_once=jobs, progress=progress, describe=describe)
    models = {}
    for name in names:
        runs = [results[key] for key in keys if key.model == name]

        def score(lr: float, runs=runs) -> float:  # mean accuracy over the tasks and test lengths, then the seeds
            return statistics.fmean(statistics.fmean(at.mean_accuracy[task] for at in r.after[lr].values()
                                                     for task in TASKS) for r in runs)

        best = max(lrs[name], key=score)
        models[name] = LengthModel(runs[0].short_lr, best, {lr: score(lr) for lr in lrs[name]},
                                   [r.before for r in runs], [r.after[best] for r in runs])
    return RetrievalByLength(list(lc.retrieval_lengths), config.retrieval.length, lc.retrieval_seq_len,
                             lc.retrieval_rope_theta, lc.retrieval_steps, 1 / config.retrieval.values, models)


# --- the study -------------------------------------------------------------------------------------


@dataclass
class LongContextMetrics:
    """Everything the long-context report shows (metrics.json is its JSON)."""

    config: str
    description: str
    budget_note: str
    settings: LongContextConfig
    short: LanguageModelling
    short_rope_theta: float
    extension: LanguageModelling
    position_nll: dict[str, PositionNLL]
    retrieval_by_length: RetrievalByLength | None
    seeds: list[int]
    labels: dict[str, str]
    attention: dict[str, str]
    device: str
    torch: str = torch.__version__
    cpu_count: int | None = os.cpu_count()
    paper: str = PAPER_REFERENCE
    claims: list[Claim] = field(default_factory=list)
    wall_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # of this invocation (a resumed one reuses runs)
    load_average: tuple[float, float, float] | None = None


def run_long_context(config: ExperimentConfig, out_dir: Path, names: Sequence[str], seeds: Sequence[int],
                     grid: Sequence[float], *, retrieval: bool | None = None, resume: bool = False, nproc: int = 1,
                     jobs: int = 1, evaluation: Evaluation | None = None, progress: bool = True,
                     overwrite: bool = False) -> LongContextMetrics:
    """The whole study (see the module docstring) into ``out_dir``; returns the metrics (also
    OUT/metrics.json). ``grid`` is the short runs' grid (as compare's ``--lr-grid``); the
    extension's grid is ``long_context.lr_grid``. ``retrieval=False`` leaves out the retrieval part."""
    start = time.perf_counter()
    settings = config.long_context
    extended = extension_config(config)
    ext_axes = extension_axes(config, names, seeds)
    with_retrieval = retrieval if retrieval is not None else config.retrieval.enabled
    record = study_record(config, names=list(names), seeds=len(seeds), lr_grid=list(grid), jobs=jobs,
                          retrieval=with_retrieval)
    data_dir = [] if config.train.data.dataset in EMBEDDED_DATASETS else [config.train.data.dataset]
    # Every run of both phases, the output folder, then what the runs read, before anything is created.
    short_keys = axes_for(config, names, seeds, grid, list(config.compare.language_model_recipes) or [None]).keys()
    runs = plan_runs(short_keys, out_dir / "short" / "runs", partial(run_config, config.train, progress=False))
    runs += plan_runs(ext_axes.keys(), out_dir / "extend" / "runs", partial(run_config, extended, progress=False))
    check_study_output(out_dir, record, resume=resume, overwrite=overwrite, reading=data_dir)
    check_runs(runs, nproc=nproc)
    validation_windows(config.train, settings.seq_len, settings.position_nll_windows)  # position-NLL's windows
    with open_study(out_dir, record, resume=resume, overwrite=overwrite, reading=data_dir, progress=progress):
        # 1. Short: the comparison itself, without its retrieval experiment and evaluations.
        short_config = dataclasses.replace(config, long_context=LongContextConfig(enabled=False))
        short: CompareMetrics = run_comparison(short_config, out_dir / "short", names, seeds, grid, retrieval=False,
                                               grounded=False,
                                               resume=resume, nproc=nproc, jobs=jobs, progress=progress)
        seconds = {"short": time.perf_counter() - start}
        short_checkpoints = {name: {run.key.seed: run.checkpoint_dir for run in short.lm.sweeps[name].chosen}
                             for name in names}

        # 2. Extension: every model, seed and extension lr, each from its own seed's short checkpoint.
        mark = time.perf_counter()
        ext_dir = out_dir / "extend"
        claim_output_dir(ext_dir, "compare")
        write_text_atomically(ext_dir / "config.yaml", yaml.safe_dump(extended.to_dict(), sort_keys=False))

        def configure(key: RunKey, log_dir: Path) -> TrainConfig:
            return run_config(extended, key, log_dir, progress=progress and jobs == 1,
                              init_from=short_checkpoints[key.model][key.seed])

        sweeps = train_language_models(ext_axes.keys(), ext_dir / "runs", configure, resume=resume, nproc=nproc,
                                       jobs=jobs, progress=progress, name=config.model_name, phase="extend")
        extension = LanguageModelling.of(config, sweeps, names, [None], train=extended)
        seconds["extension"] = time.perf_counter() - mark

        # 3. Position-NLL before and after, on the same held-out windows.
        mark = time.perf_counter()
        position_nll = {}
        for name in names:
            before = [position_nll_curve(short_checkpoints[name][seed], config, settings.seq_len) for seed in seeds]
            after = [position_nll_curve(run.checkpoint_dir, config, settings.seq_len)
                     for run in extension.sweeps[name].chosen]
            position_nll[name] = PositionNLL(before, after)
            if progress:
                print(f"[position-nll] {name}: C({settings.seq_len}) before "
                      f"{statistics.fmean(c[-1] for c in before):.4f}, "
                      f"after {statistics.fmean(c[-1] for c in after):.4f}",
                      file=sys.stderr, flush=True)
        seconds["position_nll"] = time.perf_counter() - mark

        # 4. Retrieval by length.
        mark = time.perf_counter()
        by_length = None
        if with_retrieval:
            by_length = retrieval_by_length(config, names, seeds, out_dir / "retrieval", resume=resume, jobs=jobs,
                                            progress=progress)
        seconds["retrieval"] = time.perf_counter() - mark

        # 5. The evaluations, on every seed's extended model.
        suite = None
        if evaluation is not None:
            mark = time.perf_counter()
            suite = evaluation({seed_label(config, name, run.key.seed): run.checkpoint_dir for name in names
                                for run in extension.sweeps[name].chosen}, out_dir / "eval")
            seconds["evaluations"] = time.perf_counter() - mark

        metrics = LongContextMetrics(
            config=config.name, description=config.train.description, budget_note=config.compare.budget_note,
            settings=settings, short=short.lm,
            short_rope_theta=config.train.model(names[0]).model_config().rope_theta, extension=extension,
            position_nll=position_nll, retrieval_by_length=by_length, seeds=list(seeds),
            labels={name: config.model_name(name) for name in names},
            attention={name: config.attention(name) for name in names}, device=short.machine.device,
        )
        metrics.claims = long_context_claims(metrics)
        metrics.wall_seconds = time.perf_counter() - start
        metrics.phase_seconds = seconds
        metrics.load_average = os.getloadavg() if hasattr(os, "getloadavg") else None
        write_plots(metrics, out_dir)
        write_study(out_dir, metrics, render_report(metrics), suite)
        return metrics


# --- claims -----------------------------------------------------------------------------------------


def long_context_claims(metrics: LongContextMetrics) -> list[Claim]:
    """The paper's long-context claims on DIFF vs the first standard model, after the extension."""
    found = _pair(metrics)
    if found is None:
        return []
    diff_name, base_name = found
    seq_len, short_len = metrics.settings.seq_len, metrics.short.budget.seq_len
    nll = metrics.position_nll
    paper = "lower at every position up to 64K (Fig. 4)"
    rows = [
        make_claim("Long-context language modelling", f"cumulative average NLL over {seq_len:,} tokens after the "
                   "extension", "lower", Figures([c[-1] for c in nll[diff_name].after]),
                   Figures([c[-1] for c in nll[base_name].after]), paper, -1),
        make_claim("Use of the longer context", f"mean NLL at positions {short_len + 1:,}–{seq_len:,} "
                   "(beyond the short training length) after the extension", "lower",
                   Figures([far_nll(c, short_len) for c in nll[diff_name].after]),
                   Figures([far_nll(c, short_len) for c in nll[base_name].after]), paper, -1),
    ]
    by_length = metrics.retrieval_by_length
    if by_length:
        longest = max(by_length.lengths)
        chance = by_length.chance
        runs = {n: by_length.models[n].after for n in found}
        for task, text in (("needle", "stable from 8K to 64K; +76 points at 25% depth of 64K (Fig. 5)"),
                           ("mqar", "no figure (Zoology's task)")):
            per = {n: Figures([r[longest].mean_accuracy[task] for r in runs[n]]) for n in found}
            testable = max(statistics.fmean(f.best) for f in per.values()) > 2 * chance
            rows.append(make_claim("Retrieval at length", f"{task} accuracy at {longest} tokens after the extension "
                                   f"(trained at {by_length.train_length}, extended at {by_length.extension_length}; "
                                   f"chance {chance:.3f})", "higher", per[diff_name], per[base_name], text, +1,
                                   testable=testable, note="" if testable else "both models near chance"))
        layer = deepest_measured_layer([r[longest].attention for n in found for r in runs[n]])
        if layer is not None:
            where = "last layer" if layer == len(runs[diff_name][0][longest].attention) - 1 else f"layer {layer}"
            for claim, group, columns, better, sign in (
                ("Attention to the answer", "answer", "the queried needle", "higher", +1),
                ("Attention noise", "noise", "noise and distractors", "lower", -1),
            ):
                per = {n: Figures([getattr(r[longest].attention[layer], group) for r in runs[n]]) for n in found}
                table3 = (statistics.fmean(ATTENTION_TABLE3["diff"][group])
                          - statistics.fmean(ATTENTION_TABLE3["standard"][group]))
                rows.append(make_claim(claim, f"share of the answer row on {columns} at {longest} tokens, {where}",
                                       better, per[diff_name], per[base_name],
                                       f"{table3:+.2f} (Table 3, 4K)", sign))
    return rows


def _pair(metrics: LongContextMetrics) -> tuple[str, str] | None:
    """(DIFF model, Transformer baseline): the first of each kind."""
    kinds = metrics.attention
    diff = next((n for n, k in kinds.items() if k == "diff"), None)
    base = next((n for n, k in kinds.items() if k == "standard"), None)
    return (diff, base) if diff and base else None


# --- plots and report -------------------------------------------------------------------------------


def _mean_curve(curves: list[list[float]]) -> list[float]:
    return [statistics.fmean(values) for values in zip(*curves)]


def write_plots(metrics: LongContextMetrics, out_dir: Path) -> list[Path]:
    """position_nll.png (cumulative NLL by position, before and after, every model) and
    retrieval_length.png (accuracy by test length, before and after)."""
    plt = pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (name, curves) in enumerate(metrics.position_nll.items()):
        color = f"C{i}"
        label = metrics.labels[name]
        for phase, style in (("before", "--"), ("after", "-")):
            mean = _mean_curve(getattr(curves, phase))
            ax.plot(range(1, len(mean) + 1), mean, style, color=color,
                    label=f"{label}, {'short weights, θ unchanged' if phase == 'before' else 'extended'}")
    ax.axvline(metrics.short.budget.seq_len, color="grey", linestyle=":", label="short training length")
    ax.set_xscale("log")
    label_axes(ax, "position (tokens)", "cumulative average NLL (nats)",
               f"Cumulative average NLL by position, mean over {len(metrics.seeds)} seeds (cf. paper Fig. 4)", 8)
    fig.tight_layout()
    paths.append(save_plot(fig, out_dir / "position_nll.png"))

    by_length = metrics.retrieval_by_length
    if by_length:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, task in zip(axes, TASKS):
            for i, (name, m) in enumerate(by_length.models.items()):
                for phase, style in (("before", "--"), ("after", "-")):
                    values = [[r[n].mean_accuracy[task] for r in getattr(m, phase)] for n in by_length.lengths]
                    ax.errorbar(by_length.lengths, [statistics.fmean(v) for v in values],
                                yerr=[statistics.stdev(v) if len(v) > 1 else 0.0 for v in values], fmt="o" + style,
                                color=f"C{i}", mfc="white" if phase == "before" else f"C{i}", capsize=3,
                                label=f"{metrics.labels[name]}, {phase} the extension")
            ax.axhline(by_length.chance, color="grey", linestyle=":", label="chance")
            ax.axvline(by_length.train_length, color="grey", linestyle="--", alpha=0.4)
            ax.set_xscale("log", base=2)
            ax.set_xticks(by_length.lengths, [str(n) for n in by_length.lengths])
            ax.set_ylim(0, 1.02)
            label_axes(ax, "test length (tokens)", "answer accuracy",
                       f"{task}: trained at {by_length.train_length}, extended at {by_length.extension_length}", 7)
        fig.tight_layout()
        paths.append(save_plot(fig, out_dir / "retrieval_length.png"))
    return paths


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def render_report(metrics: LongContextMetrics) -> str:
    """report.md: the claims, then the training, position-NLL and retrieval tables with their plots."""
    s, short, ext = metrics.settings, metrics.short, metrics.extension
    labels, seeds = metrics.labels, metrics.seeds
    load = metrics.load_average
    lines = heading_lines(f"Long context: {metrics.config}", metrics.description)
    lines += [
        f"Every model trained at {short.budget.seq_len} tokens (RoPE θ {metrics.short_rope_theta:,.0f}; "
        f"{short.budget.tokens_per_model:,} tokens, short/report.md), then extended from each seed's weights to "
        f"{s.seq_len:,} tokens with θ {s.rope_theta:,.0f} for {s.steps} steps × {s.batch_size} sequences "
        f"({s.steps * s.batch_size * s.seq_len:,} tokens, windows inside documents"
        + (f", documents of {s.long_document_tokens:,}+ tokens ×{s.long_document_weight:g}"
           if s.long_document_weight != 1 else "")
        + f"), {len(seeds)} seeds ({', '.join(map(str, seeds))}), the same data and schedule for every model, each at "
        f"its own best learning rate. Wall time {metrics.wall_seconds / 60:.1f} min for this command ("
        + ", ".join(f"{what.replace('_', '-')} {sec / 60:.1f}" for what, sec in metrics.phase_seconds.items())
        + " min)"
        + (f", load average at the end {load[0]:.1f} on {metrics.cpu_count} cores" if load else "")
        + f"; device {metrics.device}, torch {metrics.torch}.",
        "",
        *budget_lines(metrics.budget_note),
        *reference_lines(short),
        *render_claims(metrics.claims, len(seeds)),
        "## Training",
        "",
        "| Model | Phase | Context | Peak lr | Tokens | Final val loss | Train tokens/s | Peak memory |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in labels:
        for phase, lm, context in (("short", short, f"{short.budget.seq_len}"), ("extension", ext, f"{s.seq_len:,}")):
            m = lm.models[name]
            lines.append(f"| {labels[name]} | {phase} | {context} | {m.lr:g} | {m.tokens:,} | "
                         f"{stats_cell(m.final_val_loss)} | {stats_cell(m.tokens_per_s, 0)} | "
                         f"{_mib(m.peak_memory_bytes)} ({m.peak_memory_kind}) |")
    lines += ["", "Validation loss: the mean cross-entropy over the same held-out windows for every model (at "
              f"{s.seq_len:,} tokens inside documents for the extension). Peak memory: the largest over seeds of "
              "each run's process (peak RSS on CPU: Python, torch and the data included).", ""]
    scores = {name: sweep.scores[None] for name, sweep in ext.sweeps.items()}
    if any(len(by_lr) > 1 for by_lr in scores.values()):
        grid = sorted({lr for by_lr in scores.values() for lr in by_lr})
        lines += ["### Extension learning rates (final validation loss; the best of each model in bold)", "",
                  "| Model | " + " | ".join(f"lr {lr:g}" for lr in grid) + " |", "|---|" + "---:|" * len(grid)]
        for name, by_lr in scores.items():
            cells = []
            for lr in grid:
                stats = by_lr.get(lr)
                cell = "—" if stats is None or stats.mean is None else stats_cell(stats)
                cells.append(f"**{cell}**" if lr == ext.sweeps[name].lr else cell)
            lines.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
        lines.append("")

    points = nll_points(s.seq_len)
    lines += ["## Cumulative average NLL by position (paper Figure 4)", "",
              f"C(t), the mean NLL of positions 1…t, over {s.position_nll_windows} held-out windows of "
              f"{s.seq_len:,} tokens inside documents (the same windows for every model), mean ± std over seeds. "
              f"*Before*: the short weights with the context raised to {s.seq_len:,} and θ unchanged; "
              "*after*: the extended model. The paper's 3B models at 64K: DIFF below the Transformer at every "
              "position.", "",
              "| Model | | " + " | ".join(f"≤{p:,}" for p in points) + " |", "|---|---|" + "---:|" * len(points)]
    for name, curves in metrics.position_nll.items():
        for phase in ("before", "after"):
            cells = [stats_cell(MeanStd.of(c[p - 1] for c in getattr(curves, phase)), 3) for p in points]
            lines.append(f"| {labels[name]} | {phase} | " + " | ".join(cells) + " |")
    lines += ["", "![cumulative NLL by position](position_nll.png)", ""]
    if metrics.retrieval_by_length:
        lines += _retrieval_lines(metrics.retrieval_by_length, labels)
    lines += ["## How to read this", "",
              f"- The paper's figures ({metrics.paper}) come from 3B models extended to 64K tokens with 1.5B tokens; "
              "these models are tiny and briefly trained, so only the direction of a difference can be compared.",
              "- Verdicts: DIFF − Transformer with Welch's 95% interval over seeds; *agrees* / *contradicts* when the "
              "interval excludes zero on one side, else *inconclusive*.", ""]
    return "\n".join(lines)


def _retrieval_lines(by_length: RetrievalByLength, labels: dict[str, str]) -> list[str]:
    lengths = by_length.lengths
    lines = ["## Retrieval by length (paper Figure 5, Table 3)", "",
             f"The retrieval experiment's models (generated multi-needle and MQAR examples), trained at "
             f"{by_length.train_length} tokens, tested at {', '.join(map(str, lengths))} tokens (longer examples hold "
             f"more noise between the keys and the query) before and after an extension of {by_length.steps} steps "
             f"at {by_length.extension_length} tokens with θ {by_length.rope_theta:,.0f}; accuracy is exact match "
             f"on the answers, mean over the difficulty cells (chance {by_length.chance:.3f}), mean ± std over seeds. "
             "Extension lr: " + ", ".join(f"{labels[n]} {m.best_lr:g}" for n, m in by_length.models.items())
             + ".", "",
             "| Model | Task | | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|---|---|" + "---:|" * len(lengths)]
    for name, m in by_length.models.items():
        for task in TASKS:
            for phase in ("before", "after"):
                cells = [stats_cell(MeanStd.of(r[n].mean_accuracy[task] for r in getattr(m, phase)), 3)
                         for n in lengths]
                lines.append(f"| {labels[name]} | {task} | {phase} | " + " | ".join(cells) + " |")
    # One layer per length for every model and phase: the deepest whose answer rows are measurable in
    # every run (a DIFF layer with λ near 1 has rows summing to ~0), as the claims read it.
    layers = {n: deepest_measured_layer([r[n].attention for m in by_length.models.values()
                                         for phase in ("before", "after") for r in getattr(m, phase)]) for n in lengths}
    lines += ["", "Where the answer row looks at each length (the hardest needle cells, every depth; head mean, "
              "divided by the row sum; at each length the deepest layer measurable in every run, the one the "
              "claims read):", "",
              "| Model | | " + " | ".join(f"{n} tokens (layer {layers[n]}): answer / noise" for n in lengths) + " |",
              "|---|---|" + "---:|" * len(lengths)]
    for name, m in by_length.models.items():
        for phase in ("before", "after"):
            cells = []
            for n in lengths:
                if layers[n] is None:
                    cells.append("–")
                    continue
                shares = [r[n].attention[layers[n]] for r in getattr(m, phase)]
                cells.append(f"{stats_cell(MeanStd.of(x.answer for x in shares), 3)} / "
                             f"{stats_cell(MeanStd.of(x.noise for x in shares), 3)}")
            lines.append(f"| {labels[name]} | {phase} | " + " | ".join(cells) + " |")
    lines += ["", "![retrieval accuracy by length](retrieval_length.png)", ""]
    return lines
