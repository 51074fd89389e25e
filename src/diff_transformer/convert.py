"""A DIFF model from a pretrained Transformer: ``diff-transformer convert SOURCE OUT``.

    from diff_transformer.convert import convert_checkpoint
    result = convert_checkpoint("out/train/tiny/checkpoint", "out/tiny-diff", to="diff", init="exact")
    result.conversion.added            # {what was added: parameters}
    result.start.loss_change           # converted − source loss on held-out windows, at step 0

SOURCE is a standard-attention (Transformer) checkpoint of this project or a transformers
``LlamaForCausalLM`` directory (read as ``import-hf`` reads it). Per layer, with H source heads of
width d, Hkv key/value heads (n_rep = H / Hkv), q_h, k_g, v_g the rows of the source's projections
for query head h and key/value head g, and W_o its output projection:

``--to diff --init exact`` (the default): the converted model computes the source's function.
    DIFF head h keeps source head h as its first map: Q1 = q_h, K1 = k_g, V = v_g (d wide:
    ``value_factor=1``), g = h // n_rep as in the source; Q2 and K2 are new (N(0, init_std)).
    λ_init = 0 and λq2 = λq1, λk2 = λk1 (N(0, lambda_std)), so λ = exp(λq1·λk1) − exp(λq2·λk2)
    + 0 is exactly 0 and (A1 − λ A2) V = A1 V, while ∂λ/∂λq1 = exp(λq1·λk1) λk1 ≠ 0: λ learns
    from the first step, and Q2, K2 from the second (their gradient is λ times a term, 0 at step
    0). No head norm (``head_norm=False``): RMSNorm is not linear and cannot start as the identity,
    so an exact start means DIFF without it; (1 − λ_init) = 1.
``--to diff --init split``: the matched DIFF of this project (H/2 DIFF heads of two d-wide groups,
    a 2d-wide value, the head norm and the λ_init schedule; the parameters of the source plus 6d
    per layer). The source's heads are paired: DIFF group g takes key/value heads 2g, 2g+1 as K1,
    K2 and V = [v_2g; v_2g+1]; DIFF head j = g·n_rep + r takes query heads 2g·n_rep + r (Q1) and
    (2g + 1)·n_rep + r (Q2), whose W_o columns it keeps. Not equal at step 0 (each head now mixes
    two maps over both values, normed): :func:`compare_start` measures the loss change.
``--to diff_v2`` (exact only): DIFF V2's gate σ(x W_λ) is never 0, so the construction above does
    not carry over; another one is exact. Query heads 2h and 2h+1 both start as q_h (one map
    A_h), W_λ = 0 (gate 1/2) and W_o doubled: (A_h − A_h / 2) V · 2 W_o = A_h V W_o. Both query
    heads and W_λ get gradients at step 0. This is the matched DIFF V2 (H heads, as the source):
    there is nothing to split.

Refused with a :class:`ConversionError` naming the problem: a source that is not a plain causal
Transformer of a supported kind (a DIFF, DIFF V2 or other checkpoint; the head-norm ablation; a
transformers model other than Llama), a GQA layout that ``split`` cannot pair (an odd number of
key/value heads), ``split`` to DIFF V2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .checkpoint import CONFIG_FILE, FORMAT, CheckpointError, load_checkpoint_tokenizer, load_state_dict_checked
from .checkpoint import read_config, save_pretrained
from .config import ModelConfig
from .files import check_output_dir
from .model import LanguageModel
from .tokenizer import BPETokenizer, ByteTokenizer

TARGETS = ("diff", "diff_v2")
INITS = ("exact", "split")
# The ModelConfig fields a conversion sets; every other field is the source's.
CONVERSION_FIELDS = ("attention", "n_heads", "n_kv_heads", "head_norm", "lambda_init", "value_factor")
LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
START_WINDOWS = 8  # held-out windows the step-0 comparison scores by default
START_WINDOW_TOKENS = 128  # their length (at most the model's context)


class ConversionError(ValueError):
    """A source that cannot be converted as asked; the message names the source and why."""


class TooLittleText(ValueError):
    """The held-out text holds fewer tokens than the step-0 comparison's windows need: ``tokens`` of
    ``needed`` (``count`` windows of ``window`` tokens), read from ``what``."""

    def __init__(self, what: str, tokens: int, count: int, window: int) -> None:
        self.what, self.tokens, self.count, self.window = what, tokens, count, window
        self.needed = count * window
        super().__init__(f"{what} holds {tokens:,} tokens; {count:,} windows of {window} tokens need "
                         f"{self.needed:,}: give more text or fewer windows")


@dataclass(frozen=True)
class Source:
    """A Transformer read for conversion: the model (fp32, CPU), its tokenizer or None, where it
    came from and what it was ("checkpoint": this project's; "llama": a transformers directory)."""

    model: LanguageModel
    tokenizer: ByteTokenizer | BPETokenizer | None
    path: Path
    kind: str


@dataclass(frozen=True)
class Conversion:
    """A converted model and what the conversion did. ``added`` names each kind of parameter the
    construction added (over every layer) and how many; the rest are the source's, moved."""

    model: LanguageModel
    to: str
    init: str
    source_parameters: int
    added: dict[str, int]
    seed: int

    @property
    def parameters(self) -> int:
        return self.model.num_parameters()

    @property
    def added_parameters(self) -> int:
        return sum(self.added.values())

    def record(self) -> dict[str, Any]:
        """What the converted checkpoint's config.json keeps under "converted_from" (with the source)."""
        return {"to": self.to, "init": self.init, "seed": self.seed, "source_parameters": self.source_parameters,
                "parameters": self.parameters, "added_parameters": self.added_parameters, "added": dict(self.added)}


@dataclass(frozen=True)
class StartComparison:
    """The source and the converted model on the same windows before any training: the mean
    next-token loss of each (nats) and the largest |difference| of their logits."""

    windows: int
    window_tokens: int  # tokens scored per window
    text: str  # where the windows come from
    source_loss: float
    converted_loss: float
    max_logit_difference: float

    @property
    def loss_change(self) -> float:
        """converted − source: what the conversion costs at step 0 (0 for an exact start)."""
        return self.converted_loss - self.source_loss

    def to_dict(self) -> dict[str, Any]:
        return {"windows": self.windows, "window_tokens": self.window_tokens, "text": self.text,
                "source_loss": self.source_loss, "converted_loss": self.converted_loss,
                "loss_change": self.loss_change, "max_logit_difference": self.max_logit_difference}


@dataclass(frozen=True)
class ConvertedCheckpoint:
    """What :func:`convert_checkpoint` wrote (``path``), how (``conversion``) and its step-0 figures."""

    path: Path
    source: Path
    source_kind: str
    conversion: Conversion
    start: StartComparison
    finetune_fields: dict[str, Any]  # the model fields a fine-tuning config sets (:func:`finetune_fields`)


# --- reading the source -----------------------------------------------------------------------


def source_config(path: str | Path) -> tuple[ModelConfig, str]:
    """The ModelConfig of a source directory and its kind ("checkpoint" or "llama"), from its
    config.json alone (no weights read); a ConversionError if it is neither."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ConversionError(f"{path}: neither a checkpoint of this project nor a transformers model directory "
                              f"(no {CONFIG_FILE})")
    try:
        meta = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or ("format" not in meta and "model_type" not in meta):
        raise ConversionError(f"{path}: neither a checkpoint of this project nor a transformers model directory "
                              f"({CONFIG_FILE} has neither 'format': {FORMAT!r} nor a 'model_type')")
    if "format" in meta:
        config, _ = read_config(path)
        return config, "checkpoint"
    from .interop.hf import model_config_from_hf

    model_type, architectures = meta["model_type"], meta.get("architectures") or ["LlamaForCausalLM"]
    if model_type != "llama" or architectures != ["LlamaForCausalLM"]:
        raise ConversionError(f"{path}: a transformers {model_type!r} model ({', '.join(map(str, architectures))}); "
                              "convert reads LlamaForCausalLM directories and this project's standard checkpoints")
    return model_config_from_hf(meta, config_file), "llama"


def check_convertible(config: ModelConfig, to: str, init: str, where: str | Path = "source") -> None:
    """A ConversionError naming the problem unless a model of ``config`` converts to ``to`` by ``init``."""
    if to not in TARGETS:
        raise ConversionError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    if init not in INITS:
        raise ConversionError(f"--init must be one of {', '.join(INITS)}, got {init!r}")
    if config.attention != "standard":
        raise ConversionError(f"{where}: holds a model with attention={config.attention!r}; convert reads Transformers "
                              "(attention='standard'), whose heads become the DIFF heads")
    if config.head_norm:
        raise ConversionError(f"{where}: a Transformer with the per-head norm (head_norm=true, the Table 6 ablation); "
                              "convert reads plain Transformers")
    if to == "diff_v2" and init == "split":
        raise ConversionError("--init split applies to --to diff: the exact DIFF V2 conversion already is the matched "
                              "DIFF V2 (the source's heads, each with a second query); use --init exact")
    if init == "split" and config.n_kv_heads % 2:
        gqa = config.n_kv_heads != config.n_heads
        layout = f"key/value heads (GQA, {config.n_heads} query heads)" if gqa else "heads"
        raise ConversionError(f"{where}: {config.n_kv_heads} {layout} cannot be paired into DIFF's K1/K2 groups "
                              "(--init split needs an even number of key/value heads); use --init exact")


def read_source(path: str | Path, *, with_tokenizer: bool = True) -> Source:
    """Read a standard checkpoint of this project or a transformers Llama directory (fp32, CPU)."""
    path = Path(path)
    config, kind = source_config(path)
    check_convertible(config, "diff", "exact", path)
    if kind == "llama":
        from .interop.hf import load_hf

        model, tokenizer = load_hf(path, with_tokenizer=with_tokenizer)
    else:
        model = LanguageModel.from_pretrained(path)
        tokenizer = load_checkpoint_tokenizer(path, config.vocab_size) if with_tokenizer else None
    return Source(model=model.eval(), tokenizer=tokenizer, path=path, kind=kind)


# --- the constructions (see the module docstring) ---------------------------------------------


def converted_config(config: ModelConfig, to: str = "diff", init: str = "exact") -> ModelConfig:
    """The ModelConfig of ``config``'s Transformer converted to ``to`` by ``init``: the source's
    fields but for :data:`CONVERSION_FIELDS`."""
    check_convertible(config, to, init)
    h, hkv = config.n_heads, config.n_kv_heads
    if to == "diff_v2":
        fields = dict(attention="diff_v2", n_heads=h, n_kv_heads=hkv, head_norm=False, lambda_init=None, value_factor=1)
    elif init == "exact":
        fields = dict(attention="diff", n_heads=h, n_kv_heads=hkv, head_norm=False, lambda_init=0.0, value_factor=1)
    else:
        fields = dict(attention="diff", n_heads=h // 2, n_kv_heads=hkv // 2, head_norm=True, lambda_init=None,
                      value_factor=2)
    return ModelConfig.from_dict({**config.to_dict(), **fields})


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> Tensor:
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _exact_diff_attention(src: dict[str, Tensor], config: ModelConfig, generator: torch.Generator) -> dict[str, Tensor]:
    """One layer's attention tensors, source -> DIFF (value_factor 1), exact start."""
    h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
    q, k = src["q_proj.weight"], src["k_proj.weight"]  # (H·d, E), (Hkv·d, E)
    e = q.shape[1]
    q2 = _normal((h, d, e), config.init_std, generator)  # the second maps, as a fresh model draws them
    k2 = _normal((hkv, d, e), config.init_std, generator)
    lambda_q, lambda_k = (_normal((d,), config.lambda_std, generator) for _ in range(2))
    return {
        "q_proj.weight": torch.stack([q.view(h, d, e), q2], dim=1).reshape(2 * h * d, e),  # sub-heads 2h: Q1, 2h+1: Q2
        "k_proj.weight": torch.stack([k.view(hkv, d, e), k2], dim=1).reshape(2 * hkv * d, e),
        "v_proj.weight": src["v_proj.weight"].clone(),
        "o_proj.weight": src["o_proj.weight"].clone(),
        # λq2 = λq1 and λk2 = λk1: both exponentials are the same number, λ = 0 + λ_init = 0
        "lambda_q1": lambda_q, "lambda_k1": lambda_k, "lambda_q2": lambda_q.clone(), "lambda_k2": lambda_k.clone(),
    }


def _split_diff_attention(src: dict[str, Tensor], config: ModelConfig, generator: torch.Generator) -> dict[str, Tensor]:
    """One layer's attention tensors, source -> the matched DIFF, heads paired (config: the source's)."""
    h, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
    groups, n_rep = hkv // 2, h // hkv
    q, o = src["q_proj.weight"], src["o_proj.weight"]  # (H·d, E), (E, H·d)
    e = q.shape[1]
    # Source query head (2g + c)·n_rep + r reads key/value head 2g + c; DIFF head g·n_rep + r takes it as group c.
    paired_q = q.view(groups, 2, n_rep, d, e).transpose(1, 2).reshape(h * d, e)
    paired_o = o.view(e, groups, 2, n_rep, d).transpose(2, 3).reshape(e, h * d)
    return {
        "q_proj.weight": paired_q,
        "k_proj.weight": src["k_proj.weight"].clone(),  # key heads 2g, 2g+1 are already sub-heads 2g, 2g+1
        "v_proj.weight": src["v_proj.weight"].clone(),  # value heads 2g, 2g+1 are group g's two halves
        "o_proj.weight": paired_o,
        "head_norm.weight": torch.ones(2 * d),
        **{name: _normal((d,), config.lambda_std, generator) for name in LAMBDA_VECTORS},
    }


def _exact_diff_v2_attention(
    src: dict[str, Tensor], config: ModelConfig, generator: torch.Generator
) -> dict[str, Tensor]:
    """One layer's attention tensors, source -> DIFF V2, exact start (no random draws)."""
    h, d = config.n_heads, config.head_dim
    q = src["q_proj.weight"]
    e = q.shape[1]
    return {
        "q_proj.weight": q.view(h, 1, d, e).expand(h, 2, d, e).reshape(2 * h * d, e),  # heads 2h, 2h+1 both q_h
        "k_proj.weight": src["k_proj.weight"].clone(),
        "v_proj.weight": src["v_proj.weight"].clone(),
        "o_proj.weight": 2.0 * src["o_proj.weight"],  # the two maps give A − A/2 = A/2
        "lambda_proj.weight": torch.zeros(h, e),  # gate σ(0) = 1/2 for every token
    }


def _added(config: ModelConfig, to: str, init: str) -> dict[str, int]:
    """What the construction adds to the source's parameters, over every layer."""
    layers, e, d = config.n_layers, config.d_model, config.head_dim
    h, hkv = config.n_heads, config.n_kv_heads
    if to == "diff_v2":
        return {"second query heads (odd query heads of q_proj)": layers * h * d * e,
                "lambda_proj (the gate σ(x W_λ))": layers * e * h}
    if init == "exact":
        return {"Q2 (odd sub-heads of q_proj)": layers * h * d * e,
                "K2 (odd sub-heads of k_proj)": layers * hkv * d * e,
                "λ vectors (lambda_q1, lambda_k1, lambda_q2, lambda_k2)": layers * 4 * d}
    return {"λ vectors (lambda_q1, lambda_k1, lambda_q2, lambda_k2)": layers * 4 * d,
            "head-norm weights (head_norm.weight)": layers * 2 * d}


def convert_model(source: LanguageModel, to: str = "diff", init: str = "exact", *, seed: int = 0) -> Conversion:
    """``source`` (a standard-attention LanguageModel) converted to ``to`` by ``init`` (see the
    module docstring), on CPU in fp32; ``seed`` draws the new parameters. The source is unchanged."""
    config = converted_config(source.config, to, init)
    construct = _exact_diff_v2_attention if to == "diff_v2" else (
        _exact_diff_attention if init == "exact" else _split_diff_attention)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Tensor] = {}
    source_state = {name: t.detach().to("cpu", torch.float32) for name, t in source.state_dict().items()}
    for name, tensor in source_state.items():
        if ".attn." not in name:
            state[name] = tensor.clone()
    for i in range(config.n_layers):
        prefix = f"layers.{i}.attn."
        layer = {name[len(prefix):]: t for name, t in source_state.items() if name.startswith(prefix)}
        # the construction reads the source's head layout: its heads, key/value heads and head width
        for name, tensor in construct(layer, source.config, generator).items():
            state[prefix + name] = tensor.contiguous()
    model = LanguageModel(config, device="meta")
    model.to_empty(device="cpu")
    load_state_dict_checked(model, state, source="the converted weights")
    return Conversion(model=model.eval(), to=to, init=init, source_parameters=source.num_parameters(),
                      added=_added(source.config, to, init), seed=seed)


# --- measuring the start ----------------------------------------------------------------------


def start_windows(tokenizer, config: ModelConfig, *, count: int = START_WINDOWS, text: str | None = None,
                  seed: int = 0) -> tuple[Tensor, str]:
    """``count`` windows of up to START_WINDOW_TOKENS + 1 tokens (count, T + 1) and what they are:
    held-out text (``text``, else the embedded corpus' validation documents) read with
    ``tokenizer``; without a tokenizer, uniform random ids (seeded), which still compare logits."""
    length = min(START_WINDOW_TOKENS, config.max_seq_len)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size, (count, length + 1), generator=generator)
        return ids, "uniform random tokens (the source has no tokenizer)"
    from .evaluation.texts import EvalText

    held_out = EvalText(None if text is None else [text])
    what = "the given text" if text is not None else "the embedded corpus' validation documents"
    tokens = held_out.stream(tokenizer, 0).numel()
    if tokens < count * (length + 1):
        raise TooLittleText(what, tokens, count, length + 1)
    return held_out.windows(tokenizer, length, count), what


@torch.no_grad()
def compare_start(source: LanguageModel, converted: LanguageModel, windows: Tensor, text: str = "") -> StartComparison:
    """Score ``windows`` (N, T + 1) token ids with both models as they are (no training): the
    mean next-token loss over the N·T targets and the largest |logit difference|. One window at
    a time, so that a large vocabulary's logits stay small."""
    totals = {"source": 0.0, "converted": 0.0}
    max_difference = 0.0
    for window in windows:
        inputs, targets = window[None, :-1], window[None, 1:]
        logits = {}
        for name, model in (("source", source), ("converted", converted)):
            logits[name], loss = model(inputs, targets, reduction="sum")
            totals[name] += loss.item()
        max_difference = max(max_difference, (logits["source"] - logits["converted"]).abs().max().item())
    scored = windows.shape[0] * (windows.shape[1] - 1)
    return StartComparison(windows=windows.shape[0], window_tokens=windows.shape[1] - 1, text=text,
                           source_loss=totals["source"] / scored, converted_loss=totals["converted"] / scored,
                           max_logit_difference=max_difference)


def finetune_fields(config: ModelConfig) -> dict[str, Any]:
    """The fields a training config's model entry sets (over the source's) for ``train --init-from``
    to accept a converted checkpoint of ``config``: :data:`CONVERSION_FIELDS` and their values."""
    values = config.to_dict()
    return {name: values[name] for name in CONVERSION_FIELDS}


# --- the whole command ------------------------------------------------------------------------


def convert_checkpoint(source: str | Path, out: str | Path, *, to: str = "diff", init: str = "exact", seed: int = 0,
                       with_tokenizer: bool = True, windows: int = START_WINDOWS, text: str | None = None
                       ) -> ConvertedCheckpoint:
    """Convert the Transformer at ``source`` and write the result as a checkpoint of this project at
    ``out`` (new or empty; never replaced), with the source's tokenizer. Everything is checked
    before anything is written: ``out``, then the source's config, then its weights.

    config.json records the conversion under "converted_from" (the source, what was added, the
    step-0 figures on ``windows`` held-out windows: see :func:`start_windows`)."""
    check_output_dir(out, "checkpoint", reading=[source], hint="choose another directory (convert replaces nothing)")
    config, _ = source_config(source)
    check_convertible(config, to, init, source)
    read = read_source(source, with_tokenizer=with_tokenizer)
    conversion = convert_model(read.model, to, init, seed=seed)
    tokens, what = start_windows(read.tokenizer, read.model.config, count=windows, text=text, seed=seed)
    start = compare_start(read.model, conversion.model, tokens, what)
    record = {"source": str(source), "source_kind": read.kind, **conversion.record(), "start": start.to_dict()}
    path = save_pretrained(conversion.model, out, tokenizer=read.tokenizer, extra={"converted_from": record},
                           reading=[source], hint="choose another directory (convert replaces nothing)")
    return ConvertedCheckpoint(path=Path(path), source=Path(source), source_kind=read.kind, conversion=conversion,
                               start=start, finetune_fields=finetune_fields(conversion.model.config))


__all__ = [
    "CONVERSION_FIELDS", "INITS", "TARGETS", "Conversion", "ConversionError", "ConvertedCheckpoint", "Source",
    "StartComparison", "check_convertible", "compare_start", "convert_checkpoint", "convert_model", "converted_config",
    "finetune_fields", "read_source", "source_config", "start_windows",
]
