"""``diff-transformer compare``: the entry of every study. The config decides which one runs: the
side-by-side comparison (:mod:`.comparison`, the default), the long-context study
(:mod:`.long_context`) for a config with a ``long_context`` section, the scaling study
(:mod:`.scaling`) for one with a ``scaling`` section, the conversion study (:mod:`.conversion`) for
one with a ``convert`` section, the pretrained-models study (:mod:`.pretrained`, no training) for one
with a ``pretrained`` section. Each is a grid of runs on
the same engine (:mod:`.study`, :mod:`.runner`); they share the options below.

    from diff_transformer.experiments import compare, load_experiment
    metrics = compare(load_experiment("tiny"), "out/compare")   # every model, same data, report.md
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ATTENTION_KINDS, ConfigError
from .comparison import CompareMetrics, Evaluation, run_comparison
from .config import ExperimentConfig
from .conversion import ConversionMetrics, run_conversion
from .long_context import LongContextMetrics, run_long_context
from .pretrained import PretrainedMetrics, run_pretrained
from .runner import StudyInterrupted
from .scaling import ScalingMetrics, run_scaling

__all__ = ["CompareMetrics", "ConversionMetrics", "Evaluation", "LongContextMetrics", "PretrainedMetrics",
           "ScalingMetrics", "StudyInterrupted", "compare", "select_models"]


def select_models(config: ExperimentConfig, attention: list[str] | None) -> list[str]:
    """Model names to train: those of the attention kinds listed and the models named (a name that is not
    a kind), in config order; else the config's compare.models, else all of its models. For a listed
    kind that compare.models names, only its models there (a config's ablation variants stay out, unless
    named); for any other kind, every model of that kind."""
    models = config.train.models
    if attention:
        kinds = [item for item in attention if item in ATTENTION_KINDS]
        named = [item for item in attention if item not in ATTENTION_KINDS]
        unknown = [item for item in named if item not in models]
        if unknown:
            raise ConfigError(f"--attention {','.join(unknown)}: neither an attention kind "
                              f"({', '.join(ATTENTION_KINDS)}) "
                              f"nor a model of config {config.name!r} ({', '.join(models)})")
        preferred = {n: models[n].attention for n in config.compare.models}
        names = [name for name, entry in models.items() if name in named or (
            entry.attention in kinds and (name in preferred or entry.attention not in preferred.values()))]
        missing = [kind for kind in kinds if not any(models[n].attention == kind for n in names)]
        if missing:
            raise ConfigError(
                f"--attention {','.join(missing)}: config {config.name!r} has no model of that kind "
                f"(its models: {', '.join(f'{n} ({e.attention})' for n, e in models.items())})"
            )
        return names
    return list(config.compare.models) or list(models)


def compare(
    config: ExperimentConfig,
    out_dir: str | Path = "out/compare",
    *,
    models: list[str] | None = None,
    seeds: int | None = None,
    lr_grid: list[float] | None = None,
    retrieval_lr_grid: list[float] | None = None,
    recipes: list[str] | None = None,
    retrieval: bool | None = None,
    grounded: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    nproc: int = 1,
    jobs: int | None = None,
    evaluation: Evaluation | None = None,
    progress: bool = True,
) -> CompareMetrics | LongContextMetrics | ScalingMetrics | ConversionMetrics | PretrainedMetrics:
    """Train ``models`` (names in ``config``; default: :func:`select_models`) for ``seeds`` seeds
    under every init recipe (``recipes``, default: compare.recipes and, for language modelling,
    compare.lm_recipes; none: each model as configured) at every learning rate of ``lr_grid``
    (default: compare.lr_grid, else each model's own lr under that recipe), report each model at its
    best (recipe, lr), run the retrieval experiment (default: retrieval.enabled), the grounded
    experiment (default: grounded.enabled; ``recipes`` given, under them too) and the evaluations,
    and write the report into ``out_dir``; returns the metrics (also DIR/metrics.json). ``jobs`` runs
    train at the same time (default: compare.jobs; 1 when ``nproc`` > 1). A config with a
    long_context section runs that study (its retrieval runs by length; ``evaluation`` on the
    extended models); one with a convert section, the conversion study (``evaluation`` on the
    fine-tuned models); one with a pretrained section, the pretrained-models study, which trains
    nothing: its work is compare.evaluations on the given checkpoints (``evaluation`` is not used;
    ``jobs`` models are measured at a time).

    ``out_dir`` is new or empty, or holds a study (:mod:`.output`): ``resume`` continues it if it is
    the same study (its runs that finished are reused, interrupted ones continue from their
    checkpoint; a setting that differs is refused by name), ``overwrite`` replaces it as a whole
    (moved aside, deleted once this one completes); without either it is refused. Every refusal
    comes before any work: the runs' configs, the output folder, then what the runs read.
    """
    names = models or select_models(config, None)
    if recipes is not None:  # the full search: every recipe in both experiments
        config = dataclasses.replace(config, compare=dataclasses.replace(config.compare, recipes=list(recipes),
                                                                         lm_recipes=[]),
                                     grounded=dataclasses.replace(config.grounded, recipes=list(recipes)))
    jobs = jobs or (1 if nproc > 1 else config.compare.jobs)  # a run in several processes takes the machine
    if jobs > 1 and nproc > 1:
        raise ConfigError(f"compare: --jobs {jobs} trains several single-process runs at once and --nproc {nproc} "
                          "one run in several processes; give one of them")
    if config.pretrained.enabled:
        given = [flag for flag, value in (("--seeds", seeds), ("--lr-grid", lr_grid),
                                          ("--retrieval-lr-grid", retrieval_lr_grid), ("--recipes", recipes))
                 if value is not None]
        given += ["--no-retrieval"] * (retrieval is not None) + ["--nproc"] * (nproc > 1)
        given += ["--attention"] * (models is not None and list(models) != select_models(config, None))
        if given:
            raise ConfigError(f"config {config.name!r} runs the pretrained-models study, which trains nothing and "
                              f"takes no {', '.join(given)}: its models are pretrained.models (--set "
                              "pretrained.models.NAME.checkpoint=DIR), its budget the evaluations' options (--set "
                              "compare.evaluation_options.NAME.OPTION=VALUE)")
        return run_pretrained(config, Path(out_dir), resume=resume, overwrite=overwrite, jobs=jobs,
                              progress=progress)
    seed_values = [config.train.run.seed + i for i in range(seeds or config.compare.seeds)]
    grid = list(lr_grid if lr_grid is not None else config.compare.lr_grid)
    if config.convert.enabled:
        if retrieval_lr_grid is not None or recipes is not None or lr_grid is not None:
            raise ConfigError(f"config {config.name!r} runs the conversion study, which takes neither --lr-grid, "
                              "--retrieval-lr-grid nor --recipes: set convert.lr_grid (--set 'convert.lr_grid=[...]') "
                              "and convert.scratch_lr_grid")
        if models is not None and list(models) != select_models(config, None):
            raise ConfigError(f"config {config.name!r} runs the conversion study, which takes no --attention: its "
                              "models are convert.source_model, its conversions (convert.inits, convert.diff_v2) and "
                              "convert.scratch_model")
        return run_conversion(config, Path(out_dir), seed_values, resume=resume, nproc=nproc, jobs=jobs,
                              evaluation=evaluation, progress=progress, overwrite=overwrite)
    if config.scaling.enabled:
        if retrieval_lr_grid is not None or recipes is not None or lr_grid is not None:
            raise ConfigError(f"config {config.name!r} runs the scaling study, which takes neither --lr-grid, "
                              "--retrieval-lr-grid nor --recipes: set scaling.lr_grid (--set 'scaling.lr_grid=[...]')")
        return run_scaling(config, Path(out_dir), names, seed_values, resume=resume, nproc=nproc, jobs=jobs,
                           evaluation=evaluation, progress=progress, overwrite=overwrite)
    if config.long_context.enabled:
        if retrieval_lr_grid is not None or recipes is not None:
            raise ConfigError(f"config {config.name!r} runs the long-context experiment, which takes neither "
                              "--retrieval-lr-grid nor --recipes: set long_context.retrieval_lr_grid "
                              "(--set 'long_context.retrieval_lr_grid=[...]') or the models' own fields")
        return run_long_context(config, Path(out_dir), names, seed_values, grid, retrieval=retrieval, resume=resume,
                                nproc=nproc, jobs=jobs, evaluation=evaluation, progress=progress,
                                overwrite=overwrite)
    return run_comparison(config, Path(out_dir), names, seed_values, grid, retrieval=retrieval, grounded=grounded,
                          retrieval_lr_grid=retrieval_lr_grid, resume=resume, nproc=nproc, jobs=jobs,
                          evaluation=evaluation, progress=progress, overwrite=overwrite)
