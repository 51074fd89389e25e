"""Attention to the answer versus attention noise (paper Table 3 and Figure 1).

Documents as in the needle evaluation (by default one needle, one query) with the needle at
each depth. The full document, answer included, runs once through the model with an
:class:`AttentionTap`, so attention uses the reference backend and hands over its effective
maps (``maps.combined``: the softmax map for the Transformer, softmax₁ − λ·softmax₂ for DIFF,
attn₂ₕ − σ(λ)·attn₂ₕ₊₁ for DIFF V2).

Measured rows: the positions that predict the answer's number tokens. Columns, i.e. where the
attention goes, are grouped as
    answer      the number tokens of the queried needle (the answer span)
    noise       the rest of the haystack: the first token (the usual attention sink), the
                corpus filler and the other needles
    other       the rest of the queried needle sentence, the question, the answer prefix.

Normalisation: in each layer the map is averaged over heads, and each row is divided by its
sum, which is 1 for softmax, 1 − λ for DIFF and the head mean of 1 − σ(λₜ) for DIFF V2, so the
three groups of a row add up to 1 for every kind of attention. A DIFF layer whose row sum is
below 0.05 (λ ≥ 0.95) makes this ratio meaningless; such layers are left out and counted in
``layers_left_out``. The reported mass is the average over layers, rows and documents.
Each document's own (``per_document``, in depth-major order): the mean over the layers kept for
it of its answer rows' mean mass per group; None for a document with no layer kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from ..progress import progress as progress_bar

from ..attention import AttentionTap
from ..data.synthetic import NeedleExample, build_needle_example
from ..ops import AttentionMaps
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
from .stats import mean, seeded_rng
from .texts import EvalText

NAME = "attention-noise"
GROUPS = ("answer", "noise", "other")
MIN_ROW_SUM = 0.05


@dataclass
class AttentionNoiseOptions:
    needles: int = option(1, "needles per document (N)")
    queries: int = option(1, "queried cities per document (R)")
    depths: tuple[float, ...] = option((0.0, 0.25, 0.5, 0.75, 1.0), "depths of the queried needle", maximum=1.0)
    length: int = option(0, "document length in tokens (0 = the model's context)", minimum=0)
    samples: int = option(10, "documents per depth")
    digits: int = option(4, "digits of the magic numbers")
    batch_size: int = option(8, "documents per forward pass")
    seed: int = option(0, "seed of the documents")

    @classmethod
    def quick(cls) -> "AttentionNoiseOptions":
        return cls(depths=(0.0, 0.5, 1.0), samples=2)


def column_groups(example: NeedleExample) -> dict[str, Tensor]:
    """Bool masks (len(tokens),) of the answer, noise and other columns of one document."""
    n = len(example.tokens)
    masks = {g: torch.zeros(n, dtype=torch.bool) for g in GROUPS}
    masks["noise"][: example.question_start] = True
    for i in example.queried_needles:
        start, end = example.needle_spans[i]
        masks["noise"][start:end] = False
        masks["other"][start:end] = True
        a_start, a_end = example.needle_number_spans[i]
        masks["other"][a_start:a_end] = False
        masks["answer"][a_start:a_end] = True
    masks["other"][example.question_start :] = True
    return masks


def answer_rows(example: NeedleExample) -> list[int]:
    """Positions whose next token is an answer number token."""
    return [p - 1 for start, end in example.answer_spans for p in range(start, end)]


class GroupMassTap(AttentionTap):
    """Records, per layer, the normalised attention mass of each column group, for chosen rows."""

    def __init__(self, rows: list[list[int]], groups: list[dict[str, Tensor]], n_layers: int) -> None:
        self.rows = rows  # per document in the batch: query positions
        self.groups = torch.stack([torch.stack([g[k] for k in GROUPS]) for g in groups]).float()  # (B, 3, S)
        self.mass = torch.zeros(n_layers, len(GROUPS))  # summed over rows
        self.count = torch.zeros(n_layers)
        self.document_mass = torch.zeros(len(rows), n_layers, len(GROUPS))  # the same, per document
        self.document_count = torch.zeros(len(rows), n_layers)
        self.left_out = [0] * n_layers
        # Per document: its first answer row, normalised, summed over the layers that were kept.
        self.profile: list[Tensor | None] = [None] * len(rows)
        self.profile_layers = [0] * len(rows)

    def per_document(self) -> list[list[float] | None]:
        """Per document: the mean over its kept layers of its rows' mean mass per group (3,), or None."""
        out = []
        for mass, count in zip(self.document_mass, self.document_count):
            kept = count > 0
            out.append((mass[kept] / count[kept, None]).mean(dim=0).tolist() if kept.any() else None)
        return out

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        combined = maps.combined.float().mean(dim=1).cpu()  # (B, T, S), head mean
        for b, rows in enumerate(self.rows):
            picked = combined[b, rows]  # (R, S)
            sums = picked.sum(dim=-1, keepdim=True)
            usable = sums.squeeze(-1) >= MIN_ROW_SUM
            self.left_out[layer_index] += int((~usable).sum())
            if not usable.any():
                continue
            normalised = picked[usable] / sums[usable]
            mass = (normalised @ self.groups[b].T).sum(dim=0)  # (3,)
            self.mass[layer_index] += mass
            self.count[layer_index] += int(usable.sum())
            self.document_mass[b, layer_index] += mass
            self.document_count[b, layer_index] += int(usable.sum())
            if usable[0]:
                first = normalised[0]
                self.profile[b] = first if self.profile[b] is None else self.profile[b] + first
                self.profile_layers[b] += 1


@torch.no_grad()
def run(mut: ModelUnderTest, options: AttentionNoiseOptions, text: EvalText, *,
        progress: bool = True) -> dict[str, Any]:
    length = options.length or mut.max_seq_len
    if length > mut.max_seq_len:
        raise ValueError(f"length {length} exceeds the model's max_seq_len={mut.max_seq_len}")
    filler = text.filler(mut.tokenizer, min_tokens=4 * length)
    n_layers = mut.model.config.n_layers
    by_depth = []
    per_document: list[list[float] | None] = []  # (3,) per document, depth-major
    profile_example = None
    for depth in progress_bar(options.depths, desc=f"attention-noise {mut.label}", disable=not progress, leave=False):
        examples = [
            build_needle_example(
                seeded_rng("attention-noise", options.seed, depth, sample), mut.tokenizer, filler, length=length,
                n_needles=options.needles, n_queries=options.queries, depth=depth, digits=options.digits,
            )
            for sample in range(options.samples)
        ]
        mass = torch.zeros(n_layers, len(GROUPS))
        count = torch.zeros(n_layers)
        left_out = [0] * n_layers
        for start in range(0, len(examples), options.batch_size):
            batch = examples[start : start + options.batch_size]
            tap = GroupMassTap([answer_rows(e) for e in batch], [column_groups(e) for e in batch], n_layers)
            tokens = torch.tensor([e.tokens for e in batch], device=mut.device)
            with mut.model.tap_attention(tap):
                mut.model(tokens)
            mass += tap.mass
            count += tap.count
            per_document += tap.per_document()
            left_out = [a + b for a, b in zip(left_out, tap.left_out)]
            middle = options.depths[len(options.depths) // 2]
            if profile_example is None and depth == middle and tap.profile[0] is not None:
                profile_example = {
                    "depth": depth,
                    "attention": (tap.profile[0] / tap.profile_layers[0]).tolist(),
                    "answer": column_groups(batch[0])["answer"].nonzero().flatten().tolist(),
                    "question_start": batch[0].question_start,
                }
        per_layer = mass / count.clamp_min(1)[:, None]  # (L, 3)
        used = count > 0
        overall = per_layer[used].mean(dim=0) if used.any() else torch.full((len(GROUPS),), float("nan"))
        by_depth.append({
            "depth": depth,
            **{g: float(overall[i]) for i, g in enumerate(GROUPS)},
            "per_layer": {g: per_layer[:, i].tolist() for i, g in enumerate(GROUPS)},
            "layers_left_out": left_out,
        })
    return {
        "model": mut.describe(),
        "length": length,
        "depths": list(options.depths),
        "answer": [d["answer"] for d in by_depth],
        "noise": [d["noise"] for d in by_depth],
        "other": [d["other"] for d in by_depth],
        "by_depth": by_depth,
        "per_document": {g: [None if d is None else d[i] for d in per_document] for i, g in enumerate(GROUPS)},
        "profile": profile_example,
    }


def plot(results: dict[str, dict], options: AttentionNoiseOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=3, size=(4.6, 3.6))
    for ax, group, title in ((axes[0], "answer", "attention to the answer ↑"), (axes[1], "noise", "attention noise ↓")):
        for label, r in results.items():
            ax.plot([d * 100 for d in r["depths"]], r[group], "o-", color=colors[label], label=f"{label} (ours)")
        for kind, name, style in (("standard", "Transformer", "s--"), ("diff", "DIFF", "^--")):
            ax.plot([d * 100 for d in paper.ATTENTION_TABLE3["depths"]], paper.ATTENTION_TABLE3[kind][group],
                    style, color="grey" if kind == "standard" else "black", alpha=0.6, label=f"{name} (paper)")
        ax.set_xlabel("depth of the answer (%)")
        ax.set_ylabel("normalised attention score")
        ax.set_title(title)
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    axes[0].legend(fontsize=7)
    ax = axes[2]
    for label, r in results.items():
        prof = r.get("profile")
        if not prof:
            continue
        q = prof["question_start"]
        ax.plot(range(q), prof["attention"][:q], color=colors[label], lw=0.8, label=label)
    first = next((r["profile"] for r in results.values() if r.get("profile")), None)
    if first and first["answer"]:
        ax.axvspan(min(first["answer"]) - 0.5, max(first["answer"]) + 0.5, color="green", alpha=0.2, label="answer")
    ax.set_xlabel("context position (haystack)")
    ax.set_ylabel("normalised attention, first answer token")
    ax.set_title(f"one document, depth {first['depth']:.0%} (cf. Fig. 1)" if first else "one document")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def report(results: dict[str, dict], options: AttentionNoiseOptions) -> str:
    depths = next(iter(results.values()))["depths"]
    headers = ["Model", "to answer ↑ (by depth " + " / ".join(f"{d:.0%}" for d in depths) + ")", "attention noise ↓"]
    rows = [[f"{label} (ours, {r['length']} tokens)", " ".join(fmt(x, 2) for x in r["answer"]),
             " ".join(fmt(x, 2) for x in r["noise"])] for label, r in results.items()]
    t3 = paper.ATTENTION_TABLE3
    for kind, name in (("standard", "Transformer"), ("diff", "DIFF")):
        rows.append([f"{name} (paper, depths 0/25/50/75/100%)", " ".join(fmt(x, 2) for x in t3[kind]["answer"]),
                     " ".join(fmt(x, 2) for x in t3[kind]["noise"])])
    lines = [markdown_table(headers, rows), "",
             f"N={options.needles}, R={options.queries}, {options.samples} documents per depth; rows of each layer's "
             "head-mean map divided by their sum (1, 1 − λ, or 1 − σ(λ)), then averaged over layers."]
    for base, cand in pairs_to_compare(results):
        b, c = results[base], results[cand]
        lines += ["", comparison_sentence("Attention to the answer (mean over depths)", (base, mean(b["answer"])),
                                          (cand, mean(c["answer"])), higher_is_better=True, noise=0.005, digits=3),
                  "", comparison_sentence("Attention noise (mean over depths)", (base, mean(b["noise"])),
                                          (cand, mean(c["noise"])), higher_is_better=False, noise=0.005, digits=3)]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Attention to the answer vs attention noise (paper Table 3, Fig. 1)",
    options_type=AttentionNoiseOptions,
    run=run,
    plot=plot,
    report=report,
)
