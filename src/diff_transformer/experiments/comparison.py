"""The side-by-side comparison, fair by construction: every model gets the same search (the same
learning-rate grid and init recipes, warmup and schedule, data order and token budget), is
reported at its own best (recipe, learning rate), over several seeds, with mean ± std and the
difference's 95% interval, along training and under each recipe (:mod:`.claims`).

1. Language modelling (:mod:`.language_models`): every (seed, model, recipe, lr) trained by the
   trainer in its own process with the same config but for those; the evaluation suite then runs
   on every seed's final model at its best.
2. Retrieval (:mod:`.retrieval`): small models of the same attention kinds trained on generated
   multi-needle and MQAR examples, accuracy by difficulty and attention to the answer.
3. Contextual hallucination (:mod:`.grounded`, the ``grounded`` section): small models trained on
   generated grounded question answering (facts memorised, then documents that agree, contradict or
   lack them), scored with known answers, and the lookback ratio of the rows that answer.

The output directory:

    DIR/report.md            per claim of the paper: our effect, its spread, the paper's figure and
                             a verdict; the tables of both experiments; the evaluations
    DIR/metrics.json         everything in the report, and the loss and learning curves
    DIR/loss.png, DIR/retrieval.png, DIR/retrieval_curves.png, DIR/diagnostics.png   the figures
    DIR/config.yaml          the resolved config of the comparison
    DIR/<model>/             the final checkpoint of the model's first seed at its best init recipe
                             and learning rate (from_pretrained loads it; the tokenizer is inside)
    DIR/runs/<model>/[<recipe>/]lr-<lr>/seed-<s>/   each run's exact config (config.yaml), logs
                             (metrics.jsonl, tensorboard/, summary.json) and final checkpoint (checkpoint/)
    DIR/retrieval/<model>/[<recipe>/]lr-<lr>/seed-<s>.json   each retrieval run's results
    DIR/grounded/<model>/[<recipe>/]lr-<lr>/seed-<s>.json    each grounded run's results
    DIR/eval/                each evaluation's JSON and plot
    DIR/.lock                while the comparison runs: its pid (a second one on DIR is refused)
"""

from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence


from ..checkpoint import write_directory_atomically
from ..data import EMBEDDED_DATASETS, dataset_directory
from ..evaluation.suite import SuiteResult
from .claims import paper_claims, seed_label, variant_comparisons
from .config import ExperimentConfig
from .equal_cost import equal_cost
from .language_models import (
    LanguageModelling, Machine, axes_for, busy_load_average, check_runs, plan_runs, run_config, train_language_models,
)
from .output import check_study_output, open_study
from .report import CompareMetrics, comparisons, render_report, write_plots, write_study
from .grounded import check_grounded
from .grounded import run_experiment as run_grounded
from .retrieval import check_retrieval, run_experiment

# The evaluation step run after training: given {label: checkpoint directory} (every seed of every
# model, labelled by seed_label) and its output directory, it returns the suite's result, whose
# Markdown goes into report.md and whose data feeds the claims.
Evaluation = Callable[[dict[str, Path], Path], SuiteResult]

__all__ = ["CompareMetrics", "Evaluation", "run_comparison"]


def run_comparison(config: ExperimentConfig, out_dir: Path, names: Sequence[str], seeds: Sequence[int],
                   grid: Sequence[float], *, retrieval: bool | None = None, grounded: bool | None = None,
                   retrieval_lr_grid: Sequence[float] | None = None, resume: bool = False, nproc: int = 1,
                   jobs: int = 1, evaluation: Evaluation | None = None, progress: bool = True,
                   overwrite: bool = False) -> CompareMetrics:
    """The comparison of ``names`` over ``seeds`` at the lrs of ``grid`` (empty: each model's own)
    under the language-model recipes of ``config.compare`` (see :func:`.compare.compare`; ``resume``
    and ``overwrite``: :mod:`.output`)."""
    start = time.perf_counter()
    lm_recipes = list(config.compare.language_model_recipes) or [None]
    axes = axes_for(config, names, seeds, grid, lm_recipes)
    configure = partial(run_config, config.train, progress=progress and jobs == 1)
    with_retrieval = retrieval if retrieval is not None else config.retrieval.enabled
    with_grounded = grounded if grounded is not None else config.grounded.enabled
    record = study_record(config, names=list(names), seeds=len(seeds), lr_grid=list(grid), jobs=jobs,
                          retrieval=with_retrieval, grounded=with_grounded, retrieval_lr_grid=retrieval_lr_grid)
    data_dir = [] if config.train.data.dataset in EMBEDDED_DATASETS else [config.train.data.dataset]
    # The whole plan before any work: every run's config, the output folder, the retrieval models, then
    # what the runs read (the embedded corpus is tokenized, once, only after everything else passed).
    runs = plan_runs(axes.keys(), out_dir / "runs", configure)
    check_study_output(out_dir, record, resume=resume, overwrite=overwrite, reading=data_dir)
    if with_retrieval:
        check_retrieval(config, names)
    if with_grounded:
        check_grounded(config, names)
    check_runs(runs, nproc=nproc)
    with open_study(out_dir, record, resume=resume, overwrite=overwrite, reading=data_dir, progress=progress):
        dataset_directory(config.train.data.dataset, config.train.data.cache_dir, progress=progress)
        phases = {}
        sweeps = train_language_models(axes.keys(), out_dir / "runs", configure, resume=resume, nproc=nproc,
                                       jobs=jobs, progress=progress, name=config.model_name)
        lm = LanguageModelling.of(config, sweeps, names, lm_recipes)
        for name in names:  # DIR/<model>: the first seed's final checkpoint at the model's best (recipe, lr)
            copy_checkpoint(lm.sweeps[name].chosen[0].checkpoint_dir, out_dir / name)
        phases["language modelling"] = time.perf_counter() - start
        device = lm.sweeps[names[0]].chosen[0].summary.device
        machine = Machine.of(device, nproc, jobs)
        metrics = CompareMetrics(config.name, config.train.description, config.compare.budget_note, lm, machine,
                                 comparisons(lm.models),
                                 busy_load_average(list(lm.models.values()), machine.cpu_count) if device == "cpu"
                                 else None)

        if with_retrieval:
            mark = time.perf_counter()
            metrics.retrieval = run_experiment(config, names, seeds, out_dir / "retrieval", lr_grid=retrieval_lr_grid,
                                               jobs=jobs, resume=resume, progress=progress)
            phases["retrieval"] = time.perf_counter() - mark
        if with_grounded:
            mark = time.perf_counter()
            metrics.grounded = run_grounded(config, names, seeds, out_dir / "grounded", lr_grid=retrieval_lr_grid,
                                            jobs=jobs, resume=resume, progress=progress)
            phases["grounded"] = time.perf_counter() - mark

        # The evaluations run on the final checkpoint of every seed (at the best recipe and learning rate);
        # their Markdown sections are appended to the report and their headline figures feed the claims.
        suite = None
        evaluated = [n for n in names if n in config.compare.evaluation_models] if config.compare.evaluation_models \
            else list(names)
        if evaluation is not None and evaluated:
            checkpoints = {seed_label(config, name, run.key.seed): run.checkpoint_dir for name in evaluated
                           for run in lm.sweeps[name].chosen}
            mark = time.perf_counter()
            suite = evaluation(checkpoints, out_dir / "eval")
            phases["evaluations"] = time.perf_counter() - mark
        metrics.claims = paper_claims(config, lm, metrics.retrieval, suite.data if suite else {}, metrics.grounded)
        metrics.variant_comparisons = variant_comparisons(config, lm, metrics.retrieval, suite.data if suite else {},
                                                          metrics.grounded)
        metrics.equal_cost = equal_cost(config, lm, metrics.retrieval, metrics.grounded, suite.data if suite else {})
        metrics.wall_seconds = time.perf_counter() - start
        metrics.phase_seconds = phases

        write_plots(metrics, out_dir)
        write_study(out_dir, metrics, render_report(metrics), suite)
        return metrics


def study_record(config: ExperimentConfig, **choices) -> dict:
    """The study's resolved config (DIR/config.yaml; what --resume compares): the config with the
    command line's choices written into its fields: ``names`` (compare.models), ``seeds``
    (compare.seeds), ``lr_grid``, ``jobs``, and where given ``retrieval`` (retrieval.enabled),
    ``grounded`` (grounded.enabled) and ``retrieval_lr_grid`` (retrieval.lr_grid)."""
    resolved = config.to_dict()
    fields = {"names": "models", "seeds": "seeds", "lr_grid": "lr_grid", "jobs": "jobs"}
    resolved["compare"].update({fields[k]: v for k, v in choices.items() if k in fields})
    if choices.get("retrieval") is not None:
        resolved["retrieval"]["enabled"] = bool(choices["retrieval"])
    if choices.get("grounded") is not None:
        resolved["grounded"]["enabled"] = bool(choices["grounded"])
    if choices.get("retrieval_lr_grid") is not None:
        resolved["retrieval"]["lr_grid"] = list(choices["retrieval_lr_grid"])
    return resolved


def copy_checkpoint(source: Path, target: Path) -> None:
    """Make ``target`` (new, or a checkpoint this comparison wrote) a copy of checkpoint ``source``."""
    write_directory_atomically(target, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True), kind="checkpoint",
                               overwrite=True, own_training_state=True)  # the copy of this comparison's own run
