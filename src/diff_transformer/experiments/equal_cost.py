"""Verdicts at equal cost: each model against DIFF at equal tokens, equal training FLOPs and, where
the machine was quiet enough to say, equal training time, in language modelling, in retrieval, in the
grounded (contextual-hallucination) task and in the evaluations of the language models.

A comparison trains every language model to one budget (``run.budget``: tokens, which ``run.steps``
counts too; training FLOPs; or seconds), every retrieval model for ``retrieval.steps`` and every
grounded model for ``grounded.steps`` (tokens). At the budget's own measure every run ends at the
same amount (within one step): the figures are the runs' final ones. At the other measures the models
spent different amounts (a kind of more FLOPs per token spent more FLOPs on the same tokens), and
each model's figure is **read off its own curve**, from the same runs (the validation loss at every
evaluation, the retrieval and grounded scores at every point of their learning curves), at the amount
the pair's least-spending run reached, linearly between measured points. The evaluations (outliers,
the attention sink, ...) measure each language model at the end of its budget only: their verdicts
are at the budget's measure, and "measured at the end only" at the others. No run is trained twice:
separate runs to each equal cost would double the study, where at this project's sizes the kinds
differ by a few per cent in FLOPs per token (diff_transformer.flops), which puts the reading inside
the last evaluation interval. Its bias is stated: a model read before its end had not finished its
schedule there (its learning rate had not yet decayed to the floor), so the reading is conservative
for the model that spent more, which would do at least as well in a run of its own to that amount.
A study that wants the equal-FLOPs verdicts at the runs' ends sets ``run.budget.kind: flops`` (its
equal-tokens verdicts are then the ones read along the curves).

Time is the runs' training seconds (their timed steps: each invocation's first step, evaluations
and checkpoints excluded), which depend on the machine and on what else ran on it. How quiet the
machine was is measured as the spread (standard deviation over mean) of the reference model's
throughput across its runs, which all do the same work (every seed and learning rate of the
Transformer, else of the first model): at most :data:`QUIET_SPREAD`, the verdicts at equal time are
given; beyond it they are not judged. A retrieval run's time along its curve is its training time
shared out evenly over its steps (its steps are the same work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..evaluation.stats import Difference, MeanStd, welch_difference
from .claims import NOT_LEARNED, Learned, better_word, evaluation_figures, mean_lookback
from .config import ExperimentConfig
from .grounded import GroundedModel, GroundedResult
from .language_models import LanguageModelling
from .results import GroundedRun, RetrievalRun, TrainingRun
from .retrieval import TASKS, RetrievalModel, RetrievalResult

MEASURES = ("tokens", "flops", "seconds")  # what a cost is counted in
QUIET_SPREAD = 0.05  # the largest spread of the reference model's throughput at which time verdicts are given


@dataclass
class Quietness:
    """How steady the machine was: the reference model's throughput over its runs (the same work each)."""

    reference: str  # the model (its label)
    runs: int
    tokens_per_s: MeanStd
    spread: float | None  # std / mean; None with fewer than two runs

    @property
    def quiet(self) -> bool:
        return self.spread is not None and self.spread <= QUIET_SPREAD

    @classmethod
    def of(cls, reference: str, throughputs: Sequence[float]) -> "Quietness":
        stats = MeanStd.of(throughputs)
        spread = stats.std / stats.mean if stats.std is not None and stats.mean else None
        return cls(reference, len(throughputs), stats, spread)


@dataclass
class Trajectory:
    """One run's figure along training: its cost in each measure at each measured point (None: not
    known, e.g. FLOPs for a kind without a term), the figure there, and the figure at its end."""

    costs: dict[str, list[float] | None]
    values: list[float]
    final: float | None

    def end(self, measure: str) -> float | None:
        """What the run spent in ``measure`` by its last measured point."""
        costs = self.costs[measure]
        return costs[-1] if costs else None

    def at(self, measure: str, amount: float) -> float | None:
        """The figure at ``amount`` of ``measure``, linear between the measured points (None before the
        first one, or where the cost is not known)."""
        costs = self.costs[measure]
        if not costs or amount < costs[0]:
            return None
        for (x0, y0), (x1, y1) in zip(zip(costs, self.values), zip(costs[1:], self.values[1:])):
            if amount <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (amount - x0) / (x1 - x0)
        return self.values[-1]  # at or past the end


def lm_trajectory(run: TrainingRun) -> Trajectory:
    """A language-model run's validation loss along training, by tokens, FLOPs and training seconds."""
    points = run.log.val
    per_token = run.summary.flops_per_token
    seconds = [p.train_seconds for p in points]
    return Trajectory({"tokens": [float(p.tokens) for p in points],
                       "flops": None if per_token is None else [p.tokens * per_token for p in points],
                       "seconds": None if None in seconds else seconds},
                      [p.loss for p in points], run.final_val_loss)


def end_only(value: float) -> Trajectory:
    """A figure measured at the end of training only (an evaluation of the final model)."""
    return Trajectory({measure: None for measure in MEASURES}, [], value)


def curve_trajectory(run: RetrievalRun | GroundedRun, figure: Callable[[Any], float], final: float, steps: int,
                     tokens_per_step: int) -> Trajectory:
    """A small-model run's ``figure`` along its learning curve (from before training; ``final`` at its
    end), by tokens, FLOPs and training seconds (the run's time shared out evenly over its ``steps``)."""
    tokens = [float(p.step * tokens_per_step) for p in run.curve]
    per_token = run.flops_per_token
    return Trajectory({"tokens": tokens, "flops": None if per_token is None else [t * per_token for t in tokens],
                       "seconds": [run.train_seconds * p.step / steps for p in run.curve]},
                      [figure(p) for p in run.curve], final)


@dataclass
class CostReading:
    """One figure of a pair at one equal cost: per seed, the difference and its verdict."""

    measure: str  # "tokens", "flops" or "seconds"
    at: float | None  # the amount the figures were read at along the curves; None: each run's end
    ours: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)
    difference: Difference | None = None
    verdict: str = ""


@dataclass
class EqualCostRow:
    """A model against DIFF on one task, at each equal cost, with the parameters of both models measured."""

    task: str
    measure: str
    better: str
    model: str  # labels
    baseline: str
    readings: list[CostReading]
    experiment: str = "language modelling"  # whose models the task measures: EXPERIMENTS
    parameters: tuple[int | None, int | None] = (None, None)  # (the model's, DIFF's) in that experiment


@dataclass
class EqualCost:
    """The verdicts at equal cost of a comparison and what they rest on."""

    budget: str  # the measure the language models' budget counts (run.steps: "tokens")
    rows: list[EqualCostRow]
    quietness: dict[str, Quietness | None]  # EXPERIMENTS -> how steady the machine was (None: did not run)


EXPERIMENTS = ("language modelling", "retrieval", "grounded")  # the experiments whose models a task measures


def reading(measure: str, budget: str, ours: Sequence[Trajectory], base: Sequence[Trajectory], word,
            quietness: Quietness | None, learned: Learned | None = None) -> CostReading:
    """The pair's figures at equal ``measure``: the runs' ends when it is the ``budget``'s measure,
    else each read at the least any of the runs spent. Time only where the machine was quiet; language
    models (``learned``) only where both have passed their data's bigram table there."""
    if measure == "seconds" and (quietness is None or not quietness.quiet):
        return CostReading(measure, None, verdict="not judged: the machine was not quiet enough")
    if measure == budget:
        values = [t.final for t in ours], [t.final for t in base]
        at = None
    elif not any(t.values for t in (*ours, *base)):
        return CostReading(measure, None, verdict="measured at the end only")
    else:
        ends = [t.end(measure) for t in (*ours, *base)]
        if None in ends:
            return CostReading(measure, None, verdict="not measured" if measure == "seconds" else "no FLOPs term")
        at = min(ends)
        values = [t.at(measure, at) for t in ours], [t.at(measure, at) for t in base]
    if any(v is None for side in values for v in side):
        return CostReading(measure, at, verdict="not measured there (before the first evaluation, or a run diverged)")
    difference = welch_difference(*values)
    judged = learned is None or (learned(values[0]) and learned(values[1]))
    return CostReading(measure, at, list(values[0]), list(values[1]), difference,
                       word(difference) if judged else NOT_LEARNED)


@dataclass
class CostTask:
    """One task of the verdicts: every model's runs as trajectories, what the runs trained to, and the
    parameters of each model measured."""

    task: str
    measure: str
    better: str
    experiment: str  # EXPERIMENTS
    budget: str  # the measure its runs trained to
    tracks: dict[str, list[Trajectory]]  # model name -> one per seed
    parameters: dict[str, int | None]
    learned: Learned | None = None  # language modelling: judged only past the bigram (claims.make_claim)


def _quietness(model: RetrievalModel | GroundedModel) -> Quietness:
    """How steady the machine was over a small-model experiment: ``model``'s runs at every lr and seed."""
    return Quietness.of(model.label, [run.train_tokens_per_second for by_lr in model.sweep.runs.values()
                                      for runs in by_lr.values() for run in runs])


def reference_model(lm: LanguageModelling) -> str:
    """The model whose runs say how quiet the machine was: the first Transformer, else the first model."""
    names = list(lm.models)
    return next((n for n in names if lm.models[n].attention == "standard"), names[0])


def cost_tasks(config: ExperimentConfig, lm: LanguageModelling, retrieval: RetrievalResult | None,
               grounded: GroundedResult | None,
               suite: dict[str, Any]) -> tuple[list[CostTask], dict[str, Quietness | None]]:
    """Every task the comparison measured on every model, and how quiet the machine was in each experiment."""
    names = list(lm.models)
    reference = reference_model(lm)
    budget = "tokens" if lm.budget.kind == "steps" else lm.budget.kind
    quietness: dict[str, Quietness | None] = {experiment: None for experiment in EXPERIMENTS}
    quietness["language modelling"] = Quietness.of(
        lm.models[reference].label, [run.summary.tokens_per_s for by_lr in lm.sweeps[reference].runs.values()
                                     for runs in by_lr.values() for run in runs if run.summary.tokens_per_s])
    lm_parameters = {n: lm.models[n].parameters for n in names}
    unit = lm.reference.unit if lm.reference else "token"
    tasks = [CostTask("Language modelling", f"final validation loss (nats/{unit})", "lower", "language modelling",
                      budget, {n: [lm_trajectory(r) for r in lm.sweeps[n].chosen] for n in names}, lm_parameters,
                      lm.learned)]
    if retrieval is not None and all(n in retrieval.models for n in names):
        settings = retrieval.settings
        per_step = settings.batch_size * settings.length
        quietness["retrieval"] = _quietness(retrieval.models[reference])
        for task in TASKS:
            tasks.append(CostTask(f"Retrieval: {task}", f"{task} accuracy, mean over difficulty cells", "higher",
                                  "retrieval", "tokens",
                                  {n: [curve_trajectory(r, lambda p, task=task: p.mean_accuracy[task],
                                                         r.mean_accuracy[task], settings.steps, per_step)
                                       for r in retrieval.models[n].runs] for n in names},
                                  {n: retrieval.models[n].parameters for n in names}))
    if grounded is not None and all(n in grounded.models for n in names):
        settings = grounded.settings
        per_step = settings.batch_size * settings.length
        quietness["grounded"] = _quietness(grounded.models[reference])
        for task, measure, better, figure, final in (
            ("Contextual hallucination", "grounded accuracy, mean over agreeing, counterfactual and lacking "
             "documents", "higher", lambda p: p.scores.accuracy, lambda r: r.scores.accuracy),
            ("Lookback ratio", "lookback ratio of the answering rows, mean over layers", "neither",
             lambda p: mean_lookback(p.lookback), lambda r: mean_lookback(r.lookback)),
        ):
            tasks.append(CostTask(task, measure, better, "grounded", "tokens",
                                  {n: [curve_trajectory(r, figure, final(r), settings.steps, per_step)
                                       for r in grounded.models[n].runs] for n in names},
                                  {n: grounded.models[n].parameters for n in names}))
    for entry in evaluation_figures(config, lm, names, suite):
        tasks.append(CostTask(entry.task, entry.measure, entry.better, "language modelling", budget,
                              {n: [end_only(v) for v in entry.figures[n].best] for n in names}, lm_parameters))
    return tasks, quietness


def equal_cost(config: ExperimentConfig, lm: LanguageModelling, retrieval: RetrievalResult | None,
               grounded: GroundedResult | None = None, suite: dict[str, Any] | None = None) -> EqualCost | None:
    """Every model of the comparison against its DIFF model (the first of attention "diff") at equal
    tokens, FLOPs and time, on every task it measured (language modelling, retrieval and grounded where
    they ran on every model, the evaluations of ``suite``, the suite's data); None without DIFF."""
    names = list(lm.models)
    diff = next((n for n in names if lm.models[n].attention == "diff"), None)
    if diff is None:
        return None
    tasks, quietness = cost_tasks(config, lm, retrieval, grounded, suite or {})
    rows = []
    for name in names:
        if name == diff:
            continue
        label = lm.models[name].label
        for task in tasks:
            word = better_word(label, task.better)
            readings = [reading(m, task.budget, task.tracks[name], task.tracks[diff], word,
                                quietness[task.experiment], task.learned) for m in MEASURES]
            rows.append(EqualCostRow(task.task, task.measure, task.better, label, lm.models[diff].label, readings,
                                     task.experiment, (task.parameters[name], task.parameters[diff])))
    budget = "tokens" if lm.budget.kind == "steps" else lm.budget.kind
    return EqualCost(budget, rows, quietness)
