"""The comparison report: metrics.json, loss.png and report.md from the runs' summaries and logs."""

from __future__ import annotations

import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from .claims import difference, interval_text, mean_std, render_claims, render_variants, task_figures
from ..train.config import TrainConfig, retrieval_examples_per_step
from ..files import write_atomically
from ..paper import PAPER_REFERENCE, PAPER_TABLE6, PAPER_TABLE7_TRAINING

THROUGHPUT_TARGET = 0.9  # project goal: DIFF trains at >= 0.9x the matched Transformer's tokens/s


def lm_curves(runs: list[dict], kind: str) -> dict[str, list]:
    """Steps, tokens and the per-seed losses of one kind of record, on the steps all seeds share."""
    by_seed = [{r["step"]: r for r in run["metrics"] if r["kind"] == kind} for run in runs]
    steps = sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else []
    return {
        "step": steps,
        "tokens": [by_seed[0][s]["tokens"] for s in steps],
        "loss": [[seed[s]["loss"] for s in steps] for seed in by_seed],
    }


def build_metrics(config: TrainConfig, runs: dict[str, list[dict]], *, wall_seconds: float, nproc: int,
                  jobs: int = 1) -> dict:
    """Everything the report shows, as plain data (written to metrics.json)."""
    seq_len = config.data.seq_len or config.model(next(iter(runs))).model_config().max_seq_len
    models: dict[str, Any] = {}
    for name, model_runs in runs.items():
        entry = config.models[name]
        finished = [r for r in model_runs if r["status"] == "completed" and r["final_val_loss"] is not None]
        models[name] = {
            "label": entry.display_name,
            "attention": entry.attention,
            "recipe": model_runs[0].get("recipe"),
            "lr": model_runs[0].get("lr"),
            "parameters": model_runs[0]["parameters"],
            "tokens": model_runs[0]["tokens"],
            "seeds": [r["seed"] for r in model_runs],
            "status": [r["status"] for r in model_runs],
            "messages": [r["message"] for r in model_runs if r["message"]],
            "final_val_loss": mean_std([r["final_val_loss"] for r in finished]),
            "tokens_per_s": mean_std([r["tokens_per_s"] for r in model_runs]),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in model_runs),
            "peak_memory_kind": model_runs[0]["peak_memory_kind"],
            "train_seconds": [r["train_seconds"] for r in model_runs],
            "load_average": [r.get("load_average") for r in model_runs],
            "checkpoint": name,
            "paper_table6": dict(PAPER_TABLE6[entry.paper_row], key=entry.paper_row) if entry.paper_row else None,
            "curves": {"train": lm_curves(model_runs, "train"), "val": lm_curves(model_runs, "val")},
            "diagnostics": diagnostic_curves(model_runs),
        }
    first = next(iter(runs.values()))[0]
    return {
        "config": config.name,
        "description": config.description,
        "budget_note": config.compare.budget_note,
        "budget": {
            "steps": config.run.steps,
            "batch_size": config.data.batch_size,
            "seq_len": seq_len,
            "tokens_per_model": config.run.steps * config.data.batch_size * seq_len,
            "data_seed": config.run.data_seed,
            "data_mix": dict(config.data.mix),
        },
        "environment": {
            "device": first["device"],
            "processes": nproc,
            "jobs": jobs,
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },
        "wall_seconds": wall_seconds,
        "models": models,
        "busy_load_average": machine_was_busy(models, os.cpu_count()) if first["device"] == "cpu" else None,
        "comparisons": _comparisons(models),
        "paper": {"reference": PAPER_REFERENCE, "table6": PAPER_TABLE6, "table7_training": PAPER_TABLE7_TRAINING},
    }


def machine_was_busy(models: dict[str, Any], cpu_count: int | None) -> float | None:
    """The highest mean load average of any run if it shows other work competing for the CPU
    (more than one runnable task beyond the cores), else None. A run's own threads count up to
    the number of cores, so only the excess means that the throughput figures are not its own."""
    loads = [x for m in models.values() for x in m["load_average"] if x is not None]
    if not loads or not cpu_count:
        return None
    return max(loads) if max(loads) > cpu_count + 1 else None


def _comparisons(models: dict[str, Any]) -> list[dict[str, Any]]:
    """Each non-standard model against the first standard-attention one."""
    baseline = next((name for name, m in models.items() if m["attention"] == "standard"), None)
    if baseline is None:
        return []
    base = models[baseline]
    out = []
    for name, m in models.items():
        if name == baseline:
            continue
        ours = _delta(m["final_val_loss"], base["final_val_loss"])
        paper = None
        if m["paper_table6"] and base["paper_table6"]:
            paper = m["paper_table6"]["valid"] - base["paper_table6"]["valid"]
        ratio = None
        if base["tokens_per_s"]["mean"]:
            ratio = m["tokens_per_s"]["mean"] / base["tokens_per_s"]["mean"]
        out.append({
            "model": name,
            "baseline": baseline,
            "val_loss_delta": ours["delta"],
            "val_loss_noise": ours["noise"],
            "paper_val_loss_delta": paper,
            "throughput_ratio": ratio,
            "paper_throughput_ratios": [row["diff"] / row["transformer"] for row in PAPER_TABLE7_TRAINING]
            if m["attention"] == "diff" else None,
            "memory_ratio": m["peak_memory_bytes"] / base["peak_memory_bytes"],
            "extra_parameters": m["parameters"] - base["parameters"],
        })
    return out


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    if a["mean"] is None or b["mean"] is None:
        return {"delta": None, "noise": None}
    noise = None
    if a["std"] is not None and b["std"] is not None:
        noise = math.sqrt(a["std"] ** 2 / len(a["per_seed"]) + b["std"] ** 2 / len(b["per_seed"]))
    return {"delta": a["mean"] - b["mean"], "noise": noise}


# --- plots ---------------------------------------------------------------------------------------


def write_plots(metrics: dict, out_dir: Path) -> list[Path]:
    """DIR/loss.png: training loss (left) and validation loss (right) of every model vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for name, m in metrics["models"].items():
        label = f"{m['label']} ({m['attention']})"
        train, val = m["curves"]["train"], m["curves"]["val"]
        if train["step"]:
            mean = [statistics.fmean(v) for v in zip(*train["loss"])]
            millions = [t / 1e6 for t in train["tokens"]]
            (line,) = ax_train.plot(millions, mean, label=label)
            color = line.get_color()
        else:
            color = None
        if val["step"]:
            mean = [statistics.fmean(v) for v in zip(*val["loss"])]
            millions = [t / 1e6 for t in val["tokens"]]
            ax_val.plot(millions, mean, marker="o", markersize=3, label=label, color=color)
            if len(val["loss"]) > 1:
                std = [statistics.stdev(v) for v in zip(*val["loss"])]
                ax_val.fill_between(millions, [a - s for a, s in zip(mean, std)], [a + s for a, s in zip(mean, std)],
                                    color=color, alpha=0.2)
    seeds = len(next(iter(metrics["models"].values()))["seeds"])
    ax_train.set_title("training loss (mean over each logging interval)")
    ax_val.set_title("validation loss" + (f" (mean ± std over {seeds} seeds)" if seeds > 1 else ""))
    for ax in (ax_train, ax_val):
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{metrics['config']}: same data, seed and token budget")
    fig.tight_layout()
    paths = [_save(fig, out_dir / "loss.png")] + write_diagnostics_plot(metrics, out_dir / "diagnostics.png")
    if metrics.get("retrieval"):
        paths.append(_retrieval_plot(metrics["retrieval"], out_dir / "retrieval.png"))
        if all("curve" in r for m in metrics["retrieval"]["models"].values() for r in m["runs"]):
            paths.append(_learning_curves_plot(metrics["retrieval"], out_dir / "retrieval_curves.png"))
    return paths


def diagnostic_curves(runs: list[dict]) -> dict[str, list] | None:
    """λ and the attention-branch RMS per layer (the runs' "diagnostics" records) on the steps all
    seeds share: {"step", "tokens", "lambda": [seed][step][layer] (absent for kinds without λ),
    "attn_rms": likewise}; None where the runs logged no diagnostics."""
    by_seed = [{r["step"]: r for r in run["metrics"] if r["kind"] == "diagnostics"} for run in runs]
    steps = sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else []
    if not steps:
        return None
    curves: dict[str, list] = {"step": steps, "tokens": [by_seed[0][s]["tokens"] for s in steps]}
    for key in ("lambda", "attn_rms"):
        if all(key in seed[s] for seed in by_seed for s in steps):
            curves[key] = [[seed[s][key] for s in steps] for seed in by_seed]
    return curves


def write_diagnostics_plot(metrics: dict, path: Path) -> list[Path]:
    """PATH: λ per layer over training for the models that have one (left) and the RMS of every
    model's attention branch per layer (right), each the mean over seeds; colour = model, line
    style = layer. [] where no run logged diagnostics."""
    import matplotlib.pyplot as plt

    models = {name: m for name, m in metrics["models"].items() if m.get("diagnostics")}
    if not models:
        return []
    styles = ["-", "--", "-.", ":"]
    fig, (ax_lambda, ax_rms) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    layers = 0
    for index, m in enumerate(models.values()):
        curves, color = m["diagnostics"], f"C{index}"
        millions = [t / 1e6 for t in curves["tokens"]]
        for ax, key in ((ax_lambda, "lambda"), (ax_rms, "attn_rms")):
            if key not in curves:
                continue
            per_seed = curves[key]  # [seed][step][layer]
            n_layers = len(per_seed[0][0])
            layers = max(layers, n_layers)
            for layer in range(n_layers):
                mean = [statistics.fmean(seed[s][layer] for seed in per_seed) for s in range(len(millions))]
                ax.plot(millions, mean, color=color, linestyle=styles[layer % len(styles)], linewidth=1.4,
                        label=m["label"] if layer == 0 else None)
    for layer in range(layers):  # the legend of the line styles
        ax_rms.plot([], [], color="grey", linestyle=styles[layer % len(styles)], label=f"layer {layer}")
    seeds = len(next(iter(models.values()))["seeds"])
    ax_lambda.set_title("λ per layer" + (f" (mean over {seeds} seeds)" if seeds > 1 else ""))
    ax_lambda.set_ylabel("λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init")
    ax_rms.set_title("RMS of the attention branch per layer")
    ax_rms.set_ylabel("RMS of the attention output")
    for ax in (ax_lambda, ax_rms):
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{metrics['config']}: diagnostics during training (one fixed validation window)")
    fig.tight_layout()
    return [_save(fig, path)]


def diagnostics_lines(metrics: dict) -> list[str]:
    """The report's pointer to diagnostics.png, if it was drawn."""
    if not any(m.get("diagnostics") for m in metrics["models"].values()):
        return []
    return ["λ per layer (the models that have one) and the RMS of each layer's attention branch during training "
            "(run.diagnostics; every run's metrics.jsonl has them, with the negative share of the differential maps):",
            "", "![λ and attention-branch RMS per layer](diagnostics.png)", ""]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        return write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


def _learning_curves_plot(retrieval: dict, path: Path) -> Path:
    """Accuracy against the examples of each task seen, every model under every recipe (each at its
    best lr there; line style = recipe), mean ± std over seeds."""
    import matplotlib.pyplot as plt

    settings = retrieval["settings"]
    per_step = retrieval_examples_per_step(settings["batch_size"])
    styles = ["-", "--", "-.", ":"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, m in enumerate(retrieval["models"].values()):
        by_recipe = m.get("recipes") or {None: {"runs": m["runs"], "best_lr": m["best_lr"]}}
        for style, (recipe, entry) in zip(styles, by_recipe.items()):
            runs = entry["runs"]
            for ax, task in zip(axes, ("needle", "mqar")):
                xs = [p["step"] * per_step[task] for p in runs[0]["curve"]]
                values = [[r["curve"][i]["mean_accuracy"][task] for r in runs] for i in range(len(xs))]
                mean = [statistics.fmean(v) for v in values]
                std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
                label = m["label"] + (f", {recipe}" if recipe else "") + f" (lr {entry['best_lr']:g})"
                ax.plot(xs, mean, linestyle=style, marker="o", markersize=3, color=f"C{index}", label=label)
                ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                color=f"C{index}", alpha=0.12)
    for ax, task in zip(axes, ("needle", "mqar")):
        ax.axhline(retrieval["chance"], color="grey", linestyle=":", label="chance")
        ax.axhline(settings["target_accuracy"], color="grey", linestyle="--", linewidth=0.8,
                   label=f"target {settings['target_accuracy']:g}")
        ax.set_title(f"{task}: accuracy along training (mean over difficulty cells)")
        ax.set_xlabel(f"{task} examples seen in training")
        ax.set_ylabel("answer accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    seeds = len(next(iter(retrieval["models"].values()))["runs"])
    fig.suptitle(f"retrieval learning curves: mean ± std over {seeds} seed{'s' if seeds > 1 else ''}")
    fig.tight_layout()
    return _save(fig, path)


def _retrieval_plot(retrieval: dict, path: Path) -> Path:
    """Accuracy against difficulty (needles N, averaged over depths; mqar pairs D), mean ± std over seeds."""
    import matplotlib.pyplot as plt

    settings = retrieval["settings"]
    fig, (ax_needle, ax_mqar) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in retrieval["models"].values():
        runs = m["runs"]
        needle = [[statistics.fmean(r["accuracy"]["needle"][f"N={n},depth={d:g}"] for d in settings["depths"])
                   for r in runs] for n in settings["needles"]]
        mqar = [[r["accuracy"]["mqar"][f"D={p}"] for r in runs] for p in settings["pairs"]]
        for ax, xs, values in ((ax_needle, settings["needles"], needle), (ax_mqar, settings["pairs"], mqar)):
            means = [statistics.fmean(v) for v in values]
            stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=f"{m['label']} (lr {m['best_lr']:g})")
    for ax, title, xlabel in ((ax_needle, "multi-needle: accuracy vs needles (N − 1 distractors)", "needles N"),
                              (ax_mqar, "MQAR: accuracy vs key-value pairs", "pairs D")):
        ax.axhline(retrieval["chance"], color="grey", linestyle=":", label="chance")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("answer accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    seeds = len(next(iter(retrieval["models"].values()))["runs"])
    fig.suptitle(f"retrieval experiment: mean ± std over {seeds} seed{'s' if seeds > 1 else ''}")
    fig.tight_layout()
    return _save(fig, path)


# --- report.md -----------------------------------------------------------------------------------


def _loss_cell(stats: dict[str, Any]) -> str:
    if stats["mean"] is None:
        return "—"
    if stats["std"] is None:
        return f"{stats['mean']:.4f}"
    return f"{stats['mean']:.4f} ± {stats['std']:.4f}"


def _jobs_text(jobs: int) -> str:
    return f"; {jobs} runs at a time, each on cores / {jobs} threads" if jobs > 1 else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _speed_cell(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:,.0f}" + (f" ± {stats['std']:,.0f}" if stats["std"] is not None else "")


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _verdict(c: dict[str, Any], label: str, base_label: str, seeds: int) -> str:
    delta, noise, paper = c["val_loss_delta"], c["val_loss_noise"], c["paper_val_loss_delta"]
    if delta is None:
        return f"- {label}: no final validation loss (see the run status)."
    direction = "lower (better)" if delta < 0 else "higher (worse)"
    text = f"- **{label} vs {base_label}, validation loss**: {delta:+.4f} nats/token here, {direction}"
    if paper is not None:
        text += f"; the paper's 1.4B models (Table 6): {paper:+.3f}."
    else:
        text += "; the paper has no figure for this model."
    if noise is not None and abs(delta) <= 2 * noise:
        text += (f" The difference is within twice the standard error over {seeds} seeds (±{noise:.4f}): "
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


def _sweep_lines(sweep: dict | None, models: dict[str, Any]) -> list[str]:
    """The search table: final validation loss (mean ± std over seeds) per model, recipe and lr."""
    if not sweep:
        return []
    grid = sorted({lr for m in sweep.values() for r in m["by_recipe"].values() for lr in r["final_val_loss"]}, key=float)
    rows = [(name, recipe, entry) for name, m in sweep.items() for recipe, entry in m["by_recipe"].items()]
    if len(grid) < 2 and len(rows) == len(sweep):
        only = {name: m["best"] for name, m in sweep.items()}
        return ["Peak learning rates: " + "; ".join(f"{models[name]['label']} {lr:g}" for name, lr in only.items())
                + " (one per model; `--lr-grid` runs a sweep and reports each at its best).", ""]
    lines = ["### The search (final validation loss; each model's best in bold)", "",
             "| Model | Init recipe | " + " | ".join(f"lr {lr}" for lr in grid) + " |", "|---|---|" + "---:|" * len(grid)]
    for name, recipe, entry in rows:
        cells = []
        for lr in grid:
            stats, diverged = entry["final_val_loss"].get(lr), entry.get("diverged", {}).get(lr, 0)
            cell = "—" if stats is None or stats["mean"] is None else _loss_cell(stats)
            if diverged:
                cell += f" ({diverged} diverged)"
            best = float(lr) == sweep[name]["best"] and (recipe or None) == sweep[name]["best_recipe"]
            cells.append(f"**{cell}**" if best else cell)
        lines.append(f"| {models[name]['label']} | {recipe or 'as configured'} | " + " | ".join(cells) + " |")
    return lines + ["", "Every model ran every learning rate of its grid under every recipe with the same warmup, schedule, "
                    "data and seeds; each is reported at its own best. A grid of one lr per model is the shipped result "
                    "of a sweep (`--lr-grid` reruns it).", ""]


def sensitivity_lines(metrics: dict) -> list[str]:
    """The init-recipe sensitivity table: under each recipe, every model at its best lr there, and the
    differences against the Transformer and DIFF with their intervals."""
    models = metrics["models"]
    names = list(models)
    base = next((n for n in names if models[n]["attention"] == "standard"), None)
    diff = next((n for n in names if models[n]["attention"] == "diff"), None)
    entries = task_figures(metrics, names)
    recipes = list(dict.fromkeys(r for e in entries for f in e["figures"].values() for r in f["by_recipe"]))
    if not recipes or base is None:
        return []
    others = [n for n in names if n != base]
    header = ["Task (better)", "Init recipe", *(models[n]["label"] for n in names),
              *(f"{models[n]['label']} − {models[base]['label']}" for n in others)]
    if diff is not None:
        header += [f"{models[n]['label']} − {models[diff]['label']}" for n in others if n != diff]
    lines = ["## Sensitivity to the init recipe", "",
             "Every model under each shared init recipe, each at its best learning rate there (mean ± std over seeds); "
             "differences with Welch's 95% interval. `scaled-init`: o_proj and down_proj at init_std/√(2·layers), as the "
             "authors' code and GPT-2; `plain-init`: every matrix N(0, init_std), as transformers' Llama and DiffLlama.",
             "", "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for entry in entries:
        for recipe in recipes:
            values = {n: entry["figures"][n]["by_recipe"].get(recipe) for n in names}
            if any(v is None for v in values.values()):
                continue
            cells = [_loss_cell(mean_std(values[n])) for n in names]
            cells += [interval_text(difference(values[n], values[base])) for n in others]
            if diff is not None:
                cells += [interval_text(difference(values[n], values[diff])) for n in others if n != diff]
            lines.append(f"| {entry['task']} ({entry['better']}) | {recipe} | " + " | ".join(cells) + " |")
    return lines + [""]


def sample_efficiency_lines(metrics: dict) -> list[str]:
    """How much training each model needs: for language modelling, the tokens the better model
    needs to reach the other's final loss; for retrieval, the examples to reach the target accuracy."""
    from .retrieval import examples_to_reach

    models = metrics["models"]
    names = list(models)
    base = next((n for n in names if models[n]["attention"] == "standard"), None)
    lines = ["## Sample efficiency", ""]
    if base is not None:
        budget = metrics["budget"]["tokens_per_model"]

        def mean_curve(name: str) -> list[tuple[float, float]]:
            val = models[name]["curves"]["val"]
            return [(t, statistics.fmean(seed[i] for seed in val["loss"])) for i, t in enumerate(val["tokens"])]

        lines += ["Language modelling (each model at its best): the tokens each needs to reach another's final validation "
                  "loss (linear between evaluations; the paper: DIFF matches the Transformer with ~64% of the tokens, "
                  "Fig. 3).", ""]
        for name in names:
            if name == base:
                continue
            for fast, slow in ((name, base), (base, name)):
                target = models[slow]["final_val_loss"]["mean"]
                curve = [(t, -loss) for t, loss in mean_curve(fast)]  # rising, as examples_to_reach reads
                tokens = examples_to_reach(curve, -target) if curve and target is not None else None
                first = curve[0][0] if curve else 0
                reaches = f"{models[fast]['label']} reaches {models[slow]['label']}'s final loss ({target:.4f})"
                if tokens is None:
                    text = f"{models[fast]['label']} does not reach {models[slow]['label']}'s final loss ({target:.4f}) " \
                           "within the budget"
                elif tokens <= first:
                    text = f"{reaches} by its first evaluation ({first:,.0f} tokens, {first / budget:.0%} of the budget)"
                else:
                    text = f"{reaches} after {tokens:,.0f} tokens ({tokens / budget:.0%} of the budget)"
                lines.append(f"- {text}.")
        lines.append("")
    retrieval = metrics.get("retrieval")
    if retrieval and all("curve" in r for m in retrieval["models"].values() for r in m["runs"]):
        settings = retrieval["settings"]
        target = settings["target_accuracy"]
        per_step = retrieval_examples_per_step(settings["batch_size"])
        lines += [f"Retrieval: the examples of each task a model needs to reach accuracy {target:g} (its mean curve over "
                  "seeds, linear between measurements), under each recipe at its best lr there; "
                  f"the budget is {settings['steps'] * per_step['needle']:,} needle and "
                  f"{settings['steps'] * per_step['mqar']:,} MQAR examples.", "",
                  "| Model | Init recipe | needle | mqar |", "|---|---|---:|---:|"]
        for m in retrieval["models"].values():
            for recipe, entry in (m.get("recipes") or {None: {"runs": m["runs"]}}).items():
                cells = []
                for task in ("needle", "mqar"):
                    runs = entry["runs"]
                    curve = [(p["step"] * per_step[task], statistics.fmean(r["curve"][i]["mean_accuracy"][task]
                                                                           for r in runs))
                             for i, p in enumerate(runs[0]["curve"])]
                    reached = examples_to_reach(curve, target)
                    cells.append("not within the budget" if reached is None else f"{reached:,.0f}")
                lines.append(f"| {m['label']} | {recipe or 'as configured'} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines if len(lines) > 2 else []


def learning_curve_lines(retrieval: dict | None) -> list[str]:
    """The retrieval models' accuracy along training (each at its best), by task."""
    if not retrieval or not all("curve" in r for m in retrieval["models"].values() for r in m["runs"]):
        return []
    settings, models = retrieval["settings"], retrieval["models"]
    per_step = retrieval_examples_per_step(settings["batch_size"])
    steps = [p["step"] for p in next(iter(models.values()))["runs"][0]["curve"]]
    lines = ["### Learning curves", "",
             "Accuracy (mean over the difficulty cells, mean ± std over seeds) after each number of training steps, each "
             f"model at its best recipe and lr; a step is {per_step['needle']} needle and {per_step['mqar']} MQAR examples.",
             "", "| Task | Model | " + " | ".join(f"step {s:,}" for s in steps) + " |", "|---|---|" + "---:|" * len(steps)]
    for task in ("needle", "mqar"):
        for m in models.values():
            cells = [_loss_cell(mean_std([r["curve"][i]["mean_accuracy"][task] for r in m["runs"]]))
                     for i in range(len(steps))]
            lines.append(f"| {task} | {m['label']} ({m.get('best_recipe') or 'as configured'}, lr {m['best_lr']:g}) | "
                         + " | ".join(cells) + " |")
    return lines + ["", "![retrieval learning curves](retrieval_curves.png)", ""]


def _retrieval_lines(retrieval: dict | None) -> list[str]:
    """The retrieval experiment: accuracy by difficulty and the attention allocation, mean ± std."""
    if not retrieval:
        return []
    from .retrieval import summarize

    settings, models = retrieval["settings"], retrieval["models"]
    seeds = len(next(iter(models.values()))["runs"])
    best_lrs = ", ".join(f"{m['label']} {(m.get('best_recipe') or '') + ' '}lr {m['best_lr']:g}".replace("  ", " ")
                         for m in models.values())
    lines = [
        "## Retrieval experiment",
        "",
        f"Models of {settings['n_layers']} layers, d_model {settings['d_model']} (DIFF {_count(settings['n_heads'], 'head')}, "
        f"the Transformer {2 * settings['n_heads']}), trained for {settings['steps']} steps × {settings['batch_size']} "
        f"generated examples of {settings['length']} tokens ({_tokens(retrieval['tokens_per_model'])} tokens, the same "
        f"batches for every model) on a {4 + settings['keys'] + settings['values'] + settings['noise_tokens']}-token "
        f"symbolic vocabulary; accuracy is exact-match on the answer tokens (chance {retrieval['chance']:.3f}), "
        f"mean ± std over {seeds} seed{'s' if seeds > 1 else ''}, each model at its best "
        f"{'init recipe and ' if retrieval.get('recipes') else ''}learning rate ({best_lrs}).",
        "",
        "| Task | Difficulty | " + " | ".join(m["label"] for m in models.values()) + " |",
        "|---|---|" + "---:|" * len(models),
    ]
    for n in settings["needles"]:
        cells = []
        for m in models.values():
            per_seed = [statistics.fmean(r["accuracy"]["needle"][f"N={n},depth={d:g}"] for d in settings["depths"])
                        for r in m["runs"]]
            cells.append(_loss_cell(mean_std(per_seed)))
        lines.append(f"| needle | N = {n} ({n - 1} distractor{'s' if n != 2 else ''}), all depths | " + " | ".join(cells) + " |")
    hardest = max(settings["needles"])
    for d in settings["depths"]:
        cells = [_loss_cell(summarize(m["runs"], "needle", f"N={hardest},depth={d:g}")) for m in models.values()]
        lines.append(f"| needle | N = {hardest}, answer depth {d:.0%} | " + " | ".join(cells) + " |")
    for p in settings["pairs"]:
        cells = [_loss_cell(summarize(m["runs"], "mqar", f"D={p}")) for m in models.values()]
        lines.append(f"| mqar | D = {p} pairs | " + " | ".join(cells) + " |")
    for bits in ["full", *map(str, settings["quantize_bits"])]:
        cells = [_loss_cell(mean_std([r["quantized_accuracy"][bits] for r in m["runs"]])) for m in models.values()]
        label = "full precision" if bits == "full" else f"{bits}-bit"
        lines.append(f"| hardest cells | attention logits at {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Where the answer row looks (N = {hardest} needles, every depth; head mean, divided by the row sum "
              "so each row adds to 1; paper Table 3 for 3B models: Transformer .03–.09 on the answer and ~.5 on "
              "noise, DIFF .27–.40 and ~.02):", "",
              "| Model | Layer | on the answer | on noise | other |", "|---|---:|---:|---:|---:|"]
    for m in models.values():
        for layer in range(len(m["runs"][0]["attention"])):
            shares = [r["attention"][layer] for r in m["runs"]]
            if any(s is None for s in shares):
                lines.append(f"| {m['label']} | {layer} | row sum < 0.05 (λ near 1) | | |")
                continue
            cells = [_loss_cell(mean_std([s[g] for s in shares])) for g in ("answer", "noise", "other")]
            lines.append(f"| {m['label']} | {layer} | " + " | ".join(cells) + " |")
    lines += ["", "![retrieval accuracy by difficulty](retrieval.png)", ""]
    return lines + learning_curve_lines(retrieval)


def evaluation_intro() -> str:
    """The heading of the evaluation sections compare appends to report.md."""
    return ("## Evaluations of the paper\n\nEach evaluation ran on the final model of every seed (rows \"NAME sK\"); "
            "the claims table above gives their mean ± std. Our models are small and CPU-trained, the paper's 3B / "
            "1.4B: only the direction of a difference can be compared. JSON and plots: eval/.")


def render_report(metrics: dict) -> str:
    """report.md, in plain words: the table, the comparisons with the paper, and how it was made."""
    budget, env, models = metrics["budget"], metrics["environment"], metrics["models"]
    seeds = len(next(iter(models.values()))["seeds"])
    lines = [f"# Side-by-side training: {metrics['config']}", ""]
    if metrics["description"]:
        lines += [metrics["description"] + ".", ""]
    lines += [
        f"Every model trained for {budget['steps']} steps × {budget['batch_size']} sequences × {budget['seq_len']} "
        f"tokens = {_tokens(budget['tokens_per_model'])} tokens, on the same data in the same order "
        f"(data seed {budget['data_seed']}"
        + (f", mixture {budget['data_mix']}" if budget["data_mix"] else "")
        + f"), with {seeds} seed{'s' if seeds > 1 else ''} ({', '.join(str(s) for s in next(iter(models.values()))['seeds'])}). "
        f"Device: {env['device']} ({env['processes']} process{'es' if env['processes'] > 1 else ''}, "
        f"{env['cpu_count']} CPU cores{_jobs_text(env.get('jobs', 1))}), torch {env['torch']}. Wall time: "
        f"{metrics['wall_seconds'] / 60:.1f} min for this command"
        + (" (" + ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in metrics["phase_seconds"].items()) + ")"
           if metrics.get("phase_seconds") else "") + ".",
        "",
        *([f"**The budget.** {metrics['budget_note']}", ""] if metrics.get("budget_note") else []),
        *render_claims(metrics.get("claims", []), seeds),
        *render_variants(metrics.get("variant_comparisons", []), seeds),
        *sensitivity_lines(metrics),
        *sample_efficiency_lines(metrics),
        "## Language modelling",
        "",
        "| Model | Attention | Parameters | Tokens | Final val loss" + (" (mean ± std)" if seeds > 1 else "")
        + " | Train tokens/s | Peak memory | Paper: val loss (1.4B, Table 6) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models.values():
        memory = f"{m['peak_memory_bytes'] / 2**20:,.0f} MiB ({m['peak_memory_kind']})"
        paper = f"{m['paper_table6']['valid']:.3f} ({m['paper_table6']['row']})" if m["paper_table6"] else "—"
        status = "" if all(s == "completed" for s in m["status"]) else f" ({', '.join(m['status'])})"
        lines.append(
            f"| {m['label']}{status} | {m['attention']} | {m['parameters']:,} | {_tokens(m['tokens'])} | "
            f"{_loss_cell(m['final_val_loss'])} | {_speed_cell(m['tokens_per_s'])} | {memory} | {paper} |"
        )
    lines.append("")
    lines += _sweep_lines(metrics.get("lr_sweep"), models)
    if metrics["comparisons"]:
        lines += ["## Against the baseline, and against the paper", ""]
        for c in metrics["comparisons"]:
            label, base = models[c["model"]]["label"], models[c["baseline"]]["label"]
            extra = c["extra_parameters"]
            share = extra / models[c["baseline"]]["parameters"]
            lines.append(f"- **{label} vs {base}, parameters**: {extra:+,} ({share:+.2%}).")
            lines.append(_verdict(c, label, base, seeds))
            if c["throughput_ratio"] is not None:
                text = f"- **{label} / {base}, training throughput**: {c['throughput_ratio']:.2f}× here"
                if c["paper_throughput_ratios"]:
                    paper = ", ".join(f"{r:.2f}×" for r in c["paper_throughput_ratios"])
                    text += (f"; the paper (Table 7, H100, the same FlashAttention-2 kernel for both; 3B 2K, 3B 4K, "
                             f"13B 2K): {paper}. Project target: ≥ {THROUGHPUT_TARGET:.2f}× — ")
                    if metrics["busy_load_average"] is not None:
                        text += (f"not judged from this run: other work shared the CPU (mean load average up to "
                                 f"{metrics['busy_load_average']:.1f} on {env['cpu_count']} cores), so the two runs, "
                                 "made one after the other, did not get the same machine.")
                    else:
                        text += "met." if c["throughput_ratio"] >= THROUGHPUT_TARGET else "**missed**."
                else:
                    text += "."
                lines.append(text)
            lines.append(f"- **{label} / {base}, peak memory**: {c['memory_ratio']:.2f}×.")
        lines.append("")
    lines += ["## Loss curves", "", "![training and validation loss](loss.png)", ""]
    lines += diagnostics_lines(metrics)
    lines += _retrieval_lines(metrics.get("retrieval"))
    problems = [f"- {m['label']}: {msg}" for m in models.values() for msg in m["messages"]]
    if problems:
        lines += ["## Runs that did not complete", "", *problems, ""]
    lines += [
        "## How to read this",
        "",
        f"- The paper's figures ({metrics['paper']['reference']}) come from models of 1.4B–13B parameters "
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
