"""Training FLOPs of a model, by a stated formula: what a budget in FLOPs counts (``run.budget``).

    from diff_transformer.flops import training_flops
    cost = training_flops(ModelConfig.from_preset("tiny"), seq_len=128)
    cost.per_token, cost.per_sequence          # FLOPs of one training step's share: forward and backward

The formula (one multiply-add is 2 FLOPs; training = forward + backward = 3 × forward, as Kaplan et
al. 2020 and Chinchilla's appendix F count it: a product's backward is two products of its size):

- **Projections**: 6 · (the weights of every matrix a token passes through) per token, counted from
  the layer shapes of the model as built (q/k/v/o and any gate of the attention kind, the SwiGLU's
  three), plus the LM head, 6 · d_model · vocab (counted whether or not it is tied to the embedding).
  The embedding is a lookup: 0.
- **Attention products** (the T × T part), per layer: 3 · P · (forward FLOPs per (query, key) pair of
  the kind, :data:`ATTENTION_COSTS`), where a causal window of T tokens has P = T(T + 1)/2 pairs,
  (T + 1)/2 per token: the half that a causal kernel computes. A dense kernel that computes the
  whole T × T square and masks it does twice that (``causal=False`` counts it so).
- Not counted: softmax, norms, RoPE, the λ re-parameterisation, gates' sigmoid and product, the loss
  (elementwise, O(T · d) per layer); a kernel's recomputation (flash kernels recompute the scores in
  the backward). ``data.packing: documents`` confines attention to shorter documents: counted here
  as whole windows.

The attention term of each kind, forward, per pair and layer (H its heads, d its head_dim, w its
value width: d, or 2d for DIFF heads):

    standard, gated, gated_headwise    2·H·(d + w)      one score product, one value product per head
    diff, diff_symmetric               2·2H·(d + w)     two maps per DIFF head, each times V (the
                                                        paper's appendix: FlashDiffAttn_1 and a fused
                                                        kernel compute both value products)
    gda                                2·(H + N)·(d + w)  H signal and N = H / gda_ratio noise maps,
                                                        each times V (DIFF's at gda_ratio 1)
    diff_v2                            2·2H·(d + d)     one attention over 2H query heads
    xsa                                2·H·(d + w)      the standard kind's; per token 4·H·d more (each
                                                        output's dot product with its own value, and
                                                        the component taken off)
    mta                                2·H·(d + w)      the standard kind's, plus per pair the head
                                       + 2·H² + 2·H·g   mixings before (H × H) and after the softmax
                                       [+ 4·H·c_q·c_k]  (groups of g = mta_head_group), and on the layers
                                                        that carry them the two key-query convolutions
                                                        (c_q × c_k each); per token 2·(H − 1)·d more (its
                                                        gate, d -> 1, read by every head: the projection
                                                        count has it once)

In the paper's unit H_t·N²·d (H_t = 2H heads of the matched Transformer, forward, non-causal) that is
4 for the Transformer and 6 for DIFF (its appendix's FlashDiffAttn_1 forward); the backward here is
twice the forward (8 and 12), the appendix's 10 and 14 being a flash kernel's, which recomputes the
scores. The project's materialised backends (reference, math) multiply V once by the combined map
P1 − λP2: 4 forward, as the Transformer.

**A new attention kind adds its entry to** :data:`ATTENTION_COSTS`: a function of the config and the
0-based layer index (a kind may differ by layer, as MTA's convolutions do); its projections count
themselves from the layer shapes. A kind without one raises :class:`UnknownAttentionCost`, rather
than being counted as standard attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .config import ModelConfig

TRAINING_FACTOR = 3  # forward + backward = 3 × forward (the backward of a product is two of its size)


@dataclass(frozen=True)
class AttentionCost:
    """One layer's attention beyond its projections, forward: FLOPs per (query, key) pair the model
    computes (score and value products), and per token (anything else that is not elementwise)."""

    per_pair: int
    per_token: int = 0


def softmax_heads(config: ModelConfig, layer: int) -> AttentionCost:
    """H heads, each one score product (width d) and one value product (width w)."""
    d = config.head_dim
    return AttentionCost(2 * config.n_heads * (d + config.value_factor * d))


def diff_heads(config: ModelConfig, layer: int) -> AttentionCost:
    """H DIFF heads of two maps, each map one score product (width d) and one value product with V
    (width w: 2d, or d with value_factor 1)."""
    d = config.head_dim
    return AttentionCost(2 * 2 * config.n_heads * (d + config.value_factor * d))


def gda_heads(config: ModelConfig, layer: int) -> AttentionCost:
    """H signal maps and N = H / gda_ratio noise maps, each one score product (width d) and one value
    product with V (width w), as DIFF's; at gda_ratio 1 (N = H) DIFF's term."""
    d = config.head_dim
    return AttentionCost(2 * (config.n_heads + config.n_noise_heads) * (d + config.value_factor * d))


def diff_v2_heads(config: ModelConfig, layer: int) -> AttentionCost:
    """One softmax attention over 2H query heads of width d (values of width d)."""
    d = config.head_dim
    return AttentionCost(2 * 2 * config.n_heads * (d + d))


def exclusive_heads(config: ModelConfig, layer: int) -> AttentionCost:
    """Softmax heads, and per token each head's output against its own value: a dot product and
    the component taken off (2·d each)."""
    return AttentionCost(softmax_heads(config, layer).per_pair, 4 * config.n_heads * config.head_dim)


def multi_token_heads(config: ModelConfig, layer: int) -> AttentionCost:
    """Softmax heads; per pair the head mixings (H × H before the softmax, groups of g after it) and,
    on a convolved layer, both key-query convolutions; per token the gate's reads by H − 1 more heads."""
    h, d = config.n_heads, config.head_dim
    group = config.mta_head_group or h
    per_pair = softmax_heads(config, layer).per_pair + 2 * h * h + 2 * h * group
    if config.mta_conv_layer(layer):
        per_pair += 2 * 2 * h * config.mta_query_kernel * config.mta_key_kernel
    return AttentionCost(per_pair, 2 * (h - 1) * d)


# Each attention kind's term, forward, per layer (see the module docstring). A new kind adds its
# entry here; its projections (nn.Linear layers of its attention module) are counted from its shapes.
ATTENTION_COSTS: dict[str, Callable[[ModelConfig, int], AttentionCost]] = {
    "standard": softmax_heads,
    "gated": softmax_heads,  # the gate: a projection (gate_proj, counted) and an elementwise product
    "gated_headwise": softmax_heads,
    "diff": diff_heads,
    "diff_symmetric": diff_heads,  # its keys are its queries: the same products
    "diff_v2": diff_v2_heads,
    "gda": gda_heads,  # a noise map serves gda_ratio signal heads: H + N maps
    "xsa": exclusive_heads,
    "mta": multi_token_heads,
}


class UnknownAttentionCost(KeyError):
    """An attention kind with no entry in :data:`ATTENTION_COSTS`."""

    def __str__(self) -> str:
        return self.args[0]


def attention_cost(config: ModelConfig, layer: int) -> AttentionCost:
    """The attention term of ``config.attention`` at the 0-based ``layer`` (:data:`ATTENTION_COSTS`)."""
    term = ATTENTION_COSTS.get(config.attention)
    if term is None:
        raise UnknownAttentionCost(f"no FLOPs term for attention {config.attention!r}: add its entry to "
                                   "diff_transformer.flops.ATTENTION_COSTS (forward FLOPs per query-key pair "
                                   "and per token of one layer)")
    return term(config, layer)


@dataclass(frozen=True)
class TrainingFlops:
    """Training FLOPs (forward and backward) of one sequence of ``seq_len`` tokens, by part."""

    seq_len: int
    projections: int  # the blocks' matrices: 6 × their weights per token
    head: int  # the LM head: 6 × d_model × vocab per token
    attention: int  # the score and value products (and any per-token term) of every layer
    causal: bool = True

    @property
    def per_sequence(self) -> int:
        return self.projections + self.head + self.attention

    @property
    def per_token(self) -> float:
        return self.per_sequence / self.seq_len

    def per_step(self, sequences: int) -> int:
        """The FLOPs of an optimizer step of ``sequences`` sequences."""
        return sequences * self.per_sequence


def block_weights(config: ModelConfig) -> int:
    """The weights of every matrix in the model's blocks (attention projections and gates, the
    SwiGLU's), from the layer shapes of the model as built (unallocated, on the meta device)."""
    from .model import LanguageModel

    model = LanguageModel(config, device="meta")
    return sum(module.weight.numel() for block in model.layers for module in block.modules()
               if isinstance(module, nn.Linear))


def training_flops(config: ModelConfig, seq_len: int | None = None, *, causal: bool = True) -> TrainingFlops:
    """The training FLOPs of a sequence of ``seq_len`` tokens (default ``config.max_seq_len``) of
    the model ``config`` describes: see the module docstring. ``causal=False`` counts every
    (query, key) pair of the T × T square, as a dense kernel computes it."""
    t = config.max_seq_len if seq_len is None else seq_len
    if not isinstance(t, int) or isinstance(t, bool) or t <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {t!r}")
    costs = [attention_cost(config, layer) for layer in range(config.n_layers)]  # first: an unknown kind raises
    pairs = t * (t + 1) // 2 if causal else t * t
    forward_attention = sum(pairs * cost.per_pair + t * cost.per_token for cost in costs)
    return TrainingFlops(
        seq_len=t,
        projections=TRAINING_FACTOR * 2 * block_weights(config) * t,
        head=TRAINING_FACTOR * 2 * config.d_model * config.vocab_size * t,
        attention=TRAINING_FACTOR * forward_attention,
        causal=causal,
    )
