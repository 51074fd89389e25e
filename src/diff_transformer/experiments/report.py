"""The comparison's report: its data (:class:`CompareMetrics`, which metrics.json holds), report.md
and the figures (loss.png, diagnostics.png, retrieval.png, retrieval_curves.png); the claims tables,
the retrieval and grounded experiments' sections, and the small formatting helpers the other
studies' reports share.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..evaluation.stats import Difference, MeanStd, decimals, welch_difference
from ..evaluation.suite import SuiteResult
from ..files import write_atomically, write_text_atomically
from ..paper import PAPER_REFERENCE, PAPER_TABLE6, PAPER_TABLE7_TRAINING
from .claims import NOT_LEARNED, NOT_LEARNED_REASON, Claim, fraction_label, mean_lookback, task_figures
from .config import retrieval_examples_per_step
from .equal_cost import EXPERIMENTS, MEASURES, QUIET_SPREAD, CostReading, EqualCost, Quietness
from .grounded import GroundedResult
from .language_models import Budget, LanguageModelling, Machine, ModelSummary
from .results import json_text
from .retrieval import RetrievalResult, accuracy_stats, examples_to_reach

THROUGHPUT_TARGET = 0.9  # project goal: DIFF trains at >= 0.9x the matched Transformer's tokens/s
PLOT_DPI = 120


@dataclass
class Comparison:
    """A model against the first Transformer of the comparison: loss, throughput, memory, parameters."""

    model: str
    baseline: str
    val_loss_delta: float | None
    val_loss_noise: float | None  # the standard error of the difference over seeds
    paper_val_loss_delta: float | None  # the same rows of the paper's Table 6
    throughput_ratio: float | None
    paper_throughput_ratios: list[float] | None  # DIFF / Transformer in the paper's Table 7
    memory_ratio: float
    extra_parameters: int


def comparisons(models: dict[str, ModelSummary]) -> list[Comparison]:
    """Each model against the first standard-attention one."""
    baseline = next((name for name, m in models.items() if m.attention == "standard"), None)
    if baseline is None:
        return []
    base = models[baseline]
    out = []
    for name, m in models.items():
        if name == baseline:
            continue
        delta = noise = None
        if m.final_val_loss.mean is not None and base.final_val_loss.mean is not None:
            delta = m.final_val_loss.mean - base.final_val_loss.mean
            if m.final_val_loss.std is not None and base.final_val_loss.std is not None:
                noise = (m.final_val_loss.std ** 2 / len(m.final_val_loss.per_seed)
                         + base.final_val_loss.std ** 2 / len(base.final_val_loss.per_seed)) ** 0.5
        paper = None
        if m.paper_table6 and base.paper_table6:
            paper = m.paper_table6["valid"] - base.paper_table6["valid"]
        ratio = m.tokens_per_s.mean / base.tokens_per_s.mean if base.tokens_per_s.mean else None
        out.append(Comparison(
            name, baseline, delta, noise, paper, ratio,
            [row["diff"] / row["transformer"] for row in PAPER_TABLE7_TRAINING] if m.attention == "diff" else None,
            m.peak_memory_bytes / base.peak_memory_bytes, m.parameters - base.parameters))
    return out


@dataclass
class CompareMetrics:
    """Everything the comparison's report shows (metrics.json is its JSON)."""

    config: str
    description: str
    budget_note: str
    lm: LanguageModelling
    machine: Machine
    comparisons: list[Comparison]
    busy_load_average: float | None  # a run's load average when other work shared the CPU (see busy_load_average)
    retrieval: RetrievalResult | None = None
    grounded: GroundedResult | None = None
    claims: list[Claim] = field(default_factory=list)
    variant_comparisons: list[Claim] = field(default_factory=list)
    equal_cost: EqualCost | None = None  # each model against DIFF at equal tokens, FLOPs and time
    wall_seconds: float = 0.0  # both experiments and the evaluations
    phase_seconds: dict[str, float] = field(default_factory=dict)
    paper: dict[str, Any] = field(default_factory=lambda: {
        "reference": PAPER_REFERENCE, "table6": PAPER_TABLE6, "table7_training": PAPER_TABLE7_TRAINING})

    @property
    def models(self) -> dict[str, ModelSummary]:
        return self.lm.models

    @property
    def seeds(self) -> int:
        return len(next(iter(self.models.values())).seeds)


# --- shared formatting --------------------------------------------------------------------------------


def signed(x: float) -> str:
    return "+0" if abs(x) < 1e-12 else f"{x:+.3g}"


def stats_cell(stats: MeanStd | None, digits: int = 4, *, significant: bool = False) -> str:
    """"3.1234 ± 0.0120", or the mean alone with one seed, or – / — when there is nothing."""
    if stats is None:
        return "–"
    if stats.mean is None:
        return "—"
    if significant:  # the claims tables: significant figures
        mean = 0.0 if abs(stats.mean) < 1e-12 else stats.mean  # float rounding of a zero difference
        return f"{mean:.4g}" + (f" ± {stats.std:.2g}" if stats.std is not None else "")
    return f"{stats.mean:,.{digits}f}" + (f" ± {stats.std:,.{digits}f}" if stats.std is not None else "")


def interval_text(d: Difference | None) -> str:
    """"+0.12 [+0.08, +0.16]", or the difference alone without an interval, or – when there is none."""
    if d is None:
        return "–"
    return signed(d.delta) + (f" [{signed(d.low)}, {signed(d.high)}]" if d.low is not None else "")


def along_text(row: Claim, shown: Sequence[float] = (0.125, 0.25, 0.5, 1.0)) -> str:
    """The difference at the measured points nearest to ``shown`` fractions of the budget."""
    points = row.along
    if not points:
        return "–"
    picked = sorted({min(range(len(points)), key=lambda i: abs(points[i].fraction - f)) for f in shown})
    return "; ".join(f"{signed(points[i].difference.delta)} at {fraction_label(points[i].fraction)}"
                     + ("" if points[i].judged else " (not judged)") for i in picked)


def reference_lines(lm: LanguageModelling) -> list[str]:
    """The language models beside their data's trivial baselines, and the rule for judging them."""
    ref = lm.reference
    if ref is None:
        return []
    below = {m.label: ref.bigram - m.final_val_loss.mean for m in lm.models.values()
             if m.final_val_loss.mean is not None}
    learned = all(lm.learned(m.final_val_loss.per_seed) for m in lm.models.values())
    return [
        f"**Trivial baselines.** {ref.text()[0].upper()}{ref.text()[1:]}. A language-model comparison is judged "
        f"only where every model it compares is at least {ref.margin:g} nats/{ref.unit} below the bigram (a loss "
        f"≤ {ref.learned_below:.3f}), along training too; elsewhere it says \"{NOT_LEARNED}\": a model above it "
        "has learned little beyond which token follows which, and its attention is hardly used. Below the bigram "
        "at the end: " + ", ".join(f"{label} {gap:+.3f}" for label, gap in below.items())
        + (" — every model has learned." if learned else " — **not every model has passed it: no language-model "
           "verdict is drawn at the end.**"),
        "",
    ]


def parameters_text(parameters: tuple[int | None, int | None]) -> str:
    """"4,917,696 / 4,916,928": the two measured models' parameters, – where one is not known."""
    return " / ".join("–" if n is None else f"{n:,}" for n in parameters)


def recipes_text(row: Claim) -> str:
    return "; ".join(f"{r} {interval_text(d)}" for r, d in row.by_recipe.items()) or "–"


def render_claims(rows: list[Claim], seeds: int) -> list[str]:
    """The claims table of a report (with the along-training and per-recipe columns when any row has them)."""
    if not rows:
        return []
    dependent = any(row.along or row.by_recipe for row in rows)
    lines = [
        "## The paper's claims at this scale",
        "",
        f"DIFF minus the matched Transformer, each at its own best {'init recipe and ' if dependent else ''}learning "
        f"rate, mean over {seeds} seed{'s' if seeds > 1 else ''}, at the end of the budget; the interval is "
        "Welch's 95% interval of the difference. "
        + ("The same difference along training (at fractions of the budget, each model at its best) and under each "
           "init recipe (both models under it, each at its best lr there) follows. " if dependent else "")
        + "Verdict: **agrees** or **contradicts** when the interval excludes zero on one side, else **inconclusive**"
        + ("; **robust** when that holds under every recipe (two or more) and at every point from 1/4 of the budget "
           "on, else what it **depends on**." if dependent else "."),
        "",
        "| Claim | Measure (better) | Parameters (Transformer / DIFF) | Transformer | DIFF | DIFF − Transformer "
        "[95% CI] | " + ("Along training | Under each recipe | " if dependent else "") + "Paper | Verdict |",
        "|---|---|---:|---:|---:|---:|" + ("---|---|" if dependent else "") + "---|---|",
    ]
    for row in rows:
        verdict_text = row.verdict + (f" ({row.note})" if row.note else "")
        middle = f"{along_text(row)} | {recipes_text(row)} | " if dependent else ""
        lines.append(f"| {row.claim} | {row.measure} ({row.better}) | {parameters_text(row.parameters[::-1])} | "
                     f"{stats_cell(row.base, significant=True)} | "
                     f"{stats_cell(row.ours, significant=True)} | {interval_text(row.difference)} | "
                     f"{middle}{row.paper} | "
                     f"**{verdict_text}** |")
    return lines + [""]


def render_variants(rows: list[Claim], seeds: int) -> list[str]:
    """The table of the attention kinds the paper's claims are not about (DIFF V2, ...)."""
    if not rows:
        return []
    lines = [
        "## The other attention kinds (no claim of the paper applies)",
        "",
        f"Each model against the Transformer and against DIFF, each at its own best init recipe and learning rate, "
        f"mean over {seeds} seed{'s' if seeds > 1 else ''}; difference = model − baseline with Welch's 95% interval. "
        "The paper's claims are about DIFF (V1); the authors' DIFF V2 notes make none of these measurements.",
        "",
        "| Model | Against | Measure (better) | Parameters (model / baseline) | Model | Baseline | Difference "
        "[95% CI] | Along training | Under each recipe | Verdict |",
        "|---|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.model} | {row.baseline} | {row.measure} ({row.better}) | "
                     f"{parameters_text(row.parameters)} | {stats_cell(row.ours, significant=True)} | "
                     f"{stats_cell(row.base, significant=True)} | "
                     f"{interval_text(row.difference)} | {along_text(row)} | {recipes_text(row)} | **{row.verdict}** |")
    return lines + [""]


def save_plot(fig, path: Path) -> Path:
    """Write a pyplot figure as a PNG, atomically, and close it."""
    import matplotlib.pyplot as plt

    try:
        return write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=PLOT_DPI, format="png"))
    finally:
        plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axes(ax, xlabel: str, ylabel: str, title: str | None = None, legend_size: float | None = None) -> None:
    """An axes' labels, title, grid and legend, as every figure of the reports draws them."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend_size is not None:
        ax.legend(fontsize=legend_size)


def heading_lines(title: str, description: str) -> list[str]:
    """A report's title and the config's description under it."""
    return [f"# {title}", ""] + ([description + ".", ""] if description else [])


def budget_lines(note: str) -> list[str]:
    """Why the budget is what it is (compare.budget_note), when the config says."""
    return [f"**The budget.** {note}", ""] if note else []


def evaluation_intro() -> str:
    """The heading of the evaluation sections a report appends."""
    return ("## Evaluations of the paper\n\nEach evaluation ran on the final model of every seed (rows \"NAME sK\"); "
            "the claims table above gives their mean ± std. Our models are small and CPU-trained, the paper's 3B / "
            "1.4B: only the direction of a difference can be compared. JSON and plots: eval/.")


def write_study(out_dir: Path, metrics: Any, report: str, suite: SuiteResult | None = None,
                intro: str | None = None) -> None:
    """A study's metrics.json and report.md (the evaluation suite's sections appended when it ran,
    under ``intro``, by default :func:`evaluation_intro`)."""
    if suite is not None:
        report += "\n" + (intro or evaluation_intro()) + "\n\n" + suite.markdown(relative_to=out_dir, heading="###")
    write_text_atomically(out_dir / "metrics.json", json_text(metrics))
    write_text_atomically(out_dir / "report.md", report)


def tokens_text(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def count_text(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# --- plots ---------------------------------------------------------------------------------------------


def write_plots(metrics: CompareMetrics, out_dir: Path) -> list[Path]:
    """DIR/loss.png (training and validation loss of every model against tokens), diagnostics.png, and
    the retrieval experiment's retrieval.png and retrieval_curves.png."""
    plt = pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for m in metrics.models.values():
        label = f"{m.label} ({m.attention})"
        color = None
        if m.train_curve.step:
            (line,) = ax_train.plot([t / 1e6 for t in m.train_curve.tokens], m.train_curve.mean(), label=label)
            color = line.get_color()
        val = m.val_curve
        if val.step:
            mean = val.mean()
            millions = [t / 1e6 for t in val.tokens]
            ax_val.plot(millions, mean, marker="o", markersize=3, label=label, color=color)
            if len(val.values) > 1:
                std = [statistics.stdev(v) for v in zip(*val.values)]
                ax_val.fill_between(millions, [a - s for a, s in zip(mean, std)], [a + s for a, s in zip(mean, std)],
                                    color=color, alpha=0.2)
    reference = metrics.lm.reference
    if reference is not None:  # the trivial baselines, beside every curve
        for ax in (ax_train, ax_val):
            for value, name in ((reference.unigram, "unigram"), (reference.bigram, "bigram")):
                ax.axhline(value, color="grey", linestyle="--", linewidth=0.8)
                ax.annotate(f"{name} {value:.2f}", (0, value), xycoords=("axes fraction", "data"), fontsize=7,
                            color="grey", va="bottom")
    unit = reference.unit if reference else "token"
    ax_train.set_title("training loss (mean over each logging interval)")
    ax_val.set_title("validation loss" + (f" (mean ± std over {metrics.seeds} seeds)" if metrics.seeds > 1 else ""))
    for ax in (ax_train, ax_val):
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel(f"cross-entropy (nats/{unit})")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:  # a run without curves (test fixtures) draws none
            ax.legend()
    budget = {"steps": "token", "tokens": "token", "flops": "FLOPs", "seconds": "time"}[metrics.lm.budget.kind]
    fig.suptitle(f"{metrics.config}: same data, seed and {budget} budget")
    fig.tight_layout()
    paths = [save_plot(fig, out_dir / "loss.png")] + write_diagnostics_plot(metrics, out_dir / "diagnostics.png")
    if metrics.retrieval is not None:
        paths.append(_retrieval_plot(metrics.retrieval, out_dir / "retrieval.png"))
        paths.append(_learning_curves_plot(metrics.retrieval, out_dir / "retrieval_curves.png"))
    return paths


def write_diagnostics_plot(metrics: CompareMetrics, path: Path) -> list[Path]:
    """PATH: λ per layer over training for the models that have one (left) and the RMS of every
    model's attention branch per layer (right), each the mean over seeds; colour = model, line
    style = layer. [] where no run logged diagnostics."""
    models = [m for m in metrics.models.values() if m.diagnostics is not None]
    if not models:
        return []
    plt = pyplot()
    styles = ["-", "--", "-.", ":"]
    fig, (ax_lambda, ax_rms) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    layers = 0
    for index, m in enumerate(models):
        curves, color = m.diagnostics, f"C{index}"
        millions = [t / 1e6 for t in curves.tokens]
        for ax, per_seed in ((ax_lambda, curves.lambdas), (ax_rms, curves.attn_rms)):
            if per_seed is None:  # [seed][step][layer]
                continue
            n_layers = len(per_seed[0][0])
            layers = max(layers, n_layers)
            for layer in range(n_layers):
                mean = [statistics.fmean(seed[s][layer] for seed in per_seed) for s in range(len(millions))]
                ax.plot(millions, mean, color=color, linestyle=styles[layer % len(styles)], linewidth=1.4,
                        label=m.label if layer == 0 else None)
    for layer in range(layers):  # the legend of the line styles
        ax_rms.plot([], [], color="grey", linestyle=styles[layer % len(styles)], label=f"layer {layer}")
    seeds = len(models[0].seeds)
    ax_lambda.set_title("λ per layer" + (f" (mean over {seeds} seeds)" if seeds > 1 else ""))
    ax_lambda.set_ylabel("λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init")
    ax_rms.set_title("RMS of the attention branch per layer")
    ax_rms.set_ylabel("RMS of the attention output")
    for ax in (ax_lambda, ax_rms):
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{metrics.config}: diagnostics during training (one fixed validation window)")
    fig.tight_layout()
    return [save_plot(fig, path)]


def _learning_curves_plot(retrieval: RetrievalResult, path: Path) -> Path:
    """Accuracy against the examples of each task seen, every model under every recipe (each at its
    best lr there; line style = recipe), mean ± std over seeds."""
    plt = pyplot()
    settings = retrieval.settings
    per_step = retrieval_examples_per_step(settings.batch_size)
    styles = ["-", "--", "-.", ":"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, m in enumerate(retrieval.models.values()):
        for style, recipe in zip(styles, m.sweep.runs):
            runs = m.sweep.at(recipe)
            for ax, task in zip(axes, ("needle", "mqar")):
                xs = [p.step * per_step[task] for p in runs[0].curve]
                mean, std = zip(*(mean_and_std([r.curve[i].mean_accuracy[task] for r in runs]) for i in range(len(xs))))
                label = m.label + (f", {recipe}" if recipe else "") + f" (lr {m.sweep.best_lr[recipe]:g})"
                ax.plot(xs, mean, linestyle=style, marker="o", markersize=3, color=f"C{index}", label=label)
                ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                color=f"C{index}", alpha=0.12)
    for ax, task in zip(axes, ("needle", "mqar")):
        ax.axhline(retrieval.chance, color="grey", linestyle=":", label="chance")
        ax.axhline(settings.target_accuracy, color="grey", linestyle="--", linewidth=0.8,
                   label=f"target {settings.target_accuracy:g}")
        ax.set_title(f"{task}: accuracy along training (mean over difficulty cells)")
        ax.set_xlabel(f"{task} examples seen in training")
        ax.set_ylabel("answer accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    seeds = len(next(iter(retrieval.models.values())).runs)
    fig.suptitle(f"retrieval learning curves: mean ± std over {seeds} seed{'s' if seeds > 1 else ''}")
    fig.tight_layout()
    return save_plot(fig, path)


def _retrieval_plot(retrieval: RetrievalResult, path: Path) -> Path:
    """Accuracy against difficulty (needles N, averaged over depths; mqar pairs D), mean ± std over seeds."""
    plt = pyplot()
    settings = retrieval.settings
    fig, (ax_needle, ax_mqar) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in retrieval.models.values():
        runs = m.runs
        needle = [[statistics.fmean(r.accuracy["needle"][f"N={n},depth={d:g}"] for d in settings.depths)
                   for r in runs] for n in settings.needles]
        mqar = [[r.accuracy["mqar"][f"D={p}"] for r in runs] for p in settings.pairs]
        for ax, xs, values in ((ax_needle, settings.needles, needle), (ax_mqar, settings.pairs, mqar)):
            means, stds = zip(*(mean_and_std(v) for v in values))
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=f"{m.label} (lr {m.sweep.lr:g})")
    for ax, title, xlabel in ((ax_needle, "multi-needle: accuracy vs needles (N − 1 distractors)", "needles N"),
                              (ax_mqar, "MQAR: accuracy vs key-value pairs", "pairs D")):
        ax.axhline(retrieval.chance, color="grey", linestyle=":", label="chance")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("answer accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    seeds = len(next(iter(retrieval.models.values())).runs)
    fig.suptitle(f"retrieval experiment: mean ± std over {seeds} seed{'s' if seeds > 1 else ''}")
    fig.tight_layout()
    return save_plot(fig, path)


# --- report.md -------------------------------------------------------------------------------------------


def _jobs_text(jobs: int) -> str:
    return f"; {jobs} runs at a time, each on cores / {jobs} threads" if jobs > 1 else ""


def _speed_cell(stats: MeanStd) -> str:
    return stats_cell(stats, 0)


def _verdict(c: Comparison, label: str, base_label: str, seeds: int, lm: LanguageModelling) -> str:
    delta, noise, paper = c.val_loss_delta, c.val_loss_noise, c.paper_val_loss_delta
    if delta is None:
        return f"- {label}: no final validation loss (see the run status)."
    direction = "lower (better)" if delta < 0 else "higher (worse)"
    places = decimals(delta, noise, at_least=4)  # the difference and its noise both visible
    unit = lm.reference.unit if lm.reference else "token"
    text = f"- **{label} vs {base_label}, validation loss**: {delta:+.{places}f} nats/{unit} here, {direction}"
    if paper is not None:
        text += f"; the paper's 1.4B models (Table 6): {paper:+.3f}."
    else:
        text += "; the paper has no figure for this model."
    if not all(lm.learned(lm.models[n].final_val_loss.per_seed) for n in (c.model, c.baseline)):
        return text + f" **Not judged**: {NOT_LEARNED_REASON} ({lm.reference.text()})."
    if noise is not None and abs(delta) <= 2 * noise:
        text += (f" The difference is within twice the standard error over {seeds} seeds (±{noise:.{places}f}): "
                 "at this scale the run shows no difference either way.")
    elif paper is not None and (delta < 0) != (paper < 0):
        text += (f" **This contradicts the paper at this scale**: here {label} is {direction}"
                 + (f", beyond twice the standard error over {seeds} seeds (±{noise:.4f})." if noise is not None
                    else "; with one seed the seed-to-seed noise is unknown (run more --seeds to tell)."))
    elif paper is not None:
        text += " Same direction as the paper" + (
            f", beyond twice the standard error over {seeds} seeds (±{noise:.4f})." if noise is not None
            else "; with one seed the seed-to-seed noise is unknown (run more --seeds to tell).")
    return text


def _sweep_lines(lm: LanguageModelling) -> list[str]:
    """The search table: final validation loss (mean ± std over seeds) per model, recipe and lr."""
    models = lm.models
    grid = sorted({lr for s in lm.sweeps.values() for by_lr in s.scores.values() for lr in by_lr})
    rows = [(name, recipe) for name, s in lm.sweeps.items() for recipe in s.scores]
    if len(grid) < 2 and len(rows) == len(lm.sweeps):
        return ["Peak learning rates: " + "; ".join(f"{models[name].label} {s.lr:g}" for name, s in lm.sweeps.items())
                + " (one per model; `--lr-grid` runs a sweep and reports each at its own best).", ""]
    lines = ["### The search (final validation loss; each model's best in bold)", "",
             "| Model | Parameters | Init recipe | " + " | ".join(f"lr {lr:g}" for lr in grid) + " |",
             "|---|---:|---|" + "---:|" * len(grid)]
    for name, recipe in rows:
        s = lm.sweeps[name]
        cells = []
        for lr in grid:
            stats, diverged = s.scores[recipe].get(lr), s.missing[recipe].get(lr, 0)
            cell = "—" if stats is None or stats.mean is None else stats_cell(stats)
            if diverged:
                cell += f" ({diverged} diverged)"
            cells.append(f"**{cell}**" if lr == s.lr and recipe == s.best_recipe else cell)
        lines.append(f"| {models[name].label} | {models[name].parameters:,} | {recipe or 'as configured'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Every model ran every learning rate of its grid under every recipe with the same warmup, "
              "schedule, data and seeds; each is reported at its own best. A grid of one lr per model is the "
              "shipped result of a sweep (`--lr-grid` reruns it)."]
    edge = [f"{models[name].label} ({s.lr:g})" for name, s in lm.sweeps.items()
            if len(tried := s.scores[s.best_recipe]) > 1 and s.lr in (min(tried), max(tried))]
    if edge:
        lines.append(f"Best at an end of the grid: {', '.join(edge)}. Their optimum may lie outside it, and their "
                     "loss is an upper bound on their best.")
    return lines + [""]


def sensitivity_lines(metrics: CompareMetrics) -> list[str]:
    """The init-recipe sensitivity table: under each recipe, every model at its best lr there, and the
    differences against the Transformer and DIFF with their intervals."""
    models = metrics.models
    names = list(models)
    base = next((n for n in names if models[n].attention == "standard"), None)
    diff = next((n for n in names if models[n].attention == "diff"), None)
    entries = task_figures(metrics.lm, metrics.retrieval, names, metrics.grounded)
    recipes = list(dict.fromkeys(r for e in entries for f in e.figures.values() for r in f.by_recipe))
    if not recipes or base is None:
        return []
    others = [n for n in names if n != base]
    header = ["Task (better)", "Init recipe", *(models[n].label for n in names),
              *(f"{models[n].label} − {models[base].label}" for n in others)]
    if diff is not None:
        header += [f"{models[n].label} − {models[diff].label}" for n in others if n != diff]
    lines = ["## Sensitivity to the init recipe", "",
             "Every model under each shared init recipe, each at its best learning rate there (mean ± std over seeds); "
             "differences with Welch's 95% interval. `scaled-init`: o_proj and down_proj at init_std/√(2·layers), "
             "as the authors' code and GPT-2; `plain-init`: every matrix N(0, init_std), as transformers' Llama and "
             "DiffLlama.",
             "", "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for entry in entries:
        rows = []
        for recipe in recipes:
            values = {n: entry.figures[n].by_recipe.get(recipe) for n in names}
            if any(v is None for v in values.values()):
                continue
            cells = [stats_cell(MeanStd.of(values[n])) for n in names]
            cells += [interval_text(welch_difference(values[n], values[base])) for n in others]
            if diff is not None:
                cells += [interval_text(welch_difference(values[n], values[diff])) for n in others if n != diff]
            rows.append(f"| {entry.task} ({entry.better}) | {recipe} | " + " | ".join(cells) + " |")
        if rows:  # the models measured, then their figures
            counts = ["–" if entry.figures[n].parameters is None else f"{entry.figures[n].parameters:,}" for n in names]
            lines.append(f"| {entry.task} | parameters | " + " | ".join(counts + [""] * (len(header) - 2 - len(names)))
                         + " |")
            lines += rows
    return lines + [""]


def sample_efficiency_lines(metrics: CompareMetrics) -> list[str]:
    """How much training each model needs: for language modelling, the tokens the better model
    needs to reach the other's final loss; for retrieval, the examples to reach the target accuracy."""
    models = metrics.models
    names = list(models)
    base = next((n for n in names if models[n].attention == "standard"), None)
    lines = ["## Sample efficiency", ""]
    if base is not None:
        lines += ["Language modelling (each model at its best): the tokens each needs to reach another's final "
                  "validation loss (linear between evaluations; the paper: DIFF matches the Transformer with ~64% of "
                  "the tokens, Fig. 3).", ""]
        for name in names:
            if name == base:
                continue
            for fast, slow in ((name, base), (base, name)):
                # a budget in FLOPs or seconds: each model's own tokens
                own = metrics.lm.budget.kind != "steps"
                budget = models[fast].tokens if own else metrics.lm.budget.tokens_per_model
                target = models[slow].final_val_loss.mean
                val = models[fast].val_curve
                curve = [(t, -loss) for t, loss in zip(val.tokens, val.mean())]  # rising, as examples_to_reach reads
                tokens = examples_to_reach(curve, -target) if curve and target is not None else None
                first = curve[0][0] if curve else 0
                reaches = f"{models[fast].label} reaches {models[slow].label}'s final loss ({target:.4f})"
                if tokens is None:
                    text = f"{models[fast].label} does not reach {models[slow].label}'s final loss ({target:.4f}) " \
                           "within the budget"
                elif tokens <= first:
                    text = (f"{reaches} by its first evaluation ({first:,.0f} tokens, "
                            f"{first / budget:.0%} of the budget)")
                else:
                    text = f"{reaches} after {tokens:,.0f} tokens ({tokens / budget:.0%} of the budget)"
                lines.append(f"- {text}.")
        lines.append("")
    retrieval = metrics.retrieval
    if retrieval is not None:
        settings = retrieval.settings
        target = settings.target_accuracy
        per_step = retrieval_examples_per_step(settings.batch_size)
        lines += [f"Retrieval: the examples of each task a model needs to reach accuracy {target:g} (its mean curve "
                  "over seeds, linear between measurements), under each recipe at its best lr there; "
                  f"the budget is {settings.steps * per_step['needle']:,} needle and "
                  f"{settings.steps * per_step['mqar']:,} MQAR examples.", "",
                  "| Model | Parameters | Init recipe | needle | mqar |", "|---|---:|---|---:|---:|"]
        for m in retrieval.models.values():
            for recipe in m.sweep.runs:
                runs = m.sweep.at(recipe)
                cells = []
                for task in ("needle", "mqar"):
                    curve = [(p.step * per_step[task], statistics.fmean(r.curve[i].mean_accuracy[task] for r in runs))
                             for i, p in enumerate(runs[0].curve)]
                    reached = examples_to_reach(curve, target)
                    cells.append("not within the budget" if reached is None else f"{reached:,.0f}")
                lines.append(f"| {m.label} | {m.parameters:,} | {recipe or 'as configured'} | " + " | ".join(cells)
                             + " |")
        lines.append("")
    return lines if len(lines) > 2 else []


def learning_curve_lines(retrieval: RetrievalResult) -> list[str]:
    """The retrieval models' accuracy along training (each at its best), by task."""
    settings, models = retrieval.settings, retrieval.models
    per_step = retrieval_examples_per_step(settings.batch_size)
    steps = [p.step for p in next(iter(models.values())).runs[0].curve]
    lines = ["### Learning curves", "",
             "Accuracy (mean over the difficulty cells, mean ± std over seeds) after each number of training steps, "
             f"each model at its best recipe and lr; a step is {per_step['needle']} needle and {per_step['mqar']} "
             "MQAR examples.",
             "", "| Task | Model | Parameters | " + " | ".join(f"step {s:,}" for s in steps) + " |",
             "|---|---|---:|" + "---:|" * len(steps)]
    for task in ("needle", "mqar"):
        for m in models.values():
            cells = [stats_cell(MeanStd.of(r.curve[i].mean_accuracy[task] for r in m.runs)) for i in range(len(steps))]
            lines.append(f"| {task} | {m.label} ({m.sweep.best_recipe or 'as configured'}, lr {m.sweep.lr:g}) | "
                         f"{m.parameters:,} | " + " | ".join(cells) + " |")
    return lines + ["", "![retrieval learning curves](retrieval_curves.png)", ""]


def retrieval_lines(retrieval: RetrievalResult | None) -> list[str]:
    """The retrieval experiment: accuracy by difficulty and the attention allocation, mean ± std."""
    if retrieval is None:
        return []
    settings, models = retrieval.settings, retrieval.models
    seeds = len(next(iter(models.values())).runs)
    best_lrs = ", ".join(f"{m.label} {(m.sweep.best_recipe or '') + ' '}lr {m.sweep.lr:g}".replace("  ", " ")
                         for m in models.values())
    lines = [
        "## Retrieval experiment",
        "",
        f"Models of {settings.n_layers} layers, d_model {settings.d_model} "
        f"(DIFF {count_text(settings.n_heads, 'head')}, the Transformer {2 * settings.n_heads} of the same width; a "
        f"model's small_model fields may set its own: the parameters row), trained for {settings.steps} steps × "
        f"{settings.batch_size} "
        f"generated examples of {settings.length} tokens ({tokens_text(retrieval.tokens_per_model)} tokens, the same "
        f"batches for every model) on a {settings.task.vocab_size}-token "
        f"symbolic vocabulary; accuracy is exact-match on the answer tokens (chance {retrieval.chance:.3f}), "
        f"mean ± std over {seeds} seed{'s' if seeds > 1 else ''}, each model at its best "
        f"{'init recipe and ' if retrieval.recipes else ''}learning rate ({best_lrs}).",
        "",
        "| Task | Difficulty | " + " | ".join(m.label for m in models.values()) + " |",
        "|---|---|" + "---:|" * len(models),
        "| parameters | | " + " | ".join(f"{m.parameters:,}" for m in models.values()) + " |",
    ]
    for n in settings.needles:
        cells = [stats_cell(MeanStd.of(statistics.fmean(r.accuracy["needle"][f"N={n},depth={d:g}"]
                                                        for d in settings.depths)
                                       for r in m.runs)) for m in models.values()]
        lines.append(f"| needle | N = {n} ({n - 1} distractor{'s' if n != 2 else ''}), all depths | "
                     + " | ".join(cells) + " |")
    hardest = max(settings.needles)
    for d in settings.depths:
        cells = [stats_cell(accuracy_stats(m.runs, "needle", f"N={hardest},depth={d:g}")) for m in models.values()]
        lines.append(f"| needle | N = {hardest}, answer depth {d:.0%} | " + " | ".join(cells) + " |")
    for p in settings.pairs:
        cells = [stats_cell(accuracy_stats(m.runs, "mqar", f"D={p}")) for m in models.values()]
        lines.append(f"| mqar | D = {p} pairs | " + " | ".join(cells) + " |")
    for bits in ["full", *map(str, settings.quantize_bits)]:
        cells = [stats_cell(MeanStd.of(r.quantized_accuracy[bits] for r in m.runs)) for m in models.values()]
        label = "full precision" if bits == "full" else f"{bits}-bit"
        lines.append(f"| hardest cells | attention logits at {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Where the answer row looks (N = {hardest} needles, every depth; head mean, divided by the row sum "
              "so each row adds to 1; paper Table 3 for 3B models: Transformer .03–.09 on the answer and ~.5 on "
              "noise, DIFF .27–.40 and ~.02):", "",
              "| Model | Parameters | Layer | on the answer | on noise | other |", "|---|---:|---:|---:|---:|---:|"]
    for m in models.values():
        for layer in range(len(m.runs[0].attention)):
            shares = [r.attention[layer] for r in m.runs]
            if any(s is None for s in shares):
                lines.append(f"| {m.label} | {m.parameters:,} | {layer} | row sum < 0.05 (λ near 1) | | |")
                continue
            cells = [stats_cell(MeanStd.of(getattr(s, g) for s in shares)) for g in ("answer", "noise", "other")]
            lines.append(f"| {m.label} | {m.parameters:,} | {layer} | " + " | ".join(cells) + " |")
    lines += ["", "![retrieval accuracy by difficulty](retrieval.png)", ""]
    return lines + learning_curve_lines(retrieval)


# The grounded experiment's scores as the report shows them: (label, GroundedScores field, better).
GROUNDED_SCORES = (
    ("grounded accuracy", "accuracy", "higher"),
    ("faithful accuracy (the document's attribute, agree and counterfactual)", "faithful", "higher"),
    ("prior override (counterfactual: the memorised attribute)", "prior_override", "lower"),
    ("fabrication (neither the document's nor the memorised attribute, nor UNKNOWN)", "fabrication", "lower"),
    ("correct abstention (lacking: UNKNOWN)", "abstention", "higher"),
    ("closed-book recall of the memorised facts", "recall", "higher"),
)


def grounded_lines(grounded: GroundedResult | None) -> list[str]:
    """The grounded experiment: every score and the lookback ratio, mean ± std over seeds, each model at
    its best; DIFF − Transformer with Welch's interval; what the answers were, per condition; the
    grounded accuracy along training."""
    if grounded is None:
        return []
    settings, models = grounded.settings, grounded.models
    seeds = len(next(iter(models.values())).runs)
    names = list(models)
    base = next((n for n in names if models[n].attention == "standard"), None)
    diff = next((n for n in names if models[n].attention == "diff"), None)
    pair = base is not None and diff is not None
    best = ", ".join(f"{m.label} {(m.sweep.best_recipe or '') + ' '}lr {m.sweep.lr:g}".replace("  ", " ")
                     for m in models.values())
    episodes = settings.batch_size - settings.closed_book
    end = next(iter(models.values())).runs[0].scores.outcomes
    lines = [
        "## Contextual hallucination experiment",
        "",
        f"Models of {settings.n_layers} layers, d_model {settings.d_model} "
        f"(DIFF {count_text(settings.n_heads, 'head')}, the others {2 * settings.n_heads} of the same width; a model's "
        f"small_model fields may set its own: the parameters row), trained for "
        f"{settings.steps} steps × {settings.batch_size} generated examples of {settings.length} tokens "
        f"({tokens_text(grounded.tokens_per_model)} tokens; the same batches for every model) with the retrieval "
        f"experiment's optimizer: {count_text(settings.closed_book, 'closed-book example')} a step teach "
        f"{settings.entities} facts (entity → one of {settings.attributes} attributes), {episodes} episodes a "
        f"step give a document of {settings.context_facts} facts among noise tokens, each agreeing with memory with "
        f"probability {settings.agree_share:g}, then {settings.questions} questions, each about an entity the "
        f"document states with probability {settings.answerable_share:g} (else UNKNOWN is the answer). Scored on "
        f"{settings.eval_episodes} held-out episodes ({end['agree'].count} agreeing, {end['counterfactual'].count} "
        f"counterfactual and {end['lacking'].count} lacking questions) by the argmax over the whole vocabulary; "
        f"mean ± std over {seeds} seed{'s' if seeds > 1 else ''}, each model at its best "
        f"{'init recipe and ' if grounded.recipes else ''}learning rate by grounded accuracy ({best}). Paper Table 4 "
        "(GPT-4o-judged summaries and answers of 3B models): DIFF ahead by 0.07–0.19 of accuracy.",
        "",
        "| Score (better) | " + " | ".join(m.label for m in models.values())
        + (f" | {models[diff].label} − {models[base].label} [95% CI]" if pair else "") + " |",
        "|---|" + "---:|" * (len(models) + pair),
        "| parameters | " + " | ".join(f"{m.parameters:,}" for m in models.values()) + (" | |" if pair else " |"),
    ]

    def row(label: str, better: str, per_model: dict[str, list[float]]) -> str:
        cells = [stats_cell(MeanStd.of(v), 3) for v in per_model.values()]
        if pair:
            cells.append(interval_text(welch_difference(per_model[diff], per_model[base])))
        return f"| {label} ({better}) | " + " | ".join(cells) + " |"

    for label, key, better in GROUNDED_SCORES:
        lines.append(row(label, better, {n: [getattr(r.scores, key) for r in m.runs] for n, m in models.items()}))
    lines.append(row("lookback ratio, mean over layers", "neither",
                     {n: [mean_lookback(r.lookback) for r in m.runs] for n, m in models.items()}))
    layers = max(len(m.runs[0].lookback) for m in models.values())
    for layer in range(layers):
        for what, better, value in (("lookback ratio", "neither", lambda r, i=layer: r.lookback[i]),
                                    ("lookback AUROC, right vs wrong answers", "0.5: no separation",
                                     lambda r, i=layer: r.lookback_auroc[i])):
            per_model = {n: [v for r in m.runs if layer < len(r.lookback) and (v := value(r)) is not None]
                         for n, m in models.items()}
            if all(per_model.values()):
                lines.append(row(f"{what}, layer {layer}", better, per_model))
    lines += ["", "What the answers were (shares per condition, mean over seeds): the document's attribute of the "
              "entity, its memorised one (where different), UNKNOWN, an attribute the document gives another entity, "
              "anything else.", "",
              "| Model | Parameters | Condition | document | memory | UNKNOWN | misattributed | invented |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]
    for m in models.values():
        for condition in ("agree", "counterfactual", "lacking", "closed_book"):
            shares = [statistics.fmean(getattr(r.scores.outcomes[condition], k) for r in m.runs)
                      for k in ("document", "memory", "unknown", "misattributed", "invented")]
            lines.append(f"| {m.label} | {m.parameters:,} | {condition.replace('_', ' ')} | "
                         + " | ".join(f"{v:.3f}" for v in shares)
                         + " |")
    steps = [p.step for p in next(iter(models.values())).runs[0].curve]
    lines += ["", f"Grounded accuracy along training (mean ± std over seeds; a step is {episodes} episodes):", "",
              "| Model | Parameters | " + " | ".join(f"step {s:,}" for s in steps) + " |",
              "|---|---:|" + "---:|" * len(steps)]
    for m in models.values():
        cells = [stats_cell(MeanStd.of(r.curve[i].scores.accuracy for r in m.runs), 3) for i in range(len(steps))]
        lines.append(f"| {m.label} | {m.parameters:,} | " + " | ".join(cells) + " |")
    lines += ["", "The lookback ratio (Chuang et al. 2024) of an answer: at the row that answers, the mean |attention| "
              "per token on the context (everything before the question's ASK) over that plus the mean on the new "
              "tokens (ASK and the entity), on the effective map (p1 − λ·p2 for DIFF; |A| because it is signed). "
              "Lookback Lens reads it within one model, as a detector of unsupported answers; between models with "
              "different maps neither side is better. Its AUROC: how well the head-mean ratio of a layer separates "
              "right answers from wrong ones (0.5: not at all). docs/evaluation.md, \"context-qa\", has the "
              "definition.", ""]
    return lines


def diagnostics_lines(metrics: CompareMetrics) -> list[str]:
    """The report's pointer to diagnostics.png, if it was drawn."""
    if not any(m.diagnostics for m in metrics.models.values()):
        return []
    return ["λ per layer (the models that have one) and the RMS of each layer's attention branch during training "
            "(run.diagnostics; every run's metrics.jsonl has them, with the negative share of the differential maps):",
            "", "![λ and attention-branch RMS per layer](diagnostics.png)", ""]


# What a study's budget counts, as the report names it.
BUDGET_NAMES = {
    "steps": "equal tokens (run.steps; every model the same steps of the same batches)",
    "tokens": "equal tokens (run.budget in tokens)",
    "flops": "equal training FLOPs (run.budget in FLOPs: each model its own number of steps)",
    "seconds": "equal training time on this machine (run.budget in seconds: each model as many steps as fit)",
}
MEASURE_NAMES = {"tokens": "tokens", "flops": "training FLOPs", "seconds": "training seconds"}


def flops_text(flops: float | None) -> str:
    """"2.31e+13", or — for a kind the FLOPs formula has no term for."""
    return "—" if flops is None else f"{flops:.3g}"


def budget_sentence(budget: Budget, models: dict[str, ModelSummary]) -> str:
    """How long every model trained: the steps and tokens, or the budget and each model's steps."""
    shape = f"{budget.batch_size} sequences × {budget.seq_len} tokens"
    if budget.kind == "steps":
        return (f"Every model trained for {budget.steps} steps × {shape} = {tokens_text(budget.tokens_per_model)} "
                "tokens")
    amount = (tokens_text(int(budget.amount)) if budget.kind == "tokens" else f"{budget.amount:g}"
              if budget.kind == "seconds" else f"{budget.amount:.3g}")
    steps = ", ".join(f"{m.label} {m.steps if m.steps is not None else '—'}" for m in models.values())
    return (f"Every model trained until it had spent a budget of {amount} {MEASURE_NAMES[budget.kind]} "
            f"(run.budget), in steps of {shape} (steps: {steps})")


def quietness_text(name: str, q: Quietness | None) -> str:
    """How quiet the machine was during one experiment, and whether the time verdicts are given."""
    if q is None:
        return f"{name}: not measured."
    if q.spread is None:
        return f"{name}: one run of {q.reference}, so how steady the machine was is unknown; time not judged."
    verdict = ("quiet enough to compare at equal time" if q.quiet
               else "**not quiet enough**: the verdicts at equal time are not judged")
    return (f"{name}: {q.reference}'s {q.runs} runs (the same work each) trained at {q.tokens_per_s.mean:,.0f} ± "
            f"{q.tokens_per_s.std:,.0f} tokens/s, a spread of {q.spread:.1%} (limit {QUIET_SPREAD:.0%}): {verdict}.")


def _cost_cell(r: CostReading, digits: int = 3) -> str:
    if r.difference is None:
        return r.verdict
    read = "" if r.at is None else f" (read at {r.at:,.0f} s)" if r.measure == "seconds" \
        else f" (read at {tokens_text(int(r.at))})" if r.measure == "tokens" else f" (read at {r.at:.3g})"
    return f"{interval_text(r.difference)} **{r.verdict}**{read}"


COST_HEADINGS = {"tokens": "At equal tokens", "flops": "At equal training FLOPs", "seconds": "At equal training time"}
END_ONLY = "measured at the end only"


def equal_cost_lines(result: EqualCost | None, seeds: int) -> list[str]:
    """The verdicts at equal cost, the paper's table of each model against DIFF: at equal tokens, equal
    FLOPs and equal time a table each, a row per model with its parameters, a column per task."""
    if result is None or not result.rows:
        return []
    tasks = list(dict.fromkeys((r.task, r.measure, r.better) for r in result.rows))
    models = list(dict.fromkeys(r.model for r in result.rows))
    baseline = result.rows[0].baseline
    rows = {(r.model, r.task, r.measure): r for r in result.rows}
    experiments = [e for e in EXPERIMENTS if any(r.experiment == e for r in result.rows)]
    names = [t for t, _, _ in tasks]
    headers = {(t, m, b): (f"{t}: {m}" if names.count(t) > 1 else t) + f" ({b})" for t, m, b in tasks}

    def parameters(model: str, side: int) -> str:
        per = {}
        for r in result.rows:
            if r.model == model:
                per.setdefault(r.experiment, r.parameters[side])
        return " · ".join("—" if per.get(e) is None else f"{per[e]:,}" for e in experiments)

    lines = [
        "## Verdicts at equal cost",
        "",
        f"Each model against {baseline}, model − {baseline} (mean over {seeds} seed{'s' if seeds > 1 else ''}, Welch's "
        f"95% interval), at equal tokens, equal training FLOPs (diff_transformer.flops) and equal training time: a "
        f"table each, with every model's parameters in each experiment ({' · '.join(experiments)}). The language "
        f"models trained to {BUDGET_NAMES[result.budget]}, the retrieval and grounded models to equal tokens (their "
        f"steps): there the figures are the runs' final ones, and {baseline}'s row gives its own. At the other costs "
        f"each model's figure is read off its own curve (validation loss at each evaluation; the retrieval and "
        f"grounded scores along their learning curves), linearly between points, at the least that either model's "
        f"runs spent (\"read at\"): the same runs, no extra training. A model read before its end had not finished its "
        f"learning-rate decay there, so the reading is conservative for the model that spent more. The evaluations "
        f"of the language models measure each at the end of its budget only.",
        "",
    ]
    for index, measure in enumerate(MEASURES):
        shown = [t for t in tasks if any(rows[m, t[0], t[1]].readings[index].verdict != END_ONLY for m in models)]
        readings = [rows[m, t[0], t[1]].readings[index] for m in models for t in shown]
        lines += [f"### {COST_HEADINGS[measure]}", ""]
        if all(r.difference is None for r in readings) and len({r.verdict for r in readings}) == 1:
            lines += [f"{readings[0].verdict[0].upper()}{readings[0].verdict[1:]}.", ""]
            continue
        lines += ["| Model | Parameters | " + " | ".join(headers[t] for t in shown) + " |",
                  "|---|---:|" + "---|" * len(shown)]
        own = []
        for t in shown:
            first = rows[models[0], t[0], t[1]].readings[index]
            own.append(stats_cell(MeanStd.of(first.base), significant=True) if first.at is None and first.base else "–")
        lines.append(f"| {baseline} | {parameters(models[0], 1)} | " + " | ".join(own) + " |")
        for m in models:
            cells = [_cost_cell(rows[m, t[0], t[1]].readings[index]) for t in shown]
            lines.append(f"| {m} | {parameters(m, 0)} | " + " | ".join(cells) + " |")
        left = [headers[t] for t in tasks if t not in shown]
        if left:
            lines.append("")
            lines.append(f"Measured at the end of training only (at the budget's measure): {', '.join(left)}.")
        lines.append("")
    lines += ["What each column measures:", ""]
    lines += [f"- {headers[t]}: {t[1]}." for t in tasks]
    lines += ["", "How quiet the machine was (the time verdicts need a steady machine: its runs' throughput "
              "varies less than the models differ):", ""]
    lines += [f"- {quietness_text(name, q)}" for name, q in result.quietness.items() if q is not None]
    return lines + [""]


def render_report(metrics: CompareMetrics) -> str:
    """report.md, in plain words: the table, the comparisons with the paper, and how it was made."""
    budget, env, models = metrics.lm.budget, metrics.machine, metrics.models
    seeds = metrics.seeds
    lines = heading_lines(f"Side-by-side training: {metrics.config}", metrics.description)
    first_seeds = next(iter(models.values())).seeds
    lines += [
        budget_sentence(budget, models)
        + f", on the same data in the same order (data seed {budget.data_seed}"
        + (f", mixture {budget.data_mix}" if budget.data_mix else "")
        + f"), with {seeds} seed{'s' if seeds > 1 else ''} ({', '.join(str(s) for s in first_seeds)}). "
        f"Device: {env.device} ({env.processes} process{'es' if env.processes > 1 else ''}, "
        f"{env.cpu_count} CPU cores{_jobs_text(env.jobs)}), torch {env.torch}. Wall time: "
        f"{metrics.wall_seconds / 60:.1f} min for this command"
        + (" (" + ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in metrics.phase_seconds.items()) + ")"
           if metrics.phase_seconds else "") + ".",
        "",
        *budget_lines(metrics.budget_note),
        *reference_lines(metrics.lm),
        *render_claims(metrics.claims, seeds),
        *render_variants(metrics.variant_comparisons, seeds),
        *equal_cost_lines(metrics.equal_cost, seeds),
        *sensitivity_lines(metrics),
        *sample_efficiency_lines(metrics),
        "## Language modelling",
        "",
        f"The budget: {BUDGET_NAMES[budget.kind]}. Each model's cost: its steps, tokens, training time (its "
        "timed steps, mean over seeds) and training FLOPs (diff_transformer.flops: docs/training.md, \"Budgets\").",
        "",
        "| Model | Attention | Parameters | Steps | Tokens | Train time | Training FLOPs | Final val loss"
        + (" (mean ± std)" if seeds > 1 else "")
        + " | Below the bigram | Train tokens/s | Peak memory | Paper: val loss (1.4B, Table 6) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bigram = metrics.lm.reference.bigram if metrics.lm.reference else None
    for m in models.values():
        memory = f"{m.peak_memory_bytes / 2**20:,.0f} MiB ({m.peak_memory_kind})"
        paper = f"{m.paper_table6['valid']:.3f} ({m.paper_table6['row']})" if m.paper_table6 else "—"
        status = "" if all(s == "completed" for s in m.status) else f" ({', '.join(m.status)})"
        lines.append(
            f"| {m.label}{status} | {m.attention} | {m.parameters:,} | {m.steps if m.steps is not None else '—'} | "
            f"{tokens_text(m.tokens)} | {statistics.fmean(m.train_seconds):,.1f} s | {flops_text(m.flops)} | "
            f"{stats_cell(m.final_val_loss)} | "
            f"{'—' if bigram is None or m.final_val_loss.mean is None else f'{bigram - m.final_val_loss.mean:+.3f}'} | "
            f"{_speed_cell(m.tokens_per_s)} | {memory} | {paper} |"
        )
    lines.append("")
    if metrics.lm.reference:
        ref = metrics.lm.reference
        lines += [f"The data's unigram: {ref.unigram:.3f}, bigram: {ref.bigram:.3f} nats/{ref.unit} "
                  "(the dashed lines of loss.png).", ""]
    lines += _sweep_lines(metrics.lm)
    if metrics.comparisons:
        lines += ["## Against the baseline, and against the paper", ""]
        for c in metrics.comparisons:
            label, base = models[c.model].label, models[c.baseline].label
            share = c.extra_parameters / models[c.baseline].parameters
            lines.append(f"- **{label} vs {base}, parameters**: {c.extra_parameters:+,} ({share:+.2%}).")
            lines.append(_verdict(c, label, base, seeds, metrics.lm))
            if c.throughput_ratio is not None:
                text = f"- **{label} / {base}, training throughput**: {c.throughput_ratio:.2f}× here"
                if c.paper_throughput_ratios:
                    paper = ", ".join(f"{r:.2f}×" for r in c.paper_throughput_ratios)
                    text += (f"; the paper (Table 7, H100, the same FlashAttention-2 kernel for both; 3B 2K, 3B 4K, "
                             f"13B 2K): {paper}. Project target: ≥ {THROUGHPUT_TARGET:.2f}× — ")
                    if metrics.busy_load_average is not None:
                        text += (f"not judged from this run: other work shared the CPU (mean load average up to "
                                 f"{metrics.busy_load_average:.1f} on {env.cpu_count} cores), so the two runs, "
                                 "made one after the other, did not get the same machine.")
                    else:
                        text += "met." if c.throughput_ratio >= THROUGHPUT_TARGET else "**missed**."
                else:
                    text += "."
                lines.append(text)
            lines.append(f"- **{label} / {base}, peak memory**: {c.memory_ratio:.2f}×.")
        lines.append("")
    lines += ["## Loss curves", "", "![training and validation loss](loss.png)", ""]
    lines += diagnostics_lines(metrics)
    lines += retrieval_lines(metrics.retrieval)
    lines += grounded_lines(metrics.grounded)
    problems = [f"- {m.label}: {msg}" for m in models.values() for msg in m.messages]
    if problems:
        lines += ["## Runs that did not complete", "", *problems, ""]
    lines += [
        "## How to read this",
        "",
        f"- The paper's figures ({metrics.paper['reference']}) come from models of 1.4B–13B parameters "
        "trained on 10B+ tokens; these models are tiny and briefly trained. The paper's numbers show the "
        "direction it found, not values to expect here, and nothing here was tuned toward them.",
        "- Validation loss: mean cross-entropy per token over the same fixed validation windows for every "
        "model, at the end of training."
        + (" ± is the standard deviation over seeds." if seeds > 1 else " One seed: no spread is given."),
        "- Train tokens/s: training tokens over the time spent in training steps (the first step, evaluations "
        "and checkpoints excluded), all processes together. The models train one after the other, so on a "
        "machine whose load changes meanwhile (other jobs on a shared CPU) the throughput ratio moves with "
        "that load; `diff-transformer bench model` measures both at one moment.",
        "- Peak memory: on CPU the peak resident set size of each model's own training process (it includes "
        "Python, torch and the data, a few hundred MiB shared by all models); on CUDA the maximum memory "
        "allocated by tensors.",
        "- Each model's final checkpoint is the directory named after it here "
        "(`LanguageModel.from_pretrained`); metrics.json holds every figure and curve.",
        "",
    ]
    return "\n".join(lines)
