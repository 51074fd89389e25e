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

``"gda"`` is grouped differential attention (arXiv 2510.06949, Motif-2-12.7B): ``n_heads`` signal
heads, each DIFF's first map with a 2d-wide value, share noise heads (DIFF's second map) in groups
of ``gda_ratio``, as GQA shares keys: n_heads / gda_ratio noise heads. ``gda_ratio=1`` is DIFF.

Fields the released Motif models need beyond that (each off by default, so that every model
defined before them computes what it did): ``attn_head_dim`` (heads that do not fill d_model),
``ffn_activation="polynorm"``, ``lambda_init_depth_offset``, ``head_norm_eps``, the bias flags and
``rope_scaling`` (:class:`RopeScaling`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

from .checks import MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH

ATTENTION_KINDS = ("standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise", "gda", "mta", "xsa")
# Kinds built of DIFF heads (two d-wide query/key groups, a 2d-wide value, λ vectors, head norm):
# n_heads counts DIFF heads (GDA: signal heads), presets keep their head counts, λ_init applies, and
# the KV cache holds K1/K2 as 2·Hkv sub-heads beside Hkv values of width 2d.
DIFF_HEAD_KINDS = ("diff", "diff_symmetric", "gda")
FFN_ACTIVATIONS = ("silu", "polynorm")  # the gated MLP's activation: down(act(x W_gate) * x W_up)
POLYNORM_EPS = 1e-6  # PolyNorm's eps in Motif's published code (vLLM's and the MLX port's PolyNorm)
HEAD_NORM_EPS = 1e-5  # the authors' subln eps (and Motif's attn_rms_norm_eps default)
ROPE_SCALING_KINDS = ("linear", "llama3")
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


class MTAWithoutConvolution(UserWarning):
    """An MTA model whose mta_conv_every leaves it without any key-query convolution layer."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _is_number(value: Any) -> bool:
    """An int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lambda_init_schedule(layer_index: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for the 1-based layer l, i.e. the 0-based index here."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as transformers defines it (``rope_scaling`` / ``rope_parameters``).

    ``kind="linear"``: every inverse frequency divided by ``factor`` (positions interpolated).
    ``kind="llama3"`` (Llama 3.1 and later): with wavelength λ = 2π / frequency, λ longer than
    ``original_max_seq_len / low_freq_factor`` divided by ``factor``, λ shorter than
    ``original_max_seq_len / high_freq_factor`` kept, and in between the blend
    (1 − s)·f/factor + s·f with s = (original_max_seq_len / λ − low_freq_factor) /
    (high_freq_factor − low_freq_factor).
    """

    kind: str
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_seq_len: int | None = None  # llama3 only: the context the model was trained at first

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ConfigError(f"rope_scaling.kind must be one of {', '.join(ROPE_SCALING_KINDS)}, got {self.kind!r}")
        if not _is_number(self.factor) or not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"rope_scaling.factor must be a positive finite number, got {self.factor!r}")
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_seq_len")
        if self.kind == "linear":
            given = [name for name in llama3 if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"rope_scaling.{given[0]} applies to kind 'llama3' only, not 'linear'")
            return
        for name in llama3[:2]:
            value = getattr(self, name)
            if not _is_number(value) or not (math.isfinite(value) and value > 0):
                raise ConfigError(f"rope_scaling.{name} must be a positive finite number for kind 'llama3', "
                                  f"got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                              f"low_freq_factor={self.low_freq_factor}")
        length = self.original_max_seq_len
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ConfigError(f"rope_scaling.original_max_seq_len must be a positive integer for kind 'llama3', "
                              f"got {length!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RopeScaling":
        """From a plain dict (config.json, YAML); an unknown or missing key is an error naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown rope_scaling field(s): {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        missing = [name for name in ("kind", "factor") if name not in data]
        if missing:
            raise ConfigError(f"rope_scaling needs {' and '.join(missing)}")
        return cls(**data)


@dataclass
class ModelConfig:
    """A decoder-only LLaMA-style language model with standard, DIFF, DIFF V2, gated, multi-token or
    exclusive self-attention.

    Fields left as None are derived in ``__post_init__``; everything is validated there.
    """

    vocab_size: int = 8192
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 3  # DIFF heads for "diff" and "diff_symmetric", signal heads for "gda"; ordinary heads otherwise
    n_kv_heads: int | None = None  # key/value heads (groups) for GQA; None = n_heads (MHA; "gda": its noise heads)
    attention: str = "diff"  # one of ATTENTION_KINDS: "standard", "diff", "diff_v2", "diff_symmetric", "gated",
    # "gated_headwise", "gda", "mta", "xsa"
    ffn_hidden: int | None = None  # gated MLP's inner width; None = 8/3·d_model rounded up to ffn_multiple_of
    ffn_multiple_of: int = 64
    ffn_activation: str = "silu"  # "silu" (SwiGLU) or "polynorm" (Motif: PolyNorm in SiLU's place)
    polynorm_eps: float = POLYNORM_EPS  # eps of PolyNorm's three RMS normalisations (ffn_activation="polynorm")
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None  # None = plain RoPE; a dict in YAML/JSON: {kind: llama3, factor: 8, ...}
    norm_eps: float = 1e-5  # the block norms' and the final norm's eps
    tie_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v projections (and symmetric DIFF's qk_proj)
    attention_out_bias: bool = False  # a bias on o_proj
    mlp_bias: bool = False  # biases on the MLP's gate, up and down projections
    # The width d of one head (one query/key group of a DIFF head), when the heads do not fill d_model
    # (Motif-2-12.7B: 128 at d_model 4096); None = d_model / (value_factor·n_heads). "diff" and "gda" only.
    attn_head_dim: int | None = None
    # Differential attention
    lambda_init: float | None = None  # None = the depth schedule; a number = constant (Table 6 ablation)
    # Added to the 0-based layer index in the depth schedule: 0.8 − 0.6·exp(−0.3·(index + offset)).
    # 0 is the paper's; Motif's code gives layer 0 0.8 − 0.6·e^{0.3}, an offset of −1.
    lambda_init_depth_offset: int = 0
    lambda_std: float = 0.1  # std of the four λ vectors at init
    head_norm: bool | None = None  # per-head RMSNorm; None = on for the DIFF-head kinds and "mta", off otherwise
    head_norm_eps: float = HEAD_NORM_EPS  # eps of the per-head RMSNorm (Motif: attn_rms_norm_eps)
    gda_ratio: int | None = None  # "gda" only: signal heads per noise head (1 computes DIFF); required there
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
        for name, limit in (("vocab_size", MAX_VOCAB), ("d_model", MAX_WIDTH), ("n_layers", MAX_LAYERS),
                            ("n_heads", MAX_WIDTH), ("max_seq_len", MAX_SEQ_LEN)):
            if getattr(self, name) > limit:  # a typo or a damaged file: refused before a model that size is built
                raise ConfigError(f"{name}={getattr(self, name):,} is beyond any model ({limit:,} at most)")
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
        self._check_head_dim()
        self._check_gda()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_noise_heads if self.attention == "gda" else self.n_heads
        if not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads!r} must be a positive divisor of n_heads={self.n_heads}")
        if self.attention == "gda" and self.n_noise_heads % self.n_kv_heads:
            # a signal head and its noise head read the same K/V group (vLLM's GDA backend asserts it)
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide the noise heads n_heads / gda_ratio = "
                              f"{self.n_noise_heads} with attention='gda'")
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
        self._check_lambda_offset()
        for name in ("head_norm_eps", "polynorm_eps"):
            value = getattr(self, name)
            if not _is_number(value) or not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise ConfigError(f"ffn_activation must be one of {', '.join(FFN_ACTIVATIONS)}, "
                              f"got {self.ffn_activation!r}")
        if self.ffn_activation != "polynorm" and self.polynorm_eps != POLYNORM_EPS:
            raise ConfigError(f"polynorm_eps applies to ffn_activation='polynorm' only, not {self.ffn_activation!r}")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling.from_dict(self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be null or a mapping with kind and factor, got {self.rope_scaling!r}")
        self._check_mta()
        if self.xsa_gate is not False and self.attention != "xsa":
            raise ConfigError(f"xsa_gate only applies to attention='xsa', not {self.attention!r}")
        for name in ("tie_embeddings", "head_norm", "scale_residual_init", "attention_bias", "attention_out_bias",
                     "mlp_bias", "xsa_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def _check_head_dim(self) -> None:
        """attn_head_dim, when set, replaces the width derived from d_model (DIFF and GDA only)."""
        if self.attn_head_dim is None:
            if self.d_model % (self.value_factor * self.n_heads):
                what = "2 * n_heads (each DIFF head has two groups)" if self.value_factor == 2 else "n_heads"
                raise ConfigError(
                    f"d_model={self.d_model} must be divisible by {what} = {self.value_factor * self.n_heads}"
                )
            return
        if self.attention not in ("diff", "gda"):
            raise ConfigError(f"attn_head_dim applies to attention 'diff' and 'gda' only, not {self.attention!r} "
                              "(leave it unset: d = d_model / n_heads)")
        if not isinstance(self.attn_head_dim, int) or isinstance(self.attn_head_dim, bool) or self.attn_head_dim <= 0:
            raise ConfigError(f"attn_head_dim must be a positive integer or null, got {self.attn_head_dim!r}")

    def _check_gda(self) -> None:
        if self.attention != "gda":
            if self.gda_ratio is not None:
                raise ConfigError(f"gda_ratio applies to attention='gda' only, not {self.attention!r}")
            return
        ratio = self.gda_ratio
        if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio <= 0:
            raise ConfigError(f"gda_ratio (signal heads per noise head) must be a positive integer with "
                              f"attention='gda', got {ratio!r}")
        if self.n_heads % ratio:
            raise ConfigError(f"n_heads={self.n_heads} (signal heads) must be a multiple of gda_ratio={ratio}")

    def _check_lambda_offset(self) -> None:
        offset = self.lambda_init_depth_offset
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise ConfigError(f"lambda_init_depth_offset must be an integer, got {offset!r}")
        if offset and (self.attention not in DIFF_HEAD_KINDS or self.lambda_init is not None):
            raise ConfigError("lambda_init_depth_offset shifts the depth schedule of λ_init: it applies to "
                              f"attention {', '.join(map(repr, DIFF_HEAD_KINDS))} without a constant lambda_init")

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
        if self.n_layers <= self.mta_conv_every // 2:  # no layer l with l % every == every // 2
            warnings.warn(f"attention='mta' with mta_conv_every={self.mta_conv_every} and n_layers={self.n_layers} "
                          "has no convolution layer (they sit on layers l with l % mta_conv_every == mta_conv_every "
                          "// 2): a different model, heads mixed only; set mta_conv_every to at most "
                          f"{2 * self.n_layers - 1} for one", MTAWithoutConvolution, stacklevel=2)

    def mta_conv_layer(self, layer_index: int) -> bool:
        """Whether the 0-based layer carries MTA's key-query convolutions (attention="mta" only)."""
        return self.attention == "mta" and layer_index % self.mta_conv_every == self.mta_conv_every // 2

    @property
    def head_dim(self) -> int:
        """d: the width of one query/key group (DIFF heads) or of one head (standard, DIFF V2):
        ``attn_head_dim`` if set, else d_model / (value_factor·n_heads)."""
        if self.attn_head_dim is not None:
            return self.attn_head_dim
        return self.d_model // (self.value_factor * self.n_heads)

    @property
    def n_noise_heads(self) -> int:
        """GDA's noise heads, n_heads / gda_ratio (the other DIFF kinds: one per DIFF head, n_heads)."""
        return self.n_heads // self.gda_ratio if self.attention == "gda" else self.n_heads

    def lambda_init_for(self, layer_index: int) -> float:
        """λ_init of the 0-based layer: the constant if set, else the depth schedule at
        ``layer_index + lambda_init_depth_offset``."""
        if self.lambda_init is not None:
            return self.lambda_init
        return lambda_init_schedule(layer_index + self.lambda_init_depth_offset)

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
