"""The paper's claims, one by one, tested on the models of a comparison.

For each claim a headline figure is computed per seed for DIFF and for the matched Transformer,
and the difference of their means gets a 95% confidence interval (Welch's t interval over seeds).
The verdict is "agrees" when the interval excludes zero on the paper's side, "contradicts" when
it excludes zero on the other side, and "inconclusive" otherwise (or "not testable here" when
the figure cannot tell the models apart, e.g. both at chance). Figures come from the runs'
summaries, the retrieval experiment and the evaluation suite's JSON (their own modules say
exactly what each measures).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

from ..paper import ATTENTION_TABLE3, OUTLIERS_TABLE5, PAPER_TABLE6
from ..train.config import TrainConfig

# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def t_quantile_95(df: float) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (interpolated)."""
    if df >= len(_T95):
        return 1.96
    df = max(df, 1.0)
    low = int(math.floor(df))
    high = min(low + 1, len(_T95))
    return _T95[low - 1] + (_T95[high - 1] - _T95[low - 1]) * (df - low)


def difference(ours: list[float], base: list[float]) -> dict[str, Any]:
    """mean(ours) − mean(base) with Welch's 95% interval (None with fewer than 2 values a side)."""
    delta = statistics.fmean(ours) - statistics.fmean(base)
    if len(ours) < 2 or len(base) < 2:
        return {"delta": delta, "low": None, "high": None}
    va, vb = statistics.variance(ours) / len(ours), statistics.variance(base) / len(base)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"delta": delta, "low": delta, "high": delta}
    df = (va + vb) ** 2 / (va**2 / (len(ours) - 1) + vb**2 / (len(base) - 1)) if va + vb > 0 else len(ours) + len(base) - 2
    half = t_quantile_95(df) * se
    return {"delta": delta, "low": delta - half, "high": delta + half}


def verdict(diff: dict[str, Any], paper_sign: int) -> str:
    """agrees / contradicts / inconclusive, from the interval and the sign the paper reports."""
    if diff["low"] is None:
        return "inconclusive (one seed)"
    if diff["low"] > 0 or diff["high"] < 0:
        return "agrees" if (1 if diff["low"] > 0 else -1) == paper_sign else "contradicts"
    return "inconclusive"


def mean_std(values: list[float]) -> dict[str, Any]:
    """{mean, std (None below 2 values), per_seed} of a list of per-seed figures."""
    return {
        "mean": statistics.fmean(values) if values else None,
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "per_seed": values,
    }


def _claim(claim: str, measure: str, better: str, ours: list[float], base: list[float], paper: str,
           paper_sign: int, note: str = "", testable: bool = True) -> dict[str, Any]:
    """One row: ``paper_sign`` is the sign of DIFF − Transformer the paper found (+1 or −1)."""
    diff = difference(ours, base)
    return {
        "claim": claim, "measure": measure, "better": better, "diff": mean_std(ours), "transformer": mean_std(base),
        "difference": diff, "paper": paper, "paper_sign": paper_sign,
        "verdict": verdict(diff, paper_sign) if testable else "not testable here", "note": note,
    }


def _pair(config: TrainConfig, names: list[str]) -> tuple[str, str] | None:
    """(DIFF model, its Transformer baseline): the first of each kind."""
    diff = next((n for n in names if config.models[n].attention == "diff"), None)
    base = next((n for n in names if config.models[n].attention == "standard"), None)
    return (diff, base) if diff and base else None


def paper_claims(config: TrainConfig, metrics: dict[str, Any], suite: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims that this comparison's figures can speak to (DIFF vs the first standard model)."""
    pair = _pair(config, list(metrics["models"]))
    if pair is None:
        return []
    diff_name, base_name = pair
    rows = []

    lm = {n: metrics["models"][n]["final_val_loss"]["per_seed"] for n in pair}
    paper = PAPER_TABLE6["diff"]["valid"] - PAPER_TABLE6["transformer"]["valid"]
    rows.append(_claim("Language modelling", "final validation loss (nats/token), each at its best lr", "lower",
                       lm[diff_name], lm[base_name], f"{paper:+.3f} (1.4B, Table 6)", -1))

    retrieval = metrics.get("retrieval")
    if retrieval and diff_name in retrieval["models"] and base_name in retrieval["models"]:
        runs = {n: retrieval["models"][n]["runs"] for n in pair}
        for task, paper_text in (("needle", "+0.30 at N=6, R=2 (4K, Table 2)"), ("mqar", "no figure (Zoology's task)")):
            per = {n: [r["mean_accuracy"][task] for r in runs[n]] for n in pair}
            chance = retrieval["chance"]
            testable = max(statistics.fmean(v) for v in per.values()) > 2 * chance
            rows.append(_claim("Key-information retrieval", f"{task} accuracy, mean over difficulty cells "
                               f"(chance {chance:.3f})", "higher", per[diff_name], per[base_name], paper_text, +1,
                               testable=testable, note="" if testable else "both models near chance"))
        layer = _deepest_measured_layer([r for n in pair for r in runs[n]])
        if layer is not None:
            where = "last layer" if layer == len(runs[diff_name][0]["attention"]) - 1 else f"layer {layer}"
            note = "" if where == "last layer" else "the last layer is not measurable: its rows sum to ~0 where λ is near 1"
            answer = {n: [r["attention"][layer]["answer"] for r in runs[n]] for n in pair}
            noise = {n: [r["attention"][layer]["noise"] for r in runs[n]] for n in pair}
            rows.append(_claim("Attention to the answer", f"share of the answer row on the queried needle, {where}",
                               "higher", answer[diff_name], answer[base_name], _table3("answer"), +1, note=note))
            rows.append(_claim("Attention noise", f"share of the answer row on noise and distractors, {where}",
                               "lower", noise[diff_name], noise[base_name], _table3("noise"), -1, note=note))
        else:
            rows.append({"claim": "Attention noise", "measure": "share of the answer row on noise and distractors",
                         "better": "lower", "diff": None, "transformer": None, "difference": None,
                         "paper": _table3("noise"), "paper_sign": -1, "verdict": "not testable here",
                         "note": "no layer whose answer rows are measurable in every model"})
        drops = {n: [r["quantized_accuracy"]["full"] - r["quantized_accuracy"][str(min(retrieval["settings"]["quantize_bits"]))]
                     for r in runs[n]] for n in pair}
        bits = min(retrieval["settings"]["quantize_bits"])
        rows.append(_claim("Quantisation", f"retrieval accuracy lost with {bits}-bit attention logits (hardest cells)",
                           "lower", drops[diff_name], drops[base_name], "DIFF loses ~25 points less at 4 bits (Fig. 8)",
                           -1))

    labels = {n: [f"{config.models[n].display_name} s{s}" for s in metrics["models"][n]["seeds"]] for n in pair}

    def per_seed(evaluation: str, figure: Callable[[dict], float | None]) -> dict[str, list[float]] | None:
        results = suite.get(evaluation, {}).get("models", {})
        values = {n: [figure(results[label]) for label in labels[n] if label in results] for n in pair}
        if any(not v or None in v for v in values.values()):
            return None
        return values

    t5 = OUTLIERS_TABLE5
    for tensor, key in (("attention logits", "attention_logits"), ("hidden states", "hidden_states")):
        ratio = per_seed("outliers", lambda r, key=key: r[key]["top1"] / r[key]["median"] if r[key]["median"] else None)
        if ratio:
            top1, median = 0, OUTLIERS_TABLE5["columns"].index("median")
            paper = (t5[key]["diff"][top1] / t5[key]["diff"][median]
                     - t5[key]["standard"][top1] / t5[key]["standard"][median])
            raw = per_seed("outliers", lambda r, key=key: r[key]["top1"])
            note = (f"raw top-1 DIFF {statistics.fmean(raw[diff_name]):.3g} vs {statistics.fmean(raw[base_name]):.3g}; "
                    "the ratio discounts each model's scale")
            rows.append(_claim("Activation outliers", f"top-1 / median magnitude of {tensor}", "lower",
                               ratio[diff_name], ratio[base_name], f"{paper:+.0f} (Table 5)", -1, note=note))
    quantized = per_seed("quantization", _loss_increase_at_fewest_bits)
    if quantized:
        rows.append(_claim("Quantisation", "validation loss added by the fewest-bit attention logits (LM models)",
                           "lower", quantized[diff_name], quantized[base_name], "DIFF degrades less (Fig. 8)", -1))
    icl = per_seed("icl", _icl_accuracy)
    if icl:
        chance = _icl_chance(suite["icl"]["models"][labels[base_name][0]])
        testable = max(statistics.fmean(v) for v in icl.values()) > chance + 0.1
        rows.append(_claim("In-context learning", f"many-shot accuracy at the most demonstrations (chance {chance:.2f})",
                           "higher", icl[diff_name], icl[base_name], "+5.2 to +21.6 points (Fig. 6)", +1,
                           testable=testable, note="" if testable else "both models near chance"))
        spread = per_seed("icl", _icl_spread)
        if spread:
            rows.append(_claim("ICL robustness", "accuracy spread over demonstration orders", "lower",
                               spread[diff_name], spread[base_name], "smaller spread (Fig. 7)", -1,
                               testable=testable, note="" if testable else "both models near chance"))
    return rows


def _table3(group: str) -> str:
    t3 = ATTENTION_TABLE3
    delta = statistics.fmean(t3["diff"][group]) - statistics.fmean(t3["standard"][group])
    return f"{delta:+.2f} (Table 3, mean over depths)"


def _deepest_measured_layer(runs: list[dict]) -> int | None:
    """The deepest layer whose answer-row shares exist in every run (a DIFF layer with λ near 1 has
    rows summing to ~0, whose shares are not defined), or None."""
    layers = range(min(len(r["attention"]) for r in runs) - 1, -1, -1)
    return next((i for i in layers if all(r["attention"][i] is not None for r in runs)), None)


def _loss_increase_at_fewest_bits(result: dict) -> float:
    rows = result["results"]
    full = next(r for r in rows if r["bits"] is None)
    fewest = min((r for r in rows if r["bits"] is not None), key=lambda r: r["bits"])
    return fewest["loss"] - full["loss"]


def _icl_accuracy(result: dict) -> float | None:
    values = []
    for task in result["tasks"].values():
        points = [c["accuracy"] for c in task["curve"] if c["accuracy"] is not None]
        if points:
            values.append(points[-1])
    return statistics.fmean(values) if values else None


def _icl_spread(result: dict) -> float | None:
    spreads = [layout["spread"] for task in result["tasks"].values() for key, layout in task["robustness"].items()
               if key != "demos" and layout.get("spread") is not None]
    return statistics.fmean(spreads) if spreads else None


def _icl_chance(result: dict) -> float:
    return statistics.fmean(task["chance"] for task in result["tasks"].values())


def render_claims(rows: list[dict[str, Any]], seeds: int) -> list[str]:
    """The claims table of report.md."""
    if not rows:
        return []
    lines = [
        "## The paper's claims at this scale",
        "",
        f"DIFF minus the matched Transformer, each at its own best learning rate, mean over {seeds} seed"
        f"{'s' if seeds > 1 else ''}; the interval is Welch's 95% interval of the difference. Verdict: **agrees** or "
        "**contradicts** when the interval excludes zero on one side, else **inconclusive**.",
        "",
        "| Claim | Measure (better) | Transformer | DIFF | DIFF − Transformer [95% CI] | Paper | Verdict |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        d = row["difference"]
        if d is None:  # nothing measurable
            delta = "–"
        else:
            delta = f"{d['delta']:+.4g}" + (f" [{d['low']:+.4g}, {d['high']:+.4g}]" if d["low"] is not None else "")
        verdict_text = row["verdict"] + (f" ({row['note']})" if row["note"] else "")
        lines.append(f"| {row['claim']} | {row['measure']} ({row['better']}) | {_cell(row['transformer'])} | "
                     f"{_cell(row['diff'])} | {delta} | {row['paper']} | **{verdict_text}** |")
    return lines + [""]


def _cell(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "–"
    mean = 0.0 if abs(stats["mean"]) < 1e-12 else stats["mean"]  # float rounding of a zero difference
    return f"{mean:.4g}" + (f" ± {stats['std']:.2g}" if stats["std"] is not None else "")
