"""The contextual-hallucination experiment: small models trained on generated grounded question
answering, scored with known answers, and the lookback ratio of the rows that answer.

The paper's Table 4 finds DIFF hallucinating less when the answer is in its context (summaries and
answers judged by GPT-4o). A judge needs no model here, because the task is generated and every
answer is known. An entity → attribute table is learnt from training text (closed-book questions
"ASK e a"); episodes then give a document of facts "e a" among noise tokens and ask about entities
(:mod:`diff_transformer.data.synthetic`, "grounded question answering"): the document agrees with
the memorised attribute, contradicts it (counterfactual, FaithEval's kind) or lacks the entity,
where UNKNOWN is taught (FaithEval's unanswerable kind). The models, their sizes, the learning rates
and the optimizer are the retrieval experiment's (:mod:`.retrieval`); every model sees the same
batches; each is reported at its best (recipe, lr) by grounded accuracy.

Scores, on held-out episodes whose questions cycle through the three conditions (each answer the
argmax over the whole vocabulary at the entity's position):

    accuracy         answered as the document warrants (its attribute; UNKNOWN where it lacks the
                     fact), the mean over the three conditions: the figure against paper Table 4
    faithful         the document's attribute where it states the fact (agree and counterfactual)
    prior override   counterfactual questions answered with the memorised attribute
    fabrication      answers that are neither the document's attribute of the entity, nor its
                     memorised one, nor UNKNOWN (another entity's attribute, or anything else),
                     the mean over the three conditions
    abstention       lacking questions answered UNKNOWN
    recall           closed-book questions answered with the memorised attribute

The lookback ratio (:mod:`diff_transformer.evaluation.lookback`) of each question's answering row,
with the question's ASK as the answer marker, per layer and head; reported per layer as the mean
over heads and questions, and as the AUROC with which it separates right answers from wrong ones.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from ..data.synthetic import (
    CLOSED_BOOK, CONDITIONS, UNKNOWN, GroundedExample, GroundedQuestion, closed_book_example, grounded_episode,
    memorised_facts, symbolic_batch,
)
from ..evaluation.lookback import LookbackTap, head_means
from ..evaluation.stats import auroc
from ..model import LanguageModel
from ..train.budget import flops_per_token
from ..train.config import OptimConfig
from .config import ExperimentConfig, GroundedConfig
from .results import GroundedPoint, GroundedRun, GroundedScores, Outcomes
from .retrieval import retrieval_fields, small_model_or_error, train_steps
from .runner import PoolJob, run_jobs
from .study import Axes, SearchedModel, learning_rates, sweep

OUTCOMES = ("document", "memory", "unknown", "misattributed", "invented")


def training_batch(config: GroundedConfig, facts: Sequence[int], step: int) -> tuple[Tensor, Tensor]:
    """The batch of ``step``, the same for every model and seed: ``config.closed_book`` closed-book
    examples of the facts, then episodes."""
    rng = random.Random(f"grounded-train/{config.data_seed}/{step}")
    task = config.task
    examples = [closed_book_example(rng, task, facts) for _ in range(config.closed_book)]
    examples += [grounded_episode(rng, task, facts) for _ in range(config.batch_size - config.closed_book)]
    return symbolic_batch(examples)


def evaluation_set(config: GroundedConfig, facts: Sequence[int]) -> list[GroundedExample]:
    """Held-out episodes whose questions cycle through agree, counterfactual and lacking (equal numbers,
    give or take one), then closed-book examples asking every entity once."""
    rng = random.Random(f"grounded-eval/{config.data_seed}")
    task = config.task
    episodes = []
    for i in range(config.eval_episodes):
        conditions = [CONDITIONS[(i * task.questions + q) % len(CONDITIONS)] for q in range(task.questions)]
        episodes.append(grounded_episode(rng, task, facts, rng.sample(conditions, len(conditions))))
    entities = list(task.entity_tokens)
    per = task.closed_book_questions
    closed = [closed_book_example(rng, task, facts, entities[i: i + per]) for i in range(0, len(entities), per)]
    return episodes + closed


def classify(question: GroundedQuestion, answer: int) -> str:
    """Which of OUTCOMES ``answer`` (a token) is for ``question``: the document's attribute of the entity,
    its memorised one (where different), UNKNOWN, an attribute the document gives another entity, or
    anything else."""
    if question.document is not None and answer == question.document:
        return "document"
    if answer == question.memorised:
        return "memory"
    if answer == UNKNOWN:
        return "unknown"
    return "misattributed" if answer in question.stated else "invented"


def outcomes(answers: Sequence[tuple[GroundedQuestion, int]]) -> Outcomes:
    """The shares of each outcome among ``answers`` (question, answer token)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for question, answer in answers:
        counts[classify(question, answer)] += 1
    n = len(answers)
    return Outcomes(n, *(counts[k] / n if n else float("nan") for k in OUTCOMES))


def grounded_scores(answers: Sequence[tuple[GroundedQuestion, int]]) -> GroundedScores:
    """The scores (:class:`~.results.GroundedScores`) of ``answers`` (question, answer token), every
    condition and the closed-book questions among them; a condition without questions makes the
    scores that read it NaN."""
    by = {c: outcomes([(q, a) for q, a in answers if q.condition == c]) for c in (*CONDITIONS, CLOSED_BOOK)}
    agree, counterfactual, lacking = (by[c] for c in CONDITIONS)
    return GroundedScores(
        accuracy=statistics.fmean([agree.document, counterfactual.document, lacking.unknown]),
        faithful=statistics.fmean([agree.document, counterfactual.document]),
        prior_override=counterfactual.memory,
        fabrication=statistics.fmean(o.misattributed + o.invented for o in (agree, counterfactual, lacking)),
        abstention=lacking.unknown,
        recall=by[CLOSED_BOOK].memory,
        outcomes=by,
    )


@dataclass
class Measured:
    """One pass over the evaluation set: every question with its answer token, and for the episodes'
    questions their lookback ratios (layers, heads) and whether the answer was right."""

    answers: list[tuple[GroundedQuestion, int]]
    lookback: list[Tensor]  # per episode question: (L, H)
    right: list[bool]


@torch.no_grad()
def measure(model: LanguageModel, examples: Sequence[GroundedExample], batch_size: int = 64) -> Measured:
    """Answers (argmax at each question's position) and, through the attention tap, the lookback ratio
    of each episode question's answering row (its ASK the answer marker)."""
    answers, lookback, right = [], [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        inputs, _ = symbolic_batch(chunk)
        tap = LookbackTap([[(q.position, q.marker) for q in e.questions] for e in chunk])
        with model.tap_attention(tap):
            predicted = model(inputs)[0].argmax(-1)
        for b, (example, ratios) in enumerate(zip(chunk, tap.per_example())):  # ratios (L, H, questions)
            for i, question in enumerate(example.questions):
                answer = int(predicted[b, question.position])
                answers.append((question, answer))
                if question.condition != CLOSED_BOOK:
                    lookback.append(ratios[:, :, i])
                    right.append(answer == question.target)
    return Measured(answers, lookback, right)


def lookback_by_layer(measured: Measured) -> list[float | None]:
    """Per layer, the mean over heads and episode questions of the lookback ratio (None if undefined)."""
    if not measured.lookback:
        return []
    per_layer = head_means(measured.lookback)  # (questions, L)
    return [_finite(torch.nanmean(per_layer[:, layer]).item()) for layer in range(per_layer.shape[1])]


def lookback_auroc(measured: Measured) -> list[float | None]:
    """Per layer, the AUROC of the head-mean lookback ratio separating right answers from wrong ones
    (None where either is missing)."""
    if not measured.lookback:
        return []
    per_layer = head_means(measured.lookback)  # (questions, L)
    out = []
    for layer in range(per_layer.shape[1]):
        values = per_layer[:, layer].tolist()
        right = [v for v, r in zip(values, measured.right) if r and v == v]
        wrong = [v for v, r in zip(values, measured.right) if not r and v == v]
        out.append(auroc(right, wrong))
    return out


def _finite(value: float) -> float | None:
    return value if value == value and abs(value) != float("inf") else None


def run_one(config: GroundedConfig, optim: OptimConfig, attention: str, seed: int, model_fields: dict | None = None,
            diff_heads: bool = False) -> GroundedRun:
    """Train one model (``seed`` sets its initialisation) on the grounded task and score it before
    training, after each of ``config.curve_steps`` and at the end."""
    torch.manual_seed(seed)
    model = LanguageModel(config.model_config(attention, diff_heads=diff_heads, **(model_fields or {})))
    facts = memorised_facts(config.task, config.data_seed)
    examples = evaluation_set(config, facts)
    curve: list[GroundedPoint] = []
    measuring = 0.0
    last: list[Measured] = []

    def at(step: int) -> None:
        nonlocal measuring
        mark = time.perf_counter()
        measured = measure(model, examples)
        curve.append(GroundedPoint(step, grounded_scores(measured.answers), lookback_by_layer(measured)))
        last[:] = [measured]
        measuring += time.perf_counter() - mark

    start = time.perf_counter()
    losses = train_steps(model, optim, config.steps, lambda step: training_batch(config, facts, step),
                         curve_steps=config.curve_steps, measure=at)
    seconds = time.perf_counter() - start - measuring
    end = curve[-1]
    return GroundedRun(
        seed=seed, lr=optim.lr, parameters=model.num_parameters(), train_seconds=seconds,
        train_tokens_per_second=config.steps * config.batch_size * config.length / seconds, losses=losses,
        scores=end.scores, lookback=end.lookback, lookback_auroc=lookback_auroc(last[0]), curve=curve,
        flops_per_token=flops_per_token(model.config, config.length),
    )


class GroundedModel(SearchedModel[GroundedRun]):
    """One model of the grounded experiment: its runs over the search, and its best."""


@dataclass
class GroundedResult:
    """The grounded experiment: its settings, the recipes searched and every model."""

    settings: GroundedConfig
    recipes: list[str]
    models: dict[str, GroundedModel]

    @property
    def tokens_per_model(self) -> int:
        return self.settings.steps * self.settings.batch_size * self.settings.length


def check_grounded(config: ExperimentConfig, names: Sequence[str]) -> None:
    """Every model the experiment would train built on paper, under each of its recipes, before the
    study starts (as :func:`~.retrieval.check_retrieval` for the retrieval experiment)."""
    for name in names:
        for recipe in tuple(config.grounded.recipes or config.compare.recipes) or (None,):
            small_model_or_error("grounded", config, name, recipe, config.grounded.model_config)


def run_experiment(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int], out_dir: Path, *,
                   lr_grid: Sequence[float] | None = None, recipes: Sequence[str] | None = None, jobs: int = 1,
                   resume: bool = False, progress: bool = True) -> GroundedResult:
    """Every model of ``names`` (their attention kinds and architecture switches, at the experiment's
    size), every seed, every init recipe of ``recipes`` (default: grounded.recipes, else compare.recipes;
    none: each model as configured) and every learning rate of the retrieval experiment's (``lr_grid``,
    default retrieval.lr_grid, else each model's grounded.lr_by_model entry or its retrieval lr under that
    recipe), trained with the
    retrieval experiment's optimizer. Each model is reported at its best (recipe, lr) by grounded
    accuracy. Each run's result is kept in OUT/<model>/[<recipe>/]lr-<lr>/seed-<s>.json; with
    ``resume`` a result already there is reused; ``jobs`` runs at a time."""
    settings = config.grounded
    recipe_list = tuple(recipes if recipes is not None else settings.recipes or config.compare.recipes) or (None,)
    grid = list(lr_grid if lr_grid is not None else config.retrieval.lr_grid)
    axes = Axes(models=tuple(names), seeds=tuple(seeds), recipes=recipe_list,
                lrs=learning_rates(names, recipe_list, grid, lambda m, r: config.lr_for(m, r, "grounded")))
    jobs_list = [PoolJob(key, key.describe(), out_dir / f"{key.path}.json", run_one,
                         (settings, config.retrieval_optim(key.lr), config.attention(key.model), key.seed,
                          retrieval_fields(config, key.model, key.recipe), config.train.model(key.model).diff_heads),
                         GroundedRun.from_dict)
                 for key in axes.keys()]

    def describe(job: PoolJob, run: GroundedRun) -> str:
        s = run.scores
        return (f"grounded {job.label}: accuracy {s.accuracy:.3f} (faithful {s.faithful:.3f}, prior override "
                f"{s.prior_override:.3f}, fabrication {s.fabrication:.3f}, abstention {s.abstention:.3f}), "
                f"{run.train_tokens_per_second:,.0f} tokens/s")

    results = run_jobs(jobs_list, resume=resume, at_once=jobs, progress=progress, describe=describe)
    sweeps = sweep(results, lambda run: run.score, lower_is_better=False)
    models = {name: GroundedModel(config.model_name(name), config.attention(name), sweeps[name, None, None])
              for name in names}
    return GroundedResult(settings, [r for r in recipe_list if r is not None], models)
