"""``diff-transformer bench gpu --out DIR``: one GPU session's checks and figures in one command.

Three phases, about 8 minutes on one H100-class GPU, written to DIR/gpu_bench.json and
DIR/gpu_bench.md:

1. correctness: every differential-attention backend on the device ("sdpa", "sdpa_split",
   "triton", "decode" on its single-query case; "reference" is the yardstick) against the fp32
   reference computed from the same inputs: output and the gradients of q1, q2, k1, k2, v, λ, in
   fp32 and bf16, over MHA and GQA, odd lengths, S > T (a cache), non-causal, left padding.
   Criterion: max |x − ref| / max |ref| below :data:`TOLERANCES` for each of the seven tensors.
2. the attention-op benchmark (:mod:`.attention`), bf16, causal, lengths 1K, 4K, 16K;
3. the model benchmark (:mod:`.model`), bf16, preset "small" at 1024 tokens, on "auto" (PyTorch's
   SDPA on CUDA) and, where the kernel imports, again on the opt-in "triton" backend.

The fused Triton kernel is verified in Triton's interpreter and compiled for sm_90, but not yet
measured on a GPU, so "auto" never picks it: this command is how a user checks and times it on
their GPU, and its report says how to turn it on (:data:`TURN_ON`).

Every phase takes a device argument, so the report logic runs (and is tested) on CPU with the
CPU backends; only the command insists on CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import claim_output_dir, write_text_atomically
from ..ops import DIFF_BACKENDS, diff_attention, key_padding_to_attn_mask, triton_available, triton_import_error
from .attention import DTYPES, AttentionBenchSettings, run_attention_bench
from .attention import format_table as attention_table
from .attention import report as attention_report
from .measure import describe_machine

OUTPUTS = ("out", "q1", "q2", "k1", "k2", "v", "lam")
# max |x − ref| / max |ref| per tensor, against the fp32 reference. fp32 allows for TF32 or
# reordered sums in vendor kernels; bf16 for a few units of its 2^-8 rounding, more for the
# gradients (P and dS are rounded to bf16 before their products).
TOLERANCES = {"float32": dict(out=1e-3, grad=5e-3), "bfloat16": dict(out=1.5e-2, grad=3e-2),
              "float16": dict(out=3e-3, grad=1e-2)}
TURN_ON = (
    'The fused Triton kernel is opt-in ("auto" runs PyTorch\'s SDPA on CUDA). If its rows above pass and '
    'it is faster than "sdpa" on this GPU, turn it on with diff_attention(..., backend="triton"), '
    'LanguageModel(config, attn_backend="triton") or model.set_attention_backend("triton"), or in a '
    'training config run.attn_backend: triton (diff-transformer train ... --set run.attn_backend=triton).'
)


@dataclass(frozen=True)
class Case:
    """One shape: q (B, H, T, d), k (B, Hkv, S, d), v (B, Hkv, S, 2d); ``pads`` left padding per row."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    head_dim: int
    causal: bool = True
    pads: tuple[int, ...] | None = None


GPU_CASES = (
    Case("mha-odd", 2, 8, 8, 257, 257, 64),
    Case("gqa-cache", 2, 8, 2, 131, 517, 64),  # S > T: a prompt continuing a KV cache
    Case("gqa-noncausal-d128", 1, 4, 2, 199, 301, 128, causal=False),
    Case("gqa-d96-left-pad", 3, 4, 2, 97, 97, 96, pads=(0, 13, 60)),
    Case("decode", 2, 8, 2, 1, 517, 64),  # one query: the "decode" backend's case
)


def _inputs(case: Case, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cpu").to(device=device, dtype=dtype)

    b, h, hkv, t, s, d = case.batch, case.heads, case.kv_heads, case.queries, case.keys, case.head_dim
    xs = [randn(b, h, t, d), randn(b, h, t, d), randn(b, hkv, s, d), randn(b, hkv, s, d), randn(b, hkv, s, 2 * d)]
    lam = (torch.rand(h, generator=generator) + 0.2).to(device)
    grad_out = randn(b, h, t, 2 * d)
    valid = None
    if case.pads is not None:
        valid = (torch.arange(s)[None, :] >= torch.tensor(case.pads)[:, None]).to(device)
    return xs + [lam], grad_out, valid


def _run(backend: str, inputs, grad_out, valid, causal: bool):
    """Output and gradients of (q1, q2, k1, k2, v, λ) through one backend."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    if backend == "reference" and valid is not None:  # the yardstick: the mask spelled out
        t, s = inputs[0].shape[2], inputs[2].shape[2]
        out = diff_attention(*inputs, causal=causal, backend=backend,
                             attn_mask=key_padding_to_attn_mask(valid, t, s))
    else:
        out = diff_attention(*inputs, causal=causal, backend=backend, key_padding_mask=valid)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return [out, *grads]


def applicable(backend: str, case: Case) -> bool:
    return backend != "decode" or case.queries == 1


def correctness_report(
    device: str | torch.device,
    *,
    backends: tuple[str, ...] | None = None,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    cases: tuple[Case, ...] = GPU_CASES,
    seed: int = 0,
) -> list[dict]:
    """One row per (backend, dtype, case): max abs and relative errors of the seven tensors
    against the fp32 reference, the tolerance and whether it passed (an exception fails the row,
    with its message in ``note``). ``backends`` default: every backend but "reference" and "flex"
    (one compilation per case: tests/test_packing.py checks it on CUDA)."""
    device = torch.device(device)
    backends = backends or tuple(b for b in DIFF_BACKENDS if b not in ("reference", "flex"))
    rows = []
    for case in cases:
        for dtype_name in dtypes:
            generator = torch.Generator().manual_seed(seed)
            inputs, grad_out, valid = _inputs(case, device, DTYPES[dtype_name], generator)
            fp32 = [x.float() if x.is_floating_point() else x for x in inputs]
            want = _run("reference", fp32, grad_out.float(), valid, case.causal)
            tol = TOLERANCES[dtype_name]
            for backend in backends:
                if not applicable(backend, case):
                    continue
                row = dict(backend=backend, dtype=dtype_name, case=case.name, shape=dataclasses.asdict(case),
                           tolerance=tol, max_abs={}, max_rel={}, passed=False, note="")
                try:
                    got = _run(backend, inputs, grad_out, valid, case.causal)
                except Exception as e:  # a crash is a failed row, not a crashed report
                    row["note"] = f"{type(e).__name__}: {e}"[:500]
                    rows.append(row)
                    continue
                for name, x, r in zip(OUTPUTS, got, want):
                    err = (x.float() - r).abs().max().item()
                    row["max_abs"][name] = err
                    row["max_rel"][name] = err / max(r.abs().max().item(), 1e-12)
                row["passed"] = all(
                    row["max_rel"][n] < (tol["out"] if n == "out" else tol["grad"]) for n in OUTPUTS
                )
                rows.append(row)
    return rows


def correctness_table(rows: list[dict]) -> str:
    """Markdown: one line per row, the worst relative gradient error and the output's."""
    lines = [
        "| backend | dtype | case | rel err out | worst rel err grad | tolerance out / grad | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["max_rel"]:
            worst = max(OUTPUTS[1:], key=lambda n: r["max_rel"][n])
            out, grad = f"{r['max_rel']['out']:.2e}", f"{r['max_rel'][worst]:.2e} ({worst})"
        else:
            out = grad = "-"
        result = "pass" if r["passed"] else f"FAIL {r['note']}".strip()
        lines.append(f"| {r['backend']} | {r['dtype']} | {r['case']} | {out} | {grad} | "
                     f"{r['tolerance']['out']:g} / {r['tolerance']['grad']:g} | {result} |")
    return "\n".join(lines)


@dataclass
class GpuBenchSettings:
    device: str = "cuda"
    backends: tuple[str, ...] | None = None  # None = every backend but "reference" and "flex"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    cases: tuple[Case, ...] = GPU_CASES
    bench_dtype: str = "bfloat16"
    lengths: tuple[int, ...] = (1024, 4096, 16384)
    head_dim: int = 64
    heads: int = 16
    preset: str = "small"
    model_length: int = 1024
    decode_tokens: int = 32
    repeats: int = 3
    compare_hf: bool = True
    time_budget_s: float = 480.0  # later phases are skipped, with a note, once this is spent


def run_gpu_bench(settings: GpuBenchSettings, *, progress: bool = True) -> dict:
    """All three phases on ``settings.device``; returns the report (see :func:`write_report`)."""
    from .model import ModelBenchSettings, run_model_bench
    from .model import format_table as model_table
    from .model import report as model_report

    start = time.perf_counter()
    device = torch.device(settings.device)

    def log(message: str) -> None:
        if progress:
            print(f"[bench gpu {time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr)

    report: dict = {"benchmark": "gpu", "machine": describe_machine(device), "settings": dataclasses.asdict(settings),
                    "tolerances": TOLERANCES, "notes": [],
                    "triton": {"available": triton_available(), "problem": triton_import_error(), "turn_on": TURN_ON}}
    log("correctness of every backend against the fp32 reference")
    report["correctness"] = correctness_report(
        device, backends=settings.backends, dtypes=settings.dtypes, cases=settings.cases
    )
    report["correctness_passed"] = all(r["passed"] for r in report["correctness"])

    def over_budget(phase: str) -> bool:
        if time.perf_counter() - start < settings.time_budget_s:
            return False
        report["notes"].append(f"{phase} skipped: the time budget of {settings.time_budget_s:.0f} s was spent")
        return True

    if not over_budget("attention benchmark"):
        log("attention benchmark")
        attn = AttentionBenchSettings(
            device=settings.device, dtype=settings.bench_dtype, lengths=settings.lengths, heads=settings.heads,
            head_dim=settings.head_dim, repeats=settings.repeats,
        )
        results = run_attention_bench(attn, progress=progress)
        report["attention"] = attention_report(attn, results)
        report["attention_table"] = attention_table(results)
    with_triton = report["triton"]["available"] and "triton" in (settings.backends or DIFF_BACKENDS)
    for backend, key in (("auto", "model"), ("triton", "model_triton")):
        if (backend == "triton" and not with_triton) or over_budget(f"model benchmark, backend {backend!r}"):
            continue
        log(f"model benchmark, backend {backend!r}")
        model = ModelBenchSettings(
            preset=settings.preset, length=settings.model_length, decode_tokens=settings.decode_tokens,
            device=settings.device, dtype=settings.bench_dtype, backend=backend, repeats=settings.repeats,
            compare_hf=settings.compare_hf and backend == "auto",
        )
        results = run_model_bench(model, progress=progress)
        report[key] = model_report(model, results)
        report[f"{key}_table"] = model_table(model, results)
    report["seconds"] = time.perf_counter() - start
    log("done")
    return report


def format_markdown(report: dict) -> str:
    machine = report["machine"]
    where = machine.get("gpu") or machine.get("cpu")
    parts = [
        "# diff-transformer bench gpu",
        "",
        f"Device {machine['device']} ({where}), torch {machine['torch']}; {report['seconds']:.0f} s.",
        "",
        "## Correctness against the fp32 reference",
        "",
        "Relative error = max |x − ref| / max |ref| over the output and the gradients of q1, q2, k1, "
        "k2, v, λ. " + ("All passed." if report["correctness_passed"] else "**Some FAILED.**"),
        "",
        correctness_table(report["correctness"]),
    ]
    for key, title in (("attention_table", "Attention backends"), ("model_table", "Models"),
                       ("model_triton_table", "Models, backend 'triton'")):
        if key in report:
            parts += ["", f"## {title}", "", "```", report[key], "```"]
    triton = report["triton"]
    usable = "" if triton["available"] else f" It cannot run here: {triton['problem'] or 'Triton in interpreter mode'}."
    parts += ["", "## The fused Triton kernel", "", triton["turn_on"] + usable]
    if report["notes"]:
        parts += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(parts) + "\n"


def write_report(out_dir: str | Path, report: dict) -> tuple[Path, Path]:
    """DIR/gpu_bench.json (everything) and DIR/gpu_bench.md (the tables)."""
    out_dir = claim_output_dir(out_dir, "bench")  # new, empty, or an earlier benchmark's (never other files)
    json_path, md_path = out_dir / "gpu_bench.json", out_dir / "gpu_bench.md"
    write_text_atomically(json_path, json.dumps(report, indent=2, default=str))
    write_text_atomically(md_path, format_markdown(report))
    return json_path, md_path


def cuda_problem() -> str | None:
    """Why this machine cannot run ``bench gpu``, or None."""
    if not torch.cuda.is_available():
        built = ("a CPU-only build" if torch.version.cuda is None
                 else f"CUDA {torch.version.cuda} build, no device visible")
        return f"torch.cuda.is_available() is False: torch {torch.__version__}, {built}"
    return None
