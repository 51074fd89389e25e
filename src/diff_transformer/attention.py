"""The three attention modules: standard, differential (DIFF) and DIFF V2.

Shapes: B batch, T new tokens, S keys (T plus what the KV cache holds), E = d_model,
H heads of this module, Hkv key/value heads, d = config.head_dim.

Weight layout of DIFF follows the authors' code so their state dicts load as they are:
q_proj (E -> 2H·d) viewed as 2H sub-heads of width d, DIFF head h taking sub-heads 2h (Q1) and
2h+1 (Q2); k_proj (E -> 2Hkv·d) likewise for K1/K2 of KV group g; v_proj (E -> Hkv·2d);
o_proj (2H·d = E -> E). RoPE is the interleaved (GPT-J) kind, applied per d-wide sub-head.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .ops import AttentionMaps, attention, diff_attention
from .ops.decode import decode_diff_attention_packed

if TYPE_CHECKING:
    from .cache import KVCache


def rope_frequencies(positions: Tensor, head_dim: int, theta: float) -> Tensor:
    """cos and sin of p·θ^(−2j/d) for integer positions p (T,) and pairs j < d/2: fp32 (T, d/2, 2)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Interleaved rotary embedding: rotate each pair (x[2i], x[2i+1]) by the angle of pair i.

    x (B, T, n, d); rope (T, d/2, 2) from :func:`rope_frequencies`. Eagerly a pair is one
    complex number and the rotation one complex product (few operator calls, which is what
    decoding small models is bound by); under torch.compile the same rotation in real
    arithmetic, which inductor fuses (it generates no code for complex tensors).
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, n, d/2, 2)
    if torch.compiler.is_compiling():
        re, im = pairs.unbind(-1)
        cos, sin = rope[:, None].unbind(-1)  # (T, 1, d/2) each
        return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).type_as(x)
    rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rope)[:, None, :]
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back to x's dtype."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # no casts: saves two calls per norm when decoding
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class AttentionTap:
    """Watch or alter what attention does, for the evaluation suite.

    Set with ``LanguageModel.tap_attention(tap)``. While a tap is set, attention runs on the
    reference backend: ``transform_logits`` may rewrite the pre-softmax logits (B, H, T, S)
    fp32 of every map (``visible`` is the bool mask or None), and ``record`` receives the maps.
    """

    def transform_logits(self, layer_index: int, logits: Tensor, visible: Tensor | None) -> Tensor:
        return logits

    def record(self, layer_index: int, maps: AttentionMaps) -> None:
        pass


class _Attention(nn.Module):
    """What the three kinds share: RoPE on projected q/k, the KV cache, the tap."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.head_dim = config.head_dim
        self.tap: AttentionTap | None = None

    def _rope(self, q: Tensor, k: Tensor, rope: Tensor | None, start: int) -> tuple[Tensor, Tensor]:
        if rope is None:  # standalone use: positions start .. start + T - 1
            positions = torch.arange(start, start + q.shape[1], device=q.device)
            rope = rope_frequencies(positions, self.head_dim, self.config.rope_theta)
        return apply_rope(q, rope), apply_rope(k, rope)

    def _tap_kwargs(self) -> dict:
        if self.tap is None:
            return {"backend": self.config.attn_backend, "check": False}
        return {
            "backend": "reference",
            "check": False,
            "return_maps": True,
            "logits_transform": partial(self.tap.transform_logits, self.layer_index),
        }

    def _attend_cache(self, k: Tensor, v: Tensor, cache: "KVCache | None") -> tuple[Tensor, Tensor]:
        """k, v (B, heads, T, w) -> all keys/values so far (B, heads, S, w)."""
        return (k, v) if cache is None else cache.update(self.layer_index, k, v)


class StandardAttention(_Attention):
    """Softmax attention with H heads of width d; optional per-head RMSNorm (Table 6 ablation)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        e, h, hkv, d = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(e, h * d, bias=False)
        self.k_proj = nn.Linear(e, hkv * d, bias=False)
        self.v_proj = nn.Linear(e, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, e, bias=False)
        self.head_norm = RMSNorm(d, eps=1e-5) if config.head_norm else None

    def forward(
        self,
        x: Tensor,
        rope: Tensor | None = None,
        *,
        cache: "KVCache | None" = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, -1, d)
        k = self.k_proj(x).view(b, t, -1, d)
        v = self.v_proj(x).view(b, t, -1, d)
        q, k = self._rope(q, k, rope, 0 if cache is None else cache.length)
        k, v = self._attend_cache(k.transpose(1, 2), v.transpose(1, 2), cache)  # (B, Hkv, S, d)
        out = attention(q.transpose(1, 2), k, v, causal=True, attn_mask=attn_mask, **self._tap_kwargs())
        if self.tap is not None:
            out, maps = out
            self.tap.record(self.layer_index, maps)
        if self.head_norm is not None:
            out = self.head_norm(out)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (B, H, T, d) -> (B, T, E)


class DiffAttention(_Attention):
    """Multi-head differential attention (paper §2.1), H DIFF heads of two d-wide groups.

    Parameters beyond a matched standard attention: λ vectors 4d, head-norm weight 2d.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        e, h, hkv, d = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(e, 2 * h * d, bias=False)
        self.k_proj = nn.Linear(e, 2 * hkv * d, bias=False)
        self.v_proj = nn.Linear(e, hkv * 2 * d, bias=False)
        self.o_proj = nn.Linear(h * 2 * d, e, bias=False)
        # λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one scalar per layer; vectors kept in fp32.
        self.lambda_q1 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_init = config.lambda_init_for(layer_index)
        self.head_norm = RMSNorm(2 * d, eps=1e-5) if config.head_norm else None

    def lam(self) -> Tensor:
        """λ as a 0-d fp32 tensor (not clamped)."""
        dot1 = torch.sum(self.lambda_q1.float() * self.lambda_k1.float())
        dot2 = torch.sum(self.lambda_q2.float() * self.lambda_k2.float())
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    def _lam_for(self, cache: "KVCache | None") -> Tensor:
        """λ, computed once per KV cache when decoding without gradients (weights are fixed then)."""
        if cache is None or torch.is_grad_enabled():
            return self.lam()
        if self.layer_index not in cache.lambdas:
            cache.lambdas[self.layer_index] = self.lam()
        return cache.lambdas[self.layer_index]

    def forward(
        self,
        x: Tensor,
        rope: Tensor | None = None,
        *,
        cache: "KVCache | None" = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, -1, d)  # (B, T, 2H, d)
        k = self.k_proj(x).view(b, t, -1, d)  # (B, T, 2Hkv, d)
        v = self.v_proj(x).view(b, t, -1, 2 * d)  # (B, T, Hkv, 2d)
        q, k = self._rope(q, k, rope, 0 if cache is None else cache.length)
        k, v = self._attend_cache(k.transpose(1, 2), v.transpose(1, 2), cache)  # (B, 2Hkv, S, d), (B, Hkv, S, 2d)
        q = q.transpose(1, 2)  # (B, 2H, T, d)
        lam = self._lam_for(cache)
        if t == 1 and self.tap is None and self.config.attn_backend in ("auto", "decode"):
            out = decode_diff_attention_packed(q, k, v, lam, attn_mask=attn_mask)  # (B, H, 1, 2d)
        else:
            out = diff_attention(
                q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2], v, lam,
                causal=True, attn_mask=attn_mask, **self._tap_kwargs(),
            )  # (B, H, T, 2d)
        if self.tap is not None:
            out, maps = out
            self.tap.record(self.layer_index, maps)
        if self.head_norm is not None:
            out = self.head_norm(out)
        out = out * (1.0 - self.lambda_init)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DiffV2Attention(_Attention):
    """DIFF V2 (unilm Diff-Transformer-V2): one attention call over 2H query heads of width d,
    then out_h = attn_2h − sigmoid(x W_λ)_h · attn_2h+1. No λ vectors, no head norm.

    K/V heads as the baseline (Hkv of width d); query heads 2h and 2h+1 share a KV group.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        e, h, hkv, d = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(e, 2 * h * d, bias=False)
        self.k_proj = nn.Linear(e, hkv * d, bias=False)
        self.v_proj = nn.Linear(e, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, e, bias=False)
        self.lambda_proj = nn.Linear(e, h, bias=False)

    def forward(
        self,
        x: Tensor,
        rope: Tensor | None = None,
        *,
        cache: "KVCache | None" = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, -1, d)  # (B, T, 2H, d)
        k = self.k_proj(x).view(b, t, -1, d)
        v = self.v_proj(x).view(b, t, -1, d)
        q, k = self._rope(q, k, rope, 0 if cache is None else cache.length)
        k, v = self._attend_cache(k.transpose(1, 2), v.transpose(1, 2), cache)  # (B, Hkv, S, d)
        out = attention(q.transpose(1, 2), k, v, causal=True, attn_mask=attn_mask, **self._tap_kwargs())
        lam = torch.sigmoid(self.lambda_proj(x).float()).transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        if self.tap is not None:
            out, maps = out
            p = maps.probs[0]
            combined = p[:, 0::2] - lam * p[:, 1::2]
            self.tap.record(self.layer_index, AttentionMaps(maps.logits, maps.probs, combined))
        out = out[:, 0::2] - lam.to(out.dtype) * out[:, 1::2]  # (B, H, T, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


ATTENTION_CLASSES: dict[str, type[_Attention]] = {
    "standard": StandardAttention,
    "diff": DiffAttention,
    "diff_v2": DiffV2Attention,
}
