"""Validation loss split into AR-Hit and Others (paper Table 6, after Zoology).

Zoology (Arora et al., 2023, §3) calls a token an associative-recall hit when it is the last
token of a bigram that already occurred earlier in the same context: having seen "Hakuna
Matata" once, the next "Matata" after "Hakuna" can be recalled rather than predicted. We use
that definition with n = 2 by default (``--ngram`` changes n): the target at position t+1 is an
AR hit when tokens[t+2-n .. t+1] equals some tokens[j-n+1 .. j] with j ≤ t, i.e. the n-gram
ending at the target was complete in the context before it. Every other target is "Others".
Zoology further restricts hits to bigrams that are rare in the training data (to leave out
memorised phrases); that needs counts over the training set, and is not applied here.

Reported: the mean cross-entropy over all targets (valid), over AR hits and over Others, and
the fraction of targets that are hits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

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
from .scoring import token_nll, windows_fingerprint
from .stats import difference_noise
from .texts import EvalText

NAME = "ar-hit"


@dataclass
class ARHitOptions:
    windows: int = option(32, "held-out windows")
    seq_len: int = option(0, "window length (0 = the model's context)", minimum=0)
    ngram: int = option(2, "n of the n-gram a hit completes (Zoology: 2)")
    batch_size: int = option(8, "windows per forward pass")

    @classmethod
    def quick(cls) -> "ARHitOptions":
        return cls(windows=2)


def ar_hit_mask(tokens: Sequence[int], n: int = 2) -> list[bool]:
    """For the targets tokens[1:], True where the n-gram ending at the target occurred before.

    ``tokens`` has T + 1 ids; the result has T flags (flag t is about tokens[t + 1]). A target
    needs n - 1 tokens before it inside the window to complete an n-gram.
    """
    if n < 1:
        raise ValueError(f"ngram must be >= 1, got {n}")
    tokens = list(tokens)
    seen: set[tuple[int, ...]] = set()
    hits = []
    for end in range(len(tokens)):  # the n-gram tokens[end-n+1 .. end]
        gram = tuple(tokens[end - n + 1 : end + 1]) if end >= n - 1 else None
        if end >= 1:
            hits.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return hits


def split_loss(nll: Tensor, hits: Tensor) -> dict[str, Any]:
    """Mean NLL over all, hit and other targets, overall and per window; nll and hits (N, T)."""
    hits = hits.bool()

    def average(values: Tensor, mask: Tensor) -> float | None:
        return float(values[mask].mean()) if mask.any() else None

    return {
        "valid": float(nll.mean()),
        "ar_hit": average(nll, hits),
        "others": average(nll, ~hits),
        "hit_fraction": float(hits.float().mean()),
        "targets": nll.numel(),
        "per_window": {
            "valid": nll.mean(dim=1).tolist(),
            "ar_hit": [average(n, h) for n, h in zip(nll, hits)],
            "others": [average(n, ~h) for n, h in zip(nll, hits)],
        },
    }


def run(mut: ModelUnderTest, options: ARHitOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    seq_len = options.seq_len or mut.max_seq_len
    if seq_len > mut.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len={mut.max_seq_len}")
    windows = text.windows(mut.tokenizer, seq_len, options.windows)
    nll = token_nll(mut.model, windows, options.batch_size)
    hits = torch.tensor([ar_hit_mask(row, options.ngram) for row in windows.tolist()])
    return {"model": mut.describe(), "ngram": options.ngram, "tokens": windows.shape[0] * seq_len,
            "windows_fingerprint": windows_fingerprint(windows), **split_loss(nll, hits)}


def plot(results: dict[str, dict], options: ARHitOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=1, size=(6.4, 3.8))
    ax = axes[0]
    groups = ("valid", "ar_hit", "others")
    labels = list(results)
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = [results[label][g] if results[label][g] is not None else math.nan for g in groups]
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, values, width, color=colors[label], label=label)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), ["valid", f"AR-Hit ({options.ngram}-gram)", "Others"])
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("Validation loss split (cf. Table 6)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def report(results: dict[str, dict], options: ARHitOptions) -> str:
    headers = ["Model", "Valid", "AR-Hit", "Others", "AR-Hit share of targets"]
    rows = [[f"{label} (ours, {r['tokens']:,} tokens)", fmt(r["valid"]), fmt(r["ar_hit"]), fmt(r["others"]),
             fmt(r["hit_fraction"], 3)] for label, r in results.items()]
    for kind, name in (("standard", "Transformer"), ("diff", "DIFF")):
        t6 = paper.AR_HIT_TABLE6[kind]
        rows.append([f"{name} (paper, 1.4B)", fmt(t6["valid"]), fmt(t6["ar_hit"]), fmt(t6["others"]), "–"])
    lines = [markdown_table(headers, rows), "",
             f"AR-Hit: the target completes a {options.ngram}-gram seen earlier in the window (Zoology)."]
    for base, cand in pairs_to_compare(results):
        b, c = results[base], results[cand]
        for key, what in (("ar_hit", "AR-Hit loss"), ("others", "Others loss")):
            noise = difference_noise({**b["per_window"], "windows_fingerprint": b["windows_fingerprint"]},
                                     {**c["per_window"], "windows_fingerprint": c["windows_fingerprint"]}, key)
            lines += ["", comparison_sentence(what, (base, b[key]), (cand, c[key]), higher_is_better=False,
                                              noise=noise)]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Loss on AR-Hit and other tokens (paper Table 6)",
    options_type=ARHitOptions,
    run=run,
    plot=plot,
    report=report,
)
