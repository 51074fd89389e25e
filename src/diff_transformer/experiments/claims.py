"""The paper's claims, one by one, tested on the models of a comparison, with what each depends on.

For each claim a headline figure is computed per seed for DIFF and for the matched Transformer,
each at its own best (init recipe, learning rate), at the end of the budget; the difference of
their means gets a 95% confidence interval (Welch's t interval over seeds). The verdict word is
"agrees" when the interval excludes zero on the paper's side, "contradicts" when it excludes zero
on the other side, and "inconclusive" otherwise (or "not testable here" when the figure cannot
tell the models apart, e.g. both at chance).

The same difference is also taken under each init recipe both models were trained with (each at
its best learning rate there) and along training (the language models' validation curve, the
retrieval models' learning curve). A claim is **robust** when its word is the same at the end,
under every recipe and at every point from a quarter of the budget on; otherwise the verdict says
what it **depends on** (the recipe, the budget) and the row gives the figures that carry it.
Figures come from the runs' summaries, the retrieval experiment and the evaluation suite's JSON
(their own modules say exactly what each measures).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence

from ..paper import ATTENTION_TABLE3, OUTLIERS_TABLE5, PAPER_TABLE6
from ..train.config import TrainConfig, retrieval_examples_per_step

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


def sign(diff: dict[str, Any] | None) -> int | None:
    """+1 / −1 when the interval excludes zero on that side, 0 when it holds zero, None without one."""
    if diff is None or diff["low"] is None:
        return None
    return 1 if diff["low"] > 0 else -1 if diff["high"] < 0 else 0


def paper_word(paper_sign: int) -> Callable[[dict[str, Any]], str]:
    """The verdict word of a paper claim: agrees / contradicts / inconclusive."""
    return lambda diff: verdict(diff, paper_sign)


def better_word(label: str, better: str) -> Callable[[dict[str, Any]], str]:
    """The verdict word of a comparison the paper does not make ("DIFF V2 better" / "worse")."""
    def word(diff: dict[str, Any]) -> str:
        s = sign(diff)
        if s is None:
            return "inconclusive (one seed)"
        if s == 0:
            return "inconclusive"
        return f"{label} {'better' if (s > 0) == (better == 'higher') else 'worse'}"
    return word


ROBUST_FROM = 0.25  # along training, the points from this fraction of the budget on must agree


def dependence(head: dict[str, Any], by_recipe: dict[str, dict[str, Any]], along: list[dict[str, Any]],
               word: Callable[[dict[str, Any]], str]) -> str:
    """The verdict of a claim from its difference at the end (``head``), under each recipe and along
    training (``along``: [{fraction, delta, low, high}], the last at the end): "robust: W" when every
    one of them gives the same word W (and two recipes or more were tried), else "depends on the recipe
    / the budget: ..." naming where."""
    headword = word(head)
    recipe_words = {recipe: word(d) for recipe, d in by_recipe.items()}
    along_words = [(p, word(p)) for p in along if p["fraction"] >= ROBUST_FROM]
    if not recipe_words and not along_words:
        return headword
    if len({headword, *recipe_words.values(), *(w for _, w in along_words)}) == 1:
        if len(recipe_words) < 2:  # the same along training, but the recipe was not varied: not "robust"
            tried = f"one init recipe tried: {next(iter(recipe_words))}" if recipe_words else "the init recipe not varied"
            return f"{headword}{' along training' if along_words else ''} ({tried})"
        return "inconclusive at every recipe and budget" if headword.startswith("inconclusive") else f"robust: {headword}"
    parts = []
    if len(set(recipe_words.values())) > 1:
        parts.append("the recipe: " + ", ".join(f"{w} under {r}" for r, w in recipe_words.items()))
    elif recipe_words and headword not in recipe_words.values():  # the recipes agree, the best-of pair does not
        parts.append(f"the recipe: {next(iter(recipe_words.values()))} under "
                     f"{'each shared recipe' if len(recipe_words) > 1 else next(iter(recipe_words))}, "
                     f"{headword} with each model at its own best recipe")
    if len({w for _, w in along_words}) > 1:
        parts.append("the budget: " + ", ".join(f"{w} at {fraction_label(p['fraction'])}" for p, w in along_words))
    if not parts:  # one recipe, the same word along training, another at some recipe: name them all
        parts.append("the recipe: " + ", ".join(f"{w} under {r}" for r, w in recipe_words.items()))
    return "depends on " + "; ".join(parts)


def fraction_label(fraction: float) -> str:
    """1/8, 1/4, 3/8, 1/2, ... of the budget, "the end" for all of it; a percentage otherwise."""
    if fraction >= 1:
        return "the end"
    eighths = fraction * 8
    if abs(eighths - round(eighths)) < 1e-9 and round(eighths) > 0:
        n, d = int(round(eighths)), 8
        while n % 2 == 0:
            n, d = n // 2, d // 2
        return f"{n}/{d}"
    return f"{fraction:.0%}"


def _claim(claim: str, measure: str, better: str, ours: list[float], base: list[float], paper: str,
           paper_sign: int, note: str = "", testable: bool = True, *,
           by_recipe: dict[str, tuple[list[float], list[float]]] | None = None,
           along: list[tuple[float, str, list[float], list[float]]] | None = None,
           word: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
    """One row: ``paper_sign`` is the sign of DIFF − Transformer the paper found (+1 or −1).
    ``by_recipe``: {recipe: (ours, base)} at the end; ``along``: [(fraction, budget, ours, base)]
    along training (the last at the end). ``word`` names a difference (default: against the paper)."""
    diff = difference(ours, base)
    word = word or paper_word(paper_sign)
    recipes = {r: difference(o, b) for r, (o, b) in (by_recipe or {}).items() if o and b}
    points = [{"fraction": f, "budget": budget, **difference(o, b)} for f, budget, o, b in (along or []) if o and b]
    return {
        "claim": claim, "measure": measure, "better": better, "diff": mean_std(ours), "transformer": mean_std(base),
        "difference": diff, "paper": paper, "paper_sign": paper_sign, "by_recipe": recipes, "along": points,
        "verdict": dependence(diff, recipes, points, word) if testable else "not testable here", "note": note,
    }


def _pair(config: TrainConfig, names: list[str]) -> tuple[str, str] | None:
    """(DIFF model, its Transformer baseline): the first of each kind."""
    diff = next((n for n in names if config.models[n].attention == "diff"), None)
    base = next((n for n in names if config.models[n].attention == "standard"), None)
    return (diff, base) if diff and base else None


# --- the figures each claim reads, per model: at its best, under each recipe, along training --------


def lm_figures(metrics: dict[str, Any], name: str) -> dict[str, Any]:
    """Final validation loss per seed of model ``name``: at its best, under each LM recipe (at its best
    lr there) and along training (its validation curve at its best)."""
    model = metrics["models"][name]
    sweep = metrics.get("lr_sweep", {}).get(name, {})
    by_recipe = {}
    for recipe in metrics.get("lm_recipes", []):
        entry = sweep["by_recipe"][recipe]
        by_recipe[recipe] = entry["final_val_loss"][f"{entry['best']:g}"]["per_seed"]
    along = []
    curve = model.get("curves", {}).get("val", {})
    steps = metrics.get("budget", {}).get("steps")
    for i, step in enumerate(curve.get("step", []) if steps else []):
        along.append((step / steps, f"{curve['tokens'][i]:,} tokens", [seed[i] for seed in curve["loss"]]))
    return {"best": model["final_val_loss"]["per_seed"], "by_recipe": by_recipe, "along": along}


def retrieval_figures(retrieval: dict[str, Any], name: str, figure: Callable[[dict], float],
                      curve: Callable[[dict], float] | None = None, task: str = "mqar") -> dict[str, Any]:
    """``figure(run)`` per seed of retrieval model ``name``: at its best, under each recipe; and, with
    ``curve(point)``, along its learning curve (the budget in ``task`` examples)."""
    model = retrieval["models"][name]
    by_recipe = {recipe: [figure(r) for r in entry["runs"]] for recipe, entry in model.get("recipes", {}).items()}
    along = []
    runs = model["runs"]
    if curve is not None and all("curve" in r for r in runs):
        settings = retrieval["settings"]
        per_step = retrieval_examples_per_step(settings["batch_size"])[task]
        for i, point in enumerate(runs[0]["curve"]):
            if point["step"] > 0:
                along.append((point["step"] / settings["steps"], f"{point['step'] * per_step:,} {task} examples",
                              [curve(r["curve"][i]) for r in runs]))
    return {"best": [figure(r) for r in runs], "by_recipe": by_recipe, "along": along}


def compared(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """_claim's by_recipe and along arguments for the figures of model ``a`` against model ``b``."""
    by_recipe = {r: (a["by_recipe"][r], b["by_recipe"][r]) for r in a["by_recipe"] if r in b["by_recipe"]}
    along = [(fa, budget, va, vb) for (fa, budget, va), (fb, _, vb) in zip(a["along"], b["along"]) if fa == fb]
    return {"by_recipe": by_recipe, "along": along}


def _share(run: dict, layer: int, group: str) -> float:
    return run["attention"][layer][group]


def task_figures(metrics: dict[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """The figures of both tasks for each model of ``names`` (the rows of the claims, of the DIFF V2
    comparisons and of the sensitivity table): [{task, measure, better, figures: {name: figures}}]."""
    out = [{"task": "Language modelling", "measure": "final validation loss (nats/token)", "better": "lower",
            "figures": {n: lm_figures(metrics, n) for n in names}}]
    retrieval = metrics.get("retrieval")
    if not retrieval or not all(n in retrieval["models"] for n in names):
        return out
    from .retrieval import TASKS  # here: the retrieval module imports this one

    for task in TASKS:
        out.append({"task": f"Retrieval: {task}", "measure": f"{task} accuracy, mean over difficulty cells",
                    "better": "higher", "figures": {n: retrieval_figures(
                        retrieval, n, lambda r, t=task: r["mean_accuracy"][t], lambda p, t=task: p["mean_accuracy"][t],
                        task) for n in names}})
    if all("curve_area" in r for n in names for r in retrieval["models"][n]["runs"]):
        for task in TASKS:
            out.append({"task": f"Learning to retrieve: {task}",
                        "measure": f"{task}: mean accuracy over training (area under the learning curve)",
                        "better": "higher", "figures": {n: retrieval_figures(
                            retrieval, n, lambda r, t=task: r["curve_area"][t]) for n in names}})
    return out


def paper_claims(config: TrainConfig, metrics: dict[str, Any], suite: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims that this comparison's figures can speak to (DIFF vs the first standard model)."""
    pair = _pair(config, list(metrics["models"]))
    if pair is None:
        return []
    diff_name, base_name = pair
    rows = []
    paper_of = {
        "Language modelling": (f"{PAPER_TABLE6['diff']['valid'] - PAPER_TABLE6['transformer']['valid']:+.3f} "
                               "(1.4B, Table 6)", -1),
        "Retrieval: needle": ("+0.30 at N=6, R=2 (4K, Table 2)", +1),
        "Retrieval: mqar": ("no figure (Zoology's task)", +1),
        "Learning to retrieve: needle": ("no retrieval figure; the same LM loss with ~64% of the tokens (Fig. 3)", +1),
        "Learning to retrieve: mqar": ("no retrieval figure; the same LM loss with ~64% of the tokens (Fig. 3)", +1),
    }
    retrieval = metrics.get("retrieval")
    for entry in task_figures(metrics, pair):
        figures = entry["figures"]
        paper, paper_sign = paper_of[entry["task"]]
        claim, measure, note, testable = entry["task"], entry["measure"], "", True
        if entry["task"] == "Language modelling":
            measure += ", each at its best recipe and lr"
        elif entry["task"].startswith("Retrieval"):
            claim, measure = "Key-information retrieval", f"{measure} (chance {retrieval['chance']:.3f})"
            testable = max(statistics.fmean(f["best"]) for f in figures.values()) > 2 * retrieval["chance"]
            note = "" if testable else "both models near chance"
        else:
            claim = "Learning to retrieve"
        rows.append(_claim(claim, measure, entry["better"], figures[diff_name]["best"], figures[base_name]["best"],
                           paper, paper_sign, note, testable, **compared(figures[diff_name], figures[base_name])))

    if retrieval and diff_name in retrieval["models"] and base_name in retrieval["models"]:
        runs = {n: retrieval["models"][n]["runs"] for n in pair}
        layer = _deepest_measured_layer([r for n in pair for r in runs[n]])
        if layer is not None:
            where = "last layer" if layer == len(runs[diff_name][0]["attention"]) - 1 else f"layer {layer}"
            note = "" if where == "last layer" else "the last layer is not measurable: its rows sum to ~0 where λ is near 1"
            for claim, group, columns, better, paper_sign in (
                ("Attention to the answer", "answer", "the queried needle", "higher", +1),
                ("Attention noise", "noise", "noise and distractors", "lower", -1),
            ):
                figures = {n: retrieval_figures(retrieval, n, lambda r, g=group: _share(r, layer, g)) for n in pair}
                rows.append(_claim(claim, f"share of the answer row on {columns}, {where}", better,
                                   figures[diff_name]["best"], figures[base_name]["best"], _table3(group), paper_sign,
                                   note=note, **compared(figures[diff_name], figures[base_name])))
        else:
            rows.append({"claim": "Attention noise", "measure": "share of the answer row on noise and distractors",
                         "better": "lower", "diff": None, "transformer": None, "difference": None,
                         "paper": _table3("noise"), "paper_sign": -1, "by_recipe": {}, "along": [],
                         "verdict": "not testable here", "note": "no layer whose answer rows are measurable in every model"})
        bits = min(retrieval["settings"]["quantize_bits"])
        figures = {n: retrieval_figures(retrieval, n, lambda r: r["quantized_accuracy"]["full"]
                                        - r["quantized_accuracy"][str(bits)]) for n in pair}
        rows.append(_claim("Quantisation", f"retrieval accuracy lost with {bits}-bit attention logits (hardest cells)",
                           "lower", figures[diff_name]["best"], figures[base_name]["best"],
                           "DIFF loses ~25 points less at 4 bits (Fig. 8)", -1,
                           **compared(figures[diff_name], figures[base_name])))

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


def variant_comparisons(config: TrainConfig, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Every model of another attention kind than "standard" and "diff" (DIFF V2, symmetric DIFF, ...)
    against the Transformer and against DIFF, on both tasks: the paper makes no claim about them,
    so each row says which model is better, and what that depends on."""
    names = list(metrics["models"])
    pair = _pair(config, names)
    bases = [n for n in (pair or ()) if n in names]
    rows = []
    for name in names:
        if config.models[name].attention in ("standard", "diff") or not bases:
            continue
        label = config.models[name].display_name
        for base in reversed(bases):  # against the Transformer, then against DIFF
            for entry in task_figures(metrics, [name, base]):
                figures = entry["figures"]
                row = _claim(entry["task"], entry["measure"], entry["better"], figures[name]["best"],
                             figures[base]["best"], "—", +1, word=better_word(label, entry["better"]),
                             **compared(figures[name], figures[base]))
                rows.append({**row, "model": label, "baseline": config.models[base].display_name})
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
    """The claims table of report.md (with the along-training and per-recipe columns when any row has them)."""
    if not rows:
        return []
    dependent = any(row.get("along") or row.get("by_recipe") for row in rows)
    lines = [
        "## The paper's claims at this scale",
        "",
        f"DIFF minus the matched Transformer, each at its own best {'init recipe and ' if dependent else ''}learning "
        f"rate, mean over {seeds} seed{'s' if seeds > 1 else ''}, at the end of the budget; the interval is Welch's 95% "
        "interval of the difference. "
        + ("The same difference along training (at fractions of the budget, each model at its best) and under each "
           "init recipe (both models under it, each at its best lr there) follows. " if dependent else "")
        + "Verdict: **agrees** or **contradicts** when the interval excludes zero on one side, else **inconclusive**"
        + ("; **robust** when that holds under every recipe (two or more) and at every point from 1/4 of the budget "
           "on, else what it **depends on**." if dependent else "."),
        "",
        "| Claim | Measure (better) | Transformer | DIFF | DIFF − Transformer [95% CI] | "
        + ("Along training | Under each recipe | " if dependent else "") + "Paper | Verdict |",
        "|---|---|---:|---:|---:|" + ("---|---|" if dependent else "") + "---|---|",
    ]
    for row in rows:
        verdict_text = row["verdict"] + (f" ({row['note']})" if row["note"] else "")
        middle = f"{along_text(row)} | {recipes_text(row)} | " if dependent else ""
        lines.append(f"| {row['claim']} | {row['measure']} ({row['better']}) | {_cell(row['transformer'])} | "
                     f"{_cell(row['diff'])} | {interval_text(row['difference'])} | {middle}{row['paper']} | "
                     f"**{verdict_text}** |")
    return lines + [""]


def render_variants(rows: list[dict[str, Any]], seeds: int) -> list[str]:
    """The table of the attention kinds the paper's claims are not about (DIFF V2, ...)."""
    if not rows:
        return []
    lines = [
        "## The other attention kinds (no claim of the paper applies)",
        "",
        f"Each model against the Transformer and against DIFF, each at its own best init recipe and learning rate, "
        f"mean over {seeds} seed{'s' if seeds > 1 else ''}; difference = model − baseline with Welch's 95% interval. "
        "The paper's claims are about DIFF (V1); the authors' DIFF V2 notes make none of these measurements.",
        "",
        "| Model | Against | Measure (better) | Model | Baseline | Difference [95% CI] | Along training | "
        "Under each recipe | Verdict |",
        "|---|---|---|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['model']} | {row['baseline']} | {row['measure']} ({row['better']}) | "
                     f"{_cell(row['diff'])} | {_cell(row['transformer'])} | {interval_text(row['difference'])} | "
                     f"{along_text(row)} | {recipes_text(row)} | **{row['verdict']}** |")
    return lines + [""]


def interval_text(d: dict[str, Any] | None) -> str:
    """"+0.12 [+0.08, +0.16]", or the difference alone without an interval, or – when there is none."""
    if d is None:
        return "–"
    return f"{_signed(d['delta'])}" + (f" [{_signed(d['low'])}, {_signed(d['high'])}]" if d["low"] is not None else "")


def along_text(row: dict[str, Any], shown: Sequence[float] = (0.125, 0.25, 0.5, 1.0)) -> str:
    """The difference at the measured points nearest to ``shown`` fractions of the budget."""
    points = row.get("along") or []
    if not points:
        return "–"
    picked = sorted({min(range(len(points)), key=lambda i: abs(points[i]["fraction"] - f)) for f in shown})
    return "; ".join(f"{_signed(points[i]['delta'])} at {fraction_label(points[i]['fraction'])}" for i in picked)


def recipes_text(row: dict[str, Any]) -> str:
    recipes = row.get("by_recipe") or {}
    return "; ".join(f"{r} {interval_text(d)}" for r, d in recipes.items()) or "–"


def _signed(x: float) -> str:
    return "+0" if abs(x) < 1e-12 else f"{x:+.3g}"


def _cell(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "–"
    mean = 0.0 if abs(stats["mean"]) < 1e-12 else stats["mean"]  # float rounding of a zero difference
    return f"{mean:.4g}" + (f" ± {stats['std']:.2g}" if stats["std"] is not None else "")
