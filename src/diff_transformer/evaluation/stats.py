"""The project's statistics, in one module: the noise of a difference of means over windows, binomial
standard errors, a mean that skips missing values, seeded random generators; over seeds, the mean ±
std of a figure, Welch's interval of a difference, bootstrap intervals; the area under the ROC curve
with its interval; and the power-law fit of the scaling laws. Quantiles, the Mann–Whitney statistic,
bootstrap and least squares come from SciPy."""

from __future__ import annotations

import math
import random
import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
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


def bootstrap_interval(samples: Sequence[Sequence[float]], statistic: Callable[..., float | None], *,
                       resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """The percentile ``level`` interval of ``statistic(*samples)`` when every sample (the seeds of one
    cell) is resampled with replacement, independently (scipy.stats.bootstrap). A resample where the
    statistic is undefined (None, NaN) counts as missing; None when fewer than half are defined."""
    import numpy as np
    from scipy.stats import DegenerateDataWarning, bootstrap

    def finite(*resampled) -> float:
        value = statistic(*resampled)
        return float("nan") if value is None else float(value)

    arrays = [np.asarray(s, dtype=np.float64) for s in samples]
    with warnings.catch_warnings():  # a distribution that does not vary (equal seeds) is a result, not a fault
        warnings.simplefilter("ignore", DegenerateDataWarning)
        result = bootstrap(arrays, finite, n_resamples=resamples, confidence_level=level, method="percentile",
                           vectorized=False, paired=False, random_state=np.random.default_rng(seed))
    values = np.asarray(result.bootstrap_distribution, dtype=np.float64)
    defined = values[np.isfinite(values)]
    if len(defined) < resamples / 2:
        return None
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(defined, [tail, 100 - tail])
    return float(low), float(high)


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


# --- fits ---------------------------------------------------------------------------------------------


@dataclass
class PowerLaw:
    """L(x) = a·x^(−b) + c fitted to ``points`` runs; ``fixed_c`` when c was held at 0."""

    a: float
    b: float
    c: float
    rmse: float
    points: int
    fixed_c: bool = False

    def __call__(self, x: float) -> float:
        return self.a * x ** (-self.b) + self.c

    def inverse(self, loss: float) -> float | None:
        """The x where the law reaches ``loss``; None below its floor c (or for a flat law)."""
        if loss <= self.c or self.a <= 0 or self.b == 0:
            return None
        return ((loss - self.c) / self.a) ** (-1.0 / self.b)


def fit_power_law(x: Iterable[float], loss: Iterable[float]) -> PowerLaw:
    """Least-squares fit of L = a·x^(−b) + c, c in [0, min L) (SciPy's Levenberg–Marquardt, c written
    as min L · sigmoid(s) so that it stays there; started from the log-log line at a few floors, the
    best kept); two distinct x fix c at 0 (a pure power law, the log-log line through them). Needs two
    or more distinct x, every x and L positive."""
    import numpy as np
    from scipy.optimize import least_squares

    xs = np.asarray(list(x), dtype=np.float64)
    ys = np.asarray(list(loss), dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError("x and loss must be two sequences of the same length")
    if np.any(~np.isfinite(xs)) or np.any(~np.isfinite(ys)) or np.any(xs <= 0) or np.any(ys <= 0):
        raise ValueError("x and loss must be positive and finite")
    distinct = len(np.unique(xs))
    if distinct < 2:
        raise ValueError(f"a power law needs at least two distinct x, got {distinct}")
    # x in units of its geometric mean keeps a and b apart (a·x^(−b) = a'·(x/x_ref)^(−b)).
    x_ref = float(np.exp(np.mean(np.log(xs))))
    u = np.log(xs / x_ref)
    top = float(ys.min()) * (1 - 1e-9)

    def as_law(log_a: float, b: float, c: float, fixed_c: bool) -> PowerLaw:
        rmse = float(np.sqrt(np.mean((np.exp(log_a - b * u) + c - ys) ** 2)))
        return PowerLaw(math.exp(log_a) * x_ref**b, b, c, rmse, len(ys), fixed_c)

    def line(c: float) -> tuple[float, float]:
        slope, intercept = np.polyfit(u, np.log(ys - c), 1)
        return float(intercept), float(-slope)

    if distinct == 2:
        return as_law(*line(0.0), 0.0, fixed_c=True)

    def residuals(p: np.ndarray) -> np.ndarray:
        return np.exp(p[0] - p[1] * u) + top / (1 + np.exp(-p[2])) - ys

    best = None
    for share in (0.05, 0.5, 0.9):
        log_a, b = line(share * top)
        fit = least_squares(residuals, [log_a, b, math.log(share / (1 - share))], method="lm",
                            xtol=1e-12, ftol=1e-12, gtol=1e-12)
        if best is None or fit.cost < best.cost:
            best = fit
    log_a, b, s = (float(v) for v in best.x)
    return as_law(log_a, b, top / (1 + math.exp(-s)), fixed_c=False)
