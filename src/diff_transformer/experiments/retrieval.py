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

import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from ..attention import AttentionTap
from ..model import LanguageModel
from ..ops import AttentionMaps
from ..evaluation.attention_noise import MIN_ROW_SUM
from ..evaluation.output import write_json
from ..evaluation.quantization import QuantizeTap
from ..train.config import OptimConfig, RetrievalConfig, TrainConfig
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
    half = config.batch_size // 2
    examples = [needle_example(rng, config, rng.choice(config.needles), rng.random()) for _ in range(half)]
    examples += [mqar_example(rng, config, rng.choice(config.pairs)) for _ in range(config.batch_size - half)]
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


def train_model(model: LanguageModel, config: RetrievalConfig, lr: float) -> list[float]:
    """Train on generated batches with AdamW, linear warmup and decay to lr/10 (the LM recipe's
    parameter groups); returns the training loss every 10 steps."""
    optim = OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=config.warmup_steps, betas=(0.9, 0.95),
                        weight_decay=config.weight_decay)
    optimizer = build_optimizer(model, optim, torch.device("cpu"))
    schedule = WarmupLinearSchedule(optimizer, optim, config.steps)
    losses = []
    model.train()
    for step in range(config.steps):
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


def run_one(config: RetrievalConfig, attention: str, seed: int, lr: float, model_fields: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Train one model (``seed`` sets its initialisation) and measure it on every cell."""
    torch.manual_seed(seed)
    model = LanguageModel(config.model_config(attention, **(model_fields or {})))
    start = time.perf_counter()
    losses = train_model(model, config, lr)
    seconds = time.perf_counter() - start
    sets = evaluation_sets(config)
    cells = {task: {cell: accuracy(model, examples) for cell, examples in by_cell.items()}
             for task, by_cell in sets.items()}
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
        "losses": losses,
        "accuracy": cells,
        "mean_accuracy": {task: sum(c.values()) / len(c) for task, c in cells.items()},
        "attention": attention_allocation(model, probe),
        "attention_needles": hardest,
        "quantized_accuracy": quantized,
    }


# Architecture fields of a model entry that the retrieval models take over (sizes are the experiment's own).
_SIZE_FIELDS = {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "ffn_hidden"}


def run_experiment(config: TrainConfig, names: Sequence[str], seeds: Sequence[int], out_dir: Path, *,
                   lr_grid: Sequence[float] | None = None, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Every model of ``names`` (their attention kinds and architecture switches, at the
    experiment's size), every seed, every learning rate of the grid (default: retrieval.lr_grid,
    else each model's retrieval_lr or retrieval.lr); each model reported at its best learning
    rate (highest mean accuracy over seeds). Each run's result is kept in OUT/<model>/lr-<lr>/
    seed-<s>.json; with ``resume`` a result already there is reused."""
    settings = config.retrieval
    grid = list(lr_grid if lr_grid is not None else settings.lr_grid)
    runs: dict[str, dict[float, list[dict]]] = {}
    for name in names:
        runs[name] = {lr: [] for lr in grid or [config.models[name].retrieval_lr or settings.lr]}
    total = sum(len(v) for v in runs.values()) * len(seeds)
    position = 0
    for seed in seeds:
        for name, by_lr in runs.items():
            entry = config.models[name]
            fields = {k: v for k, v in entry.fields.items() if k not in _SIZE_FIELDS}
            for lr in by_lr:
                position += 1
                path = out_dir / name / f"lr-{lr:g}" / f"seed-{seed}.json"
                if resume and path.is_file():
                    result = json.loads(path.read_text())
                else:
                    result = run_one(settings, entry.attention, seed, lr, fields)
                    write_json(path, result)
                if progress:
                    print(f"[retrieval {position}/{total}] {name} lr {lr:g} (seed {seed}): accuracy needle "
                          f"{result['mean_accuracy']['needle']:.3f}, mqar {result['mean_accuracy']['mqar']:.3f}, "
                          f"{result['train_tokens_per_second']:,.0f} tokens/s", file=sys.stderr, flush=True)
                by_lr[lr].append(result)

    def score(results: list[dict]) -> float:
        return statistics.fmean(statistics.fmean(r["mean_accuracy"].values()) for r in results)

    models = {}
    for name, by_lr in runs.items():
        best = max(by_lr, key=lambda lr: score(by_lr[lr]))
        chosen = by_lr[best]
        models[name] = {
            "label": config.models[name].display_name,
            "attention": config.models[name].attention,
            "parameters": chosen[0]["parameters"],
            "best_lr": best,
            "sweep": {f"{lr:g}": mean_std([score([r]) for r in results]) for lr, results in by_lr.items()},
            "seeds": [r["seed"] for r in chosen],
            "runs": chosen,
            "train_tokens_per_second": mean_std([r["train_tokens_per_second"] for r in chosen]),
        }
    return {
        "settings": dataclasses.asdict(settings),
        "tokens_per_model": settings.steps * settings.batch_size * settings.length,
        "chance": 1 / settings.values,
        "models": models,
    }


def summarize(runs: list[dict], task: str, cell: str | None = None) -> dict[str, Any]:
    """Mean ± std over seeds of one task's accuracy: of one cell, or of the task's mean."""
    values = [r["accuracy"][task][cell] if cell else r["mean_accuracy"][task] for r in runs]
    return mean_std(values)
