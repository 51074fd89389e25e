"""Small statistics for the reports: the noise of a difference of means, binomial standard errors,
a mean that skips missing values, and seeded random generators."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any


def difference_noise(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    """Two standard errors of mean(b[key]) − mean(a[key]) from per-window values.

    ``a[key]``, ``b[key]`` are per-window lists (None where a window has no value). Paired
    (window by window) when both results carry the same ``windows`` fingerprint, else unpaired.
    """
    xs, ys = a[key], b[key]
    if a.get("windows_fingerprint") is not None and a.get("windows_fingerprint") == b.get("windows_fingerprint"):
        diffs = [y - x for x, y in zip(xs, ys) if x is not None and y is not None]
        return 2 * math.sqrt(_variance(diffs) / len(diffs)) if len(diffs) > 1 else 0.0
    xs, ys = [x for x in xs if x is not None], [y for y in ys if y is not None]
    if len(xs) < 2 or len(ys) < 2:
        return 0.0
    return 2 * math.sqrt(_variance(xs) / len(xs) + _variance(ys) / len(ys))


def _variance(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def seeded_rng(*parts: Any) -> random.Random:
    """A ``random.Random`` seeded from the parts (deterministic across runs and platforms)."""
    return random.Random("/".join(str(p) for p in parts))


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n items."""
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


def mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")
