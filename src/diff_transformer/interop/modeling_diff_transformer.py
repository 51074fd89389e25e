"""A Differential Transformer model for transformers, as ``diff-transformer export-hf`` ships it: this
file is copied beside the weights (config.json's ``auto_map`` names it) and imports only torch and
transformers, so a model loads with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``
without the project that trained it. Read it before you trust it: it is all the code that runs.

The decoder is transformers' Llama (embed_tokens, layers of input_layernorm -> self_attn ->
post_attention_layernorm -> mlp, norm, lm_head) with the attention of ``config.attention``:

    standard        softmax(q kᵀ/√d) v
    diff            (softmax(Q1 K1ᵀ/√d) − λ softmax(Q2 K2ᵀ/√d)) V, λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init,
                    a per-head RMSNorm times (1 − λ_init) (Ye et al., ICLR 2025, arXiv 2410.05258; the
                    authors' microsoft/unilm Diff-Transformer)
    diff_symmetric  diff with the keys equal to the queries (one qk_proj)
    gda             grouped differential attention (arXiv 2510.06949, Motif-2-12.7B): gda_ratio signal
                    heads share one noise head (the second map)
    diff_v2         unilm's Diff-Transformer-V2: 2H softmax heads, out_h = a_2h − sigmoid(x W_λ)_h · a_2h+1
    gated(_headwise) softmax heads times sigmoid(x W_g) per channel (per head) (Qiu et al. 2025, G1)
    mta             multi-token attention (Golovneva et al. 2025, arXiv 2504.00927; facebookresearch/RAM):
                    logits and maps convolved over nearby queries and keys and mixed across heads
    xsa             exclusive self-attention (Zhai 2026, arXiv 2603.09078): each head's output minus its
                    component along the token's own value

Differences from Llama that matter for reading the weights: RoPE rotates interleaved pairs
(x[2i], x[2i+1]) of each head, not halves; a DIFF head's query sub-heads 2h (Q1) and 2h+1 (Q2)
are adjacent rows of q_proj (keys likewise per key/value group), its value is value_factor·d wide;
the MLP's activation may be Motif's PolyNorm (mlp.act_fn). The KV cache is transformers' (one
cache layer per decoder layer; a multi-token layer with convolutions stores its rotated queries
beside its keys, which the convolution of later queries reads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_diff_transformer import DiffTransformerConfig

DIFF_HEAD_KINDS = ("diff", "diff_symmetric", "gda")  # two maps per head, λ, a value 2d wide


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inverse_frequencies(config: DiffTransformerConfig) -> Tensor:
    """θ^(−2j/d) for the pairs j < d/2 (fp32), scaled as transformers' "linear" and "llama3" kinds."""
    params = config.rope_parameters or {}
    d = config.head_dim
    inv_freq = params.get("rope_theta", 10_000.0) ** -(torch.arange(0, d, 2, dtype=torch.float32) / d)
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} is not one this model computes")
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend in between
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength > original / low, inv_freq / factor,
                       torch.where(wavelength < original / high, inv_freq, blended))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved RoPE: rotate each pair (x[2i], x[2i+1]) of x (B, heads, T, d) by the angle of pair i;
    cos, sin (B, 1, T, d/2) fp32."""
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).type_as(x)


def repeat_kv(x: Tensor, heads: int) -> Tensor:
    """(B, Hkv, S, w) -> (B, heads, S, w): head h reads key/value head h // (heads / Hkv)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """softmax(q kᵀ/√d) v over the visible keys: q (B, Hq, T, d), k (B, Hk, S, d), v (B, Hk, S, w),
    visible (B, 1, T, S) bool -> (B, Hq, T, w)."""
    heads = q.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=visible)


def kq_convolution(x: Tensor, kernel: Tensor, reads: Tensor) -> Tensor:
    """MTA's key-query convolution of the maps x (B, H, R, S) by kernel (H, c_q, c_k), one per head:

        out[i, j] = Σ_a Σ_b kernel[a, b] · x[i − δ, j + b − (c_k − 1)/2] · reads[δ, i],   δ = c_q − 1 − a

    the row itself and the c_q − 1 rows (earlier queries) above it, keys from both sides (zeros past the
    ends). reads (B, 1, c_q, R) bool: whether row i may read row i − δ (:func:`row_reads`)."""
    h, cq, ck = kernel.shape
    r = x.shape[-2]
    out = torch.zeros_like(x)
    for a in range(cq):
        delta = cq - 1 - a
        if delta >= r:
            continue
        # row i holds x[i − δ] where it may read it, keys padded by (c_k − 1)/2 on both sides
        shifted = F.pad(x, ((ck - 1) // 2, (ck - 1) // 2, delta, 0))[..., :r, :] * reads[:, :, delta, :, None]
        out = out + F.conv2d(shifted, kernel[:, a].reshape(h, 1, 1, ck), groups=h)
    return out


def row_reads(visible: Tensor, reach: int) -> Tensor:
    """visible (B, 1, R, S), the last R of S positions -> (B, 1, reach, R) bool: row i may read row i − δ
    when that row is among the R and query i sees the key at its own position minus δ."""
    r, s = visible.shape[-2:]
    rows = torch.arange(r, device=visible.device)
    own = s - r + rows
    out = []
    for delta in range(reach):
        source = (own - delta).clamp_min(0)
        seen = visible.gather(-1, source.view(1, 1, r, 1).expand(visible.shape[0], 1, r, 1)).squeeze(-1)
        out.append(seen & (rows >= delta))
    return torch.stack(out, dim=-2)


class Attention(nn.Module):
    """One layer's attention of every kind: projections, interleaved RoPE, transformers' KV cache, the
    kind's maps, the per-head norm (``config.head_norm``), o_proj. H heads, Hkv key/value groups, d =
    head_dim; the widths per kind are set in ``__init__``."""

    def __init__(self, config: DiffTransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.kind = config, layer_idx, config.attention
        e, h, hkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = h, hkv, d
        q_heads, k_heads, self.value_width = h, hkv, d
        if self.kind in DIFF_HEAD_KINDS:
            self.ratio = config.gda_ratio if self.kind == "gda" else 1
            q_heads, k_heads, self.value_width = h + h // self.ratio, 2 * hkv, config.value_factor * d
        elif self.kind == "diff_v2":
            q_heads = 2 * h
        bias = config.attention_bias
        if self.kind == "diff_symmetric":  # the keys are the queries: one projection
            self.qk_proj = nn.Linear(e, q_heads * d, bias=bias)
        else:
            self.q_proj = nn.Linear(e, q_heads * d, bias=bias)
            self.k_proj = nn.Linear(e, k_heads * d, bias=bias)
        self.v_proj = nn.Linear(e, hkv * self.value_width, bias=bias)
        self.o_proj = nn.Linear(h * self.value_width, e, bias=config.attention_out_bias)
        self.head_norm = RMSNorm(self.value_width, config.head_norm_eps) if config.head_norm else None
        self.out_scale = 1.0  # DIFF: the fixed 1 − λ_init on the normed heads
        if self.kind in DIFF_HEAD_KINDS:
            offset = config.lambda_init_depth_offset
            self.lambda_init = (config.lambda_init if config.lambda_init is not None
                                else 0.8 - 0.6 * math.exp(-0.3 * (layer_idx + offset)))
            self.out_scale = 1.0 - self.lambda_init
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, nn.Parameter(torch.zeros(d, dtype=torch.float32)))
        elif self.kind == "diff_v2":
            self.lambda_proj = nn.Linear(e, h, bias=False)
        elif self.kind in ("gated", "gated_headwise"):
            self.gate_proj = nn.Linear(e, h * (d if self.kind == "gated" else 1), bias=False)
        elif self.kind == "xsa" and config.xsa_gate:
            self.xsa_gate = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        elif self.kind == "mta":
            group = config.mta_head_group or h
            self.head_mix_pre = nn.Parameter(torch.eye(h))
            self.head_mix_post = nn.Parameter(torch.eye(group).repeat(h // group, 1, 1))
            self.gate_proj = nn.Linear(d, 1)
            every = config.mta_conv_every
            self.convolved = layer_idx % every == every // 2
            if self.convolved:
                shape = (h, config.mta_query_kernel, config.mta_key_kernel)
                self.kq_conv_pre, self.kq_conv_post = nn.Parameter(torch.zeros(shape)), nn.Parameter(torch.zeros(shape))

    def lam(self) -> Tensor:
        """DIFF's λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, 0-d fp32."""
        return (torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
                - torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float())) + self.lambda_init)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, visible: Tensor, cache: Cache | None) -> Tensor:
        """x (B, T, E); cos, sin (B, 1, T, d/2); visible (B, 1, T, S) bool over every key -> (B, T, E)."""
        b, t, _ = x.shape
        d = self.head_dim
        if self.kind == "diff_symmetric":
            q = apply_rope(self.qk_proj(x).view(b, t, -1, d).transpose(1, 2), cos, sin)
            k = q
        else:
            q = apply_rope(self.q_proj(x).view(b, t, -1, d).transpose(1, 2), cos, sin)  # (B, Hq, T, d)
            k = apply_rope(self.k_proj(x).view(b, t, -1, d).transpose(1, 2), cos, sin)  # (B, Hk, T, d)
        v = self.v_proj(x).view(b, t, -1, self.value_width).transpose(1, 2)  # (B, Hkv, T, w)
        new_v = v
        mta_rows = self.kind == "mta" and self.convolved
        if cache is not None:
            stored = torch.cat([k, q], dim=1) if mta_rows else k  # a convolved MTA layer keeps its queries too
            stored, v = cache.update(stored, v, self.layer_idx)
            k = stored[:, : k.shape[1]]
            if mta_rows:
                q = stored[:, k.shape[1]:]  # every query so far: the convolution reads rows above the new ones
        if self.kind in DIFF_HEAD_KINDS:
            out = self._differential(q, k, v, visible)
        elif self.kind == "mta":
            out = self._multi_token(q, k, v, visible)[:, :, -t:]
        else:
            out = softmax_attention(q, k, v, visible)  # (B, Hq, T, d)
            if self.kind == "diff_v2":
                gate = torch.sigmoid(self.lambda_proj(x).float()).transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
                out = out[:, 0::2] - gate.to(out.dtype) * out[:, 1::2]
            elif self.kind in ("gated", "gated_headwise"):
                gate = torch.sigmoid(self.gate_proj(x).float()).view(b, t, self.heads, -1).transpose(1, 2)
                out = out * gate.to(out.dtype)
            elif self.kind == "xsa":
                out = self._exclude_own_value(out, new_v)
        if self.head_norm is not None:  # the fixed scale rides on the norm's weight
            out = rms_norm(out, self.head_norm.weight * self.out_scale, self.head_norm.eps)
        elif self.out_scale != 1.0:
            out = out * self.out_scale
        if self.kind == "mta":
            out = out * torch.sigmoid(self.gate_proj(out))  # (B, H, T, d) · (B, H, T, 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _differential(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
        """q (B, H + N, T, d) in N groups [r signal sub-heads, 1 noise sub-head] (DIFF: r = 1, the pairs
        Q1, Q2), k (B, 2Hkv, S, d) pairs K1, K2, v (B, Hkv, S, w) -> (B, H, T, w): signal head g·r + j
        minus λ times noise head g."""
        groups = q.unflatten(1, (-1, self.ratio + 1))  # (B, N, r + 1, T, d)
        signal, noise = groups[:, :, : self.ratio].flatten(1, 2), groups[:, :, self.ratio]
        first = softmax_attention(signal, k[:, 0::2], v, visible)  # (B, H, T, w)
        second = softmax_attention(noise, k[:, 1::2], v, visible)  # (B, N, T, w)
        return first - self.lam().to(first.dtype) * second.repeat_interleave(self.ratio, dim=1)

    def _exclude_own_value(self, out: Tensor, own: Tensor) -> Tensor:
        """XSA: out (B, H, T, d) minus g · (outᵀv / ‖v‖²) v along the token's own value v (B, Hkv, T, d)."""
        y, v = out.float(), repeat_kv(own, self.heads).float()
        coef = (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True).clamp_min(1e-30)
        if self.config.xsa_gate:
            coef = coef * torch.sigmoid(self.xsa_gate.float()).view(1, -1, 1, 1)
        return (y - coef * v).to(out.dtype)

    def _multi_token(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
        """MTA over the query rows q (B, H, R, d) (a convolved layer with a cache: every query so far;
        else the new ones) -> (B, H, R', d), R' ≤ R rows ending at the last key. The maps in fp32:
        conv(logits) -> mix heads -> softmax -> conv -> mix heads in groups -> times V."""
        b, h, _, d = q.shape
        s, t = k.shape[2], visible.shape[2]
        halo = 2 * (self.config.mta_query_kernel - 1) if self.convolved else 0  # rows above a new one it reads
        rows = min(t + halo, q.shape[2])
        q = q[:, :, q.shape[2] - rows:]
        positions = torch.arange(s - rows, s, device=q.device)
        keys = torch.arange(s, device=q.device)
        # the rows' mask: the new rows' padding flags (their first row's) for the halo rows above them
        flags = visible[:, :, :1, :] | (keys > s - t)  # (B, 1, 1, S) whether a key is a real token
        seen = (keys <= positions[:, None]) & flags | (keys == positions[:, None])  # (B, 1, R, S)
        seen = torch.cat([seen[:, :, : rows - t], visible], dim=2)
        logits = (q.float() @ repeat_kv(k, h).float().transpose(-1, -2)) * d**-0.5  # (B, H, R, S)
        x = logits
        if self.convolved:
            reads = row_reads(seen, self.config.mta_query_kernel)
            x = kq_convolution(x.masked_fill(~seen, 0.0), self.kq_conv_pre.float(), reads)
        x = torch.einsum("mn,bnij->bmij", self.head_mix_pre.float(), x)
        p = torch.softmax(x.masked_fill(~seen, float("-inf")), dim=-1)
        if self.convolved:
            p = kq_convolution(p, self.kq_conv_post.float(), reads).masked_fill(~seen, 0.0)
        groups, size, _ = self.head_mix_post.shape
        mixed = torch.einsum("gnm,bgnij->bgmij", self.head_mix_post.float(), p.unflatten(1, (groups, size)))
        return (mixed.flatten(1, 2) @ repeat_kv(v, h).float()).to(q.dtype)


class PolyNorm(nn.Module):
    """Motif's MLP activation: w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b, norm = RMSNorm without weight, fp32."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((3,), 1 / 3))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        z, w = x.float(), self.weight.float()
        out = (w[0] * rms_norm(z * z * z, None, self.eps) + w[1] * rms_norm(z * z, None, self.eps)
               + w[2] * rms_norm(z, None, self.eps) + self.bias.float())
        return out.type_as(x)


class MLP(nn.Module):
    """down(act(x W_gate) ⊙ x W_up), act SiLU (Llama's SwiGLU) or PolyNorm."""

    def __init__(self, config: DiffTransformerConfig) -> None:
        super().__init__()
        e, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(e, f, bias=bias)
        self.up_proj = nn.Linear(e, f, bias=bias)
        self.down_proj = nn.Linear(f, e, bias=bias)
        self.act_fn = PolyNorm(config.polynorm_eps) if config.hidden_act == "poly_norm" else nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DiffTransformerDecoderLayer(nn.Module):
    def __init__(self, config: DiffTransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, visible: Tensor, cache: Cache | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, visible, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DiffTransformerPreTrainedModel(PreTrainedModel):
    config_class = DiffTransformerConfig
    config: DiffTransformerConfig
    base_model_prefix = "model"
    _no_split_modules = ["DiffTransformerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """transformers' defaults (Linear and Embedding N(0, initializer_range), norms 1), and the
        kinds' own: λ vectors N(0, lambda_std), MTA's kernels and mixings the identity, PolyNorm 1/3, 0."""
        super()._init_weights(module)
        if isinstance(module, Attention):
            if module.kind in DIFF_HEAD_KINDS:
                for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                    init.normal_(getattr(module, name), mean=0.0, std=self.config.lambda_std)
            if module.kind == "xsa" and self.config.xsa_gate:
                init.zeros_(module.xsa_gate)
            if module.kind == "mta":
                init.copy_(module.head_mix_pre, torch.eye(module.heads))
                group = module.head_mix_post.shape[1]
                init.copy_(module.head_mix_post, torch.eye(group).expand_as(module.head_mix_post))
                if module.convolved:
                    identity = torch.zeros_like(module.kq_conv_pre)
                    identity[:, -1, identity.shape[2] // 2] = 1.0  # the pair itself: this query, this key
                    init.copy_(module.kq_conv_pre, identity)
                    init.copy_(module.kq_conv_post, identity)
        elif isinstance(module, PolyNorm):
            init.constant_(module.weight, 1 / 3)
            init.zeros_(module.bias)


class DiffTransformerModel(DiffTransformerPreTrainedModel):
    def __init__(self, config: DiffTransformerConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DiffTransformerDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """-> the last hidden states (B, T, E) after the final norm, and the cache (None without one).
        attention_mask (B, S) marks the real tokens among the cached and new ones (0: padding, never
        attended to); position_ids (B, T) default to the cached length onwards."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        s = past + t
        if position_ids is None:
            position_ids = torch.arange(past, s, device=x.device).expand(b, t)
        inv_freq = rope_inverse_frequencies(self.config).to(x.device)  # d/2 numbers: no buffer to keep
        angles = position_ids.float()[:, None, :, None] * inv_freq  # (B, 1, T, d/2)
        cos, sin = angles.cos(), angles.sin()
        # query i sits at key slot past + i: it sees the real tokens up to itself, and always itself
        keys = torch.arange(s, device=x.device)
        slots = torch.arange(past, s, device=x.device)[:, None]
        visible = (keys <= slots).expand(b, 1, t, s)
        if attention_mask is not None:
            real = attention_mask[:, None, None, -s:].bool()
            visible = (visible & real) | (keys == slots)
        for layer in self.layers:
            x = layer(x, cos, sin, visible, past_key_values if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x),
                                       past_key_values=past_key_values if use_cache else None)


class DiffTransformerForCausalLM(DiffTransformerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DiffTransformerConfig) -> None:
        super().__init__(config)
        self.model = DiffTransformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits (B, T, V) (the last ``logits_to_keep`` rows if > 0) and, with labels, the mean
        next-token cross-entropy (transformers' shift: label i is predicted at position i − 1)."""
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


__all__ = ["DiffTransformerForCausalLM", "DiffTransformerModel", "DiffTransformerPreTrainedModel"]
