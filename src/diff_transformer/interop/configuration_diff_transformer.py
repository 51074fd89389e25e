"""The transformers configuration of a model that ``diff-transformer export-hf`` writes as remote code.

This file is copied beside the weights of an export (config.json names it in ``auto_map``) and
imports transformers alone: whoever loads the model needs neither this project nor its package.
The fields are transformers' Llama names where Llama has the quantity, and otherwise the names of
the project's ``ModelConfig`` (``modeling_diff_transformer.py`` says what each computes).
"""

from __future__ import annotations

from transformers import PreTrainedConfig


class DiffTransformerConfig(PreTrainedConfig):
    """One decoder of the Differential Transformer family (Ye et al., ICLR 2025, arXiv 2410.05258) and its
    competitors, Llama-style: ``attention`` picks the kind of every layer.

    Head counts: ``num_attention_heads`` counts DIFF heads for "diff" / "diff_symmetric" (each two
    query/key sub-heads of width ``head_dim`` and a value ``value_factor``·head_dim wide), signal heads
    for "gda", ordinary heads otherwise; ``num_key_value_heads`` the key/value groups.
    """

    model_type = "diff_transformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    head_dim: int = 16
    # "standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise", "gda", "mta", "xsa"
    attention: str = "diff"
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "poly_norm" (Motif's PolyNorm)
    polynorm_eps: float = 1e-6
    max_position_embeddings: int = 128
    # interleaved-pair RoPE: {"rope_type": "default" | "linear" | "llama3", "rope_theta": θ, factor, ...}
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-5  # block and final norms
    head_norm: bool = True  # a per-head RMSNorm (with weight) on each head's output
    head_norm_eps: float = 1e-5
    attention_bias: bool = False  # q/k/v (symmetric DIFF: qk) projections
    attention_out_bias: bool = False  # o_proj
    mlp_bias: bool = False
    value_factor: int = 2  # a DIFF head's value width in units of head_dim (1: a Transformer converted to DIFF)
    lambda_init: float | None = None  # None: 0.8 − 0.6·exp(−0.3·(layer + lambda_init_depth_offset)); else constant
    lambda_init_depth_offset: int = 0
    lambda_std: float = 0.1  # initialisation only
    gda_ratio: int | None = None  # "gda": signal heads per noise head
    mta_query_kernel: int | None = None  # "mta": c_q, c_k, the layers with convolutions, c_h
    mta_key_kernel: int | None = None
    mta_conv_every: int | None = None
    mta_head_group: int | None = None
    xsa_gate: bool = False  # "xsa": scale the removed component by sigmoid(β) per head
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None


__all__ = ["DiffTransformerConfig"]
