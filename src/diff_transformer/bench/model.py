"""``diff-transformer bench model``: training, prefill and decode tokens/s (the paper's Table 7).

Models, all with random weights, at the preset's size (``architectures``, default DIFF and the
Transformer):
    DIFF          this project's DIFF model at the preset (H DIFF heads of two d-wide groups)
    Transformer   the matched Transformer (2H heads of width d, same parameters but 6d per layer)
    GDA           grouped differential attention: the H DIFF heads as signal heads sharing H / r
                  noise heads (``gda_ratio`` r; default the largest of 4, 3, 2 dividing H)
    Motif-2.6B arch      DIFF with Motif-2.6B's PolyNorm MLP, λ_init schedule and norm eps
    Motif-2-12.7B arch   GDA in Motif-2-12.7B's proportions: 4 signal heads per noise head, a K/V
                  group per noise head, the preset's d, N = round(d_model / 4d) noise heads (at
                  d_model 4096, d 128: 32 signal and 8 noise heads, the 12.7B's), PolyNorm MLP
    DiffLlama     transformers' DiffLlamaForCausalLM built from the DIFF config (num_attention_heads
                  = 2H, num_key_value_heads = 2Hkv, head_dim d, intermediate_size = ffn_hidden),
                  when transformers is installed and DIFF is measured
    any other kind       any attention kind by its name (mta, xsa, diff_v2, gated, ...), at the preset as
                  ``ModelConfig.from_preset`` builds it (the Transformer's heads for the non-DIFF kinds)

Measured:
    train     B·L tokens / (forward + backward + AdamW step) on random tokens of length L
    prefill   B·L tokens / one forward of length L that fills the KV cache, no grad
    decode    B tokens / the time of one generation step (forward of one token through the KV
              cache + greedy choice) after a prompt of length L: each of the N − 1 steps after
              the first is timed from inside generation (our ``stream``; a logits processor for
              transformers' ``generate``), so the prefill is left out

With ``compile`` our two models are measured twice in the same run, eager and through
torch.compile: the training step's forward and backward and the prefill's forward by
``torch.compile(model)`` (as ``run.compile`` trains), every decoding step by
``generate(..., compile=True)`` (a static KV cache, one graph). DiffLlama stays eager (its
static-cache ``generate`` compiles only on CUDA), so its ratios compare compiled with eager code.

Every figure is the best of ``repeats`` runs (of the N − 1 steps for decode) after ``warmup``
untimed ones (which compile): on a shared machine the least disturbed run (see
measure.time_call). The models take turns within every repeat, so that a change in the machine's
load hits them alike, and the ratios printed come from the same run.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..config import ATTENTION_KINDS, PRESETS, ModelConfig
from ..model import LanguageModel
from .attention import DTYPES
from ..ops import MATH_MAX_KEYS
from .measure import describe_machine, memory_budget, synchronize


@dataclass
class ModelBenchSettings:
    preset: str = "tiny"
    length: int = 256  # L: training / prefill length, and the decode prompt length
    batch: int = 1
    decode_tokens: int = 32  # N new tokens per generate call
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "auto"  # attention backend of this project's models
    warmup: int = 1
    repeats: int = 3
    compare_hf: bool = True  # also measure transformers' DiffLlama when transformers is installed
    threads: int | None = None  # torch CPU threads while measuring; None = leave as is
    compile: bool = False  # also measure our models through torch.compile (compiled during the warm-up)
    architectures: tuple[str, ...] = ("diff", "standard")  # keys of ARCHITECTURES, measured in this order
    gda_ratio: int | None = None  # GDA's signal heads per noise head; None = the largest of 4, 3, 2 dividing H

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        unknown = [a for a in self.architectures if a not in ARCHITECTURES]
        if unknown or not self.architectures or len(set(self.architectures)) < len(self.architectures):
            raise ValueError(f"architectures must be distinct names among {', '.join(ARCHITECTURES)}, got "
                             f"{list(self.architectures)}")
        heads = PRESETS[self.preset]["n_heads"]
        if self.gda_ratio is not None and (self.gda_ratio < 1 or heads % self.gda_ratio):
            raise ValueError(f"gda_ratio={self.gda_ratio} must divide the {heads} heads of preset {self.preset!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("length", "batch", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.compile and self.warmup < 1:
            raise ValueError("compile needs warmup >= 1, so that compiling is not timed")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2 (the rate is measured over N − 1 steps), "
                             f"got {self.decode_tokens}")
        context = PRESETS[self.preset]["max_seq_len"]
        for name in ("length", "decode_tokens"):  # the decoded tokens may run past the context: its table grows
            if getattr(self, name) > context:
                raise ValueError(f"{name} {getattr(self, name):,} is beyond the context of preset {self.preset!r} "
                                 f"({context:,} tokens, its max_seq_len): choose at most {context:,}, or a preset "
                                 f"with a longer context")
        if self.backend == "decode":
            raise ValueError("backend 'decode' takes one query per sequence, and training and prefill take "
                             "length tokens: use 'auto', which decodes with it")
        if self.backend == "triton" and not self.device.startswith("cuda"):
            raise ValueError(f"backend 'triton' (the fused kernel) needs a CUDA device, not {self.device!r}")


@dataclass
class ModelBenchResult:
    model: str
    parameters: int
    train_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    compiled: bool = False  # measured through torch.compile


@dataclass
class Contender:
    """One model and the three measured calls, each taking the (B, L) prompt tokens."""

    name: str
    model: torch.nn.Module
    train_step: Callable[[Tensor], None]  # forward + backward + AdamW step
    prefill: Callable[[Tensor], None]  # one forward filling the KV cache, no grad
    decode_steps: Callable[[Tensor, int], list[float]]  # generate N tokens -> N − 1 step times (s)
    compiled: bool = False

    @property
    def key(self) -> str:
        return f"{self.name} (compiled)" if self.compiled else self.name


# The architectures bench model measures, by name, and the label of each in the table.
ARCHITECTURES = {"diff": "DIFF", "standard": "Transformer", "gda": "GDA", "mta": "MTA", "xsa": "XSA",
                 "diff_v2": "DIFF V2", "diff_symmetric": "Symmetric DIFF", "gated": "Gated attention",
                 "gated_headwise": "Gated (head-wise)", "motif-2.6b": "Motif-2.6B arch",
                 "motif-2-12.7b": "Motif-2-12.7B arch"}
# What Motif's models change beyond the attention (interop.motif reads them from config.json)
MOTIF_FIELDS = dict(ffn_activation="polynorm", lambda_init_depth_offset=-1, norm_eps=1e-6, head_norm_eps=1e-5)


def default_gda_ratio(heads: int) -> int:
    """The largest of 4, 3, 2 (else 1) that divides ``heads``."""
    return next((r for r in (4, 3, 2) if heads % r == 0), 1)


def architecture_fields(settings: ModelBenchSettings, name: str) -> dict:
    """ModelConfig fields of architecture ``name`` at the preset (see the module docstring)."""
    preset = PRESETS[settings.preset]
    if name in ATTENTION_KINDS and name != "gda":
        return {"attention": name}
    if name == "gda":
        return {"attention": "gda", "gda_ratio": settings.gda_ratio or default_gda_ratio(preset["n_heads"])}
    if name == "motif-2.6b":
        return {"attention": "diff", **MOTIF_FIELDS}
    d = preset["d_model"] // (2 * preset["n_heads"])
    noise = max(1, round(preset["d_model"] / (4 * d)))
    return {"attention": "gda", "gda_ratio": 4, "n_heads": 4 * noise, "n_kv_heads": noise, "attn_head_dim": d,
            **MOTIF_FIELDS}


# fp32 T × S maps per head that a training step keeps, per kind that materialises them: DIFF's "math" backend
# (on CPU, up to MATH_MAX_KEYS keys) keeps P1 and P2; MTA about eight (the logits, their convolution and mixing,
# the softmax, its convolution and mixing, the masks' copies) on every device
KEPT_MAPS = {"diff": 2, "mta": 8}


def planned_bytes(settings: ModelBenchSettings) -> int:
    """About the most memory the benchmark holds at once (an upper estimate, before anything is
    allocated): every model's weights, gradients and two AdamW states (4 copies of its parameters in
    the measured dtype; DiffLlama counted as DIFF), a training step's activations (per layer and
    token about 12·E + 3·F values, and the fp32 maps a kind keeps, ``KEPT_MAPS``, S per head; the
    most of any model), and three (B, L, V) fp32 logits (a prefill's, DiffLlama's and its loss's)."""
    configs = [model_config(settings, name) for name in settings.architectures]
    models = len(configs) + (1 if settings.compare_hf and hf_available() else 0)
    itemsize = DTYPES[settings.dtype].itemsize
    counts = [LanguageModel(config, device="meta").num_parameters() for config in configs]
    parameters = max(counts)
    config, tokens = configs[counts.index(parameters)], settings.batch * settings.length
    per_token = (12 * config.d_model + 3 * config.ffn_hidden) * itemsize
    maps = 0
    for c in configs:
        if c.attention == "mta" or (c.attention == "diff" and not settings.device.startswith("cuda")
                                    and settings.length <= MATH_MAX_KEYS):
            maps = max(maps, KEPT_MAPS[c.attention] * c.n_heads * settings.length * 4)
    return (4 * parameters * itemsize * models + tokens * (per_token + maps) * config.n_layers
            + 3 * tokens * config.vocab_size * 4)


def check_fits(settings: ModelBenchSettings) -> None:
    """A ValueError, before any model is built, if :func:`planned_bytes` exceeds the memory budget
    (60% of the RAM, or of the free GPU memory: measure.memory_budget)."""
    need, budget = planned_bytes(settings), memory_budget(torch.device(settings.device))
    if need > budget:
        raise ValueError(
            f"bench model --preset {settings.preset} --length {settings.length} --batch {settings.batch} needs about "
            f"{need / 2**30:,.1f} GiB on {settings.device} (weights, gradients and AdamW states of its models, "
            f"activations, logits), more than its budget of {budget / 2**30:,.1f} GiB: choose a smaller preset, "
            f"length or batch"
        )


def model_config(settings: ModelBenchSettings, architecture: str) -> ModelConfig:
    """Architecture ``architecture`` (a key of ARCHITECTURES) at the preset, with room for the prompt
    and the generated tokens."""
    max_len = max(PRESETS[settings.preset]["max_seq_len"], settings.length + settings.decode_tokens)
    fields = architecture_fields(settings, architecture)
    return ModelConfig.from_preset(settings.preset, attention=fields.pop("attention"), max_seq_len=max_len, **fields)


def diffllama_config(config: ModelConfig):
    """transformers' DiffLlamaConfig of the same shape as our DIFF ``config`` (the export's
    mapping; no eos token, so that generate never stops early)."""
    from transformers import DiffLlamaConfig

    from ..interop.hf import hf_config_dict

    fields = hf_config_dict(config, eos_id=None)
    del fields["model_type"], fields["dtype"]
    return DiffLlamaConfig(**{**fields, "pad_token_id": 0})


def _ours(
    name: str, model: LanguageModel, optimizer: torch.optim.Optimizer, device: torch.device, compile: bool
) -> Contender:
    """This project's model, eager or through torch.compile (the same weights and optimizer either way)."""
    from ..generation import stream

    forward = torch.compile(model) if compile else model

    def train_step(tokens):
        model.train()
        _, loss = forward(tokens, tokens, return_logits=False)  # as the trainer (eagerly the fused head and loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def prefill(tokens):
        model.eval()
        forward(tokens, cache=model.new_cache(tokens.shape[0], tokens.shape[1]))

    def decode_steps(tokens, n):
        model.eval()
        times = []
        for _ in stream(model, tokens.tolist(), n, temperature=0.0, compile=compile):  # a token is yielded per step
            synchronize(device)
            times.append(time.perf_counter())
        return [b - a for a, b in zip(times, times[1:])]

    return Contender(name, model, train_step, prefill, decode_steps, compiled=compile)


def _diffllama(name: str, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Contender:
    """transformers' DiffLlamaForCausalLM of the same shape."""
    from transformers import DiffLlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generation step, after the forward: records the time."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            synchronize(device)
            self.times.append(time.perf_counter())
            return scores

    model = DiffLlamaForCausalLM(diffllama_config(config)).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step(tokens):
        model.train()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def prefill(tokens):
        model.eval()
        model(input_ids=tokens, use_cache=True)

    def decode_steps(tokens, n):
        model.eval()
        clock = StepClock()
        model.generate(
            tokens, max_new_tokens=n, min_new_tokens=n, do_sample=False, logits_processor=LogitsProcessorList([clock])
        )
        return [b - a for a, b in zip(clock.times, clock.times[1:])]

    return Contender(name, model, train_step, prefill, decode_steps)


def _best_times(calls: dict[str, Callable[[], list[float] | None]], device: torch.device,
                settings: ModelBenchSettings) -> dict[str, float]:
    """Best time of each call (or of the step times it returns), the models taking turns in every
    repeat so that a change in the machine's load hits them alike."""
    for call in calls.values():
        for _ in range(settings.warmup):
            call()
    best = {name: float("inf") for name in calls}
    for _ in range(settings.repeats):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            steps = call()
            synchronize(device)
            best[name] = min(best[name], *(steps or [time.perf_counter() - start]))
    return best


def hf_available() -> bool:
    try:
        from transformers import DiffLlamaForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def run_model_bench(settings: ModelBenchSettings, *, progress: bool = True) -> list[ModelBenchResult]:
    from ..progress import progress as tqdm

    check_fits(settings)
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(0)
    ours = {}  # name -> (model, optimizer)
    for architecture in settings.architectures:
        model = LanguageModel(model_config(settings, architecture), device=device, attn_backend=settings.backend)
        model = model.to(dtype)
        ours[ARCHITECTURES[architecture]] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    contenders = [_ours(name, *pair, device, compile=False) for name, pair in ours.items()]
    if settings.compare_hf and hf_available() and "diff" in settings.architectures:
        contenders.append(_diffllama("DiffLlama (transformers)", model_config(settings, "diff"), device, dtype))
    if settings.compile:
        contenders += [_ours(name, *pair, device, compile=True) for name, pair in ours.items()]
    vocab = PRESETS[settings.preset]["vocab_size"]
    tokens = torch.randint(0, vocab, (settings.batch, settings.length), device=device)
    n = settings.decode_tokens
    phases = {
        "train": {c.key: (lambda c=c: c.train_step(tokens)) for c in contenders},
        "prefill": {c.key: (lambda c=c: c.prefill(tokens)) for c in contenders},
        "decode": {c.key: (lambda c=c: c.decode_steps(tokens, n)) for c in contenders},
    }
    # Each compiled model adds its graphs (training, prefill, decoding) to dynamo's cache of the one
    # LanguageModel.forward; past the recompile limit (8: two models' worth) a model would run eager unsaid.
    limit = max(torch._dynamo.config.recompile_limit, 4 * len(ours))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            best = {phase: _best_times(calls, device, settings) for phase, calls in tqdm(
                phases.items(), desc="bench model", disable=not progress, file=sys.stderr
            )}
    finally:
        torch.set_num_threads(threads)
    tokens_in = settings.batch * settings.length
    return [
        ModelBenchResult(
            model=c.name,
            parameters=sum(p.numel() for p in c.model.parameters()),
            train_tokens_per_s=tokens_in / best["train"][c.key],
            prefill_tokens_per_s=tokens_in / best["prefill"][c.key],
            decode_tokens_per_s=settings.batch / best["decode"][c.key],
            compiled=c.compiled,
        )
        for c in contenders
    ]


def _ratios(a: ModelBenchResult, b: ModelBenchResult) -> str:
    return (f"train {a.train_tokens_per_s / b.train_tokens_per_s:.3f}, "
            f"prefill {a.prefill_tokens_per_s / b.prefill_tokens_per_s:.3f}, "
            f"decode {a.decode_tokens_per_s / b.decode_tokens_per_s:.3f}")


def format_table(settings: ModelBenchSettings, results: list[ModelBenchResult]) -> str:
    lines = [
        f"preset {settings.preset}, length {settings.length}, batch {settings.batch}, {settings.dtype} on "
        f"{settings.device}, {settings.decode_tokens} decoded tokens, attention backend {settings.backend!r}, "
        f"{settings.threads or torch.get_num_threads()} torch threads"
        + (", our models eager and through torch.compile (DiffLlama eager)" if settings.compile else ""),
        f"{'model':<26} {'mode':<9} {'params':>12} {'train tok/s':>12} {'prefill tok/s':>14} {'decode tok/s':>13}",
    ]
    for r in results:
        lines.append(
            f"{r.model:<26} {'compiled' if r.compiled else 'eager':<9} {r.parameters:>12,} "
            f"{r.train_tokens_per_s:>12.1f} {r.prefill_tokens_per_s:>14.1f} {r.decode_tokens_per_s:>13.1f}"
        )
    by_name = {(r.model, r.compiled): r for r in results}
    hf = by_name.get(("DiffLlama (transformers)", False))
    others = [ARCHITECTURES[a] for a in settings.architectures if a != "standard"]
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        std = by_name.get(("Transformer", compiled))
        for name in others:
            model = by_name.get((name, compiled))
            if model and std:
                lines.append(f"{name} vs Transformer (throughput ratio), {mode}: {_ratios(model, std)}")
        diff = by_name.get(("DIFF", compiled))
        if diff and hf:
            lines.append(f"DIFF vs DiffLlama (throughput ratio; DiffLlama eager), {mode} DIFF: {_ratios(diff, hf)}")
    return "\n".join(lines)


def report(settings: ModelBenchSettings, results: list[ModelBenchResult]) -> dict:
    return {
        "benchmark": "model",
        "machine": describe_machine(torch.device(settings.device)),
        "settings": dataclasses.asdict(settings),
        "results": [dataclasses.asdict(r) for r in results],
    }
