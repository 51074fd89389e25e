"""The retrieval experiment: small models trained on generated key-value retrieval, then tested
by difficulty, with the attention each puts on the answer and on the noise around it.

The paper's central claim (Tables 2-3, Figure 1) is that differential attention finds key
information amid noise. Its multi-needle test needs billions of tokens of language modelling
before a model answers at all, so at CPU scale both models score zero and nothing is measured.
This experiment trains the skill directly, in the style of the Zoology benchmarks (Arora et
al., 2023), on a small symbolic vocabulary where a 2-layer model learns it in about a minute:

    needle   BOS noise … NEEDLE k₁ v₁ … noise … NEEDLE k₂ v₂ … noise … QUERY kᵢ → vᵢ
             N needles (N − 1 distractors with other keys) among random noise tokens; the
             queried needle sits at a chosen depth; one answer token is scored.
    mqar     BOS k₁ v₁ k₂ v₂ … k_D v_D noise … kₐ → vₐ  k_b → v_b …
             multi-query associative recall: D pairs, then several of their keys again;
             every value after a repeated key is scored.

Both models of the comparison see the same batches (one data seed) and the same recipe; each
learning rate of the grid is tried on every model, every model is reported at its own best.
Accuracy is the share of answer tokens predicted exactly (argmax over the whole vocabulary);
chance is 1 / values.

Attention to the answer (paper Table 3): on needle documents, the row of the query's key token
(the one that predicts the answer) in each layer, averaged over heads, divided by the row sum
(1 for softmax, 1 − λ for DIFF), split into the queried needle's three tokens ("answer"), the
noise and distractor needles ("noise"), and the query itself ("other").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..attention import AttentionTap
from ..model import LanguageModel
from ..ops import AttentionMaps
from ..evaluation.attention_noise import MIN_ROW_SUM
from ..evaluation.output import write_json
from ..evaluation.quantization import QuantizeTap
from ..train.config import OptimConfig, RetrievalConfig, TrainConfig, retrieval_examples_per_step
from ..train.optim import WarmupLinearSchedule, build_optimizer
from .claims import mean_std

TASKS = ("needle", "mqar")
IGNORE = -100

# Token layout of the symbolic vocabulary: markers, then keys, values and noise tokens
# (RetrievalConfig.vocab_size counts them).
BOS, NEEDLE, QUERY = 0, 1, 2
FIRST_KEY = 4


@dataclass
class Example:
    """One generated example: ``tokens`` (length + 1), and the positions (in the model's input,
    i.e. predicting tokens[pos + 1]) whose next token is scored."""

    tokens: list[int]
    answer_positions: list[int]
    answer_span: tuple[int, int] = (0, 0)  # needle: [start, end) of the queried needle's tokens
    query_start: int = 0  # needle: where the query begins


class Vocabulary:
    def __init__(self, config: RetrievalConfig) -> None:
        self.keys = range(FIRST_KEY, FIRST_KEY + config.keys)
        self.values = range(self.keys.stop, self.keys.stop + config.values)
        self.noise = range(self.values.stop, self.values.stop + config.noise_tokens)


def needle_example(rng: random.Random, config: RetrievalConfig, n_needles: int, depth: float) -> Example:
    """BOS, noise with ``n_needles`` (NEEDLE key value) triples, then QUERY key → value.

    The queried needle starts at ``depth`` of the body (0 = first, 1 = last possible slot);
    the distractors take random free slots, keys are distinct.
    """
    vocab = Vocabulary(config)
    body = config.length - 2  # tokens[0] = BOS; the query's two tokens and the answer close the example
    n_body = body - 1
    keys = rng.sample(vocab.keys, n_needles)
    values = [rng.choice(vocab.values) for _ in keys]
    slots = n_body - 3 * n_needles  # noise tokens
    # Place needles as items among noise: the queried one at the position matching depth.
    queried = round(depth * slots)
    others = sorted(rng.randint(0, slots) for _ in range(n_needles - 1))
    starts_in_noise = sorted([(queried, 0)] + [(p, i + 1) for i, p in enumerate(others)])
    tokens = [BOS]
    span = (0, 0)
    noise_used = 0
    for position, index in starts_in_noise:
        tokens += [rng.choice(vocab.noise) for _ in range(position - noise_used)]
        noise_used = position
        if index == 0:
            span = (len(tokens), len(tokens) + 3)
        tokens += [NEEDLE, keys[index], values[index]]
    tokens += [rng.choice(vocab.noise) for _ in range(slots - noise_used)]
    query_start = len(tokens)
    tokens += [QUERY, keys[0], values[0]]
    assert len(tokens) == config.length + 1
    return Example(tokens, [config.length - 1], span, query_start)


def mqar_example(rng: random.Random, config: RetrievalConfig, n_pairs: int) -> Example:
    """BOS, ``n_pairs`` key-value pairs, noise, then ``queries`` of the keys again (default: all,
    shuffled), each followed by its value (scored)."""
    vocab = Vocabulary(config)
    keys = rng.sample(vocab.keys, n_pairs)
    values = [rng.choice(vocab.values) for _ in keys]
    tokens = [BOS]
    for k, v in zip(keys, values):
        tokens += [k, v]
    asked = rng.sample(range(n_pairs), config.queries or n_pairs)
    gap = config.length + 1 - len(tokens) - 2 * len(asked)
    tokens += [rng.choice(vocab.noise) for _ in range(gap)]
    positions = []
    for i in asked:
        tokens += [keys[i], values[i]]
        positions.append(len(tokens) - 2)  # the key's position predicts the value
    assert len(tokens) == config.length + 1
    return Example(tokens, positions)


def to_batch(examples: Sequence[Example]) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (B, length); targets are IGNORE except at the answers."""
    tokens = torch.tensor([e.tokens for e in examples])
    inputs = tokens[:, :-1]
    targets = torch.full_like(inputs, IGNORE)
    for row, example in enumerate(examples):
        for position in example.answer_positions:
            targets[row, position] = tokens[row, position + 1]
    return inputs, targets


def training_batch(config: RetrievalConfig, step: int) -> tuple[Tensor, Tensor]:
    """The batch of ``step``: the same for every model and seed (seeded by data_seed and step)."""
    rng = random.Random(f"retrieval-train/{config.data_seed}/{step}")
    count = retrieval_examples_per_step(config.batch_size)
    examples = [needle_example(rng, config, rng.choice(config.needles), rng.random()) for _ in range(count["needle"])]
    examples += [mqar_example(rng, config, rng.choice(config.pairs)) for _ in range(count["mqar"])]
    return to_batch(examples)


def evaluation_sets(config: RetrievalConfig) -> dict[str, dict[str, list[Example]]]:
    """Held-out examples per difficulty cell: needle "N=4,depth=0.5", mqar "D=16"."""
    rng = random.Random(f"retrieval-eval/{config.data_seed}")
    needle = {f"N={n},depth={d:g}": [needle_example(rng, config, n, d) for _ in range(config.eval_samples)]
              for n in config.needles for d in config.depths}
    mqar = {f"D={p}": [mqar_example(rng, config, p) for _ in range(config.eval_samples)] for p in config.pairs}
    return {"needle": needle, "mqar": mqar}


@torch.no_grad()
def accuracy(model: LanguageModel, examples: Sequence[Example], batch_size: int = 64) -> float:
    """Share of answer tokens whose argmax prediction is exact."""
    correct = total = 0
    for start in range(0, len(examples), batch_size):
        inputs, targets = to_batch(examples[start : start + batch_size])
        logits, _ = model(inputs)
        scored = targets != IGNORE
        correct += int((logits.argmax(-1)[scored] == targets[scored]).sum())
        total += int(scored.sum())
    return correct / total


class _AnswerRowTap(AttentionTap):
    """Keeps, per layer, the effective map's row of the last query position: (B, H, S)."""

    def __init__(self) -> None:
        self.rows: dict[int, Tensor] = {}

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        self.rows[layer_index] = maps.combined[:, :, -1, :].float()


@torch.no_grad()
def attention_allocation(model: LanguageModel, examples: Sequence[Example]) -> list[dict[str, float] | None]:
    """Per layer: the mean share of the answer row's attention on the answer, noise and other
    columns (see :func:`attention_shares`), from the model's effective maps."""
    inputs, _ = to_batch(examples)
    tap = _AnswerRowTap()
    with model.tap_attention(tap):
        model(inputs)
    return attention_shares([tap.rows[layer] for layer in sorted(tap.rows)], examples)


def attention_shares(rows: Sequence[Tensor], examples: Sequence[Example]) -> list[dict[str, float] | None]:
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
    out = []
    for row in rows:
        row = row.mean(1)  # (B, S)
        total = row.sum(-1, keepdim=True)
        if total.min() < MIN_ROW_SUM:
            out.append(None)
            continue
        row = row / total
        shares = [(row * m).sum(-1).mean().item() for m in masks.float()]
        out.append(dict(zip(("answer", "noise", "other"), shares)))
    return out


def train_model(model: LanguageModel, config: RetrievalConfig, lr: float, *,
                measure: Callable[[int], None] | None = None) -> list[float]:
    """Train on generated batches with AdamW, linear warmup and decay to lr/10 (the LM recipe's
    parameter groups); returns the training loss every 10 steps. ``measure(step)`` is called, with
    the model in eval mode, at each of ``config.curve_steps`` (after that many steps)."""
    optim = OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=config.warmup_steps, betas=(0.9, 0.95),
                        weight_decay=config.weight_decay)
    optimizer = build_optimizer(model, optim, torch.device("cpu"))
    schedule = WarmupLinearSchedule(optimizer, optim, config.steps)
    points = set(config.curve_steps) if measure is not None else set()
    losses = []
    for step in range(config.steps + 1):
        if step in points:
            model.eval()
            measure(step)
        if step == config.steps:
            break
        model.train()
        inputs, targets = training_batch(config, step)
        _, loss = model(inputs, targets, return_logits=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % 10 == 0 or step == config.steps - 1:
            losses.append(loss.item())
    model.eval()
    return losses


def cell_accuracies(model: LanguageModel, sets: dict[str, dict[str, list[Example]]]) -> dict[str, dict[str, float]]:
    """Accuracy on every difficulty cell: {task: {cell: accuracy}}."""
    return {task: {cell: accuracy(model, examples) for cell, examples in by_cell.items()} for task, by_cell in sets.items()}


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


def learning_curve(model: torch.nn.Module, config: RetrievalConfig, lr: float,
                   sets: dict[str, dict[str, list[Example]]] | None = None) -> dict[str, Any]:
    """Train ``model`` (any module called as LanguageModel is) and measure its accuracy on every cell
    before training and after each of ``config.curve_steps``: {"curve": [{step, accuracy, mean_accuracy}],
    "curve_area": {task: mean accuracy over training}, "losses", "train_seconds" (the steps alone)}."""
    sets = sets or evaluation_sets(config)
    curve = []
    measuring = 0.0

    def measure(step: int) -> None:
        nonlocal measuring
        mark = time.perf_counter()
        cells = cell_accuracies(model, sets)
        curve.append({"step": step, "accuracy": cells,
                      "mean_accuracy": {task: statistics.fmean(c.values()) for task, c in cells.items()}})
        measuring += time.perf_counter() - mark

    start = time.perf_counter()
    losses = train_model(model, config, lr, measure=measure)
    return {
        "curve": curve,
        "curve_area": {task: curve_area([(config.examples_seen(task, p["step"]), p["mean_accuracy"][task])
                                         for p in curve]) for task in TASKS},
        "losses": losses,
        "train_seconds": time.perf_counter() - start - measuring,
    }


def run_one(config: RetrievalConfig, attention: str, seed: int, lr: float, model_fields: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Train one model (``seed`` sets its initialisation) and measure it on every cell, along
    training (``config.curve_steps``) and at the end."""
    torch.manual_seed(seed)
    model = LanguageModel(config.model_config(attention, **(model_fields or {})))
    sets = evaluation_sets(config)
    trained = learning_curve(model, config, lr, sets)
    curve, seconds = trained["curve"], trained["train_seconds"]
    cells = curve[-1]["accuracy"]
    hardest = max(config.needles)
    probe = [e for d in config.depths for e in sets["needle"][f"N={hardest},depth={d:g}"]]
    # Attention logits quantised (absmax per row, every map of every layer) on the hardest cells.
    hard_set = probe + sets["mqar"][f"D={max(config.pairs)}"]
    quantized = {}
    for bits in [None, *config.quantize_bits]:
        with model.tap_attention(QuantizeTap(bits)):
            quantized["full" if bits is None else str(bits)] = accuracy(model, hard_set)
    return {
        "seed": seed,
        "lr": lr,
        "parameters": model.num_parameters(),
        "train_seconds": seconds,
        "train_tokens_per_second": config.steps * config.batch_size * config.length / seconds,
        "losses": trained["losses"],
        "accuracy": cells,
        "mean_accuracy": curve[-1]["mean_accuracy"],
        "curve": curve,
        "curve_area": trained["curve_area"],
        "attention": attention_allocation(model, probe),
        "attention_needles": hardest,
        "quantized_accuracy": quantized,
    }


# Architecture fields of a model entry that the retrieval models take over (sizes are the experiment's own).
_SIZE_FIELDS = {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "ffn_hidden"}


def run_experiment(config: TrainConfig, names: Sequence[str], seeds: Sequence[int], out_dir: Path, *,
                   lr_grid: Sequence[float] | None = None, recipes: Sequence[str] | None = None, jobs: int = 1,
                   resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Every model of ``names`` (their attention kinds and architecture switches, at the
    experiment's size), every seed, every init recipe of ``recipes`` (default: compare.recipes; none:
    each model as configured) and every learning rate of the grid (default: retrieval.lr_grid, else
    each model's retrieval lr under that recipe). Each model is reported at its best (recipe, lr)
    and, per recipe, at its best lr there (highest mean final accuracy over seeds). Each run's result
    is kept in OUT/<model>/[<recipe>/]lr-<lr>/seed-<s>.json; with ``resume`` a result already there is
    reused. ``jobs`` runs train at the same time, in worker processes of cores / jobs threads each."""
    settings = config.retrieval
    grid = list(lr_grid if lr_grid is not None else settings.lr_grid)
    recipe_list: list[str | None] = list(recipes if recipes is not None else config.compare.recipes) or [None]
    runs: dict[str, dict[str | None, dict[float, list[dict]]]] = {
        name: {recipe: {lr: [] for lr in grid or [config.lr_for(name, recipe, "retrieval")]} for recipe in recipe_list}
        for name in names
    }
    units = [(seed, name, recipe, lr) for seed in seeds for name in names for recipe in recipe_list
             for lr in runs[name][recipe]]
    paths = {unit: out_dir / unit[1] / (unit[2] or "") / f"lr-{unit[3]:g}" / f"seed-{unit[0]}.json" for unit in units}
    results: dict[tuple, dict] = {}
    pending = []
    for unit in units:
        if resume and paths[unit].is_file():
            results[unit] = json.loads(paths[unit].read_text())
        else:
            seed, name, recipe, lr = unit
            fields = {k: v for k, v in config.entry_fields(name, recipe).items() if k not in _SIZE_FIELDS}
            pending.append((unit, (settings, config.models[name].attention, seed, lr, fields)))

    def done(unit: tuple, result: dict, position: int) -> None:
        write_json(paths[unit], result)
        results[unit] = result
        if progress:
            seed, name, recipe, lr = unit
            print(f"[retrieval {position}/{len(pending)}] {name}{f' {recipe}' if recipe else ''} lr {lr:g} (seed {seed}): "
                  f"accuracy needle {result['mean_accuracy']['needle']:.3f}, mqar {result['mean_accuracy']['mqar']:.3f}, "
                  f"{result['train_tokens_per_second']:,.0f} tokens/s", file=sys.stderr, flush=True)

    if jobs > 1 and len(pending) > 1:
        run_in_pool(run_one, pending, jobs, done)
    else:
        for position, (unit, arguments) in enumerate(pending, 1):
            done(unit, run_one(*arguments), position)
    for unit in units:
        seed, name, recipe, lr = unit
        runs[name][recipe][lr].append(results[unit])

    def score(results: list[dict]) -> float:
        return statistics.fmean(statistics.fmean(r["mean_accuracy"].values()) for r in results)

    models = {}
    for name, by_recipe in runs.items():
        per_recipe = {}
        for recipe, by_lr in by_recipe.items():
            best = max(by_lr, key=lambda lr: score(by_lr[lr]))
            per_recipe[recipe] = {"best_lr": best, "score": score(by_lr[best]), "runs": by_lr[best],
                                  "sweep": {f"{lr:g}": mean_std([score([r]) for r in rs]) for lr, rs in by_lr.items()}}
        best_recipe = max(per_recipe, key=lambda r: per_recipe[r]["score"])
        chosen = per_recipe[best_recipe]
        models[name] = {
            "label": config.models[name].display_name,
            "attention": config.models[name].attention,
            "parameters": chosen["runs"][0]["parameters"],
            "best_lr": chosen["best_lr"],
            "best_recipe": best_recipe,
            "sweep": chosen["sweep"],
            "seeds": [r["seed"] for r in chosen["runs"]],
            "runs": chosen["runs"],
            "recipes": {recipe: {k: v for k, v in entry.items() if k != "score"} for recipe, entry in per_recipe.items()
                        if recipe is not None},
            "train_tokens_per_second": mean_std([r["train_tokens_per_second"] for r in chosen["runs"]]),
        }
    return {
        "settings": dataclasses.asdict(settings),
        "tokens_per_model": settings.steps * settings.batch_size * settings.length,
        "chance": 1 / settings.values,
        "recipes": [r for r in recipe_list if r is not None],
        "curve_steps": settings.curve_steps,
        "models": models,
    }


def threads_per_job(jobs: int) -> int:
    """The CPU threads each of ``jobs`` runs at a time gets: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or jobs) // jobs)


def _worker_init(threads: int) -> None:
    """A pool worker: ``threads`` CPU threads; Ctrl-C is the parent's to handle (a run in progress
    finishes and is saved, the rest are cancelled)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def run_in_pool(function: Callable[..., dict], pending: list[tuple[tuple, tuple]], jobs: int,
                done: Callable[[tuple, dict, int], None]) -> None:
    """``function(*arguments)`` for every (unit, arguments) of ``pending`` in ``jobs`` worker processes
    (each with cores / jobs threads), ``done(unit, result, position)`` as each finishes. Ctrl-C waits
    for the runs in progress and cancels the rest; what ``done`` saved stays for --resume."""
    threads = threads_per_job(jobs)
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's thread pools
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init,
                                                initargs=(threads,)) as pool:
        futures = {pool.submit(function, *arguments): unit for unit, arguments in pending}
        try:
            for position, future in enumerate(concurrent.futures.as_completed(futures), 1):
                done(futures[future], future.result(), position)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def summarize(runs: list[dict], task: str, cell: str | None = None) -> dict[str, Any]:
    """Mean ± std over seeds of one task's accuracy: of one cell, or of the task's mean."""
    values = [r["accuracy"][task][cell] if cell else r["mean_accuracy"][task] for r in runs]
    return mean_std(values)
