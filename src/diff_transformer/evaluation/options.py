"""The evaluation registry entry and its options (each field of an ``Options`` dataclass is one
command-line flag of ``diff-transformer eval``, built by :mod:`diff_transformer.cli.evaluate`).

An evaluation module defines ``SPEC = Evaluation(...)``: its name, the paper figure it
reproduces, an ``Options`` dataclass (each field one ``--flag``, its help in the field metadata,
``Options.quick()`` a small budget for tests), ``run(model, options, text) -> dict`` for one
model, ``plot(results, options, path)`` and ``report(results, options) -> Markdown`` for all models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .models import ModelUnderTest
from .texts import EvalText


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with a --help text (``metadata["help"]``); tuples are given as lists."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence options")
    return field(default=default, metadata={"help": help, **metadata})


def options_dict(options: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(options).items()}


# --- the evaluation registry entry ---------------------------------------------------------------------


@dataclass
class Evaluation:
    """One evaluation: how to run it on a model, plot and report the results of several models."""

    name: str
    title: str  # what it measures and the paper's figure, e.g. "Multi-needle retrieval (Table 2, Fig. 5)"
    options_type: type
    run: Callable[[ModelUnderTest, Any, EvalText], dict]
    plot: Callable[[dict[str, dict], Any, Path], None]
    report: Callable[[dict[str, dict], Any], str]
