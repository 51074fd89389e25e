"""What an evaluation writes: JSON result files, plots (PNG, a colour per model) and Markdown
(tables, numbers, sentences comparing each DIFF model with its baseline against the paper)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..files import write_atomically, write_files_together, write_text_atomically
from .models import BASELINE, DIFF_KINDS
from .stats import decimals

DEFAULT_OUT = Path("out/eval")


# --- output files ---------------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically (NaN/inf become null)."""
    return write_text_atomically(path, _json_text(data))


def _json_text(data: Any) -> str:
    return json.dumps(_finite(data), indent=2) + "\n"


def result_files(out_dir: Path, name: str) -> tuple[Path, Path]:
    """(OUT/NAME.json, OUT/NAME.png): the files of one evaluation's result."""
    return out_dir / f"{name}.json", out_dir / f"{name}.png"


def write_result(out_dir: Path, name: str, data: Any, plot: Callable[[Path], None] | None) -> list[Path]:
    """Write one evaluation's result: OUT/NAME.png drawn by ``plot(path)`` (None: no plot, and an
    earlier result's plot is removed) and OUT/NAME.json (``data``), together: both or, on a failure
    (a full disk), neither, an earlier result left as it was. The JSON, which readers take as the
    sign that the result exists, takes its name last. Returns the files written, the JSON first."""
    json_path, png_path = result_files(out_dir, name)
    files: list[tuple[Path, Callable[[Path], None]]] = [] if plot is None else [(png_path, plot)]
    files.append((json_path, lambda tmp: tmp.write_text(_json_text(data), encoding="utf-8")))
    write_files_together(files, remove=[png_path] if plot is None else [])
    return [json_path] + ([png_path] if plot is not None else [])


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (6.0, 4.0)):
    """(figure, axes) without pyplot: an Agg-rendered matplotlib Figure, axes always a flat list."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig, path: Path) -> Path:
    """Render ``fig`` to a PNG at ``path`` (Agg backend), atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


KIND_COLORS = {"standard": "#4c72b0", "diff": "#dd8452", "diff_v2": "#55a868", "diff_symmetric": "#8172b3",
               "gated": "#c44e52", "gated_headwise": "#937860"}
EXTRA_COLORS = ("#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd", "#1b9e77", "#7570b3")


def model_colors(results: dict[str, dict]) -> dict[str, str]:
    """A colour per model label: blue for the first Transformer, orange for the first DIFF, green for
    the first DIFF V2, purple for the first symmetric DIFF, red and brown for the first gated and
    head-wise gated models (as in every plot of the suite), other colours for further models."""
    colors, used, extra = {}, set(), 0
    for label, result in results.items():
        kind = result["model"]["attention"]
        if kind in KIND_COLORS and kind not in used:
            colors[label] = KIND_COLORS[kind]
            used.add(kind)
        else:
            colors[label] = EXTRA_COLORS[extra % len(EXTRA_COLORS)]
            extra += 1
    return colors


# --- Markdown --------------------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def pairs_to_compare(results: dict[str, dict], candidates: Sequence[str] = DIFF_KINDS) -> list[tuple[str, str]]:
    """(baseline label, candidate label) pairs among the results, in order, a candidate being a model
    of a kind in ``candidates`` (the DIFF kinds by default). Labels of one seed of a comparison
    ("DIFF s1", as ``compare`` names them) are paired with the same seed only."""
    baselines = [k for k, r in results.items() if r["model"]["attention"] == BASELINE]
    diffs = [k for k, r in results.items() if r["model"]["attention"] in candidates]
    return [(b, d) for b in baselines for d in diffs if _seed_of(b) == _seed_of(d)]


def _seed_of(label: str) -> str | None:
    """"DIFF s2" -> "2"; None for a label without a seed suffix."""
    head, _, tail = label.rpartition(" s")
    return tail if head and tail.isdigit() else None


def comparison_sentence(
    what: str,
    baseline: tuple[str, float],
    candidate: tuple[str, float],
    *,
    higher_is_better: bool,
    paper_says_candidate_better: bool = True,
    noise: float = 0.0,
    digits: int = 3,
) -> str:
    """A plain sentence: does our small-scale result agree with the paper's direction?

    ``noise`` is the difference below which the two are reported as indistinguishable
    (e.g. two standard errors of an accuracy). The figures get ``digits`` decimals, or more where
    the difference or the noise would not show (:func:`~.stats.decimals`).
    """
    (b_label, b), (c_label, c) = baseline, candidate
    if b is None or c is None or not (math.isfinite(b) and math.isfinite(c)):
        return f"{what}: not measurable for {b_label} vs {c_label}."
    diff = c - b
    digits = decimals(diff, noise, at_least=digits)  # enough to see the difference the verdict reads
    ours = f"{what}: {c_label} {c:.{digits}f} vs {b_label} {b:.{digits}f}"
    if abs(diff) <= noise:
        return f"{ours} — within noise (±{noise:.{digits}f}), so this run neither confirms nor contradicts the paper."
    candidate_better = (diff > 0) == higher_is_better
    if candidate_better == paper_says_candidate_better:
        return f"{ours} — agrees with the paper."
    return f"{ours} — **contradicts the paper** at this scale."
