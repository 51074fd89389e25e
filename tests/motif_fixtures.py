"""Tiny random Motif directories in the released format, and an independent float64 forward of them.

The weights of Motif-2.6B and Motif-2-12.7B cannot be downloaded here, so the tests build small
directories laid out as released: config.json with Motif's field names, sharded safetensors with
their index (tensor names as vLLM's MotifForCausalLM and the MLX port load them), tokenizer.json
with tokenizer_config.json naming its special tokens. Layouts:

    "2.6b"   DIFF in every layer: num_attention_heads = 2H sub-heads in Q1/Q2 pairs, no num_noise_heads,
             heads filling hidden_size (Motif-2.6B: 2048 = 16 × 128, 32 layers, kv 16)
    "12.7b"  grouped differential attention: num_noise_heads N, num_attention_heads = signal + N,
             head_dim given, heads wider than hidden_size (Motif-2-12.7B: 40 = 32 + 8 heads × 128 at
             4096, kv 16: ratio 4, each noise head on its own K/V pair)

:func:`motif_forward_float64` computes the logits from the files alone, in float64, as the public
implementations compute them (vLLM's GroupedDifferentialAttention backend and MotifAttention /
MotifMLP): it shares no code with the library. ``tests/test_motif.py`` compares the imported
model with it; other tests may import both (``from motif_fixtures import make_tiny_motif_dir``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")  # begin, end-of-text (Llama 3's names)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXTS = ["the quick brown fox jumps over the lazy dog", "differential attention cancels noise",
         "grouped heads share their noise maps", "a tiny tokenizer for tests", "numbers 0123456789 and symbols!?"]


def write_tokenizer(directory: Path, specials: tuple[str, ...], *, eos: str | None, bos: str | None,
                    vocab_size: int = 300, config_ids: bool = False) -> Path:
    """A byte-level BPE tokenizer.json trained on a few sentences, with ``specials`` added, and a
    tokenizer_config.json naming ``eos``/``bos`` (transformers' fields); with ``config_ids`` the
    special tokens are named instead by id in a config.json beside it (as model directories do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    if config_ids:
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        config.update(eos_token_id=tokenizer.token_to_id(eos) if eos else None,
                      bos_token_id=tokenizer.token_to_id(bos) if bos else None)
        config_file.write_text(json.dumps(config, indent=2))
    else:
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
             "add_bos_token": False}, indent=2))
    return path


def motif_config(layout: str, *, gqa: bool = False, tie: bool = False, vocab_size: int = 320) -> dict:
    """config.json of a tiny Motif model (Motif's field names and the values its code reads)."""
    hidden, layers = 64, 3
    if layout == "2.6b":
        heads, kv = 8, 4 if gqa else 8  # 4 DIFF heads of d = 8 (pairs), 2 or 4 K/V pairs
        shape = {"num_attention_heads": heads, "num_key_value_heads": kv}
    elif layout == "12.7b":
        heads, noise, d = 10, 2, 16  # 8 signal + 2 noise heads of d = 16 (wider than 64 / 10): ratio 4
        kv = 2 if gqa else 4  # one K/V pair for both noise heads (GQA), or a pair each (as Motif-2-12.7B)
        shape = {"num_attention_heads": heads, "num_key_value_heads": kv, "num_noise_heads": noise, "head_dim": d,
                 "k_ratio": 1}
    else:
        raise ValueError(f"layout must be '2.6b' or '12.7b', got {layout!r}")
    return {
        "architectures": ["MotifForCausalLM"],
        "model_type": "Motif",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        **shape,
        "hidden_act": "poly_norm",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "attn_rms_norm_eps": 1e-5,
        "rope_theta": 500.0,
        "rope_scaling": None,
        "tie_word_embeddings": tie,
        "use_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def motif_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Motif checkpoint and its shape, as vLLM's and the MLX port's loaders read them."""
    e, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // heads
    noise = config.get("num_noise_heads") or heads // 2
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, e)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (heads * d, e), p + "self_attn.k_proj.weight": (kv * d, e),
            p + "self_attn.v_proj.weight": (kv * d, e), p + "self_attn.o_proj.weight": (e, 2 * (heads - noise) * d),
            p + "self_attn.subln.weight": (2 * d,),
            **{p + f"self_attn.lambda_{name}": (d,) for name in ("q1", "k1", "q2", "k2")},
            p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e), p + "mlp.down_proj.weight": (e, f),
            p + "mlp.act_fn.weight": (3,), p + "mlp.act_fn.bias": (1,),
        })
    return shapes


def make_tiny_motif_dir(path: str | Path, layout: str = "2.6b", *, gqa: bool = False, tie: bool = False,
                        shards: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0,
                        tokenizer: bool = True, config_overrides: dict | None = None) -> Path:
    """Write a tiny random Motif directory at ``path`` (see the module docstring) and return it.

    ``layout`` "2.6b" or "12.7b"; ``gqa``: fewer K/V pairs than the heads use; ``tie``: tied LM head
    (no lm_head.weight stored); ``shards``: safetensors files and an index (1: one model.safetensors);
    ``dtype`` of the stored weights (the release is bfloat16); ``tokenizer``: a Llama-3-style
    tokenizer.json and tokenizer_config.json; ``config_overrides``: config.json fields to change
    (e.g. a larger model for measuring memory). Weights are random and larger than an init (sharp
    attention maps), λ vectors and PolyNorm's coefficients random too, so that a wrong mapping shows."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**motif_config(layout, gqa=gqa, tie=tie), **(config_overrides or {})}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in motif_tensor_shapes(config).items():
        if name.endswith("norm.weight") or name.endswith("subln.weight"):
            value = 1.0 + 0.3 * torch.randn(shape, generator=g)
        elif "lambda_" in name:
            value = 0.3 * torch.randn(shape, generator=g)
        elif name.endswith("act_fn.weight"):
            value = 1 / 3 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("act_fn.bias"):
            value = 0.1 * torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) / math.sqrt(shape[-1]) * 1.5
        tensors[name] = value.to(dtype)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, str(path / shard), metadata={"format": "pt"})
            weight_map.update({n: shard for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer:
        tok = write_tokenizer(path, LLAMA_SPECIALS, eos=LLAMA_SPECIALS[1], bos=LLAMA_SPECIALS[0])
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tok))
        config.update(bos_token_id=ids.token_to_id(LLAMA_SPECIALS[0]), eos_token_id=ids.token_to_id(LLAMA_SPECIALS[1]))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# --- the independent float64 forward -----------------------------------------------------------


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors = {}
    for file in files:
        tensors.update(load_file(str(directory / file)))
    return {name: t.double() for name, t in tensors.items()}


def _rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 if weight is None else weight)


def _neox_rope(x, theta):
    """x (T, heads, d) float64, rotate-half RoPE over the whole head (vLLM's is_neox_style=True)."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]  # (T, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def _attend(q, k, v, d):
    """Causal softmax attention, q (T, Hq, d) against k, v (T, Hk, w) with GQA (head i -> i // (Hq/Hk))."""
    t = q.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def motif_forward_float64(directory: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) float64 of one sequence ``tokens`` (T,), from the files in ``directory`` alone.

    The arithmetic of vLLM's MotifForCausalLM on the GroupedDifferentialAttention backend (which
    at num_noise_heads = num_attention_heads / 2 is Motif-2.6B's differential attention):
    pre-RMSNorm blocks; q heads in groups of (ratio + 1) = [signal…, noise]; K1/V1 the even and
    K2/V2 the odd K/V sub-heads; attn1 = [attn(Q1, K1, V1), attn(Q1, K1, V2)], attn2 likewise from
    Q2/K2, repeated for the ratio signal heads of its group; attn1 − λ·attn2 with λ = exp(Σλq1λk1)
    − exp(Σλq2λk2) + λ_init, λ_init = 0.8 − 0.6·exp(−0.3·(layer − 1)); subln (RMSNorm over 2d,
    attn_rms_norm_eps) × (1 − λ_init); o_proj; MLP down(PolyNorm(gate) · up), PolyNorm =
    w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b with eps 1e-6; final norm; lm_head or the embedding."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    w = _read_all(directory)
    e, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or e // heads
    noise = config.get("num_noise_heads") or heads // 2
    ratio = (heads - noise) // noise
    eps, sub_eps, theta = config["rms_norm_eps"], config["attn_rms_norm_eps"], config["rope_theta"]
    t = tokens.shape[0]
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = _neox_rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, d), theta)
        k = _neox_rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, d), theta)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, d)
        groups = q.view(t, noise, ratio + 1, d)
        q1, q2 = groups[:, :, :ratio].reshape(t, noise * ratio, d), groups[:, :, ratio]
        k1, k2, v1, v2 = k[:, 0::2], k[:, 1::2], v[:, 0::2], v[:, 1::2]
        attn1 = torch.cat([_attend(q1, k1, v1, d), _attend(q1, k1, v2, d)], dim=-1)  # (T, signal, 2d)
        attn2 = torch.cat([_attend(q2, k2, v1, d), _attend(q2, k2, v2, d)], dim=-1)  # (T, noise, 2d)
        attn2 = attn2.repeat_interleave(ratio, dim=1)  # einops "... H D -> ... (H r) D"
        lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (i - 1))
        lam = (torch.exp((w[p + "self_attn.lambda_q1"] * w[p + "self_attn.lambda_k1"]).sum())
               - torch.exp((w[p + "self_attn.lambda_q2"] * w[p + "self_attn.lambda_k2"]).sum()) + lambda_init)
        attn = _rms(attn1 - lam * attn2, w[p + "self_attn.subln.weight"], sub_eps) * (1 - lambda_init)
        h = h + attn.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        c, b = w[p + "mlp.act_fn.weight"], w[p + "mlp.act_fn.bias"]
        act = (c[0] * _rms(gate ** 3, None, 1e-6) + c[1] * _rms(gate ** 2, None, 1e-6)
               + c[2] * _rms(gate, None, 1e-6) + b)
        h = h + (act * up) @ w[p + "mlp.down_proj.weight"].T
    h = _rms(h, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T
