"""Quantised attention logits (paper Figure 8): absmax dynamic quantisation at inference.

Every pre-softmax attention logit of every map (both maps of a DIFF head, GDA's signal and noise
maps, DIFF V2's 2H query heads, MTA's logits after its convolution and head mixing: what each
softmax reads; tests/test_eval_maps.py) is replaced, in every layer, by

    scale = absmax / (2^(bits-1) - 1),   x̂ = clamp(round(x / scale), ±(2^(bits-1) - 1)) · scale

with ``absmax`` the largest |logit| among the positions the query can see (masked positions
never set the scale), per row (each query of each head: the default, as per-token activation
quantisation) or per head (each (sequence, head) map). The scale is computed afresh on every
forward pass (dynamic). Everything else stays in fp32.

Per bit width (and unquantised, "fp32", through the same reference attention path) it measures:
- validation loss on held-out windows (and each window's own, ``per_window_loss``);
- cloze accuracy: a multiple-choice task in the style of HellaSwag made from held-out text: a
  context, its true continuation and continuations taken from elsewhere, chosen by the sum of
  log-probabilities (chance = 1 / choices);
- needle accuracy: exact match of the answer numbers of needle documents, under teacher forcing
  (all answer tokens are the argmax; the same as greedy decoding of that tokenization).
Invariant (tested): 16 bits changes the loss by less than 1e-4 nats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from ..progress import progress as progress_bar

from ..attention import AttentionTap
from ..data.synthetic import build_needle_example
from .. import paper
from .models import ModelUnderTest
from .needle import parse_setting
from .options import Evaluation, option
from .output import (
    comparison_sentence,
    fmt,
    markdown_table,
    model_colors,
    new_figure,
    pairs_to_compare,
    save_figure,
)
from .scoring import score_sequences, token_nll
from .stats import seeded_rng
from .texts import EvalText

NAME = "quantization"
GRANULARITIES = ("row", "head")


@dataclass
class QuantizationOptions:
    bits: tuple[int, ...] = option((16, 8, 6, 4), "bit widths of the attention logits", minimum=2, maximum=24)
    granularity: str = option("row", "absmax over each query row ('row') or each head's whole map ('head')",
                              choices=GRANULARITIES)
    loss_windows: int = option(16, "held-out windows for the validation loss")
    cloze_items: int = option(64, "multiple-choice cloze items")
    cloze_choices: int = option(4, "choices per cloze item")
    cloze_context: int = option(48, "context tokens of a cloze item")
    cloze_continuation: int = option(12, "continuation tokens of a cloze item")
    needle_setting: str = option("2:1", "N:R of the needle documents", check=lambda s: parse_setting(s))
    needle_samples: int = option(24, "needle documents")
    batch_size: int = option(8, "sequences per forward pass")
    seed: int = option(0, "seed of the cloze items and needle documents")

    @classmethod
    def quick(cls) -> "QuantizationOptions":
        return cls(bits=(16, 4), loss_windows=2, cloze_items=8, needle_samples=4)


def quantize_absmax(logits: Tensor, visible: Tensor | None, bits: int, granularity: str = "row") -> Tensor:
    """Absmax-quantise logits (.., T, S) to ``bits`` (signed, symmetric) and dequantise them.

    ``visible`` (broadcastable bool, True = the query sees the key) limits the absmax; None = all.
    """
    if not 2 <= bits <= 24:
        raise ValueError(f"bits must be in [2, 24], got {bits}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    levels = 2 ** (bits - 1) - 1
    magnitude = logits.abs() if visible is None else logits.abs().masked_fill(~visible, 0.0)
    dims = (-1,) if granularity == "row" else (-2, -1)
    scale = magnitude.amax(dim=dims, keepdim=True).clamp_min(1e-12) / levels
    return torch.round(logits / scale).clamp(-levels, levels) * scale


class QuantizeTap(AttentionTap):
    """Quantise every attention logit to ``bits`` (None: leave them, but still use the reference path)."""

    def __init__(self, bits: int | None, granularity: str = "row") -> None:
        self.bits = bits
        self.granularity = granularity

    def transform_logits(self, layer_index: int, logits: Tensor, visible: Tensor | None) -> Tensor:
        return logits if self.bits is None else quantize_absmax(logits, visible, self.bits, self.granularity)


def cloze_items(stream: Tensor, options: QuantizationOptions) -> list[tuple[list[int], list[list[int]], int]]:
    """(context, choices, index of the true continuation) items cut from a token stream."""
    ctx, cont, k = options.cloze_context, options.cloze_continuation, options.cloze_choices
    span = ctx + cont
    if stream.numel() < span * (k + 1):
        raise ValueError(f"cloze items need at least {span * (k + 1)} held-out tokens, got {stream.numel()}")
    tokens = stream.tolist()
    items = []
    for i in range(options.cloze_items):
        rng = seeded_rng("cloze", options.seed, i)
        start = rng.randrange(len(tokens) - span)
        true = tokens[start + ctx : start + span]
        choices = [true]
        while len(choices) < k:
            other = rng.randrange(len(tokens) - cont)
            if abs(other - (start + ctx)) >= cont:
                choices.append(tokens[other : other + cont])
        rng.shuffle(choices)
        items.append((tokens[start : start + ctx], choices, choices.index(true)))
    return items


def _cloze_correct(mut: ModelUnderTest, items, batch_size: int) -> list[int]:
    """1 where the true continuation scores highest, per item."""
    sequences, scored_from = [], []
    for context, choices, _ in items:
        for choice in choices:
            sequences.append(context + choice)
            scored_from.append(len(context))
    scores = score_sequences(mut.model, sequences, scored_from, batch_size=batch_size)
    k = len(items[0][1])
    correct = []
    for i, (_, _, answer) in enumerate(items):
        row = scores[i * k : (i + 1) * k]
        correct.append(int(row.index(max(row)) == answer))
    return correct


@torch.no_grad()
def _needle_accuracy(mut: ModelUnderTest, documents, batch_size: int) -> float:
    correct = total = 0
    for start in range(0, len(documents), batch_size):
        batch = documents[start : start + batch_size]
        tokens = torch.tensor([d.tokens for d in batch], device=mut.device)
        predicted = mut.model(tokens[:, :-1])[0].argmax(-1).cpu()  # (B, T-1): prediction of tokens[:, 1:]
        for b, doc in enumerate(batch):
            for a_start, a_end in doc.answer_spans:
                correct += bool((predicted[b, a_start - 1 : a_end - 1] == tokens[b, a_start:a_end].cpu()).all())
                total += 1
    return correct / total


def run(mut: ModelUnderTest, options: QuantizationOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    if options.granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {options.granularity!r}")
    length = mut.max_seq_len
    windows = text.windows(mut.tokenizer, length, options.loss_windows)
    stream = text.stream(mut.tokenizer, 4 * length)
    items = cloze_items(stream, options)
    n_needles, n_queries = parse_setting(options.needle_setting)
    filler = text.filler(mut.tokenizer, min_tokens=4 * length)
    try:
        documents = [
            build_needle_example(seeded_rng("quantization-needle", options.seed, i), mut.tokenizer, filler,
                                 length=length, n_needles=n_needles, n_queries=n_queries, depth=(i % 5) / 4)
            for i in range(options.needle_samples)
        ]
    except ValueError:
        documents = []
    settings: list[int | None] = [None, *options.bits]
    rows = []
    for bits in progress_bar(settings, desc=f"quantization {mut.label}", disable=not progress, leave=False):
        with mut.model.tap_attention(QuantizeTap(bits, options.granularity)):
            nll = token_nll(mut.model, windows, options.batch_size)  # (windows, T)
            cloze = _cloze_correct(mut, items, 4 * options.batch_size)  # cloze sequences are short
            needle = _needle_accuracy(mut, documents, options.batch_size) if documents else None
        rows.append({"bits": bits, "loss": float(nll.mean()), "cloze_accuracy": sum(cloze) / len(cloze),
                     "needle_accuracy": needle, "cloze_correct": cloze, "per_window_loss": nll.mean(dim=1).tolist()})
    return {
        "model": mut.describe(),
        "granularity": options.granularity,
        "cloze": {"items": len(items), "choices": options.cloze_choices},
        "needle": {"documents": len(documents), "setting": options.needle_setting},
        "results": rows,
    }


def _label(bits: int | None) -> str:
    return "fp32" if bits is None else f"{bits}-bit"


def plot(results: dict[str, dict], options: QuantizationOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=3, size=(4.4, 3.6))
    metrics = (("cloze_accuracy", "cloze accuracy (cf. Fig. 8)"), ("needle_accuracy", "needle accuracy"),
               ("loss", "validation loss"))
    for ax, (metric, title) in zip(axes, metrics):
        for label, r in results.items():
            xs = [_label(row["bits"]) for row in r["results"]]
            ys = [row[metric] if row[metric] is not None else float("nan") for row in r["results"]]
            ax.plot(xs, ys, "o-", color=colors[label], label=label)
        if metric == "cloze_accuracy":
            ax.axhline(1 / options.cloze_choices, color="grey", ls=":", label="chance")
        ax.set_xlabel("attention logits")
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def report(results: dict[str, dict], options: QuantizationOptions) -> str:
    first = next(iter(results.values()))
    settings = [row["bits"] for row in first["results"]]
    headers = ["Model", "Metric", *[_label(b) for b in settings]]
    rows = []
    for label, r in results.items():
        for metric, name in (("cloze_accuracy", "cloze acc."), ("needle_accuracy", "needle acc."),
                             ("loss", "valid loss")):
            rows.append([label, name, *[fmt(row[metric], 3) for row in r["results"]]])
    lines = [
        markdown_table(headers, rows), "",
        f"Paper ({paper.QUANTIZATION_FIG8['source']}): {paper.QUANTIZATION_FIG8['claim']}.",
        f"Ours: absmax per {options.granularity}; cloze: {first['cloze']['items']} items, "
        f"{first['cloze']['choices']} choices (chance {1 / first['cloze']['choices']:.2f}); "
        f"needle: {first['needle']['documents']} documents (N:R {first['needle']['setting']}).",
    ]
    lowest = min(b for b in settings if b is not None)
    for base, cand in pairs_to_compare(results):
        drops, variances = {}, {}
        for label in (base, cand):
            by_bits = {row["bits"]: row for row in results[label]["results"]}
            per_item = [a - b for a, b in zip(by_bits[None]["cloze_correct"], by_bits[lowest]["cloze_correct"])]
            drops[label] = sum(per_item) / len(per_item)
            variances[label] = (sum((x - drops[label]) ** 2 for x in per_item) / max(len(per_item) - 1, 1)
                                / len(per_item))
        noise = 2 * (variances[base] + variances[cand]) ** 0.5  # two standard errors of the difference of drops
        lines += ["", comparison_sentence(
            f"Cloze accuracy lost going from fp32 to {lowest}-bit logits", (base, drops[base]), (cand, drops[cand]),
            higher_is_better=False, noise=noise, digits=3)]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Quantised attention logits (paper Fig. 8)",
    options_type=QuantizationOptions,
    run=run,
    plot=plot,
    report=report,
)
