"""The pretrained-models study: ``diff-transformer compare --config pretrained``.

No training. The paper's evaluations that apply to a pretrained language model (compare.evaluations:
needle retrieval at several lengths and depths, attention to the answer against noise, activation
outliers and massive activations, the attention sink, NLL by position, quantised attention logits)
run on given checkpoints of this project (trained here, converted, or imported with ``import-hf``),
each labelled with its family (pretrained.models.NAME.family: "DIFF family" or "Transformer"), on
the same text, and every effect is reported as DIFF family − Transformer for every pair of a
DIFF-family model and a Transformer. On the engine's runner:

1. **Checks, before any work** (:func:`check_study`): every checkpoint's config, weights (from the
   safetensors header: every tensor of the right name and shape) and tokenizer; its family against
   its attention kind; the context every model is read at (pretrained.seq_len, at most each one's
   own) against what each evaluation needs; the text, read once: each tokenizer must encode every
   document back to the same characters, into enough tokens for every evaluation.
2. **Measurement**: one :class:`~.runner.PoolJob` per model: the model loaded at that context,
   every evaluation run on it with the same text (each model tokenises the characters itself),
   its results saved as OUT/models/<name>.json (``--resume`` reuses those measured from the same
   checkpoint file, evaluations, options, context and text); then OUT/eval/NAME.json and NAME.png
   per evaluation, as ``diff-transformer eval`` writes them.
3. **Effects** (:data:`EFFECTS`): each evaluation's figure per unit (a window of text, a needle
   document, a cloze item); per model the mean over its units with Student's 95% interval; per pair
   the difference of the means with its 95% interval over units: paired, unit by unit (Student's
   interval of the differences), when both models tokenise the text into the same tokens (then
   they read the same windows and documents), else Welch's interval. The verdict, in the words of
   the other studies' claims: *agrees* / *contradicts* the paper when the interval excludes zero
   (*DIFF family better* / *worse* where the paper has no figure), else *inconclusive*; over
   several pairs, the same word for every pair or what it *depends on*.

Different tokenizers: the text is the same characters for every model, and lengths (contexts,
windows, needle documents) are counted in each model's own tokens. Figures per token (NLL, the loss
added by quantisation) are compared per byte: a window's mean per token times the model's tokens
per UTF-8 byte of the whole text (one end-of-text token per document counted).

What it cannot say: the models differ in more than attention (their data, tokenizer, size, recipe,
context), so an effect is between two whole models; and the intervals cover the choice of text only
(each model is one trained instance: nothing here says how another training run would differ).

The output directory:

    OUT/report.md, OUT/metrics.json, OUT/config.yaml
    OUT/models/<name>.json   each model's measurements (what --resume reuses)
    OUT/eval/NAME.json, OUT/eval/NAME.png   each evaluation on every model
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..checkpoint import WEIGHTS_FILE, CheckpointError, load_checkpoint_tokenizer, read_config
from ..config import ConfigError
from ..data.inputs import scan_documents
from ..data.synthetic import build_needle_example
from ..evaluation.models import BASELINE, DIFF_KINDS, load_model
from ..evaluation.needle import parse_setting
from ..evaluation.options import options_dict
from ..evaluation.stats import Difference, mean_interval, seeded_rng, welch_difference
from ..evaluation.suite import EVALUATIONS, SuiteResult, evaluation_options, measure, write_evaluation
from ..evaluation.texts import EvalText, corpus_validation_texts, first_chars
from ..files import project_output_kind
from ..paper import HALLUCINATION_TABLE4, OUTLIERS_TABLE5
from ..train.state import weights_problem
from .claims import table3
from .config import DIFF_FAMILY, TRANSFORMER_FAMILY, ExperimentConfig, PretrainedConfig
from .language_models import Machine
from .output import check_study_output, open_study
from .report import budget_lines, heading_lines, interval_text, write_study
from .runner import PoolJob, run_jobs
from .study import RunKey

FAMILY_KINDS = {DIFF_FAMILY: DIFF_KINDS, TRANSFORMER_FAMILY: (BASELINE,)}  # the attention kinds of each family


# --- the effects: what each evaluation's result says per unit --------------------------------------


@dataclass(frozen=True)
class Effect:
    """One figure of one evaluation, read per unit off a model's result, and how the paper reads it:
    the sign of DIFF − Transformer it found (0: no figure; the verdict then says which is better)."""

    evaluation: str
    claim: str
    measure: str
    better: str  # "lower" or "higher"
    unit: str  # what one value is: "window", "document", "cloze item"
    paper: str
    paper_sign: int
    values: Callable[[dict], list[float | None]]  # the model's figure per unit, from its result
    per_byte: bool = False  # a figure per token, compared per byte (times the model's tokens per byte)
    floor: float | None = None  # not testable when no model's mean is above it (every model at zero)


def _outlier_paper(key: str) -> str:
    t5 = OUTLIERS_TABLE5
    top1, median = 0, t5["columns"].index("median")
    ratio = {kind: t5[key][kind][top1] / t5[key][kind][median] for kind in ("diff", "standard")}
    return f"{ratio['diff'] - ratio['standard']:+.0f} (Table 5: top-1 / median over 0.4M tokens)"


def _to_median(key: str) -> Callable[[dict], list[float | None]]:
    """Each window's largest |value| of ``key`` over the model's median |value| (its scale)."""
    def values(result: dict) -> list[float | None]:
        stats = result[key]
        median = stats["median"]
        return [top / median if median else None for top in stats["per_window_top1"]]
    return values


def _massive(result: dict) -> list[float | None]:
    """Each window's largest, over layers, of the layer's top |hidden state| over its median."""
    stats = result["hidden_states"]
    medians = stats["per_layer_median"]
    out = []
    for window in stats["per_window_layer_top1"]:
        ratios = [top / median for top, median in zip(window, medians) if median]
        out.append(max(ratios) if ratios else None)
    return out


def _quantization_rows(result: dict) -> tuple[dict, dict]:
    """The full-precision row and the fewest-bit row of a quantization result."""
    rows = result["results"]
    full = next(row for row in rows if row["bits"] is None)
    fewest = min((row for row in rows if row["bits"] is not None), key=lambda row: row["bits"])
    return full, fewest


def _loss_added(result: dict) -> list[float | None]:
    full, fewest = _quantization_rows(result)
    return [q - f for f, q in zip(full["per_window_loss"], fewest["per_window_loss"])]


def _cloze_lost(result: dict) -> list[float | None]:
    full, fewest = _quantization_rows(result)
    return [f - q for f, q in zip(full["cloze_correct"], fewest["cloze_correct"])]


EFFECTS: list[Effect] = [
    Effect("needle", "Key-information retrieval", "multi-needle exact match: a document's share of its queries "
           "answered, every cell (N:R, depth, length)", "higher", "document", "+0.30 at N=6, R=2 (4K, Table 2)", +1,
           lambda r: r["per_document"], floor=0.05),
    Effect("attention-noise", "Attention to the answer", "share of the answer rows' attention on the answer span, "
           "mean over layers", "higher", "document", table3("answer"), +1,
           lambda r: r["per_document"]["answer"]),
    Effect("attention-noise", "Attention noise", "share of the answer rows' attention on the rest of the haystack, "
           "mean over layers", "lower", "document", table3("noise"), -1,
           lambda r: r["per_document"]["noise"]),
    Effect("outliers", "Activation outliers", "a window's top-1 |attention logit| over the model's median",
           "lower", "window", _outlier_paper("attention_logits"), -1, _to_median("attention_logits")),
    Effect("outliers", "Activation outliers", "a window's top-1 |hidden state| over the model's median",
           "lower", "window", _outlier_paper("hidden_states"), -1, _to_median("hidden_states")),
    Effect("outliers", "Massive activations", "a window's largest layer ratio: a layer's top-1 |hidden state| over "
           "that layer's median (Sun et al. 2024)", "lower", "window", "no figure (Table 5 is over all layers)", 0,
           _massive),
    Effect("attention-sink", "Attention sink", "share of attention on the first token, mean over layers (queries "
           "from the second on)", "lower", "window", "no figure (gated attention, Qiu et al. 2025: ~0.47 → ~0.05)", 0,
           lambda r: r["per_window"]["mean_over_layers"]),
    Effect("position-nll", "Language modelling", "held-out NLL over the whole context, nats per byte", "lower",
           "window", "lower NLL at every position (Fig. 4)", -1, lambda r: r["per_window"], per_byte=True),
    Effect("quantization", "Quantisation", "held-out NLL added by the fewest-bit attention logits, nats per byte",
           "lower", "window", "DIFF degrades less (Fig. 8)", -1, _loss_added, per_byte=True),
    Effect("quantization", "Quantisation", "cloze accuracy lost going to the fewest-bit attention logits", "lower",
           "cloze item", "DIFF loses ~25 points less at 4 bits (Fig. 8)", -1, _cloze_lost),
    Effect("context-qa", "Contextual hallucination", "a question's greedy answer from its context matches an answer "
           "(normalised exact match; no judge)", "higher", "question",
           f"{HALLUCINATION_TABLE4['range']} accuracy (Table 4, GPT-4o-judged)", +1,
           lambda r: [float(a["exact_match"]) for a in r["answers"]]),
]
"""Every effect the report gives, in order; an evaluation of compare.evaluations without one here
still runs and has its section in the report. A new evaluation joins with an entry: the figure
per unit read off its result JSON, as context-qa's per question."""


# What an evaluation needs of the context every model is read at (``seq_len``) and of the text, in a
# model's own tokens: (context, text), from its options; an evaluation not named here checks itself
# as it runs (a model it cannot run on is reported as such).
NEEDS: dict[str, Callable[[Any, int], tuple[int, int]]] = {
    "needle": lambda o, n: (max(o.lengths or (n,)), 4 * max(o.lengths or (n,))),
    "attention-noise": lambda o, n: (o.length or n, 4 * (o.length or n)),
    "outliers": lambda o, n: (o.seq_len or n, math.ceil(o.tokens / (o.seq_len or n)) * ((o.seq_len or n) + 1)),
    "attention-sink": lambda o, n: (o.seq_len or n, o.windows * ((o.seq_len or n) + 1)),
    "position-nll": lambda o, n: (n, o.windows * (n + 1)),
    "quantization": lambda o, n: (n, max(o.loss_windows * (n + 1), 4 * n)),
}


# The needle documents an evaluation builds, (N needles, R queries, length, digits), which must fit
# in their length with every model's tokenizer (the shortest of each setting is tried).
DOCUMENTS: dict[str, Callable[[Any, int], list[tuple[int, int, int, int]]]] = {
    "needle": lambda o, n: [(*parse_setting(s), max(o.lengths or (n,)), o.digits) for s in o.settings]
    + [(*parse_setting(o.heatmap), min(o.lengths or (n // 2,)), o.digits)],
    "attention-noise": lambda o, n: [(o.needles, o.queries, o.length or n, o.digits)],
}
ROOM_TRIALS = 8  # needle documents drawn per setting to see that it fits (their cities and numbers vary)


def needle_room_problem(tokenizer, needles: int, queries: int, length: int, digits: int) -> str | None:
    """Why needle documents of ``needles`` needles and ``queries`` queries do not fit in ``length``
    tokens of ``tokenizer`` (a few drawn, with any filler), or None."""
    for trial in range(ROOM_TRIALS):
        try:
            build_needle_example(seeded_rng("needle-room", trial), tokenizer, lambda rng, k: [tokenizer.eos_id] * k,
                                 length=length, n_needles=needles, n_queries=queries, depth=0.5, digits=digits)
        except ValueError as exc:
            return str(exc)
    return None


# --- the text --------------------------------------------------------------------------------------


@dataclass
class StudyText:
    """The text every model reads: its documents, where they come from, and a fingerprint."""

    source: str
    documents: list[str]

    @property
    def characters(self) -> int:
        return sum(len(t) for t in self.documents)

    @property
    def bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.documents)

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha1()
        for text in self.documents:
            digest.update(text.encode("utf-8") + b"\0")
        return digest.hexdigest()[:12]


def read_texts(settings: PretrainedConfig) -> StudyText:
    """pretrained.texts read: the embedded corpus' validation documents ("default"), a prepared
    dataset's validation documents (decoded with its own tokenizer), or what ``prepare`` reads;
    at most pretrained.max_chars characters. A ConfigError names what cannot be read."""
    where, limit = settings.texts, settings.max_chars
    if where == "default":
        return StudyText("the embedded corpus' validation documents", first_chars(corpus_validation_texts(), limit))
    path = Path(where)
    if not path.exists():
        raise ConfigError(f"pretrained.texts: {where} does not exist (give 'default', a prepared dataset, or text "
                          "files `prepare` reads)")
    try:
        if project_output_kind(path) == "dataset":
            return StudyText(f"the validation documents of the prepared dataset {where}",
                             first_chars(_dataset_documents(path), limit))
        documents = scan_documents([path], settings.text_field)
        count = f"{len(documents):,} document{'s' if len(documents) > 1 else ''}"
        return StudyText(f"{where} ({count})", first_chars(documents.texts(), limit))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"pretrained.texts: {exc}") from None


def _dataset_documents(directory: Path):
    """A prepared dataset's validation documents as text, one at a time (its end-of-text tokens dropped)."""
    from ..data import TokenShards
    from ..tokenizer import load_tokenizer

    shards = TokenShards(directory, "val")
    if shards.document_ends is None or not shards.num_tokens:
        raise ValueError(f"{directory}: no validation documents to read (an empty split, or a dataset prepared "
                         "before document boundaries were recorded: prepare it again)")
    tokenizer = load_tokenizer(directory)
    start = 0
    for end in shards.document_ends.tolist():
        yield tokenizer.decode(shards.tokens[start : end - 1].tolist())
        start = end


def first_difference(tokenizer, text: str) -> str | None:
    """Where ``tokenizer`` does not give ``text`` back (decode ∘ encode), in words, or None."""
    back = tokenizer.decode(tokenizer.encode(text))
    if back == text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    return f"character {at} {text[at:at + 12]!r} comes back as {back[at:at + 12]!r}"


# --- the checks ------------------------------------------------------------------------------------


@dataclass
class GivenModel:
    """A model of the study as the checks found it."""

    name: str
    label: str
    family: str
    checkpoint: str
    attention: str
    parameters: int
    context: int  # its own max_seq_len
    tokenizer: str  # "BPETokenizer of 8,192 tokens"


def check_model(config: ExperimentConfig, name: str) -> tuple[GivenModel, Any]:
    """Model ``name``'s checkpoint, from its files alone (no weights read): (what it is, its tokenizer),
    or a ConfigError naming the model and what is wrong."""
    settings = config.pretrained
    entry = settings.models[name]
    where = f"pretrained.models.{name}.checkpoint"
    path = Path(entry.checkpoint)
    if not path.is_dir():
        raise ConfigError(f"{where}: {entry.checkpoint} does not exist or is not a directory (a checkpoint of this "
                          "project: import a transformers directory with `diff-transformer import-hf DIR OUT`, or "
                          f"give another with --set {where}=DIR)")
    try:
        model_config, _ = read_config(path)
        tokenizer = load_checkpoint_tokenizer(path, model_config.vocab_size)
    except (CheckpointError, ValueError, OSError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    problem = weights_problem(path / WEIGHTS_FILE, model_config)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    if tokenizer is None:
        raise ConfigError(f"{where}: {entry.checkpoint} holds no tokenizer; every model reads the text itself, so each "
                          "needs its own (import-hf without --no-tokenizer)")
    kinds = FAMILY_KINDS[entry.family]
    if model_config.attention not in kinds:
        raise ConfigError(f"pretrained.models.{name}.family: {entry.family!r}, but {entry.checkpoint} holds a model of "
                          f"attention {model_config.attention!r} (the family's kinds: {', '.join(kinds)})")
    from ..model import LanguageModel

    parameters = LanguageModel(model_config, device="meta").num_parameters()
    described = GivenModel(name, settings.label(name), entry.family, entry.checkpoint, model_config.attention,
                           parameters, model_config.max_seq_len,
                           f"{type(tokenizer).__name__} of {tokenizer.vocab_size:,} tokens")
    return described, tokenizer


def study_options(config: ExperimentConfig) -> dict[str, Any]:
    """The options of every evaluation of compare.evaluations (its defaults under compare.evaluation_options)."""
    try:
        return {name: evaluation_options(name, config.compare.evaluation_options.get(name))
                for name in config.compare.evaluations}
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"compare.evaluation_options: {exc}") from None


@dataclass
class StudyPlan:
    """What the checks established: the models, the context they are read at, the evaluations and
    their options, the text."""

    models: list[GivenModel]
    seq_len: int
    options: dict[str, Any]
    text: StudyText
    text_tokens: dict[str, int]  # per model: the tokens of the text (an end-of-text per document)
    streams: dict[str, str]  # per model: a fingerprint of its token stream (equal: the same units)


def check_study(config: ExperimentConfig) -> StudyPlan:
    """Every check before any work (see the module docstring); a ConfigError names the first failure."""
    settings = config.pretrained
    if not config.compare.evaluations:
        raise ConfigError("compare.evaluations: the pretrained-models study runs evaluations; name at least one "
                          f"({', '.join(EVALUATIONS)})")
    checked = [check_model(config, name) for name in settings.models]
    models = [model for model, _ in checked]
    seq_len = settings.seq_len or min(model.context for model in models)
    short = [f"{m.name} ({m.context:,})" for m in models if m.context < seq_len]
    if short:
        raise ConfigError(f"pretrained.seq_len={seq_len:,} is longer than the context of {', '.join(short)}: set "
                          "pretrained.seq_len to at most the shortest model's context")
    options = study_options(config)
    needs = {name: NEEDS[name](options[name], seq_len) for name in options if name in NEEDS}
    for name, (context, _) in needs.items():
        if context > seq_len:
            raise ConfigError(f"compare.evaluation_options.{name}: {context:,} tokens of context, longer than the "
                              f"{seq_len:,} every model is read at (pretrained.seq_len)")
    text = read_texts(settings)
    if not text.documents or not any(t.strip() for t in text.documents):
        raise ConfigError(f"pretrained.texts: {settings.texts} holds no text")
    text_tokens, streams = {}, {}
    reader = EvalText(text.documents)  # the stream each model's evaluations read: documents and end-of-text tokens
    for model, tokenizer in checked:
        for i, document in enumerate(text.documents):
            problem = first_difference(tokenizer, document)
            if problem is not None:
                raise ConfigError(f"pretrained.texts: the tokenizer of {model.name} ({model.tokenizer}) does not "
                                  f"give document {i} of {text.source} back: {problem}")
        stream = reader.stream(tokenizer, 0)
        text_tokens[model.name] = len(stream)
        streams[model.name] = hashlib.sha1(stream.numpy().tobytes() + b"%d" % tokenizer.vocab_size).hexdigest()[:12]
        for name in (n for n in options if n in DOCUMENTS):
            for needles, queries, length, digits in DOCUMENTS[name](options[name], seq_len):
                problem = needle_room_problem(tokenizer, needles, queries, length, digits)
                if problem is not None:
                    raise ConfigError(f"compare.evaluation_options.{name}: for {model.name} ({model.tokenizer}), "
                                      f"{problem} (lengths count each model's own tokens: give longer ones)")
        for name, (_, tokens) in needs.items():
            if len(stream) < tokens:
                raise ConfigError(f"pretrained.texts: {text.source} is {len(stream):,} tokens for {model.name}; "
                                  f"{name} needs {tokens:,} with its options (give more text, or lower its budget "
                                  f"with --set compare.evaluation_options.{name}...)")
    return StudyPlan(models, seq_len, options, text, text_tokens, streams)


# --- the measurement: one job per model --------------------------------------------------------------


@dataclass
class ModelMeasurement:
    """One model's results of every evaluation (by name), those it could not run (why), the seconds
    each took, and what was asked (``asked``: --resume reuses only the same)."""

    name: str
    asked: dict[str, Any]
    results: dict[str, dict]
    errors: dict[str, str]
    seconds: dict[str, float]
    device: str


def asked_of(plan: StudyPlan, model: GivenModel) -> dict[str, Any]:
    """What a model's measurement depends on, as plain data: its checkpoint's weights file (path,
    size, modification time), the evaluations and their options, the context, the text."""
    weights = Path(model.checkpoint) / WEIGHTS_FILE
    stat = weights.stat()
    asked = {"checkpoint": str(Path(model.checkpoint).resolve()), "weights": [stat.st_size, stat.st_mtime_ns],
             "label": model.label, "seq_len": plan.seq_len, "text": plan.text.fingerprint,
             "evaluations": {name: options_dict(options) for name, options in plan.options.items()}}
    return json.loads(json.dumps(asked))  # as it reads back from JSON


def measure_model(name: str, label: str, checkpoint: str, options: dict[str, Any], documents: list[str],
                  seq_len: int, device: str, asked: dict[str, Any], progress: bool) -> ModelMeasurement:
    """Every evaluation on one model, read at a context of ``seq_len`` tokens, on ``documents``."""
    mut = load_model(checkpoint, device=device, label=label, max_seq_len=seq_len)
    text = EvalText(documents)
    results, errors, seconds = {}, {}, {}
    for evaluation, chosen in options.items():
        result, error, seconds[evaluation] = measure(EVALUATIONS[evaluation], mut, chosen, text, progress=progress)
        if error is None:
            results[evaluation] = result
        else:
            errors[evaluation] = error
    return ModelMeasurement(name, asked, results, errors, seconds, device)


def load_measurement(data: dict, asked: dict[str, Any]) -> ModelMeasurement | None:
    """A saved measurement, if it was made as ``asked`` now (else it is made again)."""
    return ModelMeasurement(**data) if data.get("asked") == asked else None


# --- the effects: per model, per pair ------------------------------------------------------------------


@dataclass
class ModelFigure:
    """One model's figure: the mean over its units with Student's 95% interval (None below two units)."""

    mean: float | None
    low: float | None
    high: float | None
    units: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> "ModelFigure":
        kept = [v for v in values if v is not None]
        if not kept:
            return cls(None, None, None, 0)
        interval = mean_interval(kept)
        return cls(statistics.fmean(kept), *(interval or (None, None)), len(kept))


def unit_difference(ours: Sequence[float | None], base: Sequence[float | None],
                    paired: bool) -> tuple[Difference | None, int]:
    """mean(ours) − mean(base) over units with its 95% interval, and the units it rests on: paired
    (the same units, in order: Student's interval of the unit-by-unit differences, units without a
    value on either side left out) or not (Welch's interval of the two means)."""
    if paired:
        if len(ours) != len(base):
            raise ValueError(f"paired units must match one to one: {len(ours)} against {len(base)}")
        differences = [a - b for a, b in zip(ours, base) if a is not None and b is not None]
        if not differences:
            return None, 0
        interval = mean_interval(differences)
        return Difference(statistics.fmean(differences), *(interval or (None, None))), len(differences)
    a, b = [v for v in ours if v is not None], [v for v in base if v is not None]
    if not a or not b:
        return None, 0
    return welch_difference(a, b), len(a) + len(b)


def effect_word(difference: Difference | None, paper_sign: int, better: str) -> str:
    """agrees / contradicts (the paper's sign), or DIFF family better / worse (no paper figure), when
    the interval excludes zero; else inconclusive."""
    if difference is None or difference.sign is None:
        return "inconclusive (too few units for an interval)"
    if difference.sign == 0:
        return "inconclusive"
    if paper_sign:
        return "agrees" if difference.sign == paper_sign else "contradicts"
    return f"{DIFF_FAMILY} {'better' if (difference.sign > 0) == (better == 'higher') else 'worse'}"


@dataclass
class PairEffect:
    """One effect for one pair: a DIFF-family model − a Transformer."""

    model: str  # labels
    baseline: str
    difference: Difference | None
    paired: bool
    units: int  # the unit pairs (paired), or the units of both models
    verdict: str


@dataclass
class EffectResult:
    """One effect over the study: each model's figure (by label), each pair's difference, the verdict."""

    evaluation: str
    claim: str
    measure: str
    better: str
    unit: str
    paper: str
    paper_sign: int
    figures: dict[str, ModelFigure]
    pairs: list[PairEffect]
    verdict: str
    note: str = ""


def overall_verdict(pairs: Sequence[PairEffect]) -> str:
    """The pairs' word when they share it, else what it depends on."""
    words = {pair.verdict for pair in pairs}
    if len(words) == 1:
        return next(iter(words))
    return "depends on the pair: " + "; ".join(f"{p.verdict} for {p.model} − {p.baseline}" for p in pairs)


def effect_result(effect: Effect, models: Sequence[GivenModel], values: dict[str, list[float | None]],
                  streams: dict[str, str]) -> EffectResult:
    """The effect on the models that have ``values`` (by name, per unit, already per byte where it is
    per token): each one's figure, each DIFF-family model against each Transformer."""
    measured = [m for m in models if m.name in values]
    figures = {m.label: ModelFigure.of(values[m.name]) for m in measured}
    means = [f.mean for f in figures.values() if f.mean is not None]
    testable = effect.floor is None or any(m > effect.floor for m in means)
    pairs = []
    for ours in (m for m in measured if m.family == DIFF_FAMILY):
        for base in (m for m in measured if m.family == TRANSFORMER_FAMILY):
            paired = streams[ours.name] == streams[base.name] and len(values[ours.name]) == len(values[base.name])
            difference, units = unit_difference(values[ours.name], values[base.name], paired)
            word = effect_word(difference, effect.paper_sign, effect.better) if testable else "not testable here"
            pairs.append(PairEffect(ours.label, base.label, difference, paired, units, word))
    note = "" if testable else f"every model at or below {effect.floor:g}"
    return EffectResult(effect.evaluation, effect.claim, effect.measure, effect.better, effect.unit, effect.paper,
                        effect.paper_sign, figures, pairs, overall_verdict(pairs) if pairs else "no pair measured",
                        note)


def study_effects(plan: StudyPlan, measurements: dict[str, ModelMeasurement]) -> list[EffectResult]:
    """Every effect of :data:`EFFECTS` whose evaluation ran, on the models it ran on."""
    out = []
    for effect in EFFECTS:
        if effect.evaluation not in plan.options:
            continue
        values = {}
        for model in plan.models:
            result = measurements[model.name].results.get(effect.evaluation)
            if result is None:
                continue
            scale = plan.text_tokens[model.name] / plan.text.bytes if effect.per_byte else 1.0
            values[model.name] = [None if v is None or not math.isfinite(v) else v * scale
                                  for v in effect.values(result)]
        out.append(effect_result(effect, plan.models, values, plan.streams))
    return out


# --- the study ---------------------------------------------------------------------------------------


@dataclass
class ModelRow:
    """A model as the report's first table shows it."""

    name: str
    label: str
    family: str
    attention: str
    parameters: int
    context: int
    tokenizer: str
    text_tokens: int
    tokens_per_byte: float
    checkpoint: str


@dataclass
class PretrainedMetrics:
    """Everything the pretrained-models report shows (metrics.json is its JSON)."""

    config: str
    description: str
    budget_note: str
    models: list[ModelRow]
    seq_len: int
    text_source: str
    text_documents: int
    text_characters: int
    text_bytes: int
    evaluations: dict[str, dict[str, Any]]  # name -> its options
    effects: list[EffectResult]
    not_run: dict[str, dict[str, str]]  # evaluation -> model label -> why
    machine: Machine
    wall_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    seconds_by_model: dict[str, float] = field(default_factory=dict)
    load_average: tuple[float, float, float] | None = None


def study_device(settings: PretrainedConfig) -> str:
    if settings.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("pretrained.device=cuda, but no CUDA device is available here")
    return settings.device


def run_pretrained(config: ExperimentConfig, out_dir: Path, *, resume: bool = False, overwrite: bool = False,
                   jobs: int = 1, progress: bool = True) -> PretrainedMetrics:
    """The whole study into ``out_dir`` (see the module docstring); returns its metrics (also
    OUT/metrics.json). A folder holding a study is continued only with ``resume`` (the same study)
    and replaced only with ``overwrite``, as every study's (experiments.output.open_study)."""
    start = time.perf_counter()
    settings = config.pretrained
    device = study_device(settings)
    reading = [m.checkpoint for m in settings.models.values()] + ([] if settings.texts == "default"
                                                                    else [settings.texts])
    record = {"name": config.name, "description": config.train.description,
              "compare": {"jobs": jobs, "evaluations": list(config.compare.evaluations),
                          "evaluation_options": config.compare.evaluation_options,
                          "budget_note": config.compare.budget_note},
              "pretrained": config.to_dict()["pretrained"]}
    check_study_output(out_dir, record, resume=resume, overwrite=overwrite, reading=reading)
    plan = check_study(config)  # before anything is created
    with open_study(out_dir, record, resume=resume, overwrite=overwrite, reading=reading, progress=progress):
        seconds = {"checks": time.perf_counter() - start}

        mark = time.perf_counter()
        pool = []
        for model in plan.models:
            asked = asked_of(plan, model)
            pool.append(PoolJob(RunKey(model.name, 0, 0.0), model.label, out_dir / "models" / f"{model.name}.json",
                                measure_model, (model.name, model.label, model.checkpoint, plan.options,
                                                plan.text.documents, plan.seq_len, device, asked,
                                                progress and jobs == 1),
                                partial(load_measurement, asked=asked)))

        def describe(job: PoolJob, measured: ModelMeasurement) -> str:
            failed = "".join(f"; {name} not run: {why}" for name, why in measured.errors.items())
            return (f"{job.label}: {len(measured.results)} evaluations in {sum(measured.seconds.values()):.0f} s"
                    + failed)

        done = run_jobs(pool, resume=resume, at_once=jobs, progress=progress, describe=describe)
        measurements = {key.model: measured for key, measured in done.items()}
        seconds["measurement"] = time.perf_counter() - mark

        mark = time.perf_counter()
        suite = write_evaluations(plan, measurements, out_dir / "eval", reading)
        effects = study_effects(plan, measurements)
        rows = [ModelRow(m.name, m.label, m.family, m.attention, m.parameters, m.context, m.tokenizer,
                         plan.text_tokens[m.name], plan.text_tokens[m.name] / plan.text.bytes, m.checkpoint)
                for m in plan.models]
        not_run = {name: {m.label: measurements[m.name].errors[name] for m in plan.models
                          if name in measurements[m.name].errors} for name in plan.options}
        metrics = PretrainedMetrics(
            config.name, config.train.description, config.compare.budget_note, rows, plan.seq_len, plan.text.source,
            len(plan.text.documents), plan.text.characters, plan.text.bytes,
            {name: options_dict(options) for name, options in plan.options.items()}, effects,
            {name: why for name, why in not_run.items() if why}, Machine.of(device, 1, jobs),
            seconds_by_model={m.label: sum(measurements[m.name].seconds.values()) for m in plan.models})
        seconds["report"] = time.perf_counter() - mark
        metrics.wall_seconds = time.perf_counter() - start
        metrics.phase_seconds = seconds
        metrics.load_average = os.getloadavg() if hasattr(os, "getloadavg") else None
        write_study(out_dir, metrics, render_report(metrics), suite, intro=EVALUATIONS_INTRO)
        return metrics


def write_evaluations(plan: StudyPlan, measurements: dict[str, ModelMeasurement], out_dir: Path,
                      reading: Sequence[str]) -> SuiteResult:
    """OUT/eval/NAME.json and NAME.png of every evaluation on every model, and their report sections."""
    suite = SuiteResult()
    for name, options in plan.options.items():
        spec = EVALUATIONS[name]
        found = [(m.label, measurements[m.name]) for m in plan.models]
        results = {label: measured.results[name] for label, measured in found if name in measured.results}
        errors = {label: measured.errors[name] for label, measured in found if name in measured.errors}
        seconds = {label: measured.seconds[name] for label, measured in found}
        data, section, files = write_evaluation(spec, options, results, errors, seconds, out_dir, reading)
        suite.data[name], suite.sections[name] = data, section
        suite.files += files
        if results:
            suite.images[name] = files[1]
    return suite


# --- the report ------------------------------------------------------------------------------------------


def figure_text(figure: ModelFigure | None) -> str:
    """"0.123 [0.101, 0.145]", the mean alone below two units, – without a value."""
    if figure is None or figure.mean is None:
        return "–"
    text = f"{figure.mean:.4g}"
    return text + (f" [{figure.low:.4g}, {figure.high:.4g}]" if figure.low is not None else "")


EVALUATIONS_INTRO = ("## The evaluations\n\nEach evaluation's own report on every model (its figures beside the "
                     "paper's, which come from models trained alike at 1.4B to 3B parameters). JSON and plots: eval/; "
                     "each model's measurements: models/.")


def render_report(metrics: PretrainedMetrics) -> str:
    """report.md: the models, the effects (DIFF family − Transformer), each model's figures, how to
    read them; the evaluations' own sections follow (appended by :func:`~.report.write_study`)."""
    env, load = metrics.machine, metrics.load_average
    lines = heading_lines(f"Pretrained models side by side: {metrics.config}", metrics.description)
    lines += [
        f"No training: {len(metrics.evaluations)} evaluations ({', '.join(metrics.evaluations)}) on "
        f"{len(metrics.models)} given models, every one reading the same text, {metrics.text_source} "
        f"({metrics.text_documents:,} documents, {metrics.text_characters:,} characters, {metrics.text_bytes:,} "
        f"UTF-8 bytes), each tokenising it itself, at a context of {metrics.seq_len:,} of its own tokens. "
        f"Wall time {metrics.wall_seconds / 60:.1f} min ("
        + ", ".join(f"{what} {sec / 60:.1f}" for what, sec in metrics.phase_seconds.items()) + " min; per model "
        + ", ".join(f"{label} {sec / 60:.1f}" for label, sec in metrics.seconds_by_model.items()) + " min)"
        + (f", load average at the end {load[0]:.1f} on {env.cpu_count} cores" if load else "")
        + f"; device {env.device}, torch {env.torch}.",
        "",
        *budget_lines(metrics.budget_note),
        "**The models differ in more than attention**: in their training data, tokenizer, size, recipe and "
        "context, as the table shows, and each is one trained instance. An effect below is the difference between "
        "two whole models on this text, not the effect of differential attention alone, which only models trained "
        "alike can show (`diff-transformer compare`).",
        "",
        "| Model | Family | Attention | Parameters | Own context | Tokenizer | Tokens of the text | Tokens per byte |",
        "|---|---|---|---:|---:|---|---:|---:|",
    ]
    for m in metrics.models:
        lines.append(f"| {m.label} | {m.family} | {m.attention} | {m.parameters:,} | {m.context:,} | {m.tokenizer} | "
                     f"{m.text_tokens:,} | {m.tokens_per_byte:.3f} |")
    lines += ["", *effect_lines(metrics), *figure_lines(metrics), *reading_lines(metrics)]
    return "\n".join(lines)


def effect_lines(metrics: PretrainedMetrics) -> list[str]:
    lines = [
        "## The effects: DIFF family − Transformer",
        "",
        "Each evaluation's figure is measured per unit (a window of the text, a needle document, a cloze item); a "
        "model's figure is the mean over its units, and the difference of two models' means has a 95% interval "
        "over units: the unit is what the interval treats as the independent draws, so it covers the choice of "
        "text, not the training of the models. Two models whose tokenizers turn the text into the same tokens read "
        "the same units: their difference is paired, unit by unit (Student's interval of the differences); "
        "otherwise the units differ and Welch's interval compares the means. Per-token figures are per byte: a "
        "window's mean per token times the model's tokens per byte of the whole text. Verdict: **agrees** or "
        "**contradicts** the paper when the interval excludes zero (**DIFF family better** or **worse** where the "
        "paper has no figure), else **inconclusive**; with several pairs, the word they share, or what it **depends "
        "on**.",
        "",
        "| Claim | Measure (better) | Paper | DIFF family − Transformer | Units | DIFF family | Transformer | "
        "Difference [95% CI] | Verdict |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for effect in metrics.effects:
        note = f" ({effect.note})" if effect.note else ""
        head = f"| {effect.claim} | {effect.measure} ({effect.better}) | {effect.paper} |"
        for pair in effect.pairs:
            units = f"{pair.units:,} {effect.unit}s{' (paired)' if pair.paired else ''}"
            ours, base = (figure_text(effect.figures.get(label)) for label in (pair.model, pair.baseline))
            lines.append(f"{head} {pair.model} − {pair.baseline} | {units} | {ours} | {base} | "
                         f"{interval_text(pair.difference)} | **{pair.verdict}**{note} |")
            head = "| | | |"
        if len(effect.pairs) > 1:
            lines.append(f"| | | | every pair | | | | | **{effect.verdict}** |")
    if metrics.not_run:
        lines += ["", "Not measured: " + "; ".join(f"{name} on {label} ({why})" for name, by in metrics.not_run.items()
                                                   for label, why in by.items()) + "."]
    return lines + [""]


def figure_lines(metrics: PretrainedMetrics) -> list[str]:
    labels = [m.label for m in metrics.models]
    lines = ["## Each model's figures", "",
             "The mean over units with Student's 95% interval over them (the count of units in the effects table).",
             "", "| Measure (unit) | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for effect in metrics.effects:
        lines.append(f"| {effect.measure} ({effect.unit}) | "
                     + " | ".join(figure_text(effect.figures.get(label)) for label in labels) + " |")
    return lines + [""]


def reading_lines(metrics: PretrainedMetrics) -> list[str]:
    return [
        "## How to read this", "",
        "- The paper's claims compare models trained alike (the same data, tokens, size and recipe) with and without "
        "differential attention. These models were not: a difference here may come from anything that differs "
        "between them, and agreeing with the paper's direction is not evidence for its claim (nor the opposite "
        "against it).",
        "- Lengths are each model's own tokens: with different tokenizers, a context or a window of "
        f"{metrics.seq_len:,} tokens covers different amounts of text (tokens per byte above), and needle documents "
        "of one length hold different fillers. Needle retrieval and attention to the answer ask models to retrieve "
        "from their context zero-shot; models too small for that give no signal (not testable).",
        "- The intervals are over units of one text: another text (another domain, language or length) may give "
        "other figures; they do not cover training randomness (one model per family member).",
        "",
    ]


__all__ = ["EFFECTS", "Effect", "PretrainedMetrics", "check_study", "run_pretrained", "unit_difference"]
