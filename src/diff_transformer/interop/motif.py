"""Motif Technologies' released models as this project's models: Motif-2.6B (DIFF attention in
every layer) and Motif-2-12.7B (grouped differential attention), read by ``import-hf``.

transformers has no class for them (they ship remote code, not read here). What is read, and how,
is what the public implementations of their arithmetic agree on: vLLM's ``MotifForCausalLM``
(``vllm/model_executor/models/motif.py``: in vLLM up to 0.10.2 on the DIFFERENTIAL_FLASH_ATTN
backend, and in MotifTechnologies/vllm on the GROUPED_DIFF_ATTN backend,
``vllm/v1/attention/backends/grouped_diff_attn.py``, whose ratio 1 is the 2.6B's) and an MLX port
of the family (``MotifAttention`` in its ``mlx_lm`` model file). docs/pretrained.md lists what was
established from which file, and what was not.

config.json (its field names) -> ModelConfig:

    num_attention_heads       query sub-heads of width d: signal + noise
    num_noise_heads           N; absent (Motif-2.6B) = num_attention_heads / 2: DIFF, Q1/Q2 pairs
                              present (Motif-2-12.7B): attention "gda", gda_ratio = signal / N
    num_key_value_heads       K/V sub-heads, 2·Hkv: K1/V1 the even ones, K2/V2 the odd ones
    head_dim                  d (absent: hidden_size / num_attention_heads); attn_head_dim when the
                              heads do not fill hidden_size (Motif-2-12.7B: 40 × 128 at 4096)
    hidden_act "poly_norm"    ffn_activation "polynorm": down(PolyNorm(x W_gate) ⊙ x W_up)
    rms_norm_eps              norm_eps (block and final norms)
    attn_rms_norm_eps         head_norm_eps (``subln``: RMSNorm over each head's 2d channels, weighted)
    attention_bias, use_bias, qkv_bias   the bias flags, as vLLM combines them
    rope_theta, rope_scaling  RoPE over the whole head, rotate-half (NeoX) kind: q/k rows permuted
                              per head to our interleaved kind (interop.hf, point 1)
    tie_word_embeddings       tie_embeddings (absent: tied when the files hold no lm_head.weight)
    max_position_embeddings   max_seq_len (absent: 8192, vLLM's default)
    λ_init                    0.8 − 0.6·exp(−0.3·(layer − 1)) for the 0-based layer (both sources):
                              lambda_init_depth_offset = −1

Tensors (their names as vLLM and the MLX port load them) -> ours: the Llama names for embeddings,
norms and MLP; ``self_attn.{q,k,v,o}_proj`` with the q/k rotary permutation (the group layout of
q, [signal × r, noise] per group, is ours); ``self_attn.lambda_{q1,k1,q2,k2}``; ``self_attn.subln``
-> ``attn.head_norm``; ``mlp.act_fn.{weight,bias}`` (PolyNorm's (3,) and (1,)) -> ``ffn.polynorm``.

Refused by name: Motif-3 (MoE, grouped differential latent attention, hyper-connections, sliding
windows, output gates, multi-token prediction: its config fields below), ``k_ratio`` other than 1
(grouped keys: only the MLX port reads it, vLLM does not), activations other than PolyNorm, and
anything :func:`~diff_transformer.interop.hf.hf_rope` does not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ModelConfig
from .mapping import HFConversionError, TensorSource, hf_rope, plain_sources, rotate_half_to_interleaved

# Fields of features not read here (most are Motif-3's: MoE, latent attention, hyper-connections,
# sliding windows, output gates, multi-token prediction), with the value that means "off": a
# config setting one to anything else is refused by name.
OFF_FEATURES: dict[str, Any] = {
    "num_experts": 0, "moe": False, "n_routed_experts": None, "interleave_moe_layer_step": 0, "n_dense_first_layers": 0,
    "q_lora_rank": 0, "kv_lora_rank": 0, "mhc_enabled": False, "diff_v2": False, "attention_cls": "basic",
    "use_qk_norm": False, "use_sliding_window": False, "headwise_attn_output_gate": False,
    "elementwise_attn_output_gate": False, "num_nextn_predict_layers": 0, "mix_attn": False, "use_mrope": False,
    "polynorm_output_scale": 1.0, "polynorm_bias_clamp": None, "k_ratio": 1, "partial_rotary_factor": 1,
    "is_causal": True,
}
MOTIF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "rms_norm_eps", "attn_rms_norm_eps")  # what vLLM's MotifForCausalLM reads without a default
MOTIF_LAMBDA_DEPTH_OFFSET = -1  # λ_init(depth) = 0.8 − 0.6·exp(−0.3·(depth − 1)), depth the 0-based layer


def _is_off(value: Any, off: Any) -> bool:
    return value is None or value == off or (not off and not value)


def motif_model_config(hf: dict[str, Any], path: Path, weight_names: set[str]) -> ModelConfig:
    """Our ModelConfig of a Motif config.json (see the module docstring); ``weight_names``: the
    directory's tensors. Whatever is not read exactly is an HFConversionError naming the field."""
    on = {name: hf[name] for name, off in OFF_FEATURES.items() if name in hf and not _is_off(hf[name], off)}
    if on:
        what = ", ".join(f"{name}={value!r}" for name, value in on.items())
        raise HFConversionError(f"{path}: {what}: a Motif model with features not read here (Motif-3's MoE, latent "
                                "attention, hyper-connections, sliding windows, gates or multi-token prediction; "
                                "grouped keys); only Motif-2.6B's and Motif-2-12.7B's layouts are imported")
    absent = [name for name in MOTIF_REQUIRED if name not in hf]
    if absent:
        raise HFConversionError(f"{path}: missing field(s) {', '.join(absent)} (Motif's code reads them)")
    if hf.get("hidden_act") != "poly_norm":
        raise HFConversionError(f"{path}: hidden_act {hf.get('hidden_act')!r}: Motif's MLP is read with 'poly_norm' "
                                "only (as vLLM's MotifMLP)")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    noise = hf.get("num_noise_heads")
    if noise is not None and hf.get("head_dim") is None:
        raise HFConversionError(f"{path}: num_noise_heads without head_dim (vLLM's Motif requires both)")
    d = hf.get("head_dim") or hidden // heads
    if kv_heads % 2:
        raise HFConversionError(f"{path}: num_key_value_heads={kv_heads} must be even (K1/V1 and K2/V2 sub-heads)")
    fields: dict[str, Any] = {}
    if noise is None:  # Motif-2.6B: DIFF, sub-heads in pairs
        if heads % 2:
            raise HFConversionError(f"{path}: num_attention_heads={heads} must be even (Q1/Q2 pairs)")
        signal, attention = heads // 2, "diff"
    else:  # Motif-2-12.7B: grouped differential attention
        signal, attention = heads - noise, "gda"
        if noise <= 0 or signal <= 0 or signal % noise:
            raise HFConversionError(f"{path}: num_attention_heads={heads} minus num_noise_heads={noise} must be a "
                                    "positive multiple of num_noise_heads (signal heads per noise head)")
        fields["gda_ratio"] = signal // noise
    if 2 * signal * d != hidden or hf.get("head_dim") not in (None, hidden // heads):
        fields["attn_head_dim"] = d
    attention_bias = bool(hf.get("attention_bias") or hf.get("use_bias"))  # vLLM's MotifDecoderLayer
    tie = hf.get("tie_word_embeddings")
    theta, scaling = hf_rope(hf, path)
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hidden,
            n_layers=hf["num_hidden_layers"],
            n_heads=signal,
            n_kv_heads=kv_heads // 2,
            attention=attention,
            ffn_hidden=hf["intermediate_size"],
            ffn_activation="polynorm",
            max_seq_len=hf.get("max_position_embeddings") or 8192,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf["rms_norm_eps"]),
            head_norm_eps=float(hf["attn_rms_norm_eps"]),
            tie_embeddings=bool(tie) if tie is not None else "lm_head.weight" not in weight_names,
            attention_bias=bool(hf["qkv_bias"]) if "qkv_bias" in hf else attention_bias,
            attention_out_bias=attention_bias,
            mlp_bias=bool(hf.get("use_bias")),
            lambda_init_depth_offset=MOTIF_LAMBDA_DEPTH_OFFSET,
            init_std=float(hf.get("initializer_range") or 0.02),
            **fields,
        )
    except ValueError as exc:
        raise HFConversionError(f"{path}: cannot be represented as a ModelConfig: {exc}") from exc


def motif_sources(config: ModelConfig) -> dict[str, TensorSource]:
    """The Motif mapping table: each tensor of ours and the Motif tensor it comes from."""
    sources = plain_sources(config)
    rotary = rotate_half_to_interleaved(config.head_dim)
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn, self_attn = ours + "attn.", theirs + "self_attn."
        biases = {"q_proj": config.attention_bias, "k_proj": config.attention_bias, "v_proj": config.attention_bias,
                  "o_proj": config.attention_out_bias}
        for proj, has_bias in biases.items():
            transform = rotary if proj in ("q_proj", "k_proj") else None
            for kind in ("weight", "bias") if has_bias else ("weight",):
                sources[f"{attn}{proj}.{kind}"] = TensorSource(f"{self_attn}{proj}.{kind}", transform)
        for vec in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            sources[attn + vec] = TensorSource(self_attn + vec)
        sources[attn + "head_norm.weight"] = TensorSource(self_attn + "subln.weight")
        if config.mlp_bias:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                sources[f"{ours}ffn.{proj}.bias"] = TensorSource(f"{theirs}mlp.{proj}.bias")
        for kind in ("weight", "bias"):
            sources[f"{ours}ffn.polynorm.{kind}"] = TensorSource(f"{theirs}mlp.act_fn.{kind}")
    return sources
