"""Export as transformers remote code: every attention kind, for a reader without this package.

Where transformers has no class computing a model exactly (DIFF V2, grouped differential, multi-token,
exclusive self- and gated attention, symmetric DIFF, PolyNorm MLPs, biases, a converted Transformer's
d-wide DIFF values, a constant or shifted λ_init, ...), ``export-hf`` writes:

    config.json                          model_type "diff_transformer", auto_map naming the two files below
    configuration_diff_transformer.py    the config class (imports transformers only)
    modeling_diff_transformer.py         the model (imports torch and transformers only)
    model.safetensors                    fp32, our tensors under Llama's names (:func:`remote_name`)
    tokenizer.json, tokenizer_config.json  when the checkpoint has a tokenizer

The two Python files are this package's own modules (:mod:`.configuration_diff_transformer`,
:mod:`.modeling_diff_transformer`), copied byte for byte: one statement of the arithmetic, held to
the library for every kind by tests/test_export_remote.py. ``AutoModelForCausalLM.from_pretrained(OUT,
trust_remote_code=True)`` loads it. The weights keep our layout (interleaved RoPE, DIFF's adjacent
sub-heads), so nothing is permuted and the export is exact up to the order of float operations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..checkpoint import CheckpointError, write_directory_atomically
from ..config import ModelConfig
from ..model import LanguageModel
from ..tokenizer import BPETokenizer, ByteTokenizer
from .hf_files import HF_CONFIG_FILE, HF_WEIGHTS_FILE, rope_parameters, save_hf_tokenizer

HERE = Path(__file__).resolve().parent
REMOTE_FILES = ("configuration_diff_transformer.py", "modeling_diff_transformer.py")
MODEL_TYPE = "diff_transformer"
AUTO_MAP = {
    "AutoConfig": "configuration_diff_transformer.DiffTransformerConfig",
    "AutoModel": "modeling_diff_transformer.DiffTransformerModel",
    "AutoModelForCausalLM": "modeling_diff_transformer.DiffTransformerForCausalLM",
}
# ModelConfig field -> its name in the remote config (transformers' Llama names where Llama has the quantity)
RENAMED = {"d_model": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size",
           "max_seq_len": "max_position_embeddings",
           "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings", "init_std": "initializer_range"}
COPIED = ("vocab_size", "attention", "polynorm_eps", "head_norm", "head_norm_eps", "attention_bias",
          "attention_out_bias", "mlp_bias", "value_factor", "lambda_init", "lambda_init_depth_offset", "lambda_std",
          "gda_ratio", "mta_query_kernel", "mta_key_kernel", "mta_conv_every", "mta_head_group", "xsa_gate")
# written in transformers' form: rope_parameters, head_dim (always resolved), hidden_act
REWRITTEN = ("rope_theta", "rope_scaling", "attn_head_dim", "ffn_activation")
# a rule for the shapes (intermediate_size is written) and the init recipe of training: no part of the function
NOT_CARRIED = ("ffn_multiple_of", "scale_residual_init")
# Our module names inside a layer -> Llama's (the longer prefix first)
LAYER_PARTS = (("attn_norm.", "input_layernorm."), ("attn.", "self_attn."), ("ffn_norm.", "post_attention_layernorm."),
               ("ffn.polynorm.", "mlp.act_fn."), ("ffn.", "mlp."))


def remote_config(config: ModelConfig, eos_id: int | None) -> dict[str, Any]:
    """config.json of the remote-code export of ``config`` (``eos_id``: the tokenizer's, or None)."""
    fields: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["DiffTransformerForCausalLM"],
                              "auto_map": dict(AUTO_MAP)}
    fields.update({theirs: getattr(config, ours) for ours, theirs in RENAMED.items()})
    fields.update({name: getattr(config, name) for name in COPIED})
    fields.update(head_dim=config.head_dim, rope_parameters=rope_parameters(config),
                  hidden_act="poly_norm" if config.ffn_activation == "polynorm" else "silu",
                  bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")
    return fields


def remote_name(name: str) -> str:
    """Our tensor name -> the remote model's: Llama's (``layers.3.attn.q_proj.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; ``layers.3.ffn.polynorm.weight`` ->
    ``model.layers.3.mlp.act_fn.weight``)."""
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)
    for ours, theirs in LAYER_PARTS:
        if rest.startswith(ours):
            return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
    raise ValueError(f"no remote name for tensor {name!r}")


def save_remote_code(model: LanguageModel, directory: str | Path,
                     tokenizer: ByteTokenizer | BPETokenizer | None = None, *, overwrite: bool = False,
                     reading: tuple[str | Path, ...] | list[str | Path] = ()) -> Path:
    """Write ``model`` (and ``tokenizer``) as a remote-code transformers directory, atomically, under
    the rules of :func:`~diff_transformer.interop.hf.save_hf` (new, empty, or with ``overwrite`` an
    earlier export; never a path among ``reading``)."""
    config = model.config
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                              f"{config.vocab_size}")
    fields = remote_config(config, None if tokenizer is None else tokenizer.eos_id)
    weights = {remote_name(name): t.detach().to("cpu", torch.float32).contiguous()
               for name, t in model.state_dict().items()}

    def write(tmp: Path) -> None:
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n", encoding="utf-8")
        for name in REMOTE_FILES:
            shutil.copyfile(HERE / name, tmp / name)
        save_file(weights, str(tmp / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer is not None:
            save_hf_tokenizer(tokenizer, tmp, config.max_seq_len)

    return write_directory_atomically(directory, write, kind="hf-export", overwrite=overwrite, reading=reading)
