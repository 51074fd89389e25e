"""The project's statistics, in one module: the noise of a difference of means over windows, binomial
standard errors, a mean that skips missing values, seeded random generators; over seeds, the mean ±
std of a figure and Welch's interval of a difference; the area under the ROC curve with its
bootstrap interval. Quantiles, the Mann–Whitney statistic and the bootstrap come from SciPy. (The
scaling laws, their fit and intervals: :mod:`diff_transformer.evaluation.scaling`.)"""

from __future__ import annotations

import math
import random
import statistics
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


def decimals(*values: float | None, at_least: int = 3, significant: int = 2, at_most: int = 10) -> int:
    """Decimal places that show every nonzero finite value of ``values`` to ``significant`` significant
    figures, and at least ``at_least``: a difference and its noise printed with them show the verdict
    drawn from them (never "-0.000 ± 0.000: lower")."""
    places = at_least
    for value in values:
        if value is not None and math.isfinite(value) and value != 0:
            places = max(places, significant - 1 - math.floor(math.log10(abs(value))))
    return min(places, at_most)


def seeded_rng(*parts: Any) -> random.Random:
    """A ``random.Random`` seeded from the parts (deterministic across runs and platforms)."""
    return random.Random("/".join(str(p) for p in parts))


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n items."""
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


def mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


# --- over seeds: the spread of a figure, the interval of a difference ----------------------------------


@dataclass(frozen=True)
class MeanStd:
    """A figure over seeds: its mean, its sample standard deviation (None below two values) and the
    per-seed values (empty: no value, mean None)."""

    mean: float | None
    std: float | None
    per_seed: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> "MeanStd":
        values = tuple(values)
        return cls(statistics.fmean(values) if values else None,
                   statistics.stdev(values) if len(values) > 1 else None, values)


@dataclass(frozen=True)
class Difference:
    """mean(ours) − mean(base) and its 95% interval [low, high] (None with fewer than two values a side)."""

    delta: float
    low: float | None = None
    high: float | None = None

    @property
    def sign(self) -> int | None:
        """+1 / −1 when the interval excludes zero on that side, 0 when it holds zero, None without one."""
        if self.low is None or self.high is None:
            return None
        return 1 if self.low > 0 else -1 if self.high < 0 else 0


def t_quantile(df: float, level: float = 0.95) -> float:
    """The two-sided ``level`` quantile of Student's t with ``df`` (> 0, not necessarily whole)
    degrees of freedom: 12.706 at df 1, 2.776 at df 4, 1.960 as df grows."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Student's ``level`` interval of the mean of ``values`` (mean ± t·s/√n on n − 1 degrees of
    freedom); None with fewer than two values, a point when they do not vary."""
    if len(values) < 2:
        return None
    center = statistics.fmean(values)
    half = t_quantile(len(values) - 1, level) * statistics.stdev(values) / math.sqrt(len(values))
    return center - half, center + half


def welch_difference(ours: Sequence[float], base: Sequence[float], level: float = 0.95) -> Difference:
    """mean(ours) − mean(base) with Welch's ``level`` interval (unequal variances; the
    Welch–Satterthwaite degrees of freedom); no interval with fewer than two values a side, a point
    interval when neither side varies."""
    delta = statistics.fmean(ours) - statistics.fmean(base)
    if len(ours) < 2 or len(base) < 2:
        return Difference(delta)
    va, vb = statistics.variance(ours) / len(ours), statistics.variance(base) / len(base)
    if va + vb == 0:
        return Difference(delta, delta, delta)
    df = (va + vb) ** 2 / (va**2 / (len(ours) - 1) + vb**2 / (len(base) - 1))
    half = t_quantile(df, level) * math.sqrt(va + vb)
    return Difference(delta, delta - half, delta + half)


# --- separating two groups by a score -------------------------------------------------------------------


def auroc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """The area under the ROC curve of a score that should be higher for ``positives``: the
    probability that a positive outscores a negative, ties counting one half (the Mann–Whitney U of
    the positives over n₊·n₋, scipy.stats.mannwhitneyu). None when a group is empty."""
    from scipy.stats import mannwhitneyu

    if len(positives) == 0 or len(negatives) == 0:
        return None
    u = mannwhitneyu(positives, negatives, method="asymptotic").statistic
    return float(u) / (len(positives) * len(negatives))


def auroc_interval(positives: Sequence[float], negatives: Sequence[float], *, resamples: int = 2000,
                   level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """The percentile ``level`` bootstrap interval of :func:`auroc`, positives and negatives resampled
    apart (stratified: every resample keeps both groups' sizes; scipy.stats.bootstrap). None when a
    group has fewer than two values."""
    import numpy as np
    from scipy.stats import DegenerateDataWarning, bootstrap, mannwhitneyu

    if len(positives) < 2 or len(negatives) < 2:
        return None
    n = len(positives) * len(negatives)

    def area(pos, neg, axis=-1):
        return mannwhitneyu(pos, neg, axis=axis, method="asymptotic").statistic / n

    with warnings.catch_warnings():  # scores that do not vary give a point interval, not a fault
        warnings.simplefilter("ignore", DegenerateDataWarning)
        result = bootstrap((np.asarray(positives, dtype=np.float64), np.asarray(negatives, dtype=np.float64)), area,
                           n_resamples=resamples, confidence_level=level, method="percentile", vectorized=True,
                           paired=False, random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
