"""diff-transformer bench attention | model | train | gpu: throughput figures, printed (attention, model,
train: nothing is asserted); gpu: correctness checks and both benchmarks on one CUDA GPU, written to a directory."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..bench.attention import DEFAULT_BACKENDS, DTYPES, KINDS, MODES
from ..bench.model import ARCHITECTURES as MODEL_ARCHITECTURES
from ..config import PRESETS
from ..ops import BACKEND_NAMES, DIFF_BACKENDS
from .args import UsageError, device as device_type, output_dir, positive_float


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="throughput benchmarks: attention backends, whole models",
        description="Measure and print throughput. 'attention': every attention backend at matched "
        "parameters. 'model': training, prefill and decode tokens/s of DIFF vs Transformer (Table 7).",
    )
    benchmarks = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    a = benchmarks.add_parser(
        "attention",
        help="time, TFLOP/s and peak memory of every attention backend",
        description="Standard attention (h heads of width d, PyTorch SDPA) against every differential "
        "attention backend (h/2 heads of two d-wide groups, v of width 2d), in three modes: fwd "
        "(T = S = L, no grad), fwd+bwd (T = S = L), decode (T = 1 query, S = L cached keys). "
        "TFLOP/s count the useful work: per visible (query, key) pair, head and unit of d, "
        "standard 4 forward + 10 backward, DIFF 6 + 10 (h = standard heads; causal counts only "
        "visible pairs, about half). Backends whose T x S maps would exceed the memory budget "
        "are skipped with the size they need. Times are the best of --repeats runs.",
    )
    a.add_argument("--device", default=_default_device(), type=device_type,
                   help="cpu or cuda (default: cuda if available)")
    a.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    a.add_argument(
        "--lengths", type=int, nargs="+", default=None, metavar="L",
        help="sequence lengths (default: 512 1024 2048 4096 on CPU, 1024 ... 16384 on CUDA)",
    )
    a.add_argument("--heads", type=int, default=16, help="standard attention heads h; DIFF gets h/2 (default 16)")
    a.add_argument("--kv-heads", type=int, default=None,
                   help="standard key/value heads (GQA); DIFF gets half (default: --heads)")
    a.add_argument("--head-dim", type=int, default=64, help="d, the width of one head / one DIFF group (default 64)")
    a.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    a.add_argument("--no-causal", dest="causal", action="store_false", help="attend to all keys (default: causal)")
    a.add_argument(
        "--backends", nargs="+", choices=list(DIFF_BACKENDS), default=list(DEFAULT_BACKENDS),
        help="DIFF backends to measure (default: all but flex; standard SDPA is always measured)",
    )
    a.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all three")
    a.add_argument("--kinds", nargs="+", choices=KINDS, default=["standard", "diff"],
                   help="attention kinds: standard (SDPA), diff and gda (on --backends), mta (multi-token attention, "
                   "its materialised fast path, a layer with the convolutions) and xsa (exclusive self-attention: "
                   "SDPA and its correction), at the standard kind's shapes (default: standard diff)")
    a.add_argument("--repeats", type=int, default=3, help="timed runs per case; the best is kept (default 3)")
    a.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    a.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory run")
    a.add_argument("--memory-budget-gib", type=float, default=None, help="default: 60%% of RAM / free GPU memory")
    a.add_argument("--threads", type=int, default=None, help="torch CPU threads while measuring (default: torch's)")
    a.add_argument("--gda-ratio", type=int, default=None, metavar="R",
                   help="grouped differential attention's ratio (kind gda, added to --kinds when this is given): the "
                   "DIFF heads as signal heads sharing heads/(2R) noise heads; its TFLOP/s count the maps it needs "
                   "(default: the largest of 4, 3, 2 dividing heads/2)")
    a.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a.set_defaults(run=run_attention)

    m = benchmarks.add_parser(
        "model",
        help="training / prefill / decode tokens/s: DIFF vs Transformer vs transformers' DiffLlama (and other kinds)",
        description="The paper's Table 7 on this machine: training tokens/s (forward, backward, AdamW "
        "step), prefill tokens/s (one forward filling the KV cache) and decode tokens/s (one token "
        "per step through the KV cache, greedy) of the DIFF model and the matched Transformer at a "
        "preset and length, random weights; and of transformers' DiffLlamaForCausalLM of the same "
        "shape when transformers is installed; and of the architectures --architectures names (any attention kind, "
        "e.g. mta xsa, and the Motif shapes). Figures are the "
        "best of --repeats runs.",
    )
    m.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model size (default tiny)")
    m.add_argument("--length", type=int, default=None,
                   help="training / prefill length and decode prompt length, at most the preset's context "
                   "(default 256, or the preset's context if shorter)")
    m.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    m.add_argument("--decode-tokens", type=int, default=32, help="new tokens per generation run (default 32)")
    m.add_argument("--device", default=_default_device(), type=device_type,
                   help="cpu or cuda (default: cuda if available)")
    m.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    m.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                   help="attention backend of our models (default auto)")
    m.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept (default 3)")
    m.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    m.add_argument("--no-hf", dest="hf", action="store_false", help="leave out transformers' DiffLlama")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads while measuring (default: torch's)")
    m.add_argument(
        "--compile", action="store_true",
        help="also measure our models through torch.compile (training, prefill and decoding, compiled in the "
        "warm-up), in the same run as eager, with the ratios of both; DiffLlama stays eager",
    )
    m.add_argument("--architectures", nargs="+", choices=list(MODEL_ARCHITECTURES), default=["diff", "standard"],
                   metavar="NAME",
                   help="the models to measure, at the preset's size, with each one's throughput ratios to the "
                   "Transformer's: diff, standard (the matched Transformer), any other attention kind by name (mta, "
                   "xsa, diff_v2, gated, ...; the Transformer's heads), gda (the DIFF heads as signal heads sharing "
                   "noise heads, --gda-ratio), motif-2.6b (DIFF with Motif-2.6B's PolyNorm MLP and λ_init schedule), "
                   "motif-2-12.7b (GDA 4:1 in Motif-2-12.7B's proportions, PolyNorm MLP) (default: diff standard)")
    m.add_argument("--gda-ratio", type=int, default=None, metavar="R",
                   help="signal heads per noise head of the gda architecture, which --architectures must list "
                   "(default: the largest of 4, 3, 2 dividing the preset's heads)")
    m.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    m.set_defaults(run=run_model)

    t = benchmarks.add_parser(
        "train",
        help="training tokens/s of the studies' small models at small batches (the trainer's own step)",
        description="Training tokens/s of the trainer's step (data, forward, backward, clipping, fused AdamW, "
        "schedule) at batch sizes 4, 8 and 16 for the small models the studies train, on the CPU with one torch "
        "thread (as compare runs each of its two jobs). Models are CONFIG:MODEL (a config's model at its own "
        "shape) or CONFIG:MODEL@SIZE (a size of the config's scaling.sizes). Figures are the best of --repeats "
        "runs of --steps steps, the models taking turns in each; ratios within the run.",
    )
    t.add_argument("--models", nargs="+", default=None, metavar="CONFIG:MODEL[@SIZE]",
                   help="default: the scaling study's standard, diff and diff_v2 at its smallest and largest size "
                   "(scaling.sizes), and tiny's standard and diff")
    t.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16], metavar="B",
                   help="global batch sizes (default 4 8 16)")
    t.add_argument("--steps", type=int, default=20, help="steps per timed run (default 20)")
    t.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept (default 3)")
    t.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    t.add_argument("--threads", type=int, default=1, help="torch CPU threads while measuring (default 1)")
    t.add_argument("--compile", action="store_true",
                   help="also measure every model through torch.compile (run.compile), with its compile time and "
                   "the steps after which compiling pays")
    t.add_argument("--previous", action="store_true",
                   help="also measure the step as it was before (each step's windows drawn alone, clip_grad_norm_)")
    t.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    t.set_defaults(run=run_train)

    g = benchmarks.add_parser(
        "gpu",
        help="one GPU session: correctness of every CUDA backend, then the attention and model benchmarks",
        description="On one CUDA GPU, in about 8 minutes: every differential-attention backend against "
        "the fp32 reference (output and all gradients; fp32 and bf16; MHA, GQA, odd lengths, S > T, "
        "left padding), the attention benchmark (bf16, 1K/4K/16K) and the model benchmark ('small', "
        "1024 tokens; on 'auto' and on the opt-in 'triton' backend). The fused Triton kernel is not "
        "used unless asked for: this is how to check and time it on your GPU, and it prints how to "
        "turn it on. Writes DIR/gpu_bench.json and DIR/gpu_bench.md; exits 1 if a correctness check "
        "fails, 2 without a CUDA device.",
    )
    g.add_argument("--out", required=True, metavar="DIR", type=output_dir,
                   help="directory for gpu_bench.json and gpu_bench.md")
    g.add_argument("--time-budget", type=positive_float, default=480.0, metavar="SECONDS",
                   help="seconds after which the phases not yet started are skipped, with a note (the phase "
                   "running finishes; default 480)")
    g.set_defaults(run=run_gpu)


def _dtype(args: argparse.Namespace) -> str:
    return args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")


def _print_machine(report: dict) -> None:
    machine = report["machine"]
    threads = report["settings"]["threads"] or machine["torch_threads"]
    where = machine.get("gpu") or f"{machine['cpu']} ({machine['cpu_cores']} cores, {threads} torch threads)"
    print(f"machine: {where}, torch {machine['torch']}")


def run_attention(args: argparse.Namespace) -> int:
    from ..bench.attention import AttentionBenchSettings, default_lengths, format_table, report, run_attention_bench

    settings = AttentionBenchSettings(
        device=args.device, dtype=_dtype(args), lengths=tuple(args.lengths or default_lengths(args.device)),
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, batch=args.batch, causal=args.causal,
        backends=tuple(args.backends), modes=tuple(args.modes), warmup=args.warmup, repeats=args.repeats,
        measure_memory=args.memory, memory_budget_gib=args.memory_budget_gib, threads=args.threads,
        kinds=tuple(args.kinds) + (("gda",) if args.gda_ratio is not None and "gda" not in args.kinds else ()),
        gda_ratio=args.gda_ratio,
    )
    results = run_attention_bench(settings, progress=not args.json)
    out = report(settings, results)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_machine(out)
    print(
        f"standard: {settings.heads} heads x d={settings.head_dim}; DIFF: {settings.heads // 2} heads x 2 groups of "
        f"d={settings.head_dim}, v 2d; kv heads {settings.kv_heads} / {settings.kv_heads // 2}; "
        f"batch {settings.batch}; "
        f"{settings.dtype}; {'causal' if settings.causal else 'non-causal'}"
        + (f"; GDA: {settings.heads // 2} signal heads sharing {settings.heads // 2 // settings.gda_ratio} noise heads"
           if settings.gda_ratio else "")
    )
    print(format_table(results))
    return 0


def run_model(args: argparse.Namespace) -> int:
    from ..bench.model import ModelBenchSettings, format_table, report, run_model_bench

    if args.gda_ratio is not None and "gda" not in args.architectures:
        raise UsageError("diff-transformer bench model: --gda-ratio applies to the gda architecture, which "
                         "--architectures does not list; add gda or leave --gda-ratio out")
    length = min(256, PRESETS[args.preset]["max_seq_len"]) if args.length is None else args.length
    settings = ModelBenchSettings(
        preset=args.preset, length=length, batch=args.batch, decode_tokens=args.decode_tokens,
        device=args.device, dtype=_dtype(args), backend=args.backend, warmup=args.warmup, repeats=args.repeats,
        compare_hf=args.hf, threads=args.threads, compile=args.compile, architectures=tuple(args.architectures),
        gda_ratio=args.gda_ratio,
    )
    results = run_model_bench(settings, progress=not args.json)
    out = report(settings, results)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_machine(out)
    print(format_table(settings, results))
    return 0


def run_train(args: argparse.Namespace) -> int:
    from ..experiments.train_bench import TrainBenchSettings, default_models, format_table, report, run_train_bench

    try:
        settings = TrainBenchSettings(
            models=tuple(args.models or default_models()), batches=tuple(args.batches), steps=args.steps,
            warmup=args.warmup, repeats=args.repeats, threads=args.threads, compile=args.compile,
            previous=args.previous,
        )
    except ValueError as exc:
        print(f"error: diff-transformer bench train: {exc}", file=sys.stderr)
        return 2
    results = run_train_bench(settings, progress=not args.json)
    out = report(settings, results)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_machine(out)
    print(format_table(settings, results))
    return 0


def run_gpu(args: argparse.Namespace) -> int:
    from ..bench.gpu import GpuBenchSettings, cuda_problem, run_gpu_bench, write_report

    from ..files import check_output_dir

    problem = cuda_problem()
    if problem:
        print(f"error: bench gpu needs a CUDA device ({problem})", file=sys.stderr)
        return 2
    check_output_dir(args.out, "bench", reuse=True)  # refused before the 8 minutes of work, not after
    report = run_gpu_bench(GpuBenchSettings(time_budget_s=args.time_budget))
    json_path, md_path = write_report(args.out, report)
    print(f"wrote {json_path} and {md_path}; correctness {'passed' if report['correctness_passed'] else 'FAILED'}")
    print(report["triton"]["turn_on"])
    return 0 if report["correctness_passed"] else 1
