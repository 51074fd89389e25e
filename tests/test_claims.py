"""The claims table: the difference's interval computed by hand, the verdict rule, the figures read."""

import math

import pytest

from diff_transformer.evaluation.stats import Difference, t_quantile, welch_difference
from diff_transformer.experiments import load_experiment
from diff_transformer.experiments.claims import (
    AlongDifference,
    better_word,
    dependence,
    fraction_label,
    paper_claims,
    paper_word,
    verdict,
)
from diff_transformer.experiments.language_models import Budget, LanguageModelling
from diff_transformer.experiments.report import render_claims
from planted import lm_sweep as _lm_sweep
from planted import retrieval as _retrieval
from planted import retrieval_run as _run
from planted import summary as _summary


def test_welch_interval_matches_a_hand_computation():
    # ours 1, 2, 3 (variance 1), base 0, 0, 0 (variance 0): se = sqrt(1/3), Welch df = 2, t(2) = 4.303.
    d = welch_difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    half = 4.303 * math.sqrt(1 / 3)
    assert d.delta == pytest.approx(2.0)
    assert d.low == pytest.approx(2.0 - half, abs=1e-3) and d.high == pytest.approx(2.0 + half, abs=1e-3)
    # Equal variances and sizes: df = 2n − 2 = 4, t(4) = 2.776, se = sqrt(2·var/n).
    d = welch_difference([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert d.delta == pytest.approx(-1.0)
    assert d.high == pytest.approx(-1.0 + 2.776 * math.sqrt(2 / 3), abs=1e-3)
    assert welch_difference([1.0], [2.0]) == Difference(-1.0)
    # Student's t from tables: 12.706 (df 1), 2.571 (df 5), 2.042 (df 30), 1.960 in the limit.
    assert [round(t_quantile(df), 3) for df in (1, 5, 30, 1e9)] == [12.706, 2.571, 2.042, 1.96]
    assert 3.182 < t_quantile(2.5) < 4.303  # between df 3 and df 2


def _d(low, high):
    return Difference((low + high) / 2, low, high)


AGREE, AGAINST, NULL = _d(0.1, 0.3), _d(-0.3, -0.1), _d(-0.1, 0.2)  # for a claim whose paper sign is +1


def test_the_verdict_follows_the_interval_and_the_papers_sign():
    assert verdict(Difference(-0.1, -0.2, -0.05), -1) == "agrees"
    assert verdict(Difference(0.1, 0.05, 0.2), -1) == "contradicts"
    assert verdict(Difference(0.1, 0.05, 0.2), +1) == "agrees"
    assert verdict(Difference(0.01, -0.05, 0.07), -1) == "inconclusive"
    assert verdict(Difference(0.01), -1) == "inconclusive (one seed)"


CONFIG = load_experiment("tiny")


def _lm(diff_loss, base_loss):
    models = {"standard": _summary("standard", base_loss), "diff": _summary("diff", diff_loss)}
    sweeps = {n: _lm_sweep(n, {None: (1e-3, {1e-3: list(m.final_val_loss.per_seed)})}) for n, m in models.items()}
    return LanguageModelling(Budget(4, 2, 32, 0, {}), models, sweeps, [])


def test_claims_read_the_right_figures_of_each_model():
    retrieval = _retrieval({
        "standard": [_run(0.55, 0.4, ((0, 1), (0.2, 0.7)), 0.6, 0.3), _run(0.56, 0.5, ((0, 1), (0.3, 0.6)), 0.7, 0.3)],
        "diff": [_run(0.85, 0.7, ((0, 1), (0.5, 0.3)), 0.8, 0.7), _run(0.86, 0.8, ((0, 1), (0.6, 0.2)), 0.9, 0.8)],
    })
    suite = {"outliers": {"models": {
        "Transformer s0": {"attention_logits": {"top1": 40.0, "median": 2.0},
                           "hidden_states": {"top1": 9.0, "median": 3.0}},
        "Transformer s1": {"attention_logits": {"top1": 60.0, "median": 2.0},
                           "hidden_states": {"top1": 12.0, "median": 3.0}},
        "DIFF s0": {"attention_logits": {"top1": 10.0, "median": 1.0}, "hidden_states": {"top1": 6.0, "median": 2.0}},
        "DIFF s1": {"attention_logits": {"top1": 12.0, "median": 1.0}, "hidden_states": {"top1": 8.0, "median": 2.0}},
    }}}
    rows = {r.measure.split(" (")[0]: r for r in paper_claims(CONFIG, _lm([3.0, 3.2], [3.1, 3.3]), retrieval, suite)}
    lm = rows["final validation loss"]
    assert lm.ours.mean == pytest.approx(3.1) and lm.base.mean == pytest.approx(3.2)
    assert lm.difference.delta == pytest.approx(-0.1) and lm.verdict.startswith("inconclusive")
    needle = rows["needle accuracy, mean over difficulty cells"]
    assert needle.difference.delta == pytest.approx(0.3) and needle.verdict.startswith("agrees")
    mqar = rows["mqar accuracy, mean over difficulty cells"]
    assert mqar.difference.delta == pytest.approx(0.3) and mqar.verdict.startswith("inconclusive")  # ±0.30 > 0.30
    answer = rows["share of the answer row on the queried needle, last layer"]
    assert answer.ours.per_seed == (0.5, 0.6) and answer.base.per_seed == (0.2, 0.3)
    noise = rows["share of the answer row on noise and distractors, last layer"]
    assert noise.difference.delta == pytest.approx(0.25 - 0.65) and noise.verdict.startswith("agrees")
    quant = rows["retrieval accuracy lost with 4-bit attention logits"]
    assert quant.ours.per_seed == pytest.approx([0.1, 0.1]) and quant.base.per_seed == pytest.approx([0.3, 0.4])
    logits = rows["top-1 / median magnitude of attention logits"]
    assert logits.ours.per_seed == (10.0, 12.0) and logits.base.per_seed == (20.0, 30.0)
    hidden = rows["top-1 / median magnitude of hidden states"]
    assert hidden.ours.per_seed == (3.0, 4.0) and hidden.base.per_seed == (3.0, 4.0)
    assert hidden.verdict == "inconclusive"
    table = "\n".join(render_claims(list(rows.values()), 2))
    assert "| Language modelling |" in table and "**agrees" in table and "[95% CI]" in table


def test_retrieval_near_chance_is_not_tested():
    retrieval = _retrieval({"standard": [_run(0.10, 0.1)] * 2, "diff": [_run(0.15, 0.12), _run(0.16, 0.12)]},
                           chance=0.1)
    rows = paper_claims(CONFIG, _lm([3.0, 3.1], [3.0, 3.1]), retrieval, {})
    needle = next(r for r in rows if r.measure.startswith("needle"))
    assert needle.verdict == "not testable here" and "chance" in needle.note


def test_attention_claims_use_the_deepest_layer_measured_in_every_model():
    share = lambda answer: (answer, 1.0 - answer)  # noqa: E731
    # DIFF's last layer has no measurable rows (None): layer 0 is compared, and the row says so.
    retrieval = _retrieval({"standard": [_run(0.5, 0.5, (share(0.1), share(0.3))),
                                         _run(0.5, 0.5, (share(0.2), share(0.3)))],
                            "diff": [_run(0.5, 0.5, (share(0.4), None)), _run(0.5, 0.5, (share(0.5), share(0.9)))]})
    rows = {r.measure: r for r in paper_claims(CONFIG, _lm([3.0, 3.1], [3.0, 3.1]), retrieval, {})}
    answer = rows["share of the answer row on the queried needle, layer 0"]
    assert answer.ours.per_seed == (0.4, 0.5) and answer.base.per_seed == (0.1, 0.2)
    assert "not measurable" in answer.note
    # No layer measurable everywhere: one row, not testable, with no figures.
    retrieval.models["diff"].sweep.runs[None][1e-3] = [_run(0.5, 0.5, (None, None))] * 2
    rows = paper_claims(CONFIG, _lm([3.0, 3.1], [3.0, 3.1]), retrieval, {})
    noise = next(r for r in rows if r.claim == "Attention noise")
    assert noise.verdict == "not testable here" and noise.ours is None
    assert ("| Attention noise | share of the answer row on noise and distractors (lower) | – / – | – | – | – |"
            in "\n".join(render_claims(rows, 2)))


def _along(*pairs):
    return [AlongDifference(f, "", d) for f, d in pairs]


def test_a_claim_is_robust_only_when_every_recipe_and_budget_says_the_same():
    word = paper_word(+1)
    along = _along((0.125, NULL), (0.25, AGREE), (0.5, AGREE), (1.0, AGREE))
    # 1/8 of the budget is before the robustness window: it does not count.
    assert dependence(AGREE, {"scaled-init": AGREE, "plain-init": AGREE}, along, word) == "robust: agrees"
    assert dependence(AGAINST, {"scaled-init": AGAINST, "plain-init": AGAINST}, [], word) == "robust: contradicts"
    # One recipe tried: the same word along training is not robustness to the recipe.
    assert dependence(AGAINST, {"scaled-init": AGAINST}, _along((1.0, AGAINST)), word) == \
        "contradicts along training (one init recipe tried: scaled-init)"
    assert dependence(AGREE, {}, along[1:], word) == "agrees along training (the init recipe not varied)"
    assert dependence(NULL, {"scaled-init": NULL, "plain-init": NULL}, [], word) == \
        "inconclusive at every recipe and budget"
    assert dependence(AGREE, {}, [], word) == "agrees"  # nothing else measured: the plain word
    assert dependence(AGREE, {"scaled-init": AGREE, "plain-init": NULL}, along, word) == \
        "depends on the recipe: agrees under scaled-init, inconclusive under plain-init"
    late = _along((0.25, NULL), (0.5, AGREE), (1.0, AGREE))
    assert dependence(AGREE, {"scaled-init": AGREE}, late, word) == \
        "depends on the budget: inconclusive at 1/4, agrees at 1/2, agrees at the end"
    # Every shared recipe agrees, but with each model at its own best recipe the difference is null.
    assert dependence(NULL, {"scaled-init": AGREE, "plain-init": AGREE}, [], word) == \
        "depends on the recipe: agrees under each shared recipe, inconclusive with each model at its own best recipe"


def test_comparisons_the_paper_does_not_make_say_which_model_is_better():
    higher, lower = better_word("DIFF V2", "higher"), better_word("DIFF V2", "lower")
    assert higher(AGREE) == "DIFF V2 better" and higher(AGAINST) == "DIFF V2 worse" and higher(NULL) == "inconclusive"
    assert lower(AGREE) == "DIFF V2 worse" and lower(AGAINST) == "DIFF V2 better"
    assert dependence(AGAINST, {"scaled-init": AGAINST, "plain-init": AGAINST}, [], lower) == "robust: DIFF V2 better"


def test_fractions_of_the_budget_are_named_as_people_say_them():
    assert [fraction_label(f) for f in (0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 0.3)] == \
        ["1/8", "1/4", "3/8", "1/2", "3/4", "the end", "30%"]


def test_claims_read_each_recipe_and_the_curve_of_each_model():
    """Language modelling by recipe (the sweep's best lr there) and along the validation curve;
    retrieval by recipe and along the learning curve; every figure planted by hand."""
    models = {"standard": _summary("standard", [3.0, 3.2], [[3.5, 3.0], [3.7, 3.2]]),
              "diff": _summary("diff", [3.4, 3.6], [[3.6, 3.4], [3.8, 3.6]])}
    sweeps = {"standard": _lm_sweep("standard", {"scaled-init": (2e-3, {1e-3: [3.3, 3.5], 2e-3: [3.0, 3.2]})}),
              "diff": _lm_sweep("diff", {"scaled-init": (1e-3, {1e-3: [3.4, 3.6], 2e-3: [3.9, 4.1]})})}
    lm = LanguageModelling(Budget(4, 2, 32, 0, {}), models, sweeps, ["scaled-init"])

    def run(final, curve, area):
        return _run(final, final, curve=curve, area=area)

    retrieval = _retrieval(
        {"standard": [run(0.4, [(0, 0.0), (4, 0.1), (8, 0.4)], 0.2)] * 2,
         "diff": [run(0.7, [(0, 0.0), (4, 0.5), (8, 0.7)], 0.5)] * 2},
        chance=0.05,
        recipes={"standard": {"scaled-init": [run(0.4, [(0, 0), (8, 0.4)], 0.2)] * 2,
                              "plain-init": [run(0.6, [(0, 0), (8, 0.6)], 0.4)] * 2},
                 "diff": {"scaled-init": [run(0.7, [(0, 0), (8, 0.7)], 0.5)] * 2,
                          "plain-init": [run(0.6, [(0, 0), (8, 0.6)], 0.45)] * 2}})
    rows = {r.measure.split(",")[0].split(" (")[0]: r for r in paper_claims(CONFIG, lm, retrieval, {})}
    loss = rows["final validation loss"]
    assert loss.by_recipe["scaled-init"].delta == pytest.approx(3.5 - 3.1)  # DIFF at 1e-3, the Transformer at 2e-3
    assert [p.difference.delta for p in loss.along] == pytest.approx([3.7 - 3.6, 3.5 - 3.1])
    assert [p.fraction for p in loss.along] == [0.5, 1.0] and loss.along[0].budget == "100 tokens"
    mqar = rows["mqar accuracy"]
    assert mqar.by_recipe["scaled-init"].delta == pytest.approx(0.3) and mqar.by_recipe["plain-init"].delta == 0
    assert [p.difference.delta for p in mqar.along] == pytest.approx([0.4, 0.3])  # steps 4 and 8; step 0 left out
    assert mqar.along[0].budget == "8 mqar examples"  # 4 steps × 2 MQAR examples a step
    assert mqar.verdict == "depends on the recipe: agrees under scaled-init, inconclusive under plain-init"
    area = rows["mqar: mean accuracy over training"]
    assert area.difference.delta == pytest.approx(0.3) and area.by_recipe["plain-init"].delta == pytest.approx(0.05)


def test_every_other_model_is_compared_on_the_evaluations_that_ran_on_it():
    """The wide-head Transformer (attention "standard", not the baseline) against the Transformer and DIFF:
    its first-token share (attention-sink) and its largest per-layer hidden-state ratio (outliers), per
    seed as planted; the same rows in the claims, DIFF against the Transformer, with no paper sign."""
    from diff_transformer.experiments.claims import variant_comparisons
    from planted import lm

    models = {"standard": _summary("standard", [3.0, 3.1]), "diff": _summary("diff", [3.1, 3.2]),
              "standard-wide": _summary("standard-wide", [3.05, 3.15])}
    sink = {"standard": [0.40, 0.44], "diff": [0.10, 0.12], "standard-wide": [0.30, 0.32]}
    ratios = {"standard": [[5.0, 50.0], [6.0, 60.0]], "diff": [[4.0, 20.0], [4.0, 22.0]],
              "standard-wide": [[5.0, 40.0], [None, 44.0]]}
    label = {"standard": "Transformer", "diff": "DIFF", "standard-wide": CONFIG.model_name("standard-wide")}
    outliers = {f"{label[n]} s{s}": {"hidden_states": {"top1": 1.0, "median": 1.0, "per_layer_ratio": ratios[n][s]},
                                      "attention_logits": {"top1": 2.0, "median": 1.0}} for n in models for s in (0, 1)}
    suite = {"attention-sink": {"models": {f"{label[n]} s{s}": {"mean_over_layers": {"mean": sink[n][s]}}
                                           for n in models for s in (0, 1)}},
             "outliers": {"models": outliers}}
    rows = variant_comparisons(CONFIG, lm(models), None, suite)
    wide = label["standard-wide"]
    assert {(r.model, r.baseline) for r in rows} == {(wide, "Transformer"), (wide, "DIFF")}
    by = {(r.baseline, r.claim): r for r in rows}
    wide_sink = by["Transformer", "Attention sink"]
    assert wide_sink.ours.per_seed == (0.30, 0.32) and wide_sink.base.per_seed == (0.40, 0.44)
    assert wide_sink.difference.delta == pytest.approx(-0.11)
    massive = by["DIFF", "Massive activations"]
    assert massive.ours.per_seed == (40.0, 44.0) and massive.base.per_seed == (20.0, 22.0)  # the largest layer's
    claims = {r.claim: r for r in paper_claims(CONFIG, lm({n: models[n] for n in ("standard", "diff")}), None, suite)}
    assert claims["Attention sink"].paper_sign == 0 and claims["Attention sink"].verdict.startswith("DIFF better")
    assert claims["Massive activations"].ours.per_seed == (20.0, 22.0)


def test_every_row_names_the_parameters_of_the_two_models_it_measures():
    """DIFF's language model 1,001 parameters and the Transformer's 1,000, their retrieval models 11 and 10:
    each row carries the counts of the experiment it reads, DIFF's first; the table prints them in the
    order of its columns, the Transformer's first."""
    lm = _lm([3.0, 3.1], [3.1, 3.2])
    lm.models["diff"].parameters, lm.models["standard"].parameters = 1_001, 1_000
    runs = {"standard": [_run(0.5, 0.3), _run(0.5, 0.3)], "diff": [_run(0.6, 0.5), _run(0.6, 0.5)]}
    for name, count in (("standard", 10), ("diff", 11)):
        for run in runs[name]:
            run.parameters = count
    rows = {r.measure: r for r in paper_claims(CONFIG, lm, _retrieval(runs), {})}
    assert rows["final validation loss (nats/token), each at its best recipe and lr"].parameters == (1_001, 1_000)
    mqar = next(r for m, r in rows.items() if m.startswith("mqar accuracy"))
    assert mqar.parameters == (11, 10)
    table = "\n".join(render_claims(list(rows.values()), 2))
    assert "| Language modelling | final validation loss (nats/token), each at its best recipe and lr (lower) | " \
           "1,000 / 1,001 | 3.15 ± 0.071 | 3.05 ± 0.071 |" in table
