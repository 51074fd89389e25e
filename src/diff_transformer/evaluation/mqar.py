"""Multi-query associative recall (MQAR, Zoology: Arora et al., 2023).

A sequence is [end-of-text], P key-value pairs "k1 v1 k2 v2 …", then every key once more, at
distances drawn from Zoology's power law (most queries close to the pairs, some far), each
followed by its value; a fixed gap token fills the rest. Keys come from one half of the
vocabulary and values from the other. Accuracy: the fraction of queried values that are the
model's argmax (teacher forcing, as in Zoology), per sequence length and number of pairs.

Small models learn this only when it is in their training data: train with the "mqar"
generator in the mixture (``data.mix: {mqar: 0.1}``). The paper has no MQAR figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ..progress import progress as progress_bar

from ..data.synthetic import build_mqar_example
from .. import paper
from .models import ModelUnderTest
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
from .stats import binomial_se, mean, seeded_rng
from .texts import EvalText

NAME = "mqar"


@dataclass
class MQAROptions:
    seq_lens: tuple[int, ...] = option((64, 128, 256, 512), "sequence lengths (those within the model's context)")
    pairs: tuple[int, ...] = option((4, 8, 16, 32, 64), "key-value pairs (those with 1 + 4P <= length)")
    samples: int = option(16, "sequences per cell")
    batch_size: int = option(32, "sequences per forward pass")
    seed: int = option(0, "seed of the sequences")

    @classmethod
    def quick(cls) -> "MQAROptions":
        return cls(seq_lens=(64,), pairs=(4, 8), samples=4)


@torch.no_grad()
def _cell(mut: ModelUnderTest, options: MQAROptions, length: int, n_pairs: int) -> dict[str, Any]:
    correct = total = 0
    examples = [
        build_mqar_example(seeded_rng("mqar", options.seed, length, n_pairs, i), mut.tokenizer, length=length,
                           n_pairs=n_pairs)
        for i in range(options.samples)
    ]
    for start in range(0, len(examples), options.batch_size):
        batch = examples[start : start + options.batch_size]
        tokens = torch.tensor([e.tokens for e in batch], device=mut.device)
        predicted = mut.model(tokens[:, :-1])[0].argmax(-1).cpu()  # (B, L - 1): predictions of tokens[:, 1:]
        for b, example in enumerate(batch):
            positions = torch.tensor(example.value_positions)
            correct += int((predicted[b, positions - 1] == tokens[b, positions].cpu()).sum())
            total += len(positions)
    return {"seq_len": length, "pairs": n_pairs, "accuracy": correct / total, "queries": total}


def run(mut: ModelUnderTest, options: MQAROptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    cells = [(n, p) for n in options.seq_lens if n <= mut.max_seq_len for p in options.pairs if 1 + 4 * p <= n]
    if not cells:
        raise ValueError(f"no MQAR cell fits: seq_lens {options.seq_lens} within max_seq_len={mut.max_seq_len}, "
                         f"pairs {options.pairs} with 1 + 4P <= length")
    results = [_cell(mut, options, n, p)
               for n, p in progress_bar(cells, desc=f"mqar {mut.label}", disable=not progress, leave=False)]
    return {"model": mut.describe(), "cells": results, "accuracy": mean(c["accuracy"] for c in results)}


def plot(results: dict[str, dict], options: MQAROptions, path: Path) -> None:
    colors = model_colors(results)
    lengths = sorted({c["seq_len"] for r in results.values() for c in r["cells"]})
    fig, axes = new_figure(ncols=len(lengths), size=(3.8, 3.4))
    for ax, length in zip(axes, lengths):
        for label, r in results.items():
            points = [(c["pairs"], c["accuracy"]) for c in r["cells"] if c["seq_len"] == length]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, "o-", color=colors[label], label=label)
        ax.set_xscale("log", base=2)
        pairs = sorted({c["pairs"] for r in results.values() for c in r["cells"] if c["seq_len"] == length})
        ax.set_xticks(pairs, [str(p) for p in pairs])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("key-value pairs")
        ax.set_ylabel("recall accuracy")
        ax.set_title(f"MQAR, length {length}")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def report(results: dict[str, dict], options: MQAROptions) -> str:
    cells = [(c["seq_len"], c["pairs"]) for c in next(iter(results.values()))["cells"]]
    headers = ["Model", *[f"L={n}, P={p}" for n, p in cells], "Mean"]
    rows = []
    for label, r in results.items():
        by_cell = {(c["seq_len"], c["pairs"]): c["accuracy"] for c in r["cells"]}
        rows.append([label, *[fmt(by_cell.get(cell), 2) for cell in cells], fmt(r["accuracy"], 2)])
    lines = [markdown_table(headers, rows), "", f"{options.samples} sequences per cell. {paper.MQAR_NOTE}"]
    for base, cand in pairs_to_compare(results):
        b, c = results[base]["accuracy"], results[cand]["accuracy"]
        n = sum(x["queries"] for x in results[base]["cells"])
        lines += ["", comparison_sentence("Mean MQAR accuracy (direction expected from the paper's retrieval results)",
                                          (base, b), (cand, c), higher_is_better=True,
                                          noise=2 * 2**0.5 * binomial_se((b + c) / 2, n), digits=3)]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Multi-query associative recall (Zoology MQAR)",
    options_type=MQAROptions,
    run=run,
    plot=plot,
    report=report,
)
