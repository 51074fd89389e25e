"""Model configuration: one typed dataclass that derives and validates itself, and named presets.

Head counting follows the paper. For ``attention="diff"`` (and ``"diff_symmetric"``), ``n_heads``
counts DIFF heads, each holding two query/key groups of width ``head_dim`` (d) and a value of
width 2d, so ``head_dim = d_model / (2 * n_heads)``. For ``"standard"``, ``"diff_v2"`` and the
gated kinds it counts ordinary heads of width d, ``head_dim = d_model / n_heads``. A size preset
asked for with ``attention="standard"`` is the matched Transformer: twice the DIFF heads, the same
head dim, the same parameters but for the λ vectors and head-norm weights (6d per layer). The
wide-head Transformer (DIFF's head count and value width) is ``attention="standard"`` with
``n_heads`` set to the DIFF head count (``from_preset(..., diff_heads=True)``): head dim 2d, the
matched Transformer's parameters.

``"gated"`` and ``"gated_headwise"`` are the matched Transformer's attention with a sigmoid gate
on each head's output before ``o_proj`` (Qiu et al. 2025, position G1): one gate per channel
(``gate_proj`` d_model -> n_heads·d, one d_model² matrix per layer more) or one per head
(d_model -> n_heads).

``"mta"`` is multi-token attention (Golovneva et al. 2025): the matched Transformer's heads whose logits
and maps are convolved over nearby queries and keys (on every ``mta_conv_every``-th layer) and mixed
across heads (every layer), with a per-head norm and a gate (``docs/attention-module.md``). ``"xsa"`` is
exclusive self-attention (Zhai 2026): the matched Transformer's heads, each output minus its component
along the token's own value vector; ``xsa_gate`` scales that component by a learned gate per head.

``value_factor=1`` gives DIFF heads a value of width d instead of 2d (``head_dim = d_model /
n_heads``): a Transformer's heads, each kept as the first map of one DIFF head, which is what
``diff-transformer convert --init exact`` builds (:mod:`diff_transformer.convert`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

ATTENTION_KINDS = ("standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise", "mta", "xsa")
# Kinds built of DIFF heads (two d-wide query/key groups, a 2d-wide value, λ vectors, head norm):
# n_heads counts DIFF heads, presets keep their head counts, λ_init applies.
DIFF_HEAD_KINDS = ("diff", "diff_symmetric")
# Kinds that gate each head's attention output by sigmoid(x · gate_proj) before o_proj (Qiu et al. 2025).
GATED_KINDS = ("gated", "gated_headwise")
# Multi-token attention's settings, each None but with attention="mta", where None means the authors' value
# (facebookresearch/RAM, projects/mta/configs/*_mta.yaml, the paper's 880M model among them).
MTA_DEFAULTS = {
    "mta_query_kernel": 6,  # c_q: the key-query convolution spans this query and the c_q − 1 before it
    "mta_key_kernel": 11,  # c_k (odd): the keys centred on each key
    "mta_conv_every": 4,  # the convolutions sit on layers l with l % every == every // 2 (the authors' 2, 6, 10, ...)
    "mta_head_group": None,  # c_h: heads mixed together after the softmax; None = all n_heads (the authors' 16 of 16)
}

# The paper's sizes (Table 10 and Table 9) and small CPU sizes. Head counts are DIFF heads;
# from_preset doubles them for the other kinds. Vocabulary: cl100k's 100,288 for the
# paper's sizes, the shipped byte-level BPE's 8,192 for the CPU sizes.
PRESETS: dict[str, dict[str, Any]] = {
    # CPU sizes
    "debug": dict(d_model=64, n_layers=2, n_heads=2, vocab_size=512, max_seq_len=128),
    "tiny": dict(d_model=192, n_layers=4, n_heads=3, vocab_size=8192, max_seq_len=256),
    "small": dict(d_model=512, n_layers=8, n_heads=4, vocab_size=8192, max_seq_len=1024),
    # Table 10: scaling runs (seq 2048)
    "830m": dict(d_model=1536, n_layers=24, n_heads=8, vocab_size=100_288, max_seq_len=2048),
    "1.4b": dict(d_model=2048, n_layers=24, n_heads=8, vocab_size=100_288, max_seq_len=2048),
    "2.8b": dict(d_model=2560, n_layers=32, n_heads=10, vocab_size=100_288, max_seq_len=2048),
    "6.8b": dict(d_model=4096, n_layers=32, n_heads=16, vocab_size=100_288, max_seq_len=2048),
    "13.1b": dict(d_model=5120, n_layers=40, n_heads=20, vocab_size=100_288, max_seq_len=2048),
    # Table 9: the 3B recipe (FFN 8192, seq 4096)
    "3b": dict(d_model=3072, n_layers=28, n_heads=12, ffn_hidden=8192, vocab_size=100_288, max_seq_len=4096),
}
PAPER_SIZES = {"830m": 830e6, "1.4b": 1.4e9, "2.8b": 2.8e9, "6.8b": 6.8e9, "13.1b": 13.1e9, "3b": 3.0e9}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _is_number(value: Any) -> bool:
    """An int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lambda_init_schedule(layer_index: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for the 1-based layer l, i.e. the 0-based index here."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


@dataclass
class ModelConfig:
    """A decoder-only LLaMA-style language model with standard, DIFF, DIFF V2, gated, multi-token or
    exclusive self-attention.

    Fields left as None are derived in ``__post_init__``; everything is validated there.
    """

    vocab_size: int = 8192
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 3  # DIFF heads for "diff" and "diff_symmetric"; ordinary heads for the other kinds
    n_kv_heads: int | None = None  # key/value heads (groups) for GQA; None = n_heads (MHA)
    attention: str = "diff"  # "standard" | "diff" | "diff_v2" | "diff_symmetric" | "gated" | "gated_headwise" | "mta"
    # | "xsa"
    ffn_hidden: int | None = None  # SwiGLU inner width; None = 8/3·d_model rounded up to ffn_multiple_of
    ffn_multiple_of: int = 64
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Differential attention
    lambda_init: float | None = None  # None = the depth schedule; a number = constant (Table 6 ablation)
    lambda_std: float = 0.1  # std of the four λ vectors at init
    head_norm: bool | None = None  # per-head RMSNorm; None = on for the DIFF-head kinds and "mta", off otherwise
    # A DIFF head's value width in units of head_dim d: 2 (the paper's 2d) or, for attention="diff", 1
    # (d: a Transformer's heads converted one for one). None = the kind's own: 2 for DIFF heads, 1 otherwise.
    value_factor: int | None = None
    # Multi-token attention (attention="mta"; None there = MTA_DEFAULTS, the authors' values)
    mta_query_kernel: int | None = None
    mta_key_kernel: int | None = None
    mta_conv_every: int | None = None
    mta_head_group: int | None = None  # stays None (all heads) unless set
    # Exclusive self-attention (attention="xsa"): scale the removed component by sigmoid(β_h), one β per head
    xsa_gate: bool = False
    # Initialisation
    init_std: float = 0.02
    # o_proj and down_proj (they write into the residual stream) at init_std / sqrt(2·n_layers), as
    # GPT-2 and the authors' code; False: init_std like every other matrix, as transformers' Llama.
    scale_residual_init: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "ffn_multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        own_factor = 2 if self.attention in DIFF_HEAD_KINDS else 1
        if self.value_factor is None:
            self.value_factor = own_factor
        allowed = (1, 2) if self.attention == "diff" else (own_factor,)
        if type(self.value_factor) is not int or self.value_factor not in allowed:  # a bool is no factor
            raise ConfigError(
                f"value_factor must be {' or '.join(map(str, allowed))} with attention={self.attention!r} (a head's "
                f"value width in units of head_dim; 1 only for 'diff'), got {self.value_factor!r}"
            )
        if self.d_model % (self.value_factor * self.n_heads):
            what = "2 * n_heads (each DIFF head has two groups)" if self.value_factor == 2 else "n_heads"
            raise ConfigError(
                f"d_model={self.d_model} must be divisible by {what} = {self.value_factor * self.n_heads}"
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads!r} must be a positive divisor of n_heads={self.n_heads}")
        if self.attention == "diff_symmetric" and self.n_kv_heads != self.n_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} with attention='diff_symmetric': its keys are its queries (one "
                f"projection), so it has n_heads={self.n_heads} key heads; leave n_kv_heads unset (no GQA)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} (from d_model and n_heads) must be even for RoPE")
        if self.ffn_hidden is None:
            self.ffn_hidden = self.ffn_multiple_of * math.ceil(8 * self.d_model / 3 / self.ffn_multiple_of)
        if not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0:
            raise ConfigError(f"ffn_hidden must be a positive integer, got {self.ffn_hidden!r}")
        if self.head_norm is None:  # MTA's group norm is a per-head RMSNorm too (the authors' subln)
            self.head_norm = self.attention in (*DIFF_HEAD_KINDS, "mta")
        if self.head_norm and self.attention == "diff_v2":
            raise ConfigError("head_norm: DIFF V2 has no per-head norm; leave head_norm unset or False")
        if self.head_norm and self.attention in GATED_KINDS:
            # a per-head norm after the gate would undo a head's gate (a per-head scale) entirely
            raise ConfigError(f"head_norm: attention={self.attention!r} gates each head's output, which a per-head "
                              "norm would undo; leave head_norm unset or False")
        if self.lambda_init is not None and self.attention not in DIFF_HEAD_KINDS:
            raise ConfigError(f"lambda_init only applies to attention={' or '.join(map(repr, DIFF_HEAD_KINDS))}, "
                              f"not {self.attention!r}")
        for name in ("rope_theta", "norm_eps", "init_std", "lambda_std"):
            value = getattr(self, name)
            if not _is_number(value) or not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        if self.lambda_init is not None and not (_is_number(self.lambda_init) and 0.0 <= self.lambda_init < 1.0):
            # the output is scaled by 1 − λ_init: 1 or more would silence or flip every layer (paper: 0.2 to 0.8)
            raise ConfigError(f"lambda_init must be a number in [0, 1) or null (the depth schedule), "
                              f"got {self.lambda_init!r}")
        self._check_mta()
        if self.xsa_gate is not False and self.attention != "xsa":
            raise ConfigError(f"xsa_gate only applies to attention='xsa', not {self.attention!r}")
        for name in ("tie_embeddings", "head_norm", "scale_residual_init", "xsa_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def _check_mta(self) -> None:
        """Fill MTA's settings with the authors' values where unset; refuse them for other kinds."""
        if self.attention != "mta":
            for name in MTA_DEFAULTS:
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} only applies to attention='mta', not {self.attention!r}")
            return
        for name, default in MTA_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name in MTA_DEFAULTS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.mta_key_kernel % 2 == 0:
            raise ConfigError(f"mta_key_kernel must be odd (keys centred on each key, as the authors pad both "
                              f"sides), got {self.mta_key_kernel}")
        if self.mta_head_group is not None and self.n_heads % self.mta_head_group:
            raise ConfigError(f"mta_head_group={self.mta_head_group} must divide n_heads={self.n_heads} (heads are "
                              "mixed in groups of that many)")

    def mta_conv_layer(self, layer_index: int) -> bool:
        """Whether the 0-based layer carries MTA's key-query convolutions (attention="mta" only)."""
        return self.attention == "mta" and layer_index % self.mta_conv_every == self.mta_conv_every // 2

    @property
    def head_dim(self) -> int:
        """d: the width of one query/key group (DIFF heads) or of one head (standard, DIFF V2)."""
        return self.d_model // (self.value_factor * self.n_heads)

    def lambda_init_for(self, layer_index: int) -> float:
        """λ_init of the 0-based layer: the constant if set, else the depth schedule."""
        return self.lambda_init if self.lambda_init is not None else lambda_init_schedule(layer_index)

    @classmethod
    def from_preset(
        cls, name: str, attention: str = "diff", *, diff_heads: bool = False, **overrides: Any
    ) -> "ModelConfig":
        """A named size with the given attention kind, e.g. ``from_preset("1.4b", attention="standard")``.

        The presets hold DIFF head counts; the other kinds ("standard", "diff_v2", the gated kinds)
        get twice as many heads (and key/value heads) of the same width, unless ``overrides`` set them
        or ``diff_heads`` keeps DIFF's: with attention="standard", the wide-head Transformer (DIFF's
        head count and value width 2d, the matched Transformer's parameters).
        """
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        fields = dict(PRESETS[name])
        if attention not in DIFF_HEAD_KINDS and not diff_heads:
            for key in ("n_heads", "n_kv_heads"):
                if fields.get(key) is not None:
                    fields[key] *= 2
        fields.update(overrides)
        return cls.from_dict({**fields, "attention": attention})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Build from a plain dict (e.g. config.json); an unknown key is an error naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if "attn_backend" in unknown:
            raise ConfigError(
                "attn_backend is a runtime setting, not a ModelConfig field: pass LanguageModel(config, "
                "attn_backend=...), call model.set_attention_backend(...), or set run.attn_backend in a training config"
            )
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
