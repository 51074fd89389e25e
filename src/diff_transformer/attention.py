"""The attention modules: standard, differential (DIFF), DIFF V2, symmetric DIFF, gated attention,
grouped differential attention (GDA), multi-token attention (MTA) and exclusive self-attention (XSA).

Shapes: B batch, T new tokens, S keys (T plus what the KV cache holds), E = d_model,
H heads of this module, Hkv key/value heads, d = config.head_dim.

Weight layout of DIFF follows the authors' code so their state dicts load as they are:
q_proj (E -> 2H·d) viewed as 2H sub-heads of width d, DIFF head h taking sub-heads 2h (Q1) and
2h+1 (Q2); k_proj (E -> 2Hkv·d) likewise for K1/K2 of KV group g; v_proj (E -> Hkv·2d);
o_proj (2H·d = E -> E). RoPE is the interleaved (GPT-J) kind, applied per d-wide sub-head.
With ``config.value_factor = 1`` (a converted Transformer) a DIFF head's value is d wide, not 2d.
Symmetric DIFF has one qk_proj in the place of q_proj and k_proj: its keys are its queries.
Gated attention is the standard kind plus gate_proj (E -> H·d, or E -> H for one gate per head).
GDA is DIFF with fewer second maps: q_proj (E -> (H + N)·d) holds N groups of gda_ratio signal
sub-heads and one noise sub-head each; keys, values, λ, head norm and o_proj are DIFF's.
MTA is the standard kind's projections plus its convolution kernels, head mixing, head norm and gate
(hundreds to thousands of numbers per layer); XSA the standard kind's, plus one gate per head with ``xsa_gate``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, RopeScaling
from .ops import (
    AttentionMaps,
    BlockMask,
    LogitsTransform,
    attention,
    diff_attention_packed,
    gda_attention,
    reference_attention,
    reference_diff_attention,
    reference_gda_attention,
    visible_mask,
)
from .ops.mta import MTAWeights, mta_attention, reference_mta_attention

if TYPE_CHECKING:
    from .cache import KVCache


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                             device: torch.device | str | None = None) -> Tensor:
    """θ^(−2j/d) for the pairs j < d/2, fp32 (d/2,), scaled as ``scaling`` says (see RopeScaling)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend in between
    wavelength = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_seq_len / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    long_wave = wavelength > scaling.original_max_seq_len / scaling.low_freq_factor
    short_wave = wavelength < scaling.original_max_seq_len / scaling.high_freq_factor
    return torch.where(long_wave, inv_freq / scaling.factor, torch.where(short_wave, inv_freq, blended))


def rope_frequencies(positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """cos and sin of p·f_j for integer positions p (T,) and the pairs' frequencies f_j = θ^(−2j/d)
    (scaled by ``scaling``), j < d/2: fp32 (T, d/2, 2)."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Interleaved rotary embedding: rotate each pair (x[2i], x[2i+1]) by the angle of pair i.

    x (B, T, n, d); rope (T, d/2, 2) from :func:`rope_frequencies`, or (B, T, d/2, 2): positions of
    their own per sequence (packed documents, each from 0). Eagerly a pair is one
    complex number and the rotation one complex product (few operator calls, which cost about
    half of a small model's decoding step); under torch.compile the same rotation in real
    arithmetic, which inductor fuses (it generates no code for complex tensors).
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, n, d/2, 2)
    if torch.compiler.is_compiling():
        re, im = pairs.unbind(-1)
        cos, sin = rope.unsqueeze(-3).unbind(-1)  # ([B,] T, 1, d/2) each
        return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).type_as(x)
    rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rope).unsqueeze(-2)  # ([B,] T, 1, d/2)
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back to x's dtype."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # no casts: two calls fewer per norm when decoding
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


class Attention(nn.Module):
    """One attention forward for every kind: projection, RoPE, KV cache, tap, head norm, output.

    A kind sets the projection widths and supplies how it attends: :meth:`attend` (the fast ops,
    dispatched by ``self.backend``) and :meth:`attend_with_maps` (the reference, which hands its
    maps to a tap). Both take q (B, Hq, T, d), the cached k (B, Hk, S, d), v (B, Hkv, S, w) and the
    cache itself (None without one) and return the (B, H, T, out) heads that the head norm,
    :meth:`finish_heads` and o_proj read.
    """

    def __init__(
        self, config: ModelConfig, layer_index: int, *, q_heads: int, k_heads: int, value_width: int, out_heads: int,
    ) -> None:
        super().__init__()
        e, d = config.d_model, config.head_dim
        self.config = config
        self.layer_index = layer_index
        self.head_dim = d
        self.value_width = value_width  # width of one value head: d, or 2d for DIFF
        self.q_proj = nn.Linear(e, q_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(e, k_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(e, config.n_kv_heads * value_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(out_heads * value_width, e, bias=config.attention_out_bias)
        self.head_norm = RMSNorm(value_width, eps=config.head_norm_eps) if config.head_norm else None
        self.out_scale = 1.0  # a constant on the normed heads (DIFF: 1 − λ_init)
        self.backend = "auto"  # runtime choice (see diff_transformer.ops); not part of the checkpoint
        self.tap: AttentionTap | None = None

    takes_block_mask = True  # whether attend takes a FlexAttention BlockMask (backend "flex", packed documents)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """q/k/v at N(0, std), o_proj (it writes into the residual stream) at N(0, out_std), head norm 1,
        biases (``attention_bias``, ``attention_out_bias``) 0."""
        for proj in self.input_projections():
            proj.weight.normal_(0.0, std, generator=generator)
        self.o_proj.weight.normal_(0.0, out_std, generator=generator)
        for proj in (*self.input_projections(), self.o_proj):
            if proj.bias is not None:
                proj.bias.zero_()
        if self.head_norm is not None:
            self.head_norm.weight.fill_(1.0)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        """The projections that read x, in the order they are initialised."""
        return self.q_proj, self.k_proj, self.v_proj

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, E) -> q (B, T, Hq, d), k (B, T, Hk, d), v (B, T, Hkv, w), before RoPE."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        return q, k, self.v_proj(x).view(b, t, -1, self.value_width)

    def lam(self) -> Tensor | None:
        """The layer's learned scalar λ (0-d fp32) for kinds that have one, else None."""
        return None

    def forward(
        self,
        x: Tensor,
        rope: Tensor | None = None,
        *,
        cache: "KVCache | None" = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, E) -> (B, T, E). ``rope`` (T, d/2, 2) or (B, T, d/2, 2) and, with a cache,
        ``positions`` (T,) of the new tokens come from the model; standalone, both follow from the
        cache (or 0 … T − 1)."""
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.project(x)
        if cache is not None and positions is None:
            positions = cache.positions(t)
        if rope is None:
            at = torch.arange(t, device=x.device) if positions is None else positions
            rope = rope_frequencies(at, d, self.config.rope_theta, self.config.rope_scaling)
        shared = k is q  # symmetric DIFF: the keys are the queries, rotated once
        q = apply_rope(q, rope).transpose(1, 2)
        k = q if shared else apply_rope(k, rope).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_index, k, v, positions)  # every stored key/value (B, heads, S, w)
        if self.tap is None:
            out = self.attend(q, k, v, x, cache=cache, attn_mask=attn_mask)
        else:
            transform = partial(self.tap.transform_logits, self.layer_index)
            out, maps = self.attend_with_maps(
                q, k, v, x, cache=cache, attn_mask=attn_mask, logits_transform=transform
            )
            self.tap.record(self.layer_index, maps)
        if self.head_norm is not None:  # the constant scale rides on the 2d-wide weight, not the activations
            weight = self.head_norm.weight
            if self.out_scale != 1.0:
                weight = self._fixed(cache, "head_norm", self._scaled_norm_weight)
            out = rms_norm(out, weight, self.head_norm.eps)
        elif self.out_scale != 1.0:
            out = out * self.out_scale
        out = self.finish_heads(out)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (B, H, T, w) -> (B, T, E)

    def finish_heads(self, out: Tensor) -> Tensor:
        """The (B, H, T, w) heads after the head norm -> what o_proj reads: as they are (MTA gates them)."""
        return out

    def _scaled_norm_weight(self) -> Tensor:
        return self.head_norm.weight * self.out_scale

    def _fixed(self, cache: "KVCache | None", name: str, compute: Callable[[], Tensor]) -> Tensor:
        """``compute()``; while decoding without gradients (the weights are fixed then) computed once
        per KV cache and kept there: operator calls cost about half of a small model's decoding step."""
        if cache is None or torch.is_grad_enabled():
            return compute()
        key = (self.layer_index, name)
        value = cache.constants.get(key)
        if value is None:
            value = cache.constants[key] = compute()
        return value

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, cache: "KVCache | None", attn_mask: Tensor | None
    ) -> Tensor:
        raise NotImplementedError

    def attend_with_maps(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, cache: "KVCache | None", attn_mask: Tensor | None,
        logits_transform: LogitsTransform,
    ) -> tuple[Tensor, AttentionMaps]:
        raise NotImplementedError

    @staticmethod
    def new_key_positions(cache: "KVCache | None", t: int, s: int, device: torch.device) -> Tensor:
        """(T,) long: the key index of each new query's own token among the S keys that attend reads."""
        if cache is not None and cache.static:  # the whole buffer: a token's slot is its position
            return cache.positions(t)
        return torch.arange(s - t, s, device=device)


class StandardAttention(Attention):
    """Softmax attention with H heads of width d; optional per-head RMSNorm (Table 6 ablation)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
        super().__init__(config, layer_index, q_heads=h, k_heads=hkv, value_width=d, out_heads=h)

    def attend(self, q, k, v, x, *, cache, attn_mask):
        return attention(q, k, v, causal=True, attn_mask=attn_mask, backend=self.backend, check=False)

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        return reference_attention(q, k, v, causal=True, attn_mask=attn_mask, logits_transform=logits_transform)


class DiffAttention(Attention):
    """Multi-head differential attention (paper §2.1), H DIFF heads of two d-wide groups.

    q (B, 2H, T, d) and k (B, 2Hkv, S, d) hold the groups as interleaved sub-heads; v (B, Hkv, S, 2d),
    or (B, Hkv, S, d) with ``value_factor=1``. Parameters beyond a matched standard attention: λ
    vectors 4d, head-norm weight 2d.
    """

    def __init__(self, config: ModelConfig, layer_index: int, *, q_heads: int | None = None) -> None:
        h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
        super().__init__(
            config, layer_index, q_heads=2 * h if q_heads is None else q_heads, k_heads=2 * hkv,
            value_width=config.value_factor * d, out_heads=h,
        )
        # λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one scalar per layer; vectors kept in fp32.
        self.lambda_q1 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_init = config.lambda_init_for(layer_index)
        self.out_scale = 1.0 - self.lambda_init

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """As every attention, and the four λ vectors at N(0, lambda_std) in fp32."""
        super().init_weights(std, out_std, generator)
        for vec in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            vec.normal_(0.0, self.config.lambda_std, generator=generator)

    def lam(self) -> Tensor:
        """λ as a 0-d fp32 tensor (not clamped)."""
        dot1 = torch.sum(self.lambda_q1.float() * self.lambda_k1.float())
        dot2 = torch.sum(self.lambda_q2.float() * self.lambda_k2.float())
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    def attend(self, q, k, v, x, *, cache, attn_mask):
        lam = self._fixed(cache, "lambda", self.lam)
        return diff_attention_packed(q, k, v, lam, causal=True, attn_mask=attn_mask, backend=self.backend)

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        return reference_diff_attention(
            q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2], v, self.lam(),
            causal=True, attn_mask=attn_mask, logits_transform=logits_transform,
        )


class DiffSymmetricAttention(DiffAttention):
    """Symmetric DIFF: DIFF whose keys are its queries. One projection qk_proj (E -> 2H·d) gives
    sub-heads 2h and 2h+1 of DIFF head h, used as Q1 = K1 and Q2 = K2 (before RoPE), so each map
    comes from a symmetric score matrix Q Qᵀ (RoPE keeps it symmetric: R_iᵀ R_j = R_{j−i} and
    its transpose R_{i−j} give the same scores for (i, j) and (j, i)); the causal mask and the
    softmax then act on it as usual. v_proj, o_proj, the λ vectors and the head norm are DIFF's,
    so it has exactly one E × E matrix per layer fewer. MHA only (keys = queries: n_kv_heads = n_heads).
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        del self.q_proj, self.k_proj  # one projection serves both (the model builds them unallocated, on meta)
        self.qk_proj = nn.Linear(config.d_model, 2 * config.n_heads * config.head_dim, bias=config.attention_bias)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        return self.qk_proj, self.v_proj

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        qk = self.qk_proj(x).view(b, t, -1, self.head_dim)  # (B, T, 2H, d): the queries, and the keys
        return qk, qk, self.v_proj(x).view(b, t, -1, self.value_width)


class GroupedDiffAttention(DiffAttention):
    """Grouped differential attention (GDA; Lim et al. 2025, arXiv 2510.06949; Motif-2-12.7B): DIFF
    whose second maps (noise) are shared by groups of ``gda_ratio`` = r first maps (signal), as GQA
    shares keys. H signal heads, N = H / r noise heads; signal head i = g·r + j (j < r) reads noise
    head g, and both read KV group g // (N / Hkv):

        out_i = (softmax(Q1_i K1ᵀ/√d) − λ·softmax(Q2_g K2ᵀ/√d)) V,     then DIFF's head norm,
        (1 − λ_init) and o_proj over the H signal heads (each 2d wide)

    Layout, that of Motif's published code (the GDA backend of vLLM, ``GroupedDifferentialAttention``,
    and the Motif MLX port agree; docs/attention-module.md says what was read where):
    q_proj (E -> (H + N)·d) viewed as N groups of r + 1 sub-heads [signal g·r … g·r + r − 1, noise g];
    k_proj (E -> 2Hkv·d), v_proj (E -> Hkv·2d), o_proj (H·2d -> E), λ vectors and head norm as
    :class:`DiffAttention`. At r = 1 the groups are DIFF's sub-head pairs (2h, 2h + 1): the same
    weights compute DIFF, and this class runs DIFF's op (tests/test_gda.py).

    The KV cache is DIFF's. Maps for the evaluations (:meth:`attend_with_maps`): the first map per
    signal head, the second per noise head (N of them), ``combined`` per signal head: the signed map
    p1_i − λ·p2_g that multiplies V.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index, q_heads=config.n_heads + config.n_noise_heads)
        self.ratio = config.gda_ratio

    def split_queries(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, H + N, T, d) in groups [signal × r, noise] -> signal (B, H, T, d), noise (B, N, T, d)."""
        groups = q.unflatten(1, (-1, self.ratio + 1))  # (B, N, r + 1, T, d)
        return groups[:, :, : self.ratio].flatten(1, 2), groups[:, :, self.ratio]

    def attend(self, q, k, v, x, *, cache, attn_mask):
        lam = self._fixed(cache, "lambda", self.lam)
        if self.ratio == 1:  # the layout is DIFF's
            return diff_attention_packed(q, k, v, lam, causal=True, attn_mask=attn_mask, backend=self.backend)
        signal, noise = self.split_queries(q)
        return gda_attention(signal, noise, k[:, 0::2], k[:, 1::2], v, lam, causal=True, attn_mask=attn_mask,
                             backend=self.backend, check=False)

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        signal, noise = self.split_queries(q)
        return reference_gda_attention(
            signal, noise, k[:, 0::2], k[:, 1::2], v, self.lam(),
            causal=True, attn_mask=attn_mask, logits_transform=logits_transform,
        )


class DiffV2Attention(Attention):
    """DIFF V2 (unilm Diff-Transformer-V2): one attention call over 2H query heads of width d,
    then out_h = attn_2h − sigmoid(x W_λ)_h · attn_2h+1. No λ vectors, no head norm.

    K/V heads as the baseline (Hkv of width d); query heads 2h and 2h+1 share a KV group.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
        super().__init__(config, layer_index, q_heads=2 * h, k_heads=hkv, value_width=d, out_heads=h)
        self.lambda_proj = nn.Linear(config.d_model, h, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """As every attention, and lambda_proj at N(0, std)."""
        super().init_weights(std, out_std, generator)
        self.lambda_proj.weight.normal_(0.0, std, generator=generator)

    def _gate(self, x: Tensor) -> Tensor:
        """sigmoid(x W_λ): (B, T, E) -> (B, H, T, 1) fp32."""
        return torch.sigmoid(self.lambda_proj(x).float()).transpose(1, 2).unsqueeze(-1)

    def attend(self, q, k, v, x, *, cache, attn_mask):
        out = attention(q, k, v, causal=True, attn_mask=attn_mask, backend=self.backend, check=False)  # (B, 2H, T, d)
        return out[:, 0::2] - self._gate(x).to(out.dtype) * out[:, 1::2]

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        out, maps = reference_attention(q, k, v, causal=True, attn_mask=attn_mask, logits_transform=logits_transform)
        gate = self._gate(x)
        p = maps.probs[0]
        combined = p[:, 0::2] - gate * p[:, 1::2]
        return out[:, 0::2] - gate.to(out.dtype) * out[:, 1::2], AttentionMaps(maps.logits, maps.probs, combined)


class GatedAttention(StandardAttention):
    """Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", gate G1): the
    standard kind's heads, each head's output multiplied by sigmoid(x · W_g) before o_proj.

    attention="gated": gate_proj (E -> H·d), one gate per channel of each head (one d_model² matrix
    per layer more than the matched Transformer, at its presets); "gated_headwise": gate_proj
    (E -> H), one gate per head and token. Both bias-free, as the paper's σ(X W_θ) (its code adds the
    gate's rows to a bias-free q_proj), and initialised as q_proj, N(0, init_std) (sigmoid ≈ 0.5 at
    init). No head norm: a per-head norm after the gate would undo a per-head gate.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        gates_per_head = config.head_dim if config.attention == "gated" else 1
        self.gate_proj = nn.Linear(config.d_model, config.n_heads * gates_per_head, bias=False)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        return self.q_proj, self.k_proj, self.v_proj, self.gate_proj

    def _gate(self, x: Tensor) -> Tensor:
        """sigmoid(x W_g): (B, T, E) -> (B, H, T, d) or, one gate per head, (B, H, T, 1); fp32."""
        b, t, _ = x.shape
        return torch.sigmoid(self.gate_proj(x).float()).view(b, t, self.config.n_heads, -1).transpose(1, 2)

    def attend(self, q, k, v, x, *, cache, attn_mask):
        out = super().attend(q, k, v, x, cache=cache, attn_mask=attn_mask)  # (B, H, T, d)
        return out * self._gate(x).to(out.dtype)

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        out, maps = super().attend_with_maps(q, k, v, x, cache=cache, attn_mask=attn_mask,
                                             logits_transform=logits_transform)
        return out * self._gate(x).to(out.dtype), maps  # the maps are softmax maps: the gate acts after them


class MultiTokenAttention(Attention):
    """Multi-token attention (Golovneva et al. 2025, arXiv 2504.00927) as the authors' code and released
    configs define it (facebookresearch/RAM, projects/mta: mta_transformer.py, configs/*_mta.yaml): the
    matched Transformer's H heads of width d whose logits and maps are convolved and mixed
    (:mod:`diff_transformer.ops.mta`).

    Every layer: head mixing before the softmax, head_mix_pre (H, H), and after it, head_mix_post
    (H/c_h, c_h, c_h); the per-head RMSNorm (the authors' group norm, eps 1e-5, weight 1:
    ``head_norm``, on by default); and the gate sigmoid(gate_proj(head)) on each normed head,
    gate_proj d -> 1 with a bias, one for every head (the authors' ``gate_1d``). Layers with
    ``config.mta_conv_layer(l)`` (every ``mta_conv_every``-th): the key-query convolutions before and
    after the softmax, kq_conv_pre and kq_conv_post (H, c_q, c_k). Initialised as the authors': every
    kernel and mixing the identity (at step 0 the maps are softmax attention's), gate_proj.weight
    N(0, init_std) like the input projections, its bias 0 (the authors' code leaves the bias to the
    memory ``to_empty`` gave it).

    The maps are materialised on every backend name: "reference" runs the readable statement, any
    other the fast path. With a KV cache, a layer with the convolutions keeps its rotated queries in
    the cache: a new query's map is convolved with the maps of the c_q − 1 rows above it, each of
    which was convolved with the c_q − 1 rows above that, so the new rows are computed together
    with the 2(c_q − 1) rows before them (the "halo"), as a full forward computes them.
    """

    takes_block_mask = False  # its maps are materialised under every backend name: a bool mask

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
        super().__init__(config, layer_index, q_heads=h, k_heads=hkv, value_width=d, out_heads=h)
        group = config.mta_head_group or h
        self.head_mix_pre = nn.Parameter(torch.empty(h, h))
        self.head_mix_post = nn.Parameter(torch.empty(h // group, group, group))
        self.gate_proj = nn.Linear(d, 1)
        self.convolved = config.mta_conv_layer(layer_index)
        if self.convolved:
            self.kq_conv_pre = nn.Parameter(torch.empty(h, config.mta_query_kernel, config.mta_key_kernel))
            self.kq_conv_post = nn.Parameter(torch.empty(h, config.mta_query_kernel, config.mta_key_kernel))
        # rows above the new ones that a cached step recomputes: each convolution reaches c_q − 1 rows up
        self.halo = 2 * (config.mta_query_kernel - 1) if self.convolved else 0

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """As every attention; the kernels and mixings the identity; gate_proj.weight N(0, std), its bias 0."""
        super().init_weights(std, out_std, generator)
        self.head_mix_pre.copy_(torch.eye(self.head_mix_pre.shape[0]))
        self.head_mix_post.copy_(torch.eye(self.head_mix_post.shape[1]).expand_as(self.head_mix_post))
        self.gate_proj.weight.normal_(0.0, std, generator=generator)
        self.gate_proj.bias.zero_()
        if self.convolved:
            for kernel in (self.kq_conv_pre, self.kq_conv_post):
                kernel.zero_()
                kernel[:, -1, kernel.shape[2] // 2] = 1.0  # the pair itself: this query, this key

    def weights(self) -> MTAWeights:
        pre, post = (self.kq_conv_pre, self.kq_conv_post) if self.convolved else (None, None)
        return MTAWeights(pre, post, self.head_mix_pre, self.head_mix_post)

    def finish_heads(self, out: Tensor) -> Tensor:
        return out * torch.sigmoid(self.gate_proj(out))  # (B, H, T, d) * (B, H, T, 1)

    def _rows(self, q: Tensor, k: Tensor, cache: "KVCache | None", attn_mask: Tensor | None):
        """The query rows the maps are computed for, (B, H, R, d), and their mask (B|1, 1, R, S) or None
        (the causal mask): the new queries, and with a cache on a convolved layer the halo above them."""
        if isinstance(attn_mask, BlockMask):
            raise TypeError("attention='mta' materialises its maps and needs a bool attn_mask, not a FlexAttention "
                            "BlockMask (LanguageModel gives it one under every backend)")
        t, s = q.shape[2], k.shape[2]
        if cache is None or not self.halo:  # the plain causal mask as None: the convolution's one-call path
            return q, None if attn_mask is None else visible_mask(t, s, causal=True, attn_mask=attn_mask,
                                                                  device=q.device)
        positions = self.new_key_positions(cache, t, s, q.device)
        stored = cache.update_queries(self.layer_index, q, positions)
        if cache.static:  # the same halo at every step (one graph): rows before position 0 see slot 0, unread
            row_pos = positions[:1] - self.halo + torch.arange(self.halo + t, device=q.device)
            rows = stored.index_select(2, row_pos.clamp_min(0))
        else:
            halo = min(self.halo, s - t)
            row_pos = torch.arange(s - t - halo, s, device=q.device)
            rows = stored[:, :, s - t - halo :]
        if attn_mask is None:  # the plain causal mask, end-aligned over the R rows
            return rows, None
        # A halo row sees what the first new query sees before it (the padding flags), and itself.
        keys = torch.arange(s, device=q.device)
        above = row_pos[: rows.shape[2] - t, None]  # (R − T, 1) the halo rows' positions
        first = attn_mask[..., :1, :]  # (B|1, 1, 1, S)
        halo_mask = (first & (keys <= above)) | (keys == above.clamp_min(0))
        full = torch.cat([halo_mask, attn_mask.expand(*halo_mask.shape[:-2], t, s)], dim=-2)
        return rows, visible_mask(rows.shape[2], s, causal=True, attn_mask=full, device=q.device)

    def attend(self, q, k, v, x, *, cache, attn_mask):
        rows, visible = self._rows(q, k, cache, attn_mask)
        if self.backend == "reference":
            out = reference_mta_attention(rows, k, v, self.weights(), visible=visible)[0]
        else:
            out = mta_attention(rows, k, v, self.weights(), visible=visible)
        return out[:, :, rows.shape[2] - q.shape[2]:]

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        rows, visible = self._rows(q, k, cache, attn_mask)
        out, maps = reference_mta_attention(rows, k, v, self.weights(), visible=visible,
                                            logits_transform=logits_transform)
        first = rows.shape[2] - q.shape[2]  # the maps of the new queries only
        new = AttentionMaps(tuple(m[..., first:, :] for m in maps.logits), tuple(m[..., first:, :] for m in maps.probs),
                            maps.combined[..., first:, :])
        return out[:, :, first:], new


def exclude_own_value(out: Tensor, own: Tensor, gate: Tensor | None) -> tuple[Tensor, Tensor]:
    """XSA's correction. out (B, H, T, d) heads, own (B, Hkv, T, d) the values of the same tokens
    (head h reads value head h // (H / Hkv)), gate (H,) or None (1) -> out − c·own with
    c = gate · outᵀown / ‖own‖², and c (B, H, T, 1) fp32."""
    b, h, t, d = out.shape
    hkv = own.shape[1]
    y = out.float().reshape(b, hkv, h // hkv, t, d)  # the heads that read one value head, together
    v = own.float().unsqueeze(2)  # (B, Hkv, 1, T, d)
    coef = (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True).clamp_min(1e-30)
    if gate is not None:
        coef = coef * gate.float().view(hkv, h // hkv, 1, 1)
    return (y - coef * v).reshape(b, h, t, d).to(out.dtype), coef.reshape(b, h, t, 1)


class ExclusiveSelfAttention(StandardAttention):
    """Exclusive self-attention (XSA; Zhai 2026, arXiv 2603.09078): the standard kind's heads, each
    head's output y_i minus its component along the token's own value vector v_i (of the head's
    key/value group), before the head norm (if any) and o_proj:

        z_i = y_i − g_h · (y_iᵀ v_i / ‖v_i‖²) v_i

    g_h = 1 is the paper's parameter-free form. With ``config.xsa_gate``, g_h = sigmoid(β_h): one fp32
    β per head and layer (``xsa_gate``), initialised at 0, so g = 0.5, midway between softmax attention
    (g = 0) and XSA (g = 1), as this project's other sigmoid gates start. A cheap correction after any
    attention: every backend, the KV caches, compiled decoding. Under a tap the effective map is the
    softmax map with c_i = g_h · y_iᵀ v_i / ‖v_i‖² taken off the token's own key: z = (P − diag c) V.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.xsa_gate = nn.Parameter(torch.empty(config.n_heads, dtype=torch.float32)) if config.xsa_gate else None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """As the standard kind, and β = 0 (a gate of 0.5)."""
        super().init_weights(std, out_std, generator)
        if self.xsa_gate is not None:
            self.xsa_gate.zero_()

    def _exclude(self, out: Tensor, v: Tensor, cache: "KVCache | None") -> tuple[Tensor, Tensor, Tensor]:
        """-> the corrected heads, c (B, H, T, 1) and the own keys' indices (T,)."""
        own_keys = self.new_key_positions(cache, out.shape[2], v.shape[2], out.device)
        own = v.index_select(2, own_keys) if cache is not None and cache.static else v[:, :, v.shape[2] - out.shape[2]:]
        gate = None if self.xsa_gate is None else torch.sigmoid(self.xsa_gate)
        return *exclude_own_value(out, own, gate), own_keys

    def attend(self, q, k, v, x, *, cache, attn_mask):
        return self._exclude(super().attend(q, k, v, x, cache=cache, attn_mask=attn_mask), v, cache)[0]

    def attend_with_maps(self, q, k, v, x, *, cache, attn_mask, logits_transform):
        out, maps = super().attend_with_maps(q, k, v, x, cache=cache, attn_mask=attn_mask,
                                             logits_transform=logits_transform)
        out, coef, own_keys = self._exclude(out, v, cache)
        own = torch.arange(v.shape[2], device=v.device) == own_keys[:, None]  # (T, S): each query's own key
        return out, AttentionMaps(maps.logits, maps.probs, maps.combined - coef * own)


ATTENTION_CLASSES: dict[str, type[Attention]] = {
    "standard": StandardAttention,
    "diff": DiffAttention,
    "diff_v2": DiffV2Attention,
    "diff_symmetric": DiffSymmetricAttention,
    "gated": GatedAttention,
    "gated_headwise": GatedAttention,
    "gda": GroupedDiffAttention,
    "mta": MultiTokenAttention,
    "xsa": ExclusiveSelfAttention,
}
