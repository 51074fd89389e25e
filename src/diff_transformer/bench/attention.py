"""``diff-transformer bench attention``: every attention backend at matched parameters.

Matched parameters (paper §2.1): standard attention has h heads of width d (and Hkv key/value
heads); differential attention has h/2 heads, each with two d-wide query/key groups and a
2d-wide value (Hkv/2 key/value groups), so both hold the same numbers of weights and cache.
With ``kinds``, also the alternatives at the standard kind's shapes: "mta", multi-token
attention (Golovneva et al. 2025) on a layer that carries its key-query convolutions (6 × 11,
before and after the softmax) and mixes all h heads (ops/mta.py, its fast path: materialised
maps), which in decode mode computes 1 + 2·5 query rows, the new one and the rows its
convolutions read; "xsa", exclusive self-attention: SDPA and its correction.

Three modes, each over the sequence lengths L:
    fwd       T = S = L, forward only, under torch.no_grad (inference / prefill)
    fwd+bwd   T = S = L, forward and backward of all inputs (training)
    decode    T = 1 query against S = L cached keys, forward only

FLOPs (as the paper's appendix counts them), counted once per attention kind as the useful work, \
whatever a backend executes,
so that TFLOP/s compare like time: with P the number of visible (query, key) pairs
(T·S, or T·(S − T) + T(T + 1)/2 when causal: about half),
    standard     forward 4·B·h·P·d    backward 10·B·h·P·d
    differential forward 6·B·h·P·d    backward 10·B·h·P·d
    grouped (GDA, ``gda_ratio`` r)    the differential counts × (1 + 1/r) / 2: h/2 signal maps and
                 h/(2r) noise maps, each with its 2d-wide value
(h the standard head count: the fused kernel's counts; the two-call "sdpa" backend executes
6 + 14, the four-call "sdpa_split" 8 + 20. GDA's "math", "triton", "decode" and "flex" backends
compute every noise map r times, which the useful-work count does not credit.) MTA adds per visible
pair and head the two convolutions and the two head mixings, 2·(2·6·11) + 2·(2h) in the forward and
twice that in the backward; XSA counts as standard attention (its correction is O(T·d)).

Peak memory: bytes allocated by one call above what was allocated before it; on CUDA from the
allocator's peak counter, on CPU from the profiler's allocation records (see measure.py).
Backends that build T×S maps are skipped where those would exceed the memory budget, with the
size they would need.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import exclude_own_value
from ..ops import DIFF_BACKENDS, TRITON_INSTALLED, attention, diff_attention, gda_attention
from ..ops.mta import MTAWeights, mta_attention
from .measure import describe_machine, memory_budget, peak_memory, time_call

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("fwd", "fwd+bwd", "decode")
DIFF_BACKEND_NAMES = tuple(DIFF_BACKENDS)
# measured unless named otherwise: "flex" only when asked (no CPU backward; on CUDA one compilation per shape)
DEFAULT_BACKENDS = tuple(b for b in DIFF_BACKENDS if b != "flex")
# FLOPs per visible (query, key) pair, per standard head h and per unit of d.
FLOP_UNITS = {("standard", "fwd"): 4, ("standard", "bwd"): 10, ("diff", "fwd"): 6, ("diff", "bwd"): 10}
KINDS = ("standard", "diff", "gda", "mta", "xsa")
MTA_KERNEL = (6, 11)  # the authors' c_q × c_k


def default_lengths(device: str) -> tuple[int, ...]:
    return (1024, 2048, 4096, 8192, 16384) if device.startswith("cuda") else (512, 1024, 2048, 4096)


@dataclass
class AttentionBenchSettings:
    """What to measure. ``heads``/``kv_heads`` count standard heads; DIFF gets half of each."""

    device: str = "cpu"
    dtype: str = "float32"
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    heads: int = 16
    kv_heads: int | None = None  # None = heads (MHA)
    head_dim: int = 64
    batch: int = 1
    causal: bool = True
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    modes: tuple[str, ...] = MODES
    warmup: int = 1
    repeats: int = 3
    measure_memory: bool = True
    memory_budget_gib: float | None = None  # None = 60% of RAM (CPU) or of free GPU memory
    threads: int | None = None  # torch CPU threads while measuring; None = leave as is
    # "diff" and "gda" over ``backends``; the others on their own path
    kinds: tuple[str, ...] = ("standard", "diff")
    # grouped differential attention ("gda" among kinds): heads/2 signal heads, heads/(2·gda_ratio) noise
    # heads; None = the largest of 4, 3, 2 dividing heads/2
    gda_ratio: int | None = None

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"unknown kind(s) {unknown}; choose from {', '.join(KINDS)}")
        if "gda" in self.kinds:
            signal = self.heads // 2
            if self.gda_ratio is None:
                self.gda_ratio = next((r for r in (4, 3, 2) if signal % r == 0), 1)
            if self.gda_ratio < 1 or signal % self.gda_ratio or (signal // self.gda_ratio) % (self.kv_heads // 2):
                raise ValueError(f"gda_ratio={self.gda_ratio} must divide the signal heads heads/2 = {signal}, leaving "
                                 f"noise heads that kv_heads/2 = {self.kv_heads // 2} divides")
        elif self.gda_ratio is not None:
            raise ValueError("gda_ratio applies to kind 'gda': add gda to the kinds")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.heads < 2 or self.heads % 2:
            raise ValueError(f"heads must be even (DIFF gets heads/2), got {self.heads}")
        if self.kv_heads < 2 or self.kv_heads % 2 or self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must be even and divide heads={self.heads}, got {self.kv_heads}")
        for name in ("head_dim", "batch", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib must be > 0, got {self.memory_budget_gib}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive, got {self.lengths}")
        unknown = [b for b in self.backends if b not in DIFF_BACKEND_NAMES]
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(DIFF_BACKEND_NAMES)}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")


@dataclass
class AttentionBenchResult:
    mode: str
    kind: str  # "standard", "diff", "gda", "mta" or "xsa"
    backend: str
    length: int
    queries: int  # T
    keys: int  # S
    flops: float
    seconds: float | None = None
    tflops: float | None = None
    peak_bytes: int | None = None
    note: str = ""


def visible_pairs(t: int, s: int, causal: bool) -> int:
    """(query, key) pairs attended to; causal is aligned to the end (query i sits at S − T + i)."""
    if not causal:
        return t * s
    return t * (s - t) + t * (t + 1) // 2


def attention_flops(kind: str, mode: str, *, batch: int, heads: int, t: int, s: int, head_dim: int,
                    causal: bool, gda_ratio: int | None = None) -> float:
    """FLOPs of one call (see the module docstring); ``heads`` is the standard head count h."""
    table = "diff" if kind in ("diff", "gda") else "standard"
    units = FLOP_UNITS[(table, "fwd")] + (FLOP_UNITS[(table, "bwd")] if mode == "fwd+bwd" else 0)
    if kind == "gda":
        units = units * (1 + 1 / gda_ratio) / 2  # H signal and H / r noise maps, not 2H
    per_pair = units * head_dim
    if kind == "mta":  # two convolutions and two head mixings per pair and head; the backward twice that
        per_pair += (2 * 2 * MTA_KERNEL[0] * MTA_KERNEL[1] + 2 * 2 * heads) * (3 if mode == "fwd+bwd" else 1)
    return float(per_pair * batch * heads * visible_pairs(t, s, causal))


def quadratic_bytes(kind: str, backend: str, mode: str, device: torch.device, *, batch: int, heads: int, t: int,
                    s: int) -> int:
    """Approximate memory of the T×S maps a backend materialises (0 for the flash-style ones).

    "reference" keeps about six fp32 maps per DIFF head in the forward (two logits, two
    softmaxes, the combined map, a temporary) and twice that with the backward. "math" keeps its
    two softmax maps for the backward (the visible part: about half of them when causal; counted
    whole), and none without one. "sdpa" on CPU falls back to PyTorch's math kernel (v wider than
    q), about three maps per call.
    """
    if kind == "mta":  # about four fp32 maps per head in the forward, ten kept for the backward
        return (10 if mode == "fwd+bwd" else 4) * batch * heads * t * s * 4
    maps = 0
    diff = kind in ("diff", "gda")  # GDA counted as DIFF: at most as many maps
    if diff and backend == "reference":
        maps = 12 if mode == "fwd+bwd" else 6
    elif diff and backend == "math" and mode == "fwd+bwd":
        maps = 2
    elif diff and backend == "sdpa" and device.type == "cpu":
        maps = 8 if mode == "fwd+bwd" else 3
    return maps * batch * (heads // 2) * t * s * 4


def _make_inputs(kind: str, settings: AttentionBenchSettings, t: int, s: int, requires_grad: bool) -> list[Tensor]:
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    b, d = settings.batch, settings.head_dim

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)

    if kind in ("standard", "xsa"):
        h, hkv = settings.heads, settings.kv_heads
        return [randn(b, h, t, d), randn(b, hkv, s, d), randn(b, hkv, s, d)]
    if kind == "mta":  # the kernels near the identity they start at, the heads mixed all together
        h, hkv = settings.heads, settings.kv_heads
        identity = torch.zeros(h, *MTA_KERNEL, device=device)
        identity[:, -1, MTA_KERNEL[1] // 2] = 1.0
        mixing = [identity + 0.1 * torch.randn_like(identity), identity + 0.1 * torch.randn_like(identity),
                  torch.eye(h, device=device), torch.eye(h, device=device)[None]]
        return [randn(b, h, t, d), randn(b, hkv, s, d), randn(b, hkv, s, d),
                *(w.requires_grad_(requires_grad) for w in mixing)]
    h, hkv = settings.heads // 2, settings.kv_heads // 2
    noise = h // settings.gda_ratio if kind == "gda" else h
    lam = torch.tensor(0.5, device=device, dtype=torch.float32, requires_grad=requires_grad)
    return [randn(b, h, t, d), randn(b, noise, t, d), randn(b, hkv, s, d), randn(b, hkv, s, d),
            randn(b, hkv, s, 2 * d), lam]


def _call(kind: str, backend: str, mode: str, inputs: list[Tensor], causal: bool):
    """A function running one measured step: forward (no grad) or forward + backward."""

    def forward() -> Tensor:
        if kind == "standard":
            return attention(*inputs, causal=causal, backend="sdpa")
        if kind == "gda":
            return gda_attention(*inputs, causal=causal, backend=backend)
        if kind == "xsa":
            q, k, v = inputs
            out = attention(q, k, v, causal=causal, backend="sdpa")
            return exclude_own_value(out, v[:, :, v.shape[2] - q.shape[2]:], None)[0]
        if kind == "mta":
            q, k, v, *mixing = inputs
            visible = None if causal else torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
            return mta_attention(q, k, v, MTAWeights(*mixing), visible=visible)
        return diff_attention(*inputs, causal=causal, backend=backend)

    if mode != "fwd+bwd":

        def run_forward() -> Tensor:
            with torch.no_grad():
                return forward()

        return run_forward
    grad_out = torch.randn_like(forward().detach())

    def run_forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(forward(), inputs, grad_out)

    return run_forward_backward


def _skip_reason(backend: str, mode: str, device: torch.device) -> str:
    if backend == "flex" and mode == "fwd+bwd" and device.type != "cuda":
        return f"FlexAttention has no backward on the {device.type}"
    if backend == "triton" and device.type != "cuda":
        return "needs a CUDA GPU (the Triton interpreter is for tests only)"
    if backend == "triton" and not TRITON_INSTALLED:
        return "needs the triton package"
    return ""


def plan(settings: AttentionBenchSettings) -> list[AttentionBenchResult]:
    """Every (mode, length, kind, backend) to measure, with its FLOPs; not yet measured."""
    cases = []
    kinds = [("standard", "sdpa")] if "standard" in settings.kinds else []
    kinds += [(k, b) for k in ("diff", "gda") if k in settings.kinds for b in settings.backends]
    kinds += [(kind, backend) for kind, backend in (("mta", "fast"), ("xsa", "sdpa")) if kind in settings.kinds]
    halo = 2 * (MTA_KERNEL[0] - 1)  # the rows above a new query that MTA's decoding step recomputes
    for mode in settings.modes:
        for length in settings.lengths:
            for kind, backend in kinds:
                t, s = (1, length) if mode == "decode" else (length, length)
                if kind == "mta" and mode == "decode":
                    t = min(1 + halo, s)
                if kind in ("diff", "gda") and backend == "decode" and mode != "decode":
                    continue
                flops = attention_flops(
                    kind, mode, batch=settings.batch, heads=settings.heads, t=t, s=s,
                    head_dim=settings.head_dim, causal=settings.causal, gda_ratio=settings.gda_ratio,
                )
                cases.append(AttentionBenchResult(mode, kind, backend, length, t, s, flops))
    return cases


def run_attention_bench(settings: AttentionBenchSettings, *, progress: bool = True) -> list[AttentionBenchResult]:
    """Measure every case of :func:`plan`; a case that cannot run carries a note instead of figures."""
    from ..progress import progress as tqdm

    device = torch.device(settings.device)
    budget = int(settings.memory_budget_gib * 2**30) if settings.memory_budget_gib else memory_budget(device)
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(0)
    cases = plan(settings)
    try:
        for case in tqdm(cases, desc="bench attention", disable=not progress, file=sys.stderr):
            _measure(case, settings, device, budget)
    finally:
        torch.set_num_threads(threads)
    return cases


def _measure(case: AttentionBenchResult, settings: AttentionBenchSettings, device: torch.device, budget: int) -> None:
    """Fill in the figures of one case, or a note saying why it was not run."""
    case.note = _skip_reason(case.backend, case.mode, device)
    need = quadratic_bytes(
        case.kind, case.backend, case.mode, device, batch=settings.batch, heads=settings.heads,
        t=case.queries, s=case.keys,
    )
    if not case.note and need > budget:
        case.note = f"skipped: its T×S maps need ~{need / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB"
    if case.note:
        return
    inputs = _make_inputs(case.kind, settings, case.queries, case.keys, requires_grad=case.mode == "fwd+bwd")
    step = _call(case.kind, case.backend, case.mode, inputs, settings.causal)
    case.seconds = time_call(step, device, warmup=settings.warmup, repeats=settings.repeats)
    case.tflops = case.flops / case.seconds / 1e12
    if settings.measure_memory:
        case.peak_bytes = peak_memory(step, device)


def format_table(results: list[AttentionBenchResult]) -> str:
    lines = [f"{'mode':<8} {'kind':<8} {'backend':<10} {'T':>6} {'S':>6} {'ms':>10} {'TFLOP/s':>8} "
             f"{'peak MiB':>9}  note"]
    for r in results:
        ms = f"{r.seconds * 1e3:10.2f}" if r.seconds is not None else f"{'-':>10}"
        tf = f"{r.tflops:8.3f}" if r.tflops is not None else f"{'-':>8}"
        mem = f"{r.peak_bytes / 2**20:9.1f}" if r.peak_bytes is not None else f"{'-':>9}"
        lines.append(f"{r.mode:<8} {r.kind:<8} {r.backend:<10} {r.queries:>6} {r.keys:>6} {ms} {tf} {mem}  {r.note}")
    return "\n".join(lines)


def report(settings: AttentionBenchSettings, results: list[AttentionBenchResult]) -> dict:
    """Everything needed to read the figures later: machine, settings, FLOP units, results."""
    return {
        "benchmark": "attention",
        "machine": describe_machine(torch.device(settings.device)),
        "settings": dataclasses.asdict(settings),
        "flop_units_per_pair_head_dim": {f"{k}/{m}": v for (k, m), v in FLOP_UNITS.items()},
        "results": [dataclasses.asdict(r) for r in results],
    }

