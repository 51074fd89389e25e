"""The scaling study: ``diff-transformer compare --config scaling`` (the paper's Figure 3).

The paper's headline: over 830M–13.1B parameters at 10B tokens, DIFF reaches the Transformer's loss with
62.2% of the parameters (6.8B ≈ 11B) and 59.5% (7.8B ≈ 13.1B) (Figure 3a), and a 3B DIFF trained on 160B
tokens matches the Transformer on 251B (63.7%, Figure 3b). This study measures the same on the engine's
axes: every model of the comparison (by default the Transformer, DIFF and DIFF V2) at every size of
``scaling.sizes`` (each kind matched as the presets are: DIFF with half the heads of the Transformer's
width, values twice it; each kind counted on its own parameters) and every budget of
``scaling.budgets``, on the same data in the same order, each at its own best learning rate at each size
(the grid extended outward, up to ``scaling.lr_extend`` steps, where the best lies at an end), over
several seeds. The lr is chosen on the validation windows; the loss every figure uses is measured on
held-out windows the choice never saw (``data.heldout_sequences``; without them, on the validation
windows, and the report says so). Then:

- DIFF − Transformer at every size and budget with Welch's 95% interval, and the trend of that gap
  along size: the least-squares slope per doubling of parameters with its 95% interval, in words;
- per kind, the law L(N) = a·N^(−b) + c over its own non-embedding parameters at the largest budget
  (the kinds sharing c) and over tokens at each size of ``budget_sizes``, each flagged where it says
  nothing; and the matching fraction with its interval and sensitivity, or "not identified" and why:
  :func:`diff_transformer.evaluation.scaling.analyse`, the one definition ``eval scaling`` uses too.

``OUT/report.md``, ``OUT/metrics.json`` (its ``runs``: every seed of every point, which ``eval scaling
--results OUT/metrics.json`` reads), ``OUT/scaling_params.png``, ``OUT/scaling_gap.png`` and
``OUT/scaling_tokens.png``; each run under ``OUT/runs/<model>/<size>/steps-<n>/lr-<lr>/seed-<s>/``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


from ..config import DIFF_HEAD_KINDS, PAPER_SIZES
from ..data import EMBEDDED_DATASETS, dataset_directory
from ..evaluation import scaling as laws
from ..evaluation.ngram import NgramReference, ngram_reference
from ..evaluation.stats import Difference, MeanStd, t_quantile, welch_difference
from ..model import LanguageModel
from ..paper import SCALING_FIG3
from ..train.config import TrainConfig
from .comparison import Evaluation, study_record
from .config import ExperimentConfig
from .language_models import Machine, check_runs, plan_runs, run_config, train_language_models
from .output import check_study_output, open_study
from .report import (
    budget_lines, count_text, heading_lines, label_axes, pyplot, save_plot, signed, stats_cell, tokens_text,
    write_study,
)
from .results import TrainingRun
from .study import Axes, RunKey, Sweep

PAPER_TOKENS = 10e9  # Figure 3a: every size trained on 10B tokens


# --- the runs ---------------------------------------------------------------------------------------


def size_fields(config: ExperimentConfig, model: str, size: str) -> dict:
    """Model ``model``'s ModelConfig fields at ``size`` (its ``preset`` apart): the size's fields, with
    twice its (DIFF) head counts for the kinds of ordinary heads, as the presets match them."""
    fields = {k: v for k, v in config.scaling.sizes[size].items() if k != "preset"}
    if config.attention(model) not in DIFF_HEAD_KINDS:
        for key in ("n_heads", "n_kv_heads"):
            if fields.get(key) is not None:
                fields[key] *= 2
    return fields


def sized_train(config: ExperimentConfig, key: RunKey) -> TrainConfig:
    """The trainer's config of run ``key``: its model at the key's size (a size that names a preset
    takes its shape from it), its run at the key's steps."""
    train = config.train
    entry = train.model(key.model)
    preset = config.scaling.sizes[key.size].get("preset", entry.preset)
    entry = dataclasses.replace(entry, preset=preset,
                                fields={**entry.fields, **size_fields(config, key.model, key.size)})
    run = dataclasses.replace(train.run, steps=key.steps, eval_every=min(train.run.eval_every, key.steps))
    return dataclasses.replace(train, models={**train.models, key.model: entry}, run=run)


def scaling_keys(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int]) -> list[RunKey]:
    """Every model, seed, size, budget and learning rate of the grids; seeds outermost (the runs an
    lr grid's extension adds come after these)."""
    settings = config.scaling
    recipes = tuple(config.compare.language_model_recipes) or (None,)
    keys = []
    for size in settings.sizes:
        grid = settings.grid(size)
        lrs = {(m, r, size): tuple(grid) or (config.lr_for(m, r, "lm"),) for m in names for r in recipes}
        budgets = tuple(settings.budget_steps(config.train.run.steps, size))
        keys += Axes(tuple(names), tuple(seeds), lrs, recipes, (size,), budgets).keys()
    return sorted(keys, key=lambda key: seeds.index(key.seed))  # stable: the rest in axis order


def training_flops(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int]) -> float:
    """The floating-point operations of every run of the grids (Kaplan et al.'s count: 6 per parameter of
    the network and LM head per token, forward and backward, and 6·L·T·d per token for the attention
    maps; the embedding lookup is free): what a machine's sustained FLOP/s turn into its wall time. An
    extension of an lr grid adds its runs' share."""
    total = 0.0
    for key in scaling_keys(config, names, seeds):
        train = sized_train(config, key)
        model = train.model(key.model).model_config()
        seq_len = train.data.seq_len or model.max_seq_len
        tokens = key.steps * train.data.batch_size * seq_len
        head = model.vocab_size * model.d_model
        total += tokens * (6 * (non_embedding_parameters(train, key.model) + head)
                           + 6 * model.n_layers * seq_len * model.d_model)
    return total


def non_embedding_parameters(train: TrainConfig, model: str) -> int:
    """The parameters of ``model`` but for its token embedding and its LM head."""
    network = LanguageModel(train.model(model).model_config(), device="meta")
    embedding = network.embed.weight.numel() + (network.lm_head.weight.numel() if network.lm_head is not None else 0)
    return network.num_parameters() - embedding


# --- the measurements ---------------------------------------------------------------------------------


@dataclass
class ScalingPoint:
    """One model at one size and budget, at its best learning rate there (chosen on the validation loss),
    over its seeds: ``loss`` is what every figure uses (the held-out loss, or the validation loss where
    the runs have no held-out windows)."""

    model: str
    size: str
    steps: int
    tokens: int
    parameters: int
    non_embedding: int
    lr: float
    recipe: str | None
    final_val_loss: MeanStd
    loss: MeanStd
    seeds: list[int]
    grid: dict[float, MeanStd]  # the final validation loss at every lr tried
    added: tuple[float, ...]  # the lrs the grid was extended by
    edge: str | None  # "low" / "high": still best at that end of its (extended) grid
    tokens_per_s: MeanStd

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.non_embedding


def point_of(config: ExperimentConfig, sweep: Sweep[TrainingRun], size: str, steps: int) -> ScalingPoint:
    runs = sweep.chosen
    summary = runs[0].summary
    train = sized_train(config, runs[0].key)
    heldout = [r.summary.final_heldout_loss for r in runs]
    loss = MeanStd.of(r.final_val_loss for r in runs) if None in heldout else MeanStd.of(heldout)
    return ScalingPoint(sweep.model, size, steps, summary.tokens, summary.parameters,
                        non_embedding_parameters(train, sweep.model), sweep.lr, sweep.best_recipe,
                        MeanStd.of(r.summary.final_val_loss for r in runs), loss, [r.key.seed for r in runs],
                        dict(sweep.scores[sweep.best_recipe]), sweep.added.get(sweep.best_recipe, ()),
                        sweep.edge(sweep.best_recipe), MeanStd.of(r.summary.tokens_per_s for r in runs))


@dataclass
class Trend:
    """How ``model`` − ``baseline`` (final loss) moves along size at the largest budget: the slope per
    doubling of non-embedding parameters (least squares over every seed's difference) and its 95%
    interval, in words."""

    model: str
    baseline: str
    slope: float | None
    low: float | None
    high: float | None
    points: int
    words: str


def size_trend(model: str, baseline: str, pairs: Sequence[tuple[float, float]], labels: dict[str, str]) -> Trend:
    """The trend of the per-seed differences ``pairs`` [(parameters, difference)]: a line in log2 of the
    parameters, its slope's Student interval on n − 2 degrees of freedom."""
    from scipy.stats import linregress

    xs = [math.log2(n) for n, _ in pairs]
    sizes = len(set(xs))
    if sizes < 2 or len(pairs) < 3:
        return Trend(model, baseline, None, None, None, len(pairs),
                     f"no trend measured: {len(pairs)} difference{'s' if len(pairs) != 1 else ''} at {sizes} "
                     f"size{'s' if sizes != 1 else ''} (a slope's interval needs two sizes and three differences)")
    differences = [d for _, d in pairs]
    if max(differences) == min(differences):  # no spread at all: a line through them has no error
        return Trend(model, baseline, 0.0, 0.0, 0.0, len(pairs),
                     f"no trend: the difference is {signed(differences[0])} at every size and seed")
    fit = linregress(xs, differences)
    half = t_quantile(len(pairs) - 2) * fit.stderr
    low, high = fit.slope - half, fit.slope + half
    return Trend(model, baseline, fit.slope, low, high, len(pairs),
                 trend_words(labels[model], labels[baseline], fit.slope, low, high,
                             statistics.fmean(d for _, d in pairs)))


def trend_words(label: str, base: str, slope: float, low: float, high: float, mean_gap: float) -> str:
    """The trend in words: whether the gap (``label`` − ``base``, nats) falls or rises with size, and
    what that means for the gap's size, or that no trend is measured (the interval holds zero)."""
    per = f"{signed(slope)} nats per doubling [{signed(low)}, {signed(high)}]"
    if low <= 0 <= high:
        return f"no trend measured: {per}"
    falls = slope < 0
    toward = "in favour of" if falls else "against"
    if (mean_gap > 0) == falls:  # the gap moves toward zero
        what = f"the gap shrinks as models grow ({label} {'behind' if mean_gap > 0 else 'ahead'} and closing)"
    else:
        what = f"the gap grows as models grow ({label} {'ahead' if mean_gap < 0 else 'behind'} by more)"
    return f"{label} − {base} {'falls' if falls else 'rises'} with size, {toward} {label}: {per}; {what}"


@dataclass
class AxisLaws:
    """The laws along one axis: parameters (at the largest budget) or tokens (at ``size``)."""

    x_kind: str
    size: str | None
    analysis: laws.LawAnalysis


@dataclass
class ScalingMetrics:
    """Everything the scaling report shows (metrics.json is its JSON; ``runs``: every seed of every point,
    as ``eval scaling`` reads them)."""

    config: str
    description: str
    budget_note: str
    sizes: dict[str, dict]
    seeds: list[int]
    labels: dict[str, str]
    baseline: str | None
    points: list[ScalingPoint]
    loss_source: str  # "held-out" or "validation": the windows every figure's loss was measured on
    laws: list[AxisLaws]
    gaps: dict[str, dict[str, dict[int, Difference]]]  # model -> size -> steps -> model − baseline
    trends: list[Trend]
    machine: Machine
    lr_note: str
    lr_extend: int
    runs: list[dict[str, Any]]
    wall_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    paper: dict = field(default_factory=lambda: dict(SCALING_FIG3))
    reference: NgramReference | None = None  # the data's unigram and bigram loss

    def point(self, model: str, size: str, steps: int) -> ScalingPoint | None:
        return next((p for p in self.points if (p.model, p.size, p.steps) == (model, size, steps)), None)

    @property
    def full_steps(self) -> int:
        return max(p.steps for p in self.points)

    def budgets(self) -> list[int]:
        return sorted({p.steps for p in self.points})


def run_records(config: ExperimentConfig, points: Sequence[ScalingPoint]) -> list[dict[str, Any]]:
    """Every seed of every point as an ``eval scaling`` run: {attention, label, model, size, params (the
    model's own non-embedding parameters), tokens, loss (the reported one), seed}."""
    records = []
    for p in points:
        for seed, loss in zip(p.seeds, p.loss.per_seed):
            records.append({"attention": config.attention(p.model), "label": config.model_name(p.model),
                            "model": p.model, "size": p.size, "params": p.non_embedding, "tokens": p.tokens,
                            "loss": loss, "seed": seed})
    return records


def analyse(config: ExperimentConfig, names: Sequence[str], sweeps: dict[tuple, Sweep[TrainingRun]],
            seeds: Sequence[int], machine: Machine) -> ScalingMetrics:
    """The points, laws, matching fractions, gaps and trends of the study's runs."""
    settings = config.scaling
    points = [point_of(config, sweep, size, steps) for (model, size, steps), sweep in sweeps.items()]
    heldout = all(r.summary.final_heldout_loss is not None for s in sweeps.values() for r in s.chosen)
    labels = {name: config.model_name(name) for name in names}
    baseline = next((n for n in names if config.attention(n) == "standard"), None)
    full = config.train.run.steps
    sizes = list(settings.sizes)
    runs = run_records(config, points)
    metrics = ScalingMetrics(config.name, config.train.description, config.compare.budget_note,
                             {s: dict(f) for s, f in settings.sizes.items()}, list(seeds), labels, baseline, points,
                             "held-out" if heldout else "validation", [], {}, [], machine, lr_note(config),
                             settings.lr_extend, runs,
                             reference=ngram_reference(config.train.data.dataset, config.train.data.cache_dir))
    if baseline is None:
        return metrics
    # The laws: the one definition (evaluation.scaling) on the runs eval scaling reads, each model its own
    # kind (two models of one attention kind stay apart here).
    by_model = [{**r, "attention": r["model"]} for r in runs]
    metrics.laws.append(AxisLaws("params", None, laws.analyse(
        laws.cells_of(by_model, "params"), "params", baseline, resamples=settings.bootstrap_resamples,
        labels=labels)))
    for size in sizes:
        if len(settings.budget_steps(full, size)) > 1:
            along = [r for r in by_model if r["size"] == size]
            metrics.laws.append(AxisLaws("tokens", size, laws.analyse(
                laws.cells_of(along, "tokens"), "tokens", baseline, resamples=settings.bootstrap_resamples,
                labels=labels)))
    per_seed = {(p.model, p.size, p.steps): list(p.loss.per_seed) for p in points}
    for name in names:
        if name == baseline:
            continue
        metrics.gaps[name] = {size: {steps: welch_difference(per_seed[name, size, steps],
                                                             per_seed[baseline, size, steps])
                                     for steps in settings.budget_steps(full, size)} for size in sizes}
        pairs = [(metrics.point(baseline, size, full).non_embedding, m - b) for size in sizes
                 for m, b in zip(per_seed[name, size, full], per_seed[baseline, size, full])]
        metrics.trends.append(size_trend(name, baseline, pairs, labels))
    return metrics


def lr_note(config: ExperimentConfig) -> str:
    """How each model's learning rate was chosen at each size, for the report."""
    settings = config.scaling
    if not settings.lr_grid and not settings.lr_grid_by_size:
        return "each model at its own configured lr at every size (no grid: `scaling.lr_grid` searches one)"
    grids = {size: settings.grid(size) for size in settings.sizes}
    shown = "; ".join(f"{size}: {', '.join(f'{lr:g}' for lr in lrs) or 'its own'}" for size, lrs in grids.items())
    extend = (f"; where a model's best lr lay at an end of its grid, the grid went on one step outward, at most "
              f"{settings.lr_extend} step{'s' if settings.lr_extend != 1 else ''} at each end"
              if settings.lr_extend else "; no grid extended (scaling.lr_extend: 0)")
    return f"each model at its own best lr at each size (chosen on the validation loss), from a grid per size " \
           f"({shown}){extend}"


# --- the study ----------------------------------------------------------------------------------------


def run_scaling(config: ExperimentConfig, out_dir: Path, names: Sequence[str], seeds: Sequence[int], *,
                resume: bool = False, nproc: int = 1, jobs: int = 1, evaluation: Evaluation | None = None,
                progress: bool = True, overwrite: bool = False) -> ScalingMetrics:
    """The whole study into ``out_dir`` (see the module docstring); returns its metrics."""
    start = time.perf_counter()
    keys = scaling_keys(config, names, seeds)

    def configure(key: RunKey, log_dir: Path) -> TrainConfig:
        return run_config(sized_train(config, key), key, log_dir, progress=progress and jobs == 1)

    record = study_record(config, names=list(names), seeds=len(seeds), jobs=jobs)
    data_dir = [] if config.train.data.dataset in EMBEDDED_DATASETS else [config.train.data.dataset]
    runs = plan_runs(keys, out_dir / "runs", configure)  # every run, the output folder, then what they read
    check_study_output(out_dir, record, resume=resume, overwrite=overwrite, reading=data_dir)
    check_runs(runs, nproc=nproc)
    with open_study(out_dir, record, resume=resume, overwrite=overwrite, reading=data_dir, progress=progress):
        dataset_directory(config.train.data.dataset, config.train.data.cache_dir, progress=progress)
        sweeps = train_language_models(keys, out_dir / "runs", configure, resume=resume, nproc=nproc, jobs=jobs,
                                       progress=progress, name=config.model_name,
                                       extend_lrs=config.scaling.lr_extend)
        phases = {"training": time.perf_counter() - start}
        device = next(iter(sweeps.values())).chosen[0].summary.device
        mark = time.perf_counter()
        metrics = analyse(config, names, sweeps, seeds, Machine.of(device, nproc, jobs))
        phases["analysis"] = time.perf_counter() - mark
        suite = None
        if evaluation is not None:  # on every seed's model at the largest size and budget
            largest, full = list(config.scaling.sizes)[-1], config.train.run.steps
            mark = time.perf_counter()
            suite = evaluation({f"{config.model_name(n)} {largest} s{run.key.seed}": run.checkpoint_dir for n in names
                                for run in sweeps[n, largest, full].chosen}, out_dir / "eval")
            phases["evaluations"] = time.perf_counter() - mark
        metrics.wall_seconds = time.perf_counter() - start
        metrics.phase_seconds = phases
        write_plots(metrics, out_dir)
        write_study(out_dir, metrics, render_report(metrics), suite)
        return metrics


# --- plots and report -------------------------------------------------------------------------------


def write_plots(metrics: ScalingMetrics, out_dir: Path) -> list[Path]:
    """scaling_params.png (loss against each model's own non-embedding parameters, with its law, and the
    profile of the fit error over each exponent), scaling_gap.png (each model − the Transformer against
    size) and, where a size has several budgets, scaling_tokens.png (loss against tokens)."""
    plt = pyplot()
    paths = []
    full = metrics.full_steps
    colors = {name: f"C{i}" for i, name in enumerate(metrics.labels)}
    fig, (ax, ax_profile) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in metrics.labels:
        at_full = [metrics.point(name, size, full) for size in metrics.sizes]
        ax.errorbar([p.non_embedding for p in at_full], [p.loss.mean for p in at_full],
                    yerr=[p.loss.std or 0.0 for p in at_full], fmt="o", color=colors[name], capsize=3,
                    label=metrics.labels[name])
    params = next((axis.analysis for axis in metrics.laws if axis.x_kind == "params"), None)
    if params is not None:
        for name, fit in params.fits.items():
            grid = [min(fit.x) * (max(fit.x) / min(fit.x) * 1.5) ** (k / 60) / 1.2 for k in range(61)]
            ax.plot(grid, [fit.law(x) for x in grid], color=colors[name], linewidth=1,
                    linestyle=":" if fit.flags else "-",
                    label=f"{fit.law.text()}" + (" (flagged: says nothing)" if fit.flags else ""))
            ax_profile.plot(laws.EXPONENTS, fit.profile, color=colors[name], label=metrics.labels[name])
        if params.noise is not None:
            from scipy.stats import f as f_distribution

            ax_profile.axhline(float(f_distribution.ppf(laws.LEVEL, 1, params.noise.df)), color="grey",
                               linestyle="--", label="95% threshold")
    ax.set_xscale("log")
    label_axes(ax, "non-embedding parameters N (each model its own)", f"final {metrics.loss_source} loss (nats/token)",
               f"Loss against size at {tokens_text(max(p.tokens for p in metrics.points))} tokens "
               "(cf. paper Fig. 3a; dotted: a flagged law)", 7)
    ax_profile.set_xscale("log")
    ax_profile.set_yscale("symlog")
    label_axes(ax_profile, "exponent b", "extra fit error / a seed's variance",
               "Profile of the fit error over b (identified: rises above the line both sides)", 7)
    fig.tight_layout()
    paths.append(save_plot(fig, out_dir / "scaling_params.png"))

    if metrics.gaps:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        base = metrics.baseline
        for name, by_size in metrics.gaps.items():
            xs = [metrics.point(base, size, full).non_embedding for size in metrics.sizes]
            d = [by_size[size][full] for size in metrics.sizes]
            lower = [x.delta - x.low if x.low is not None else 0.0 for x in d]
            upper = [x.high - x.delta if x.high is not None else 0.0 for x in d]
            ax.errorbar(xs, [x.delta for x in d], yerr=[lower, upper], fmt="o-", color=colors[name], capsize=3,
                        label=f"{metrics.labels[name]} − {metrics.labels[base]}")
        ax.axhline(0.0, color="grey", linestyle=":")
        ax.set_xscale("log")
        label_axes(ax, "the Transformer's non-embedding parameters N", "difference in final loss (nats/token)",
                   "The gap along size, 95% intervals (negative: better than the Transformer)", 7)
        fig.tight_layout()
        paths.append(save_plot(fig, out_dir / "scaling_gap.png"))

    token_laws = [axis for axis in metrics.laws if axis.x_kind == "tokens"]
    if token_laws:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for axis in token_laws:
            for name in metrics.labels:
                along = [metrics.point(name, axis.size, s) for s in metrics.budgets()]
                along = [p for p in along if p is not None]
                ax.plot([p.tokens for p in along], [p.loss.mean for p in along], "o", color=colors[name],
                        label=f"{metrics.labels[name]} ({axis.size})")
                fit = axis.analysis.fits.get(name)
                if fit is not None:
                    grid = [min(fit.x) * (max(fit.x) / min(fit.x)) ** (k / 40) for k in range(41)]
                    ax.plot(grid, [fit.law(x) for x in grid], color=colors[name], linewidth=1,
                            linestyle=":" if fit.flags else "-")
        ax.set_xscale("log")
        label_axes(ax, "training tokens D", f"final {metrics.loss_source} loss (nats/token)",
                   "Loss against tokens (cf. Fig. 3b; dotted: a flagged law)", 7)
        fig.tight_layout()
        paths.append(save_plot(fig, out_dir / "scaling_tokens.png"))
    return paths


def ratio_text(x: float) -> str:
    """A ratio with two significant figures at least: 12, 2.8, 0.23, 0.016."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def _law_lines(metrics: ScalingMetrics, axis: AxisLaws) -> list[str]:
    """The laws of one axis: a table with each law's exponent set, residuals and flags; the noise."""
    analysis = axis.analysis
    where = "parameters" if axis.x_kind == "params" else f"tokens at {axis.size}"
    if analysis.problem:
        return [f"Along {where}: no laws — {analysis.problem}.", ""]
    labels = metrics.labels
    noise = analysis.noise
    floor = ("the models share the floor c (the same data at the same budget has one irreducible loss)"
             if analysis.shared_floor else "each model has its own floor c (its loss trained without end)")
    if noise is None:
        judged = "the noise is unknown, so nothing is identified."
    else:
        source = ("pooled within cells" if noise.source == "seeds"
                  else "the fit's residuals, larger than the seeds' spread")
        test = f"; lack of fit p = {noise.lack_of_fit_p:.2g}" if noise.lack_of_fit_p is not None else ""
        judged = f"a seed's noise {noise.sd:.4f} nats ({source}, {noise.df} degrees of freedom{test})."
    lines = [f"Along {where}: {floor}; {judged}",
             "", "| Model | Law | b within the noise (95%) | RMSE | Residuals | Flags |", "|---|---|---|---:|---|---|"]
    for kind in [n for n in labels if n in analysis.fits]:
        fit = analysis.fits[kind]
        low, high = fit.exponent_interval
        lines.append(f"| {labels.get(kind, kind)} | {fit.law.text()} | {low:.3g}–{high:.3g} | {fit.rmse:.4f} | "
                     + ", ".join(f"{r:+.4f}" for r in fit.residuals) + f" | {'; '.join(fit.flags) or '–'} |")
    return lines + [""]


def _matching_lines(metrics: ScalingMetrics, axis: AxisLaws) -> list[str]:
    """Each model's matching fraction along one axis: the summary in words, then every reading."""
    labels = metrics.labels
    what = "parameters" if axis.x_kind == "params" else f"tokens (at {axis.size})"
    if axis.analysis.problem:
        return [f"- Along {what}: no fraction — {axis.analysis.problem}.", ""]
    lines = []
    for kind in [n for n in labels if n in axis.analysis.matching]:
        m = axis.analysis.matching[kind]
        lines += ["- " + laws.fraction_text(m, labels.get(kind, kind), what), "",
                  f"  | The Transformer's {axis.x_kind} | Its fitted loss | {labels.get(kind, kind)}'s {axis.x_kind} "
                  "for that loss | Fraction | Within its measured range |", "  |---:|---:|---:|---:|---|"]
        for r in m.readings:
            needed = "never" if math.isinf(r.kind_x) else laws.x_text(r.kind_x)
            fraction = "–" if math.isinf(r.fraction) else f"{r.fraction:.3g}"
            lines.append(f"  | {laws.x_text(r.baseline_x)} | {r.loss:.4f} | {needed} | {fraction} | "
                         f"{'yes' if r.inside else 'no'} |")
        lines.append("")
    return lines


def render_report(metrics: ScalingMetrics) -> str:
    """report.md: the gap at every size with its interval, the trend along size, the matching fractions
    with their readings, the laws, then the tables of every point."""
    labels, full = metrics.labels, metrics.full_steps
    names = list(labels)
    env = metrics.machine
    seeds = len(metrics.seeds)
    sizes = list(metrics.sizes)
    budgets = metrics.budgets()
    held = ("measured on held-out windows the lr choice never saw (data.heldout_sequences)"
            if metrics.loss_source == "held-out" else
            "measured on the validation windows the lr was chosen on (no held-out windows: "
            "data.heldout_sequences is 0), so the best lr's loss is biased low by the choice")
    lines = heading_lines(f"Scaling: {metrics.config}", metrics.description)
    lines += [
        f"{', '.join(labels.values())} at {count_text(len(sizes), 'size')} ({', '.join(sizes)}; "
        "each kind matched as the presets are: DIFF with half the Transformer's heads, values twice as wide; each "
        f"counted on its own parameters) and {count_text(len(budgets), 'budget')} "
        f"({', '.join(count_text(b, 'step') for b in budgets)}), trained on the same data in the same order, "
        f"{count_text(seeds, 'seed')} ({', '.join(map(str, metrics.seeds))}); {metrics.lr_note}. "
        f"Every loss below is the final loss {held}. Device: {env.device} ({env.cpu_count} CPU cores; "
        f"{count_text(env.jobs, 'run')} at a time), torch {env.torch}. Wall time: {metrics.wall_seconds / 60:.1f} min "
        "for this command" + (" (" + ", ".join(f"{k} {v / 60:.1f} min" for k, v in metrics.phase_seconds.items())
                              + ")" if metrics.phase_seconds else "") + ".",
        "",
        *budget_lines(metrics.budget_note),
        *_reference_lines(metrics),
        "## The gap along size",
        "",
        f"Final loss at the largest budget ({full} steps), mean ± std over seeds; each model − the Transformer with "
        "Welch's 95% interval (negative: lower loss than the Transformer). Each model's own non-embedding "
        "parameters; tokens per parameter: training tokens over the Transformer's (the paper's Figure 3a: 10B "
        f"tokens over 0.83–13.1B parameters, {ratio_text(PAPER_TOKENS / PAPER_SIZES['830m'])} down to "
        f"{ratio_text(PAPER_TOKENS / PAPER_SIZES['13.1b'])}).",
        "",
        "| Size | " + " | ".join(f"{labels[n]} parameters" for n in names) + " | Tokens | Tokens / parameter | "
        + " | ".join(labels[n] for n in names)
        + "".join(f" | {labels[n]} − {labels[metrics.baseline]} [95% CI]" for n in metrics.gaps) + " |",
        "|---|" + "---:|" * (2 * len(names) + 2 + len(metrics.gaps)),
    ]
    for size in sizes:
        base = metrics.point(metrics.baseline or names[0], size, full)
        counts = [f"{metrics.point(n, size, full).non_embedding:,}" for n in names]
        cells = [stats_cell(metrics.point(n, size, full).loss) for n in names]
        cells += [_interval(metrics.gaps[n][size][full]) for n in metrics.gaps]
        lines.append(f"| {size} | " + " | ".join(counts) + f" | {tokens_text(base.tokens)} | "
                     f"{ratio_text(base.tokens_per_parameter)} | " + " | ".join(cells) + " |")
    lines += ["", "![the gap along size](scaling_gap.png)", ""]
    if metrics.trends:
        lines += ["**The trend along size** (least squares over every seed's difference against log2 of the "
                  "Transformer's parameters, Student's 95% interval):", ""]
        lines += [f"- **{labels[t.model]}**: {t.words}." for t in metrics.trends] + [""]
    paper = metrics.paper
    lines += ["## The matching fraction",
              "",
              f"The paper: DIFF reaches the Transformer's loss with {paper['parameter_fraction'][1]:.3f} and "
              f"{paper['parameter_fraction'][0]:.3f} of its parameters (Figure 3a: 6.8B ≈ 11B, 7.8B ≈ 13.1B) and "
              f"{paper['token_fraction']:.3f} of its tokens (Figure 3b). Here: at each size the Transformer was "
              "measured at, its fitted loss and the parameters (or tokens) each model's law needs for it, over the "
              "Transformer's (the readings); the figure summarised is the reading at the geometric centre of the "
              "Transformer's measured range, where the laws are best determined. It is stated beside the paper's "
              "only when both laws are identified and the crossing lies within the model's measured range; its "
              "interval is a parametric bootstrap (every cell mean redrawn around the laws with the seeds' noise, "
              "the noise redrawn too, both laws refitted; resamples that never reach the loss counted, not "
              "dropped), and its sensitivity the fraction when any one cell mean moves by one seed's standard "
              "deviation.", ""]
    for axis in metrics.laws:
        lines += _matching_lines(metrics, axis)
    lines += ["## The laws", "",
              "L(x) = a·x^(−b) + c per model, fitted jointly by variable projection (for each floor c and exponent "
              "b, a by non-negative least squares; c and b on a grid, refined by SciPy), cell means weighted by "
              "their seeds; residual = measured − law. A law is flagged, and says nothing, when a constant sits at "
              "its bound or the profile of the fit error over b stays within the noise up to an end of the range "
              "searched (0.01–2): then the data do not identify how fast the loss falls, and any fraction read "
              "from it is a statement about the fit, not the models.", ""]
    for axis in metrics.laws:
        lines += _law_lines(metrics, axis)
    lines += ["![loss against size](scaling_params.png)", ""]
    if any(axis.x_kind == "tokens" for axis in metrics.laws):
        lines += ["![loss against tokens](scaling_tokens.png)", ""]
    lines += ["## Every run", "", "Each model at its best lr at each size and budget (the validation loss at every lr "
              f"tried; the loss column is the {metrics.loss_source} loss).", "",
              "| Model | Size | Steps | Tokens | Best lr | Validation loss | Loss | Every lr | Train tokens/s |",
              "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for p in sorted(metrics.points, key=lambda p: (names.index(p.model), sizes.index(p.size), p.steps)):
        grid = "; ".join(f"{lr:g}: {s.mean:.4f}" if s.mean is not None else f"{lr:g}: –"
                         for lr, s in sorted(p.grid.items()))
        mark = f" ({p.edge} edge)" if p.edge else ""
        added = f" (added {', '.join(f'{lr:g}' for lr in p.added)})" if p.added else ""
        lines.append(f"| {labels[p.model]} | {p.size} | {p.steps} | {tokens_text(p.tokens)} | {p.lr:g}{mark} | "
                     f"{stats_cell(p.final_val_loss)} | {stats_cell(p.loss)} | {grid}{added} | "
                     f"{stats_cell(p.tokens_per_s, 0)} |")
    edge = [p for p in metrics.points if p.edge]
    extended = [p for p in metrics.points if p.added]
    lines += [""]
    if extended:
        lines.append(f"{len(extended)} of {len(metrics.points)} points had their lr grid extended outward (the lrs "
                     "added are named).")
    if edge:
        limit = (f"the limit of {metrics.lr_extend} added lr{'s' if metrics.lr_extend != 1 else ''} per end was "
                 "reached" if metrics.lr_extend else "no extension was allowed (scaling.lr_extend: 0)")
        lines.append(f"{len(edge)} of {len(metrics.points)} points are still best at an end of their grid (marked "
                     f"edge): {limit}; their best lr may lie beyond, and their loss is an upper bound on their best.")
    elif not extended:
        lines.append("Every point's best lr lies inside its grid.")
    lines += ["", "## How to read this", "",
              f"- The paper ({metrics.paper['source']}): {metrics.paper['claim']}. Its models are 830M–13.1B "
              "parameters at 10B tokens; these are tiny, so only the direction and the trend can be compared, and a "
              "law fitted to a few small sizes says nothing certain about billions of parameters.",
              "- A matching fraction below 1 means the model needs fewer parameters (or tokens) than the "
              "Transformer for the same loss. Where the laws are nearly flat a small loss offset is a large factor "
              "in parameters: the sensitivity says how far one point's noise moves it.", ""]
    return "\n".join(lines)


def _reference_lines(metrics: ScalingMetrics) -> list[str]:
    """Where the models stand against their data's unigram and bigram tables, at the largest budget."""
    ref = metrics.reference
    if ref is None:
        return []
    full, sizes = metrics.full_steps, list(metrics.sizes)
    gaps = {(p.model, p.size): ref.bigram - p.loss.mean for p in metrics.points
            if p.steps == full and p.loss.mean is not None}
    if not gaps:
        return []
    least = min(gaps, key=gaps.get)
    base = metrics.baseline
    fall = (metrics.point(base, sizes[0], full).loss.mean - metrics.point(base, sizes[-1], full).loss.mean
            if base and metrics.point(base, sizes[0], full).loss.mean is not None
            and metrics.point(base, sizes[-1], full).loss.mean is not None else None)
    largest = [gaps[n, sizes[-1]] for n in metrics.labels if (n, sizes[-1]) in gaps]
    every = all(g >= ref.margin for g in gaps.values())
    return [
        f"**Trivial baselines.** {ref.text()[0].upper()}{ref.text()[1:]}. Below the bigram at the largest budget: "
        f"every model at every size by {min(gaps.values()):+.3f} or more (the least: {metrics.labels[least[0]]} at "
        f"{least[1]}), at the largest size by {min(largest):+.3f} to {max(largest):+.3f}"
        + (f"; the Transformer's loss falls by {fall:.3f} nats from {sizes[0]} to {sizes[-1]}" if fall is not None
           else "") + ". "
        + ("Every model has passed the bigram by the margin (" + f"{ref.margin:g} nats/{ref.unit}): the "
           "comparison along size is one of models that have learned." if every else
           f"**Not every model is {ref.margin:g} nats/{ref.unit} below the bigram**: where one is not, it has "
           "learned little beyond which token follows which, and the gap there says little about attention."),
        "",
    ]


def _interval(d: Difference) -> str:
    return signed(d.delta) + (f" [{signed(d.low)}, {signed(d.high)}]" if d.low is not None else "")


__all__ = ["AxisLaws", "ScalingMetrics", "analyse", "run_scaling", "size_trend", "trend_words"]
