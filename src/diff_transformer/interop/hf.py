"""Hugging Face transformers interop: export to ``DiffLlama`` / ``Llama``, import back.

    export_hf(CHECKPOINT, OUT)   a checkpoint of this project -> an HF directory that
                                 ``AutoModelForCausalLM.from_pretrained(OUT)`` opens as
                                 DiffLlamaForCausalLM (DIFF) or LlamaForCausalLM (standard)
    import_hf(DIR, OUT)          a DiffLlama or Llama directory -> a checkpoint of this project

The HF directory holds config.json, model.safetensors (fp32, never a pickle) and the tokenizer
as a ``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json, with
``<|endoftext|>`` as eos, bos and pad token).

Weight mapping, per layer (H DIFF heads, Hkv KV groups, head dim d; HF's DiffLlama counts
2H attention heads and 2Hkv key/value heads of width d):

1. Rotary order. We rotate interleaved pairs (2i, 2i+1) of each d-wide q/k head; HF rotates
   halves (i, i + d/2) with the same frequency for pair i. Taking each head's q/k projection
   rows in the order (0, 2, 4, …, 1, 3, 5, …) turns one into the other exactly: the same
   permutation on q and k leaves every rotated dot product unchanged.
2. Head grouping (DIFF). Our q_proj holds DIFF head h as adjacent sub-heads 2h (Q1), 2h+1 (Q2);
   HF splits its 2H query heads into contiguous halves, head c·H + h being group c of DIFF
   head h. So our sub-head (h, c) <-> HF q head c·H + h, and likewise our key sub-head (g, c)
   <-> HF k head c·Hkv + g.
3. Values (DIFF). Our KV group g owns 2d value channels. HF chunks its 2Hkv value heads into
   two halves, attends with each, and concatenates the two outputs along the channels, so HF v
   head g gives the first d channels of group g and HF v head Hkv + g the last d: the same
   (g, c) <-> c·Hkv + g regrouping as the keys, without the rotary permutation.
4. Head norm (DIFF). Our per-head RMSNorm(2d) has a weight w; HF's has none. The normed heads
   are scaled by (1 − λ_init) and fed to o_proj, which is linear in each channel, so the
   weight folds exactly into o_proj's columns: W_o' = W_o · diag(tile(w, H)). Importing sets
   our head-norm weight to ones and keeps the folded W_o, which computes the same function.
5. λ vectors, MLP, block norms, embeddings and the LM head copy over unchanged.

What HF cannot express is refused with a :class:`HFConversionError`: DIFF V2, symmetric DIFF,
gated attention, multi-token attention and exclusive self-attention (no HF class computes them), a
constant λ_init (HF hard-codes the depth schedule), DIFF without its head norm, a block
``norm_eps`` other than the head norm's 1e-5 (HF shares one eps between them), DIFF heads with
d-wide values (``value_factor=1``: a converted Transformer), and a standard model with the
head-norm ablation (no Llama equivalent).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..checkpoint import (
    FORMAT,
    CheckpointError,
    load_checkpoint_tokenizer,
    load_state_dict_checked,
    read_weights,
    write_directory_atomically,
)
from ..config import GATED_KINDS, ModelConfig
from ..files import check_output_dir, lock_output
from ..model import LanguageModel
from ..tokenizer import BPE_FILE, EOS_TOKEN, BPETokenizer, ByteTokenizer

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"  # sharded weights: {"weight_map": {name: shard file}}
HF_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
HEAD_NORM_EPS = 1e-5  # DiffAttention's head norm; HF uses config.rms_norm_eps for it
ARCHITECTURES = {"diff": ("diffllama", "DiffLlamaForCausalLM"), "standard": ("llama", "LlamaForCausalLM")}
LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
# lm-evaluation-harness tasks shipped with the package: lm_eval ... --include_path LM_EVAL_TASKS
LM_EVAL_TASKS = Path(__file__).resolve().parents[1] / "assets" / "lm_eval"


class HFConversionError(ValueError):
    """A model cannot be converted to or from Hugging Face format; the message says why."""


# --- the tensor transforms (documented in the module docstring) ----------------------------


def _rotate_half_order(d: int) -> Tensor:
    """Row order taking one interleaved-RoPE head (pairs 2i, 2i+1) to rotate-half (i, i + d/2)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _permute_head_rows(weight: Tensor, d: int, order: Tensor) -> Tensor:
    """weight (n·d, E): reorder the d rows of each of the n heads by ``order``."""
    return weight.view(-1, d, weight.shape[-1])[:, order].reshape(weight.shape)


def _pairs_to_halves(weight: Tensor, d: int) -> Tensor:
    """(n·2·d, E) rows grouped [unit g][copy c][d] -> [copy c][unit g][d] (HF's contiguous halves)."""
    e = weight.shape[-1]
    return weight.view(-1, 2, d, e).transpose(0, 1).reshape(weight.shape)


def _halves_to_pairs(weight: Tensor, d: int) -> Tensor:
    """Inverse of :func:`_pairs_to_halves`."""
    e = weight.shape[-1]
    return weight.view(2, -1, d, e).transpose(0, 1).reshape(weight.shape)


def _attention_to_hf(attn: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """One layer's attention tensors (our names without prefix) -> HF's (names without prefix)."""
    d = config.head_dim
    to_half = _rotate_half_order(d)
    q = _permute_head_rows(attn["q_proj.weight"], d, to_half)
    k = _permute_head_rows(attn["k_proj.weight"], d, to_half)
    out = {"v_proj.weight": attn["v_proj.weight"], "o_proj.weight": attn["o_proj.weight"]}
    if config.attention == "diff":
        q, k = _pairs_to_halves(q, d), _pairs_to_halves(k, d)
        out["v_proj.weight"] = _pairs_to_halves(attn["v_proj.weight"], d)
        # o_proj input channels are (head h, 2d); scale each by its head-norm weight.
        head_norm = attn["head_norm.weight"].to(attn["o_proj.weight"].dtype)
        out["o_proj.weight"] = attn["o_proj.weight"] * head_norm.repeat(config.n_heads)[None, :]
        out.update({name: attn[name] for name in LAMBDA_VECTORS})
    out["q_proj.weight"], out["k_proj.weight"] = q, k
    return out


def _attention_from_hf(attn: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Inverse of :func:`_attention_to_hf`; the head-norm weight comes back as ones (folded)."""
    d = config.head_dim
    to_interleaved = torch.argsort(_rotate_half_order(d))
    q, k = attn["q_proj.weight"], attn["k_proj.weight"]
    out = {"v_proj.weight": attn["v_proj.weight"], "o_proj.weight": attn["o_proj.weight"]}
    if config.attention == "diff":
        q, k = _halves_to_pairs(q, d), _halves_to_pairs(k, d)
        out["v_proj.weight"] = _halves_to_pairs(attn["v_proj.weight"], d)
        out["head_norm.weight"] = torch.ones(2 * d, dtype=attn["o_proj.weight"].dtype)
        out.update({name: attn[name] for name in LAMBDA_VECTORS})
    out["q_proj.weight"] = _permute_head_rows(q, d, to_interleaved)
    out["k_proj.weight"] = _permute_head_rows(k, d, to_interleaved)
    return out


def _plain_renames(config: ModelConfig) -> dict[str, str]:
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


def to_hf_state_dict(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> the HF DiffLlama/Llama state dict (see the module docstring)."""
    check_exportable(config)
    hf = {theirs: state[ours] for ours, theirs in _plain_renames(config).items()}
    for i in range(config.n_layers):
        prefix = f"layers.{i}.attn."
        attn = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
        for name, tensor in _attention_to_hf(attn, config).items():
            hf[f"model.layers.{i}.self_attn.{name}"] = tensor
    return {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in hf.items()}


def from_hf_state_dict(hf: dict[str, Tensor], config: ModelConfig, source: str = "HF weights") -> dict[str, Tensor]:
    """An HF DiffLlama/Llama state dict -> ours. Unknown, missing or mis-shaped tensors are errors."""
    hf = dict(hf)
    if config.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some writers store the tied head twice
    for i in range(config.n_layers):
        hf.pop(f"model.layers.{i}.self_attn.rotary_emb.inv_freq", None)  # a buffer older versions saved
    renames = _plain_renames(config)
    state: dict[str, Tensor] = {}
    missing = []
    for ours, theirs in renames.items():
        if theirs in hf:
            state[ours] = hf.pop(theirs)
        else:
            missing.append(theirs)
    attn_names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    if config.attention == "diff":
        attn_names += list(LAMBDA_VECTORS)
    for i in range(config.n_layers):
        prefix = f"model.layers.{i}.self_attn."
        absent = [prefix + n for n in attn_names if prefix + n not in hf]
        if absent:
            missing += absent
            continue
        attn = {n: hf.pop(prefix + n) for n in attn_names}
        try:
            converted = _attention_from_hf(attn, config)
        except RuntimeError as exc:  # a view() that does not fit: wrong head counts or widths
            raise CheckpointError(f"{source}: layer {i} attention tensors do not fit the config ({exc})") from exc
        state.update({f"layers.{i}.attn.{n}": t for n, t in converted.items()})
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if hf:
        problems.append(f"not understood: {', '.join(sorted(hf))}")
    if problems:
        raise CheckpointError(f"{source} do not match the config — " + " | ".join(problems))
    return {name: t.to(torch.float32) for name, t in state.items()}


# --- configs --------------------------------------------------------------------------------


def check_exportable(config: ModelConfig) -> None:
    """Raise HFConversionError if transformers has no class computing what ``config`` computes."""
    if config.attention == "diff_v2":
        raise HFConversionError(
            "DIFF V2 has no Hugging Face transformers class (only DiffLlama, the original DIFF, and Llama); "
            "it cannot be exported"
        )
    if config.attention == "diff_symmetric":
        raise HFConversionError(
            "symmetric DIFF (attention='diff_symmetric', keys = queries) has no transformers equivalent (DiffLlama "
            "has separate query and key projections); it cannot be exported"
        )
    if config.attention in GATED_KINDS:
        # transformers' gated attentions (Qwen3-Next, Qwen3.5, Beam, AFMoE, LFM3, ...) all normalise q and k
        # per head (or differ further: partial RoPE, sliding windows, MoE, recurrent stacks): none is this
        raise HFConversionError(
            f"gated attention (attention={config.attention!r}) has no transformers equivalent: its classes with an "
            "output gate (Qwen3-Next and others) also normalise queries and keys; it cannot be exported"
        )
    if config.attention == "mta":
        raise HFConversionError(
            "multi-token attention (attention='mta') has no transformers equivalent: no class there convolves "
            "attention logits over queries and keys or mixes the maps of heads; it cannot be exported"
        )
    if config.attention == "xsa":
        raise HFConversionError(
            "exclusive self-attention (attention='xsa') has no transformers equivalent: Llama's attention keeps each "
            "output's component along the token's own value; it cannot be exported"
        )
    if config.attention == "standard":
        if config.head_norm:
            raise HFConversionError(
                "a standard-attention model with the head-norm ablation (head_norm=True) has no Llama equivalent"
            )
        return
    if config.value_factor != 2:
        raise HFConversionError(
            f"DiffLlama's DIFF heads have values of width 2·head_dim; this model's are {config.value_factor}·head_dim "
            f"(value_factor={config.value_factor}, a Transformer converted by diff-transformer convert) and cannot "
            "be exported"
        )
    if not config.head_norm:
        raise HFConversionError("DiffLlama always applies the per-head norm; a DIFF model with head_norm=False "
                                "cannot be exported")
    if config.lambda_init is not None:
        raise HFConversionError(
            f"DiffLlama hard-codes λ_init = 0.8 − 0.6·exp(−0.3·layer); this model uses a constant "
            f"lambda_init={config.lambda_init} and cannot be exported"
        )
    if config.norm_eps != HEAD_NORM_EPS:
        raise HFConversionError(
            f"DiffLlama uses one rms_norm_eps for the block norms and the head norm; the head norm's eps is "
            f"{HEAD_NORM_EPS} but this model's norm_eps is {config.norm_eps}"
        )


def hf_config_dict(config: ModelConfig, eos_id: int | None) -> dict[str, Any]:
    """The arguments of transformers' DiffLlamaConfig / LlamaConfig for ``config``."""
    check_exportable(config)
    model_type, architecture = ARCHITECTURES[config.attention]
    heads_per_unit = 2 if config.attention == "diff" else 1  # HF counts both groups of a DIFF head
    init = {"lambda_std_dev": config.lambda_std} if config.attention == "diff" else {}
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": heads_per_unit * config.n_heads,
        "num_key_value_heads": heads_per_unit * config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "initializer_range": config.init_std,
        **init,
        "dtype": "float32",
    }


def _rope_theta(hf: dict[str, Any], path: Path) -> float:
    """θ from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (older files)."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    scaling = hf.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise HFConversionError(f"{path}: RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def model_config_from_hf(hf: dict[str, Any], path: Path) -> ModelConfig:
    """Our ModelConfig for a DiffLlama or Llama config.json (already parsed); ``path`` for errors."""
    model_type = hf.get("model_type")
    kinds = {model_type: attention for attention, (model_type, _) in ARCHITECTURES.items()}
    if model_type not in kinds:
        raise HFConversionError(f"{path}: model_type {model_type!r} is not supported (only 'diffllama' and 'llama')")
    attention = kinds[model_type]
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    absent = [name for name in required if name not in hf]
    if absent:
        raise HFConversionError(f"{path}: missing field(s) {', '.join(absent)}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConversionError(f"{path}: {flag}=true is not supported (this project's models have no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise HFConversionError(
            f"{path}: head_dim {head_dim} × num_attention_heads {heads} != hidden_size {hf['hidden_size']} "
            "(this project needs the heads to fill the model width)"
        )
    eps = float(hf.get("rms_norm_eps", 1e-6))
    init = {"init_std": float(hf.get("initializer_range", 0.02))}
    if attention == "diff":
        init["lambda_std"] = float(hf.get("lambda_std_dev") or 0.1)
        if heads % 2 or kv_heads % 2:
            raise HFConversionError(f"{path}: DiffLlama needs even num_attention_heads and num_key_value_heads")
        if eps != HEAD_NORM_EPS:
            raise HFConversionError(
                f"{path}: rms_norm_eps={eps}; DiffLlama uses it for the head norm too, "
                f"whose eps is {HEAD_NORM_EPS} here"
            )
        heads, kv_heads = heads // 2, kv_heads // 2
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=kv_heads,
            attention=attention,
            ffn_hidden=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=_rope_theta(hf, path),
            norm_eps=eps,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **init,
        )
    except ValueError as exc:
        raise HFConversionError(f"{path}: cannot be represented as a ModelConfig: {exc}") from exc


# --- tokenizers -----------------------------------------------------------------------------


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


def _is_byte_tokenizer(path: Path) -> bool:
    """Whether the tokenizers JSON at ``path`` is :func:`byte_tokenizer_json` (as export writes it)."""
    fields = ("model", "pre_tokenizer", "decoder", "normalizer")  # transformers adds a no-op post_processor
    written = json.loads(path.read_text())
    reference = json.loads(byte_tokenizer_json().to_str())
    same_tokens = ([(t["id"], t["content"]) for t in written.get("added_tokens", [])]
                   == [(ByteTokenizer.eos_id, EOS_TOKEN)])
    return same_tokens and all(written.get(f) == reference.get(f) for f in fields)


def _save_hf_tokenizer(tokenizer: ByteTokenizer | BPETokenizer, directory: Path, max_len: int) -> None:
    """Write ``tokenizer`` as a transformers PreTrainedTokenizerFast into ``directory``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = (byte_tokenizer_json() if isinstance(tokenizer, ByteTokenizer)
               else Tokenizer.from_file(str(tokenizer.path)))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=max_len,
    )
    fast.save_pretrained(str(directory))


# --- whole directories ----------------------------------------------------------------------


def save_hf(model: LanguageModel, directory: str | Path, tokenizer: ByteTokenizer | BPETokenizer | None = None, *,
            overwrite: bool = False, reading: Iterable[str | Path] = ()) -> Path:
    """Write ``model`` (and ``tokenizer``) as a transformers directory, atomically. ``directory``
    must be new, empty, or (with ``overwrite``) an export of this project; ``reading``: paths it
    must not be or contain (see :func:`~diff_transformer.files.check_output_dir`)."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise HFConversionError("exporting needs transformers: pip install 'diff-transformer[hf]'") from exc
    config = model.config
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                              f"{config.vocab_size}")
    fields = hf_config_dict(config, None if tokenizer is None else tokenizer.eos_id)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    weights = to_hf_state_dict(model.state_dict(), config)

    def write(tmp: Path) -> None:
        hf_config.save_pretrained(str(tmp))
        save_file(weights, str(tmp / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer is not None:
            _save_hf_tokenizer(tokenizer, tmp, config.max_seq_len)

    return write_directory_atomically(directory, write, kind="hf-export", overwrite=overwrite, reading=reading)


def export_hf(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """A checkpoint directory of this project -> a transformers directory at ``out`` (new, empty,
    or with ``overwrite`` an earlier export; never the checkpoint itself)."""
    check_output_dir(out, "hf-export", overwrite=overwrite, reading=[checkpoint])  # before the work
    with lock_output(out):  # one writer: a second export to ``out`` is refused before its work
        model = LanguageModel.from_pretrained(checkpoint)
        tokenizer = load_checkpoint_tokenizer(checkpoint, model.config.vocab_size)
        return save_hf(model, out, tokenizer, overwrite=overwrite, reading=[checkpoint])


def _read_hf_weights(directory: Path) -> dict[str, Tensor]:
    """model.safetensors, or the shards a model.safetensors.index.json names. Never a pickle."""
    if (directory / HF_WEIGHTS_FILE).is_file():
        return read_weights(directory / HF_WEIGHTS_FILE)
    index = directory / HF_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index (expected a 'weight_map')") from exc
        weights: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:
                raise CheckpointError(f"{index}: shard name {shard!r} must be a file in the same directory")
            weights.update(read_weights(directory / shard))
        return weights
    if any((directory / name).exists() for name in HF_PICKLE_FILES):
        raise CheckpointError(
            f"{directory}: only pickled weights (pytorch_model.bin), which are never loaded here because "
            "unpickling runs arbitrary code; convert them to safetensors first"
        )
    raise CheckpointError(f"{directory}: no {HF_WEIGHTS_FILE} or {HF_INDEX_FILE}")


def _load_hf_tokenizer(directory: Path) -> ByteTokenizer | BPETokenizer | None:
    """The directory's tokenizer.json as our tokenizer (ByteTokenizer if it is the byte one), or None."""
    path = directory / BPE_FILE
    if not path.is_file():
        return None
    try:
        tokenizer = BPETokenizer(path)
    except ValueError as exc:
        raise HFConversionError(f"{exc}; import without it using --no-tokenizer") from exc
    return ByteTokenizer() if _is_byte_tokenizer(path) else tokenizer


def load_hf(directory: str | Path, *,
            with_tokenizer: bool = True) -> tuple[LanguageModel, ByteTokenizer | BPETokenizer | None]:
    """A DiffLlama or Llama directory -> (our model in fp32, its tokenizer or None)."""
    directory = Path(directory)
    path = directory / HF_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a transformers model directory (no {HF_CONFIG_FILE})")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if hf.get("format") == FORMAT:
        raise CheckpointError(f"{directory} is already a diff-transformer checkpoint, not a transformers directory: "
                              f"nothing to import; use it as it is (LanguageModel.from_pretrained, generate, eval, "
                              f"train --init-from)")
    config = model_config_from_hf(hf, path)
    state = from_hf_state_dict(_read_hf_weights(directory), config, source=f"{directory} weights")
    model = LanguageModel(config, device="meta")
    model.to_empty(device="cpu")
    load_state_dict_checked(model, state, source=f"{directory} weights")
    tokenizer = _load_hf_tokenizer(directory) if with_tokenizer else None
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{directory / BPE_FILE}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}"
        )
    return model, tokenizer


def import_hf(directory: str | Path, out: str | Path, *, with_tokenizer: bool = True, overwrite: bool = False) -> Path:
    """A DiffLlama or Llama directory -> a checkpoint of this project at ``out`` (new, empty, or
    with ``overwrite`` a checkpoint of this project; never the directory read)."""
    check_output_dir(out, "checkpoint", overwrite=overwrite, reading=[directory])  # before the work
    with lock_output(out):  # one writer: a second import to ``out`` is refused before its work
        model, tokenizer = load_hf(directory, with_tokenizer=with_tokenizer)
        return model.save_pretrained(out, tokenizer, overwrite=overwrite, reading=[directory])
