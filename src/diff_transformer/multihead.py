"""Differential attention as a drop-in module with plain arguments, for any model.

    from diff_transformer import MultiheadDiffAttention
    attn = MultiheadDiffAttention(embed_dim=256, num_heads=4, causal=False, rope_theta=None)
    y = attn(x)                                   # (B, T, 256) -> (B, T, 256)

The same computation as the language model's DIFF layer, on the same ops and backends, without
its config: queries, keys and values from x, interleaved RoPE (or none), the two softmax maps
(causal or not), λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, the per-head RMSNorm (``subln``,
eps 1e-5, with weight) times (1 − λ_init), and ``out_proj``.

Parameters and their names are those of the authors' ``MultiheadDiffAttn`` (microsoft/unilm,
Diff-Transformer/), so one of their state dicts loads unchanged; with GQA (num_kv_heads <
num_heads) it then computes what their flash files compute (head h takes K1/K2 of group
h // n_rep), not what their naive ``multihead_diffattn.py`` computes (its ``repeat_kv`` over the
2·Hkv key sub-heads gives Q1 and Q2 of head h other keys), while with MHA all three agree:

    q_proj    (E -> E)          2H sub-heads of width d = E / 2H; DIFF head h on sub-heads 2h (Q1), 2h+1 (Q2)
    k_proj    (E -> E / n_rep)  2Hkv sub-heads, K1/K2 of KV group g on 2g, 2g+1 (GQA: n_rep = H / Hkv)
    v_proj    (E -> E / n_rep)  Hkv groups of width 2d; DIFF head h reads group h // n_rep
    out_proj  (E -> E)
    lambda_q1, lambda_k1, lambda_q2, lambda_k2 (d,) fp32;  subln.weight (2d,)

``gda_ratio=r > 1`` makes it grouped differential attention (arXiv 2510.06949; the language
model's ``attention="gda"``): the H heads are signal heads sharing N = H / r noise heads (second
maps), q_proj (E -> (H + N)·d) holding N groups [r signal sub-heads, 1 noise sub-head] as
Motif's published code lays them out; the rest as above (num_kv_heads then defaults to N).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .attention import RMSNorm, apply_rope, rms_norm, rope_frequencies
from .config import lambda_init_schedule
from .ops import BACKEND_NAMES, check_every_query_sees_a_key, diff_attention_packed, gda_attention

HEAD_NORM_EPS = 1e-5  # subln's eps in the authors' module
LAMBDA_STD = 0.1  # the λ vectors' init, N(0, 0.1), as the authors'


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MultiheadDiffAttention(nn.Module):
    """Multi-head differential attention (Ye et al., ICLR 2025, §2.1) on (B, T, embed_dim).

    Args:
        embed_dim: E, the width of x and of the output.
        num_heads: H DIFF heads, half the heads of a matched Transformer; each has two query/key
            groups of width d = E / (2H) and a value of width 2d. d must be even with RoPE.
        num_kv_heads: key/value heads (GQA); None = num_heads (with ``gda_ratio``: the noise heads).
            Must divide num_heads (and the noise heads). Keys are paired as in the authors' flash
            files, not their naive file (see the module docstring).
        gda_ratio: signal heads per noise head (grouped differential attention); 1 = DIFF.
        depth: the 0-based index of the layer, which sets λ_init = 0.8 − 0.6·exp(−0.3·depth).
        lambda_init: a constant λ_init in [0, 1) instead of the depth schedule.
        causal: mask future positions (a decoder); False for an encoder or a ViT.
        rope_theta: base of the interleaved rotary embedding at positions 0 … T − 1; None = no
            RoPE (positions come from elsewhere, e.g. a ViT's learned position embedding).
        backend: how the two maps are computed (``diff_transformer.ops``: "auto", "reference",
            "sdpa", "sdpa_split", "math", "triton", "decode"); an attribute you may change later.

    ``forward(x, attn_mask=None)``: ``attn_mask`` is a bool tensor broadcastable to
    (B, H, T, T), True where query i may attend to key j (the ops' convention), combined with the
    causal mask when ``causal``. A key-padding mask ``keep`` (B, T) is ``keep[:, None, None, :]``.
    Every query must keep at least one visible key (a ValueError names the first that does not).

    Parameters are initialised as the authors': projections as ``nn.Linear`` (uniform, Kaiming),
    λ vectors N(0, 0.1) in fp32, subln weight 1 (:meth:`reset_parameters`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        gda_ratio: int = 1,
        depth: int = 0,
        lambda_init: float | None = None,
        causal: bool = True,
        rope_theta: float | None = 10000.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if embed_dim % (2 * num_heads):
            raise ValueError(
                f"embed_dim={embed_dim} must be divisible by 2 * num_heads = {2 * num_heads} "
                "(each DIFF head has two groups)"
            )
        if not _is_int(gda_ratio) or gda_ratio <= 0 or num_heads % gda_ratio:
            raise ValueError(f"gda_ratio={gda_ratio!r} must be a positive divisor of num_heads={num_heads} "
                             "(signal heads per noise head)")
        noise_heads = num_heads // gda_ratio
        num_kv_heads = noise_heads if num_kv_heads is None else num_kv_heads
        if not _is_int(num_kv_heads) or num_kv_heads <= 0 or noise_heads % num_kv_heads:
            what = (f"the noise heads num_heads / gda_ratio = {noise_heads}" if gda_ratio > 1
                    else f"num_heads={num_heads}")
            raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive divisor of {what}")
        if not _is_int(depth) or depth < 0:
            raise ValueError(f"depth must be a 0-based layer index (an integer >= 0), got {depth!r}")
        if lambda_init is not None and not (_is_number(lambda_init) and 0.0 <= lambda_init < 1.0):
            # as ModelConfig: 1 would zero the output (× (1 − λ_init)), beyond it flip its sign
            raise ValueError(f"lambda_init must be a number in [0, 1), or None for the depth schedule; "
                             f"got {lambda_init!r}")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        if rope_theta is not None and not (_is_number(rope_theta) and math.isfinite(rope_theta) and rope_theta > 0):
            raise ValueError(f"rope_theta must be a positive finite number, or None for no rotary embedding; "
                             f"got {rope_theta!r}")
        head_dim = embed_dim // (2 * num_heads)
        if rope_theta is not None and head_dim % 2:
            raise ValueError(f"head_dim = embed_dim / (2 * num_heads) = {head_dim} must be even for RoPE "
                             "(or rope_theta=None)")
        if backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.gda_ratio = gda_ratio
        self.head_dim = head_dim
        self.depth = depth
        self.lambda_init = lambda_init_schedule(depth) if lambda_init is None else float(lambda_init)
        self.causal = causal
        self.rope_theta = rope_theta
        self.backend = backend
        kv_width = embed_dim // (num_heads // num_kv_heads)  # 2·Hkv·d
        self.q_proj = nn.Linear(embed_dim, (num_heads + noise_heads) * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, kv_width, bias=False)
        self.v_proj = nn.Linear(embed_dim, kv_width, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_q1 = nn.Parameter(torch.empty(head_dim, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.empty(head_dim, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.empty(head_dim, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.empty(head_dim, dtype=torch.float32))
        self.subln = RMSNorm(2 * head_dim, eps=HEAD_NORM_EPS)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Projections as ``nn.Linear`` initialises them, λ vectors N(0, 0.1), subln weight 1 (the
        authors' init; ``generator`` seeds the λ vectors)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            proj.reset_parameters()
        for vec in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            vec.normal_(0.0, LAMBDA_STD, generator=generator)
        self.subln.weight.fill_(1.0)

    def lam(self) -> Tensor:
        """λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, a 0-d fp32 tensor (gradients flow into the vectors)."""
        dot1 = torch.sum(self.lambda_q1.float() * self.lambda_k1.float())
        dot2 = torch.sum(self.lambda_q2.float() * self.lambda_k2.float())
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """x (B, T, E) -> (B, T, E); ``attn_mask`` bool, broadcastable to (B, H, T, T), True = may attend.
        x has the dtype of the module's weights (any under torch.autocast, which casts it)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a (batch, length, embed_dim) tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim or 0 in x.shape:
            raise ValueError(f"x must be (batch, length, embed_dim={self.embed_dim}) with at least one position, got "
                             f"{tuple(x.shape)}")
        weight = self.q_proj.weight
        if x.dtype != weight.dtype and not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
            hint = f"x.to({weight.dtype}) or module.to({x.dtype})" if x.is_floating_point() else f"x.to({weight.dtype})"
            raise TypeError(f"x is {x.dtype} but the module's weights are {weight.dtype}: convert one of them, {hint}")
        b, t, _ = x.shape
        if attn_mask is not None:
            self._check_mask(attn_mask, b, t)
            check_every_query_sees_a_key(attn_mask, t, t, causal=self.causal)
            # 4-D for every backend
            attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        d, r = self.head_dim, self.gda_ratio
        q = self.q_proj(x).view(b, t, -1, d)  # sub-heads 2h (Q1), 2h + 1 (Q2) of head h (GDA: groups [Q1 × r, Q2])
        k = self.k_proj(x).view(b, t, 2 * self.num_kv_heads, d)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, 2 * d).transpose(1, 2)  # (B, Hkv, T, 2d)
        if self.rope_theta is not None:
            rope = rope_frequencies(torch.arange(t, device=x.device), d, self.rope_theta)  # (T, d/2, 2)
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if r == 1:
            out = diff_attention_packed(q, k, v, self.lam(), causal=self.causal, attn_mask=attn_mask,
                                        backend=self.backend)  # (B, H, T, 2d)
        else:
            groups = q.unflatten(1, (-1, r + 1))  # (B, N, r + 1, T, d): [signal × r, noise]
            out = gda_attention(groups[:, :, :r].flatten(1, 2), groups[:, :, r], k[:, 0::2], k[:, 1::2], v,
                                self.lam(), causal=self.causal, attn_mask=attn_mask, backend=self.backend)
        out = rms_norm(out, self.subln.weight * (1.0 - self.lambda_init), self.subln.eps)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.embed_dim))

    def _check_mask(self, attn_mask: Tensor, b: int, t: int) -> None:
        if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
            got = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
            raise TypeError(f"attn_mask must be a bool tensor (True = may attend), got {got}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, self.num_heads, t, t))
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, T, T) = "
                f"{(b, self.num_heads, t, t)}; a key-padding mask (B, T) is passed as mask[:, None, None, :]"
            ) from None

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        gda = f", gda_ratio={self.gda_ratio}" if self.gda_ratio != 1 else ""
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}{gda}, head_dim={self.head_dim}, "
                f"lambda_init={self.lambda_init:.4g}, causal={self.causal}, rope_theta={self.rope_theta}")
