"""Activation outliers (paper Table 5): the largest magnitudes of attention logits and hidden states.

Over a budget of held-out tokens (windows of the model's context length):
- attention logits: every pre-softmax score q·k/√d of every head and layer (both maps of a
  DIFF head; GDA's H signal and H / r noise maps; all 2H query heads of DIFF V2; MTA's after its
  convolution and head mixing, which its softmax reads), at the positions a query can see;
  masked (future) positions are excluded;
- hidden states: every element of every block's output (the residual stream after the block).
For each: the 1st, 2nd, 3rd, 10th and 100th largest absolute value, and the median absolute
value. Top values are exact; the median is exact while the values fit in ``median_sample``,
otherwise it is the median of a uniform random subsample (with replacement) of about that many.
Per layer, as Sun et al. 2024 ("Massive activations in large language models") read the residual
stream: the largest absolute value, the median absolute value (of that layer's share of the
subsample) and their ratio, top-1 / median. Per window and layer, the window's own largest
absolute value (``per_window_layer_top1``, (windows, layers); ``per_window_top1`` its largest over
layers): what varies from one window of text to the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from ..progress import progress as progress_bar

from ..attention import AttentionTap
from ..config import GATED_KINDS
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
from .texts import EvalText

NAME = "outliers"
RANKS = (1, 2, 3, 10, 100)
COLUMNS = ("top1", "top2", "top3", "top10", "top100", "median")
RELATIVE_TIE = 0.05  # top-1 values within 5% of each other are reported as a tie


@dataclass
class OutlierOptions:
    tokens: int = option(16384, "held-out tokens to look at (the paper used 0.4M)")
    seq_len: int = option(0, "window length (0 = the model's context)", minimum=0)
    batch_size: int = option(4, "windows per forward pass")
    median_sample: int = option(2_000_000, "values kept per activation kind to estimate the median")
    seed: int = option(0, "seed of the median's subsample")

    @classmethod
    def quick(cls) -> "OutlierOptions":
        return cls(tokens=1024)


class MagnitudeStats:
    """Running top-100 and a uniform random subsample of |values| (for the median).

    Works where the values are (CPU or GPU); only the top values and the subsample are kept.
    The subsample draws ``keep_probability`` of each update's values at random (with
    replacement), or keeps them all when the probability is 1; it is kept per layer, so that each
    layer has its own median.
    """

    def __init__(self, keep_probability: float, seed: int) -> None:
        self.keep_probability = keep_probability
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self.top = torch.empty(0)
        self.samples: dict[int, list[Tensor]] = {}  # per layer
        self.count = 0
        self.layer_top1: dict[int, float] = {}
        self.window_top1: dict[int, list[Tensor]] = {}  # per layer: each batch's (B,) largest |value| per window

    def record_windows(self, top1: Tensor, layer_index: int) -> None:
        """The largest |value| of each window (B,) of one batch in one layer (batches in order)."""
        self.window_top1.setdefault(layer_index, []).append(top1.detach().float().cpu())

    def update(self, values: Tensor, layer_index: int) -> None:
        values = values.detach().float().abs().flatten()
        n = values.numel()
        if n == 0:
            return
        self.count += n
        top = values.topk(min(max(RANKS), n)).values.cpu()
        self.top = torch.cat([self.top, top]).topk(min(max(RANKS), self.top.numel() + top.numel())).values
        self.layer_top1[layer_index] = max(self.layer_top1.get(layer_index, 0.0), float(top[0]))
        samples = self.samples.setdefault(layer_index, [])
        if self.keep_probability >= 1.0:
            samples.append(values.cpu())
            return
        generator = self.generators.get(values.device)
        if generator is None:
            generator = self.generators[values.device] = torch.Generator(values.device).manual_seed(self.seed)
        picks = torch.randint(n, (max(1, round(n * self.keep_probability)),), generator=generator, device=values.device)
        samples.append(values[picks].cpu())

    def summary(self) -> dict[str, Any]:
        """Top values and median over every layer; per layer (in layer order) the top-1, the median
        and top-1 / median (None where the median is 0)."""
        out: dict[str, Any] = {}
        for rank in RANKS:
            out[f"top{rank}"] = float(self.top[rank - 1]) if self.top.numel() >= rank else None
        layers = sorted(self.layer_top1)
        by_layer = [torch.cat(self.samples[i]) for i in layers]
        sample = torch.cat(by_layer) if by_layer else torch.empty(0)
        out["median"] = float(sample.median()) if sample.numel() else None
        out["count"] = self.count
        out["median_exact"] = self.keep_probability >= 1.0
        out["per_layer_top1"] = [self.layer_top1[i] for i in layers]
        medians = [float(values.median()) for values in by_layer]
        out["per_layer_median"] = medians
        out["per_layer_ratio"] = [top / median if median > 0 else None
                                  for top, median in zip(out["per_layer_top1"], medians)]
        if self.window_top1:
            windows = torch.stack([torch.cat(self.window_top1[i]) for i in layers], dim=1)  # (windows, layers)
            out["per_window_layer_top1"] = windows.tolist()
            out["per_window_top1"] = windows.amax(dim=1).tolist()
        return out


def window_top1(values: Tensor) -> Tensor:
    """The largest |value| of each window (B,) of ``values`` (B, ...), ignoring the masked (-inf) ones."""
    magnitude = values.detach().float().abs()
    return magnitude.masked_fill(~torch.isfinite(magnitude), 0.0).flatten(1).amax(dim=1)


class LogitTap(AttentionTap):
    def __init__(self, stats: MagnitudeStats) -> None:
        self.stats = stats

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        for logits in maps.logits:
            self.stats.update(logits[torch.isfinite(logits)], layer_index)
        self.stats.record_windows(torch.stack([window_top1(logits) for logits in maps.logits]).amax(dim=0),
                                  layer_index)


def _record_hidden(stats: MagnitudeStats, hidden: Tensor, layer_index: int) -> None:
    """A block's output (B, T, D): every value, and each window's largest."""
    stats.update(hidden, layer_index)
    stats.record_windows(window_top1(hidden), layer_index)


@torch.no_grad()
def run(mut: ModelUnderTest, options: OutlierOptions, text: EvalText, *, progress: bool = True) -> dict[str, Any]:
    config = mut.model.config
    seq_len = options.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len={config.max_seq_len}")
    n_windows = max(1, math.ceil(options.tokens / seq_len))
    windows = text.windows(mut.tokenizer, seq_len, n_windows)
    # Expected counts, to keep each value with the probability that leaves ~median_sample of them.
    one_map = ("standard", "mta", "xsa", *GATED_KINDS)  # one softmax per head
    # DIFF kinds: H first maps and H second ones (GDA: N; DIFF V2: its 2H query heads)
    maps_per_layer = config.n_heads if config.attention in one_map else config.n_heads + config.n_noise_heads
    n_logits = n_windows * config.n_layers * maps_per_layer * seq_len * (seq_len + 1) // 2
    n_hidden = n_windows * config.n_layers * seq_len * config.d_model
    logit_stats = MagnitudeStats(min(1.0, options.median_sample / n_logits), options.seed)
    hidden_stats = MagnitudeStats(min(1.0, options.median_sample / n_hidden), options.seed + 1)
    hooks = [
        layer.register_forward_hook(lambda _m, _inp, out, i=i: _record_hidden(hidden_stats, out, i))
        for i, layer in enumerate(mut.model.layers)
    ]
    try:
        with mut.model.tap_attention(LogitTap(logit_stats)):
            for batch in progress_bar(windows.split(options.batch_size), desc=f"outliers {mut.label}",
                                      disable=not progress, leave=False):
                mut.model(batch[:, :-1].to(mut.device))
    finally:
        for hook in hooks:
            hook.remove()
    return {
        "model": mut.describe(),
        "tokens": n_windows * seq_len,
        "attention_logits": logit_stats.summary(),
        "hidden_states": hidden_stats.summary(),
    }


def plot(results: dict[str, dict], options: OutlierOptions, path: Path) -> None:
    colors = model_colors(results)
    fig, axes = new_figure(ncols=2, size=(5.2, 3.8))
    labels = list(results)
    width = 0.8 / max(len(labels), 1)
    for ax, kind, title in ((axes[0], "attention_logits", "attention logits"),
                            (axes[1], "hidden_states", "hidden states")):
        for i, label in enumerate(labels):
            values = [results[label][kind][c] or 0.0 for c in COLUMNS]
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(COLUMNS))]
            ax.bar(xs, values, width, color=colors[label], label=label)
        ax.set_xticks(range(len(COLUMNS)), ["Top-1", "Top-2", "Top-3", "Top-10", "Top-100", "Median"])
        ax.set_yscale("log")
        ax.set_ylabel("|value|")
        ax.set_title(f"largest {title} (cf. Table 5)")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def report(results: dict[str, dict], options: OutlierOptions) -> str:
    headers = ["Activation", "Model", "Top-1", "Top-2", "Top-3", "Top-10", "Top-100", "Median"]
    rows = []
    for kind, name in (("attention_logits", "Attention logits"), ("hidden_states", "Hidden states")):
        for label, r in results.items():
            rows.append([name, f"{label} (ours, {r['tokens']:,} tokens)", *[fmt(r[kind][c], 2) for c in COLUMNS]])
        for model_kind, model_name in (("standard", "Transformer"), ("diff", "DIFF")):
            rows.append([name, f"{model_name} (paper, 0.4M tokens)",
                         *[fmt(v, 1) for v in paper.OUTLIERS_TABLE5[kind][model_kind]]])
    lines = [markdown_table(headers, rows), "", _massive_activations_table(results)]
    for base, cand in pairs_to_compare(results):
        for kind, what in (("attention_logits", "Top-1 attention logit"), ("hidden_states", "Top-1 hidden state")):
            b, c = results[base][kind]["top1"], results[cand][kind]["top1"]
            lines += ["", comparison_sentence(what, (base, b), (cand, c), higher_is_better=False, digits=2,
                                              noise=RELATIVE_TIE * max(abs(b or 0.0), abs(c or 0.0)))]
    return "\n".join(lines)


def _massive_activations_table(results: dict[str, dict]) -> str:
    """Per layer, the largest hidden-state magnitude and its ratio to the layer's median (Sun et al. 2024)."""
    layers = max(len(r["hidden_states"]["per_layer_top1"]) for r in results.values())
    headers = ["Model", *(f"layer {i}" for i in range(layers))]
    rows = []
    for label, r in results.items():
        hidden = r["hidden_states"]
        cells = [f"{fmt(top, 2)} (×{fmt(ratio, 0)})"
                 for top, ratio in zip(hidden["per_layer_top1"], hidden["per_layer_ratio"])]
        rows.append([label, *cells, *[""] * (layers - len(cells))])
    return ("Massive activations (Sun et al. 2024): each layer's largest hidden-state magnitude (× its ratio to the "
            "layer's median magnitude).\n\n" + markdown_table(headers, rows))


SPEC = Evaluation(
    name=NAME,
    title="Activation outliers (paper Table 5)",
    options_type=OutlierOptions,
    run=run,
    plot=plot,
    report=report,
)
