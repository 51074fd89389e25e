"""The typed results of the studies: what a training run and a retrieval run report, the curves they
log, and how results become JSON (metrics.json, each retrieval run's file) and come back.

Everything a report renders is one of these dataclasses (or built of them); :func:`to_json` turns
any of them into plain data, :meth:`RetrievalRun.from_dict`, :meth:`GroundedRun.from_dict` and
:func:`read_training_run` read them back from disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Sequence

from ..train.trainer import METRICS_FILE, SUMMARY_FILE, TrainResult, read_metrics
from .study import RunKey

# --- JSON -------------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """Plain JSON data of a result: dataclasses as objects, tuples as lists, paths as strings, mapping
    keys as strings (a learning rate "0.002"), NaN and inf as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {_json_key(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json_key(key: Any) -> str:
    if key is None:
        return ""
    return f"{key:g}" if isinstance(key, float) else str(key)


def json_text(value: Any) -> str:
    return json.dumps(to_json(value), indent=2) + "\n"


# --- training runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogPoint:
    """One record of a run's metrics.jsonl that the reports read."""

    step: int
    tokens: int
    loss: float | None = None  # "train" (the mean over the logging interval) and "val" records
    lambdas: tuple[float, ...] | None = None  # "diagnostics": λ per layer (DIFF kinds)
    attn_rms: tuple[float, ...] | None = None  # "diagnostics": the attention branch's RMS per layer
    train_seconds: float | None = None  # "train" and "val": the training time spent up to this step


@dataclass
class RunLog:
    """The curves of one training run: its train, val and diagnostics records."""

    train: list[LogPoint] = field(default_factory=list)
    val: list[LogPoint] = field(default_factory=list)
    diagnostics: list[LogPoint] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> "RunLog":
        log = cls()
        for record in read_metrics(path):
            kind = record.get("kind")
            if kind in ("train", "val"):
                getattr(log, kind).append(LogPoint(record["step"], record["tokens"], loss=record["loss"],
                                                   train_seconds=record.get("train_seconds")))
            elif kind == "diagnostics":
                lambdas, rms = record.get("lambda"), record.get("attn_rms")
                log.diagnostics.append(LogPoint(record["step"], record["tokens"],
                                                lambdas=None if lambdas is None else tuple(lambdas),
                                                attn_rms=None if rms is None else tuple(rms)))
        return log


@dataclass
class TrainingRun:
    """A finished (or diverged) run of the trainer: its point of the study, its summary.json, its
    curves and where it lives."""

    key: RunKey
    summary: TrainResult
    log: RunLog
    log_dir: Path

    @property
    def checkpoint_dir(self) -> Path:
        return self.log_dir / "checkpoint"

    @property
    def final_val_loss(self) -> float | None:
        """The final validation loss of a completed run (None: diverged, or not finite)."""
        loss = self.summary.final_val_loss
        if self.summary.status != "completed" or loss is None or not math.isfinite(loss):
            return None
        return loss


def read_summary(log_dir: Path) -> TrainResult | None:
    """A run's summary.json as the trainer wrote it (None if there is none)."""
    path = log_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(TrainResult)}
    return TrainResult(**{k: v for k, v in data.items() if k in known})


def read_training_run(key: RunKey, log_dir: Path) -> TrainingRun | None:
    summary = read_summary(log_dir)
    return None if summary is None else TrainingRun(key, summary, RunLog.read(log_dir / METRICS_FILE), log_dir)


@dataclass
class SeedCurves:
    """A curve over seeds on the steps every seed logged: ``values[seed][point]``."""

    step: list[int]
    tokens: list[int]
    values: list[list[float]]

    def mean(self) -> list[float]:
        return [sum(v) / len(v) for v in zip(*self.values)]


def seed_curves(logs: Sequence[list[LogPoint]], value=lambda p: p.loss) -> SeedCurves:
    """The points every seed's series has (by step), ``value(point)`` per seed."""
    by_seed = [{p.step: p for p in series} for series in logs]
    steps = sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else []
    return SeedCurves(steps, [by_seed[0][s].tokens for s in steps],
                      [[value(seed[s]) for s in steps] for seed in by_seed])


@dataclass
class Diagnostics:
    """λ and the attention branch's RMS per layer over training, every seed: ``[seed][point][layer]``
    (``lambdas`` None for kinds without λ)."""

    step: list[int]
    tokens: list[int]
    lambdas: list[list[list[float]]] | None
    attn_rms: list[list[list[float]]] | None


def diagnostics_of(runs: Sequence[TrainingRun]) -> Diagnostics | None:
    """The runs' diagnostics on the steps all seeds share; None where they logged none."""
    series = [run.log.diagnostics for run in runs]
    lambdas = seed_curves(series, lambda p: p.lambdas)
    if not lambdas.step:
        return None
    rms = seed_curves(series, lambda p: p.attn_rms)
    complete = lambda curves: curves.values if all(v is not None for s in curves.values for v in s) else None  # noqa: E731
    return Diagnostics(lambdas.step, lambdas.tokens, complete(lambdas), complete(rms))


# --- retrieval runs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerShares:
    """Where the answer row of a layer looks, as shares of its sum: on the queried needle, on noise
    and distractors, on the query itself."""

    answer: float
    noise: float
    other: float


@dataclass
class CurvePoint:
    """Accuracy after ``step`` training steps: per task and difficulty cell, and per task's mean."""

    step: int
    accuracy: dict[str, dict[str, float]]
    mean_accuracy: dict[str, float]


@dataclass
class RetrievalRun:
    """One retrieval model trained and measured (experiments.retrieval.run_one)."""

    seed: int
    lr: float
    parameters: int
    train_seconds: float
    train_tokens_per_second: float
    losses: list[float]  # the training loss every 10 steps
    accuracy: dict[str, dict[str, float]]  # task -> cell -> accuracy at the end
    mean_accuracy: dict[str, float]  # task -> mean over its cells
    curve: list[CurvePoint]  # before training and after each of the curve's steps
    curve_area: dict[str, float]  # task -> mean accuracy over training
    attention: list[AnswerShares | None]  # per layer; None where the row sum is too small to divide by
    attention_needles: int  # the needle count of the probe
    quantized_accuracy: dict[str, float]  # "full" / "8" / "6" / "4" -> accuracy on the hardest cells
    flops_per_token: float | None = None  # training FLOPs per token (diff_transformer.flops); None: no term

    @property
    def score(self) -> float:
        """The mean over tasks of the mean accuracy: what the sweep maximises."""
        return sum(self.mean_accuracy.values()) / len(self.mean_accuracy)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RetrievalRun":
        fields = dict(data)
        fields["curve"] = [CurvePoint(**p) for p in data["curve"]]
        fields["attention"] = [None if s is None else AnswerShares(**s) for s in data["attention"]]
        return cls(**fields)


# --- grounded runs (contextual hallucination) -------------------------------------------------------------


@dataclass(frozen=True)
class Outcomes:
    """What the answers to one kind of question were, as shares of its ``count`` questions: the
    document's attribute of the asked entity (``document``), its memorised attribute where that differs
    (``memory``), UNKNOWN, an attribute the document gives another entity (``misattributed``), or
    anything else (``invented``). The five add up to 1."""

    count: int
    document: float
    memory: float
    unknown: float
    misattributed: float
    invented: float


@dataclass(frozen=True)
class GroundedScores:
    """The grounded task's scores on held-out episodes (experiments.grounded.grounded_scores says
    exactly how each is read off the outcomes); ``outcomes`` per condition and for the closed-book
    questions."""

    accuracy: float  # answered as the document warrants: mean over agree, counterfactual, lacking
    faithful: float  # the document's attribute where it states the fact: mean over agree, counterfactual
    prior_override: float  # counterfactual: the memorised attribute, against the document
    fabrication: float  # neither the document's nor the memorised attribute, nor UNKNOWN: mean over conditions
    abstention: float  # lacking: UNKNOWN
    recall: float  # closed book: the memorised attribute (how well the facts were learnt)
    outcomes: dict[str, Outcomes]


@dataclass
class GroundedPoint:
    """The scores after ``step`` training steps, and the mean lookback ratio per layer."""

    step: int
    scores: GroundedScores
    lookback: list[float | None]


@dataclass
class GroundedRun:
    """One grounded model trained and measured (experiments.grounded.run_one)."""

    seed: int
    lr: float
    parameters: int
    train_seconds: float
    train_tokens_per_second: float
    losses: list[float]  # the training loss every 10 steps
    scores: GroundedScores  # at the end
    lookback: list[float | None]  # per layer at the end: the mean over heads and the episodes' questions
    lookback_auroc: list[float | None]  # per layer: how well it separates right answers from wrong ones
    curve: list[GroundedPoint]  # before training and after each of the curve's steps
    flops_per_token: float | None = None  # training FLOPs per token (diff_transformer.flops); None: no term

    @property
    def score(self) -> float:
        """What the sweep maximises: the grounded accuracy."""
        return self.scores.accuracy

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GroundedRun":
        fields = dict(data)
        fields["scores"] = _scores(data["scores"])
        fields["curve"] = [GroundedPoint(p["step"], _scores(p["scores"]), p["lookback"]) for p in data["curve"]]
        return cls(**fields)


def _scores(data: dict[str, Any]) -> GroundedScores:
    return GroundedScores(**{**data, "outcomes": {k: Outcomes(**v) for k, v in data["outcomes"].items()}})
