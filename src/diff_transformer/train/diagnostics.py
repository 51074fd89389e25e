"""What the trainer watches besides the loss (``run.diagnostics``): the questions users of DIFF ask.

- λ per layer (kinds that have one): how it moves during training.
- The RMS of each layer's attention branch (the attention module's output, what it adds to the
  residual stream), for every kind: a branch that grows is where instability starts.
- The share of negative entries in each layer's differential map p1 − λ·p2 (kinds with a
  differential map), among the entries a query may see (the causal lower triangle).
- The first-token share of each layer's attention (the attention sink), every kind, as the
  ``attention-sink`` evaluation measures it (evaluation/attention_sink.py).
- Spikes of the global gradient norm (before clipping): a step whose norm exceeds
  ``SPIKE_FACTOR`` × the median of the previous ``SPIKE_WINDOW`` norms.

λ, the RMS and the first-token share come from one no-grad forward of fixed validation windows
(the probe, the same every time, at every log and evaluation step): λ and the RMS through forward
hooks on the attention modules; the first-token share at every probe and the negative share at
evaluation steps through the reference backend with an
:class:`~diff_transformer.attention.AttentionTap`, which materialises every map (B, H, T, T) in
fp32 (docs/training.md gives the probe's cost). So the maps are taken on the probe's first
``MAP_PROBE_TOKENS`` tokens only (the same forward when the probe is no longer, else a second one
on that prefix): the model is causal, so
they are exactly the top-left block of the full window's maps, and their memory stays bounded at
any context (at 64K tokens and 12 heads one full map would be ~206 GB). Nothing is computed inside
``forward``, and the training step is left as it is (no hooks on it, so ``run.compile`` is
unaffected). Under FSDP every process runs the probe (its forward gathers the shards) and λ is
read inside the hook, while the block's parameters are whole.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import deque
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import AttentionTap
from ..config import GATED_KINDS
from ..evaluation.attention_sink import first_token_share
from ..model import LanguageModel
from ..ops import AttentionMaps

SPIKE_FACTOR = 5.0  # a gradient norm above this many times the running median is a spike
SPIKE_WINDOW = 50  # previous steps whose median is the reference
SPIKE_MIN_HISTORY = 10  # no verdict before this many previous norms (the first steps move a lot)
PROBE_SEQUENCES = 1  # validation sequences of the diagnostics' forward: ~4% of a step at tiny (docs/training.md)
MAP_PROBE_TOKENS = 2048  # the map shares are of the maps of the probe's first this-many tokens (bounded memory)


class GradientSpikes:
    """Counts gradient norms above ``factor`` × the median of the previous ``window`` norms.

    ``observe(step, norm)`` once per optimizer step; a spike is returned (and kept in ``spikes``)
    as {"step", "grad_norm", "median", "window"} (window: how many previous norms the median is
    of). Every norm, spike or not, joins the window afterwards.
    """

    def __init__(self, factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW, min_history: int = SPIKE_MIN_HISTORY,
                 earlier: int = 0) -> None:
        self.factor, self.min_history = factor, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.spikes: list[dict[str, float]] = []
        self.earlier = earlier  # spikes counted by an earlier invocation of a resumed run

    @property
    def count(self) -> int:
        return self.earlier + len(self.spikes)

    @property
    def median(self) -> float | None:
        return statistics.median(self.history) if self.history else None

    def observe(self, step: int, norm: float) -> dict[str, float] | None:
        spike = None
        if len(self.history) >= self.min_history:
            median = statistics.median(self.history)
            if norm > self.factor * median:
                spike = {"step": step, "grad_norm": norm, "median": median, "window": len(self.history)}
                self.spikes.append(spike)
        self.history.append(norm)
        return spike


def negative_share(combined: Tensor) -> float:
    """The share of entries < 0 among the visible entries of causal maps (.., T, S), query i at
    key position S − T + i: the lower triangle (the masked entries are 0 and are not counted)."""
    t, s = combined.shape[-2:]
    visible = torch.ones(t, s, dtype=torch.bool, device=combined.device).tril(diagonal=s - t)
    negative = ((combined < 0) & visible).sum().item()
    return negative / (visible.sum().item() * combined[..., 0, 0].numel())


class _MapSharesTap(AttentionTap):
    """Per layer: the first-token share (mean over the probe's sequences) and, with ``negative``, the
    share of negative visible entries of the combined map (the maps are not kept)."""

    def __init__(self, *, negative: bool) -> None:
        self.negative = negative
        self.first_token: dict[int, float] = {}
        self.negative_shares: dict[int, float] = {}

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        # the mean over the probe's sequences; NaN where every row is left out (a DIFF row sum < 0.05)
        self.first_token[layer_index] = first_token_share(maps.combined)[0].nanmean().item()
        if self.negative:
            self.negative_shares[layer_index] = negative_share(maps.combined)


def has_differential_map(attention: str) -> bool:
    """Whether the kind's effective map can go negative (every kind but softmax attention, gated or not)."""
    return attention not in ("standard", *GATED_KINDS)


@torch.no_grad()
def probe(model: LanguageModel, tokens: Tensor, *, maps: bool, autocast: Any = None) -> dict[str, list[float]]:
    """One no-grad forward of ``tokens`` (B, T) through ``model`` (unwrapped from DDP; under FSDP
    on every process): "lambda" per layer (kinds with λ), "attn_rms" per layer, "first_token_share"
    per layer, and with ``maps`` "negative_share" per layer (kinds with a differential map); the
    two shares over the maps of the first ``MAP_PROBE_TOKENS`` tokens, through the reference backend
    (the same forward when T is no longer, else a second forward of that prefix). ``autocast``: the
    training's autocast context, if any."""
    lambdas: dict[int, float] = {}
    rms: dict[int, float] = {}

    def watch(index: int):
        def hook(module: nn.Module, args: Any, out: Tensor) -> None:
            rms[index] = out.float().pow(2).mean().sqrt().item()
            lam = module.lam()
            if lam is not None:
                lambdas[index] = lam.item()
        return hook

    tap = _MapSharesTap(negative=maps and has_differential_map(model.config.attention))
    prefix = tokens.shape[1] > MAP_PROBE_TOKENS  # the maps need a forward of their own
    was_training = model.training
    model.eval()
    hooks = [layer.attn.register_forward_hook(watch(i)) for i, layer in enumerate(model.layers)]
    try:
        with autocast or contextlib.nullcontext():
            with model.tap_attention(tap) if not prefix else contextlib.nullcontext():
                model(tokens, logits_to_keep=1)  # the LM head on one position: its logits are not wanted
            for hook in hooks:
                hook.remove()
            if prefix:  # the maps of the prefix: the top-left block of the full window's (the model is causal)
                with model.tap_attention(tap):
                    model(tokens[:, :MAP_PROBE_TOKENS], logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    found = {"attn_rms": [rms[i] for i in sorted(rms)]}
    if lambdas:
        found["lambda"] = [lambdas[i] for i in sorted(lambdas)]
    found["first_token_share"] = [tap.first_token[i] for i in sorted(tap.first_token)]
    if tap.negative:
        found["negative_share"] = [tap.negative_shares[i] for i in sorted(tap.negative_shares)]
    return found
