"""The one check of values read from a user's file (a transformers config.json of every family read by
``import-hf``, a results or metrics JSON, a record of a JSON Lines file): each field's JSON type (a
number, not the string "64"; a boolean, not "false"), its range, and sizes no run on any machine
would use, refused with the figure, before any work. Every refusal is an :class:`InputError` naming
the file and the field, the value and what is needed, in one line.

A reader states its fields once, as a table of :class:`Field` (``LLAMA_FIELDS`` in interop.hf), and
calls :func:`check_fields`; a lone value goes through :func:`integer`, :func:`number` or
:func:`boolean`. Light on purpose (no numpy, no torch), as :mod:`diff_transformer.user_text`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .user_text import InputError

# Sizes beyond any model or run this project (or a released model) has, by orders of magnitude: a value
# past one is a typo or a damaged file, and taking it would run for hours or fill the memory first.
MAX_LAYERS = 1_000
MAX_WIDTH = 1 << 20  # hidden sizes, MLP widths, heads, head widths
MAX_VOCAB = 1 << 24
MAX_SEQ_LEN = 1 << 22  # 4M tokens: a position table, a context
MAX_STEPS = 10**9  # optimizer steps of one run


def shown(value: Any) -> str:
    """A JSON value as a refusal quotes it: ``'64' (a string)``, ``null``, ``true (a boolean)``, ``1e+30``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, str):
        return f"{value[:40]!r}{'...' if len(value) > 40 else ''} (a string)"
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    return repr(value)


def _refuse(where: str, field: str, value: Any, needed: str) -> InputError:
    return InputError(f"{where}: {field} is {shown(value)}; {needed}")


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" from {low:,} to {high:,}"
    if low is not None:
        return f" of at least {low:,}"
    return f" of at most {high:,}" if high is not None else ""


def integer(value: Any, field: str, where: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is a JSON integer (not a boolean, string or float) within [minimum, maximum]."""
    needed = f"an integer{_range(minimum, maximum)} is needed"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(where, field, value, needed)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _refuse(where, field, value, needed)
    return value


def number(value: Any, field: str, where: str, *, minimum: float | None = None, maximum: float | None = None,
           positive: bool = False) -> float:
    """``value`` as a float if it is a finite JSON number (not a boolean or string) within [minimum,
    maximum], and greater than 0 where ``positive``."""
    needed = f"a finite {'positive ' if positive else ''}number{_range(minimum, maximum)} is needed"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(where, field, value, needed)
    if ((positive and value <= 0) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise _refuse(where, field, value, needed)
    return float(value)


def boolean(value: Any, field: str, where: str) -> bool:
    """``value`` if it is a JSON boolean (true or false; not the string "false", not 0)."""
    if not isinstance(value, bool):
        raise _refuse(where, field, value, "true or false is needed")
    return value


def string(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise _refuse(where, field, value, "a string is needed")
    return value


@dataclass(frozen=True)
class Field:
    """One field of a file: its kind ("int", "number", "bool", "str"), its range, and whether null
    stands for "absent" (the reader's default)."""

    kind: str
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False
    nullable: bool = False


def check_fields(data: Mapping[str, Any], fields: Mapping[str, Field], where: str) -> None:
    """Every field of ``fields`` that ``data`` holds checked by :func:`integer`, :func:`number`,
    :func:`boolean` or :func:`string`; fields absent, and null where ``nullable``, are left to the
    reader's defaults. The first bad one is an InputError naming ``where`` and the field."""
    for name, field in fields.items():
        if name not in data or (data[name] is None and field.nullable):
            continue
        value = data[name]
        if field.kind == "int":
            integer(value, name, where, minimum=field.minimum, maximum=field.maximum)
        elif field.kind == "number":
            number(value, name, where, minimum=field.minimum, maximum=field.maximum, positive=field.positive)
        elif field.kind == "bool":
            boolean(value, name, where)
        else:
            string(value, name, where)


def few(names: list[str], shown_at_most: int = 3) -> str:
    """A list as one short phrase: the first few and how many more, never thousands of names."""
    more = len(names) - shown_at_most
    return ", ".join(names[:shown_at_most]) + (f" and {more:,} more" if more > 0 else "")
