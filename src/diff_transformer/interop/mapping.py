"""What every family's mapping table between transformers' tensors and ours is made of: the
row orders of the rotary embedding and of DiffLlama's head grouping (interop.hf's docstring, points
1-3), Llama's names for the tensors every Llama-like family shares, one :class:`TensorSource` per
tensor of ours, and the RoPE settings of a config.json. The tables themselves: Llama and DiffLlama
in :mod:`~diff_transformer.interop.hf`, Motif in :mod:`~diff_transformer.interop.motif`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from ..checks import MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, Field, check_fields
from ..config import ConfigError, ModelConfig, RopeScaling


class HFConversionError(ValueError):
    """A model cannot be converted to or from Hugging Face format; the message says why."""


def rotate_half_order(d: int) -> Tensor:
    """Row order taking one interleaved-RoPE head (pairs 2i, 2i+1) to rotate-half (i, i + d/2)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def permute_head_rows(weight: Tensor, d: int, order: Tensor) -> Tensor:
    """weight (n·d, E) or a bias (n·d,): reorder the d rows of each of the n heads by ``order``."""
    return weight.reshape(-1, d, *weight.shape[1:])[:, order].reshape(weight.shape)


def pairs_to_halves(weight: Tensor, d: int) -> Tensor:
    """(n·2·d, E) rows grouped [unit g][copy c][d] -> [copy c][unit g][d] (HF's contiguous halves)."""
    e = weight.shape[-1]
    return weight.view(-1, 2, d, e).transpose(0, 1).reshape(weight.shape)


def halves_to_pairs(weight: Tensor, d: int) -> Tensor:
    """Inverse of :func:`pairs_to_halves`."""
    e = weight.shape[-1]
    return weight.view(2, -1, d, e).transpose(0, 1).reshape(weight.shape)


def rotate_half_to_interleaved(d: int) -> Callable[[Tensor], Tensor]:
    """The transform of a q/k projection (or its bias) whose heads of width d rotate halves (HF's
    RoPE) into ours, which rotates interleaved pairs (interop.hf, point 1)."""
    order = torch.argsort(rotate_half_order(d))
    return lambda weight: permute_head_rows(weight, d, order)


def llama_names(config: ModelConfig) -> dict[str, str]:
    """Our name -> HF name of every tensor that copies unchanged (all but attention)."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        names[ours + "ffn_norm.weight"] = theirs + "post_attention_layernorm.weight"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"{ours}ffn.{proj}.weight"] = f"{theirs}mlp.{proj}.weight"
    return names


@dataclass(frozen=True)
class TensorSource:
    """One tensor of ours: the HF tensor ``name`` through ``transform`` (None: as it is), or, for a
    tensor the family does not have, ``make()`` (DiffLlama's head-norm weight: ones, folded)."""

    name: str | None
    transform: Callable[[Tensor], Tensor] | None = None
    make: Callable[[], Tensor] | None = None


def plain_sources(config: ModelConfig) -> dict[str, TensorSource]:
    """The tensors every Llama-like family stores under Llama's names: embeddings, LM head, norms, MLP."""
    return {ours: TensorSource(theirs) for ours, theirs in llama_names(config).items()}


# Every field of a config.json that some family reads (interop.hf, interop.motif), checked by type and
# range before any is used (checks.check_fields); null stands for absent where a reader has a default.
_WIDTH, _OPTIONAL_WIDTH, _POSITIVE = Field("int", 1, MAX_WIDTH), Field("int", 1, MAX_WIDTH, nullable=True), \
    Field("number", positive=True)
HF_CONFIG_FIELDS = {
    "vocab_size": Field("int", 1, MAX_VOCAB), "hidden_size": _WIDTH, "intermediate_size": _WIDTH,
    "num_hidden_layers": Field("int", 1, MAX_LAYERS), "num_attention_heads": _WIDTH,
    "num_key_value_heads": _OPTIONAL_WIDTH, "head_dim": _OPTIONAL_WIDTH,
    "num_noise_heads": Field("int", 0, MAX_WIDTH, nullable=True),
    "max_position_embeddings": Field("int", 1, MAX_SEQ_LEN, nullable=True),
    "rms_norm_eps": Field("number", maximum=1, positive=True),
    "attn_rms_norm_eps": Field("number", maximum=1, positive=True),
    "initializer_range": Field("number", 0, nullable=True), "lambda_std_dev": Field("number", 0, nullable=True),
    "rope_theta": Field("number", positive=True, nullable=True),
    "tie_word_embeddings": Field("bool", nullable=True), "attention_bias": Field("bool", nullable=True),
    "mlp_bias": Field("bool", nullable=True), "use_bias": Field("bool", nullable=True),
    "qkv_bias": Field("bool", nullable=True), "hidden_act": Field("str", nullable=True),
}
ROPE_VALUE_FIELDS = {"rope_theta": _POSITIVE, "factor": _POSITIVE, "low_freq_factor": _POSITIVE,
                     "high_freq_factor": _POSITIVE,
                     "original_max_position_embeddings": Field("int", 1, MAX_SEQ_LEN), "rope_type": Field("str"),
                     "type": Field("str")}

# The fields of each RoPE kind that are read (transformers' names); any other is refused by name.
ROPE_FIELDS = {"default": (), "linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def hf_rope(hf: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """θ and the scaling from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``
    (older files, and Motif's; a top-level ``original_max_position_embeddings`` completes llama3's, as
    vLLM reads it). Plain RoPE, "linear" and "llama3" are read; any other kind or field is refused."""
    given = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = hf.get(name)
        if value is not None and not isinstance(value, dict):
            raise HFConversionError(f"{path}: {name} must be a JSON object or null, not {type(value).__name__}")
        if value:
            check_fields(value, ROPE_VALUE_FIELDS, f"{path}: {name}")
            given[name] = dict(value)
    if len(given) == 2:  # a legacy rope_scaling beside transformers 5's rope_parameters: one must be meant
        legacy, current = (given[name].get("rope_type", given[name].get("type", "default")) for name in given)
        if legacy != current:
            raise HFConversionError(f"{path}: rope_scaling (kind {legacy!r}) and rope_parameters (kind {current!r}) "
                                    "disagree; keep the one the model was trained with")
    params = dict(given.get("rope_scaling", {}))
    params.update(given.get("rope_parameters", {}))
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10_000.0)))
    if kind not in ROPE_FIELDS:
        raise HFConversionError(f"{path}: RoPE scaling {kind!r} is not supported (plain RoPE, 'linear' and 'llama3' "
                                "are)")
    original = "original_max_position_embeddings"
    if kind == "llama3" and original not in params and hf.get(original):
        params[original] = hf[original]
    extra = sorted(set(params) - set(ROPE_FIELDS[kind]))
    if extra:
        raise HFConversionError(f"{path}: RoPE field(s) {', '.join(extra)} of kind {kind!r} are not read here")
    if kind == "default":
        return theta, None
    absent = [name for name in ROPE_FIELDS[kind] if name not in params]
    if absent:
        raise HFConversionError(f"{path}: RoPE scaling {kind!r} needs {', '.join(absent)}")
    try:
        scaling = RopeScaling(kind=kind, factor=params["factor"], low_freq_factor=params.get("low_freq_factor"),
                              high_freq_factor=params.get("high_freq_factor"),
                              original_max_seq_len=params.get("original_max_position_embeddings"))
    except ConfigError as exc:
        raise HFConversionError(f"{path}: {exc}") from exc
    return theta, scaling
