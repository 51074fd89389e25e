"""The attention sink: the share of each layer's attention that lands on the first token.

Xiao et al. 2023 (StreamingLLM) found softmax attention putting much of its mass on the first
token whatever it holds; Qiu et al. 2025 report a sigmoid gate on the heads' outputs bringing the
share from about 47% to about 5%, and DIFF V2's authors name "no attention sinks" as a motive.

Over held-out windows of the model's context, each layer's effective map (``maps.combined``:
softmax for the Transformer and the gated kinds, whose gate acts after the map; p1 − λ·p2 for DIFF;
p₂ₕ − σ(λₜ)·p₂ₕ₊₁ for DIFF V2) is read as the attention-noise evaluation reads it: averaged over
heads, each row divided by its sum (1, 1 − λ, or the head mean of 1 − σ), a row whose sum is below
0.05 left out and counted. A layer's first-token share in one window is the mean, over the query
positions from ``first_query`` on, of the normalised row's entry at key 0. Query 0 is left out by
default: it sees key 0 alone, so its share is 1 for every model (a constant that says nothing of
the model). Reported per layer: the mean and the standard deviation over windows, beside the share
that uniform causal attention would give over the same queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..attention import AttentionTap
from ..ops import AttentionMaps
from ..progress import progress as progress_bar
from .attention_noise import MIN_ROW_SUM
from .models import BASELINE, ModelUnderTest
from .options import Evaluation, option
from .output import markdown_table, model_colors, new_figure, pairs_to_compare, save_figure
from .scoring import windows_fingerprint
from .stats import decimals, difference_noise
from .texts import EvalText

NAME = "attention-sink"
FIRST_QUERY = 1  # query 0 sees key 0 alone: its share is 1 for every model


def first_token_share(combined: Tensor, first_query: int = FIRST_QUERY) -> tuple[Tensor, int]:
    """The first-token share of causal maps ``combined`` (B, H, T, T), one query per key position.

    The maps are averaged over heads and each row divided by its sum; rows whose sum is below
    MIN_ROW_SUM are left out. Returns the mean over the kept rows i >= ``first_query`` of the
    normalised entry (i, 0), per batch row, (B,) fp32 (NaN where no row is kept), and how many
    rows were left out.
    """
    rows = combined.float().mean(dim=1)[:, first_query:]  # (B, T - first_query, T)
    sums = rows.sum(dim=-1)
    kept = sums >= MIN_ROW_SUM
    shares = torch.where(kept, rows[..., 0] / sums.where(kept, 1.0), 0.0)
    counts = kept.sum(dim=-1)
    per_row = shares.sum(dim=-1) / counts.clamp_min(1)
    return per_row.where(counts > 0, float("nan")), int((~kept).sum())


def uniform_share(length: int, first_query: int = FIRST_QUERY) -> float:
    """The first-token share of uniform causal attention over ``length`` positions: query i gives
    key 0 a share of 1 / (i + 1); the mean over queries first_query … length − 1."""
    queries = range(first_query, length)
    return sum(1.0 / (i + 1) for i in queries) / len(queries)


class FirstTokenShareTap(AttentionTap):
    """Per layer: the first-token share of each batch row (window), and the rows left out."""

    def __init__(self, first_query: int = FIRST_QUERY) -> None:
        self.first_query = first_query
        self.shares: dict[int, Tensor] = {}  # layer -> (B,)
        self.rows_left_out: dict[int, int] = {}

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        shares, left_out = first_token_share(maps.combined, self.first_query)
        self.shares[layer_index] = shares.cpu()
        self.rows_left_out[layer_index] = left_out


@dataclass
class AttentionSinkOptions:
    windows: int = option(16, "held-out windows")
    seq_len: int = option(0, "window length (0 = the model's context)", minimum=0)
    batch_size: int = option(4, "windows per forward pass")
    first_query: int = option(FIRST_QUERY, "the first query position counted (0 = every query; query 0 sees only "
                                           "the first token, so its share is 1 for every model)", minimum=0)

    @classmethod
    def quick(cls) -> "AttentionSinkOptions":
        return cls(windows=4)


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite values (None when there are none; std 0 for one)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None, None
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    return mean, std


@torch.no_grad()
def run(mut: ModelUnderTest, options: AttentionSinkOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    config = mut.model.config
    seq_len = options.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len={config.max_seq_len}")
    if options.first_query >= seq_len:
        raise ValueError(f"first_query {options.first_query} leaves no query in windows of {seq_len} tokens")
    windows = text.windows(mut.tokenizer, seq_len, options.windows)[:, :-1]  # (N, seq_len): inputs only
    per_window: list[list[float]] = []  # (windows, layers)
    rows_left_out = [0] * config.n_layers
    for batch in progress_bar(windows.split(options.batch_size), desc=f"attention-sink {mut.label}",
                              disable=not progress, leave=False):
        tap = FirstTokenShareTap(options.first_query)
        with mut.model.tap_attention(tap):
            mut.model(batch.to(mut.device), logits_to_keep=1)  # the maps are wanted, not the logits
        per_window += torch.stack([tap.shares[i] for i in range(config.n_layers)], dim=1).tolist()
        rows_left_out = [a + tap.rows_left_out[i] for i, a in enumerate(rows_left_out)]
    layer_stats = [_mean_std([w[i] for w in per_window]) for i in range(config.n_layers)]
    over_layers = [_mean_std(w)[0] for w in per_window]  # per window: the mean over its measurable layers
    mean, std = _mean_std([v for v in over_layers if v is not None])
    return {
        "model": mut.describe(),
        "windows": len(per_window),
        "seq_len": seq_len,
        "first_query": options.first_query,
        "uniform_share": uniform_share(seq_len, options.first_query),
        "per_layer": {"mean": [m for m, _ in layer_stats], "std": [s for _, s in layer_stats]},
        "mean_over_layers": {"mean": mean, "std": std},
        "per_window": {"mean_over_layers": over_layers, "per_layer": per_window},
        "windows_fingerprint": windows_fingerprint(windows),
        "rows_left_out": rows_left_out,
    }


def plot(results: dict[str, dict], options: AttentionSinkOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(size=(6.0, 4.0))
    ax = axes[0]
    for label, r in results.items():
        means = [float("nan") if m is None else m for m in r["per_layer"]["mean"]]
        stds = [0.0 if s is None else s for s in r["per_layer"]["std"]]
        ax.errorbar(range(len(means)), means, yerr=stds, fmt="o-", capsize=3, color=colors[label], label=label)
    uniform = next(iter(results.values()))["uniform_share"]
    ax.axhline(uniform, color="grey", ls="--", lw=0.8, label="uniform attention")
    ax.set_xticks(range(max(len(r["per_layer"]["mean"]) for r in results.values())))
    ax.set_xlabel("layer")
    ax.set_ylabel("attention on the first token")
    ax.set_title("first-token share per layer (mean ± std over windows)")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.legend(fontsize=8)
    save_figure(fig, path)


def _cell(mean: float | None, std: float | None) -> str:
    return "–" if mean is None else f"{mean:.3f} ± {std:.3f}"


def report(results: dict[str, dict], options: AttentionSinkOptions) -> str:
    layers = max(len(r["per_layer"]["mean"]) for r in results.values())
    headers = ["Model", *(f"layer {i}" for i in range(layers)), "mean over layers"]
    rows = []
    for label, r in results.items():
        cells = [_cell(m, s) for m, s in zip(r["per_layer"]["mean"], r["per_layer"]["std"])]
        rows.append([f"{label} ({r['windows']} × {r['seq_len']} tokens)", *cells, *[""] * (layers - len(cells)),
                     _cell(r["mean_over_layers"]["mean"], r["mean_over_layers"]["std"])])
    first = next(iter(results.values()))
    lines = [markdown_table(headers, rows), "",
             f"Attention on the first token: each layer's head-mean map, rows divided by their sum (1, 1 − λ, or "
             f"1 − σ(λ)), averaged over the queries from position {first['first_query']} on; mean ± std over "
             "windows. "
             f"Uniform causal attention would give {first['uniform_share']:.3f}. Qiu et al.'s paper reports about 0.47 "
             "for its Transformer and about 0.05 with gated attention (1.7B and 15B models)."]
    candidates = tuple({r["model"]["attention"] for r in results.values()} - {BASELINE})  # every other kind
    for base, cand in pairs_to_compare(results, candidates=candidates):
        b, c = (results[label]["mean_over_layers"]["mean"] for label in (base, cand))
        if b is None or c is None:
            continue
        noise = difference_noise({"share": results[base]["per_window"]["mean_over_layers"],
                                  "windows_fingerprint": results[base]["windows_fingerprint"]},
                                 {"share": results[cand]["per_window"]["mean_over_layers"],
                                  "windows_fingerprint": results[cand]["windows_fingerprint"]}, "share")
        verdict = "within noise" if abs(c - b) <= noise else ("lower" if c < b else "higher")
        places = decimals(c - b, noise)  # the verdict visible in the figures
        lines += ["", f"First-token share, mean over layers: {cand} {c:.{places}f} vs {base} {b:.{places}f}, "
                      f"{c - b:+.{places}f} ± {noise:.{places}f} (two standard errors over windows): {verdict}."]
    return "\n".join(lines)


SPEC = Evaluation(
    name=NAME,
    title="Attention sink: first-token share per layer (Xiao et al. 2023; Qiu et al. 2025)",
    options_type=AttentionSinkOptions,
    run=run,
    plot=plot,
    report=report,
)
