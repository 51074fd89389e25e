"""The evaluation registry entry and its options: each field of an ``Options`` dataclass becomes one
command-line flag.

An evaluation module defines ``SPEC = Evaluation(...)``: its name, the paper figure it
reproduces, an ``Options`` dataclass (each field one ``--flag``, its help in the field metadata,
``Options.quick()`` a small budget for tests), ``run(model, options, text) -> dict`` for one
model, ``plot(results, options, path)`` and ``report(results, options) -> Markdown`` for all models.
"""

from __future__ import annotations

import argparse
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


def _flag_type(f: dataclasses.Field) -> tuple[Callable[[str], Any], bool]:
    """(element type, takes several values) of an option field."""
    explicit = f.metadata.get("type")
    default = f.default
    if isinstance(default, tuple):
        return explicit or (type(default[0]) if default else str), True
    if explicit:
        return explicit, f.metadata.get("nargs") == "+"
    if default is None:
        raise TypeError(f"option {f.name}: give metadata type= for a None default")
    return type(default), False


def _flag_parser(f: dataclasses.Field, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """The argument type of a number flag: an int is at least 1 (0 for a ``seed``) and a float at
    least 0, unless the field's metadata gives ``minimum`` / ``maximum``; a field whose metadata
    gives ``check`` (a function raising ValueError) has each value checked by it."""
    check = f.metadata.get("check")
    if check is not None:
        import argparse

        def checked(value: str):
            converted = kind(value)
            try:
                check(converted)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{value!r} is not valid ({exc})") from None
            return converted

        checked.__name__ = getattr(kind, "__name__", "value")
        return checked
    if kind not in (int, float):
        return kind
    from ..cli.args import bounded

    default_minimum = (0 if f.name == "seed" else 1) if kind is int else 0.0
    return bounded(kind, f.metadata.get("minimum", default_minimum), f.metadata.get("maximum"))


def add_option_flags(parser, options_type: type) -> None:
    """One ``--flag`` per field of the ``options_type`` dataclass; numbers are range-checked
    (see :func:`_flag_parser`) so a bad value is refused before any model loads."""
    for f in dataclasses.fields(options_type):
        flag = "--" + f.name.replace("_", "-")
        kind, several = _flag_type(f)
        kind = _flag_parser(f, kind)
        shown = f.default if not isinstance(f.default, tuple) else " ".join(map(str, f.default))
        help_text = f.metadata.get("help", "") + (f" (default: {shown})" if shown not in ("", ()) else "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=kind, nargs="+" if several else None, default=None, help=help_text,
                                metavar=f.name.upper(), choices=f.metadata.get("choices"))


def options_from_flags(options_type: type, args: Any, base: Any = None) -> Any:
    """``base`` (default: the type's defaults) with every flag the user gave applied."""
    options = base if base is not None else options_type()
    given = {}
    for f in dataclasses.fields(options_type):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(options, **given)


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
