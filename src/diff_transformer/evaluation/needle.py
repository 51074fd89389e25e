"""Multi-needle retrieval (paper Table 2 and Figure 5).

A haystack of held-out corpus text holds N needles "The magic number of CITY is NUMBER."; a
question asks for R of the cities. The needle the evaluation tracks (always among the queried
ones) sits at a given depth of the haystack: 0% right after the start, 100% right before the
question. For each query the model greedily decodes after "... The magic number of CITY is";
a query is right when the decoded digits are exactly the number (exact match). Earlier answers
of the same document are given (teacher forcing), so queries are scored independently.

Two grids, a fixed number of documents per cell:
- the table: every N:R setting at the longest context length, accuracy averaged over depths;
- the heatmap: one N:R setting, accuracy per depth x context length.
Each document's own accuracy (the share of its R queries answered exactly) is kept too,
``per_document``: every cell's documents in the order of ``cells``.

Small models cannot do this zero-shot: train with the "needle" generator in the data mixture
(``data.mix: {needle: 0.1}``), which produces documents in exactly this format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..progress import progress as progress_bar

from ..data.synthetic import build_needle_example
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
from .scoring import greedy_decode
from .stats import binomial_se, mean, seeded_rng
from .texts import EvalText

NAME = "needle"


@dataclass
class NeedleOptions:
    settings: tuple[str, ...] = option(("1:1", "2:2", "4:2", "6:2"),
                                       "N:R settings of the table (N needles, R queried), at the longest length",
                                     check=lambda s: parse_setting(s))
    heatmap: str = option("4:1", "the N:R setting of the depth x length heatmap", check=lambda s: parse_setting(s))
    depths: tuple[float, ...] = option((0.0, 0.25, 0.5, 0.75, 1.0),
                                       "depths of the tracked needle, 0 = start, 1 = end of the haystack",
                                       maximum=1.0)
    lengths: tuple[int, ...] = option((), "context lengths in tokens (default: half, three quarters and all of the "
                                      "model's context)", type=int)
    samples: int = option(5, "documents per cell (the paper: 50)")
    digits: int = option(4, "digits of the magic numbers")
    batch_size: int = option(32, "prompts decoded together")
    seed: int = option(0, "seed of the documents")

    @classmethod
    def quick(cls) -> "NeedleOptions":
        return cls(settings=("1:1", "2:2"), heatmap="2:1", depths=(0.0, 0.5, 1.0), samples=2)


def parse_setting(text: str) -> tuple[int, int]:
    """"N:R" -> (N, R)."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"needle setting {text!r} must look like N:R, e.g. 4:2")
    n, r = int(match[1]), int(match[2])
    if not 1 <= r <= n:
        raise ValueError(f"needle setting {text!r}: need 1 <= R <= N")
    return n, r


def context_lengths(options: NeedleOptions, max_seq_len: int) -> list[int]:
    lengths = options.lengths or (max_seq_len // 2, 3 * max_seq_len // 4, max_seq_len)
    too_long = [n for n in lengths if n > max_seq_len]
    if too_long:
        raise ValueError(f"needle lengths {too_long} exceed the model's max_seq_len={max_seq_len}")
    return sorted(set(lengths))


def decoded_number(text: str) -> str:
    """The digits the model wrote first ("" if none)."""
    match = re.match(r"\s*(\d+)", text)
    return match[1] if match else ""


def _documents(mut: ModelUnderTest, options: NeedleOptions, filler, cell: tuple[str, float, int]):
    """(prompt, answer, document) per query of the cell's documents (document: its sample number), or
    the reason the cell cannot be built."""
    setting, depth, length = cell
    n_needles, n_queries = parse_setting(setting)
    queries = []
    try:
        for sample in range(options.samples):
            rng = seeded_rng("needle", options.seed, setting, depth, length, sample)
            example = build_needle_example(
                rng, mut.tokenizer, filler, length=length, n_needles=n_needles, n_queries=n_queries,
                depth=depth, digits=options.digits,
            )
            queries += [(example.tokens[:start], answer, sample)
                        for (start, _), answer in zip(example.answer_spans, example.answers)]
    except ValueError as exc:  # the context is too short for this many needles
        return str(exc)
    return queries


def run(mut: ModelUnderTest, options: NeedleOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    for setting in (*options.settings, options.heatmap):
        parse_setting(setting)
    lengths = context_lengths(options, mut.max_seq_len)
    filler = text.filler(mut.tokenizer, min_tokens=4 * max(lengths))
    cells = [(s, d, lengths[-1]) for s in options.settings for d in options.depths]
    cells += [(options.heatmap, d, n) for n in lengths for d in options.depths]
    cells = list(dict.fromkeys(cells))  # the table and the heatmap share the longest length
    built = {cell: _documents(mut, options, filler, cell) for cell in cells}
    # Every query of every cell, decoded in batches of similar prompt length (little padding).
    queue = sorted(((len(p), (cell, d), p, a) for cell, qs in built.items() if isinstance(qs, list)
                    for p, a, d in qs), key=lambda q: q[0])
    max_new = len(mut.tokenizer.encode(" " + "9" * options.digits)) + 1
    correct = dict.fromkeys(cells, 0)
    document_correct: dict[tuple, int] = {}  # (cell, document) -> its queries answered exactly
    batches = range(0, len(queue), options.batch_size)
    for start in progress_bar(batches, desc=f"needle {mut.label}", disable=not progress, leave=False):
        batch = queue[start : start + options.batch_size]
        # the last answer of a full-length document ends at the context's end
        room = mut.max_seq_len - max(n for n, _, _, _ in batch)
        decoded = greedy_decode(mut.model, [p for _, _, p, _ in batch], min(max_new, room))
        for (_, (cell, document), _, answer), new_tokens in zip(batch, decoded):
            right = decoded_number(mut.tokenizer.decode(new_tokens)) == answer
            correct[cell] += right
            document_correct[cell, document] = document_correct.get((cell, document), 0) + right
    done = {}
    for cell, qs in built.items():
        if isinstance(qs, str):
            done[cell] = {"accuracy": None, "n": 0, "skipped": qs}
        else:
            done[cell] = {"accuracy": correct[cell] / len(qs), "n": len(qs)}
    table = {}
    for setting in options.settings:
        per_depth = [done[(setting, d, lengths[-1])] for d in options.depths]
        n = sum(c["n"] for c in per_depth)
        table[setting] = {
            "accuracy": (sum(c["accuracy"] * c["n"] for c in per_depth if c["n"]) / n) if n else None,
            "by_depth": [c["accuracy"] for c in per_depth],
            "n": n,
            **({"skipped": per_depth[0]["skipped"]} if not n else {}),
        }
    heatmap = [[done[(options.heatmap, d, n)]["accuracy"] for d in options.depths] for n in lengths]
    built_cells = [cell for cell, qs in built.items() if isinstance(qs, list)]
    per_document = [document_correct.get((cell, d), 0) / parse_setting(cell[0])[1]
                    for cell in built_cells for d in range(options.samples)]
    return {
        "model": mut.describe(),
        "length": lengths[-1],
        "table": table,
        "heatmap": {"setting": options.heatmap, "depths": list(options.depths), "lengths": lengths,
                    "accuracy": heatmap},
        "cells": [list(cell) for cell in built_cells],  # (setting, depth, length) of each built cell
        "per_document": per_document,
    }


def plot(results: dict[str, dict], options: NeedleOptions, path: Path) -> None:
    labels = list(results)
    colors = model_colors(results)
    fig, axes = new_figure(ncols=1 + len(labels), size=(4.6, 3.8))
    ax = axes[0]
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        table = results[label]["table"]
        values = [table[s]["accuracy"] or 0.0 for s in options.settings]
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(options.settings))]
        ax.bar(xs, values, width, label=label, color=colors[label])
    ax.set_xticks(range(len(options.settings)), [f"N={s.split(':')[0]},R={s.split(':')[1]}" for s in options.settings])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(f"Multi-needle retrieval, {results[labels[0]]['length']} tokens (cf. Table 2)")
    ax.legend(fontsize=8)
    for ax, label in zip(axes[1:], labels):
        heat = results[label]["heatmap"]
        grid = [[float("nan") if a is None else a for a in row] for row in heat["accuracy"]]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(heat["depths"])), [f"{d:.0%}" for d in heat["depths"]])
        ax.set_yticks(range(len(heat["lengths"])), [str(n) for n in heat["lengths"]])
        for y, row in enumerate(grid):
            for x, a in enumerate(row):
                ax.text(x, y, "–" if a != a else f"{a:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("depth of the needle")
        ax.set_ylabel("context length (tokens)")
        setting = heat["setting"].split(":")
        ax.set_title(f"{label}: N={setting[0]}, R={setting[1]} (cf. Fig. 5)")
    fig.colorbar(image, ax=axes[1:], shrink=0.8, label="accuracy")
    save_figure(fig, path)


def report(results: dict[str, dict], options: NeedleOptions) -> str:
    settings = list(options.settings)
    headers = ["Model", *[f"N={s.split(':')[0]},R={s.split(':')[1]}" for s in settings], "Mean"]
    rows = []
    for label, r in results.items():
        accs = [r["table"][s]["accuracy"] for s in settings]
        rows.append([f"{label} (ours, {r['length']} tokens)", *[fmt(a, 2) for a in accs], fmt(mean(accs), 2)])
    for kind, name in (("standard", "Transformer"), ("diff", "DIFF")):
        values = [paper.NEEDLE_TABLE2[kind].get(s) for s in settings]
        rows.append([f"{name} (paper, 4K tokens)", *[fmt(v, 2) for v in values], fmt(mean(values), 2)])
    lines = [markdown_table(headers, rows), ""]
    first = next(iter(results.values()))
    heat = first["heatmap"]
    lines.append(
        f"Heatmap (N:R = {heat['setting']}): mean accuracy over depths {', '.join(f'{d:.0%}' for d in heat['depths'])} "
        f"and lengths {', '.join(map(str, heat['lengths']))}: "
        + "; ".join(f"{label} {fmt(mean(a for row in r['heatmap']['accuracy'] for a in row), 2)}"
                    for label, r in results.items())
        + f". {options.samples} documents per cell."
    )
    for base, cand in pairs_to_compare(results):
        b_accs = [results[base]["table"][s] for s in settings]
        c_accs = [results[cand]["table"][s] for s in settings]
        n = sum(c["n"] for c in b_accs)
        b, c = mean(x["accuracy"] for x in b_accs), mean(x["accuracy"] for x in c_accs)
        noise = 2 * binomial_se((b + c) / 2, n) * 2**0.5 if n and b == b and c == c else 0.0
        lines.append("")
        lines.append(comparison_sentence("Mean retrieval accuracy", (base, b), (cand, c), higher_is_better=True,
                                         noise=noise, digits=2))
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Multi-needle retrieval (paper Table 2, Fig. 5)",
    options_type=NeedleOptions,
    run=run,
    plot=plot,
    report=report,
)
