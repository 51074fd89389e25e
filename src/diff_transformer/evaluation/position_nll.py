"""Cumulative average negative log-likelihood by position (paper Figure 4).

Held-out windows of the model's full context: NLL(t) is the cross-entropy of the token at
position t + 1 given positions 0..t, averaged over windows; the curve is the cumulative
average  C(t) = mean(NLL(0..t)). A model that uses long context well keeps C(t) falling.
With ``within_documents`` every window lies inside one document (the paper reads long books),
so that no position's context holds the end of another text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

NAME = "position-nll"


@dataclass
class PositionNLLOptions:
    windows: int = option(32, "held-out windows of the model's full context")
    batch_size: int = option(8, "windows per forward pass")
    within_documents: bool = option(False, "windows that lie inside one document each (from the documents as long "
                                           "as the context), as the paper's book data")

    @classmethod
    def quick(cls) -> "PositionNLLOptions":
        return cls(windows=2)


def cumulative_average(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        out.append(total / (i + 1))
    return out


def checkpoints(length: int) -> list[int]:
    """Positions reported in the table: powers of two up to the context, and the context itself."""
    points, p = [], 16
    while p < length:
        points.append(p)
        p *= 2
    return points + [length]


def run(mut: ModelUnderTest, options: PositionNLLOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    length = mut.max_seq_len
    if options.within_documents:
        windows = text.document_windows(mut.tokenizer, length, options.windows)
    else:
        windows = text.windows(mut.tokenizer, length, options.windows)
    nll = token_nll(mut.model, windows, options.batch_size)  # (N, T)
    per_position = nll.mean(dim=0).tolist()
    cumulative = cumulative_average(per_position)
    return {
        "model": mut.describe(),
        "windows": options.windows,
        "length": length,
        "nll": per_position,
        "cumulative": cumulative,
        "at": {str(p): cumulative[p - 1] for p in checkpoints(length)},
        "per_window": nll.mean(dim=1).tolist(),
        "windows_fingerprint": windows_fingerprint(windows),
    }


def plot(results: dict[str, dict], options: PositionNLLOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=1, size=(6.4, 4.0))
    ax = axes[0]
    for label, r in results.items():
        ax.plot(range(1, len(r["cumulative"]) + 1), r["cumulative"], color=colors[label], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("cumulative average NLL")
    ax.set_title("Cumulative average NLL by position (cf. Fig. 4)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def report(results: dict[str, dict], options: PositionNLLOptions) -> str:
    points = list(next(iter(results.values()))["at"])
    headers = ["Model", *[f"≤{p}" for p in points]]
    rows = [[f"{label} (ours)", *[fmt(r["at"].get(p), 3) for p in points]] for label, r in results.items()]
    lines = [markdown_table(headers, rows), "",
             f"Cumulative average NLL over {options.windows} held-out windows"
             f"{' within documents' if options.within_documents else ''}. "
             f"Paper ({paper.POSITION_NLL_FIG4['source']}): {paper.POSITION_NLL_FIG4['claim']}."]
    for base, cand in pairs_to_compare(results):
        b, c = results[base]["cumulative"], results[cand]["cumulative"]
        lower_everywhere = all(y < x for x, y in zip(b, c))
        noise = difference_noise(results[base], results[cand], "per_window")
        lines += ["", comparison_sentence("Cumulative NLL over the whole context", (base, b[-1]), (cand, c[-1]),
                                          higher_is_better=False, noise=noise)
                  + f" {cand} is {'below' if lower_everywhere else 'not below'} {base} at every position."]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Cumulative average NLL by position (paper Fig. 4)",
    options_type=PositionNLLOptions,
    run=run,
    plot=plot,
    report=report,
)
