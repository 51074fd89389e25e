"""The paper's claims, one by one, tested on the models of a comparison, with what each depends on.

For each claim a headline figure is computed per seed for DIFF and for the matched Transformer,
each at its own best (init recipe, learning rate), at the end of the budget; the difference of
their means gets a 95% confidence interval (Welch's t interval over seeds). The verdict word is
"agrees" when the interval excludes zero on the paper's side, "contradicts" when it excludes zero
on the other side, and "inconclusive" otherwise (or "not testable here" when the figure cannot
tell the models apart, e.g. both at chance).

The same difference is also taken under each init recipe both models were trained with (each at
its best learning rate there) and along training (the language models' validation curve, the
retrieval and grounded models' learning curves). A claim is **robust** when its word is the same at the end,
under every recipe and at every point from a quarter of the budget on; otherwise the verdict says
what it **depends on** (the recipe, the budget) and the row gives the figures that carry it.
Figures come from the runs' summaries, the retrieval and grounded experiments and the evaluation
suite's JSON (their own modules say exactly what each measures).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..evaluation.stats import Difference, MeanStd, welch_difference
from ..paper import ATTENTION_TABLE3, HALLUCINATION_TABLE4, OUTLIERS_TABLE5, PAPER_TABLE6
from .config import ExperimentConfig, retrieval_examples_per_step
from .grounded import GroundedResult
from .language_models import LanguageModelling
from .results import AnswerShares, CurvePoint, GroundedPoint, GroundedRun, RetrievalRun
from .retrieval import TASKS, RetrievalResult

ROBUST_FROM = 0.25  # along training, the points from this fraction of the budget on must agree
Word = Callable[[Difference], str]
Learned = Callable[[Sequence[float]], bool]  # whether language models with these losses (per seed) have learned
NOT_LEARNED_REASON = "the models have not passed a bigram table"
NOT_LEARNED = f"not judged: {NOT_LEARNED_REASON}"


@dataclass
class AlongValues:
    """A figure per seed at one point of training: ``fraction`` of the budget, described in ``budget``."""

    fraction: float
    budget: str
    values: list[float]


@dataclass
class Figures:
    """One figure of one model, per seed: at its best (recipe, lr), under each init recipe (at its
    best lr there) and along training (at its best); and the parameters of the model it measures (the
    language model, or the task's small model)."""

    best: list[float]
    by_recipe: dict[str, list[float]] = field(default_factory=dict)
    along: list[AlongValues] = field(default_factory=list)
    parameters: int | None = None


@dataclass
class TaskFigures:
    """The figures of one task for several models: a row of the claims and of the sensitivity table."""

    task: str
    measure: str
    better: str  # "lower" or "higher" ("neither": a figure with no better side)
    figures: dict[str, Figures]
    # language modelling: judged only where both models passed the bigram (keyword-only: the subclasses' fields follow)
    learned: Learned | None = field(default=None, kw_only=True)


@dataclass
class AlongDifference:
    fraction: float
    budget: str
    difference: Difference
    judged: bool = True  # False: a model had not passed its data's bigram there (no verdict drawn)


@dataclass
class Claim:
    """One row: a model's figure against a baseline's (DIFF against the Transformer for the paper's
    claims), their difference with its interval, under each recipe and along training, the paper's
    figure and the verdict."""

    claim: str
    measure: str
    better: str
    ours: MeanStd | None
    base: MeanStd | None
    difference: Difference | None
    paper: str
    paper_sign: int  # the sign of DIFF − Transformer the paper found (0: the paper makes no such claim)
    verdict: str
    note: str = ""
    by_recipe: dict[str, Difference] = field(default_factory=dict)
    along: list[AlongDifference] = field(default_factory=list)
    model: str = "DIFF"  # what ``ours`` is (the other attention kinds' rows name theirs)
    baseline: str = "Transformer"
    parameters: tuple[int | None, int | None] = (None, None)  # the measured models': (ours, the baseline's)


def verdict(diff: Difference, paper_sign: int) -> str:
    """agrees / contradicts / inconclusive, from the interval and the sign the paper reports."""
    if diff.sign is None:
        return "inconclusive (one seed)"
    if diff.sign == 0:
        return "inconclusive"
    return "agrees" if diff.sign == paper_sign else "contradicts"


def paper_word(paper_sign: int) -> Word:
    """The verdict word of a paper claim: agrees / contradicts / inconclusive."""
    return lambda diff: verdict(diff, paper_sign)


def better_word(label: str, better: str) -> Word:
    """The verdict word of a comparison the paper does not make ("DIFF V2 better" / "worse"; for a
    figure with no better side, ``better`` "neither", "DIFF higher" / "lower")."""
    def word(diff: Difference) -> str:
        if diff.sign is None:
            return "inconclusive (one seed)"
        if diff.sign == 0:
            return "inconclusive"
        if better == "neither":
            return f"{label} {'higher' if diff.sign > 0 else 'lower'}"
        return f"{label} {'better' if (diff.sign > 0) == (better == 'higher') else 'worse'}"
    return word


def dependence(head: Difference, by_recipe: dict[str, Difference], along: Sequence[AlongDifference], word: Word) -> str:
    """The verdict of a claim from its difference at the end (``head``), under each recipe and along
    training (``along``, the last at the end): "robust: W" when every one of them gives the same word W
    (and two recipes or more were tried), else "depends on the recipe / the budget: ..." naming where."""
    headword = word(head)
    recipe_words = {recipe: word(d) for recipe, d in by_recipe.items()}
    along_words = [(p, word(p.difference)) for p in along if p.fraction >= ROBUST_FROM]
    if not recipe_words and not along_words:
        return headword
    if len({headword, *recipe_words.values(), *(w for _, w in along_words)}) == 1:
        if len(recipe_words) < 2:  # the same along training, but the recipe was not varied: not "robust"
            tried = (f"one init recipe tried: {next(iter(recipe_words))}" if recipe_words
                     else "the init recipe not varied")
            return f"{headword}{' along training' if along_words else ''} ({tried})"
        return ("inconclusive at every recipe and budget" if headword.startswith("inconclusive")
                else f"robust: {headword}")
    parts = []
    if len(set(recipe_words.values())) > 1:
        parts.append("the recipe: " + ", ".join(f"{w} under {r}" for r, w in recipe_words.items()))
    elif recipe_words and headword not in recipe_words.values():  # the recipes agree, the best-of pair does not
        parts.append(f"the recipe: {next(iter(recipe_words.values()))} under "
                     f"{'each shared recipe' if len(recipe_words) > 1 else next(iter(recipe_words))}, "
                     f"{headword} with each model at its own best recipe")
    if len({w for _, w in along_words}) > 1:
        parts.append("the budget: " + ", ".join(f"{w} at {fraction_label(p.fraction)}" for p, w in along_words))
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


def make_claim(claim: str, measure: str, better: str, ours: Figures, base: Figures, paper: str, paper_sign: int,
               *, note: str = "", testable: bool = True, word: Word | None = None,
               learned: Learned | None = None) -> Claim:
    """One row from two models' figures: the difference at the end, under every recipe both have and
    at every point of training both have; ``word`` names a difference (default: against the paper).
    With ``learned`` (language modelling), a point where either model has not passed its data's bigram
    table is shown but not judged, and the verdict is :data:`NOT_LEARNED` when the end is such a point."""
    diff = welch_difference(ours.best, base.best)
    word = word or paper_word(paper_sign)
    both = (lambda a, b: learned(a) and learned(b)) if learned else (lambda a, b: True)
    shared = [r for r in ours.by_recipe if r in base.by_recipe and ours.by_recipe[r] and base.by_recipe[r]]
    recipes = {r: welch_difference(ours.by_recipe[r], base.by_recipe[r]) for r in shared}  # every one shown
    judged_recipes = {r: recipes[r] for r in shared if both(ours.by_recipe[r], base.by_recipe[r])}
    along = [AlongDifference(a.fraction, a.budget, welch_difference(a.values, b.values), both(a.values, b.values))
             for a, b in zip(ours.along, base.along) if a.fraction == b.fraction and a.values and b.values]
    if not testable:
        text = "not testable here"
    elif not both(ours.best, base.best):
        text = NOT_LEARNED
    else:
        text = dependence(diff, judged_recipes, [p for p in along if p.judged], word)
    return Claim(claim, measure, better, MeanStd.of(ours.best), MeanStd.of(base.best), diff, paper, paper_sign,
                 verdict=text, note=note, by_recipe=recipes, along=along, parameters=(ours.parameters, base.parameters))


def pair(config: ExperimentConfig, names: Sequence[str]) -> tuple[str, str] | None:
    """(DIFF model, its Transformer baseline): the first of each kind."""
    diff = next((n for n in names if config.attention(n) == "diff"), None)
    base = next((n for n in names if config.attention(n) == "standard"), None)
    return (diff, base) if diff and base else None


# --- the figures each claim reads, per model: at its best, under each recipe, along training --------


def lm_figures(lm: LanguageModelling, name: str) -> Figures:
    """Final validation loss per seed of model ``name``: at its best, under each LM recipe (at its best
    lr there) and along training (its validation curve at its best)."""
    model, sweep = lm.models[name], lm.sweeps[name]
    by_recipe = {recipe: list(sweep.scores[recipe][sweep.best_lr[recipe]].per_seed) for recipe in lm.recipes}
    curve, steps = model.val_curve, model.steps or lm.budget.steps  # a budget in FLOPs: the model's own steps
    along = [AlongValues(step / steps, f"{curve.tokens[i]:,} tokens", [seed[i] for seed in curve.values])
             for i, step in enumerate(curve.step)]
    return Figures(list(model.final_val_loss.per_seed), by_recipe, along, model.parameters)


def retrieval_figures(retrieval: RetrievalResult, name: str, figure: Callable[[RetrievalRun], float],
                      curve: Callable[[CurvePoint], float] | None = None, task: str = "mqar") -> Figures:
    """``figure(run)`` per seed of retrieval model ``name``: at its best, under each recipe; and, with
    ``curve(point)``, along its learning curve (the budget in ``task`` examples)."""
    model = retrieval.models[name]
    by_recipe = {recipe: [figure(r) for r in model.sweep.at(recipe)] for recipe in model.sweep.runs if recipe}
    along = []
    runs = model.runs
    if curve is not None:
        settings = retrieval.settings
        per_step = retrieval_examples_per_step(settings.batch_size)[task]
        along = [AlongValues(point.step / settings.steps, f"{point.step * per_step:,} {task} examples",
                             [curve(r.curve[i]) for r in runs])
                 for i, point in enumerate(runs[0].curve) if point.step > 0]
    return Figures([figure(r) for r in runs], by_recipe, along, model.parameters)


def grounded_figures(grounded: GroundedResult, name: str, figure: Callable[[GroundedRun], float],
                     curve: Callable[[GroundedPoint], float]) -> Figures:
    """``figure(run)`` per seed of grounded model ``name``: at its best, under each recipe, and along its
    learning curve (``curve(point)``; the budget in episodes)."""
    model = grounded.models[name]
    settings = grounded.settings
    per_step = settings.batch_size - settings.closed_book
    by_recipe = {recipe: [figure(r) for r in model.sweep.at(recipe)] for recipe in model.sweep.runs if recipe}
    along = [AlongValues(point.step / settings.steps, f"{point.step * per_step:,} episodes",
                         [curve(r.curve[i]) for r in model.runs])
             for i, point in enumerate(model.runs[0].curve) if point.step > 0]
    return Figures([figure(r) for r in model.runs], by_recipe, along, model.parameters)


def mean_lookback(per_layer: Sequence[float | None]) -> float:
    """The lookback ratio averaged over the layers where it is defined (NaN where none is)."""
    values = [v for v in per_layer if v is not None]
    return statistics.fmean(values) if values else float("nan")


def task_figures(lm: LanguageModelling, retrieval: RetrievalResult | None, names: Sequence[str],
                 grounded: GroundedResult | None = None) -> list[TaskFigures]:
    """The figures of every task for each model of ``names`` (the rows of the claims, of the other
    kinds' comparisons and of the sensitivity table)."""
    unit = lm.reference.unit if lm.reference else "token"
    out = [TaskFigures("Language modelling", f"final validation loss (nats/{unit})", "lower",
                       {n: lm_figures(lm, n) for n in names}, learned=lm.learned)]
    out += _retrieval_task_figures(retrieval, names)
    if grounded is not None and all(n in grounded.models for n in names):
        out.append(TaskFigures(
            "Contextual hallucination", "grounded accuracy: answered as the document warrants (its attribute; "
            "UNKNOWN where it lacks the fact), mean over agreeing, counterfactual and lacking documents", "higher",
            {n: grounded_figures(grounded, n, lambda r: r.scores.accuracy, lambda p: p.scores.accuracy)
             for n in names}))
        out.append(TaskFigures(  # a detector within a model (Lookback Lens), not a score: no better side
            "Lookback ratio", "lookback ratio of the answering rows (higher: more attention per token on the "
            "context), mean over layers, heads and questions", "neither",
            {n: grounded_figures(grounded, n, lambda r: mean_lookback(r.lookback), lambda p: mean_lookback(p.lookback))
             for n in names}))
    return out


def _retrieval_task_figures(retrieval: RetrievalResult | None, names: Sequence[str]) -> list[TaskFigures]:
    """The retrieval experiment's rows: accuracy at the end and over training, per task."""
    out: list[TaskFigures] = []
    if retrieval is None or not all(n in retrieval.models for n in names):
        return out
    for task in TASKS:
        out.append(TaskFigures(f"Retrieval: {task}", f"{task} accuracy, mean over difficulty cells", "higher", {
            n: retrieval_figures(retrieval, n, lambda r, t=task: r.mean_accuracy[t],
                                 lambda p, t=task: p.mean_accuracy[t], task) for n in names}))
    for task in TASKS:
        out.append(TaskFigures(f"Learning to retrieve: {task}",
                               f"{task}: mean accuracy over training (area under the learning curve)", "higher",
                               {n: retrieval_figures(retrieval, n, lambda r, t=task: r.curve_area[t]) for n in names}))
    return out


PAPER_OF = {
    "Language modelling": (f"{PAPER_TABLE6['diff']['valid'] - PAPER_TABLE6['transformer']['valid']:+.3f} "
                           "(1.4B, Table 6)", -1),
    "Retrieval: needle": ("+0.30 at N=6, R=2 (4K, Table 2)", +1),
    "Retrieval: mqar": ("no figure (Zoology's task)", +1),
    "Learning to retrieve: needle": ("no retrieval figure; the same LM loss with ~64% of the tokens (Fig. 3)", +1),
    "Learning to retrieve: mqar": ("no retrieval figure; the same LM loss with ~64% of the tokens (Fig. 3)", +1),
    "Contextual hallucination": (f"{HALLUCINATION_TABLE4['range']} accuracy (Table 4, GPT-4o-judged)", +1),
    "Lookback ratio": ("no figure (Lookback Lens: within a model, a higher ratio goes with grounded answers)", 0),
}


def paper_claims(config: ExperimentConfig, lm: LanguageModelling, retrieval: RetrievalResult | None,
                 suite: dict[str, Any], grounded: GroundedResult | None = None) -> list[Claim]:
    """The claims that this comparison's figures can speak to (DIFF vs the first standard model);
    ``suite`` is the evaluation suite's data (evaluation name -> its JSON result)."""
    found = pair(config, list(lm.models))
    if found is None:
        return []
    diff_name, base_name = found
    rows = []
    for entry in task_figures(lm, retrieval, found, grounded):
        figures = entry.figures
        paper, paper_sign = PAPER_OF[entry.task]
        claim, measure, note, testable = entry.task, entry.measure, "", True
        word = None if paper_sign else better_word("DIFF", entry.better)
        if entry.task in ("Contextual hallucination", "Lookback ratio"):
            claim = "Contextual hallucination" + (": lookback ratio" if entry.task == "Lookback ratio" else "")
        elif entry.task == "Language modelling":
            measure += ", each at its best recipe and lr"
        elif entry.task.startswith("Retrieval"):
            claim, measure = "Key-information retrieval", f"{measure} (chance {retrieval.chance:.3f})"
            testable = max(statistics.fmean(f.best) for f in figures.values()) > 2 * retrieval.chance
            note = "" if testable else "both models near chance"
        else:
            claim = "Learning to retrieve"
        rows.append(make_claim(claim, measure, entry.better, figures[diff_name], figures[base_name], paper, paper_sign,
                               note=note, testable=testable, word=word, learned=entry.learned))
    if retrieval is not None and diff_name in retrieval.models and base_name in retrieval.models:
        rows += _attention_claims(retrieval, found)
    rows += _evaluation_claims(config, lm, found, suite)
    return rows


def _attention_claims(retrieval: RetrievalResult, names: tuple[str, str]) -> list[Claim]:
    diff_name, base_name = names
    rows = []
    layer = deepest_measured_layer([r.attention for n in names for r in retrieval.models[n].runs])
    if layer is not None:
        where = "last layer" if layer == len(retrieval.models[diff_name].runs[0].attention) - 1 else f"layer {layer}"
        note = "" if where == "last layer" else "the last layer is not measurable: its rows sum to ~0 where λ is near 1"
        for claim, group, columns, better, paper_sign in (
            ("Attention to the answer", "answer", "the queried needle", "higher", +1),
            ("Attention noise", "noise", "noise and distractors", "lower", -1),
        ):
            figures = {n: retrieval_figures(retrieval, n, lambda r, g=group: getattr(r.attention[layer], g))
                       for n in names}
            rows.append(make_claim(claim, f"share of the answer row on {columns}, {where}", better, figures[diff_name],
                                   figures[base_name], table3(group), paper_sign, note=note))
    else:
        rows.append(Claim("Attention noise", "share of the answer row on noise and distractors", "lower", None, None,
                          None, table3("noise"), -1, "not testable here",
                          "no layer whose answer rows are measurable in every model"))
    bits = min(retrieval.settings.quantize_bits)
    figures = {n: retrieval_figures(retrieval, n,
                                    lambda r: r.quantized_accuracy["full"] - r.quantized_accuracy[str(bits)])
               for n in names}
    rows.append(make_claim("Quantisation", f"retrieval accuracy lost with {bits}-bit attention logits (hardest cells)",
                           "lower", figures[diff_name], figures[base_name],
                           "DIFF loses ~25 points less at 4 bits (Fig. 8)", -1))
    return rows


@dataclass
class EvaluationFigures(TaskFigures):
    """An evaluation's headline figure per seed of each model it ran on, and how the paper's claims read
    it: the paper's figure and the sign of DIFF − Transformer it found (0: no claim of the paper; the
    verdict then says which model is better), a note."""

    paper: str = "—"
    paper_sign: int = 0
    note: str = ""
    testable: bool = True


def evaluation_figures(config: ExperimentConfig, lm: LanguageModelling, names: Sequence[str],
                       suite: dict[str, Any]) -> list[EvaluationFigures]:
    """The evaluation suite's figures for the models of ``names``, per seed ("DIFF s0", ...); an
    evaluation that did not run on every seed of every one of them gives no row."""
    labels = {n: [seed_label(config, n, s) for s in lm.models[n].seeds] for n in names}

    def per_seed(evaluation: str, figure: Callable[[dict], float | None]) -> dict[str, Figures] | None:
        results = suite.get(evaluation, {}).get("models", {})
        values = {n: [figure(results[label]) for label in labels[n] if label in results] for n in names}
        if any(len(v) < len(labels[n]) or None in v for n, v in values.items()):
            return None
        return {n: Figures(v, parameters=lm.models[n].parameters) for n, v in values.items()}

    rows = []
    t5 = OUTLIERS_TABLE5
    for tensor, key in (("attention logits", "attention_logits"), ("hidden states", "hidden_states")):
        ratio = per_seed("outliers", lambda r, key=key: r[key]["top1"] / r[key]["median"] if r[key]["median"] else None)
        if ratio:
            top1, median = 0, t5["columns"].index("median")
            paper = (t5[key]["diff"][top1] / t5[key]["diff"][median]
                     - t5[key]["standard"][top1] / t5[key]["standard"][median])
            rows.append(EvaluationFigures("Activation outliers", f"top-1 / median magnitude of {tensor}", "lower",
                                          ratio, f"{paper:+.0f} (Table 5)", -1))
    massive = per_seed("outliers", _largest_layer_ratio)
    if massive:
        rows.append(EvaluationFigures(
            "Massive activations", "the largest hidden-state magnitude over its layer's median, the largest over "
            "layers (Sun et al. 2024)", "lower", massive, "no figure (Table 5 is over all layers)", 0))
    sink = per_seed("attention-sink", lambda r: r["mean_over_layers"]["mean"])
    if sink:
        rows.append(EvaluationFigures(
            "Attention sink", "share of attention on the first token, mean over layers (queries from the second on)",
            "lower", sink, "no figure (gated attention, Qiu et al. 2025: ~0.47 → ~0.05)", 0))
    quantized = per_seed("quantization", _loss_increase_at_fewest_bits)
    if quantized:
        rows.append(EvaluationFigures("Quantisation", "validation loss added by the fewest-bit attention logits "
                                      "(LM models)", "lower", quantized, "DIFF degrades less (Fig. 8)", -1))
    icl = per_seed("icl", _icl_accuracy)
    if icl:
        chance = _icl_chance(suite["icl"]["models"][labels[names[0]][0]])
        testable = max(statistics.fmean(f.best) for f in icl.values()) > chance + 0.1
        note = "" if testable else "all models near chance"
        rows.append(EvaluationFigures("In-context learning", f"many-shot accuracy at the most demonstrations (chance "
                                      f"{chance:.2f})", "higher", icl, "+5.2 to +21.6 points (Fig. 6)", +1, note,
                                      testable))
        spread = per_seed("icl", _icl_spread)
        if spread:
            rows.append(EvaluationFigures("ICL robustness", "accuracy spread over demonstration orders", "lower",
                                          spread, "smaller spread (Fig. 7)", -1, note, testable))
    return rows


def _evaluation_claims(config: ExperimentConfig, lm: LanguageModelling, names: tuple[str, str],
                       suite: dict[str, Any]) -> list[Claim]:
    """The claims the evaluation suite's results speak to, DIFF against the Transformer."""
    diff_name, base_name = names
    rows = []
    for entry in evaluation_figures(config, lm, names, suite):
        figures = entry.figures
        word = None if entry.paper_sign else better_word("DIFF", entry.better)
        note = entry.note.replace("all models", "both models")
        if entry.task == "Activation outliers":
            raw = "hidden_states" if "hidden" in entry.measure else "attention_logits"
            top1 = {n: statistics.fmean(suite["outliers"]["models"][seed_label(config, n, s)][raw]["top1"]
                                        for s in lm.models[n].seeds) for n in names}
            note = (f"raw top-1 DIFF {top1[diff_name]:.3g} vs {top1[base_name]:.3g}; the ratio discounts each "
                    "model's scale")
        rows.append(make_claim(entry.task, entry.measure, entry.better, figures[diff_name], figures[base_name],
                               entry.paper, entry.paper_sign, note=note, testable=entry.testable, word=word))
    return rows


def variant_comparisons(config: ExperimentConfig, lm: LanguageModelling, retrieval: RetrievalResult | None,
                        suite: dict[str, Any] | None = None, grounded: GroundedResult | None = None) -> list[Claim]:
    """Every model but the pair the paper's claims compare (DIFF V2, symmetric DIFF, gated attention, the
    wide-head Transformer, an ablation...) against the Transformer and against DIFF, on both tasks and the
    evaluations that ran on both: the paper makes no claim about them, so each row says which model is
    better, and what that depends on."""
    names = list(lm.models)
    bases = list(pair(config, names) or ())
    rows = []
    for name in names:
        if name in bases or not bases:
            continue
        label = config.model_name(name)
        for base in reversed(bases):  # against the Transformer, then against DIFF
            entries = task_figures(lm, retrieval, [name, base], grounded) + evaluation_figures(config, lm, [name, base],
                                                                                              suite or {})
            for entry in entries:
                row = make_claim(entry.task, entry.measure, entry.better, entry.figures[name], entry.figures[base], "—",
                                 +1, word=better_word(label, entry.better), learned=entry.learned)
                row.model, row.baseline = label, config.model_name(base)
                rows.append(row)
    return rows


def seed_label(config: ExperimentConfig, name: str, seed: int) -> str:
    """How one seed of one model is named in the evaluations: "DIFF s0"."""
    return f"{config.model_name(name)} s{seed}"


def table3(group: str) -> str:
    t3 = ATTENTION_TABLE3
    delta = statistics.fmean(t3["diff"][group]) - statistics.fmean(t3["standard"][group])
    return f"{delta:+.2f} (Table 3, mean over depths)"


def deepest_measured_layer(attention: Sequence[Sequence[AnswerShares | None]]) -> int | None:
    """The deepest layer whose answer-row shares exist in every run's ``attention`` (a DIFF layer with
    λ near 1 has rows summing to ~0, whose shares are not defined), or None."""
    layers = range(min(len(a) for a in attention) - 1, -1, -1)
    return next((i for i in layers if all(a[i] is not None for a in attention)), None)


def _largest_layer_ratio(result: dict) -> float | None:
    """The largest, over layers, of a layer's top-1 hidden-state magnitude over its median."""
    ratios = [r for r in result["hidden_states"].get("per_layer_ratio", []) if r is not None]
    return max(ratios) if ratios else None


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
