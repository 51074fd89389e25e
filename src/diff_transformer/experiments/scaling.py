"""The scaling study: ``diff-transformer compare --config scaling`` (the paper's Figure 3).

The paper's headline: over 830M–13.1B parameters at 10B tokens, DIFF reaches the Transformer's
loss with ~62% of the parameters (Figure 3a), and a 3B DIFF trained on 160B tokens matches the
Transformer on 251B (~64%, Figure 3b). This study measures the same on the engine's axes: every
model of the comparison (by default the Transformer, DIFF and DIFF V2) at every size of
``scaling.sizes`` (each kind matched as the presets are: DIFF with half the heads of the
Transformer's width, values twice it) and every budget of ``scaling.budgets``, on the same data in
the same order, each at its own best learning rate at each size, over several seeds. Then:

- per kind, the loss against non-embedding parameters (at the largest budget) and against tokens
  (at each size of ``budget_sizes``) with the fitted law L(x) = a·x^(−b) + c and its residuals;
- DIFF − Transformer at every size and budget with Welch's 95% interval, and the trend of that
  gap along size: the least-squares slope per doubling of parameters with its 95% interval, in
  words (falls, rises, or no trend measured);
- the matching fraction: the parameters (or tokens) DIFF needs for the Transformer's loss, as a
  fraction of the Transformer's, from the two fitted laws, with a bootstrap interval over seeds; a
  crossing outside the measured range is reported as an extrapolation, never as a measurement.

``OUT/report.md``, ``OUT/metrics.json``, ``OUT/scaling_params.png``, ``OUT/scaling_gap.png`` and
``OUT/scaling_tokens.png``; each run under ``OUT/runs/<model>/<size>/steps-<n>/lr-<lr>/seed-<s>/``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence


from ..config import DIFF_HEAD_KINDS, PAPER_SIZES
from ..data import EMBEDDED_DATASETS, dataset_directory
from ..evaluation.stats import Difference, MeanStd, PowerLaw, bootstrap_interval, fit_power_law, t_quantile, \
    welch_difference
from ..model import LanguageModel
from ..paper import SCALING_FIG3
from ..train.config import TrainConfig
from .comparison import Evaluation, study_record
from .config import ExperimentConfig
from .language_models import Machine, check_runs, plan_runs, run_config, train_language_models
from .output import check_study_output, open_study
from .report import (
    budget_lines, heading_lines, label_axes, pyplot, save_plot, signed, stats_cell, tokens_text, write_study,
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
    """Every model, seed, size, budget and learning rate; seeds outermost."""
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
    """The floating-point operations of every run of the study (Kaplan et al.'s count: 6 per parameter of
    the network and LM head per token, forward and backward, and 6·L·T·d per token for the attention
    maps; the embedding lookup is free): what a machine's sustained FLOP/s turn into its wall time."""
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
    """One model at one size and budget, at its best learning rate there, over its seeds."""

    model: str
    size: str
    steps: int
    tokens: int
    parameters: int
    non_embedding: int
    lr: float
    recipe: str | None
    final_val_loss: MeanStd
    grid: dict[float, MeanStd]  # the final loss at every lr tried
    tokens_per_s: MeanStd

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.non_embedding

    @property
    def at_grid_edge(self) -> bool:
        """Best at the smallest or the largest lr of a grid of several: the optimum may lie outside it."""
        return len(self.grid) > 1 and self.lr in (min(self.grid), max(self.grid))


def point_of(config: ExperimentConfig, sweep: Sweep[TrainingRun], size: str, steps: int) -> ScalingPoint:
    runs = sweep.chosen
    summary = runs[0].summary
    train = sized_train(config, runs[0].key)
    return ScalingPoint(sweep.model, size, steps, summary.tokens, summary.parameters,
                        non_embedding_parameters(train, sweep.model), sweep.lr, sweep.best_recipe,
                        MeanStd.of(r.summary.final_val_loss for r in runs), dict(sweep.scores[sweep.best_recipe]),
                        MeanStd.of(r.summary.tokens_per_s for r in runs))


@dataclass
class Fit:
    """A model's law L(x) over ``x`` ("params": non-embedding parameters at the largest budget;
    "tokens": training tokens at one size), the points it was fitted to and its residuals."""

    model: str
    x_kind: str
    size: str | None  # the size of a law over tokens
    x: list[float]
    loss: list[float]  # the mean over seeds at each x
    law: PowerLaw | None  # None with fewer than two distinct x

    @property
    def residuals(self) -> list[float] | None:
        return None if self.law is None else [y - self.law(x) for x, y in zip(self.x, self.loss)]


def fit_law(x: Sequence[float], loss: Sequence[float]) -> PowerLaw | None:
    return fit_power_law(x, loss) if len(set(x)) >= 2 else None


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
    if len(set(xs)) < 2 or len(pairs) < 3:
        return Trend(model, baseline, None, None, None, len(pairs), "no trend measured (fewer than two sizes)")
    fit = linregress(xs, [d for _, d in pairs])
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
class Matching:
    """The fraction of the baseline's parameters (or tokens) ``model`` needs for the baseline's loss, from
    the two fitted laws (the median over the baseline's measured x whose crossing lies within the
    measured range), with its bootstrap interval over seeds; None and why when undefined.
    ``extrapolated``: no crossing lies within the x measured."""

    model: str
    baseline: str
    x_kind: str
    size: str | None
    fraction: float | None
    interval: tuple[float, float] | None
    extrapolated: bool
    why: str = ""


def matching_fraction(model_law: PowerLaw | None, base_law: PowerLaw | None, base_x: Sequence[float]
                      ) -> tuple[float | None, bool]:
    """The fraction of the baseline's x the model needs for the baseline's fitted loss, the median over
    the ``base_x`` where the model's x lies within the measured range (interpolated by its law), else
    over all of them (``True``: an extrapolation); (None, False) where the model never reaches a loss."""
    if model_law is None or base_law is None:
        return None, False
    needed = [model_law.inverse(base_law(x)) for x in base_x]
    if any(n is None for n in needed):
        return None, False
    inside = [n / x for n, x in zip(needed, base_x) if min(base_x) <= n <= max(base_x)]
    if inside:
        return statistics.median(inside), False
    return statistics.median(n / x for n, x in zip(needed, base_x)), True


def matching(model: str, baseline: str, x_kind: str, size: str | None, x: Sequence[float],
             model_seeds: Sequence[Sequence[float]], base_seeds: Sequence[Sequence[float]], resamples: int) -> Matching:
    """The matching fraction from the per-seed losses at each x (``*_seeds[i]``: the seeds at x[i]),
    its bootstrap interval (every cell's seeds resampled, both laws fitted again)."""
    @functools.lru_cache(maxsize=None)
    def law(means: tuple[float, ...]) -> PowerLaw | None:  # a law depends on its cells' means alone
        return fit_law(x, means)

    def fraction(*cells) -> float | None:
        means = tuple(statistics.fmean(c) for c in cells)
        k = len(x)
        return matching_fraction(law(means[:k]), law(means[k:]), x)[0]

    model_law = fit_law(x, [statistics.fmean(s) for s in model_seeds])
    base_law = fit_law(x, [statistics.fmean(s) for s in base_seeds])
    if model_law is None or base_law is None:
        return Matching(model, baseline, x_kind, size, None, None, False, "one x only: no law to read it off")
    point, extrapolated = matching_fraction(model_law, base_law, x)
    if point is None:
        return Matching(model, baseline, x_kind, size, None, None, False,
                        "at some x the Transformer's loss is below the floor c of this model's fitted law: the "
                        "model would never reach it")
    cells = [*model_seeds, *base_seeds]
    interval = bootstrap_interval(cells, fraction, resamples=resamples) if all(len(c) > 1 for c in cells) else None
    why = "two x only: c held at 0 (pure power laws)" if model_law.fixed_c else ""
    return Matching(model, baseline, x_kind, size, point, interval, extrapolated, why)


@dataclass
class ScalingMetrics:
    """Everything the scaling report shows (metrics.json is its JSON)."""

    config: str
    description: str
    budget_note: str
    sizes: dict[str, dict]
    seeds: list[int]
    labels: dict[str, str]
    baseline: str | None
    points: list[ScalingPoint]
    fits: list[Fit]
    gaps: dict[str, dict[str, dict[int, Difference]]]  # model -> size -> steps -> model − baseline
    trends: list[Trend]
    matching: list[Matching]
    machine: Machine
    lr_note: str
    wall_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    paper: dict = field(default_factory=lambda: dict(SCALING_FIG3))

    def point(self, model: str, size: str, steps: int) -> ScalingPoint | None:
        return next((p for p in self.points if (p.model, p.size, p.steps) == (model, size, steps)), None)

    @property
    def full_steps(self) -> int:
        return max(p.steps for p in self.points)


def analyse(config: ExperimentConfig, names: Sequence[str], sweeps: dict[tuple, Sweep[TrainingRun]],
            seeds: Sequence[int], machine: Machine) -> ScalingMetrics:
    """The points, fits, gaps, trends and matching fractions of the study's runs."""
    settings = config.scaling
    points = [point_of(config, sweep, size, steps) for (model, size, steps), sweep in sweeps.items()]
    per_seed = {(model, size, steps): [r.summary.final_val_loss for r in sweep.chosen]
                for (model, size, steps), sweep in sweeps.items()}
    labels = {name: config.model_name(name) for name in names}
    baseline = next((n for n in names if config.attention(n) == "standard"), None)
    full = config.train.run.steps
    sizes = list(settings.sizes)
    metrics = ScalingMetrics(config.name, config.train.description, config.compare.budget_note,
                             {s: dict(f) for s, f in settings.sizes.items()}, list(seeds), labels, baseline, points,
                             [], {}, [], [], machine, lr_note(config))
    for name in names:
        at_full = [metrics.point(name, size, full) for size in sizes]
        x = [float(p.non_embedding) for p in at_full]
        metrics.fits.append(Fit(name, "params", None, x, [p.final_val_loss.mean for p in at_full],
                                fit_law(x, [p.final_val_loss.mean for p in at_full])))
        for size in sizes:
            steps = settings.budget_steps(full, size)
            if len(steps) > 1:
                along = [metrics.point(name, size, s) for s in steps]
                tokens = [float(p.tokens) for p in along]
                losses = [p.final_val_loss.mean for p in along]
                metrics.fits.append(Fit(name, "tokens", size, tokens, losses, fit_law(tokens, losses)))
    if baseline is None:
        return metrics
    for name in names:
        if name == baseline:
            continue
        metrics.gaps[name] = {size: {steps: welch_difference(per_seed[name, size, steps],
                                                             per_seed[baseline, size, steps])
                                     for steps in settings.budget_steps(full, size)} for size in sizes}
        pairs = [(metrics.point(baseline, size, full).non_embedding, m - b) for size in sizes
                 for m, b in zip(per_seed[name, size, full], per_seed[baseline, size, full])]
        metrics.trends.append(size_trend(name, baseline, pairs, labels))
        x = [float(metrics.point(baseline, size, full).non_embedding) for size in sizes]
        metrics.matching.append(matching(name, baseline, "params", None, x,
                                         [per_seed[name, size, full] for size in sizes],
                                         [per_seed[baseline, size, full] for size in sizes],
                                         settings.bootstrap_resamples))
        for size in sizes:
            steps = settings.budget_steps(full, size)
            if len(steps) > 1:
                tokens = [float(metrics.point(baseline, size, s).tokens) for s in steps]
                metrics.matching.append(matching(name, baseline, "tokens", size, tokens,
                                                 [per_seed[name, size, s] for s in steps],
                                                 [per_seed[baseline, size, s] for s in steps],
                                                 settings.bootstrap_resamples))
    return metrics


def lr_note(config: ExperimentConfig) -> str:
    """How each model's learning rate was chosen at each size, for the report."""
    settings = config.scaling
    if not settings.lr_grid and not settings.lr_grid_by_size:
        return "each model at its own configured lr at every size (no grid: `scaling.lr_grid` searches one)"
    grids = {size: settings.grid(size) for size in settings.sizes}
    shown = "; ".join(f"{size}: {', '.join(f'{lr:g}' for lr in lrs) or 'its own'}" for size, lrs in grids.items())
    return f"each model at its own best lr at each size, from a grid per size ({shown})"


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
                                       progress=progress, name=config.model_name)
        phases = {"training": time.perf_counter() - start}
        device = next(iter(sweeps.values())).chosen[0].summary.device
        metrics = analyse(config, names, sweeps, seeds, Machine.of(device, nproc, jobs))
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
    """scaling_params.png (loss against non-embedding parameters per model, with its law),
    scaling_gap.png (each model − the Transformer against size) and, where a size has several
    budgets, scaling_tokens.png (loss against tokens)."""
    plt = pyplot()
    paths = []
    full = metrics.full_steps
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, fit in enumerate(f for f in metrics.fits if f.x_kind == "params"):
        stds = [metrics.point(fit.model, size, full).final_val_loss.std or 0.0 for size in metrics.sizes]
        ax.errorbar(fit.x, fit.loss, yerr=stds, fmt="o", color=f"C{i}", capsize=3, label=metrics.labels[fit.model])
        if fit.law is not None:
            grid = [min(fit.x) * (max(fit.x) / min(fit.x) * 1.5) ** (k / 60) / 1.2 for k in range(61)]
            ax.plot(grid, [fit.law(x) for x in grid], color=f"C{i}", linewidth=1,
                    label=f"{fit.law.a:.3g}·N^−{fit.law.b:.3f} + {fit.law.c:.3f}"
                    + (" (c = 0)" if fit.law.fixed_c else ""))
    ax.set_xscale("log")
    label_axes(ax, "non-embedding parameters N", "final validation loss (nats/token)",
               f"Loss against size at {tokens_text(max(p.tokens for p in metrics.points))} tokens "
               "(cf. paper Fig. 3a)", 7)
    fig.tight_layout()
    paths.append(save_plot(fig, out_dir / "scaling_params.png"))

    if metrics.gaps:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        base = metrics.baseline
        for i, (name, by_size) in enumerate(metrics.gaps.items(), 1):
            xs = [metrics.point(base, size, full).non_embedding for size in metrics.sizes]
            d = [by_size[size][full] for size in metrics.sizes]
            lower = [x.delta - x.low if x.low is not None else 0.0 for x in d]
            upper = [x.high - x.delta if x.high is not None else 0.0 for x in d]
            ax.errorbar(xs, [x.delta for x in d], yerr=[lower, upper], fmt="o-", color=f"C{i}", capsize=3,
                        label=f"{metrics.labels[name]} − {metrics.labels[base]}")
        ax.axhline(0.0, color="grey", linestyle=":")
        ax.set_xscale("log")
        label_axes(ax, "non-embedding parameters N", "difference in final loss (nats/token)",
                   "The gap along size, 95% intervals (negative: better than the Transformer)", 7)
        fig.tight_layout()
        paths.append(save_plot(fig, out_dir / "scaling_gap.png"))

    token_fits = [f for f in metrics.fits if f.x_kind == "tokens"]
    if token_fits:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = {name: f"C{i}" for i, name in enumerate(metrics.labels)}
        for fit in token_fits:
            ax.plot(fit.x, fit.loss, "o", color=colors[fit.model], label=f"{metrics.labels[fit.model]} ({fit.size})")
            if fit.law is not None:
                grid = [min(fit.x) * (max(fit.x) / min(fit.x)) ** (k / 40) for k in range(41)]
                ax.plot(grid, [fit.law(x) for x in grid], color=colors[fit.model], linewidth=1)
        ax.set_xscale("log")
        label_axes(ax, "training tokens D", "final validation loss (nats/token)",
                   "Loss against tokens (cf. Fig. 3b)", 7)
        fig.tight_layout()
        paths.append(save_plot(fig, out_dir / "scaling_tokens.png"))
    return paths


def _fraction_text(m: Matching, labels: dict[str, str]) -> str:
    what = "parameters" if m.x_kind == "params" else f"tokens at {m.size}"
    paper = SCALING_FIG3
    theirs = (f"{paper['parameter_fraction'][0]:.2f}–{paper['parameter_fraction'][1]:.2f}" if m.x_kind == "params"
              else f"{paper['token_fraction']:.2f}")
    head = f"- **{labels[m.model]}, {what}**: "
    if m.fraction is None:
        return head + f"undefined: {m.why} (the paper: {theirs})."
    interval = f" [{m.interval[0]:.2f}, {m.interval[1]:.2f}] (bootstrap over seeds, 95%)" if m.interval else \
        " (no interval: one seed in a cell)"
    where = (" — **an extrapolation**: every crossing lies outside the range measured, so this is where the laws "
             "would cross, not a measurement" if m.extrapolated else " (read within the measured range)")
    note = f"; {m.why}" if m.why else ""
    return head + (f"{m.fraction:.2f}× the Transformer's {what.split(' at')[0]}{interval}{where}{note}; "
                   f"the paper: {theirs}.")


def render_report(metrics: ScalingMetrics) -> str:
    """report.md: the gap at every size with its interval, the trend along size, the matching fraction,
    the laws, then the tables of every point."""
    labels, full = metrics.labels, metrics.full_steps
    names = list(labels)
    env = metrics.machine
    seeds = len(metrics.seeds)
    sizes = list(metrics.sizes)
    lines = heading_lines(f"Scaling: {metrics.config}", metrics.description)
    lines += [
        f"{', '.join(labels.values())} at {len(sizes)} sizes ({', '.join(sizes)}; each kind matched as the presets "
        f"are: DIFF with half the Transformer's heads, values twice as wide), trained on the same data in the same "
        f"order, {seeds} seed{'s' if seeds > 1 else ''} ({', '.join(map(str, metrics.seeds))}); {metrics.lr_note}. "
        f"Device: {env.device} ({env.cpu_count} CPU cores; {env.jobs} runs at a time), torch {env.torch}. Wall time: "
        f"{metrics.wall_seconds / 60:.1f} min for this command ("
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in metrics.phase_seconds.items()) + ").",
        "",
        *budget_lines(metrics.budget_note),
        "## The gap along size",
        "",
        f"Final validation loss at the largest budget ({full} steps), mean ± std over seeds; each model − the "
        "Transformer with Welch's 95% interval (negative: lower loss than the Transformer). Tokens per parameter: "
        f"training tokens over non-embedding parameters (the paper's Figure 3a: 10B tokens over 0.83–13.1B "
        f"parameters, {PAPER_TOKENS / PAPER_SIZES['830m']:.1f} down to {PAPER_TOKENS / PAPER_SIZES['13.1b']:.2f}).",
        "",
        "| Size | Non-embedding parameters | Tokens | Tokens / parameter | "
        + " | ".join(labels[n] for n in names)
        + "".join(f" | {labels[n]} − {labels[metrics.baseline]} [95% CI]" for n in metrics.gaps) + " |",
        "|---|---:|---:|---:|" + "---:|" * (len(names) + len(metrics.gaps)),
    ]
    for size in sizes:
        base = metrics.point(metrics.baseline or names[0], size, full)
        cells = [stats_cell(metrics.point(n, size, full).final_val_loss) for n in names]
        cells += [_interval(metrics.gaps[n][size][full]) for n in metrics.gaps]
        lines.append(f"| {size} | {base.non_embedding:,} | {tokens_text(base.tokens)} | "
                     f"{base.tokens_per_parameter:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "![the gap along size](scaling_gap.png)", ""]
    if metrics.trends:
        lines += ["**The trend along size** (least squares over every seed's difference against log2 of the "
                  "parameters, Student's 95% interval):", ""]
        lines += [f"- **{labels[t.model]}**: {t.words}." for t in metrics.trends] + [""]
    if metrics.matching:
        lines += ["## The matching fraction (paper: DIFF matches the Transformer with ~62–65% of the parameters, "
                  "~64% of the tokens)", "",
                  "What each model needs, as a fraction of the Transformer's, to reach the Transformer's loss, read "
                  "off the two fitted laws at each size the Transformer was measured at (the median), with a bootstrap "
                  "interval over seeds (every cell's seeds resampled, both laws fitted again).", ""]
        lines += [_fraction_text(m, labels) for m in metrics.matching] + [""]
    lines += ["## The laws", "", "L(x) = a·x^(−b) + c per model, least squares on the means over seeds; residual = "
              "measured − law.", "", "| Model | x | Law | RMSE | Residuals |", "|---|---|---|---:|---|"]
    for fit in metrics.fits:
        x_name = "parameters" if fit.x_kind == "params" else f"tokens at {fit.size}"
        if fit.law is None:
            lines.append(f"| {labels[fit.model]} | {x_name} | – (one x) | – | – |")
            continue
        law = f"{fit.law.a:.4g}·x^(−{fit.law.b:.4f}) + {fit.law.c:.4f}" + (" (c held at 0)" if fit.law.fixed_c else "")
        lines.append(f"| {labels[fit.model]} | {x_name} | {law} | {fit.law.rmse:.4f} | "
                     + ", ".join(f"{r:+.4f}" for r in fit.residuals) + " |")
    lines += ["", "![loss against size](scaling_params.png)", ""]
    if any(f.x_kind == "tokens" for f in metrics.fits):
        lines += ["![loss against tokens](scaling_tokens.png)", ""]
    lines += ["## Every run", "", "Each model at its best lr at each size and budget (the lrs tried and the final loss "
              "at each).", "",
              "| Model | Size | Steps | Tokens | Best lr | Final val loss | Every lr | Train tokens/s |",
              "|---|---|---:|---:|---:|---:|---|---:|"]
    for p in sorted(metrics.points, key=lambda p: (names.index(p.model), sizes.index(p.size), p.steps)):
        grid = "; ".join(f"{lr:g}: {s.mean:.4f}" if s.mean is not None else f"{lr:g}: –" for lr, s in p.grid.items())
        lines.append(f"| {labels[p.model]} | {p.size} | {p.steps} | {tokens_text(p.tokens)} | {p.lr:g}"
                     f"{' (edge)' if p.at_grid_edge else ''} | {stats_cell(p.final_val_loss)} | {grid} | "
                     f"{stats_cell(p.tokens_per_s, 0)} |")
    edge = [p for p in metrics.points if p.at_grid_edge]
    if edge:
        lines += ["", f"{len(edge)} of {len(metrics.points)} points are best at the edge of their lr grid (marked "
                  "edge): their best lr may lie outside it, and their loss is an upper bound on their best."]
    lines += ["", "## How to read this", "",
              f"- The paper ({metrics.paper['source']}): {metrics.paper['claim']}. Its models are 830M–13.1B "
              "parameters at 10B tokens; these are tiny, so only the direction and the trend can be compared, and a "
              "law fitted to a few small sizes says nothing certain about billions of parameters.",
              "- A matching fraction below 1 means the model needs fewer parameters (or tokens) than the "
              "Transformer for the same loss; an extrapolated one is where the two laws would cross, not a "
              "measurement.", ""]
    return "\n".join(lines)


def _interval(d: Difference) -> str:
    return signed(d.delta) + (f" [{signed(d.low)}, {signed(d.high)}]" if d.low is not None else "")


__all__ = ["ScalingMetrics", "analyse", "matching", "run_scaling", "size_trend", "trend_words"]
