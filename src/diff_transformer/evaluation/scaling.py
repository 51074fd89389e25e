"""Scaling laws (paper Figure 3): fit L(x) = a·x^(−b) + c per architecture, x = parameters or
training tokens, and find the fraction of x DIFF needs to reach the Transformer's loss.

Input: several runs, each {attention, params, tokens, loss} (a JSON list, a {"runs": [...]}
file, or the metrics.json that ``diff-transformer compare`` writes), or checkpoints whose
validation loss is measured here. The fit is :func:`~diff_transformer.evaluation.stats.fit_power_law`
(SciPy's least squares, c in [0, the smallest loss)). Three distinct x per architecture are needed
for the three parameters; with two, c is fixed at 0 (a pure power law) and the report says so;
with one there is no fit, only the losses.

Matching fraction: at each baseline x_T, the fitted baseline loss L_T(x_T) and the DIFF x_D
with L_D(x_D) = L_T(x_T); the fraction is x_D / x_T (the paper: ~0.62-0.65 for parameters,
~0.64 for tokens). It is undefined where L_T(x_T) is below DIFF's fitted floor c.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .. import paper
from ..checkpoint import read_config
from .models import BASELINE, DIFF_KINDS, ModelUnderTest
from .output import KIND_COLORS, fmt, markdown_table, new_figure, save_figure
from .scoring import token_nll
from .stats import PowerLaw, fit_power_law
from .texts import EvalText

NAME = "scaling"
TITLE = "Scaling laws (paper Fig. 3)"
X_KINDS = ("params", "tokens")

__all__ = ["PowerLaw", "evaluate", "fit_power_law", "load_runs", "runs_from_json"]


# --- runs ------------------------------------------------------------------------------------------------


def _run_record(item: dict, source: str) -> dict[str, Any]:
    missing = [k for k in ("attention", "loss") if k not in item]
    if missing:
        raise ValueError(f"{source}: a run needs 'attention' and 'loss' (missing {', '.join(missing)}): {item}")
    params = item.get("params", item.get("parameters"))
    return {"label": item.get("label", item.get("name")), "attention": str(item["attention"]),
            "params": None if params is None else float(params),
            "tokens": None if item.get("tokens") is None else float(item["tokens"]), "loss": float(item["loss"])}


def runs_from_json(data: Any, source: str = "results") -> list[dict[str, Any]]:
    """Runs from a list of run dicts, {"runs": [...]}, or a compare metrics.json ({"lm": {"models": {...}}},
    or {"models": {...}} as comparisons wrote it before)."""
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        data = data["runs"]
    if isinstance(data, dict) and isinstance(data.get("lm"), dict):
        data = data["lm"]
    if isinstance(data, dict) and isinstance(data.get("models"), dict):
        data = [{"label": name, **_compare_model(model, f"{source}: models.{name}")}
                for name, model in data["models"].items()]
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise ValueError(f"{source}: expected a list of runs {{attention, params, tokens, loss}}, "
                         f"a {{\"runs\": [...]}} "
                         "object, or a compare metrics.json")
    return [_run_record(item, source) for item in data]


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
    runs = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such results file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        runs += runs_from_json(data, str(path))
    return runs


# --- the evaluation ------------------------------------------------------------------------------------


def evaluate(runs: list[dict[str, Any]], x_kind: str = "params") -> dict[str, Any]:
    """Fit every architecture and the matching fractions of each DIFF kind against the baseline."""
    if x_kind not in X_KINDS:
        raise ValueError(f"x must be one of {', '.join(X_KINDS)}, got {x_kind!r}")
    by_kind: dict[str, list[dict]] = {}
    for run in runs:
        if run[x_kind] is None:
            raise ValueError(f"run {run} has no {x_kind!r}")
        by_kind.setdefault(run["attention"], []).append(run)
    fits: dict[str, PowerLaw | None] = {}
    architectures = {}
    for kind, points in by_kind.items():
        points.sort(key=lambda r: r[x_kind])
        distinct = len({r[x_kind] for r in points})
        fit = fit_power_law([r[x_kind] for r in points], [r["loss"] for r in points]) if distinct >= 2 else None
        fits[kind] = fit
        architectures[kind] = {"points": points, "fit": asdict(fit) if fit else None}
    matching = {}
    base_fit = fits.get(BASELINE)
    for kind in DIFF_KINDS:
        if kind not in by_kind or BASELINE not in by_kind:
            continue
        entries = []
        if base_fit and fits[kind]:
            for run in by_kind[BASELINE]:
                x_base = run[x_kind]
                target = base_fit(x_base)
                x_diff = fits[kind].inverse(target)
                entries.append({"baseline_x": x_base, "loss": target, "diff_x": x_diff,
                                "fraction": None if x_diff is None else x_diff / x_base})
        same_x = [(b, d) for b in by_kind[BASELINE] for d in by_kind[kind] if b[x_kind] == d[x_kind]]
        fractions = [e["fraction"] for e in entries if e["fraction"] is not None]
        matching[kind] = {
            "fractions": entries,
            "median_fraction": float(np.median(fractions)) if fractions else None,
            "loss_differences_at_same_x": [{"x": b[x_kind], "baseline": b["loss"], kind: d["loss"],
                                            "difference": d["loss"] - b["loss"]} for b, d in same_x],
        }
    return {"x": x_kind, "architectures": architectures, "matching": matching}


def plot(result: dict[str, Any], path: Path) -> None:
    fig, axes = new_figure(ncols=1, size=(6.4, 4.2))
    ax = axes[0]
    for i, (kind, arch) in enumerate(result["architectures"].items()):
        color = KIND_COLORS.get(kind, f"C{i}")
        xs = [p[result["x"]] for p in arch["points"]]
        ax.scatter(xs, [p["loss"] for p in arch["points"]], color=color, label=f"{kind} runs")
        if arch["fit"]:
            law = PowerLaw(**arch["fit"])
            grid = np.geomspace(min(xs) / 1.5, max(xs) * 1.5, 100)
            ax.plot(grid, [law(x) for x in grid], color=color,
                    label=f"{kind}: {law.a:.3g}·x^-{law.b:.3f} + {law.c:.3f}" + (" (c fixed)" if law.fixed_c else ""))
    ax.set_xscale("log")
    ax.set_xlabel("parameters" if result["x"] == "params" else "training tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("Scaling (cf. Fig. 3)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def report(result: dict[str, Any]) -> str:
    x_name = "parameters" if result["x"] == "params" else "training tokens"
    rows = []
    for kind, arch in result["architectures"].items():
        fit = arch["fit"]
        law = "–" if not fit else f"{fit['a']:.4g}·x^(−{fit['b']:.4f}) + {fit['c']:.4f}" + (
            " (c fixed at 0)" if fit["fixed_c"] else "")
        rows.append([kind, len(arch["points"]), law, fmt(fit["rmse"], 4) if fit else "–"])
    lines = [markdown_table(["Architecture", "Runs", f"L({x_name})", "RMSE"], rows), ""]
    claim = paper.SCALING_FIG3
    paper_fraction = (f"{claim['parameter_fraction'][0]:.2f}–{claim['parameter_fraction'][1]:.2f}"
                      if result["x"] == "params" else f"{claim['token_fraction']:.2f}")
    for kind, match in result["matching"].items():
        median = match["median_fraction"]
        if median is not None:
            verdict = ("agrees with the paper's direction (DIFF needs less)" if median < 1
                       else "**contradicts the paper** (DIFF needs more)")
            lines.append(f"{kind} reaches the Transformer's loss with {median:.2f}× its {x_name} "
                         "(median over the baseline runs; "
                         f"paper: {paper_fraction}) — {verdict}.")
        elif match["fractions"]:
            lines.append(f"{kind}: the Transformer's losses are below {kind}'s fitted floor; no matching fraction.")
        else:
            lines.append(f"{kind}: too few distinct sizes to fit both laws; no matching fraction.")
        for d in match["loss_differences_at_same_x"]:
            lines.append(f"At {x_name} = {d['x']:.4g}: {kind} loss {d[kind]:.4f} vs Transformer {d['baseline']:.4f} "
                         f"({d['difference']:+.4f}; the paper expects negative).")
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
            "tokens": None if tokens is None else float(tokens), "loss": float(nll.mean())}
