"""Scaling laws (paper Figure 3): L(x) = a·x^(−b) + c per attention kind, x = non-embedding parameters
or training tokens, and the matching fraction: the x a kind needs to reach the Transformer's loss, over
the Transformer's x. The one definition of both, used by ``diff-transformer eval scaling`` and by the
scaling study (``compare --config scaling``).

Input: cells, one per kind and x, each with its per-seed losses (:class:`Cell`); ``eval scaling`` reads
them from runs {attention, params, tokens, loss, seed} (a JSON list, {"runs": [...]}, the study's
metrics.json or a compare metrics.json) or from checkpoints.

**The fit** is variable projection (Golub & Pereyra; for scaling laws arXiv 2603.22339): for a fixed
floor c and exponent b a kind's coefficient a is linear, a one-column non-negative least squares with a
closed form, so only (c, b) are searched: on a grid of exponents (0.01 to 2, log-spaced) and floors
(0 up to the lowest loss), every kind and every bootstrap resample at once, then refined (the vertex of
the parabola through the best grid point and its neighbours; the reported fit is polished by
``scipy.optimize.minimize``). Cell means are weighted by their seeds. On the parameter axis the kinds
share the floor c: the same data at the same token budget has one irreducible loss, and sharing it
removes one constant per kind that a few sizes cannot identify. On the token axis each kind has its
own: there the floor is the loss of each kind's model trained without end, which differs by kind.

**The noise** of a seed: the pooled standard deviation within cells, or the spread of the fit's
residuals (scaled to one seed) where that is larger: a law that misses the cell means by more than the
seeds' noise widens its intervals (the lack-of-fit F test's p-value is reported). One seed per cell:
the residuals' alone.

**Identification.** A law is flagged when a constant sits at its bound (c at 0 or at the lowest loss,
b at an end of its range, a at 0: no fall with x) or when its exponent is not identified: the profile
of the fit error over b (every other constant refitted at each b) stays within F(1, df)·σ² of its
minimum up to an end of the searched range — the data cannot tell that b from a flat or a vertical
law. A fraction read from a flagged law is "not identified at this range", with the reason.

**The matching fraction** at a Transformer x: the kind's x where its law reaches the Transformer's law
there, over that x (each kind on its own x). Read at each measured Transformer x (the readings), and
summarised at the geometric centre of the Transformer's measured range, where the laws are best
determined; a summary whose crossing lies outside the kind's measured range is an extrapolation, not
identified. Its interval: a parametric bootstrap (cell means redrawn around the fitted laws with the
noise, the noise itself redrawn from its χ² distribution; every law refitted), the percentile
interval; a resample whose kind never reaches the loss counts as an infinite fraction, and resamples
are never dropped. Its sensitivity: the fraction when any one cell mean moves by one seed's standard
deviation, either way.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .. import paper
from ..checkpoint import read_config
from ..checks import Field, check_fields, string
from ..user_text import read_text_file
from .models import BASELINE, ModelUnderTest
from .output import KIND_COLORS, fmt, markdown_table, new_figure, save_figure
from .scoring import token_nll
from .texts import EvalText

NAME = "scaling"
TITLE = "Scaling laws (paper Fig. 3)"
X_KINDS = ("params", "tokens")
LEVEL = 0.95  # every interval and profile set
EXPONENTS = np.geomspace(0.01, 2.0, 97)  # the exponents b searched (a 5.7% step, refined)
FLOOR_STEPS = np.linspace(0.0, 0.995, 64)  # the floors c searched, as fractions of the lowest loss
CHUNK = 64  # resamples fitted at once (memory: CHUNK × floors × kinds × exponents floats)

__all__ = ["Cell", "KindFit", "Law", "LawAnalysis", "Matching", "analyse", "evaluate", "load_runs", "runs_from_json"]


# --- the data and the laws ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One kind at one x: its loss at every seed."""

    kind: str
    x: float
    losses: tuple[float, ...]

    @property
    def mean(self) -> float:
        return float(np.mean(self.losses))


@dataclass(frozen=True)
class Law:
    """L(x) = a·x^(−b) + c."""

    a: float
    b: float
    c: float

    def __call__(self, x: float) -> float:
        return self.a * x ** (-self.b) + self.c

    def inverse(self, loss: float) -> float:
        """The x where the law reaches ``loss``; infinity at or below its floor c (or for a flat law)."""
        if loss <= self.c or self.a <= 0:
            return math.inf
        return ((loss - self.c) / self.a) ** (-1.0 / self.b)

    def text(self) -> str:
        """"2.31·x^(−0.0420) + 1.2000"."""
        return f"{self.a:.4g}·x^(−{self.b:.4f}) + {self.c:.4f}"


@dataclass
class KindFit:
    """One kind's law in the joint fit, the cells it was fitted to, its residuals (measured − law) and
    what identifies it: the profile of the fit error over the exponent (``profile[i]``: the least
    weighted squared error with b = ``EXPONENTS[i]``, over that of the fit, in units of a seed's
    variance), its set within the ``LEVEL`` threshold, and the flags that make it say nothing."""

    kind: str
    x: list[float]
    loss: list[float]  # the mean over seeds of each cell
    seeds: list[int]
    law: Law
    residuals: list[float]
    exponent_interval: tuple[float, float]  # the profile's set: the b that fit within the noise
    profile: list[float]
    flags: list[str]

    @property
    def rmse(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.residuals))))


@dataclass
class Noise:
    """A seed's standard deviation, where it comes from ("seeds": pooled within cells; "residuals":
    the fit's, with one seed per cell or a lack of fit), its degrees of freedom, and the lack-of-fit
    test's p-value (None without seeds and residual degrees of freedom both)."""

    sd: float
    df: int
    source: str
    lack_of_fit_p: float | None = None


@dataclass
class Reading:
    """At the baseline's x: its fitted loss, the x where the kind's law reaches it (inf: never), their
    ratio, and whether that x lies within the kind's measured range."""

    baseline_x: float
    loss: float
    kind_x: float
    fraction: float
    inside: bool


@dataclass
class Matching:
    """The fraction of the baseline's x ``kind`` needs for the baseline's loss, summarised at ``at`` (the
    geometric centre of the baseline's measured x): ``fraction`` and its ``interval`` where identified,
    else None and the ``reason``; ``estimate`` the summary reading whatever its standing (inf: never
    reached); the readings at every measured baseline x; the sensitivity (the least and the most the
    fraction reads when any one cell mean moves by one seed's sd); the resamples of the interval and
    how many of them never reach the loss (an infinite fraction, counted)."""

    kind: str
    baseline: str
    x_kind: str
    fraction: float | None
    interval: tuple[float, float] | None
    identified: bool
    reason: str
    estimate: float | None = None
    at: float | None = None
    readings: list[Reading] = field(default_factory=list)
    sensitivity: tuple[float, float] | None = None
    resamples: int = 0
    undefined: int = 0


@dataclass
class LawAnalysis:
    """Every kind's law (one joint fit), the noise it was judged against, and each kind's matching
    against the baseline."""

    x_kind: str
    shared_floor: bool
    fits: dict[str, KindFit]
    noise: Noise | None
    matching: dict[str, Matching]
    problem: str = ""  # why there are no laws (too few x), if so


# --- the fit: variable projection over (c, b), vectorised over resamples --------------------------------


@dataclass
class _Design:
    """The cells as arrays: kind index, x over its kind's geometric mean (log), seeds per cell."""

    kinds: list[str]
    kind: np.ndarray  # (m,) index into kinds
    log_u: np.ndarray  # (m,) log(x / x_ref[kind])
    x_ref: np.ndarray  # (K,)
    weight: np.ndarray  # (m,) seeds
    shared_floor: bool

    @functools.cached_property
    def onehot(self) -> np.ndarray:  # (K, m)
        return (self.kind[None, :] == np.arange(len(self.kinds))[:, None]).astype(np.float64)

    @property
    def parameters(self) -> int:
        k = len(self.kinds)
        return 2 * k + 1 if self.shared_floor else 3 * k


@dataclass
class _Fits:
    """B fits: a (B, K) in units of x_ref (a·(x/x_ref)^(−b) + c), b and c (B, K), each kind's weighted
    squared error (B, K); for a single fit, the profile of the error over EXPONENTS (K, G): with a
    shared floor the error of every kind, else the kind's own."""

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    rss_by_kind: np.ndarray
    profile: np.ndarray | None = None

    @property
    def rss(self) -> np.ndarray:  # (B,)
        return self.rss_by_kind.sum(-1)


def _vertex(lo: np.ndarray, mid: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The offset, in grid steps, of the vertex of the parabola through three equally spaced values
    (0 where they are not convex)."""
    curvature = lo - 2 * mid + hi
    return np.where(curvature > 0, 0.5 * (lo - hi) / np.where(curvature > 0, curvature, 1.0), 0.0)


def _least(values: np.ndarray, axis: int) -> np.ndarray:
    """The least of ``values`` along ``axis``, lowered to its parabola's vertex (exact for a quadratic,
    as the error is in c at a fixed exponent)."""
    best = values.argmin(axis)
    inner = np.clip(best, 1, values.shape[axis] - 2)
    pick = lambda i: np.take_along_axis(values, np.expand_dims(i, axis), axis).squeeze(axis)  # noqa: E731
    lo, mid, hi = pick(inner - 1), pick(inner), pick(inner + 1)
    curvature = lo - 2 * mid + hi
    vertex = mid - np.where(curvature > 0, (lo - hi) ** 2 / (8 * np.where(curvature > 0, curvature, 1.0)), 0.0)
    interior = (best > 0) & (best < values.shape[axis] - 1)
    return np.where(interior, np.minimum(vertex, pick(best)), pick(best))


def _refined(values: np.ndarray, grid: np.ndarray, axis: int) -> np.ndarray:
    """The grid value of the least of ``values`` along ``axis``, moved to its parabola's vertex (kept at an
    end of the grid)."""
    best = values.argmin(axis)
    inner = np.clip(best, 1, len(grid) - 2)
    pick = lambda i: np.take_along_axis(values, np.expand_dims(i, axis), axis).squeeze(axis)  # noqa: E731
    step = np.clip(_vertex(pick(inner - 1), pick(inner), pick(inner + 1)), -0.5, 0.5)
    interior = (best > 0) & (best < len(grid) - 1)
    return np.where(interior, grid[inner] + step * (grid[1] - grid[0]), grid[best])


def _fit_batch(design: _Design, y: np.ndarray, *, profile: bool = False) -> _Fits:
    """Least weighted squares of every row of ``y`` (B, m): the floor(s) and exponents on the grid, a
    projected out, then refined. ``profile`` (B = 1): the profile of the error over each exponent."""
    onehot, w = design.onehot, design.weight
    powers = np.exp(-EXPONENTS[:, None] * design.log_u[None, :])  # (G, m): (x/x_ref)^(−b)
    # The weighted moments of each kind's cells, at every exponent of the grid: (K,), (K, G), (B, K), (B, K, G).
    s_w = onehot @ w
    s_x = np.einsum("gi,ki,i->kg", powers, onehot, w)
    s_xx = np.einsum("gi,ki,i->kg", powers**2, onehot, w)
    wy = y * w
    s_y, s_yy = wy @ onehot.T, (wy * y) @ onehot.T  # (B, K)
    s_xy = np.einsum("bi,gi,ki->bkg", wy, powers, onehot)  # (B, K, G)
    lowest = np.where(onehot[None] > 0, y[:, None, :], np.inf).min(-1)  # (B, K): each kind's lowest loss
    top = np.repeat(lowest.min(-1, keepdims=True), len(design.kinds), 1) if design.shared_floor else lowest

    inverse_xx = 1.0 / s_xx

    def error(c: np.ndarray, xy: np.ndarray, y1: np.ndarray, y2: np.ndarray) -> np.ndarray:
        """The error of each kind at floor c (..., K) and every b, a = max(0, ⟨x, y − c⟩ / ⟨x, x⟩)."""
        xr = np.maximum(xy - c[..., None] * s_x, 0.0)
        rr = y2 - 2 * c * y1 + c * c * s_w
        return rr[..., None] - xr * xr * inverse_xx

    # (B, T, K, G) on the grid of floors: the best b of each kind at each floor
    grid_error = error(FLOOR_STEPS[None, :, None] * top[:, None, :], s_xy[:, None], s_y[:, None], s_yy[:, None])
    at_floor = grid_error.min(-1)  # (B, T, K)
    if design.shared_floor:
        step = np.repeat(_refined(at_floor.sum(-1), FLOOR_STEPS, 1)[:, None], len(design.kinds), 1)
    else:
        step = _refined(at_floor, FLOOR_STEPS, 1)  # (B, K)
    c = step * top
    b = np.exp(_refined(error(c, s_xy, s_y, s_yy), np.log(EXPONENTS), 2))
    fits = _Fits(*_coefficients(design, y, b, c))
    if profile:
        if design.shared_floor:  # each kind's b held, the floor and the other kinds' b refitted
            others = at_floor.sum(-1, keepdims=True) - at_floor  # (B, T, K)
            fits.profile = _least(grid_error + others[..., None], 1)[0]  # (K, G)
        else:
            fits.profile = _least(grid_error, 1)[0]
    return fits


def _coefficients(design: _Design, y: np.ndarray, b: np.ndarray, c: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, c, each kind's weighted squared error), all (B, K): a at exponents b and floors c."""
    onehot, w, kind = design.onehot, design.weight, design.kind
    powers = np.exp(-b[:, kind] * design.log_u[None, :])  # (B, m)
    rest = y - c[:, kind]
    a = np.maximum(((rest * powers * w) @ onehot.T) / ((powers**2 * w) @ onehot.T), 0.0)
    return a, b, c, ((rest - a[:, kind] * powers) ** 2 * w) @ onehot.T


def _polish(design: _Design, y: np.ndarray, fits: _Fits) -> _Fits:
    """The single fit ``fits`` refined by SciPy (Nelder-Mead over the floor(s) and log exponents, a
    projected out, within the searched bounds); kept where it lowers the error."""
    from scipy.optimize import minimize

    k = len(design.kinds)
    lowest = np.array([y[0, design.kind == i].min() for i in range(k)])
    tops = np.full(k, lowest.min()) if design.shared_floor else lowest
    n_floor = 1 if design.shared_floor else k

    def unpack(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        floor = np.broadcast_to(theta[:n_floor], (k,))[None, :] * tops
        return np.exp(theta[n_floor:])[None, :], floor

    def objective(theta: np.ndarray) -> float:
        return float(_coefficients(design, y, *unpack(theta))[3].sum())

    start = np.concatenate([(fits.c[0] / tops)[:n_floor], np.log(fits.b[0])])
    bounds = [(0.0, FLOOR_STEPS[-1])] * n_floor + [(math.log(EXPONENTS[0]), math.log(EXPONENTS[-1]))] * k
    result = minimize(objective, start, method="Nelder-Mead", bounds=bounds,
                      options={"xatol": 1e-6, "fatol": 1e-12 * max(float(fits.rss[0]), 1e-300)})
    if not result.fun < fits.rss[0]:
        return fits
    b, c = unpack(result.x)
    polished = _Fits(*_coefficients(design, y, b.copy(), c.copy()))
    polished.profile = fits.profile
    return polished


def _design(cells: Sequence[Cell], kinds: Sequence[str], shared_floor: bool) -> _Design:
    kind = np.array([kinds.index(c.kind) for c in cells])
    log_x = np.log(np.array([c.x for c in cells], dtype=np.float64))
    centre = np.array([log_x[kind == i].mean() for i in range(len(kinds))])
    return _Design(list(kinds), kind, log_x - centre[kind], np.exp(centre),
                   np.array([len(c.losses) for c in cells], dtype=np.float64), shared_floor)


def _noise(cells: Sequence[Cell], rss: float, residual_df: int) -> Noise | None:
    """A seed's noise: pooled within cells, or the fit's residual spread where that is larger (module
    docstring); None when neither can be measured."""
    from scipy.stats import f as f_distribution

    df = sum(len(c.losses) - 1 for c in cells)
    residual = rss / residual_df if residual_df > 0 else None
    if df == 0:
        return None if residual is None else Noise(math.sqrt(residual), residual_df, "residuals")
    pooled = sum(float(np.sum((np.asarray(c.losses) - c.mean) ** 2)) for c in cells) / df
    if residual is None:
        return Noise(math.sqrt(pooled), df, "seeds")
    # the lack-of-fit test: the residual spread against the seeds' (F on residual_df and df)
    p = float(f_distribution.sf(residual / pooled, residual_df, df)) if pooled > 0 else float(residual == 0)
    if residual > pooled:
        return Noise(math.sqrt(residual), residual_df, "residuals", p)
    return Noise(math.sqrt(pooled), df, "seeds", p)


def _flags(law: Law, top: float, interval: tuple[float, float], at_end: bool, shared_floor: bool) -> list[str]:
    """Why a law says nothing, in words (empty: identified); ``top``: the floor's upper bound (the lowest
    loss), ``at_end``: whether the exponent's profile set reaches an end of the searched range."""
    flags = []
    floor = "the shared floor c" if shared_floor else "the floor c"
    if law.c <= 1e-9 * top:
        flags.append(f"{floor} at its bound 0")
    elif law.c >= FLOOR_STEPS[-1] * top * (1 - 1e-6):
        flags.append(f"{floor} at its bound, the lowest loss")
    if law.b <= EXPONENTS[0] * 1.0001 or law.b >= EXPONENTS[-1] / 1.0001:
        flags.append(f"the exponent b at an end of its range ({EXPONENTS[0]:g}–{EXPONENTS[-1]:g})")
    if law.a <= 0:
        flags.append("the loss does not fall with x (a = 0)")
    if at_end:
        flags.append(f"the exponent is not identified: every b from {interval[0]:.3g} to {interval[1]:.3g} fits "
                     "within the noise (a flat profile)")
    return flags


def _fit_laws(cells: Sequence[Cell], x_kind: str) -> tuple[_Design, _Fits, dict[str, KindFit], Noise | None]:
    """Every kind's law, one joint fit (the floor shared on the parameter axis), flagged where it says
    nothing; and the noise it is judged against (None: unknown)."""
    from scipy.stats import f as f_distribution

    kinds = list(dict.fromkeys(c.kind for c in cells))
    design = _design(cells, kinds, shared_floor=x_kind == "params")
    y = np.array([[c.mean for c in cells]])
    fits = _polish(design, y, _fit_batch(design, y, profile=True))
    noise = _noise(cells, float(fits.rss[0]), len(cells) - design.parameters)
    threshold = None if noise is None else float(f_distribution.ppf(LEVEL, 1, noise.df)) * noise.sd**2
    laws = {}
    lowest = {kind: min(c.mean for c in cells if c.kind == kind) for kind in kinds}
    for i, kind in enumerate(kinds):
        rows = [j for j, c in enumerate(cells) if c.kind == kind]
        law = Law(float(fits.a[0, i] * design.x_ref[i] ** fits.b[0, i]), float(fits.b[0, i]), float(fits.c[0, i]))
        least = fits.rss[0] if design.shared_floor else fits.rss_by_kind[0, i]
        profile = np.maximum(fits.profile[i] - least, 0.0)
        # no noise to judge by: every b fits (nothing is identified)
        inside = profile <= (np.inf if threshold is None else max(threshold, profile.min()))
        chosen = np.flatnonzero(inside)
        interval = (float(EXPONENTS[chosen[0]]), float(EXPONENTS[chosen[-1]]))
        scale = noise.sd**2 if noise is not None and noise.sd > 0 else 1.0
        top = min(lowest.values()) if design.shared_floor else lowest[kind]
        laws[kind] = KindFit(kind, [cells[j].x for j in rows], [cells[j].mean for j in rows],
                             [len(cells[j].losses) for j in rows], law,
                             [cells[j].mean - law(cells[j].x) for j in rows], interval,
                             [float(v) for v in profile / scale],
                             _flags(law, top, interval, bool(inside[0] or inside[-1]), design.shared_floor))
    return design, fits, laws, noise


# --- the matching fraction ------------------------------------------------------------------------------


def _fractions(fits: _Fits, design: _Design, base: int, kind: int, base_x: np.ndarray) -> np.ndarray:
    """(B, len(base_x)): the x where ``kind``'s law reaches ``base``'s law at each base x, over that x;
    inf where it never does (or where a nearly flat law's inverse overflows)."""
    with np.errstate(over="ignore"):
        return _crossings(fits, design, base, kind, base_x)


def _crossings(fits: _Fits, design: _Design, base: int, kind: int, base_x: np.ndarray) -> np.ndarray:
    ref = design.x_ref
    target = fits.a[:, base, None] * (base_x[None, :] / ref[base]) ** (-fits.b[:, base, None]) + fits.c[:, base, None]
    above = target - fits.c[:, kind, None]
    a = fits.a[:, kind, None]
    reached = (above > 0) & (a > 0)
    ratio = np.where(reached, above, 1.0) / np.where(a > 0, a, 1.0)
    needed = ref[kind] * ratio ** (-1.0 / fits.b[:, kind, None])
    return np.where(reached, needed / base_x[None, :], np.inf)


def _quantile_interval(values: np.ndarray) -> tuple[float, float]:
    """The central LEVEL interval of ``values`` by order statistics (the outer ones: conservative);
    an end may be inf."""
    tail = (1 - LEVEL) / 2
    return (float(np.quantile(values, tail, method="lower")), float(np.quantile(values, 1 - tail, method="higher")))


@dataclass
class _Perturbed:
    """The joint fit again on perturbed cell means: each cell moved by one seed's sd either way (2m
    fits), and the parametric bootstrap's resamples (module docstring)."""

    moved: _Fits
    resampled: _Fits


def _perturb(design: _Design, fits: _Fits, noise: Noise, cells: Sequence[Cell], resamples: int,
             seed: int) -> _Perturbed:
    means = np.array([[c.mean for c in cells]])
    moves = np.concatenate([np.eye(len(cells)), -np.eye(len(cells))]) * noise.sd
    rng = np.random.default_rng(seed)
    fitted = fits.a[0, design.kind] * np.exp(-fits.b[0, design.kind] * design.log_u) + fits.c[0, design.kind]
    sd = noise.sd * np.sqrt(noise.df / rng.chisquare(noise.df, resamples))  # the noise redrawn, then the means
    draws = fitted[None, :] + sd[:, None] * rng.standard_normal((resamples, len(cells))) / np.sqrt(design.weight)
    chunks = [_fit_batch(design, draws[i:i + CHUNK]) for i in range(0, resamples, CHUNK)]
    resampled = _Fits(*(np.concatenate([getattr(f, name) for f in chunks]) for name in ("a", "b", "c", "rss_by_kind")))
    return _Perturbed(_fit_batch(design, means + moves), resampled)


def _match(design: _Design, fits: _Fits, laws: dict[str, KindFit], perturbed: _Perturbed | None, baseline: str,
           kind: str, x_kind: str, labels: dict[str, str]) -> Matching:
    """The matching fraction of ``kind`` against ``baseline`` (module docstring); ``perturbed``: None when the
    noise is unknown; ``labels`` name the kinds in the reason."""
    base_i, kind_i = design.kinds.index(baseline), design.kinds.index(kind)
    base_x = np.array(sorted(laws[baseline].x), dtype=np.float64)
    at = float(np.exp(np.mean(np.log(base_x))))
    kind_range = (min(laws[kind].x), max(laws[kind].x))
    readings = []
    for x, f in zip(base_x, _fractions(fits, design, base_i, kind_i, base_x)[0]):
        needed = f * x
        readings.append(Reading(float(x), laws[baseline].law(float(x)), float(needed), float(f),
                                bool(kind_range[0] <= needed <= kind_range[1])))
    estimate = float(_fractions(fits, design, base_i, kind_i, np.array([at]))[0, 0])
    match = Matching(kind, baseline, x_kind, None, None, False, "", None if math.isinf(estimate) else estimate, at,
                     readings)
    if perturbed is None:
        match.reason = "the noise is unknown (one seed per cell and no degrees of freedom left by the fit)"
        return match
    shifted = _fractions(perturbed.moved, design, base_i, kind_i, np.array([at]))[:, 0]
    match.sensitivity = (float(shifted.min()), float(shifted.max()))
    values = _fractions(perturbed.resampled, design, base_i, kind_i, np.array([at]))[:, 0]
    match.resamples, match.undefined = len(values), int(np.isinf(values).sum())
    low, high = _quantile_interval(values)
    needed = estimate * at
    name = lambda k: labels.get(k, k)  # noqa: E731
    flagged = [f"{name(k)}'s law: {'; '.join(laws[k].flags)}" for k in (baseline, kind) if laws[k].flags]
    if flagged:
        match.reason = "not identified at this range: " + "; ".join(flagged)
    elif math.isinf(estimate):
        match.reason = (f"{name(kind)}'s law never reaches {name(baseline)}'s loss at x = {x_text(at)} (its floor lies "
                        "above it)")
    elif not kind_range[0] <= needed <= kind_range[1]:
        match.reason = (f"an extrapolation: {name(kind)} would need x = {x_text(needed)}, outside its measured range "
                        f"{x_text(kind_range[0])}–{x_text(kind_range[1])}")
    elif math.isinf(high):
        match.reason = (f"not identified at this range: {match.undefined} of {match.resamples} resamples never reach "
                        f"{name(baseline)}'s loss, so the interval has no upper end")
    else:
        match.fraction, match.interval, match.identified = estimate, (low, high), True
    return match


def analyse(cells: Sequence[Cell], x_kind: str, baseline: str = BASELINE, *, resamples: int = 2000,
            seed: int = 0, labels: dict[str, str] | None = None) -> LawAnalysis:
    """Every kind's law and each other kind's matching fraction against ``baseline`` (module docstring),
    ``resamples`` drawn from ``seed`` for each interval; ``labels`` name the kinds in the reasons. A kind
    needs three distinct x (its law has three constants); fewer: no laws, and why."""
    if x_kind not in X_KINDS:
        raise ValueError(f"x must be one of {', '.join(X_KINDS)}, got {x_kind!r}")
    for c in cells:
        if not (c.x > 0 and math.isfinite(c.x) and c.losses and all(v > 0 and math.isfinite(v) for v in c.losses)):
            raise ValueError(f"{c.kind} at x = {c.x}: x and every loss must be positive and finite, got {c.losses}")
    kinds = list(dict.fromkeys(c.kind for c in cells))
    few = [(labels or {}).get(k, k) for k in kinds if len({c.x for c in cells if c.kind == k}) < 3]
    if few:
        return LawAnalysis(x_kind, x_kind == "params", {}, None, {},
                           f"{', '.join(few)}: fewer than three distinct x (a law a·x^(−b) + c has three constants)")
    if len({(c.kind, c.x) for c in cells}) != len(cells):
        raise ValueError("two cells of the same kind at the same x: give each its seeds in one cell")
    design, fits, laws, noise = _fit_laws(cells, x_kind)
    matching = {}
    if baseline in laws:
        perturbed = None if noise is None else _perturb(design, fits, noise, cells, resamples, seed)
        for kind in kinds:
            if kind != baseline:
                matching[kind] = _match(design, fits, laws, perturbed, baseline, kind, x_kind, labels or {})
    return LawAnalysis(x_kind, design.shared_floor, laws, noise, matching)


# --- runs --------------------------------------------------------------------------------------------------


# A run's fields, each checked by type and range before any is used (checks.check_fields).
RUN_FIELDS = {"loss": Field("number", minimum=0), "params": Field("number", positive=True, nullable=True),
              "parameters": Field("number", positive=True, nullable=True),
              "tokens": Field("number", positive=True, nullable=True),
              "seed": Field("int", 0, 2**63 - 1, nullable=True),
              "label": Field("str", nullable=True), "name": Field("str", nullable=True)}


def _run_record(item: dict, source: str) -> dict[str, Any]:
    missing = [k for k in ("attention", "loss") if k not in item]
    if missing:
        raise ValueError(f"{source}: a run needs 'attention' and 'loss' (missing {', '.join(missing)})")
    string(item["attention"], "attention", source)
    check_fields(item, RUN_FIELDS, source)
    params = item.get("params", item.get("parameters"))
    return {"label": item.get("label", item.get("name")), "attention": str(item["attention"]),
            "params": None if params is None else float(params),
            "tokens": None if item.get("tokens") is None else float(item["tokens"]), "loss": float(item["loss"]),
            "seed": item.get("seed")}


def runs_from_json(data: Any, source: str = "results") -> list[dict[str, Any]]:
    """Runs from a list of run dicts, {"runs": [...]} (the scaling study's metrics.json holds its runs so),
    or a compare metrics.json ({"lm": {"models": {...}}}, or {"models": {...}} as comparisons wrote it
    before)."""
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        data = data["runs"]
    if isinstance(data, dict) and isinstance(data.get("lm"), dict):
        data = data["lm"]
    if isinstance(data, dict) and isinstance(data.get("models"), dict):
        data = [{"label": name, **_compare_model(model, f"{source}: models.{name}")}
                for name, model in data["models"].items()]
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise ValueError(f"{source}: expected a list of runs {{attention, params, tokens, loss}}, "
                         "a {\"runs\": [...]} object, or a compare metrics.json")
    return [_run_record(item, f"{source}: run {i}") for i, item in enumerate(data)]


def _compare_model(model: dict, source: str) -> dict[str, Any]:
    """One model entry of a compare metrics.json as a run."""
    loss = model.get("loss", model.get("final_val_loss", model.get("val_loss")))
    if isinstance(loss, dict):
        loss = loss.get("mean")
    if loss is None:
        raise ValueError(f"{source}: no final validation loss (loss / final_val_loss / val_loss)")
    return {"attention": model.get("attention"), "params": model.get("params", model.get("parameters")),
            "tokens": model.get("tokens"), "loss": loss}


def load_runs(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The runs of every results file (read as UTF-8 text, each once: a file given twice is refused)."""
    runs, seen = [], set()
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such results file")
        if path.resolve() in seen:
            raise ValueError(f"{path}: results file given twice (its runs would count twice)")
        seen.add(path.resolve())
        try:
            data = json.loads(read_text_file(path))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        runs += runs_from_json(data, str(path))
    return runs


def cells_of(runs: Sequence[dict[str, Any]], x_kind: str) -> list[Cell]:
    """The cells of ``runs``: one per kind and x, its runs' losses as seeds. Along parameters, the runs at
    the most tokens (a law over parameters is at one budget); along tokens, each kind's runs at the
    parameters with the most budgets (a law over tokens is at one size)."""
    if x_kind not in X_KINDS:
        raise ValueError(f"x must be one of {', '.join(X_KINDS)}, got {x_kind!r}")
    for run in runs:
        if run[x_kind] is None:
            raise ValueError(f"run {run} has no {x_kind!r}")
    other = "tokens" if x_kind == "params" else "params"
    kept = []
    for kind in dict.fromkeys(r["attention"] for r in runs):
        mine = [r for r in runs if r["attention"] == kind]
        if any(r[other] is not None for r in mine):
            values = {r[other] for r in mine}
            spread = {v: len({r[x_kind] for r in mine if r[other] == v}) for v in values}
            chosen = (max(v for v in values if v is not None) if x_kind == "params"
                      else max(values, key=lambda v: (spread[v], v or 0)))
            mine = [r for r in mine if r[other] == chosen]
        kept += mine
    losses: dict[tuple[str, float], list[float]] = {}
    for run in kept:
        losses.setdefault((run["attention"], run[x_kind]), []).append(run["loss"])
    return [Cell(kind, x, tuple(v)) for (kind, x), v in sorted(losses.items(), key=lambda kv: kv[0])]


# --- the evaluation ------------------------------------------------------------------------------------


def evaluate(runs: list[dict[str, Any]], x_kind: str = "params", *, resamples: int = 2000) -> dict[str, Any]:
    """Every architecture's law and each other kind's matching fraction against the Transformer
    (:func:`analyse` on :func:`cells_of` the runs, ``resamples`` for each interval), as JSON data:
    ``matching[kind]`` holds ``fraction`` (None when not identified), ``interval`` ([low, high] or
    None), ``identified`` and ``reason``."""
    analysis = analyse(cells_of(runs, x_kind), x_kind, resamples=resamples)
    return result_data(analysis)


def result_data(analysis: LawAnalysis) -> dict[str, Any]:
    """The JSON data of an analysis (what ``eval scaling`` writes and the study's metrics.json holds)."""
    def plain(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain({
        "x": analysis.x_kind, "shared_floor": analysis.shared_floor, "problem": analysis.problem,
        "noise": None if analysis.noise is None else asdict(analysis.noise),
        "exponents": [float(b) for b in EXPONENTS],
        "architectures": {kind: {**asdict(fit), "law": asdict(fit.law), "rmse": fit.rmse}
                          for kind, fit in analysis.fits.items()},
        "matching": {kind: asdict(m) for kind, m in analysis.matching.items()},
    })


def plot(result: dict[str, Any], path: Path) -> None:
    """The loss against x with every law (left) and the profile of the fit error over each exponent
    (right: a law is identified where its profile rises above the threshold on both sides)."""
    fig, (ax, ax_profile) = new_figure(ncols=2, size=(11.0, 4.2))
    for i, (kind, arch) in enumerate(result["architectures"].items()):
        color = KIND_COLORS.get(kind, f"C{i}")
        xs = arch["x"]
        ax.scatter(xs, arch["loss"], color=color, label=f"{kind}")
        law = Law(**arch["law"])
        grid = np.geomspace(min(xs) / 1.5, max(xs) * 1.5, 100)
        ax.plot(grid, [law(x) for x in grid], color=color, linestyle=":" if arch["flags"] else "-",
                label=f"{kind}: {law.text()}" + (" (flagged)" if arch["flags"] else ""))
        ax_profile.plot(result["exponents"], arch["profile"], color=color, label=kind)
    noise = result["noise"]
    if noise is not None:
        from scipy.stats import f as f_distribution

        ax_profile.axhline(float(f_distribution.ppf(LEVEL, 1, noise["df"])), color="grey", linestyle="--",
                           label="95% threshold")
    ax.set_xscale("log")
    ax.set_xlabel("parameters" if result["x"] == "params" else "training tokens")
    ax.set_ylabel("loss")
    ax.set_title("Scaling (cf. Fig. 3); dotted: a flagged law")
    ax.legend(fontsize=7)
    ax_profile.set_xscale("log")
    ax_profile.set_yscale("symlog")
    ax_profile.set_xlabel("exponent b")
    ax_profile.set_ylabel("extra fit error / a seed's variance")
    ax_profile.set_title("Profile of the fit error over b")
    ax_profile.legend(fontsize=7)
    save_figure(fig, path)


def x_text(x: float) -> str:
    """A parameter or token count: "17,238", or "3.1e-05" / "2.4e+15" where a far-off law reads one."""
    return f"{x:,.0f}" if 1 <= x < 1e12 else f"{x:.3g}"


def paper_fraction(x_kind: str) -> str:
    """The paper's figure beside ours: "0.595 and 0.622" (Fig. 3a) or "0.637" (Fig. 3b)."""
    claim = paper.SCALING_FIG3
    if x_kind == "params":
        return " and ".join(f"{v:.3f}" for v in claim["parameter_fraction"])
    return f"{claim['token_fraction']:.3f}"


def fraction_text(m: Matching, label: str, what: str) -> str:
    """A matching fraction in words: identified, with its interval, sensitivity and the paper's figure; or
    not, and why (with the reading, which is not a measurement)."""
    if m.identified:
        low, high = m.interval
        return (f"{label} reaches the Transformer's loss with **{m.fraction:.2f}×** its {what} [{low:.2f}, {high:.2f}] "
                f"(95%, {m.resamples} resamples, {m.undefined} never reaching it), read at {x_text(m.at)}; one point "
                f"moved by one seed's sd reads {m.sensitivity[0]:.2f}–{m.sensitivity[1]:.2f}. The paper's DIFF: "
                f"{paper_fraction(m.x_kind)}.")
    reading = "" if m.estimate is None else f" (the laws read {m.estimate:.3g}× at {x_text(m.at)}: not a measurement)"
    return f"{label}: no fraction — {m.reason}{reading}."


def report(result: dict[str, Any]) -> str:
    x_name = "parameters" if result["x"] == "params" else "training tokens"
    if result["problem"]:
        return f"No laws: {result['problem']}."
    rows = []
    for kind, arch in result["architectures"].items():
        law = Law(**arch["law"])
        low, high = arch["exponent_interval"]
        rows.append([kind, len(arch["x"]), law.text(), f"{low:.3g}–{high:.3g}", fmt(arch["rmse"], 4),
                     "; ".join(arch["flags"]) or "–"])
    noise = result["noise"]
    floor = "one floor c shared by the kinds" if result["shared_floor"] else "a floor c per kind"
    lines = [markdown_table(["Architecture", "Cells", f"L({x_name})", "b within the noise", "RMSE", "Flags"], rows), "",
             f"Fitted jointly with {floor}; "
             + ("the noise is unknown." if noise is None else
                f"a seed's noise {noise['sd']:.4f} ({noise['source']}, {noise['df']} degrees of freedom)."), ""]
    for kind, m in result["matching"].items():
        match = Matching(**{**m, "readings": [Reading(**r) for r in m["readings"]],
                            "interval": None if m["interval"] is None else tuple(m["interval"]),
                            "sensitivity": None if m["sensitivity"] is None else tuple(m["sensitivity"])})
        lines.append("- " + fraction_text(match, kind, x_name))
        lines.append("  Readings at each Transformer x: " + ", ".join(
            f"{x_text(r.baseline_x)}: " + ("never" if r.kind_x is None else f"{r.fraction:.3g}×"
                                        + ("" if r.inside else " (outside)")) for r in match.readings) + ".")
    claim = paper.SCALING_FIG3
    lines += ["", f"Paper ({claim['source']}): {claim['claim']}."]
    return "\n".join(lines)


def run_from_checkpoint(mut: ModelUnderTest, text: EvalText, *, windows: int = 16,
                        batch_size: int = 8) -> dict[str, Any]:
    """A run record for a checkpoint: its parameters, the tokens it was trained on (recorded in a
    training checkpoint's config.json, else None), and its validation loss on held-out windows of
    its full context."""
    tokens = read_config(mut.checkpoint)[1].get("training", {}).get("tokens") if mut.checkpoint else None
    nll = token_nll(mut.model, text.windows(mut.tokenizer, mut.max_seq_len, windows), batch_size)
    return {"label": mut.label, "attention": mut.attention, "params": float(mut.model.num_parameters()),
            "tokens": None if tokens is None else float(tokens), "loss": float(nll.mean()), "seed": None}
