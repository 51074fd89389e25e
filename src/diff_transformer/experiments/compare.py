"""``diff-transformer compare``: train several attention kinds side by side and report.

Two experiments, both fair by construction: every model gets the same search (the same
learning-rate grid and init recipes, warmup and schedule, data order and token budget), is
reported at its own best (recipe, learning rate), over several seeds, with mean ± std and the
difference's 95% interval, along training and under each recipe (:mod:`.claims`).

1. Language modelling: every model trained by the same ``train`` entry point, in its own process
   (a fresh interpreter, so that its peak memory is its own and no model inherits another's
   state), with the same config: the same data order (run.data_seed), the same seeds and the
   same token budget (run.steps × data.batch_size × data.seq_len), at every learning rate of
   the grid; the evaluation suite then runs on every seed's final model.
2. Retrieval (:mod:`.retrieval`): small models of the same attention kinds trained on generated
   multi-needle and MQAR examples, accuracy by difficulty and attention to the answer.

The output directory:

    DIR/report.md            per claim of the paper: our effect, its spread, the paper's figure and
                             a verdict; the tables of both experiments; the evaluations
    DIR/metrics.json         everything in the report, and the loss and learning curves
    DIR/loss.png, DIR/retrieval.png, DIR/retrieval_curves.png, DIR/diagnostics.png   the figures
    DIR/config.yaml          the resolved config every run used
    DIR/<model>/             the final checkpoint of the model's first seed at its best init recipe
                             and learning rate (from_pretrained loads it; the tokenizer is inside)
    DIR/runs/<model>/[<recipe>/]lr-<lr>/seed-<s>/   each run's exact config (config.yaml), logs
                             (metrics.jsonl, tensorboard/, summary.json) and final checkpoint (checkpoint/)
    DIR/retrieval/<model>/[<recipe>/]lr-<lr>/seed-<s>.json   each retrieval run's results
    DIR/eval/                each evaluation's JSON and plot
    DIR/.lock                while the comparison runs: its pid (a second one on DIR is refused)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Hashable

import yaml

from ..config import ConfigError
from ..train.config import TrainConfig
from ..evaluation.suite import SuiteResult
from ..checkpoint import write_directory_atomically
from ..files import check_output_dir, claim_output_dir, lock_output_dir, write_text_atomically
from .claims import mean_std, paper_claims, variant_comparisons
from .report import build_metrics, evaluation_intro, lm_curves, render_report, write_plots
from .retrieval import run_experiment, threads_per_job
from ..train.state import find_checkpoint
from ..train.trainer import SUMMARY_FILE, TrainingError, read_metrics

# The evaluation step run after training: given {label: checkpoint directory} (every seed of every
# model, labelled by seed_label) and its output directory, it returns the suite's result, whose
# Markdown goes into report.md and whose data feeds the claims.
Evaluation = Callable[[dict[str, Path], Path], SuiteResult]


class CompareInterrupted(RuntimeError):
    """A signal stopped the comparison; the interrupted run saved a checkpoint. ``exit_status``:
    128 + the signal (130 SIGINT, 143 SIGTERM), what the command returns."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum


def select_models(config: TrainConfig, attention: list[str] | None) -> list[str]:
    """Model names to train: those whose attention kind is listed (in config order), else the
    config's compare.models, else all of its models. For a listed kind that compare.models
    names, only its models there (a config's ablation variants stay out); for any other kind,
    every model of that kind."""
    if attention:
        preferred = {n: config.models[n].attention for n in config.compare.models}
        names = [name for name, entry in config.models.items() if entry.attention in attention
                 and (name in preferred or entry.attention not in preferred.values())]
        missing = [kind for kind in attention if not any(config.models[n].attention == kind for n in names)]
        if missing:
            raise ConfigError(
                f"--attention {','.join(missing)}: config {config.name!r} has no model of that kind "
                f"(its models: {', '.join(f'{n} ({e.attention})' for n, e in config.models.items())})"
            )
        return names
    return list(config.compare.models) or list(config.models)


def _run_config(resolved: dict, config: TrainConfig, name: str, lr: float, seed: int, log_dir: Path,
                checkpoint_dir: Path, recipe: str | None = None) -> Path:
    """Write LOG_DIR/config.yaml, the exact config of one run: the resolved config with this
    seed, these directories, this learning rate (min_lr keeping its ratio) and this init recipe's
    fields for the model."""
    data = copy.deepcopy(resolved)
    optim = config.optim_for(name, lr)
    entry = data["models"][name]
    entry["optim"] = {**entry.get("optim", {}), "lr": optim.lr, "min_lr": optim.min_lr}
    entry.update(config.entry_fields(name, recipe))
    data["run"].update(seed=seed, out_dir=str(log_dir), checkpoint_dir=str(checkpoint_dir))
    path = claim_output_dir(log_dir, "train-run") / "config.yaml"
    write_text_atomically(path, yaml.safe_dump(data, sort_keys=False))
    return path


def _train_command(config_file: Path, model: str, resume: bool, nproc: int) -> list[str]:
    command = [sys.executable, "-m"]
    if nproc > 1:
        command += ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
    command += ["diff_transformer", "train", "--config", str(config_file), "--model", model]
    return command + (["--resume"] if resume else [])


@dataclass
class TrainingRun:
    """One run of a comparison: its name in the log, its directory, the model it trains, and how
    to write its exact config (LOG_DIR/config.yaml, whose path it returns)."""

    label: str
    log_dir: Path
    model: str
    write_config: Callable[[], Path]


def train_runs(runs: dict[Hashable, TrainingRun], steps: int, *, resume: bool, nproc: int, jobs: int
               ) -> dict[Hashable, dict]:
    """Each run's summary (summary.json): with ``resume``, one that finished ``steps`` steps is reused
    and an interrupted one continues from its checkpoint; any other earlier run there is replaced;
    the rest train ``jobs`` at a time (:func:`_run_children`). A run that diverged (loss NaN/inf) is
    a result (that lr counts as the worst); any other failure is a TrainingError."""
    summaries: dict[Hashable, dict] = {}
    pending: list[Hashable] = []
    commands: list[list[str]] = []
    for key, run in runs.items():
        checkpoint_dir = run.log_dir / "checkpoint"
        done = _finished_summary(run.log_dir, checkpoint_dir, steps) if resume else None
        if done is not None:
            print(f"{run.label}: already trained, reusing {run.log_dir}", file=sys.stderr)
            summaries[key] = done
            continue
        continue_run = resume and find_checkpoint(checkpoint_dir) is not None
        if not continue_run:
            _clear_run(run.log_dir, run.label)
        config_file = run.write_config()
        (run.log_dir / SUMMARY_FILE).unlink(missing_ok=True)  # an interrupted run's summary is not a result
        pending.append(key)
        commands.append(_train_command(config_file, run.model, continue_run, nproc))
        if jobs == 1:
            print(f"{run.label}: {'resuming' if continue_run else 'training'} -> {run.log_dir}", file=sys.stderr,
                  flush=True)

    def finished(index: int, code: int) -> None:
        run = runs[pending[index]]
        done = _read_summary(run.log_dir)
        if done is None or done["status"] not in ("completed", "diverged"):
            status = f", status {done['status']}" if done else ""
            raise TrainingError(f"{run.label}: training failed (exit code {code}{status}); see the messages above")
        summaries[pending[index]] = done
        if jobs > 1:
            loss = done["final_val_loss"]
            print(f"{run.label}: {done['status']}, final validation loss {'-' if loss is None else f'{loss:.4f}'}, "
                  f"{done['tokens_per_s']:,.0f} tokens/s -> {run.log_dir}", file=sys.stderr, flush=True)

    if jobs > 1 and commands:
        print(f"{len(commands)} training runs, {jobs} at a time", file=sys.stderr, flush=True)
    _run_children(commands, jobs, on_exit=finished)
    return summaries


def _run_children(commands: list[list[str]], jobs: int, on_exit: Callable[[int, int], None] | None = None) -> list[int]:
    """Run training processes, up to ``jobs`` at a time (each then with cores / jobs CPU threads);
    their exit statuses, in order. ``on_exit(index, status)`` is called as each ends. SIGINT/SIGTERM
    to this process are passed on to the running ones exactly once (each runs in its own session, so a
    terminal's Ctrl-C reaches only us), which save a checkpoint; no further one starts. A child stopped
    by a signal (sent to us, or to it: exit status 130 or 143) is a :class:`CompareInterrupted`."""
    env = None
    if jobs > 1:
        threads = str(threads_per_job(jobs))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    codes: list[int | None] = [None] * len(commands)
    running: dict[int, subprocess.Popen] = {}
    received: list[int] = []

    def forward(signum, frame) -> None:
        if not received:
            received.append(signum)
            for child in running.values():
                child.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        queue = list(range(len(commands)))
        while queue or running:
            while queue and len(running) < jobs and not received:
                index = queue.pop(0)
                running[index] = subprocess.Popen(commands[index], start_new_session=True, env=env)
            if received and not running:
                break
            index, code = _wait_any(running)
            del running[index]
            codes[index] = code
            if on_exit is not None and code not in _INTERRUPTED:
                on_exit(index, code)
    except BaseException:  # a failed run (on_exit raised): the others save a checkpoint and stop too
        for child in running.values():
            child.send_signal(signal.SIGTERM)
        for child in running.values():
            child.wait()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    stopped = [c for c in codes if c in _INTERRUPTED]
    if received or stopped:
        signum = received[0] if received else _INTERRUPTED[stopped[0]]
        raise CompareInterrupted(f"interrupted by {signal.Signals(signum).name}: the running model"
                                 f"{'s' if jobs > 1 else ''} saved a checkpoint; rerun the same command with --resume",
                                 signum)
    return [c for c in codes if c is not None]


_INTERRUPTED = {128 + s: s for s in (signal.SIGINT, signal.SIGTERM)}  # exit status -> the signal that stopped it


def _wait_any(running: dict[int, subprocess.Popen]) -> tuple[int, int]:
    """(index, exit status) of the first of ``running`` to end."""
    while True:
        for index, child in running.items():
            code = child.poll()
            if code is not None:
                return index, code
        time.sleep(0.05)


def compare(
    config: TrainConfig,
    out_dir: str | Path = "out/compare",
    *,
    models: list[str] | None = None,
    seeds: int | None = None,
    lr_grid: list[float] | None = None,
    retrieval_lr_grid: list[float] | None = None,
    recipes: list[str] | None = None,
    retrieval: bool | None = None,
    resume: bool = False,
    nproc: int = 1,
    jobs: int | None = None,
    evaluation: Evaluation | None = None,
    progress: bool = True,
) -> dict:
    """Train ``models`` (names in ``config``; default: :func:`select_models`) for ``seeds`` seeds
    under every init recipe (``recipes``, default: compare.recipes and, for language modelling,
    compare.lm_recipes; none: each model as configured) at every learning rate of ``lr_grid``
    (default: compare.lr_grid, else each model's own lr under that recipe), report each model at its
    best (recipe, lr), run the retrieval experiment (default: retrieval.enabled) and the evaluations,
    and write the report into ``out_dir``; returns the metrics (also DIR/metrics.json). ``jobs``
    runs train at the same time (default: compare.jobs; 1 when ``nproc`` > 1).

    With ``resume``, runs that finished are reused and interrupted ones continue from their
    checkpoint; without it, earlier runs of the same models in ``out_dir`` are replaced.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir)
    names = models or select_models(config, None)
    if recipes is not None:  # the full search: every recipe in both experiments
        config = dataclasses.replace(config, compare=dataclasses.replace(config.compare, recipes=list(recipes),
                                                                         lm_recipes=[]))
    for name in names:
        for recipe in config.compare.recipes or [None]:
            config.entry_fields(name, recipe)  # an unknown name or a conflicting recipe is an error before anything starts
    jobs = jobs or (1 if nproc > 1 else config.compare.jobs)  # a run in several processes takes the machine
    if jobs > 1 and nproc > 1:
        raise ConfigError(f"compare: --jobs {jobs} trains several single-process runs at once and --nproc {nproc} "
                          "one run in several processes; give one of them")
    n_seeds = seeds or config.compare.seeds
    seed_values = [config.run.seed + i for i in range(n_seeds)]
    grid = list(lr_grid if lr_grid is not None else config.compare.lr_grid)
    data_dir = [] if config.data.dataset == "default" else [config.data.dataset]
    claim_output_dir(out_dir, "compare", reading=data_dir)  # a new directory, or an earlier comparison's
    with lock_output_dir(out_dir):  # one comparison at a time in out_dir (each run locks its own directory)
        if config.long_context.enabled:  # a config with a long_context section: that experiment instead
            from .long_context import run_long_context

            if retrieval_lr_grid is not None or recipes is not None:
                raise ConfigError(f"config {config.name!r} runs the long-context experiment, which takes neither "
                                  "--retrieval-lr-grid nor --recipes: set long_context.retrieval_lr_grid "
                                  "(--set 'long_context.retrieval_lr_grid=[...]') or the models' own fields")

            return run_long_context(config, out_dir, models=models, seeds=seeds, lr_grid=lr_grid,
                                    retrieval=retrieval, resume=resume, nproc=nproc, jobs=jobs, progress=progress)
        return _compare(config, out_dir, names, seed_values, grid, start, retrieval=retrieval,
                        retrieval_lr_grid=retrieval_lr_grid, resume=resume, nproc=nproc, jobs=jobs,
                        evaluation=evaluation, progress=progress)


def _compare(config: TrainConfig, out_dir: Path, names: list[str], seed_values: list[int], grid: list[float],
             start: float, *, retrieval: bool | None, retrieval_lr_grid: list[float] | None, resume: bool, nproc: int,
             jobs: int, evaluation: Evaluation | None, progress: bool) -> dict:
    """:func:`compare` once its output directory is claimed and locked."""
    if config.data.dataset == "default":  # prepare the corpus once, here, before the runs start
        from ..data import default_dataset

        default_dataset(config.data.cache_dir, progress=progress)

    # The resolved config every run reads: the user's, with what compare decided.
    resolved = config.to_dict()
    resolved["compare"].update(models=names, seeds=len(seed_values), lr_grid=grid, jobs=jobs)
    resolved["run"]["progress"] = progress and jobs == 1  # concurrent runs: one line per run instead of bars
    config_file = out_dir / "config.yaml"
    write_text_atomically(config_file, yaml.safe_dump(resolved, sort_keys=False))

    # Language modelling: every (seed, model, recipe, learning rate), seeds outermost so that an early
    # stop leaves every model with the same runs.
    recipes: list[str | None] = list(config.compare.language_model_recipes) or [None]
    lrs = {(name, recipe): grid or [config.lr_for(name, recipe, "lm")] for name in names for recipe in recipes}
    units = [(seed, name, recipe, lr) for seed in seed_values for name in names for recipe in recipes
             for lr in lrs[name, recipe]]
    log_dirs = {u: out_dir / "runs" / u[1] / (u[2] or "") / f"lr-{u[3]:g}" / f"seed-{u[0]}" for u in units}
    summaries = train_runs({
        unit: TrainingRun(
            label=f"[{i}/{len(units)}] {unit[1]}{f' {unit[2]}' if unit[2] else ''} lr {unit[3]:g} (seed {unit[0]})",
            log_dir=log_dirs[unit], model=unit[1],
            write_config=partial(_run_config, resolved, config, unit[1], unit[3], unit[0], log_dirs[unit],
                                 log_dirs[unit] / "checkpoint", unit[2]))
        for i, unit in enumerate(units, 1)
    }, config.run.steps, resume=resume, nproc=nproc, jobs=jobs)

    runs: dict[str, dict[str | None, dict[float, list[dict]]]] = {
        name: {recipe: {lr: [] for lr in lrs[name, recipe]} for recipe in recipes} for name in names}
    for unit in units:
        seed, name, recipe, lr = unit
        done = summaries[unit]
        done.update(seed=seed, lr=lr, recipe=recipe, log_dir=str(log_dirs[unit]),
                    checkpoint_dir=str(log_dirs[unit] / "checkpoint"))
        done["metrics"] = read_metrics(log_dirs[unit] / "metrics.jsonl")
        runs[name][recipe][lr].append(done)

    n_seeds = len(seed_values)
    sweep = {name: {recipe: {lr: _final_losses(rs) for lr, rs in by_lr.items()} for recipe, by_lr in by_recipe.items()}
             for name, by_recipe in runs.items()}
    best_lr = {name: {recipe: _best_lr(f"{name}{f' ({recipe})' if recipe else ''}", by_lr, n_seeds)
                      for recipe, by_lr in by_recipe.items()} for name, by_recipe in sweep.items()}
    best_recipe = {name: min(recipes, key=lambda r: statistics.fmean(sweep[name][r][best_lr[name][r]]))
                   for name in names}
    chosen = {name: runs[name][best_recipe[name]][best_lr[name][best_recipe[name]]] for name in names}
    for name in names:  # DIR/<model>: the first seed's final checkpoint at the model's best (recipe, lr)
        _replace_tree(Path(chosen[name][0]["checkpoint_dir"]), out_dir / name)

    phases = {"language modelling": time.perf_counter() - start}
    metrics = build_metrics(config, chosen, wall_seconds=time.perf_counter() - start, nproc=nproc, jobs=jobs)
    metrics["lm_recipes"] = [r for r in recipes if r is not None]
    metrics["lr_sweep"] = {
        name: {"best": best_lr[name][best_recipe[name]], "best_recipe": best_recipe[name],
               "by_recipe": {recipe or "": {
                   "grid": lrs[name, recipe], "best": best_lr[name][recipe],
                   "final_val_loss": {f"{lr:g}": mean_std(losses) for lr, losses in sweep[name][recipe].items()},
                   "diverged": {f"{lr:g}": n_seeds - len(losses) for lr, losses in sweep[name][recipe].items()},
                   "curves": {"val": lm_curves(runs[name][recipe][best_lr[name][recipe]], "val")},
               } for recipe in recipes}}
        for name in names
    }

    if retrieval if retrieval is not None else config.retrieval.enabled:
        mark = time.perf_counter()
        metrics["retrieval"] = run_experiment(config, names, seed_values, out_dir / "retrieval",
                                              lr_grid=retrieval_lr_grid, jobs=jobs, resume=resume, progress=progress)
        phases["retrieval"] = time.perf_counter() - mark

    # The evaluations run on the final checkpoint of every seed (at the best recipe and learning rate);
    # their Markdown sections are appended to the report and their headline figures feed the claims.
    suite = None
    evaluated = [n for n in names if n in config.compare.evaluation_models] if config.compare.evaluation_models else names
    if evaluation is not None and evaluated:
        checkpoints = {seed_label(config, name, r["seed"]): Path(r["checkpoint_dir"]) for name in evaluated
                       for r in chosen[name]}
        mark = time.perf_counter()
        suite = evaluation(checkpoints, out_dir / "eval")
        phases["evaluations"] = time.perf_counter() - mark
    metrics["claims"] = paper_claims(config, metrics, suite.data if suite else {})
    metrics["variant_comparisons"] = variant_comparisons(config, metrics)
    metrics["wall_seconds"] = time.perf_counter() - start  # both experiments and the evaluations
    metrics["phase_seconds"] = phases  # minutes in the report
    write_plots(metrics, out_dir)
    report = render_report(metrics)
    if suite is not None:
        report += "\n" + evaluation_intro() + "\n\n" + suite.markdown(relative_to=out_dir, heading="###")

    write_text_atomically(out_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    write_text_atomically(out_dir / "report.md", report)
    return metrics


def seed_label(config: TrainConfig, name: str, seed: int) -> str:
    """How one seed of one model is named in the evaluations: "DIFF s0"."""
    return f"{config.models[name].display_name} s{seed}"


def _final_losses(model_runs: list[dict]) -> list[float]:
    """The final validation losses of the runs that completed (a diverged run has none)."""
    return [r["final_val_loss"] for r in model_runs
            if r["status"] == "completed" and r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"])]


def _best_lr(name: str, by_lr: dict[float, list[float]], n_seeds: int) -> float:
    """The learning rate with the lowest mean final validation loss over seeds; one where any seed
    diverged is out of the running."""
    scored = {lr: statistics.fmean(v) for lr, v in by_lr.items() if len(v) == n_seeds}
    if not scored:
        raise TrainingError(f"{name}: no learning rate gave a finite final validation loss for every seed ({', '.join(map(str, by_lr))})")
    return min(scored, key=scored.get)


def _replace_tree(source: Path, target: Path) -> None:
    """Make ``target`` (new, or a checkpoint this comparison wrote) a copy of checkpoint ``source``."""
    write_directory_atomically(target, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True), kind="checkpoint",
                               overwrite=True, own_training_state=True)  # the copy of this comparison's own run


def _finished_summary(log_dir: Path, checkpoint_dir: Path, steps: int) -> dict | None:
    summary = _read_summary(log_dir)
    if summary and summary["status"] == "completed" and summary["steps"] >= steps and find_checkpoint(checkpoint_dir):
        return summary
    return None


def _read_summary(log_dir: Path) -> dict | None:
    path = log_dir / SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _clear_run(log_dir: Path, label: str) -> None:
    """Remove an earlier run of this model, lr and seed (said aloud: nothing is replaced silently)."""
    if log_dir.exists():
        check_output_dir(log_dir, "train-run", overwrite=True)  # only a run of this project is removed
        print(f"{label}: replacing the earlier run in {log_dir}", file=sys.stderr)
        shutil.rmtree(log_dir)


