"""Training configuration: typed dataclasses, read from YAML, with ``key=value`` overrides.

A config file names an experiment: a base ``model`` and named ``models`` (variants merged over
it), the ``data``, the ``optim``izer and the ``run``; the sections of the experiments beside them
(``compare``, ``retrieval``, ``long_context``, ``scaling``, ``convert``, ``pretrained``:
:data:`EXPERIMENT_SECTIONS`) are read by :mod:`diff_transformer.experiments.config`, not here (a
config with a ``pretrained`` section, whose models are given checkpoints, needs no ``model``)::

    name: tiny
    model: {preset: tiny}                  # a ModelConfig preset plus any ModelConfig field
    models:
      standard: {attention: standard, label: Transformer, paper_row: transformer}
      diff: {attention: diff, label: DIFF, paper_row: diff}
    data: {dataset: default, seq_len: 256, batch_size: 16}
    optim: {recipe: null, lr: 2.0e-3, min_lr: 2.0e-4, warmup_steps: 30, betas: [0.9, 0.95], weight_decay: 0.1}
    run: {steps: 300, eval_every: 50, out_dir: out/train}
    compare: {models: [standard, diff]}

Every section is a dataclass below; an unknown key anywhere is a :class:`ConfigError` naming it,
and so is a number that is not finite (NaN, inf) or out of its range.
Overrides use dotted paths: ``optim.lr=1e-3``, ``models.diff.lambda_init=0.8``,
``data.mix.needle=0.1``; the value is read as YAML (``run.compile=true``, ``optim.betas=[0.9,0.95]``).
An override of an optim field (``optim.lr=1e-3``) applies to every model: it replaces the value a
model sets for itself (``models.NAME.optim``), which ``models.NAME.optim.lr=...`` overrides for one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from ..checks import MAX_STEPS
from ..config import ATTENTION_KINDS, ConfigError, ModelConfig
from ..ops import BACKEND_NAMES
from ..user_text import not_a_file

T = TypeVar("T")
# Sections of a config file that the experiments read (diff_transformer.experiments.config); the
# trainer does not look into them.
EXPERIMENT_SECTIONS = ("compare", "retrieval", "grounded", "long_context", "scaling", "convert", "pretrained")
# Keys a model entry no longer takes, and where their values live now.
MOVED_MODEL_KEYS = {
    "retrieval_lr": "retrieval.lr_by_model.{name}",
    "lr_by_recipe": "compare.lr_by_recipe.RECIPE.{name} (and retrieval.lr_by_recipe.RECIPE.{name})",
}

# The ModelConfig fields the small models' experiments set for every model (their section's sizes),
# which a model entry's small_model cannot change.
SMALL_MODEL_SIZES = ("vocab_size", "d_model", "n_layers", "max_seq_len")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def require_finite(section: str, values: Any) -> None:
    """A ConfigError naming the first float of dataclass ``values`` (a field, or an item of a list,
    tuple or mapping field) that is NaN or infinite."""
    for f in dataclasses.fields(values):
        value = getattr(values, f.name)
        if isinstance(value, dict):
            items = [(f".{k}", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [("", value)]
        for where, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{section}.{f.name}{where} must be a finite number, got {item}")


MAX_SEED = 2**63 - 1  # torch.manual_seed's range


def require_seeds(section: str, values: Any, names: tuple[str, ...]) -> None:
    """A ConfigError naming the first of ``names`` outside [0, MAX_SEED]."""
    for name in names:
        value = getattr(values, name)
        if not 0 <= value <= MAX_SEED:
            raise ConfigError(f"{section}.{name} must be in [0, 2**63 - 1], got {value}")


@dataclass
class ModelEntry:
    """One model of an experiment: a preset (or none) plus ModelConfig fields.

    ``label`` is the name reports print, its ``{field}``s filled from the model's own ModelConfig
    (``"Transformer {n_heads}×{head_dim}"``: its real shape at whatever preset and size, never a
    shape written by hand); ``paper_row`` names the row of the paper's Table 6 (see
    :data:`diff_transformer.paper.PAPER_TABLE6`) that this model corresponds to.
    """

    name: str
    attention: str = "diff"
    preset: str | None = None
    label: str | None = None
    paper_row: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # any other ModelConfig field
    optim: dict[str, Any] = field(default_factory=dict)  # this model's OptimConfig fields over the config's (its lr)
    # The preset's DIFF head count (not doubled) for a kind of ordinary heads, at whatever size the
    # preset is: with attention "standard", the wide-head Transformer (head dim 2d, the same parameters).
    diff_heads: bool = False
    # ModelConfig fields of this model's small models (the retrieval and grounded experiments, the
    # long-context study's retrieval models) over the entry's own: its shape at their size where the
    # entry's cannot apply (GDA's signal heads at d_model 64), or a setting that differs there (MTA's
    # convolution layers among 2). Never the sizes those experiments set for every model (SMALL_MODEL_SIZES).
    small_model: dict[str, Any] = field(default_factory=dict)

    def model_config(self) -> ModelConfig:
        """The ModelConfig this entry describes (validated by ModelConfig itself)."""
        if self.diff_heads and (self.preset is None or "n_heads" in self.fields):
            raise ConfigError(f"models.{self.name}.diff_heads keeps a preset's DIFF head count: it needs a preset "
                              "(model.preset or models.NAME.preset) and no n_heads of its own")
        try:
            if self.preset is None:
                return ModelConfig.from_dict({**self.fields, "attention": self.attention})
            return ModelConfig.from_preset(self.preset, attention=self.attention, diff_heads=self.diff_heads,
                                           **self.fields)
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"models.{self.name}: {exc}") from None

    @property
    def display_name(self) -> str:
        """The label with its ``{field}``s filled from the model's ModelConfig, else the name."""
        if not self.label or "{" not in self.label:
            return self.label or self.name
        config = self.model_config()

        class Fields(dict):
            def __missing__(self, key: str) -> Any:  # a ModelConfig field or property (head_dim)
                if key.startswith("_") or not hasattr(config, key):
                    raise KeyError(key)
                return getattr(config, key)

        try:
            return self.label.format_map(Fields())
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ConfigError(f"models.{self.name}.label {self.label!r}: each {{...}} must name a ModelConfig field "
                              f"or head_dim (e.g. {{n_heads}}×{{head_dim}}); {type(exc).__name__}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attention": self.attention}
        for key in ("preset", "label", "paper_row"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.optim:
            out["optim"] = dict(self.optim)
        if self.diff_heads:
            out["diff_heads"] = True
        if self.small_model:
            out["small_model"] = dict(self.small_model)
        return {**out, **self.fields}


PACKINGS = ("none", "documents")  # data.packing


@dataclass
class DataConfig:
    """What the model reads. Batches are counted in sequences of ``seq_len`` tokens."""

    # "default" = the embedded corpus with the shipped BPE, "default-bytes" = byte by byte (both prepared
    # once into a cache), or a `prepare`d folder
    dataset: str = "default"
    cache_dir: str | None = None  # where the embedded corpus is prepared; None = the data layer's default cache
    seq_len: int | None = None  # tokens per sequence; None = the model's max_seq_len
    batch_size: int = 16  # sequences per optimizer step, summed over all processes
    micro_batch_size: int | None = None  # sequences per forward pass and process; None = batch_size / processes
    mix: dict[str, float] = field(default_factory=dict)  # generator name -> fraction of training sequences
    eval_sequences: int = 64  # validation sequences scored at every evaluation (the same ones each time)
    # A second held-out set, scored once at the end (summary.json's final_heldout_loss): this many windows,
    # each between two validation windows, never overlapping them (at most eval_sequences − 1; 0: none).
    # A study that chooses on the validation loss reports this one, which the choice never saw.
    heldout_sequences: int = 0
    # Long-context training (see diff_transformer.data.shards): windows (training and validation) that
    # never cross a document boundary, from the documents of at least seq_len + 1 tokens; and long
    # documents up-sampled, within documents or across them.
    within_documents: bool = False
    long_document_tokens: int | None = None  # documents of at least this many tokens are "long"
    long_document_weight: float = 1.0  # a long document's windows are drawn this many times as often (> 1: up-sampled)
    # "documents": the windows as above, with attention confined to each document they hold (whole or
    # split at the window's ends; a document starts at each end-of-text token) and positions from 0 in
    # each; "none": attention across the documents of a window
    packing: str = "none"

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise ConfigError(f"data.packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.packing == "documents" and self.within_documents:
            raise ConfigError("data.packing=documents packs the documents a window runs across, and "
                              "data.within_documents takes windows that run across none: choose one")
        if self.packing == "documents" and self.mix:
            raise ConfigError("data.packing=documents cuts each sequence at its end-of-text tokens, and the examples "
                              "data.mix generates hold them inside (their filler is corpus text): choose one")
        if self.long_document_tokens is not None and self.long_document_tokens <= 0:
            raise ConfigError(f"data.long_document_tokens must be positive, got {self.long_document_tokens}")
        if not self.long_document_weight > 0:
            raise ConfigError(f"data.long_document_weight must be positive, got {self.long_document_weight}")
        if self.long_document_weight != 1.0 and self.long_document_tokens is None:
            raise ConfigError("data.long_document_weight up-samples the long documents: set data.long_document_tokens "
                              "(how many tokens make a document long)")
        require_finite("data", self)
        if self.seq_len is not None and self.seq_len <= 0:
            raise ConfigError(f"data.seq_len must be positive, got {self.seq_len}")
        if self.batch_size <= 0:
            raise ConfigError(f"data.batch_size must be positive, got {self.batch_size}")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ConfigError(f"data.micro_batch_size must be positive, got {self.micro_batch_size}")
        if self.eval_sequences <= 0:
            raise ConfigError(f"data.eval_sequences must be positive, got {self.eval_sequences}")
        if not 0 <= self.heldout_sequences < self.eval_sequences:
            raise ConfigError(f"data.heldout_sequences lie between the {self.eval_sequences} validation windows: "
                              f"0 to {self.eval_sequences - 1}, got {self.heldout_sequences}")
        from ..data.synthetic import GENERATORS

        for name, fraction in self.mix.items():
            if name not in GENERATORS:
                raise ConfigError(f"data.mix.{name}: no such generator; choose from {', '.join(GENERATORS)}")
            if not 0.0 <= fraction < 1.0:
                raise ConfigError(f"data.mix.{name} must be a fraction in [0, 1), got {fraction}")
        if sum(self.mix.values()) >= 1.0:
            raise ConfigError(f"data.mix fractions must sum to less than 1, got {sum(self.mix.values()):.3f}")


# The paper's training recipes (Tables 9 and 10). A recipe fills every optim field a config leaves unset.
RECIPES: dict[str, dict[str, Any]] = {
    # Table 9, the 3B model: 1000 warmup steps, then linear decay to 1.28e-5.
    "paper-3b": dict(lr=3.2e-4, min_lr=1.28e-5, warmup_steps=1000, betas=(0.9, 0.95), weight_decay=0.1),
    # Table 10, the scaling runs (830M-13.1B): lr 1.5e-4 up to 2.8B (use 7.5e-5 from 6.8B on),
    # 375 warmup steps, linear decay. The paper names no floor: we decay to 0.
    "paper-scaling": dict(lr=1.5e-4, min_lr=0.0, warmup_steps=375, betas=(0.9, 0.98), weight_decay=0.05),
}


@dataclass
class OptimConfig:
    """AdamW, linear warmup then linear decay to ``min_lr``. ``recipe`` names a preset (see
    :data:`RECIPES`) that fills every field left unset (null)."""

    recipe: str | None = None
    lr: float | None = None  # peak learning rate
    min_lr: float | None = None  # the floor the linear decay ends at
    warmup_steps: int | None = None
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None  # applied to matrices and embeddings, not to norms and λ vectors
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping

    def __post_init__(self) -> None:
        if self.recipe is not None:
            if self.recipe not in RECIPES:
                raise ConfigError(f"optim.recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
            for key, value in RECIPES[self.recipe].items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
        missing = [f.name for f in dataclasses.fields(self) if f.name != "recipe" and getattr(self, f.name) is None]
        if missing:
            raise ConfigError(f"optim: set {', '.join(missing)} or name a recipe (optim.recipe) that sets them")
        self.betas = tuple(self.betas)
        require_finite("optim", self)
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim: need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("optim.warmup_steps, optim.weight_decay and optim.grad_clip must not be negative")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be positive, got {self.eps}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")


# What a budget (run.budget) counts: tokens (every process's), training FLOPs (diff_transformer.flops), or
# seconds of training steps (the timed steps of TrainResult.train_seconds).
BUDGET_KINDS = ("tokens", "flops", "seconds")


@dataclass
class TrainingBudget:
    """A run's length in tokens, training FLOPs or seconds instead of run.steps (``run.budget``):
    each model trains until it has spent ``amount`` of ``kind`` (see :mod:`diff_transformer.train.budget`)."""

    kind: str
    amount: float

    def __post_init__(self) -> None:
        if self.kind not in BUDGET_KINDS:
            raise ConfigError(f"run.budget.kind must be one of {', '.join(BUDGET_KINDS)} (a length in steps is "
                              f"run.steps), got {self.kind!r}")
        if not (math.isfinite(self.amount) and self.amount > 0):
            raise ConfigError(f"run.budget.amount must be a positive finite number of {self.kind}, got {self.amount}")


# run.compile=auto compiles the training step of a run of at least this many steps: compiling costs the
# first step ~30-140 s on a CPU core (from a warm or an empty inductor cache) and saves a small model's
# step ~40%: BENCHMARKS.md, "Small models: the trainer's step"
COMPILE_AUTO_MIN_STEPS = 2000


@dataclass
class RunConfig:
    """How long, where, on what, and how often to evaluate, log and save."""

    steps: int = 300  # optimizer steps; with run.budget, derived from it (tokens, FLOPs) or unused (seconds)
    # The run's length in tokens, training FLOPs or seconds of training steps instead of steps: null = run.steps
    budget: TrainingBudget | None = None
    seed: int = 0  # model init; the data order is fixed by data_seed
    data_seed: int = 0  # which corpus windows, in which order (the same for every model and seed)
    eval_every: int = 50  # steps between validation evaluations (and one at the end)
    log_every: int = 10  # steps between training-metric records
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end (and on SIGINT/SIGTERM)
    stop_at_step: int | None = None  # end this invocation after this step (checkpoint saved; the schedule
    #                                  still spans `steps`): time-sliced jobs, continued with --resume
    out_dir: str = "out/train"  # metrics.jsonl, tensorboard/, summary.json
    checkpoint_dir: str | None = None  # the training checkpoint; None = out_dir/checkpoint
    # A checkpoint whose weights start this run (a training or save_pretrained checkpoint of the same
    # model, which may differ in max_seq_len and rope_theta only): a fresh optimizer, schedule and step
    # count. Ignored by --resume, which continues from the run's own checkpoint.
    init_from: str | None = None
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda"
    precision: str = "auto"  # "auto" = bf16 autocast on CUDA, fp32 on CPU; or "fp32", "bf16"
    # torch.compile the model (training and evaluation); "auto": its training step only, and only for a
    # run of COMPILE_AUTO_MIN_STEPS steps or more (where compiling pays: see compile_training)
    compile: bool | str = False
    # attention backend of every layer (see diff_transformer.ops; "triton" opts in); not saved
    attn_backend: str = "auto"
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard per block)
    tensorboard: bool = True  # also write TensorBoard event files in out_dir/tensorboard
    progress: bool = True  # tqdm progress bar (rank 0)
    # λ and the attention-branch RMS per layer (every log and eval step), the negative share of the
    # differential maps (every eval step), from a forward of one validation sequence (train/diagnostics.py)
    diagnostics: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "eval_every", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"run.{name} must be positive, got {getattr(self, name)}")
        if self.steps > MAX_STEPS:
            raise ConfigError(f"run.steps={self.steps:,} is beyond any run ({MAX_STEPS:,} at most)")
        require_seeds("run", self, ("seed", "data_seed"))
        if self.stop_at_step is not None and self.stop_at_step <= 0:
            raise ConfigError(f"run.stop_at_step must be positive, got {self.stop_at_step}")
        if self.stop_at_step is not None and self.budget is None and self.stop_at_step > self.steps:
            raise ConfigError(f"run.stop_at_step must be in [1, run.steps={self.steps}], got {self.stop_at_step}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"run.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.compile not in (True, False, "auto"):
            raise ConfigError(f"run.compile must be true, false or auto, got {self.compile!r}")
        choices = {
            "device": ("auto", "cpu", "cuda"),
            "precision": ("auto", "fp32", "bf16"),
            "parallel": ("ddp", "fsdp"),
            "attn_backend": BACKEND_NAMES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"run.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def compile_training(self, steps: int | None) -> bool:
        """Whether the training step goes through torch.compile in a run of ``steps`` steps (None: a budget
        in seconds): run.compile true, or "auto" and at least COMPILE_AUTO_MIN_STEPS steps."""
        if self.compile == "auto":
            return steps is not None and steps >= COMPILE_AUTO_MIN_STEPS
        return bool(self.compile)

    def resolved_precision(self, device_type: str) -> str:
        """What ``precision`` means on a device of ``device_type``: "fp32" or "bf16" (autocast)."""
        if self.precision == "auto":
            return "bf16" if device_type == "cuda" else "fp32"
        return self.precision


@dataclass
class TrainConfig:
    name: str
    models: dict[str, ModelEntry]
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(recipe="paper-scaling"))
    run: RunConfig = field(default_factory=RunConfig)
    description: str = ""
    source: str | None = None  # the file it was read from

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("models: a config needs at least one model")
        for name in self.models:
            self.optim_for(name)  # a model's optim fields are checked like the section's

    def model(self, name: str | None = None) -> ModelEntry:
        """The entry called ``name``; without a name, the only one (an error if there are several)."""
        if name is None:
            if len(self.models) > 1:
                raise ConfigError(
                    f"config {self.name!r} defines models {', '.join(self.models)}: choose one (--model NAME)"
                )
            return next(iter(self.models.values()))
        if name not in self.models:
            raise ConfigError(f"no model named {name!r} in config {self.name!r}; it has {', '.join(self.models)}")
        return self.models[name]

    def optim_for(self, name: str, lr: float | None = None) -> OptimConfig:
        """The optimizer settings of model ``name``: the optim section with the model's own fields
        over it; ``lr`` (a grid value) replaces the peak lr and scales min_lr with it."""
        overrides = self.model(name).optim
        if lr is not None:
            base_lr = overrides.get("lr", self.optim.lr)
            overrides = {**overrides, "lr": lr, "min_lr": overrides.get("min_lr", self.optim.min_lr) * lr / base_lr}
        if not overrides:
            return self.optim
        values = {**dataclasses.asdict(self.optim), "recipe": None}
        try:
            return section_from_dict(OptimConfig, {**values, **overrides}, f"models.{name}.optim")
        except ConfigError as exc:
            raise ConfigError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :func:`config_from_dict` reads back (written beside every run)."""
        out = {"name": self.name, "description": self.description}
        out["models"] = {name: entry.to_dict() for name, entry in self.models.items()}
        for section in ("data", "optim", "run"):
            values = dataclasses.asdict(getattr(self, section))
            if section == "optim":
                values["betas"] = list(values["betas"])
            out[section] = values
        return out


# --- reading -----------------------------------------------------------------------------------



def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """``value`` if it fits ``annotation`` (ints are accepted as floats), else a ConfigError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):  # a section within a section (run.budget, each pretrained model)
        return value if isinstance(value, annotation) else section_from_dict(annotation, value, where)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if annotation is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value}")
    if annotation in (int, float, str, bool):
        if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
            raise ConfigError(f"{where} must be {annotation.__name__}, got {value!r}")
        return value
    if origin is tuple:
        item_types = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_types):
            raise ConfigError(f"{where} must be a list of {len(item_types)} values, got {value!r}")
        return tuple(_check_type(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, item_types)))
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_check_type(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return {_check_type(k, key_type, where): _check_type(v, value_type, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):  # a nested config (ModelConfig.rope_scaling): a mapping of its fields
        if isinstance(value, annotation):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        hints = typing.get_type_hints(annotation)
        unknown = sorted(set(value) - set(hints))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: no such field (known: {', '.join(hints)})")
        return {k: _check_type(v, hints[k], f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"unsupported annotation {annotation!r} at {where}")


def section_from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from a mapping, naming any unknown key or ill-typed value."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {where}.{unknown[0]} (known keys of {where}: {', '.join(known)})")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"{where}.{missing[0]} is missing ({where} needs {', '.join(required)})")
    values = {key: _check_type(value, hints[key], f"{where}.{key}") for key, value in data.items()}
    return cls(**values)


def _model_entries(base: Any, variants: Any) -> dict[str, ModelEntry]:
    if base is None:
        base = {}
    if not isinstance(base, dict):
        raise ConfigError(f"model must be a mapping, got {base!r}")
    if variants is None:
        variants = {"model": {}}
    if not isinstance(variants, dict):
        raise ConfigError(f"models must be a mapping of name -> model fields, got {variants!r}")
    entries = {}
    model_fields = typing.get_type_hints(ModelConfig)
    for name, variant in variants.items():
        if not isinstance(variant, dict):
            raise ConfigError(f"models.{name} must be a mapping, got {variant!r}")
        merged = {**base, **(variant or {})}
        for key, value in merged.items():  # typed as the ModelConfig field (a YAML "1e-3" is a number)
            if key in model_fields and key != "attention":
                merged[key] = _check_type(value, model_fields[key], f"models.{name}.{key}")
        attention = merged.pop("attention", "diff")
        if attention not in ATTENTION_KINDS:
            raise ConfigError(f"models.{name}.attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
        optim = merged.pop("optim", None) or {}
        if not isinstance(optim, dict):
            raise ConfigError(f"models.{name}.optim must be a mapping of optim fields, got {optim!r}")
        for key, new in MOVED_MODEL_KEYS.items():
            if key in merged:
                raise ConfigError(f"models.{name}.{key} has moved: set {new.format(name=name)} instead")
        diff_heads = _check_type(merged.pop("diff_heads", False), bool, f"models.{name}.diff_heads")
        small_model = _small_model_fields(name, merged.pop("small_model", {}), diff_heads)
        entry = ModelEntry(
            name=str(name),
            attention=attention,
            preset=merged.pop("preset", None),
            label=merged.pop("label", None),
            paper_row=merged.pop("paper_row", None),
            fields=merged,
            optim=optim,
            diff_heads=diff_heads,
            small_model=small_model,
        )
        entry.model_config()  # validate now: unknown ModelConfig fields are named here
        _ = entry.display_name  # and the fields its label names
        entries[str(name)] = entry
    return entries


def _small_model_fields(name: Any, fields: Any, diff_heads: bool) -> dict[str, Any]:
    """models.NAME.small_model checked: a mapping of ModelConfig fields, each typed as the field, none
    of the sizes the small models' experiments set (SMALL_MODEL_SIZES) nor the attention kind."""
    where = f"models.{name}.small_model"
    fields = {} if fields is None else fields
    if not isinstance(fields, dict):
        raise ConfigError(f"{where} must be a mapping of ModelConfig fields, got {fields!r}")
    model_fields = typing.get_type_hints(ModelConfig)
    checked = {}
    for key, value in fields.items():
        if key in SMALL_MODEL_SIZES or key == "attention":
            raise ConfigError(f"{where}.{key}: the small models' experiments set {key} for every model (their "
                              "section's sizes) and a model keeps its attention kind; small_model sets the other "
                              "ModelConfig fields (n_heads, attn_head_dim, mta_conv_every, ...)")
        if key not in model_fields:
            raise ConfigError(f"{where}: unknown ModelConfig field {key!r}")
        checked[key] = _check_type(value, model_fields[key], f"{where}.{key}")
    if diff_heads and "n_heads" in checked:
        raise ConfigError(f"{where}.n_heads: models.{name}.diff_heads keeps the DIFF head count of every size; "
                          "give one or the other")
    return checked


def config_from_dict(data: dict[str, Any], source: str | None = None) -> TrainConfig:
    """A TrainConfig from plain data (a parsed YAML file); every key is checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source or 'config'}: expected a mapping at the top level")
    known = {"name", "description", "model", "models", "data", "optim", "run", *EXPERIMENT_SECTIONS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} at the top level (known: {', '.join(sorted(known))})")
    models = _model_entries(data.get("model"), data.get("models"))
    return TrainConfig(
        name=_check_type(data.get("name", Path(source).stem if source else "experiment"), str, "name"),
        description=_check_type(data.get("description", ""), str, "description"),
        models=models,
        data=section_from_dict(DataConfig, data.get("data"), "data"),
        optim=section_from_dict(OptimConfig, data.get("optim", {"recipe": "paper-scaling"}), "optim"),
        run=section_from_dict(RunConfig, data.get("run"), "run"),
        source=source,
    )


def shipped_configs() -> dict[str, Path]:
    """The named configs that ship with the package: name -> YAML file."""
    return {path.stem: path for path in sorted(CONFIG_DIR.glob("*.yaml"))}


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config ("tiny", "ablation-1.4b", ...)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"config {str(name_or_path)!r}: a directory; "
                          "give a YAML file or the name of a shipped config")
    shipped = shipped_configs()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    what = not_a_file(path)
    if what != "no such file or folder":  # a FIFO (a read would wait for a writer), a device, a broken link
        raise ConfigError(f"config {str(name_or_path)!r}: {what}, not a file; give a YAML file or the name of a "
                          "shipped config")
    raise ConfigError(f"config {str(name_or_path)!r}: no such file, and not a shipped config ({', '.join(shipped)})")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a copy of ``data``; values are parsed as YAML. An override
    of the optim section (``optim.lr=...``, or ``optim={...}``) also removes the fields it sets from
    every model's own optim, so that it applies to every model."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        path = key.strip().split(".")
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
            node = child
        node[path[-1]] = value
        if path[0] == "optim":
            _section_override_reaches_models(data, path[1:], value)
    return data


def _section_override_reaches_models(data: dict[str, Any], field_path: list[str], value: Any) -> None:
    """Drop the optim fields an override of the section sets (``field_path`` under optim, or the
    keys of ``value`` when the whole section is set) from each model's own optim mapping."""
    fields = field_path[:1] if field_path else (list(value) if isinstance(value, dict) else [])
    models = data.get("models")
    if not isinstance(models, dict):
        return
    for entry in models.values():
        own = entry.get("optim") if isinstance(entry, dict) else None
        if isinstance(own, dict):
            for name in fields:
                own.pop(name, None)


def read_config_data(name_or_path: str | Path, overrides: list[str] | None, parse: Callable[[dict, str], T]) -> T:
    """Read a YAML config (a path or a shipped name), apply ``key=value`` overrides, and build it with
    ``parse(data, source)``; a ConfigError names the file."""
    path = resolve_config_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a YAML text file (not UTF-8: {exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if data is None or data == {}:
        raise ConfigError(f"{path}: an empty config; give at least a model (see the shipped configs: "
                          f"{', '.join(shipped_configs())})")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    overrides = list(overrides or [])
    merged = apply_overrides(data, overrides)
    if "model" not in merged and "models" not in merged and "pretrained" not in merged:  # pretrained: its checkpoints
        raise ConfigError(f"{path}: no model; set model (e.g. model: {{preset: tiny}}) or models")
    try:
        return parse(merged, str(path))
    except ConfigError as exc:
        raise ConfigError(f"{_error_source(path, data, overrides, str(exc), parse)}: {exc}") from None


def _error_source(path: Path, data: dict[str, Any], overrides: list[str], message: str,
                  parse: Callable[[dict, str], Any]) -> str:
    """Where a config error came from: the file, when it has the error without the overrides, else
    the first override (``--set KEY=VALUE``) with which the error appears."""
    for applied in range(len(overrides) + 1):
        try:
            parse(apply_overrides(data, overrides[:applied]), str(path))
        except ConfigError as exc:
            if str(exc) == message:
                return str(path) if applied == 0 else f"--set {overrides[applied - 1]}"
        except (TypeError, ValueError, KeyError):  # a part-way config may fail otherwise: the error is further on
            pass
    return f"{path} with {' '.join(f'--set {item}' for item in overrides)}"


def load_config(name_or_path: str | Path = "tiny", overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (a path or a shipped name) and apply ``key=value`` overrides: the trainer's
    part of it (the experiments' sections: :func:`diff_transformer.experiments.load_experiment`)."""
    return read_config_data(name_or_path, overrides, config_from_dict)
