"""The retrieval experiment: small models trained on generated key-value retrieval, then tested
by difficulty, with the attention each puts on the answer and on the noise around it.

The paper's central claim (Tables 2-3, Figure 1) is that differential attention finds key
information amid noise. Its multi-needle test needs billions of tokens of language modelling
before a model answers at all, so at CPU scale both models score zero and nothing is measured.
This experiment trains the skill directly, in the style of the Zoology benchmarks (Arora et
al., 2023), on a small symbolic vocabulary where a 2-layer model learns it in about a minute:
multi-needle documents and multi-query associative recall (:mod:`diff_transformer.data.synthetic`,
"symbolic retrieval").

Every model of the comparison sees the same batches (one data seed) and the same recipe (the
config's optimizer through the trainer's step, :mod:`diff_transformer.train.step`); each learning
rate of the grid is tried on every model, every model is reported at its own best. Accuracy is the
share of answer tokens predicted exactly (argmax over the whole vocabulary); chance is 1 / values.

Attention to the answer (paper Table 3): on needle documents, the row of the query's key token
(the one that predicts the answer) in each layer, averaged over heads, divided by the row sum
(1 for softmax, 1 − λ for DIFF), split into the queried needle's three tokens ("answer"), the
noise and distractor needles ("noise"), and the query itself ("other").
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..attention import AttentionTap
from ..config import ConfigError
from ..data.synthetic import SymbolicExample, symbolic_batch, symbolic_mqar, symbolic_needle
from ..evaluation.attention_noise import MIN_ROW_SUM
from ..evaluation.quantization import QuantizeTap
from ..evaluation.stats import MeanStd
from ..loss import IGNORE_INDEX
from ..model import LanguageModel
from ..ops import AttentionMaps
from ..train.budget import flops_per_token
from ..train.config import OptimConfig
from ..train.step import InProcessTraining
from .config import ExperimentConfig, RetrievalConfig, retrieval_examples_per_step
from .results import AnswerShares, CurvePoint, RetrievalRun
from .runner import PoolJob, run_jobs
from .study import Axes, SearchedModel, learning_rates, sweep

TASKS = ("needle", "mqar")
EvaluationSets = dict[str, dict[str, list[SymbolicExample]]]  # task -> difficulty cell -> examples


def training_batch(config: RetrievalConfig, step: int) -> tuple[Tensor, Tensor]:
    """The batch of ``step``: the same for every model and seed (seeded by data_seed and step)."""
    rng = random.Random(f"retrieval-train/{config.data_seed}/{step}")
    count = retrieval_examples_per_step(config.batch_size)
    task = config.task
    examples = [symbolic_needle(rng, task, rng.choice(config.needles), rng.random()) for _ in range(count["needle"])]
    examples += [symbolic_mqar(rng, task, rng.choice(config.pairs)) for _ in range(count["mqar"])]
    return symbolic_batch(examples)


def evaluation_sets(config: RetrievalConfig) -> EvaluationSets:
    """Held-out examples per difficulty cell: needle "N=4,depth=0.5", mqar "D=16"."""
    rng = random.Random(f"retrieval-eval/{config.data_seed}")
    task = config.task
    needle = {f"N={n},depth={d:g}": [symbolic_needle(rng, task, n, d) for _ in range(config.eval_samples)]
              for n in config.needles for d in config.depths}
    mqar = {f"D={p}": [symbolic_mqar(rng, task, p) for _ in range(config.eval_samples)] for p in config.pairs}
    return {"needle": needle, "mqar": mqar}


@torch.no_grad()
def accuracy(model: LanguageModel, examples: Sequence[SymbolicExample], batch_size: int = 64) -> float:
    """Share of answer tokens whose argmax prediction is exact."""
    correct = total = 0
    for start in range(0, len(examples), batch_size):
        inputs, targets = symbolic_batch(examples[start : start + batch_size])
        logits, _ = model(inputs)
        scored = targets != IGNORE_INDEX
        correct += int((logits.argmax(-1)[scored] == targets[scored]).sum())
        total += int(scored.sum())
    return correct / total


def cell_accuracies(model: LanguageModel, sets: EvaluationSets) -> dict[str, dict[str, float]]:
    """Accuracy on every difficulty cell: {task: {cell: accuracy}}."""
    return {task: {cell: accuracy(model, examples) for cell, examples in by_cell.items()}
            for task, by_cell in sets.items()}


class _AnswerRowTap(AttentionTap):
    """Keeps, per layer, the effective map's row of the last query position: (B, H, S)."""

    def __init__(self) -> None:
        self.rows: dict[int, Tensor] = {}

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        self.rows[layer_index] = maps.combined[:, :, -1, :].float()


@torch.no_grad()
def attention_allocation(model: LanguageModel, examples: Sequence[SymbolicExample]) -> list[AnswerShares | None]:
    """Per layer: the mean share of the answer row's attention on the answer, noise and other
    columns (see :func:`attention_shares`), from the model's effective maps."""
    inputs, _ = symbolic_batch(examples)
    tap = _AnswerRowTap()
    with model.tap_attention(tap):
        model(inputs)
    return attention_shares([tap.rows[layer] for layer in sorted(tap.rows)], examples)


def attention_shares(rows: Sequence[Tensor], examples: Sequence[SymbolicExample]) -> list[AnswerShares | None]:
    """``rows[layer]`` (B, H, S): each example's answer row. Per layer, the row averaged over heads
    and divided by its sum (1 for softmax, 1 − λ for DIFF), summed over the queried needle's tokens
    ("answer"), the query ("other") and everything else ("noise"), averaged over examples. A
    layer whose row sum is below MIN_ROW_SUM (DIFF with λ near 1) has no meaningful share: None."""
    length = rows[0].shape[-1]
    masks = torch.zeros(3, len(examples), length, dtype=torch.bool)  # answer, noise, other
    for i, example in enumerate(examples):
        start, end = example.answer_span
        masks[0, i, start:end] = True
        masks[2, i, example.query_start:] = True
        masks[1, i] = ~(masks[0, i] | masks[2, i])
    out: list[AnswerShares | None] = []
    for row in rows:
        row = row.mean(1)  # (B, S)
        total = row.sum(-1, keepdim=True)
        if total.min() < MIN_ROW_SUM:
            out.append(None)
            continue
        row = row / total
        out.append(AnswerShares(*((row * m).sum(-1).mean().item() for m in masks.float())))
    return out


def train_model(model: LanguageModel, config: RetrievalConfig, optim: OptimConfig, *,
                measure: Callable[[int], None] | None = None) -> list[float]:
    """Train on the retrieval experiment's generated batches (:func:`train_steps`); ``measure(step)``
    at each of ``config.curve_steps``."""
    return train_steps(model, optim, config.steps, lambda step: training_batch(config, step),
                       curve_steps=config.curve_steps, measure=measure)


def train_steps(model: LanguageModel, optim: OptimConfig, steps: int, batch: Callable[[int], tuple[Tensor, Tensor]],
                *, curve_steps: Sequence[int] = (), measure: Callable[[int], None] | None = None) -> list[float]:
    """Train a small model in this process for ``steps`` steps on ``batch(step)`` (inputs, targets)
    through the trainer's step (:class:`InProcessTraining`, ``optim``'s AdamW, schedule and clipping);
    returns the training loss every 10 steps. ``measure(step)`` is called, with the model in eval mode,
    at each of ``curve_steps`` (after that many steps)."""
    training = InProcessTraining(model, optim, steps)
    points = set(curve_steps) if measure is not None else set()
    losses = []
    for step in range(steps + 1):
        if step in points:
            model.eval()
            measure(step)
        if step == steps:
            break
        loss = training.step(*batch(step))
        if step % 10 == 0 or step == steps - 1:
            losses.append(loss)
    model.eval()
    return losses


def curve_area(points: Sequence[tuple[float, float]]) -> float:
    """The area under a learning curve [(examples, accuracy), ...] (trapezoids, from its first point
    to its last) divided by its width: the mean accuracy over training."""
    width = points[-1][0] - points[0][0]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    return area / width if width > 0 else points[-1][1]


def examples_to_reach(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The examples at which a learning curve [(examples, accuracy), ...] first reaches ``target``
    (linear between measured points), or None if it never does."""
    if points[0][1] >= target:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


@dataclass
class LearningCurve:
    """What :func:`learning_curve` measured: accuracy before training and after each curve step, the
    mean accuracy over training per task, the training losses, the seconds of the steps alone."""

    curve: list[CurvePoint]
    curve_area: dict[str, float]
    losses: list[float]
    train_seconds: float


def learning_curve(model: torch.nn.Module, config: RetrievalConfig, optim: OptimConfig,
                   sets: EvaluationSets | None = None) -> LearningCurve:
    """Train ``model`` (any module called as LanguageModel is) and measure its accuracy on every cell
    before training and after each of ``config.curve_steps``."""
    sets = sets or evaluation_sets(config)
    curve: list[CurvePoint] = []
    measuring = 0.0

    def measure(step: int) -> None:
        nonlocal measuring
        mark = time.perf_counter()
        cells = cell_accuracies(model, sets)
        curve.append(CurvePoint(step, cells, {task: statistics.fmean(c.values()) for task, c in cells.items()}))
        measuring += time.perf_counter() - mark

    start = time.perf_counter()
    losses = train_model(model, config, optim, measure=measure)
    area = {task: curve_area([(config.examples_seen(task, p.step), p.mean_accuracy[task]) for p in curve])
            for task in TASKS}
    return LearningCurve(curve, area, losses, time.perf_counter() - start - measuring)


def run_one(config: RetrievalConfig, optim: OptimConfig, attention: str, seed: int,
            model_fields: dict | None = None, diff_heads: bool = False) -> RetrievalRun:
    """Train one model (``seed`` sets its initialisation; ``diff_heads``: DIFF's head count for a kind of
    ordinary heads, the wide-head Transformer) and measure it on every cell, along training
    (``config.curve_steps``) and at the end."""
    torch.manual_seed(seed)
    model = LanguageModel(config.model_config(attention, diff_heads=diff_heads, **(model_fields or {})))
    sets = evaluation_sets(config)
    trained = learning_curve(model, config, optim, sets)
    hardest = max(config.needles)
    probe = [e for d in config.depths for e in sets["needle"][f"N={hardest},depth={d:g}"]]
    # Attention logits quantised (absmax per row, every map of every layer) on the hardest cells.
    hard_set = probe + sets["mqar"][f"D={max(config.pairs)}"]
    quantized = {}
    for bits in [None, *config.quantize_bits]:
        with model.tap_attention(QuantizeTap(bits)):
            quantized["full" if bits is None else str(bits)] = accuracy(model, hard_set)
    end = trained.curve[-1]
    return RetrievalRun(
        seed=seed, lr=optim.lr, parameters=model.num_parameters(), train_seconds=trained.train_seconds,
        train_tokens_per_second=config.steps * config.batch_size * config.length / trained.train_seconds,
        losses=trained.losses, accuracy=end.accuracy, mean_accuracy=end.mean_accuracy, curve=trained.curve,
        curve_area=trained.curve_area, attention=attention_allocation(model, probe), attention_needles=hardest,
        quantized_accuracy=quantized, flops_per_token=flops_per_token(model.config, config.length),
    )


# Architecture fields of a model entry that the retrieval models do not take over (sizes are the experiment's own).
SIZE_FIELDS = {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "ffn_hidden"}


def retrieval_fields(config: ExperimentConfig, name: str, recipe: str | None) -> dict:
    """Model ``name``'s ModelConfig fields in the small models under ``recipe``: its architecture
    switches without its sizes, then its entry's ``small_model`` fields (which may set its heads)."""
    own = {k: v for k, v in config.entry_fields(name, recipe).items() if k not in SIZE_FIELDS}
    return {**own, **config.train.model(name).small_model}


def small_model_or_error(section: str, config: ExperimentConfig, name: str, recipe: str | None, build) -> None:
    """``build(attention, diff_heads=..., **fields)`` for model ``name`` (a section's model_config): a
    ConfigError naming the experiment and the model where the small size cannot hold the model."""
    try:
        build(config.attention(name), diff_heads=config.train.model(name).diff_heads,
              **retrieval_fields(config, name, recipe))
    except ConfigError as exc:
        raise ConfigError(f"{section}: models.{name} at the {section} experiment's size: {exc} (its "
                          f"models.{name}.small_model sets its own fields there)") from None


def check_retrieval(config: ExperimentConfig, names: Sequence[str], recipes: Sequence[str] | None = None) -> None:
    """Every model the experiment would train built on paper (:func:`run_experiment`'s ``recipes``):
    a model field that contradicts a recipe, or a model the experiment's size cannot have, is refused
    before the study starts, not after its language models trained."""
    for name in names:
        for recipe in tuple(recipes if recipes is not None else config.compare.recipes) or (None,):
            small_model_or_error("retrieval", config, name, recipe, config.retrieval.model_config)


class RetrievalModel(SearchedModel[RetrievalRun]):
    """One model of the retrieval experiment: its runs over the search, and its best."""


@dataclass
class RetrievalResult:
    """The retrieval experiment: its settings, the recipes searched and every model."""

    settings: RetrievalConfig
    recipes: list[str]
    models: dict[str, RetrievalModel]

    @property
    def chance(self) -> float:
        return 1 / self.settings.values

    @property
    def tokens_per_model(self) -> int:
        return self.settings.steps * self.settings.batch_size * self.settings.length

    @property
    def curve_steps(self) -> list[int]:
        return self.settings.curve_steps


def accuracy_stats(runs: Sequence[RetrievalRun], task: str, cell: str | None = None) -> MeanStd:
    """Mean ± std over seeds of one task's accuracy: of one cell, or of the task's mean."""
    return MeanStd.of(r.accuracy[task][cell] if cell else r.mean_accuracy[task] for r in runs)


def run_experiment(config: ExperimentConfig, names: Sequence[str], seeds: Sequence[int], out_dir: Path, *,
                   lr_grid: Sequence[float] | None = None, recipes: Sequence[str] | None = None, jobs: int = 1,
                   resume: bool = False, progress: bool = True) -> RetrievalResult:
    """Every model of ``names`` (their attention kinds and architecture switches, at the
    experiment's size), every seed, every init recipe of ``recipes`` (default: compare.recipes; none:
    each model as configured) and every learning rate of the grid (default: retrieval.lr_grid, else
    each model's retrieval lr under that recipe). Each model is reported at its best (recipe, lr) and,
    per recipe, at its best lr there (highest mean accuracy over seeds). Each run's result is kept in
    OUT/<model>/[<recipe>/]lr-<lr>/seed-<s>.json; with ``resume`` a result already there is reused.
    ``jobs`` runs train at the same time, in worker processes of cores / jobs threads each."""
    settings = config.retrieval
    recipe_list = tuple(recipes if recipes is not None else config.compare.recipes) or (None,)
    grid = list(lr_grid if lr_grid is not None else settings.lr_grid)
    axes = Axes(models=tuple(names), seeds=tuple(seeds), recipes=recipe_list,
                lrs=learning_rates(names, recipe_list, grid, lambda m, r: config.lr_for(m, r, "retrieval")))
    jobs_list = [PoolJob(key, key.describe(), out_dir / f"{key.path}.json", run_one,
                         (settings, config.retrieval_optim(key.lr), config.attention(key.model), key.seed,
                          retrieval_fields(config, key.model, key.recipe), config.train.model(key.model).diff_heads),
                         RetrievalRun.from_dict)
                 for key in axes.keys()]

    def describe(job: PoolJob, run: RetrievalRun) -> str:
        return (f"retrieval {job.label}: accuracy needle {run.mean_accuracy['needle']:.3f}, mqar "
                f"{run.mean_accuracy['mqar']:.3f}, {run.train_tokens_per_second:,.0f} tokens/s")

    results = run_jobs(jobs_list, resume=resume, at_once=jobs, progress=progress, describe=describe)
    sweeps = sweep(results, lambda run: run.score, lower_is_better=False)
    models = {name: RetrievalModel(config.model_name(name), config.attention(name), sweeps[name, None, None])
              for name in names}
    return RetrievalResult(settings, [r for r in recipe_list if r is not None], models)


def with_length(settings: RetrievalConfig, length: int) -> RetrievalConfig:
    """The same experiment at another example length (longer examples hold more noise)."""
    return dataclasses.replace(settings, length=length)
