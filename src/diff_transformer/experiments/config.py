"""The experiments' settings: the sections of a config file beside the trainer's (``compare``,
``retrieval``, ``long_context``, ``scaling``, ``convert``, ``pretrained``), the init recipes a comparison
searches, and the learning rates a sweep chose for each model, and the sizes and budgets of a scaling study.
:func:`load_experiment` reads a whole config file into an
:class:`ExperimentConfig`: the trainer's part (:class:`~diff_transformer.train.config.TrainConfig`)
and these sections, every key checked::

    compare: {models: [standard, diff], seeds: 3, recipes: [scaled-init, plain-init],
              lr_by_recipe: {plain-init: {standard: 4.0e-3}}}
    retrieval: {steps: 400, lr: 1.0e-3, lr_by_model: {standard: 2.0e-3}}
    grounded: {steps: 300, recipes: [scaled-init]}
    long_context: {seq_len: 1024, rope_theta: 226000}

A section that is absent is off (``retrieval``, ``grounded``, ``long_context``, ``scaling``,
``convert``, ``pretrained``) or at its defaults (``compare``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..config import DIFF_HEAD_KINDS, PRESETS, ConfigError, ModelConfig
from ..convert import INITS, ConversionError, converted_config
from ..data.synthetic import GroundedTask, SymbolicTask
from ..evaluation.suite import EVALUATIONS, evaluation_options
from ..paper import PAPER_TABLE6
from ..train.config import (
    DataConfig, ModelEntry, OptimConfig, TrainConfig, config_from_dict, read_config_data, require_finite, require_seeds,
    section_from_dict,
)

# Initialisation recipes that ``compare`` searches beside the learning rate (compare.recipes): each
# is a set of ModelConfig fields applied to every model of the comparison.
INIT_RECIPES: dict[str, dict[str, Any]] = {
    # The authors' (and GPT-2's): o_proj and down_proj, which write into the residual stream, at
    # init_std / sqrt(2 · layers); every other matrix N(0, init_std). The ModelConfig default.
    "scaled-init": {"scale_residual_init": True},
    # transformers' Llama and DiffLlama: every matrix N(0, init_std).
    "plain-init": {"scale_residual_init": False},
}



def retrieval_examples_per_step(batch_size: int) -> dict[str, int]:
    """The examples of each retrieval task in one training batch: half needle documents, half MQAR."""
    half = batch_size // 2
    return {"needle": half, "mqar": batch_size - half}


def curve_steps(steps: int, fractions: Sequence[float]) -> list[int]:
    """The steps after which a small model's learning curve is measured: 0 (before training), each of
    ``fractions`` of ``steps`` (at least one step each), and ``steps``."""
    return sorted({0, steps, *(max(1, round(f * steps)) for f in fractions)})


@dataclass
class RetrievalConfig:
    """The retrieval experiment of ``compare`` (the ``retrieval`` section of a config)."""

    enabled: bool = True
    length: int = 48  # tokens per example (the models' context)
    keys: int = 32
    values: int = 32  # chance = 1 / values
    noise_tokens: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 1  # DIFF heads; the Transformer gets twice as many of the same width (here 2 of 32)
    steps: int = 400
    batch_size: int = 16  # examples per step: half needle, half mqar
    lr: float = 3.0e-3  # peak learning rate of a model that lr_by_model does not name
    lr_by_model: dict[str, float] = field(default_factory=dict)  # model name -> its peak lr (from a sweep)
    # Where another init recipe's best differs: {recipe: {model name: peak lr}}.
    lr_by_recipe: dict[str, dict[str, float]] = field(default_factory=dict)
    lr_grid: list[float] = field(default_factory=list)  # every model at each; reported at its best. Empty: lr
    warmup_steps: int = 40
    weight_decay: float = 0.1
    needles: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # N; distractors = N − 1
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    pairs: list[int] = field(default_factory=lambda: [2, 4, 8, 12])  # D of mqar
    queries: int | None = None  # mqar keys asked again per example; None = every pair, in a random order
    eval_samples: int = 40  # examples per difficulty cell
    # accuracy with attention logits at these widths
    quantize_bits: list[int] = field(default_factory=lambda: [8, 6, 4])
    data_seed: int = 0
    # The learning curve: accuracy on every cell before training and after these fractions of the steps
    # (the last point is the end of training, whatever the list says).
    curve: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 1.0])
    target_accuracy: float = 0.25  # sample efficiency: the examples a model needs to reach this accuracy

    def __post_init__(self) -> None:
        require_finite("retrieval", self)
        for name in ("length", "keys", "values", "noise_tokens", "d_model", "n_layers", "n_heads", "steps",
                     "batch_size", "eval_samples"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"retrieval.{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.weight_decay < 0 or any(lr <= 0 for lr in self.lr_grid):
            raise ConfigError("retrieval: need lr > 0, warmup_steps >= 0, weight_decay >= 0")
        check_learning_rates("retrieval.lr_by_model", self.lr_by_model)
        check_recipe_table("retrieval.lr_by_recipe", self.lr_by_recipe)
        require_seeds("retrieval", self, ("data_seed",))
        if not self.needles or not self.pairs or not self.depths:
            raise ConfigError("retrieval.needles, retrieval.pairs and retrieval.depths must not be empty")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"retrieval.depths must lie in [0, 1], got {self.depths}")
        if any(not 0.0 < f <= 1.0 for f in self.curve):
            raise ConfigError(f"retrieval.curve: fractions of the steps in (0, 1], got {self.curve}")
        if not 0.0 < self.target_accuracy < 1.0:
            raise ConfigError(f"retrieval.target_accuracy must lie in (0, 1), got {self.target_accuracy}")
        if self.queries is not None and not 0 < self.queries <= min(self.pairs):
            raise ConfigError(f"retrieval.queries must be in [1, min(pairs)] or null (every pair), got {self.queries}")
        if max(self.needles) > self.keys or max(self.pairs) > self.keys:
            raise ConfigError("retrieval: needles and pairs must not exceed keys")
        if 3 * max(self.needles) + 4 > self.length:
            raise ConfigError(f"retrieval.length={self.length} is too short for {max(self.needles)} needles")
        queries = self.queries or max(self.pairs)
        if 2 * max(self.pairs) + 2 * queries > self.length:
            raise ConfigError(f"retrieval.length={self.length} is too short for {max(self.pairs)} pairs and "
                              f"{queries} queries")

    @property
    def curve_steps(self) -> list[int]:
        return curve_steps(self.steps, self.curve)

    def examples_seen(self, task: str, step: int) -> int:
        """Training examples of ``task`` after ``step`` steps (each batch: half needle, half mqar)."""
        return step * retrieval_examples_per_step(self.batch_size)[task]

    @property
    def task(self) -> SymbolicTask:
        """The generated examples' vocabulary and lengths (diff_transformer.data.synthetic)."""
        return SymbolicTask(length=self.length, keys=self.keys, values=self.values, noise_tokens=self.noise_tokens,
                            queries=self.queries)

    def model_config(self, attention: str, *, diff_heads: bool = False, **fields: Any) -> ModelConfig:
        """The retrieval model of one attention kind (:func:`small_model_config`)."""
        return small_model_config(self, self.task.vocab_size, attention, diff_heads=diff_heads, **fields)


def small_model_config(section: Any, vocab_size: int, attention: str, *, diff_heads: bool = False,
                       **fields: Any) -> ModelConfig:
    """A model of the retrieval or the grounded experiment: the section's d_model, n_layers and length,
    DIFF's head count ``section.n_heads``, doubled for the other kinds (the same head width) unless
    ``diff_heads``, as a model entry's (the wide-head Transformer); ``fields`` over that (a model
    entry's switches and its small_model fields, which may set its own n_heads)."""
    heads = section.n_heads if attention in DIFF_HEAD_KINDS or diff_heads else 2 * section.n_heads
    return ModelConfig(**{"n_heads": heads, **fields, "vocab_size": vocab_size, "d_model": section.d_model,
                          "n_layers": section.n_layers, "max_seq_len": section.length, "attention": attention})


@dataclass
class GroundedConfig:
    """The contextual-hallucination experiment of ``compare`` (the ``grounded`` section; absent = off):
    small models of every attention kind trained on generated grounded question answering
    (:class:`~diff_transformer.data.synthetic.GroundedTask`, :mod:`.grounded`) with the retrieval
    experiment's recipe (its learning rates, warmup and weight decay). Each training batch holds
    ``closed_book`` examples of the facts' training text and ``batch_size − closed_book`` episodes."""

    enabled: bool = True
    length: int = 36  # tokens per example (the models' context)
    entities: int = 24  # each with one memorised attribute
    attributes: int = 16
    noise_tokens: int = 16
    context_facts: int = 6  # facts an episode's document states
    questions: int = 6  # questions after each document
    # How likely a document's fact agrees with memory; a quarter, so that reading the document pays off
    # within the small budget (at one half, no model here learns to copy from it in 300 steps).
    agree_share: float = 0.25
    answerable_share: float = 0.8  # how likely a question asks about an entity the document states
    closed_book: int = 2  # closed-book examples (the facts' training text) per training batch
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 1  # DIFF heads; the other kinds get twice as many of the same width
    steps: int = 300
    batch_size: int = 16
    eval_episodes: int = 64  # held-out episodes; their questions cycle through the three conditions
    # The learning curve: scores before training and after these fractions of the steps (and at the end).
    curve: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])
    recipes: list[str] = field(default_factory=list)  # init recipes (INIT_RECIPES); empty: compare.recipes
    # model name -> its peak lr here under every recipe (from a sweep); a model not named: its retrieval lr
    lr_by_model: dict[str, float] = field(default_factory=dict)
    data_seed: int = 0  # the memorised facts, the training batches and the held-out episodes

    def __post_init__(self) -> None:
        require_finite("grounded", self)
        for name in ("length", "entities", "attributes", "noise_tokens", "context_facts", "questions", "d_model",
                     "n_layers", "n_heads", "steps", "batch_size", "eval_episodes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"grounded.{name} must be positive, got {getattr(self, name)}")
        for name in ("agree_share", "answerable_share"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"grounded.{name} must lie in (0, 1) (every condition occurs in training), "
                                  f"got {getattr(self, name)}")
        if not 0 <= self.closed_book < self.batch_size:
            raise ConfigError(f"grounded.closed_book must be in [0, batch_size={self.batch_size}), "
                              f"got {self.closed_book}")
        if self.eval_episodes * self.questions < 3:
            raise ConfigError(f"grounded: eval_episodes × questions = {self.eval_episodes * self.questions} held-out "
                              "questions; at least 3 are needed, one for each condition")
        if any(not 0.0 < f <= 1.0 for f in self.curve):
            raise ConfigError(f"grounded.curve: fractions of the steps in (0, 1], got {self.curve}")
        unknown = [r for r in self.recipes if r not in INIT_RECIPES]
        if unknown:
            raise ConfigError(f"grounded.recipes: no init recipe {unknown[0]!r}; choose from {', '.join(INIT_RECIPES)}")
        if len(set(self.recipes)) != len(self.recipes):
            raise ConfigError(f"grounded.recipes names a recipe twice: {self.recipes}")
        check_learning_rates("grounded.lr_by_model", self.lr_by_model)
        require_seeds("grounded", self, ("data_seed",))
        try:
            GroundedTask(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GroundedTask)})
        except ValueError as exc:
            raise ConfigError(f"grounded: {exc}") from None

    @property
    def task(self) -> GroundedTask:
        """The generated examples' vocabulary and sizes (diff_transformer.data.synthetic)."""
        return GroundedTask(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GroundedTask)})

    @property
    def curve_steps(self) -> list[int]:
        return curve_steps(self.steps, self.curve)

    def model_config(self, attention: str, *, diff_heads: bool = False, **fields: Any) -> ModelConfig:
        """The grounded model of one attention kind (:func:`small_model_config`)."""
        return small_model_config(self, self.task.vocab_size, attention, diff_heads=diff_heads, **fields)


@dataclass
class LongContextConfig:
    """The long-context experiment of ``compare`` (the ``long_context`` section; absent = off): every
    model trained at ``data.seq_len`` (the config's own runs), then extended (``run.init_from``) to
    ``seq_len`` tokens with RoPE θ ``rope_theta``; position-NLL up to the new context, and the
    retrieval models of the ``retrieval`` section tested at longer lengths before and after their own
    extension. See :mod:`diff_transformer.experiments.long_context`."""

    enabled: bool = True
    # The language models' extension: model.max_seq_len and data.seq_len, RoPE θ, budget and schedule.
    seq_len: int = 1024
    rope_theta: float = 226_000.0  # 10,000 × (1,024 / 128)^1.5, as the paper grows θ with the length
    steps: int = 16
    batch_size: int = 4  # sequences of seq_len tokens per step
    warmup_steps: int = 2
    lr: dict[str, float] = field(default_factory=dict)  # model name -> its extension peak lr; absent: its own lr
    lr_grid: list[float] = field(default_factory=list)  # every model extended at each; reported at its best
    eval_sequences: int = 16  # validation windows of seq_len tokens (the extension's lr is chosen on them)
    # Extension data: windows inside documents (data.within_documents), long documents optionally up-sampled.
    within_documents: bool = True
    long_document_tokens: int | None = None
    long_document_weight: float = 1.0
    position_nll_windows: int = 16  # held-out windows of seq_len tokens, within documents
    # The retrieval models (trained at retrieval.length): tested at these lengths before and after being
    # extended to retrieval_seq_len tokens with θ retrieval_rope_theta.
    retrieval_lengths: list[int] = field(default_factory=lambda: [48, 96, 192])
    retrieval_seq_len: int = 96
    retrieval_rope_theta: float = 28_000.0  # 10,000 × (96 / 48)^1.5
    retrieval_steps: int = 150
    retrieval_lr: dict[str, float] = field(default_factory=dict)  # model name -> extension lr; absent: its retrieval lr
    retrieval_lr_grid: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("seq_len", "steps", "batch_size", "eval_sequences", "position_nll_windows", "retrieval_seq_len",
                     "retrieval_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"long_context.{name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.rope_theta <= 0 or self.retrieval_rope_theta <= 0:
            raise ConfigError("long_context: need warmup_steps >= 0, rope_theta > 0 and retrieval_rope_theta > 0")
        for where, lrs in (("lr", self.lr.values()), ("lr_grid", self.lr_grid),
                           ("retrieval_lr", self.retrieval_lr.values()), ("retrieval_lr_grid", self.retrieval_lr_grid)):
            if any(lr <= 0 for lr in lrs):
                raise ConfigError(f"long_context.{where}: learning rates must be positive, got {list(lrs)}")
        if not self.retrieval_lengths or min(self.retrieval_lengths) <= 0:
            raise ConfigError(f"long_context.retrieval_lengths must be positive lengths, got {self.retrieval_lengths}")
        try:
            DataConfig(within_documents=self.within_documents, long_document_tokens=self.long_document_tokens,
                       long_document_weight=self.long_document_weight)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("data.", "long_context.")) from None


@dataclass
class CompareConfig:
    """What ``diff-transformer compare`` trains by default."""

    models: list[str] = field(default_factory=list)  # model names; empty = every model of the config
    seeds: int = 1  # training seeds per model: run.seed, run.seed + 1, ...
    # Peak learning rates every model is trained with (min_lr keeps its ratio to lr); each model is
    # reported at its own best (lowest mean final validation loss). Empty = each model's own lr only.
    lr_grid: list[float] = field(default_factory=list)
    # Evaluations of the suite run on every seed's language model (names: diff-transformer eval --help).
    evaluations: list[str] = field(default_factory=lambda: ["outliers", "quantization", "ar-hit", "position-nll",
                                                            "icl"])
    # Options of those evaluations over their defaults, e.g. {outliers: {tokens: 4096}} (diff-transformer eval --help).
    evaluation_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The models the evaluations run on (names); empty = every model of the comparison.
    evaluation_models: list[str] = field(default_factory=list)
    # Why the budget is what it is (steps, seeds, sizes), printed under the report's first paragraph.
    budget_note: str = ""
    # Init recipes (INIT_RECIPES) searched beside the learning rate: every model is trained under each,
    # reported at its best (recipe, lr) and, recipe by recipe, in the sensitivity table. Empty = every
    # model as its config entry sets it (no recipe dimension).
    recipes: list[str] = field(default_factory=list)
    # The recipes of the language-model runs, where they are fewer than the retrieval experiment's
    # (the expensive part); empty = compare.recipes.
    lm_recipes: list[str] = field(default_factory=list)
    # Runs trained at the same time (language-model runs as processes, retrieval runs in a process pool),
    # each with cores / jobs CPU threads.
    jobs: int = 1
    # A model's language-model peak lr under an init recipe where it differs from its own optim.lr:
    # {recipe: {model name: peak lr}} (from a sweep; --lr-grid searches instead).
    lr_by_recipe: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require_finite("compare", self)
        if self.seeds <= 0:
            raise ConfigError(f"compare.seeds must be positive, got {self.seeds}")
        if self.jobs <= 0:
            raise ConfigError(f"compare.jobs must be positive, got {self.jobs}")
        for where, recipes in (("recipes", self.recipes), ("lm_recipes", self.lm_recipes)):
            unknown = [r for r in recipes if r not in INIT_RECIPES]
            if unknown:
                raise ConfigError(f"compare.{where}: no init recipe {unknown[0]!r}; "
                                  f"choose from {', '.join(INIT_RECIPES)}")
            if len(set(recipes)) != len(recipes):
                raise ConfigError(f"compare.{where} names a recipe twice: {recipes}")
        if self.lm_recipes and not set(self.lm_recipes) <= set(self.recipes):
            raise ConfigError(f"compare.lm_recipes {self.lm_recipes} must be among compare.recipes {self.recipes}")
        if any(lr <= 0 for lr in self.lr_grid):
            raise ConfigError(f"compare.lr_grid values must be positive, got {self.lr_grid}")
        check_recipe_table("compare.lr_by_recipe", self.lr_by_recipe)

        unknown = [name for name in [*self.evaluations, *self.evaluation_options] if name not in EVALUATIONS]
        if unknown:
            raise ConfigError(f"compare.evaluations: no evaluation {unknown[0]!r}; "
                              f"choose from {', '.join(EVALUATIONS)}")
        for name, overrides in self.evaluation_options.items():
            try:
                evaluation_options(name, overrides)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"compare.evaluation_options.{name}: {exc}") from None

    @property
    def language_model_recipes(self) -> list[str]:
        """The init recipes of the language-model runs: lm_recipes, else recipes."""
        return self.lm_recipes or self.recipes



@dataclass
class ScalingConfig:
    """The scaling study of ``compare`` (the ``scaling`` section; absent = off): every model of the
    comparison at every size of ``sizes`` and every budget of ``budgets``, each at its own best lr
    at each size; the loss against size and tokens, the fitted laws, DIFF − Transformer along size
    and the matching fraction (the paper's Figure 3). See :mod:`diff_transformer.experiments.scaling`."""

    enabled: bool = True
    # The model shapes, smallest first: name -> ModelConfig fields over the models' own (d_model,
    # n_layers, n_heads, ...), or a preset (with fields over it). n_heads counts DIFF heads, as the
    # presets do: the kinds of ordinary heads get twice as many of the same width, the matched
    # Transformer of each size.
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The token axis: fractions of run.steps (the largest budget, 1.0), each trained as its own run
    # with its own schedule; at the sizes of budget_sizes (empty: every size), the others at 1.0 only.
    budgets: list[float] = field(default_factory=lambda: [1.0])
    budget_sizes: list[str] = field(default_factory=list)
    # Peak learning rates every model is trained at, at every size (min_lr keeps its ratio); each model
    # reported at its own best at each size. lr_grid_by_size: another grid at a size. Empty: its own lr.
    lr_grid: list[float] = field(default_factory=list)
    lr_grid_by_size: dict[str, list[float]] = field(default_factory=dict)
    # Where a model's best lr is the smallest or the largest of its grid at a size and budget, the study
    # trains one lr further out (the grid's end step again, every seed), up to this many at each end.
    lr_extend: int = 2
    bootstrap_resamples: int = 2000  # the matching fraction's interval: resamples of the parametric bootstrap

    def __post_init__(self) -> None:
        require_finite("scaling", self)
        if self.enabled and len(self.sizes) < 2:
            raise ConfigError(f"scaling.sizes: name two sizes or more (a law needs them), got {list(self.sizes)}")
        for name, fields in self.sizes.items():
            if not isinstance(fields, dict) or not fields:
                raise ConfigError(f"scaling.sizes.{name} must be a mapping of ModelConfig fields, got {fields!r}")
            unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)} - {"preset"})
            if unknown:
                raise ConfigError(f"scaling.sizes.{name}: unknown ModelConfig field {unknown[0]!r}")
            if "preset" in fields and fields["preset"] not in PRESETS:
                raise ConfigError(f"scaling.sizes.{name}.preset: no preset {fields['preset']!r}; choose from "
                                  f"{', '.join(PRESETS)}")
        if not self.budgets or any(not 0 < b <= 1 for b in self.budgets) or 1.0 not in self.budgets:
            raise ConfigError(f"scaling.budgets: fractions of run.steps in (0, 1], with 1.0 among them, "
                              f"got {self.budgets}")
        for where, names in (("budget_sizes", self.budget_sizes), ("lr_grid_by_size", list(self.lr_grid_by_size))):
            unknown = [n for n in names if n not in self.sizes]
            if unknown:
                raise ConfigError(f"scaling.{where}: no size {unknown[0]!r}; the sizes are {', '.join(self.sizes)}")
        for lrs in [self.lr_grid, *self.lr_grid_by_size.values()]:
            if any(not lr > 0 for lr in lrs):
                raise ConfigError(f"scaling: learning rates must be positive, got {lrs}")
        if self.lr_extend < 0:
            raise ConfigError(f"scaling.lr_extend must be 0 or more, got {self.lr_extend}")
        if self.bootstrap_resamples < 100:
            raise ConfigError(f"scaling.bootstrap_resamples must be at least 100, got {self.bootstrap_resamples}")

    def grid(self, size: str) -> list[float]:
        """The learning rates every model is trained at at ``size`` (empty: each model's own)."""
        return list(self.lr_grid_by_size.get(size, self.lr_grid))

    def budget_steps(self, steps: int, size: str) -> list[int]:
        """The training steps of each budget at ``size``, the largest last."""
        fractions = self.budgets if not self.budget_sizes or size in self.budget_sizes else [1.0]
        return sorted({max(1, round(f * steps)) for f in fractions})


# The evaluations of the suite the conversion study reads as its retrieval measurement (convert.retrieval).
CONVERSION_RETRIEVAL = ("ar-hit", "mqar")
CONTINUED = "continued"  # the conversion study's arm of the Transformer trained on from its own weights
# The conversion study's fine-tuned models (its arms): the Transformer continued, DIFF by each init, DIFF V2.
CONVERSION_ARMS = (CONTINUED, *INITS, "diff_v2")


@dataclass
class ConvertConfig:
    """The conversion study of ``compare`` (the ``convert`` section; absent = off): the Transformer
    ``source_model`` (trained here for run.steps, one per seed, or read from ``source``) converted to
    DIFF by each of ``inits`` (and exactly to DIFF V2 with ``diff_v2``); the Transformer continued and
    every conversion fine-tuned for ``steps`` on the same data, each at its own best lr of
    ``lr_grid`` (empty: ``lr_by_model``'s, a pilot's best, else the source's); for reference
    ``scratch_model`` trained from scratch on as many tokens as the source and the fine-tuning together.
    See :mod:`diff_transformer.experiments.conversion`."""

    enabled: bool = True
    source_model: str = "standard"  # the model entry that describes the source (a Transformer)
    # A checkpoint of this project or a transformers LlamaForCausalLM directory: the source of every
    # seed. None: the study trains one source per seed (run.steps of the config's data and optim).
    source: str | None = None
    source_tokens: int | None = None  # a given source's pretraining tokens (the from-scratch reference's share)
    # The tokenizer a given source was trained with, where the source holds none (a tokenizers JSON
    # file, "default" or "bytes"): it must be data.dataset's. None: the source's own.
    source_tokenizer: str | None = None
    steps: int = 32  # fine-tuning steps of data.batch_size × data.seq_len tokens
    warmup_steps: int = 4  # the fine-tuning's warmup (a fresh optimizer and schedule)
    eval_every: int = 4  # fine-tuning steps between evaluations: the resolution of the recovery curve
    inits: list[str] = field(default_factory=lambda: ["exact", "split"])  # convert --to diff --init ...
    diff_v2: bool = True  # also convert --to diff_v2 (exact)
    lr_grid: list[float] = field(default_factory=list)  # every fine-tuned model at each; empty: lr_by_model
    # arm (CONVERSION_ARMS) -> its one fine-tuning lr where lr_grid is empty (a pilot's best); else the source's
    lr_by_model: dict[str, float] = field(default_factory=dict)
    scratch_model: str | None = "diff"  # the model entry trained from scratch for reference; None: none
    scratch_lr_grid: list[float] = field(default_factory=list)  # empty: the scratch model's own lr
    # The fine-tuning's data order; the source is trained with run.data_seed, so another seed reads
    # the corpus in another order rather than the source's first batches again.
    data_seed: int = 1
    retrieval: str = "ar-hit"  # the suite's evaluation run before and after (CONVERSION_RETRIEVAL)
    retrieval_options: dict[str, Any] = field(default_factory=dict)  # its options over its defaults

    def __post_init__(self) -> None:
        require_finite("convert", self)
        for name in ("steps", "eval_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"convert.{name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"convert.warmup_steps must not be negative, got {self.warmup_steps}")
        if self.source_tokens is not None and self.source_tokens <= 0:
            raise ConfigError(f"convert.source_tokens must be positive, got {self.source_tokens}")
        if self.source is not None and not self.source.strip():
            raise ConfigError("convert.source must be a directory path, or null (the study trains the source)")
        if self.source_tokenizer is not None and self.source is None:
            raise ConfigError("convert.source_tokenizer names the tokenizer of a given convert.source; the study "
                              "trains its sources with data.dataset's: leave it unset (null)")
        unknown = [init for init in self.inits if init not in INITS]
        if unknown:
            raise ConfigError(f"convert.inits: no init {unknown[0]!r}; choose from {', '.join(INITS)}")
        if len(set(self.inits)) != len(self.inits):
            raise ConfigError(f"convert.inits names an init twice: {self.inits}")
        if not self.inits and not self.diff_v2:
            raise ConfigError("convert: nothing to convert; name convert.inits or set convert.diff_v2: true")
        for where, lrs in (("lr_grid", self.lr_grid), ("scratch_lr_grid", self.scratch_lr_grid)):
            if any(not lr > 0 for lr in lrs):
                raise ConfigError(f"convert.{where}: learning rates must be positive, got {lrs}")
        unknown = [name for name in self.lr_by_model if name not in CONVERSION_ARMS]
        if unknown:
            raise ConfigError(f"convert.lr_by_model: no fine-tuned model {unknown[0]!r}; choose from "
                              f"{', '.join(CONVERSION_ARMS)}")
        check_learning_rates("convert.lr_by_model", self.lr_by_model)
        require_seeds("convert", self, ("data_seed",))
        if self.retrieval not in CONVERSION_RETRIEVAL:
            raise ConfigError(f"convert.retrieval must be one of {', '.join(CONVERSION_RETRIEVAL)}, "
                              f"got {self.retrieval!r}")
        try:
            evaluation_options(self.retrieval, self.retrieval_options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"convert.retrieval_options: {exc}") from None

    def check_models(self, train: TrainConfig) -> None:
        """A ConfigError unless the models named exist, the source converts by every init asked, and
        the budgets and data orders fit together."""
        for where, name in (("source_model", self.source_model), ("scratch_model", self.scratch_model)):
            if name is not None and name not in train.models:
                raise ConfigError(f"convert.{where}: no model named {name!r}; the config has {', '.join(train.models)}")
        source = train.model(self.source_model).model_config()
        conversions = [("diff", init) for init in self.inits] + ([("diff_v2", "exact")] if self.diff_v2 else [])
        for to, init in conversions:
            try:
                converted_config(source, to, init)
            except ConversionError as exc:
                raise ConfigError(f"convert: models.{self.source_model} --to {to} --init {init}: {exc}") from None
        if self.source is None and self.data_seed == train.run.data_seed:
            raise ConfigError(f"convert.data_seed={self.data_seed} is run.data_seed, the source's: the fine-tuning "
                              "would read the source's own first batches again; choose another seed")
        if self.source is not None and self.scratch_model is not None and self.source_tokens is None:
            raise ConfigError("convert.scratch_model: the from-scratch reference trains on the source's tokens plus "
                              "the fine-tuning's; set convert.source_tokens (the given source's pretraining tokens) "
                              "or convert.scratch_model: null")


# The families a pretrained model belongs to (pretrained.models.NAME.family): the study reports every
# DIFF-family model against every Transformer.
DIFF_FAMILY, TRANSFORMER_FAMILY = "DIFF family", "Transformer"
FAMILIES = (DIFF_FAMILY, TRANSFORMER_FAMILY)


@dataclass
class PretrainedModel:
    """One given model of the pretrained-models study: a checkpoint of this project (trained here,
    converted, or imported with ``import-hf``) and the family it belongs to."""

    checkpoint: str
    family: str
    label: str | None = None  # how the report names it; None: its name in pretrained.models


@dataclass
class PretrainedConfig:
    """The pretrained-models study of ``compare`` (the ``pretrained`` section; absent = off): no
    training; compare.evaluations run on every model of ``models`` with the same texts, every
    effect reported as DIFF family − Transformer. See :mod:`diff_transformer.experiments.pretrained`."""

    enabled: bool = True
    models: dict[str, PretrainedModel] = field(default_factory=dict)  # name -> its checkpoint and family
    # The held-out text every model reads (each tokenising it itself): "default" (the embedded corpus'
    # validation documents), a prepared dataset (its validation documents, decoded with its tokenizer),
    # or what `prepare` reads (a text file, a JSON Lines file of {text_field: ...} records, a folder).
    texts: str = "default"
    text_field: str = "text"
    max_chars: int = 4_000_000  # the text read, at most (the documents in order, the last one cut)
    # The context every model is read at, in its own tokens (the evaluations' windows and documents);
    # None: the shortest of the models' own contexts. Longer than a model's own is refused.
    seq_len: int | None = None
    device: str = "auto"  # "auto" (cuda if available), "cpu" or "cuda"

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        for name, entry in self.models.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
                raise ConfigError(f"pretrained.models.{name}: a model's name is a file name of the study's output "
                                  "(letters, digits, '.', '_', '-'); give a label for anything else")
            if not entry.checkpoint.strip():
                raise ConfigError(f"pretrained.models.{name}.checkpoint must be a checkpoint directory")
            if entry.family not in FAMILIES:
                raise ConfigError(f"pretrained.models.{name}.family must be one of {', '.join(map(repr, FAMILIES))}, "
                                  f"got {entry.family!r}")
        families = {entry.family for entry in self.models.values()}
        if set(FAMILIES) - families:
            given = ", ".join(f"{name} ({entry.family})" for name, entry in self.models.items()) or "none"
            raise ConfigError(f"pretrained.models: the study compares the families {' and '.join(FAMILIES)}: give at "
                              f"least one model of each (got {given})")
        labels = [entry.label or name for name, entry in self.models.items()]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"pretrained.models: two models have the same label ({', '.join(labels)})")
        if not self.texts.strip():
            raise ConfigError("pretrained.texts must be 'default' or a path")
        for name in ("max_chars", "seq_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"pretrained.{name} must be positive, got {value}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"pretrained.device must be one of auto, cpu, cuda, got {self.device!r}")

    def label(self, name: str) -> str:
        """How reports name model ``name``."""
        return self.models[name].label or name


def check_learning_rates(where: str, table: dict[str, float]) -> None:
    """A ConfigError naming the first learning rate of ``table`` that is not positive."""
    for name, lr in table.items():
        if not lr > 0:
            raise ConfigError(f"{where}.{name} must be a positive learning rate, got {lr}")


def check_recipe_table(where: str, table: dict[str, dict[str, float]]) -> None:
    """{recipe: {model: lr}}: every recipe an init recipe, every lr positive."""
    for recipe, lrs in table.items():
        if recipe not in INIT_RECIPES:
            raise ConfigError(f"{where}.{recipe}: no such init recipe; choose from {', '.join(INIT_RECIPES)}")
        check_learning_rates(f"{where}.{recipe}", lrs)


def recipe_fields(entry: ModelEntry, recipe: str | None) -> dict[str, Any]:
    """A model entry's ModelConfig fields under init recipe ``recipe`` (None: as configured). An
    entry that sets a field the recipe sets, to another value, is a ConfigError naming both."""
    if recipe is None:
        return dict(entry.fields)
    for key, value in INIT_RECIPES[recipe].items():
        if key in entry.fields and entry.fields[key] != value:
            raise ConfigError(f"models.{entry.name}.{key}={entry.fields[key]} disagrees with init recipe {recipe!r} "
                              f"({key}={value}), which compare.recipes applies to every model: remove "
                              f"{key} from the model, or set compare.recipes: [] (each model as configured)")
    return {**entry.fields, **INIT_RECIPES[recipe]}


# The sections this module reads, with the value an absent one takes.
SECTIONS: dict[str, tuple[type, dict[str, Any]]] = {
    "compare": (CompareConfig, {}),
    "retrieval": (RetrievalConfig, {"enabled": False}),
    "grounded": (GroundedConfig, {"enabled": False}),
    "long_context": (LongContextConfig, {"enabled": False}),
    "scaling": (ScalingConfig, {"enabled": False}),
    "convert": (ConvertConfig, {"enabled": False}),
    "pretrained": (PretrainedConfig, {"enabled": False}),
}


@dataclass
class ExperimentConfig:
    """A whole config file: the trainer's part and the experiments' sections."""

    train: TrainConfig
    compare: CompareConfig = field(default_factory=CompareConfig)
    retrieval: RetrievalConfig = field(default_factory=lambda: RetrievalConfig(enabled=False))
    grounded: GroundedConfig = field(default_factory=lambda: GroundedConfig(enabled=False))
    long_context: LongContextConfig = field(default_factory=lambda: LongContextConfig(enabled=False))
    scaling: ScalingConfig = field(default_factory=lambda: ScalingConfig(enabled=False))
    convert: ConvertConfig = field(default_factory=lambda: ConvertConfig(enabled=False))
    pretrained: PretrainedConfig = field(default_factory=lambda: PretrainedConfig(enabled=False))

    def __post_init__(self) -> None:
        studies = [name for name in ("long_context", "scaling", "convert", "pretrained") if getattr(self, name).enabled]
        if len(studies) > 1:
            raise ConfigError(f"{' and '.join(studies)}: a config runs one study; remove all but one of the sections")
        if studies and self.train.run.budget is not None:
            # these studies set their runs' lengths in steps themselves (scaling.budgets, long_context.steps, ...)
            raise ConfigError(f"run.budget: the {studies[0]} study counts its runs' lengths in steps (run.steps and "
                              f"its {studies[0]} section); a budget in {self.train.run.budget.kind} applies to the "
                              "side-by-side comparison only: unset run.budget (null)")
        if self.convert.enabled:
            self.convert.check_models(self.train)
        names = self.train.models
        tables = {
            "compare.models": self.compare.models,
            "compare.evaluation_models": self.compare.evaluation_models,
            "long_context.lr": self.long_context.lr,
            "long_context.retrieval_lr": self.long_context.retrieval_lr,
            "retrieval.lr_by_model": self.retrieval.lr_by_model,
            "grounded.lr_by_model": self.grounded.lr_by_model,
            **{f"compare.lr_by_recipe.{r}": lrs for r, lrs in self.compare.lr_by_recipe.items()},
            **{f"retrieval.lr_by_recipe.{r}": lrs for r, lrs in self.retrieval.lr_by_recipe.items()},
        }
        for where, named in tables.items():
            unknown = [name for name in named if name not in names]
            if unknown:
                raise ConfigError(f"{where}: no model named {unknown[0]!r}; the config has {', '.join(names)}")
        for entry in names.values():
            pinned = sorted({key for recipe in INIT_RECIPES.values() for key in recipe} & set(entry.small_model))
            if pinned:
                raise ConfigError(f"models.{entry.name}.small_model.{pinned[0]}: an init recipe sets it for every "
                                  f"model (compare.recipes); set it on the model itself, where the recipes check it")
            if entry.paper_row is not None and entry.paper_row not in PAPER_TABLE6:
                raise ConfigError(f"models.{entry.name}.paper_row must be one of {', '.join(PAPER_TABLE6)}, "
                                  f"got {entry.paper_row!r}")

    @property
    def name(self) -> str:
        return self.train.name

    def model_name(self, name: str) -> str:
        """How reports name model ``name``: its label, else its name."""
        return self.train.model(name).display_name

    def attention(self, name: str) -> str:
        return self.train.model(name).attention

    def entry_fields(self, name: str, recipe: str | None) -> dict[str, Any]:
        """Model ``name``'s ModelConfig fields under init recipe ``recipe`` (:func:`recipe_fields`)."""
        return recipe_fields(self.train.model(name), recipe)

    def lr_for(self, name: str, recipe: str | None, task: str = "lm") -> float:
        """Model ``name``'s peak learning rate under ``recipe`` for ``task`` ("lm", "retrieval" or
        "grounded"): the section's lr_by_recipe entry, else its own (its optim.lr; retrieval.lr_by_model),
        else the section's (retrieval.lr). The grounded task: grounded.lr_by_model's entry, else the
        model's retrieval lr."""
        if task == "grounded":
            own = self.grounded.lr_by_model.get(name)
            return own if own is not None else self.lr_for(name, recipe, "retrieval")
        section = self.compare if task == "lm" else self.retrieval
        own = section.lr_by_recipe.get(recipe, {}).get(name) if recipe else None
        if own is not None:
            return own
        if task == "lm":
            return self.train.optim_for(name).lr
        return self.retrieval.lr_by_model.get(name, self.retrieval.lr)

    def retrieval_optim(self, lr: float, steps: int | None = None, warmup_steps: int | None = None) -> OptimConfig:
        """The optimizer of a retrieval run at peak ``lr``: the config's optim section (betas, eps,
        clipping, the min_lr / lr ratio) with the retrieval section's warmup and weight decay."""
        base = self.train.optim
        return dataclasses.replace(base, recipe=None, lr=lr, min_lr=lr * base.min_lr / base.lr,
                                   warmup_steps=self.retrieval.warmup_steps if warmup_steps is None else warmup_steps,
                                   weight_decay=self.retrieval.weight_decay)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :func:`experiment_from_dict` reads back (written beside every comparison)."""
        out = self.train.to_dict()
        for section in SECTIONS:
            out[section] = dataclasses.asdict(getattr(self, section))
        return out


def experiment_from_dict(data: dict[str, Any], source: str | None = None) -> ExperimentConfig:
    """An ExperimentConfig from plain data (a parsed YAML file); every key is checked."""
    train = config_from_dict(data, source)
    sections = {name: section_from_dict(cls, data.get(name, absent), name) for name, (cls, absent) in SECTIONS.items()}
    return ExperimentConfig(train=train, **sections)


def load_experiment(name_or_path: str | Path = "tiny", overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML config (a path or a shipped name) with ``key=value`` overrides: the whole file."""
    return read_config_data(name_or_path, overrides, experiment_from_dict)
