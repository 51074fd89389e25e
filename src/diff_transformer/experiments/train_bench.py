"""``diff-transformer bench train``: training tokens/s of the studies' small models at small batches.

A study's cost is its steps: small byte-level models (vocab 257, 128 tokens, d_model 12-96, 2-4
layers) trained for 1,000-4,000 steps at batch 4-16, each run on one CPU core (compare.jobs runs at
a time). Each figure is the trainer's own step, as ``train`` takes it: the step's micro-batches from
the config's dataset (``DataPlan.micro_batches``), forward and backward (``step.forward_backward``),
clipping (``step.clip_gradients``), the fused AdamW step and the schedule (``step.advance``).

Models are named ``CONFIG:MODEL`` (a shipped config or a YAML file, and one of its models, at the
config's own shape) or ``CONFIG:MODEL@SIZE`` (a size of the config's ``scaling.sizes``, as the
scaling study builds it). By default: the scaling study's Transformer, DIFF and DIFF V2 at its
first (smallest) and last (largest) size, and the tiny config's two models.

Every figure is the best of ``repeats`` runs of ``steps`` steps after ``warmup`` untimed steps (on
a shared machine the least disturbed run); the models take turns within every repeat, so that a
change in the machine's load hits them alike, and the ratios printed come from the same run.

With ``compile`` each model is measured a second time with its forward and backward through
``torch.compile`` (as ``run.compile`` trains), and the first compiled step's time (the compilation:
from an empty inductor cache, or from the cache an earlier compile of the same shapes left) is
reported, with the steps after which compiling pays: compile seconds / seconds saved per step.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..model import LanguageModel

DEFAULT_BATCHES = (4, 8, 16)


def default_models() -> tuple[str, ...]:
    """The scaling study's Transformer, DIFF and DIFF V2 at its first (smallest) and last (largest) size,
    and the tiny config's two models."""
    from .config import load_experiment

    sizes = list(load_experiment("scaling").scaling.sizes)
    return tuple(f"scaling:{model}@{size}" for size in (sizes[0], sizes[-1])
                 for model in ("standard", "diff", "diff_v2")) + ("tiny:standard", "tiny:diff")


@dataclass
class TrainBenchSettings:
    models: tuple[str, ...] = dataclasses.field(default_factory=default_models)
    batches: tuple[int, ...] = DEFAULT_BATCHES
    steps: int = 20  # steps per timed run
    warmup: int = 3  # untimed steps first (the compiled models compile in the first)
    repeats: int = 3
    threads: int | None = 1  # torch CPU threads while measuring (1: a compare job's, two runs on 2 cores)
    compile: bool = False  # also measure every model through torch.compile
    previous: bool = False  # also measure the step as it was before its data and clipping were made cheaper

    def __post_init__(self) -> None:
        for name in ("steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or (self.compile and self.warmup < 1):
            raise ValueError(f"warmup must be >= 0 (>= 1 with compile, which compiles in it), got {self.warmup}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive sizes, got {list(self.batches)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not self.models or len(set(self.models)) < len(self.models):
            raise ValueError(f"models must be distinct, got {list(self.models)}")
        for spec in self.models:
            parse_model(spec)


def parse_model(spec: str) -> tuple[str, str, str | None]:
    """``CONFIG:MODEL[@SIZE]`` as (config, model, size or None); a ValueError naming the form otherwise."""
    config, _, rest = spec.rpartition(":")
    model, _, size = rest.partition("@")
    if not config or not model or (rest.endswith("@") and not size):
        raise ValueError(f"model {spec!r}: name it CONFIG:MODEL or CONFIG:MODEL@SIZE (e.g. scaling:diff@w8, "
                         "tiny:standard)")
    return config, model, size or None


def train_config(spec: str, batch: int):
    """The trainer's config of model ``spec`` (see :func:`parse_model`) at global batch ``batch``."""
    from ..config import ConfigError
    from ..train.config import load_config

    config_name, model, size = parse_model(spec)
    overrides = [f"data.batch_size={batch}", "data.micro_batch_size=null"]
    if size is None:
        config = load_config(config_name, overrides)
    else:
        from .config import load_experiment
        from .scaling import sized_train
        from .study import RunKey

        experiment = load_experiment(config_name, overrides)
        if size not in experiment.scaling.sizes:
            raise ConfigError(f"model {spec!r}: config {config_name!r} has no scaling size {size!r}; its sizes: "
                              f"{', '.join(experiment.scaling.sizes) or 'none'}")
        key = RunKey(model=model, seed=0, lr=experiment.train.optim.lr, recipe=None, size=size,
                     steps=experiment.train.run.steps)
        config = sized_train(experiment, key)
    config.model(model)  # an unknown model named now
    return config, model


@dataclass
class TrainBenchResult:
    model: str  # the spec, CONFIG:MODEL[@SIZE]
    mode: str  # "eager", "compiled", or "previous" (the step before its data and clipping were made cheaper)
    batch: int
    seq_len: int
    parameters: int
    tokens_per_s: float
    step_ms: float
    compile_seconds: float | None = None  # compiled: the first step's time less an eager step's


@dataclass
class _Contender:
    spec: str
    mode: str
    batch: int
    seq_len: int
    parameters: int
    step: Callable[[], None]
    first_step_seconds: float = 0.0


def _contender(spec: str, batch: int, mode: str) -> _Contender:
    """Model ``spec`` at ``batch`` with the trainer's optimizer, schedule and data, stepping as the trainer."""
    from ..train.optim import WarmupLinearSchedule, build_optimizer
    from ..train.step import CPU, advance, clip_gradients, forward_backward
    from ..train.trainer import DataPlan

    config, name = train_config(spec, batch)
    model_config = config.model(name).model_config()
    seq_len = config.data.seq_len or model_config.max_seq_len
    plan = DataPlan(config, seq_len, CPU)
    torch.manual_seed(config.run.seed)
    model = LanguageModel(model_config, attn_backend=config.run.attn_backend)
    forward = torch.compile(model) if mode == "compiled" else model
    optim = config.optim_for(name)
    optimizer = build_optimizer(model, optim, CPU.device)
    schedule = WarmupLinearSchedule(optimizer, optim, 10**6)
    model.train()
    parameters = list(model.parameters())  # as the trainer lists them once
    counter = iter(range(10**9))

    def step() -> None:
        index = next(counter)
        if mode == "previous":  # each step's windows drawn alone, clip_grad_norm_ over model.parameters()
            first = index * plan.batch_size
            batches = [plan.train.get_batch(range(first, first + plan.batch_size), seq_len, seed=plan.seed)]
            forward_backward(model, forward, batches, CPU, separator=plan.separator)
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip or float("inf")))
        else:
            forward_backward(model, forward, list(plan.micro_batches(index)), CPU, separator=plan.separator)
            clip_gradients(parameters, optim.grad_clip)
        advance(optimizer, schedule)

    return _Contender(spec, mode, batch, seq_len, model.num_parameters(), step)


def run_train_bench(settings: TrainBenchSettings, *, progress: bool = True) -> list[TrainBenchResult]:
    from ..progress import progress as tqdm

    modes = ["eager"] + (["compiled"] if settings.compile else []) + (["previous"] if settings.previous else [])
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    results = []
    try:
        for batch in tqdm(settings.batches, desc="bench train", disable=not progress, file=sys.stderr):
            contenders = [_contender(spec, batch, mode) for spec in settings.models for mode in modes]
            for c in contenders:
                for i in range(settings.warmup):
                    start = time.perf_counter()
                    c.step()
                    if i == 0:
                        c.first_step_seconds = time.perf_counter() - start
            best = {id(c): float("inf") for c in contenders}
            for _ in range(settings.repeats):
                for c in contenders:
                    start = time.perf_counter()
                    for _ in range(settings.steps):
                        c.step()
                    best[id(c)] = min(best[id(c)], (time.perf_counter() - start) / settings.steps)
            eager = {c.spec: best[id(c)] for c in contenders if c.mode == "eager"}
            for c in contenders:
                seconds = best[id(c)]
                results.append(TrainBenchResult(
                    model=c.spec, mode=c.mode, batch=batch, seq_len=c.seq_len, parameters=c.parameters,
                    tokens_per_s=batch * c.seq_len / seconds, step_ms=seconds * 1e3,
                    compile_seconds=c.first_step_seconds - eager[c.spec] if c.mode == "compiled" else None,
                ))
    finally:
        torch.set_num_threads(threads)
    return results


def break_even_steps(eager: TrainBenchResult, compiled: TrainBenchResult) -> float:
    """The steps after which a compiled run has caught up its compile time (inf: it never does)."""
    saved = (eager.step_ms - compiled.step_ms) / 1e3
    return compiled.compile_seconds / saved if saved > 0 else float("inf")


def format_table(settings: TrainBenchSettings, results: list[TrainBenchResult]) -> str:
    modes = list(dict.fromkeys(r.mode for r in results))
    by = {(r.model, r.mode, r.batch): r for r in results}
    seq_lens = sorted({r.seq_len for r in results})
    lines = [f"training tokens/s (forward, backward, clipping, fused AdamW, schedule, data: the trainer's step), "
             f"fp32 on cpu, {settings.threads or torch.get_num_threads()} torch threads, sequences of "
             f"{'/'.join(map(str, seq_lens))} tokens; best of {settings.repeats} runs of {settings.steps} steps"]
    header = f"{'model':<22} {'params':>10} {'mode':<9}" + "".join(f" {'batch ' + str(b):>11}"
                                                                     for b in settings.batches)
    lines.append(header)
    for spec in settings.models:
        for mode in modes:
            row = [by.get((spec, mode, b)) for b in settings.batches]
            params = next((r.parameters for r in row if r is not None), 0)
            lines.append(f"{spec:<22} {params:>10,} {mode:<9}"
                         + "".join(f" {r.tokens_per_s:>11,.0f}" if r else f" {'-':>11}" for r in row))
    for other in [m for m in modes if m != "eager"]:
        label = {"compiled": "compiled / eager", "previous": "eager / previous step"}[other]
        lines.append(f"{label} (throughput ratio):")
        for spec in settings.models:
            ratios = []
            for b in settings.batches:
                e, o = by.get((spec, "eager", b)), by.get((spec, other, b))
                if e is None or o is None:
                    ratios.append("-")
                elif other == "compiled":
                    ratios.append(f"{o.tokens_per_s / e.tokens_per_s:.2f}")
                else:
                    ratios.append(f"{e.tokens_per_s / o.tokens_per_s:.2f}")
            lines.append(f"  {spec:<20} " + "  ".join(f"batch {b}: {x}" for b, x in zip(settings.batches, ratios)))
    if "compiled" in modes:
        lines.append("compiling (the first compiled step less an eager step) and the steps after which it pays:")
        for spec in settings.models:
            parts = []
            for b in settings.batches:
                e, c = by.get((spec, "eager", b)), by.get((spec, "compiled", b))
                if e and c:
                    steps = break_even_steps(e, c)
                    parts.append(f"batch {b}: {c.compile_seconds:.1f} s, "
                                 + (f"{steps:,.0f} steps" if steps != float("inf") else "never"))
            lines.append(f"  {spec:<20} " + "; ".join(parts))
    return "\n".join(lines)


def report(settings: TrainBenchSettings, results: list[TrainBenchResult]) -> dict:
    from ..bench.measure import describe_machine

    return {
        "benchmark": "train",
        "machine": describe_machine(torch.device("cpu")),
        "settings": dataclasses.asdict(settings),
        "results": [dataclasses.asdict(r) for r in results],
    }
