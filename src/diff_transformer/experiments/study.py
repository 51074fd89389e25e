"""A study is data: named axes (the model, which fixes the attention kind; the seed; the peak
learning rate; the init recipe; the model size; the training budget), every combination of which
is one run, identified by a :class:`RunKey`. :class:`Axes` expands into keys; the runner
(:mod:`.runner`) trains them; :func:`sweep` reads each model's best learning rate and init recipe
off the results, at every size and budget; :func:`extended_sweep` trains more learning rates where a
best one lies at an end of its grid.

    axes = Axes(models=("standard", "diff"), seeds=(0, 1, 2), recipes=("scaled-init",),
                lrs={("standard", "scaled-init"): (1e-3, 2e-3), ("diff", "scaled-init"): (1e-3, 2e-3)})
    keys = axes.keys()            # 12 runs, seeds outermost
    best = sweep(results, score=lambda run: run.final_val_loss, lower_is_better=True, what="...")
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Callable, Generic, Sequence, TypeVar

from ..evaluation.stats import MeanStd

R = TypeVar("R")


@dataclass(frozen=True)
class RunKey:
    """One run of a study: its coordinates on the study's axes."""

    model: str  # a model entry of the config (its attention kind and fields)
    seed: int
    lr: float  # the peak learning rate (min_lr keeps its ratio to it)
    recipe: str | None = None  # an init recipe (experiments.config.INIT_RECIPES); None: as configured
    size: str | None = None  # a model shape of the study's size axis; None: the entry's own
    steps: int | None = None  # a training budget of the study's budget axis; None: the phase's own

    @property
    def path(self) -> PurePosixPath:
        """Where the run lives under its phase's folder:
        <model>/[<size>/][steps-<n>/][<recipe>/]lr-<lr>/seed-<s>."""
        parts = [self.model, self.size, None if self.steps is None else f"steps-{self.steps}", self.recipe,
                 f"lr-{self.lr:g}", f"seed-{self.seed}"]
        return PurePosixPath(*(p for p in parts if p))

    @property
    def cell(self) -> tuple[str, str | None, int | None]:
        """(model, size, budget): the runs a sweep picks a best (recipe, lr) among."""
        return self.model, self.size, self.steps

    def describe(self) -> str:
        """"diff 25M plain-init lr 0.002 (seed 1)"."""
        words = [self.model, self.size, None if self.steps is None else f"{self.steps} steps", self.recipe,
                 f"lr {self.lr:g}"]
        return " ".join(w for w in words if w) + f" (seed {self.seed})"


@dataclass(frozen=True)
class Axes:
    """The axes of one phase of a study. ``lrs`` gives each (model, recipe) its grid of peak learning
    rates, or each (model, recipe, size) where sizes differ. Expanded, every combination is one
    run, seeds outermost, then sizes, budgets, models, recipes and learning rates: a study stopped
    early leaves every model with the same seeds."""

    models: tuple[str, ...]
    seeds: tuple[int, ...]
    lrs: dict[tuple, tuple[float, ...]]
    recipes: tuple[str | None, ...] = (None,)
    sizes: tuple[str | None, ...] = (None,)
    budgets: tuple[int | None, ...] = (None,)

    def grid(self, model: str, recipe: str | None, size: str | None = None) -> tuple[float, ...]:
        """The learning rates of (model, recipe) at ``size``."""
        found = self.lrs.get((model, recipe, size), self.lrs.get((model, recipe)))
        if found is None:
            raise KeyError(f"no learning rates for {model} under {recipe or 'its own init'} at size {size}")
        return found

    def keys(self) -> list[RunKey]:
        return [RunKey(model, seed, lr, recipe, size, steps)
                for seed in self.seeds for size in self.sizes for steps in self.budgets for model in self.models
                for recipe in self.recipes for lr in self.grid(model, recipe, size)]


def learning_rates(models: Sequence[str], recipes: Sequence[str | None], grid: Sequence[float],
                   own: Callable[[str, str | None], float]) -> dict[tuple, tuple[float, ...]]:
    """Every (model, recipe) at ``grid``, or, with an empty grid, at its own lr ``own(model, recipe)``."""
    return {(m, r): tuple(grid) if grid else (own(m, r),) for m in models for r in recipes}


@dataclass
class Sweep(Generic[R]):
    """One model's runs (at one size and budget) over its learning rates under each init recipe, and
    its best: under each recipe the lr of the best mean score over seeds (an lr where a seed has no
    score, a diverged run, is out of the running), and the recipe of the best of those."""

    model: str
    runs: dict[str | None, dict[float, list[R]]]  # recipe -> lr -> runs, one per seed
    scores: dict[str | None, dict[float, MeanStd]]  # recipe -> lr -> the scores of the runs that have one
    missing: dict[str | None, dict[float, int]]  # recipe -> lr -> runs without a score (diverged)
    best_lr: dict[str | None, float]
    best_recipe: str | None
    added: dict[str | None, tuple[float, ...]] = field(default_factory=dict)  # lrs extended_sweep added

    @property
    def chosen(self) -> list[R]:
        """The runs at the best recipe and lr, one per seed."""
        return self.runs[self.best_recipe][self.best_lr[self.best_recipe]]

    def at(self, recipe: str | None) -> list[R]:
        """The runs under ``recipe`` at its best lr there."""
        return self.runs[recipe][self.best_lr[recipe]]

    @property
    def lr(self) -> float:
        return self.best_lr[self.best_recipe]

    def edge(self, recipe: str | None) -> str | None:
        """"low" or "high" when the best lr under ``recipe`` is the smallest or the largest of several
        tried (its optimum may lie beyond), else None."""
        lrs = sorted(self.runs[recipe])
        best = self.best_lr[recipe]
        if len(lrs) < 2 or lrs[0] < best < lrs[-1]:
            return None
        return "low" if best == lrs[0] else "high"


@dataclass
class SearchedModel(Generic[R]):
    """One model of a small-model experiment (retrieval, grounded): its runs over the search, and its
    best. ``R`` carries the model's ``parameters``."""

    label: str
    attention: str
    sweep: Sweep[R]

    @property
    def runs(self) -> list[R]:
        """At its best (recipe, lr), one per seed."""
        return self.sweep.chosen

    @property
    def parameters(self) -> int:
        return self.runs[0].parameters


class NoBestLearningRate(RuntimeError):
    """No learning rate of a model gave a score for every seed (every one diverged somewhere)."""


def sweep(results: dict[RunKey, R], score: Callable[[R], float | None], *, lower_is_better: bool,
          what: Callable[[RunKey], str] = lambda key: key.model) -> dict[tuple, Sweep[R]]:
    """Each cell's (model, size, budget) :class:`Sweep` from the runs in ``results`` (in their order).
    ``what(key)`` names a cell in the error raised when no lr has a score for every seed."""
    grouped: dict[tuple, dict[str | None, dict[float, list[R]]]] = {}
    for key, run in results.items():
        grouped.setdefault(key.cell, {}).setdefault(key.recipe, {}).setdefault(key.lr, []).append(run)
    sign = 1 if lower_is_better else -1
    sweeps = {}
    for cell, by_recipe in grouped.items():
        scores: dict[str | None, dict[float, MeanStd]] = {}
        missing: dict[str | None, dict[float, int]] = {}
        best_lr: dict[str | None, float] = {}
        for recipe, by_lr in by_recipe.items():
            values = {lr: [s for s in map(score, runs) if s is not None] for lr, runs in by_lr.items()}
            scores[recipe] = {lr: MeanStd.of(v) for lr, v in values.items()}
            missing[recipe] = {lr: len(by_lr[lr]) - len(v) for lr, v in values.items()}
            complete = [lr for lr in by_lr if missing[recipe][lr] == 0 and values[lr]]
            if not complete:
                key = next(k for k in results if k.cell == cell and k.recipe == recipe)
                name = what(key) + (f" ({recipe})" if recipe else "")
                raise NoBestLearningRate(f"{name}: no learning rate gave a final score for every seed "
                                         f"({', '.join(f'{lr:g}' for lr in by_lr)})")
            best_lr[recipe] = min(complete, key=lambda lr: sign * scores[recipe][lr].mean)
        best_recipe = min(by_recipe, key=lambda r: sign * scores[r][best_lr[r]].mean)
        sweeps[cell] = Sweep(cell[0], by_recipe, scores, missing, best_lr, best_recipe)
    return sweeps


def outward_keys(sweeps: dict[tuple, Sweep], keys: Sequence[RunKey], added: dict[tuple, int], limit: int
                 ) -> list[RunKey]:
    """The runs one step beyond each grid whose best lr lies at its end (the step: the ratio of that end
    to its neighbour, so a geometric grid goes on as it was), every seed of the cell, while fewer than
    ``limit`` lrs were added at that end (``added``: (cell, recipe, end) -> lrs added so far, updated)."""
    new = []
    for cell, found in sweeps.items():
        for recipe, by_lr in found.runs.items():
            end = found.edge(recipe)
            if end is None or added.get((cell, recipe, end), 0) >= limit:
                continue
            lrs = sorted(by_lr)
            lr = lrs[0] ** 2 / lrs[1] if end == "low" else lrs[-1] ** 2 / lrs[-2]
            added[cell, recipe, end] = added.get((cell, recipe, end), 0) + 1
            seeds = sorted({k.seed for k in keys if k.cell == cell and k.recipe == recipe})
            new += [RunKey(cell[0], seed, lr, recipe, cell[1], cell[2]) for seed in seeds]
    return new


def extended_sweep(keys: Sequence[RunKey], train: Callable[[Sequence[RunKey]], dict[RunKey, R]],
                   score: Callable[[R], float | None], *, lower_is_better: bool, limit: int,
                   what: Callable[[RunKey], str] = lambda key: key.model, progress: bool = False
                   ) -> dict[tuple, Sweep[R]]:
    """:func:`sweep` of the runs ``train(keys)`` returns, where every cell whose best lr lies at an end
    of its grid has the grid extended one step outward (:func:`outward_keys`; ``train`` trains the new
    runs) until the best lies inside or ``limit`` lrs were added at that end; each Sweep's ``added``
    names the lrs added. ``limit`` 0: the plain sweep."""
    results = dict(train(keys))
    added: dict[tuple, int] = {}
    while True:
        sweeps = sweep(results, score, lower_is_better=lower_is_better, what=what)
        new = outward_keys(sweeps, list(results), added, limit)
        if not new:
            break
        if progress:
            where = sorted({(what(k), k.size or "", k.steps or 0, k.recipe or "", k.lr) for k in new})
            print("best lr at an end of its grid, one step further: " + "; ".join(
                " ".join(str(p) for p in (name, size, f"{steps} steps" if steps else "", recipe, f"lr {lr:g}") if p)
                for name, size, steps, recipe, lr in where), file=sys.stderr, flush=True)
        results.update(train(new))
    original = {(k.cell, k.recipe, k.lr) for k in keys}
    for cell, found in sweeps.items():
        found.added = {r: tuple(sorted(lr for lr in by_lr if (cell, r, lr) not in original))
                       for r, by_lr in found.runs.items()}
    return sweeps
