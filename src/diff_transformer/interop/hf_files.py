"""What every transformers directory this package writes holds, whatever the model in it (DiffLlama
and Llama: :mod:`~diff_transformer.interop.hf`; remote code: :mod:`~diff_transformer.interop.remote_code`;
Motif's layout: :mod:`~diff_transformer.interop.motif_export`): the file names, transformers 5's
``rope_parameters``, and the tokenizer as a ``PreTrainedTokenizerFast``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..tokenizer import EOS_TOKEN, BPETokenizer, ByteTokenizer

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"  # sharded weights: {"weight_map": {name: shard file}}


def rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of ``config`` (θ and the scaling, in transformers' names)."""
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    fields = {"rope_type": scaling.kind, "rope_theta": config.rope_theta, "factor": scaling.factor}
    if scaling.kind == "llama3":
        fields.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                      original_max_position_embeddings=scaling.original_max_seq_len)
    return fields


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: byte b -> the printable character byte-level BPE writes for it
    (printable Latin-1 bytes stand for themselves, the others for code points 256, 257, …)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return mapping


def byte_tokenizer_json():
    """A ``tokenizers.Tokenizer`` equal to :class:`ByteTokenizer`: byte b is token b, 256 is
    ``<|endoftext|>``. (One difference: it reads the literal text "<|endoftext|>" as token 256,
    as every BPE tokenizer of this project does, where ByteTokenizer spells it out in bytes.)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return tokenizer


def save_hf_tokenizer(tokenizer: ByteTokenizer | BPETokenizer, directory: Path, max_len: int) -> None:
    """Write ``tokenizer`` as a transformers PreTrainedTokenizerFast into ``directory``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = (byte_tokenizer_json() if isinstance(tokenizer, ByteTokenizer)
               else Tokenizer.from_file(str(tokenizer.path)))
    eos = getattr(tokenizer, "eos_token", EOS_TOKEN)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        bos_token=getattr(tokenizer, "bos_token", None) or eos,
        pad_token=eos,
        model_max_length=max_len,
    )
    fast.save_pretrained(str(directory))
