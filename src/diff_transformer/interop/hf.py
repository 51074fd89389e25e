"""Hugging Face transformers interop: export to ``DiffLlama`` / ``Llama``, import from them and from
Motif's released models.

    export_hf(CHECKPOINT, OUT)   a checkpoint of this project -> an HF directory that
                                 ``AutoModelForCausalLM.from_pretrained(OUT)`` opens as
                                 DiffLlamaForCausalLM (DIFF) or LlamaForCausalLM (standard);
                                 every other model as remote code (:mod:`.remote_code`), a
                                 model of Motif's arithmetic in Motif's layout (:mod:`.motif_export`)
    import_hf(DIR, OUT)          a Llama, DiffLlama or Motif directory -> a checkpoint of this project

The exported directory holds config.json, model.safetensors (fp32, never a pickle) and the
tokenizer as a ``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json, with the
tokenizer's end-of-text token as eos, bos and pad token).

Importing reads one tensor at a time: the safetensors headers first (every tensor's name, shape
and dtype, checked against the model before any value is read), then shard by shard
(``safe_open``), each tensor converted, cast to ``dtype`` and written to the new checkpoint's
file at once (:func:`~diff_transformer.checkpoint.write_safetensors_streaming`). The memory held is
one tensor in its forms, never the model: about 3 × the largest tensor, plus the pages of the
shard being read that the kernel keeps mapped (docs/pretrained.md measures it). Each family has
one mapping table (:class:`TensorSource` per tensor of ours): Llama and DiffLlama here, Motif in
:mod:`diff_transformer.interop.motif`.

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

What DiffLlama and Llama cannot express is refused by :func:`save_hf` with a
:class:`HFConversionError` (``export_hf`` writes it as remote code instead): DIFF V2, symmetric DIFF,
gated attention, GDA, multi-token attention and exclusive self-attention (no HF class computes
them), PolyNorm MLPs, a constant or shifted λ_init (HF hard-codes the depth schedule), DIFF without
its head norm, a head-norm eps other than the block norms' (HF shares one eps between them), biases,
DIFF heads with d-wide values (``value_factor=1``: a converted Transformer), and a standard model
with the head-norm ablation (no Llama equivalent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from ..checkpoint import (
    FORMAT,
    WEIGHTS_FILE,
    CheckpointError,
    TensorSpec,
    load_checkpoint_tokenizer,
    read_config,
    write_config,
    write_directory_atomically,
    write_safetensors_streaming,
)
from ..checks import check_fields, few
from ..config import GATED_KINDS, ModelConfig
from ..files import check_output_dir, lock_output
from ..model import LanguageModel
from ..tokenizer import BPE_FILE, EOS_TOKEN, BPETokenizer, ByteTokenizer
from .hf_files import (
    HF_CONFIG_FILE,
    HF_INDEX_FILE,
    HF_WEIGHTS_FILE,
    byte_tokenizer_json,
    rope_parameters,
    save_hf_tokenizer,
)
from .mapping import (
    HF_CONFIG_FIELDS,
    HFConversionError,
    TensorSource,
    halves_to_pairs,
    hf_rope,
    llama_names,
    pairs_to_halves,
    permute_head_rows,
    plain_sources,
    rotate_half_order,
    rotate_half_to_interleaved,
)
from .motif import motif_model_config, motif_sources

HF_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
ARCHITECTURES = {"diff": ("diffllama", "DiffLlamaForCausalLM"), "standard": ("llama", "LlamaForCausalLM")}
LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
IMPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# lm-evaluation-harness tasks shipped with the package: lm_eval ... --include_path LM_EVAL_TASKS
LM_EVAL_TASKS = Path(__file__).resolve().parents[1] / "assets" / "lm_eval"


# --- export: our tensors -> transformers' (the transforms: interop.mapping) -------------------


def _attention_to_hf(attn: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """One layer's attention tensors (our names without prefix) -> HF's (names without prefix)."""
    d = config.head_dim
    to_half = rotate_half_order(d)
    q = permute_head_rows(attn["q_proj.weight"], d, to_half)
    k = permute_head_rows(attn["k_proj.weight"], d, to_half)
    out = {"v_proj.weight": attn["v_proj.weight"], "o_proj.weight": attn["o_proj.weight"]}
    if config.attention == "diff":
        q, k = pairs_to_halves(q, d), pairs_to_halves(k, d)
        out["v_proj.weight"] = pairs_to_halves(attn["v_proj.weight"], d)
        # o_proj input channels are (head h, 2d); scale each by its head-norm weight.
        head_norm = attn["head_norm.weight"].to(attn["o_proj.weight"].dtype)
        out["o_proj.weight"] = attn["o_proj.weight"] * head_norm.repeat(config.n_heads)[None, :]
        out.update({name: attn[name] for name in LAMBDA_VECTORS})
    out["q_proj.weight"], out["k_proj.weight"] = q, k
    return out


def to_hf_state_dict(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Our state dict -> the HF DiffLlama/Llama state dict (see the module docstring)."""
    check_exportable(config)
    hf = {theirs: state[ours] for ours, theirs in llama_names(config).items()}
    for i in range(config.n_layers):
        prefix = f"layers.{i}.attn."
        attn = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
        for name, tensor in _attention_to_hf(attn, config).items():
            hf[f"model.layers.{i}.self_attn.{name}"] = tensor
    return {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in hf.items()}


# --- reading a transformers directory, tensor by tensor ------------------------------------


class HFWeights:
    """The tensors of a transformers directory (model.safetensors, or the shards its
    model.safetensors.index.json names), known from the safetensors headers alone: each tensor's
    file, shape and dtype. :meth:`read` then reads tensors shard by shard, one at a time. Pickled
    weights (pytorch_model.bin) are refused: unpickling runs arbitrary code."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' names: "BF16", "F32", ...
        index = self._index()
        files = sorted(set(index.values())) if index is not None else [directory / HF_WEIGHTS_FILE]
        for file in files:
            try:
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        part = f.get_slice(name)
                        self.where[name], self.shapes[name] = file, tuple(part.get_shape())
                        self.dtypes[name] = part.get_dtype()
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{file}: truncated or corrupted safetensors file ({exc})") from exc
        if index is not None:
            wrong = sorted(name for name, file in index.items() if self.where.get(name) != file)
            if wrong:
                raise CheckpointError(f"{directory / HF_INDEX_FILE}: names tensors its shards do not hold where it "
                                      f"says ({', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''})")

    def _index(self) -> dict[str, Path] | None:
        """{tensor: shard file} of a sharded directory, None for a single model.safetensors."""
        directory = self.directory
        if (directory / HF_WEIGHTS_FILE).is_file():
            return None
        index = directory / HF_INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                items = weight_map.items()
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index (expected a 'weight_map')") from exc
            odd = [f"{name!r}: {value!r}" for name, value in items if not isinstance(value, str) or not value]
            if odd:
                raise CheckpointError(f"{index}: weight_map entries must name a shard file, got {few(odd)}")
            files = {name: Path(shard) for name, shard in items}
            for shard in set(files.values()):
                if shard.name != str(shard):
                    raise CheckpointError(f"{index}: shard name {str(shard)!r} must be a file in the same directory")
                if not (directory / shard).is_file():
                    raise CheckpointError(f"{index}: shard {shard} is missing")
            return {name: directory / shard for name, shard in files.items()}
        if any((directory / name).exists() for name in HF_PICKLE_FILES):
            raise CheckpointError(
                f"{directory}: only pickled weights (pytorch_model.bin), which are never loaded here because "
                "unpickling runs arbitrary code; convert them to safetensors first"
            )
        raise CheckpointError(f"{directory}: no {HF_WEIGHTS_FILE} or {HF_INDEX_FILE}")

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Tensor]]:
        """The tensors ``names`` in that order (ordered by file, that is shard by shard). Each is read
        through its own short ``safe_open`` of its shard: the pages of the shard that a read maps
        are let go with the tensor, so that what stays resident is the tensor being converted, not
        the shard (measured in tests/test_motif.py). A tensor holding NaN or Inf (safetensors has no
        checksum: damaged bytes show up as such) is a CheckpointError naming it."""
        for name in names:
            file = self.where[name]
            with safe_open(str(file), "pt") as f:
                tensor = f.get_tensor(name)
            if tensor.is_floating_point() and not _all_finite(tensor):
                raise CheckpointError(f"{file}: corrupted weights, NaN or Inf values in {name}")
            yield name, tensor


def _all_finite(tensor: Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every value is finite, checked 4M values at a time: ``isfinite`` of a whole embedding
    would hold temporaries of several times its size."""
    return all(bool(torch.isfinite(part).all()) for part in tensor.reshape(-1).split(chunk))


# --- the mapping tables: where each tensor of ours comes from ------------------------------


def _llama_sources(config: ModelConfig) -> dict[str, TensorSource]:
    """transformers' LlamaForCausalLM (attention="standard")."""
    sources = plain_sources(config)
    rotary = rotate_half_to_interleaved(config.head_dim)
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.attn.", f"model.layers.{i}.self_attn."
        for proj in ("q_proj", "k_proj"):
            sources[f"{ours}{proj}.weight"] = TensorSource(f"{theirs}{proj}.weight", rotary)
        for proj in ("v_proj", "o_proj"):
            sources[f"{ours}{proj}.weight"] = TensorSource(f"{theirs}{proj}.weight")
    return sources


def _diffllama_sources(config: ModelConfig) -> dict[str, TensorSource]:
    """transformers' DiffLlamaForCausalLM (attention="diff"; points 1-4 of the module docstring)."""
    sources = plain_sources(config)
    d = config.head_dim
    rotary = rotate_half_to_interleaved(d)

    def grouped_rotary(weight: Tensor) -> Tensor:
        return rotary(halves_to_pairs(weight, d))

    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.attn.", f"model.layers.{i}.self_attn."
        sources[f"{ours}q_proj.weight"] = TensorSource(f"{theirs}q_proj.weight", grouped_rotary)
        sources[f"{ours}k_proj.weight"] = TensorSource(f"{theirs}k_proj.weight", grouped_rotary)
        sources[f"{ours}v_proj.weight"] = TensorSource(f"{theirs}v_proj.weight", lambda w: halves_to_pairs(w, d))
        sources[f"{ours}o_proj.weight"] = TensorSource(f"{theirs}o_proj.weight")
        sources[f"{ours}head_norm.weight"] = TensorSource(None, make=lambda: torch.ones(2 * d))  # folded into o_proj
        for vec in LAMBDA_VECTORS:
            sources[f"{ours}{vec}"] = TensorSource(f"{theirs}{vec}")
    return sources


def ignorable_hf_tensor(name: str, config: ModelConfig) -> bool:
    """Tensors a transformers directory may hold that carry nothing: the RoPE buffer older versions
    saved, and a tied LM head stored a second time."""
    return name.endswith(".rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")


@dataclass
class ImportPlan:
    """What importing a directory writes: every tensor of ours (in reading order: the made ones,
    then file by file) with its source and its spec in the new checkpoint."""

    config: ModelConfig
    family: str
    sources: list[tuple[str, TensorSource]]
    specs: list[TensorSpec]

    def tensors(self, weights: HFWeights) -> Iterator[tuple[str, Tensor]]:
        """Each tensor of ours, converted and cast, one at a time (see :class:`HFWeights`)."""
        made = [(ours, src) for ours, src in self.sources if src.make is not None]
        read = [(ours, src) for ours, src in self.sources if src.make is None]
        specs = iter(self.specs)
        for ours, src in made:
            yield ours, src.make().to(next(specs).dtype)
        for (ours, src), (_, tensor) in zip(read, weights.read(src.name for _, src in read)):
            if src.transform is not None:
                tensor = src.transform(tensor)
            yield ours, tensor.to(next(specs).dtype).contiguous()


def plan_import(weights: HFWeights, config: ModelConfig, family: str, dtype: torch.dtype) -> ImportPlan:
    """Check every tensor of ``weights`` against the model of ``config`` from the headers (none
    missing, none unknown, each of the model's shape and floating point): a CheckpointError naming
    every problem, before any value is read; then the plan. The λ vectors stay fp32 (the model
    keeps them so); every other tensor becomes ``dtype``."""
    if family == "motif":
        table = motif_sources
    else:
        table = {"llama": _llama_sources, "diffllama": _diffllama_sources}[family]
    sources = table(config)
    expected = {name: tuple(t.shape) for name, t in LanguageModel(config, device="meta").state_dict().items()}
    if set(sources) != set(expected):  # the table and the model disagree: a bug here, not in the files
        raise RuntimeError(f"the {family} table does not cover the model: {sorted(set(sources) ^ set(expected))}")
    used = {src.name for src in sources.values() if src.name is not None}
    missing = sorted(name for name in used if name not in weights.shapes)
    unknown = sorted(name for name in weights.shapes if name not in used and not ignorable_hf_tensor(name, config))
    mis_shaped = [f"{ours}: {weights.shapes[src.name]} in {src.name}, {expected[ours]} in the model"
                  for ours, src in sources.items() if src.name in weights.shapes
                  and weights.shapes[src.name] != expected[ours]]
    not_float = [f"{src.name} is {weights.dtypes[src.name]}" for src in sources.values()
                 if src.name in weights.dtypes and weights.dtypes[src.name] not in ("F64", "F32", "BF16", "F16")]
    problems = [f"{what}: {few(names) if what != 'shape mismatch' else '; '.join(names[:3])}"
                for what, names in (("missing", missing), ("not understood", unknown), ("shape mismatch", mis_shaped),
                                    ("not floating point", not_float)) if names]
    if problems:
        raise CheckpointError(f"{weights.directory} weights do not match the config — " + " | ".join(problems))
    order = sorted(sources.items(), key=lambda item: (item[1].make is None, str(weights.where.get(item[1].name, ""))))
    specs = [TensorSpec(ours, expected[ours], torch.float32 if ours.rsplit(".", 1)[-1] in LAMBDA_VECTORS else dtype)
             for ours, _ in order]
    return ImportPlan(config, family, order, specs)


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
    if config.attention == "gda":
        raise HFConversionError("grouped differential attention (attention='gda', Motif-2-12.7B) has no transformers "
                                "class (Motif ships remote code); it cannot be exported")
    if config.ffn_activation != "silu":
        raise HFConversionError(f"ffn_activation={config.ffn_activation!r} (Motif's PolyNorm MLP) has no transformers "
                                "class (Llama and DiffLlama use SiLU); it cannot be exported")
    biases = [name for name in ("attention_bias", "attention_out_bias", "mlp_bias") if getattr(config, name)]
    if biases:
        raise HFConversionError(f"{', '.join(biases)}: the export writes bias-free Llama and DiffLlama models")
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
    if config.lambda_init_depth_offset:
        raise HFConversionError(
            f"DiffLlama hard-codes λ_init = 0.8 − 0.6·exp(−0.3·layer); this model shifts the layer index by "
            f"lambda_init_depth_offset={config.lambda_init_depth_offset} (Motif's schedule) and cannot be exported"
        )
    if config.norm_eps != config.head_norm_eps:
        raise HFConversionError(
            f"DiffLlama uses one rms_norm_eps for the block norms and the head norm; this model's head_norm_eps is "
            f"{config.head_norm_eps} but its norm_eps is {config.norm_eps}"
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
        "rope_parameters": rope_parameters(config),
        "attention_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "initializer_range": config.init_std,
        **init,
        "dtype": "float32",
    }


def hf_family(hf: dict[str, Any], path: Path) -> str:
    """"llama", "diffllama" or "motif" from config.json's model_type; anything else is refused."""
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type.lower() == "motif":
        return "motif"
    if model_type not in ("llama", "diffllama"):
        raise HFConversionError(f"{path}: model_type {model_type!r} is not supported (only 'llama', 'diffllama' and "
                                "Motif's 'Motif')")
    return model_type


def model_config_from_hf(hf: dict[str, Any], path: Path, weight_names: Iterable[str] = ()) -> ModelConfig:
    """Our ModelConfig for a Llama, DiffLlama or Motif config.json (already parsed); ``path`` for
    errors; ``weight_names``: the directory's tensors (Motif: whether the LM head is tied, when
    config.json does not say)."""
    family = hf_family(hf, path)
    if family == "motif":
        return motif_model_config(hf, path, set(weight_names))
    attention = "diff" if family == "diffllama" else "standard"
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    absent = [name for name in required if name not in hf]
    if absent:
        raise HFConversionError(f"{path}: missing field(s) {', '.join(absent)}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConversionError(f"{path}: {flag}=true is not supported (Llama and DiffLlama are read bias-free)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    eps = float(hf.get("rms_norm_eps", 1e-6))
    fields: dict[str, Any] = {"init_std": float(hf.get("initializer_range", 0.02))}
    if head_dim * heads != hf["hidden_size"]:
        if attention != "diff":
            raise HFConversionError(
                f"{path}: head_dim {head_dim} × num_attention_heads {heads} != hidden_size {hf['hidden_size']} "
                "(a Llama's heads must fill the model width here)"
            )
        fields["attn_head_dim"] = head_dim
    if attention == "diff":
        fields.update(lambda_std=float(hf.get("lambda_std_dev") or 0.1), head_norm_eps=eps)  # one eps for all norms
        if heads % 2 or kv_heads % 2:
            raise HFConversionError(f"{path}: DiffLlama needs even num_attention_heads and num_key_value_heads")
        heads, kv_heads = heads // 2, kv_heads // 2
    theta, scaling = hf_rope(hf, path)
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
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=eps,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **fields,
        )
    except ValueError as exc:
        raise HFConversionError(f"{path}: cannot be represented as a ModelConfig: {exc}") from exc


# --- tokenizers -----------------------------------------------------------------------------


def _is_byte_tokenizer(path: Path) -> bool:
    """Whether the tokenizers JSON at ``path`` is :func:`byte_tokenizer_json` (as export writes it)."""
    fields = ("model", "pre_tokenizer", "decoder", "normalizer")  # transformers adds a no-op post_processor
    written = json.loads(path.read_text())
    reference = json.loads(byte_tokenizer_json().to_str())
    same_tokens = ([(t["id"], t["content"]) for t in written.get("added_tokens", [])]
                   == [(ByteTokenizer.eos_id, EOS_TOKEN)])
    return same_tokens and all(written.get(f) == reference.get(f) for f in fields)


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
            save_hf_tokenizer(tokenizer, tmp, config.max_seq_len)

    return write_directory_atomically(directory, write, kind="hf-export", overwrite=overwrite, reading=reading)


EXPORT_LAYOUTS = ("hf", "motif")


def export_hf(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False, layout: str | None = None) -> Path:
    """A checkpoint directory of this project -> a transformers directory at ``out`` (new, empty,
    or with ``overwrite`` an earlier export; never the checkpoint itself). ``layout`` "hf":
    DiffLlama / Llama where they compute the model exactly, else remote code
    (:mod:`~diff_transformer.interop.remote_code`); "motif": Motif's released layout
    (:mod:`~diff_transformer.interop.motif_export`); None: "motif" for a model of Motif's arithmetic, else "hf"."""
    from .motif_export import check_motif_exportable, is_motif_model, save_motif, stored_dtype
    from .remote_code import save_remote_code

    if layout not in (None, *EXPORT_LAYOUTS):
        raise HFConversionError(f"layout must be one of {', '.join(EXPORT_LAYOUTS)}, got {layout!r}")
    check_output_dir(out, "hf-export", overwrite=overwrite, reading=[checkpoint])  # before the work
    config, _ = read_config(checkpoint)
    layout = layout or ("motif" if is_motif_model(config) else "hf")
    if layout == "motif":
        check_motif_exportable(config)  # from config.json alone, before the weights are read
    tokenizer = load_checkpoint_tokenizer(checkpoint, config.vocab_size)
    with lock_output(out):  # one writer: a second export to ``out`` is refused before its work
        model = LanguageModel.from_pretrained(checkpoint)
        if layout == "motif":
            dtype = stored_dtype(Path(checkpoint) / WEIGHTS_FILE)  # bf16 stays bf16
            return save_motif(model, out, tokenizer, dtype=dtype, overwrite=overwrite, reading=[checkpoint])
        try:
            check_exportable(config)
        except HFConversionError:  # no transformers class computes it: remote code
            return save_remote_code(model, out, tokenizer, overwrite=overwrite, reading=[checkpoint])
        return save_hf(model, out, tokenizer, overwrite=overwrite, reading=[checkpoint])




def load_hf_tokenizer(directory: Path, eos_token: str | None = None,
                      bos_token: str | None = None) -> ByteTokenizer | BPETokenizer | None:
    """The directory's tokenizer.json as our tokenizer (ByteTokenizer if it is the byte one), or None;
    its special tokens as named, or as tokenizer_config.json / config.json beside it name them."""
    path = directory / BPE_FILE
    if not path.is_file():
        if eos_token is not None or bos_token is not None:
            raise HFConversionError(f"{directory}: no {BPE_FILE}, so --eos-token / --bos-token name nothing")
        return None
    try:
        tokenizer = BPETokenizer(path, eos_token=eos_token, bos_token=bos_token)
    except ValueError as exc:
        raise HFConversionError(f"{exc}; or import without it using --no-tokenizer") from exc
    return ByteTokenizer() if _is_byte_tokenizer(path) else tokenizer


@dataclass
class HFSource:
    """A transformers directory ready to import: its config, tensors (headers read), plan and tokenizer."""

    directory: Path
    weights: HFWeights
    plan: ImportPlan
    tokenizer: ByteTokenizer | BPETokenizer | None

    @property
    def config(self) -> ModelConfig:
        return self.plan.config


def read_hf_directory(directory: str | Path, *, dtype: str = "float32", with_tokenizer: bool = True,
                      eos_token: str | None = None, bos_token: str | None = None) -> HFSource:
    """Everything an import needs from ``directory`` but the tensors' values: config.json read,
    the safetensors headers checked against the model (:func:`plan_import`), the tokenizer read.
    Any problem is an error naming the file (and field or tensor), before a value is read."""
    directory = Path(directory)
    path = directory / HF_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a transformers model directory (no {HF_CONFIG_FILE})")
    if dtype not in IMPORT_DTYPES:
        raise HFConversionError(f"dtype must be one of {', '.join(IMPORT_DTYPES)}, got {dtype!r}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if hf.get("format") == FORMAT:
        raise CheckpointError(f"{directory} is already a diff-transformer checkpoint, not a transformers directory: "
                              f"nothing to import; use it as it is (LanguageModel.from_pretrained, generate, eval, "
                              f"train --init-from)")
    check_fields(hf, HF_CONFIG_FIELDS, str(path))  # every value's type and size, before any is used
    family = hf_family(hf, path)
    if not with_tokenizer and (eos_token is not None or bos_token is not None):
        raise HFConversionError("--eos-token / --bos-token name the tokenizer's tokens, and --no-tokenizer imports "
                                "none: give one or the other")
    # the tokenizer before the weights (their headers, then the plan): what decides the import comes first
    tokenizer = load_hf_tokenizer(directory, eos_token, bos_token) if with_tokenizer else None
    weights = HFWeights(directory)
    check_agreement(hf, path, weights)
    config = model_config_from_hf(hf, path, weights.shapes)
    plan = plan_import(weights, config, family, IMPORT_DTYPES[dtype])
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{directory / BPE_FILE}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}"
        )
    return HFSource(directory, weights, plan, tokenizer)


def check_agreement(hf: dict[str, Any], path: Path, weights: HFWeights) -> None:
    """config.json's layer count and embedding shape against the tensors' headers: a CheckpointError
    naming the field and the figures where they disagree (before a model of that size is planned)."""
    layers = {int(name.split(".")[2]) for name in weights.shapes
              if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
    count = hf.get("num_hidden_layers")
    if layers and count != max(layers) + 1:
        raise CheckpointError(f"{path}: num_hidden_layers is {count} but the weights in {weights.directory} hold "
                              f"{max(layers) + 1} layers (model.layers.0 to model.layers.{max(layers)}): the config "
                              "and the files disagree")
    embed = weights.shapes.get("model.embed_tokens.weight")
    wanted = (hf.get("vocab_size"), hf.get("hidden_size"))
    if embed is not None and embed != wanted:
        raise CheckpointError(f"{path}: vocab_size {wanted[0]} and hidden_size {wanted[1]} but "
                              f"model.embed_tokens.weight is {tuple(embed)} in {weights.directory}: the config and "
                              "the files disagree")


def load_hf(directory: str | Path, *, with_tokenizer: bool = True, dtype: str = "float32",
            eos_token: str | None = None,
            bos_token: str | None = None) -> tuple[LanguageModel, ByteTokenizer | BPETokenizer | None]:
    """A Llama, DiffLlama or Motif directory -> (our model in ``dtype``, its tokenizer or None). The
    model is allocated once and filled tensor by tensor (one copy of the weights in memory)."""
    source = read_hf_directory(directory, dtype=dtype, with_tokenizer=with_tokenizer, eos_token=eos_token,
                               bos_token=bos_token)
    model = LanguageModel(source.config, device="meta")
    model.to(IMPORT_DTYPES[dtype]).to_empty(device="cpu")  # as model.to(dtype) would leave it, λ vectors too
    targets = model.state_dict()
    with torch.no_grad():
        for name, tensor in source.plan.tensors(source.weights):
            targets[name].copy_(tensor)
    return model, source.tokenizer


def import_hf(directory: str | Path, out: str | Path, *, with_tokenizer: bool = True, overwrite: bool = False,
              dtype: str = "float32", eos_token: str | None = None, bos_token: str | None = None) -> Path:
    """A Llama, DiffLlama or Motif directory -> a checkpoint of this project at ``out`` (new, empty,
    or with ``overwrite`` a checkpoint of this project; never the directory read), its weights in
    ``dtype`` ("float32", "bfloat16" keeps a bf16 release as it is, "float16"), written tensor by
    tensor as they are read: the memory held is about one tensor, not the model."""
    check_output_dir(out, "checkpoint", overwrite=overwrite, reading=[directory])  # before the work
    with lock_output(out):  # one writer: a second import to ``out`` is refused before its work
        source = read_hf_directory(directory, dtype=dtype, with_tokenizer=with_tokenizer, eos_token=eos_token,
                                   bos_token=bos_token)

        def write(tmp: Path) -> None:
            write_config(tmp, source.config)
            write_safetensors_streaming(tmp / WEIGHTS_FILE, source.plan.specs, source.plan.tensors(source.weights),
                                        metadata={"format": FORMAT})
            if source.tokenizer is not None:
                source.tokenizer.save(tmp)

        return write_directory_atomically(out, write, kind="checkpoint", overwrite=overwrite, reading=[directory])
