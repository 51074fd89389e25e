"""Load the authors' ``MultiheadDiffAttn`` weights (microsoft/unilm, Diff-Transformer/).

The official module and :class:`~diff_transformer.attention.DiffAttention` share one layout
(q_proj viewed as 2H sub-heads with DIFF head h on sub-heads 2h, 2h+1; k_proj as 2Hkv sub-heads;
v_proj as Hkv groups of 2d; interleaved RoPE), so the tensors copy over unchanged and only
two names differ: ``out_proj`` -> ``o_proj`` and ``subln`` -> ``head_norm``.

With GQA (num_kv_heads < num_heads) the result matches the official *flash* files, where DIFF
head h reads KV group h // n_rep. The official naive file repeats the 2·Hkv key sub-heads
instead, which pairs keys differently when n_rep > 1 (the flash files are the consistent reference).
"""

from __future__ import annotations

import torch

from ..attention import DiffAttention
from ..checkpoint import load_state_dict_checked
from ..config import ModelConfig

RENAMES = {"out_proj.weight": "o_proj.weight", "subln.weight": "head_norm.weight"}


def attention_from_unilm(
    state_dict: dict[str, torch.Tensor],
    *,
    embed_dim: int,
    depth: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    rope_theta: float = 10000.0,
) -> DiffAttention:
    """A DiffAttention equal to the official ``MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads)``.

    ``num_heads`` counts DIFF heads (half the baseline's), ``depth`` is the 0-based layer index
    that sets λ_init. ``module(x)`` for x (B, T, embed_dim) equals the official
    ``forward(x, rel_pos)`` with interleaved rotary of θ = ``rope_theta`` at positions 0..T-1.
    """
    config = ModelConfig(
        vocab_size=1,
        d_model=embed_dim,
        n_layers=depth + 1,
        n_heads=num_heads,
        n_kv_heads=num_kv_heads,
        attention="diff",
        rope_theta=rope_theta,
        max_seq_len=1 << 20,
    )
    module = DiffAttention(config, layer_index=depth)
    state = {RENAMES.get(name, name): tensor for name, tensor in state_dict.items()}
    load_state_dict_checked(module, state, source="the unilm state dict")
    return module
