"""A checkpoint back to Motif's released layout: ``export-hf --layout motif`` (the default for a model of
Motif's arithmetic, as ``import-hf`` reads Motif-2.6B and Motif-2-12.7B).

The inverse of :mod:`diff_transformer.interop.motif`: config.json with Motif's field names and the
values ``import-hf`` reads from them, the tensors under Motif's names (q/k rows back to the
rotate-half order of each head), sharded safetensors ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``, and the tokenizer. Every tensor is written in the dtype the
checkpoint holds its embedding in, the λ vectors too (a bf16 release imported with ``--dtype bfloat16``
leaves as it came: same names, same bytes). Motif's modeling code is not shipped (it is Motif's):
engines that read Motif's releases read this directory, and transformers loads it with the
modeling files of a Motif release copied beside it.

What Motif's layout cannot express is refused by name, before anything is written: other attention
kinds, the SiLU MLP, λ_init on another schedule, no head norm, d-wide DIFF values, a PolyNorm eps
other than Motif's, and MLP biases without an o_proj bias (one flag, ``use_bias``, sets both there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from ..checkpoint import CheckpointError, write_directory_atomically
from ..config import POLYNORM_EPS, ModelConfig
from ..model import LanguageModel
from ..tokenizer import BPETokenizer, ByteTokenizer
from .hf_files import HF_CONFIG_FILE, HF_INDEX_FILE, save_hf_tokenizer
from .mapping import HFConversionError, permute_head_rows, rotate_half_order
from .motif import MOTIF_LAMBDA_DEPTH_OFFSET, motif_sources

MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default shard size
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def motif_refusal(config: ModelConfig) -> str | None:
    """Why ``config`` has no Motif layout, or None when it has one."""
    if config.attention not in ("diff", "gda"):
        return f"attention={config.attention!r} (Motif's models are DIFF, Motif-2.6B, or GDA, Motif-2-12.7B)"
    if config.ffn_activation != "polynorm":
        return f"ffn_activation={config.ffn_activation!r} (Motif's MLP is PolyNorm)"
    if config.lambda_init is not None or config.lambda_init_depth_offset != MOTIF_LAMBDA_DEPTH_OFFSET:
        return ("λ_init on another schedule than Motif's 0.8 − 0.6·exp(−0.3·(layer − 1)) (lambda_init="
                f"{config.lambda_init}, lambda_init_depth_offset={config.lambda_init_depth_offset})")
    if not config.head_norm or config.value_factor != 2:
        return "DIFF heads without the head norm or with d-wide values (Motif's have both)"
    if config.polynorm_eps != POLYNORM_EPS:
        return f"polynorm_eps={config.polynorm_eps} (Motif's code fixes {POLYNORM_EPS})"
    if config.mlp_bias and not config.attention_out_bias:
        return "mlp_bias without attention_out_bias (Motif's use_bias sets both)"
    return None


def is_motif_model(config: ModelConfig) -> bool:
    """Whether ``config`` computes Motif's arithmetic (what ``import-hf`` makes of a Motif release)."""
    return motif_refusal(config) is None


def check_motif_exportable(config: ModelConfig) -> None:
    why = motif_refusal(config)
    if why is not None:
        raise HFConversionError(f"--layout motif: this model has {why}; export it with --layout hf (transformers "
                                "remote code) instead")


def motif_config_dict(config: ModelConfig, dtype: torch.dtype, eos_id: int | None,
                      bos_id: int | None) -> dict[str, Any]:
    """Motif's config.json for ``config``: the fields :func:`~diff_transformer.interop.motif.motif_model_config`
    reads, set so that it reads ``config`` back."""
    d = config.head_dim
    signal = config.n_heads
    fields: dict[str, Any] = {
        "architectures": ["MotifForCausalLM"],
        "model_type": "Motif",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": signal + config.n_noise_heads,
        "num_key_value_heads": 2 * config.n_kv_heads,
        "hidden_act": "poly_norm",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "attn_rms_norm_eps": config.head_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": _rope_scaling(config),
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.attention_out_bias,  # vLLM: o_proj's bias (and q/k/v's without qkv_bias)
        "qkv_bias": config.attention_bias,
        "use_bias": config.mlp_bias,
        "initializer_range": config.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if config.attention == "gda":
        fields.update(num_noise_heads=config.n_noise_heads, head_dim=d, k_ratio=1)
    elif config.attn_head_dim is not None:  # heads that do not fill hidden_size
        fields["head_dim"] = d
    return fields


def _rope_scaling(config: ModelConfig) -> dict[str, Any] | None:
    scaling = config.rope_scaling
    if scaling is None:
        return None
    fields: dict[str, Any] = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind == "llama3":
        fields.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                      original_max_position_embeddings=scaling.original_max_seq_len)
    return fields


def to_motif_tensors(state: dict[str, Tensor], config: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """Our tensors -> Motif's names and row order (q/k rows of each head back to rotate-half), in ``dtype``."""
    to_halves = rotate_half_order(config.head_dim)
    out = {}
    for ours, source in motif_sources(config).items():
        tensor = state[ours]
        if source.transform is not None:  # the q/k projections (and their biases)
            tensor = permute_head_rows(tensor, config.head_dim, to_halves)
        out[source.name] = tensor.detach().to("cpu", dtype).contiguous()
    return out


def shard(tensors: dict[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    """Consecutive groups of ``tensors`` of at most ``max_bytes`` each (a larger tensor alone)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save_motif(model: LanguageModel, directory: str | Path, tokenizer: ByteTokenizer | BPETokenizer | None = None, *,
               dtype: torch.dtype = torch.float32, overwrite: bool = False, reading: Iterable[str | Path] = (),
               max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write ``model`` as a Motif directory, its tensors in ``dtype``, atomically (the rules of
    :func:`~diff_transformer.interop.hf.save_hf`); shards of at most ``max_shard_bytes``."""
    config = model.config
    check_motif_exportable(config)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                              f"{config.vocab_size}")
    tensors = to_motif_tensors(model.state_dict(), config, dtype)
    eos, bos = (None, None) if tokenizer is None else (tokenizer.eos_id, tokenizer.bos_id)
    fields = motif_config_dict(config, dtype, eos, bos)
    parts = shard(tensors, max_shard_bytes)

    def write(tmp: Path) -> None:
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n", encoding="utf-8")
        weight_map = {}
        for k, part in enumerate(parts):
            name = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            save_hf_tokenizer(tokenizer, tmp, config.max_seq_len)

    return write_directory_atomically(directory, write, kind="hf-export", overwrite=overwrite, reading=reading)


def stored_dtype(weights: Path) -> torch.dtype:
    """The dtype a checkpoint's safetensors file holds its embedding in (what a Motif export keeps)."""
    with safe_open(str(weights), "pt") as f:
        stored = f.get_slice("embed.weight").get_dtype()
    return STORED_DTYPES.get(stored, torch.float32)
