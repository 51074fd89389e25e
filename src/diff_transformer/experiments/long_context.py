"""The long-context experiment: ``diff-transformer compare --config long-context``.

The paper extends its 3B models to 64K tokens (1.5B more tokens, RoPE θ 640,000, lr 8e-5) and
then shows, at that length, that DIFF's cumulative average NLL falls further with position
(Figure 4), that its multi-needle retrieval holds up (Figure 5) and that it puts more attention
on the answer (Table 3). This experiment runs the same pipeline at CPU scale, for every model of
the comparison alike (same data, budget, schedule and seeds; each at its own best learning rate):

1. **Short**: every model trained at ``data.seq_len`` exactly as ``compare`` trains it
   (``OUT/short/`` is that comparison, with its own report).
2. **Extension**: each seed's short model continues from its weights (``run.init_from``) at
   ``long_context.seq_len`` tokens with RoPE θ ``long_context.rope_theta``, on windows inside
   documents, at each model's extension learning rate (every lr of ``long_context.lr_grid`` when
   given; a model is reported at the lr of its lowest mean final validation loss).
   ``OUT/extend/runs/<model>/lr-<lr>/seed-<s>/`` as compare's runs.
3. **Position-NLL** (Figure 4): the cumulative average NLL up to the new context, on the same
   held-out windows inside documents for every model, before the extension (the short weights with
   the context raised and θ unchanged) and after.
4. **Retrieval by length** (Figure 5, Table 3): the retrieval models of the ``retrieval`` section,
   trained at ``retrieval.length`` tokens, tested at each of ``long_context.retrieval_lengths``
   before and after their own extension (``retrieval_seq_len`` tokens, θ ``retrieval_rope_theta``);
   accuracy per task and where the answer row's attention goes, per length.

``OUT/report.md`` opens with the claims (DIFF − Transformer, Welch's 95% interval, a verdict), then
the tables and ``position_nll.png`` and ``retrieval_length.png``; ``OUT/metrics.json`` holds it all.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from ..evaluation.models import load_with_context  # a checkpoint read at another context and θ
from ..evaluation.output import write_json
from ..evaluation.position_nll import checkpoints as nll_points, cumulative_average
from ..evaluation.scoring import token_nll
from ..files import claim_output_dir, write_atomically, write_text_atomically
from ..model import LanguageModel
from ..paper import ATTENTION_TABLE3, PAPER_REFERENCE
from ..train.config import LongContextConfig, RetrievalConfig, TrainConfig, config_from_dict
from .claims import _deepest_measured_layer, difference, mean_std, render_claims, verdict
from .compare import (
    TrainingRun, _best_lr, _final_losses, _run_config, compare, select_models, train_runs,
)
from .retrieval import _SIZE_FIELDS, TASKS, accuracy, attention_allocation, evaluation_sets, run_in_pool, train_model



def run_long_context(
    config: TrainConfig,
    out_dir: str | Path,
    *,
    models: list[str] | None = None,
    seeds: int | None = None,
    lr_grid: list[float] | None = None,
    retrieval: bool | None = None,
    resume: bool = False,
    nproc: int = 1,
    jobs: int | None = None,
    progress: bool = True,
) -> dict:
    """The whole experiment (see the module docstring) into ``out_dir``; returns the metrics (also
    OUT/metrics.json). ``lr_grid`` is the short runs' grid (as compare's ``--lr-grid``); the
    extension's grid is ``long_context.lr_grid``. ``retrieval=False`` leaves out the retrieval part.
    ``jobs`` language-model runs train at a time (default: compare.jobs; 1 when ``nproc`` > 1)."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    settings = config.long_context
    names = models or select_models(config, None)
    n_seeds = seeds or config.compare.seeds
    seed_values = [config.run.seed + i for i in range(n_seeds)]
    data_dir = [] if config.data.dataset == "default" else [config.data.dataset]
    claim_output_dir(out_dir, "compare", reading=data_dir)

    # 1. Short: compare itself, without its retrieval experiment and evaluations.
    short_config = dataclasses.replace(config, long_context=LongContextConfig(enabled=False))
    jobs = jobs or (1 if nproc > 1 else config.compare.jobs)
    short = compare(short_config, out_dir / "short", models=names, seeds=n_seeds, lr_grid=lr_grid, retrieval=False,
                    resume=resume, nproc=nproc, jobs=jobs, progress=progress)
    seconds = {"short": time.perf_counter() - start}
    short_checkpoints = {
        name: {seed: out_dir / "short" / "runs" / name / f"lr-{short['lr_sweep'][name]['best']:g}" / f"seed-{seed}"
               / "checkpoint" for seed in seed_values}
        for name in names
    }

    # 2. Extension: every model, seed and extension lr, each from its own seed's short checkpoint.
    mark = time.perf_counter()
    extension = _extend(config, names, seed_values, short_checkpoints, out_dir / "extend", resume=resume, nproc=nproc,
                        jobs=jobs, progress=progress)
    seconds["extension"] = time.perf_counter() - mark

    # 3. Position-NLL before and after, on the same held-out windows.
    mark = time.perf_counter()
    position_nll = {}
    for name in names:
        before = [position_nll_curve(short_checkpoints[name][seed], config, settings.seq_len)
                  for seed in seed_values]
        after = [position_nll_curve(Path(run["checkpoint_dir"]), config, settings.seq_len)
                 for run in extension[name]["runs"]]
        position_nll[name] = {"before": before, "after": after}
        if progress:
            print(f"[position-nll] {name}: C({settings.seq_len}) before "
                  f"{statistics.fmean(c[-1] for c in before):.4f}, after {statistics.fmean(c[-1] for c in after):.4f}",
                  file=sys.stderr, flush=True)
    seconds["position_nll"] = time.perf_counter() - mark

    # 4. Retrieval by length.
    mark = time.perf_counter()
    by_length = None
    if retrieval if retrieval is not None else config.retrieval.enabled:
        by_length = retrieval_by_length(config, names, seed_values, out_dir / "retrieval", resume=resume, jobs=jobs,
                                        progress=progress)
    seconds["retrieval"] = time.perf_counter() - mark

    metrics = {
        "config": config.name,
        "description": config.description,
        "budget_note": config.compare.budget_note,
        "settings": dataclasses.asdict(settings),
        "short": {"seq_len": short["budget"]["seq_len"], "tokens_per_model": short["budget"]["tokens_per_model"],
                  "rope_theta": config.model(names[0]).model_config().rope_theta,
                  "models": {name: _short_summary(short, name) for name in names}},
        "extension": extension,
        "position_nll": position_nll,
        "retrieval_by_length": by_length,
        "seeds": seed_values,
        "labels": {name: config.models[name].display_name for name in names},
        "attention": {name: config.models[name].attention for name in names},
        "environment": {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                        "device": short["environment"]["device"]},
        "paper": PAPER_REFERENCE,
    }
    metrics["claims"] = long_context_claims(metrics)
    metrics["wall_seconds"] = time.perf_counter() - start
    metrics["phase_seconds"] = seconds  # of this invocation (a resumed one reuses finished runs)
    metrics["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    write_plots(metrics, out_dir)
    write_text_atomically(out_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    write_text_atomically(out_dir / "report.md", render_report(metrics))
    return metrics


def _short_summary(short: dict, name: str) -> dict:
    m = short["models"][name]
    return {key: m[key] for key in ("final_val_loss", "tokens_per_s", "peak_memory_bytes", "peak_memory_kind",
                                    "parameters", "tokens", "load_average", "train_seconds")} | {
        "best_lr": short["lr_sweep"][name]["best"]}


# --- the extension --------------------------------------------------------------------------------


def extension_config(config: TrainConfig) -> dict:
    """The resolved config of the extension runs (plain data): every model at long_context.seq_len
    and rope_theta, the extension's data, budget and warmup; evaluation at the end only."""
    settings = config.long_context
    data = config.to_dict()
    for entry in data["models"].values():
        entry.update(max_seq_len=settings.seq_len, rope_theta=settings.rope_theta)
    data["data"].update(seq_len=settings.seq_len, batch_size=settings.batch_size, micro_batch_size=None,
                        eval_sequences=settings.eval_sequences, within_documents=settings.within_documents,
                        long_document_tokens=settings.long_document_tokens,
                        long_document_weight=settings.long_document_weight)
    data["optim"]["warmup_steps"] = settings.warmup_steps
    data["run"].update(steps=settings.steps, eval_every=settings.steps, log_every=1, stop_at_step=None,
                       checkpoint_every=0)
    data["long_context"]["enabled"] = False
    return data


def _extend(config: TrainConfig, names: Sequence[str], seeds: Sequence[int], short_checkpoints: dict, out_dir: Path,
            *, resume: bool, nproc: int, jobs: int, progress: bool) -> dict:
    """Train every (seed, model, extension lr) as its own process, ``jobs`` at a time, as compare
    trains the short runs; returns per model the runs at its best extension lr and the sweep."""
    settings = config.long_context
    resolved = extension_config(config)
    extended = config_from_dict(resolved)
    lrs = {name: settings.lr_grid or [settings.lr.get(name, config.optim_for(name).lr)] for name in names}
    claim_output_dir(out_dir, "compare")
    write_text_atomically(out_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    units = [(seed, name, lr) for seed in seeds for name in names for lr in lrs[name]]
    log_dirs = {u: out_dir / "runs" / u[1] / f"lr-{u[2]:g}" / f"seed-{u[0]}" for u in units}

    def write_config(unit: tuple) -> Path:
        seed, name, lr = unit
        run_data = copy.deepcopy(resolved)
        run_data["run"]["init_from"] = str(short_checkpoints[name][seed])
        run_data["run"]["progress"] = progress and jobs == 1
        return _run_config(run_data, extended, name, lr, seed, log_dirs[unit], log_dirs[unit] / "checkpoint")

    summaries = train_runs({
        unit: TrainingRun(label=f"[extend {i}/{len(units)}] {unit[1]} lr {unit[2]:g} (seed {unit[0]})",
                          log_dir=log_dirs[unit], model=unit[1], write_config=partial(write_config, unit))
        for i, unit in enumerate(units, 1)
    }, settings.steps, resume=resume, nproc=nproc, jobs=jobs)
    runs: dict[str, dict[float, list[dict]]] = {name: {lr: [] for lr in lrs[name]} for name in names}
    for unit in units:
        seed, name, lr = unit
        done = summaries[unit]
        done.update(seed=seed, lr=lr, log_dir=str(log_dirs[unit]), checkpoint_dir=str(log_dirs[unit] / "checkpoint"))
        runs[name][lr].append(done)
    out = {}
    for name, by_lr in runs.items():
        sweep = {lr: _final_losses(model_runs) for lr, model_runs in by_lr.items()}
        best = _best_lr(name, sweep, len(seeds))
        chosen = by_lr[best]
        out[name] = {
            "best_lr": best,
            "sweep": {f"{lr:g}": mean_std(losses) for lr, losses in sweep.items()},
            "runs": chosen,
            "final_val_loss": mean_std([r["final_val_loss"] for r in chosen]),
            "tokens_per_s": mean_std([r["tokens_per_s"] for r in chosen]),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in chosen),
            "peak_memory_kind": chosen[0]["peak_memory_kind"],
            "tokens": chosen[0]["tokens"],
            "load_average": [r.get("load_average") for r in chosen],
        }
    return out


# --- position-NLL -----------------------------------------------------------------------------------


def validation_windows(config: TrainConfig, seq_len: int, count: int) -> torch.Tensor:
    """``count`` fixed windows of ``seq_len + 1`` tokens inside documents of the dataset's validation
    split (:meth:`TokenShards.val_batches`): (count, seq_len + 1)."""
    from ..data import TokenShards, default_dataset

    directory = default_dataset(config.data.cache_dir, progress=False) if config.data.dataset == "default" \
        else Path(config.data.dataset)
    inputs, targets = TokenShards(directory, "val", within_documents=True).val_batches(1, count, seq_len)[0]
    return torch.cat([inputs, targets[:, -1:]], dim=1)


def position_nll_curve(checkpoint: str | Path, config: TrainConfig, seq_len: int) -> list[float]:
    """The cumulative average NLL C(t) = mean(NLL(0..t)), t < seq_len, of a checkpoint at context
    ``seq_len`` (its own θ), over long_context.position_nll_windows held-out windows inside documents."""
    model = load_with_context(checkpoint, seq_len)
    windows = validation_windows(config, seq_len, config.long_context.position_nll_windows)
    return cumulative_average(token_nll(model, windows, batch_size=4).mean(dim=0).tolist())


# --- retrieval by length ------------------------------------------------------------------------------


@torch.no_grad()
def measure_at_lengths(model: LanguageModel, settings: RetrievalConfig, lengths: Sequence[int]) -> dict[str, Any]:
    """Per test length: accuracy per task (mean over its difficulty cells) and per cell, and the
    answer row's attention split (per layer) on the hardest needle cells at every depth."""
    out = {}
    for length in lengths:
        at_length = dataclasses.replace(settings, length=length)
        sets = evaluation_sets(at_length)
        cells = {task: {cell: accuracy(model, examples) for cell, examples in by_cell.items()}
                 for task, by_cell in sets.items()}
        hardest = max(settings.needles)
        probe = [e for d in settings.depths for e in sets["needle"][f"N={hardest},depth={d:g}"]]
        out[str(length)] = {
            "accuracy": cells,
            "mean_accuracy": {task: statistics.fmean(c.values()) for task, c in cells.items()},
            "attention": attention_allocation(model, probe),
        }
    return out


def retrieval_run(config: TrainConfig, name: str, seed: int, extension_lrs: Sequence[float]) -> dict[str, Any]:
    """One retrieval model (``seed`` sets its initialisation) of model ``name``'s attention kind:
    trained at retrieval.length, measured at every test length, then extended at each lr of
    ``extension_lrs`` (each from the same short weights) and measured again."""
    settings, lc = config.retrieval, config.long_context
    entry = config.models[name]
    fields = {k: v for k, v in entry.fields.items() if k not in _SIZE_FIELDS}
    longest = max([*lc.retrieval_lengths, lc.retrieval_seq_len, settings.length])
    torch.manual_seed(seed)
    model = LanguageModel(dataclasses.replace(settings.model_config(entry.attention, **fields), max_seq_len=longest))
    short_lr = entry.retrieval_lr or settings.lr
    start = time.perf_counter()
    train_model(model, settings, short_lr)
    result = {"seed": seed, "short_lr": short_lr, "short_seconds": time.perf_counter() - start,
              "before": measure_at_lengths(model, settings, lc.retrieval_lengths), "after": {}, "extension_seconds": {}}
    # The extension: the same weights, θ raised, trained on examples of retrieval_seq_len tokens with a
    # tenth of the steps as warmup (as the retrieval experiment's own 40 of 400).
    extended_settings = dataclasses.replace(settings, length=lc.retrieval_seq_len, steps=lc.retrieval_steps,
                                            warmup_steps=lc.retrieval_steps // 10)
    for lr in extension_lrs:
        extended = LanguageModel(dataclasses.replace(model.config, rope_theta=lc.retrieval_rope_theta))
        extended.load_state_dict(model.state_dict())
        start = time.perf_counter()
        train_model(extended, extended_settings, lr)
        result["extension_seconds"][f"{lr:g}"] = time.perf_counter() - start
        result["after"][f"{lr:g}"] = measure_at_lengths(extended, settings, lc.retrieval_lengths)
    return result


def retrieval_by_length(config: TrainConfig, names: Sequence[str], seeds: Sequence[int], out_dir: Path, *,
                        resume: bool = False, jobs: int = 1, progress: bool = True) -> dict[str, Any]:
    """Every model and seed (:func:`retrieval_run`, ``jobs`` at a time); each model's extension
    reported at the lr with the highest mean accuracy (both tasks, every test length) over seeds.
    OUT/<model>/seed-<s>.json holds each run; with ``resume`` a result already there for the same lrs
    is reused."""
    lc = config.long_context
    lrs = {name: lc.retrieval_lr_grid or [lc.retrieval_lr.get(name, config.models[name].retrieval_lr
                                                               or config.retrieval.lr)] for name in names}
    results: dict[tuple, dict] = {}
    pending = []
    for name in names:
        for seed in seeds:
            path = out_dir / name / f"seed-{seed}.json"
            result = json.loads(path.read_text()) if resume and path.is_file() else None
            if result is None or set(result["after"]) != {f"{lr:g}" for lr in lrs[name]}:
                pending.append(((name, seed), (config, name, seed, lrs[name])))
            else:
                results[name, seed] = result

    def done(unit: tuple, result: dict, position: int) -> None:
        name, seed = unit
        write_json(out_dir / name / f"seed-{seed}.json", result)
        results[unit] = result
        if progress:
            print(f"[retrieval by length] {name} (seed {seed}): " + "; ".join(
                f"{length}: " + ", ".join(f"{t} {result['before'][length]['mean_accuracy'][t]:.2f}" for t in TASKS)
                for length in result["before"]) + " before the extension", file=sys.stderr, flush=True)

    if jobs > 1 and len(pending) > 1:
        run_in_pool(retrieval_run, pending, jobs, done)
    else:
        for position, (unit, arguments) in enumerate(pending, 1):
            done(unit, retrieval_run(*arguments), position)
    models = {}
    for name in names:
        runs = [results[name, seed] for seed in seeds]

        def score(lr: str) -> float:  # mean accuracy over the tasks and test lengths, then the seeds
            return statistics.fmean(statistics.fmean(at["mean_accuracy"][task] for at in r["after"][lr].values()
                                                     for task in TASKS) for r in runs)

        best = max((f"{lr:g}" for lr in lrs[name]), key=score)
        models[name] = {
            "short_lr": runs[0]["short_lr"], "best_lr": float(best),
            "sweep": {f"{lr:g}": score(f"{lr:g}") for lr in lrs[name]},
            "before": [r["before"] for r in runs], "after": [r["after"][best] for r in runs],
        }
    return {"lengths": list(lc.retrieval_lengths), "train_length": config.retrieval.length,
            "extension_length": lc.retrieval_seq_len, "rope_theta": lc.retrieval_rope_theta,
            "steps": lc.retrieval_steps, "chance": 1 / config.retrieval.values, "models": models}


# --- claims -----------------------------------------------------------------------------------------


def _pair(metrics: dict) -> tuple[str, str] | None:
    """(DIFF model, Transformer baseline): the first of each kind."""
    kinds = metrics["attention"]
    diff = next((n for n, k in kinds.items() if k == "diff"), None)
    base = next((n for n, k in kinds.items() if k == "standard"), None)
    return (diff, base) if diff and base else None


def _row(claim: str, measure: str, better: str, ours: list[float], base: list[float], paper: str, paper_sign: int,
         *, testable: bool = True, note: str = "") -> dict[str, Any]:
    diff = difference(ours, base)
    return {"claim": claim, "measure": measure, "better": better, "diff": mean_std(ours), "transformer": mean_std(base),
            "difference": diff, "paper": paper, "paper_sign": paper_sign,
            "verdict": verdict(diff, paper_sign) if testable else "not testable here", "note": note}


def far_nll(cumulative: list[float], short_len: int) -> float:
    """The mean NLL of the positions past ``short_len`` (t ≥ short_len), from the cumulative average C."""
    n = len(cumulative)
    return (cumulative[-1] * n - cumulative[short_len - 1] * short_len) / (n - short_len)


def long_context_claims(metrics: dict) -> list[dict[str, Any]]:
    """The paper's long-context claims on DIFF vs the first standard model, after the extension."""
    pair = _pair(metrics)
    if pair is None:
        return []
    diff_name, base_name = pair
    seq_len, short_len = metrics["settings"]["seq_len"], metrics["short"]["seq_len"]
    nll = metrics["position_nll"]
    far = {n: [far_nll(c, short_len) for c in nll[n]["after"]] for n in pair}
    rows = [
        _row("Long-context language modelling", f"cumulative average NLL over {seq_len:,} tokens after the extension",
             "lower", [c[-1] for c in nll[diff_name]["after"]], [c[-1] for c in nll[base_name]["after"]],
             "lower at every position up to 64K (Fig. 4)", -1),
        _row("Use of the longer context", f"mean NLL at positions {short_len + 1:,}–{seq_len:,} (beyond the short "
             "training length) after the extension", "lower",
             far[diff_name], far[base_name], "lower at every position up to 64K (Fig. 4)", -1),
    ]
    by_length = metrics.get("retrieval_by_length")
    if by_length:
        longest = str(max(by_length["lengths"]))
        chance = by_length["chance"]
        runs = {n: by_length["models"][n]["after"] for n in pair}
        for task, paper in (("needle", "stable from 8K to 64K; +76 points at 25% depth of 64K (Fig. 5)"),
                            ("mqar", "no figure (Zoology's task)")):
            per = {n: [r[longest]["mean_accuracy"][task] for r in runs[n]] for n in pair}
            testable = max(statistics.fmean(v) for v in per.values()) > 2 * chance
            rows.append(_row("Retrieval at length", f"{task} accuracy at {longest} tokens after the extension "
                             f"(trained at {by_length['train_length']}, extended at {by_length['extension_length']}; "
                             f"chance {chance:.3f})", "higher", per[diff_name], per[base_name], paper, +1,
                             testable=testable, note="" if testable else "both models near chance"))
        attention = [{"attention": r[longest]["attention"]} for n in pair for r in runs[n]]
        layer = _deepest_measured_layer(attention)
        if layer is not None:
            where = "last layer" if layer == len(attention[0]["attention"]) - 1 else f"layer {layer}"
            for claim, group, columns, better, sign in (
                ("Attention to the answer", "answer", "the queried needle", "higher", +1),
                ("Attention noise", "noise", "noise and distractors", "lower", -1),
            ):
                per = {n: [r[longest]["attention"][layer][group] for r in runs[n]] for n in pair}
                table3 = statistics.fmean(ATTENTION_TABLE3["diff"][group]) - statistics.fmean(ATTENTION_TABLE3["standard"][group])
                rows.append(_row(claim, f"share of the answer row on {columns} at {longest} tokens, {where}", better,
                                 per[diff_name], per[base_name], f"{table3:+.2f} (Table 3, 4K)", sign))
    return rows


# --- plots and report -------------------------------------------------------------------------------


def _mean_curve(curves: list[list[float]]) -> list[float]:
    return [statistics.fmean(values) for values in zip(*curves)]


def write_plots(metrics: dict, out_dir: Path) -> list[Path]:
    """position_nll.png (cumulative NLL by position, before and after, every model) and
    retrieval_length.png (accuracy by test length, before and after)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (name, curves) in enumerate(metrics["position_nll"].items()):
        color = f"C{i}"
        label = metrics["labels"][name]
        for phase, style in (("before", "--"), ("after", "-")):
            mean = _mean_curve(curves[phase])
            ax.plot(range(1, len(mean) + 1), mean, style, color=color,
                    label=f"{label}, {'short weights, θ unchanged' if phase == 'before' else 'extended'}")
    ax.axvline(metrics["short"]["seq_len"], color="grey", linestyle=":", label="short training length")
    ax.set_xscale("log")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("cumulative average NLL (nats)")
    ax.set_title(f"Cumulative average NLL by position, mean over {len(metrics['seeds'])} seeds (cf. paper Fig. 4)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "position_nll.png"))

    by_length = metrics.get("retrieval_by_length")
    if by_length:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, task in zip(axes, TASKS):
            for i, (name, m) in enumerate(by_length["models"].items()):
                for phase, style in (("before", "--"), ("after", "-")):
                    values = [[r[str(n)]["mean_accuracy"][task] for r in m[phase]] for n in by_length["lengths"]]
                    ax.errorbar(by_length["lengths"], [statistics.fmean(v) for v in values],
                                yerr=[statistics.stdev(v) if len(v) > 1 else 0.0 for v in values], fmt="o" + style,
                                color=f"C{i}", mfc="white" if phase == "before" else f"C{i}", capsize=3,
                                label=f"{metrics['labels'][name]}, {phase} the extension")
            ax.axhline(by_length["chance"], color="grey", linestyle=":", label="chance")
            ax.axvline(by_length["train_length"], color="grey", linestyle="--", alpha=0.4)
            ax.set_xscale("log", base=2)
            ax.set_xticks(by_length["lengths"], [str(n) for n in by_length["lengths"]])
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("test length (tokens)")
            ax.set_ylabel("answer accuracy")
            ax.set_title(f"{task}: trained at {by_length['train_length']}, extended at {by_length['extension_length']}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "retrieval_length.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        return write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


def _cell(values: list[float], digits: int = 4) -> str:
    stats = mean_std(values)
    return f"{stats['mean']:.{digits}f}" + (f" ± {stats['std']:.{digits}f}" if stats["std"] is not None else "")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def render_report(metrics: dict) -> str:
    """report.md: the claims, then the training, position-NLL and retrieval tables with their plots."""
    s, short, ext = metrics["settings"], metrics["short"], metrics["extension"]
    labels, seeds = metrics["labels"], metrics["seeds"]
    minutes = metrics["wall_seconds"] / 60
    load = metrics.get("load_average")
    lines = [f"# Long context: {metrics['config']}", ""]
    if metrics["description"]:
        lines += [metrics["description"] + ".", ""]
    lines += [
        f"Every model trained at {short['seq_len']} tokens (RoPE θ {short['rope_theta']:,.0f}; "
        f"{short['tokens_per_model']:,} tokens, short/report.md), then extended from each seed's weights to "
        f"{s['seq_len']:,} tokens with θ {s['rope_theta']:,.0f} for {s['steps']} steps × {s['batch_size']} sequences "
        f"({s['steps'] * s['batch_size'] * s['seq_len']:,} tokens, windows inside documents"
        + (f", documents of {s['long_document_tokens']:,}+ tokens ×{s['long_document_weight']:g}"
           if s["long_document_weight"] != 1 else "")
        + f"), {len(seeds)} seeds ({', '.join(map(str, seeds))}), the same data and schedule for every model, each at "
        f"its own best learning rate. Wall time {minutes:.1f} min for this command ("
        + ", ".join(f"{what.replace('_', '-')} {sec / 60:.1f}" for what, sec in metrics["phase_seconds"].items())
        + " min)"
        + (f", load average at the end {load[0]:.1f} on {metrics['environment']['cpu_count']} cores" if load else "")
        + f"; device {metrics['environment']['device']}, torch {metrics['environment']['torch']}.",
        "",
        *([f"**The budget.** {metrics['budget_note']}", ""] if metrics.get("budget_note") else []),
        *render_claims(metrics["claims"], len(seeds)),
        "## Training",
        "",
        "| Model | Phase | Context | Peak lr | Tokens | Final val loss | Train tokens/s | Peak memory |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in labels:
        m, e = short["models"][name], ext[name]
        lines.append(f"| {labels[name]} | short | {short['seq_len']} | {m['best_lr']:g} | {m['tokens']:,} | "
                     f"{_stats(m['final_val_loss'])} | {_stats(m['tokens_per_s'], 0)} | "
                     f"{_mib(m['peak_memory_bytes'])} ({m['peak_memory_kind']}) |")
        lines.append(f"| {labels[name]} | extension | {s['seq_len']:,} | {e['best_lr']:g} | {e['tokens']:,} | "
                     f"{_stats(e['final_val_loss'])} | {_stats(e['tokens_per_s'], 0)} | "
                     f"{_mib(e['peak_memory_bytes'])} ({e['peak_memory_kind']}) |")
    lines += ["", "Validation loss: the mean cross-entropy over the same held-out windows for every model (at "
              f"{s['seq_len']:,} tokens inside documents for the extension). Peak memory: the largest over seeds of "
              "each run's process (peak RSS on CPU: Python, torch and the data included).", ""]
    if any(len(e["sweep"]) > 1 for e in ext.values()):
        grid = sorted({lr for e in ext.values() for lr in e["sweep"]}, key=float)
        lines += ["### Extension learning rates (final validation loss; the best of each model in bold)", "",
                  "| Model | " + " | ".join(f"lr {lr}" for lr in grid) + " |", "|---|" + "---:|" * len(grid)]
        for name, e in ext.items():
            cells = []
            for lr in grid:
                stats = e["sweep"].get(lr)
                cell = "—" if stats is None or stats["mean"] is None else _stats(stats)
                cells.append(f"**{cell}**" if float(lr) == e["best_lr"] else cell)
            lines.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
        lines.append("")

    points = nll_points(s["seq_len"])
    lines += ["## Cumulative average NLL by position (paper Figure 4)", "",
              f"C(t), the mean NLL of positions 1…t, over {s['position_nll_windows']} held-out windows of "
              f"{s['seq_len']:,} tokens inside documents (the same windows for every model), mean ± std over seeds. "
              f"*Before*: the short weights with the context raised to {s['seq_len']:,} and θ unchanged; "
              "*after*: the extended model. The paper's 3B models at 64K: DIFF below the Transformer at every "
              "position.", "",
              "| Model | | " + " | ".join(f"≤{p:,}" for p in points) + " |", "|---|---|" + "---:|" * len(points)]
    for name, curves in metrics["position_nll"].items():
        for phase in ("before", "after"):
            cells = [_cell([c[p - 1] for c in curves[phase]], 3) for p in points]
            lines.append(f"| {labels[name]} | {phase} | " + " | ".join(cells) + " |")
    lines += ["", "![cumulative NLL by position](position_nll.png)", ""]

    by_length = metrics.get("retrieval_by_length")
    if by_length:
        lines += _retrieval_lines(by_length, labels)
    lines += ["## How to read this", "",
              f"- The paper's figures ({metrics['paper']}) come from 3B models extended to 64K tokens with 1.5B tokens; "
              "these models are tiny and briefly trained, so only the direction of a difference can be compared.",
              "- Verdicts: DIFF − Transformer with Welch's 95% interval over seeds; *agrees* / *contradicts* when the "
              "interval excludes zero on one side, else *inconclusive*.", ""]
    return "\n".join(lines)


def _stats(stats: dict[str, Any], digits: int = 4) -> str:
    if stats["mean"] is None:
        return "—"
    fmt = f",.{digits}f"
    return f"{stats['mean']:{fmt}}" + (f" ± {stats['std']:{fmt}}" if stats["std"] is not None else "")


def _retrieval_lines(by_length: dict, labels: dict[str, str]) -> list[str]:
    lengths = by_length["lengths"]
    lines = ["## Retrieval by length (paper Figure 5, Table 3)", "",
             f"The retrieval experiment's models (generated multi-needle and MQAR examples), trained at "
             f"{by_length['train_length']} tokens, tested at {', '.join(map(str, lengths))} tokens (longer examples hold "
             f"more noise between the keys and the query) before and after an extension of {by_length['steps']} steps "
             f"at {by_length['extension_length']} tokens with θ {by_length['rope_theta']:,.0f}; accuracy is exact match "
             f"on the answers, mean over the difficulty cells (chance {by_length['chance']:.3f}), mean ± std over seeds. "
             "Extension lr: " + ", ".join(f"{labels[n]} {m['best_lr']:g}" for n, m in by_length["models"].items())
             + ".", "",
             "| Model | Task | | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|---|---|" + "---:|" * len(lengths)]
    for name, m in by_length["models"].items():
        for task in TASKS:
            for phase in ("before", "after"):
                cells = [_cell([r[str(n)]["mean_accuracy"][task] for r in m[phase]], 3) for n in lengths]
                lines.append(f"| {labels[name]} | {task} | {phase} | " + " | ".join(cells) + " |")
    # One layer per length for every model and phase: the deepest whose answer rows are measurable in
    # every run (a DIFF layer with λ near 1 has rows summing to ~0), as the claims read it.
    layers = {n: _deepest_measured_layer([{"attention": r[str(n)]["attention"]} for m in by_length["models"].values()
                                          for phase in ("before", "after") for r in m[phase]]) for n in lengths}
    lines += ["", "Where the answer row looks at each length (the hardest needle cells, every depth; head mean, "
              "divided by the row sum; at each length the deepest layer measurable in every run, the one the "
              "claims read):", "",
              "| Model | | " + " | ".join(f"{n} tokens (layer {layers[n]}): answer / noise" for n in lengths) + " |",
              "|---|---|" + "---:|" * len(lengths)]
    for name, m in by_length["models"].items():
        for phase in ("before", "after"):
            cells = []
            for n in lengths:
                if layers[n] is None:
                    cells.append("–")
                    continue
                shares = [r[str(n)]["attention"][layers[n]] for r in m[phase]]
                cells.append(f"{_cell([x['answer'] for x in shares], 3)} / {_cell([x['noise'] for x in shares], 3)}")
            lines.append(f"| {labels[name]} | {phase} | " + " | ".join(cells) + " |")
    lines += ["", "![retrieval accuracy by length](retrieval_length.png)", ""]
    return lines
