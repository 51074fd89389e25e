"""attention_from_unilm against the authors' MultiheadDiffAttn semantics.

The authors' code is not vendored here. ``official_forward`` re-states what their module computes
(q/k/v views, interleaved rotary from rel_pos = (cos, sin), fp32 softmax, λ, subln RMSNorm with
weight, × (1 − λ_init), out_proj), with GQA as in their flash files: DIFF head h reads KV group
h // n_rep. scripts/check_unilm_parity.py runs the same comparison against a checkout of their
repository (figures in README).
"""

import math

import pytest
import torch

from diff_transformer.checkpoint import CheckpointError
from diff_transformer.interop.unilm import attention_from_unilm


def official_state_dict(embed_dim, num_heads, num_kv_heads, generator):
    n_rep = num_heads // (num_kv_heads or num_heads)
    d = embed_dim // num_heads // 2

    def w(*shape, std=0.05):
        return torch.randn(*shape, generator=generator) * std

    return {
        "q_proj.weight": w(embed_dim, embed_dim),
        "k_proj.weight": w(embed_dim // n_rep, embed_dim),
        "v_proj.weight": w(embed_dim // n_rep, embed_dim),
        "out_proj.weight": w(embed_dim, embed_dim),
        "lambda_q1": w(d, std=0.1),
        "lambda_k1": w(d, std=0.1),
        "lambda_q2": w(d, std=0.1),
        "lambda_k2": w(d, std=0.1),
        "subln.weight": 1 + w(2 * d, std=0.2),
    }


def rel_pos(t, d, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None]
    return angles.cos(), angles.sin()


def interleaved_rotary(x, cos, sin):
    """x (B, T, heads, d); rotate (x[2i], x[2i+1]) by the i-th angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)


def official_forward(sd, x, rel, depth, num_heads, num_kv_heads):
    b, t, e = x.shape
    hkv = num_kv_heads or num_heads
    n_rep, d = num_heads // hkv, e // num_heads // 2
    q = interleaved_rotary((x @ sd["q_proj.weight"].T).view(b, t, 2 * num_heads, d), *rel)
    k = interleaved_rotary((x @ sd["k_proj.weight"].T).view(b, t, 2 * hkv, d), *rel)
    v = (x @ sd["v_proj.weight"].T).view(b, t, hkv, 2 * d)
    q = q.view(b, t, num_heads, 2, d).permute(0, 3, 2, 1, 4)  # (B, 2, H, T, d)
    k = k.view(b, t, hkv, 2, d).permute(0, 3, 2, 1, 4).repeat_interleave(n_rep, dim=2)
    v = v.transpose(1, 2).repeat_interleave(n_rep, dim=1)  # (B, H, T, 2d)
    mask = torch.full((t, t), float("-inf")).triu(1)
    weights = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(d) + mask, dim=-1, dtype=torch.float32)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
    lam = (
        torch.exp(torch.sum(sd["lambda_q1"] * sd["lambda_k1"]))
        - torch.exp(torch.sum(sd["lambda_q2"] * sd["lambda_k2"]))
        + lambda_init
    )
    attn = (weights[:, 0] - lam * weights[:, 1]) @ v  # (B, H, T, 2d)
    attn = attn * torch.rsqrt(attn.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["subln.weight"]
    attn = (attn * (1 - lambda_init)).transpose(1, 2).reshape(b, t, e)
    return attn @ sd["out_proj.weight"].T


@pytest.mark.parametrize(
    "embed_dim, depth, num_heads, num_kv_heads, theta, t",
    [
        (256, 0, 4, None, 10000.0, 33),  # MHA
        (256, 5, 4, 2, 10000.0, 50),  # GQA, two DIFF heads per KV group
        (384, 3, 3, 1, 500000.0, 17),  # MQA, another θ
    ],
)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split", "math"])
def test_matches_official_forward(embed_dim, depth, num_heads, num_kv_heads, theta, t, backend):
    g = torch.Generator().manual_seed(depth)
    sd = official_state_dict(embed_dim, num_heads, num_kv_heads, g)
    module = attention_from_unilm(
        sd, embed_dim=embed_dim, depth=depth, num_heads=num_heads, num_kv_heads=num_kv_heads, rope_theta=theta
    )
    module.backend = backend
    x = torch.randn(2, t, embed_dim, generator=g)
    expected = official_forward(sd, x, rel_pos(t, embed_dim // num_heads // 2, theta), depth, num_heads, num_kv_heads)
    assert (module(x) - expected).abs().max().item() < 1e-5


def test_wrong_state_dict_is_named():
    sd = official_state_dict(128, 2, None, torch.Generator().manual_seed(0))
    sd.pop("subln.weight")
    with pytest.raises(CheckpointError, match=r"missing from the unilm state dict: head_norm\.weight"):
        attention_from_unilm(sd, embed_dim=128, depth=0, num_heads=2)
    sd = official_state_dict(128, 2, None, torch.Generator().manual_seed(0))
    with pytest.raises(CheckpointError, match=r"shape mismatch: k_proj\.weight: \(128, 128\) in the unilm state dict, "
                                              r"\(64, 128\) in the model"):
        attention_from_unilm(sd, embed_dim=128, depth=0, num_heads=2, num_kv_heads=1)
