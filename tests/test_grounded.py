"""The grounded (contextual-hallucination) experiment: the generated episodes, each score pinned on
hand-built answers, the lookback ratio of the answering rows against a float64 oracle, a run end to
end, and the claims it feeds."""

import math
import random

import pytest
import torch

from diff_transformer import LanguageModel
from diff_transformer.attention import ATTENTION_CLASSES, AttentionTap
from diff_transformer.config import ConfigError
from diff_transformer.data.synthetic import (
    ASK, BOS, CLOSED_BOOK, DOCUMENT, UNKNOWN, GroundedQuestion, closed_book_example, grounded_episode, memorised_facts,
)
from diff_transformer.experiments import load_experiment
from diff_transformer.experiments.claims import paper_claims, variant_comparisons
from diff_transformer.experiments.config import GroundedConfig, experiment_from_dict
from diff_transformer.experiments.grounded import (
    Measured, evaluation_set, grounded_scores, lookback_auroc, lookback_by_layer, measure, run_experiment, run_one,
    training_batch,
)
from diff_transformer.experiments.language_models import Budget, LanguageModelling
from diff_transformer.experiments.report import grounded_lines
from diff_transformer.experiments.results import GroundedRun, to_json
from diff_transformer.train.config import OptimConfig
from planted import grounded as _grounded
from planted import grounded_run as _run
from planted import lm_sweep as _lm_sweep
from planted import summary as _summary

SMALL = dict(length=24, entities=10, attributes=5, noise_tokens=4, context_facts=3, questions=3, d_model=32,
             n_layers=2, n_heads=1, steps=3, batch_size=4, closed_book=1, eval_episodes=3, curve=[0.5, 1.0])


def test_an_episode_states_its_facts_then_asks_each_condition():
    config = GroundedConfig(**SMALL)
    task = config.task
    facts = memorised_facts(task, 0)
    for seed in range(20):
        conditions = ["counterfactual", "lacking", "agree"]
        example = grounded_episode(random.Random(seed), task, facts, conditions)
        tokens = example.tokens
        assert len(tokens) == task.length + 1 and tokens[:2] == [BOS, DOCUMENT]
        first_question = task.length + 1 - 3 * task.questions
        document = tokens[2:first_question]
        stated = {e: document[i + 1] for i, e in enumerate(document) if e in task.entity_tokens}
        assert len(stated) == task.context_facts and all(a in task.attribute_tokens for a in stated.values())
        assert [t for t in document if t not in task.entity_tokens and t not in stated.values()] == \
            [t for t in document if t in task.noise] and len(document) - 2 * task.context_facts == task.document_noise
        assert [q.condition for q in example.questions] == conditions
        asked = set()
        for q in example.questions:
            assert tokens[q.marker] == ASK and q.position == q.marker + 1 and tokens[q.position] == q.entity
            assert tokens[q.position + 1] == q.target and q.memorised == facts[q.entity - task.entity_tokens[0]]
            assert q.entity not in asked  # every question asks another entity
            asked.add(q.entity)
            if q.condition == "agree":
                assert stated[q.entity] == q.document == q.memorised == q.target
            elif q.condition == "counterfactual":
                assert stated[q.entity] == q.document == q.target != q.memorised
            else:
                assert q.entity not in stated and q.document is None and q.target == UNKNOWN
            assert sorted(q.stated) == sorted(stated.values())
        assert example.answer_positions == [q.position for q in example.questions]


def test_the_training_text_teaches_each_entity_its_one_memorised_attribute():
    config = GroundedConfig(**SMALL)
    task = config.task
    facts = memorised_facts(task, 0)
    assert facts == memorised_facts(task, 0) and facts != memorised_facts(task, 1)  # one table per data seed
    example = closed_book_example(random.Random(0), task, facts)
    assert example.tokens[0] == BOS and len(example.tokens) == task.length + 1
    assert len(example.questions) == task.closed_book_questions == task.length // 3
    for q in example.questions:
        assert q.condition == CLOSED_BOOK and q.document is None
        assert example.tokens[q.marker: q.position + 2] == [ASK, q.entity, facts[q.entity - task.entity_tokens[0]]]
    inputs, targets = training_batch(config, facts, 0)
    assert inputs.shape == (config.batch_size, config.length)
    assert (inputs[0, 0] == BOS and inputs[0, 1] == ASK and inputs[1:, 1] == DOCUMENT).all()  # 1 closed book first
    scored = (targets != -100).nonzero().tolist()
    assert all(inputs[b, p - 1] == ASK for b, p in scored)  # only the answers count, predicted at the entity
    assert len(scored) == task.closed_book_questions + (config.batch_size - 1) * task.questions


def test_the_held_out_questions_cycle_through_the_three_conditions():
    config = GroundedConfig(**{**SMALL, "eval_episodes": 4})
    examples = evaluation_set(config, memorised_facts(config.task, 0))
    conditions = [q.condition for e in examples for q in e.questions]
    assert {c: conditions.count(c) for c in set(conditions)} == {"agree": 4, "counterfactual": 4, "lacking": 4,
                                                                 CLOSED_BOOK: config.entities}
    closed = {q.entity for e in examples for q in e.questions if q.condition == CLOSED_BOOK}
    assert closed == set(config.task.entity_tokens)  # every fact asked once


def _q(condition, memorised, document, stated=(11, 12)):
    target = UNKNOWN if condition == "lacking" else memorised if condition == CLOSED_BOOK else document
    return GroundedQuestion(1, 0, condition, 40, memorised, document, target, stated)


def test_each_score_is_read_off_hand_built_answers():
    agree, counterfactual, lacking, closed = (_q("agree", 10, 10, (10, 11)), _q("counterfactual", 10, 12),
                                              _q("lacking", 10, None), _q(CLOSED_BOOK, 10, None, ()))
    answers = [(agree, 10), (agree, UNKNOWN), (agree, 11),  # document, unknown, misattributed
               (counterfactual, 12), (counterfactual, 10), (counterfactual, 13), (counterfactual, 12),  # 2 doc, 1 mem.
               (lacking, UNKNOWN), (lacking, 10), (lacking, 11), (lacking, UNKNOWN),  # 2 unknown, memory, misattr.
               (closed, 10), (closed, 10), (closed, 14)]  # 2 memory, invented
    scores = grounded_scores(answers)
    o = scores.outcomes
    assert (o["agree"].count, o["agree"].document, o["agree"].unknown, o["agree"].misattributed) == (3, 1 / 3, 1 / 3,
                                                                                                      1 / 3)
    assert (o["counterfactual"].document, o["counterfactual"].memory, o["counterfactual"].invented) == (0.5, 0.25, 0.25)
    assert (o["lacking"].unknown, o["lacking"].memory, o["lacking"].misattributed) == (0.5, 0.25, 0.25)
    assert (o["closed_book"].memory, o["closed_book"].invented) == pytest.approx((2 / 3, 1 / 3))
    assert scores.accuracy == pytest.approx((1 / 3 + 1 / 2 + 1 / 2) / 3)  # as the document warrants, per condition
    assert scores.faithful == pytest.approx((1 / 3 + 1 / 2) / 2)  # the document's attribute where it states it
    assert scores.prior_override == pytest.approx(1 / 4)  # counterfactual answered from memory
    assert scores.fabrication == pytest.approx((1 / 3 + 1 / 4 + 1 / 4) / 3)  # neither source, nor UNKNOWN
    assert scores.abstention == pytest.approx(1 / 2)
    assert scores.recall == pytest.approx(2 / 3)
    assert math.isnan(grounded_scores(answers[:3]).prior_override)  # no counterfactual question: no figure


class _Maps(AttentionTap):
    def __init__(self):
        self.combined = {}

    def record(self, layer_index, maps):
        self.combined[layer_index] = maps.combined.double()


@pytest.mark.parametrize("kind", list(ATTENTION_CLASSES))
def test_measure_answers_by_argmax_and_reads_the_lookback_ratio_of_the_effective_map(kind):
    # GDA: 2 signal heads sharing 1 noise head, so that its maps are not DIFF's
    config = GroundedConfig(**{**SMALL, "n_heads": 2} if kind == "gda" else SMALL)
    torch.manual_seed(0)
    model = LanguageModel(config.model_config(kind, **({"gda_ratio": 2} if kind == "gda" else {}))).eval()
    with torch.no_grad():
        for layer in model.layers:  # larger logits: peaked maps, and p1 − λ·p2 plainly signed with λ = 0.9
            for projection in layer.attn.input_projections():
                projection.weight.mul_(20)
            if kind in ("diff", "diff_symmetric", "gda"):
                layer.attn.lambda_init = 0.9
    examples = evaluation_set(config, memorised_facts(config.task, 0))
    measured = measure(model, examples, batch_size=2)
    inputs = torch.tensor([e.tokens[:-1] for e in examples])
    maps = _Maps()
    with torch.no_grad(), model.tap_attention(maps):
        predicted = model(inputs)[0].argmax(-1)
    oracle, i = [], 0
    for b, example in enumerate(examples):
        for q in example.questions:
            assert measured.answers[i] == (q, int(predicted[b, q.position]))
            i += 1
            if q.condition == CLOSED_BOOK:
                continue
            ratio = torch.zeros(len(maps.combined), maps.combined[0].shape[1], dtype=torch.float64)
            for layer, combined in maps.combined.items():
                for head in range(combined.shape[1]):
                    row = combined[b, head, q.position]
                    context = sum(abs(float(row[j])) for j in range(q.marker)) / q.marker
                    new = sum(abs(float(row[j])) for j in range(q.marker, q.position + 1)) / (q.position + 1 - q.marker)
                    ratio[layer, head] = context / (context + new)
            oracle.append(ratio)
    assert len(measured.lookback) == len(oracle) == 3 * config.eval_episodes
    for got, want in zip(measured.lookback, oracle):
        assert got.double() == pytest.approx(want, abs=1e-5)
    if kind in ("diff", "diff_symmetric"):
        assert min(float(c.min()) for c in maps.combined.values()) < -1e-3  # the |A| of the definition matters here
    per_layer = torch.stack(oracle).mean(dim=2).mean(dim=0)
    assert lookback_by_layer(measured) == pytest.approx(per_layer.tolist(), abs=1e-5)
    head_mean = torch.stack(oracle).mean(dim=2)  # (questions, L)
    for layer, got in enumerate(lookback_auroc(measured)):  # right above wrong, counted pair by pair
        right = [float(v) for v, r in zip(head_mean[:, layer], measured.right) if r]
        wrong = [float(v) for v, r in zip(head_mean[:, layer], measured.right) if not r]
        pairs = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
        assert got == (pytest.approx(pairs / (len(right) * len(wrong)), abs=1e-6) if right and wrong else None)


def test_an_undefined_heads_ratio_is_left_out_of_its_layers_mean():
    nan = float("nan")
    measured = Measured([], [torch.tensor([[0.2, nan], [0.4, 0.6]]), torch.tensor([[0.6, 0.8], [0.2, 0.2]])],
                        [True, False])
    # layer 0: head means 0.2 (the NaN head left out) and 0.7; layer 1: 0.5 and 0.2.
    assert lookback_by_layer(measured) == pytest.approx([0.45, 0.35])
    assert lookback_auroc(measured) == [0.0, 1.0]


def test_a_run_measures_along_training_and_reads_back_from_json():
    config = GroundedConfig(**SMALL)
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, betas=(0.9, 0.95), weight_decay=0.1)
    run = run_one(config, optim, "diff", seed=0)
    assert [p.step for p in run.curve] == config.curve_steps == [0, 2, 3]
    assert run.scores == run.curve[-1].scores and run.lookback == run.curve[-1].lookback
    assert len(run.lookback) == len(run.lookback_auroc) == config.n_layers
    assert {k: v.count for k, v in run.scores.outcomes.items()} == {"agree": 3, "counterfactual": 3, "lacking": 3,
                                                                     "closed_book": config.entities}
    again = GroundedRun.from_dict(to_json(run))
    assert to_json(again) == to_json(run) and again.score == run.scores.accuracy


def test_each_model_trains_at_its_own_grounded_lr_else_its_retrieval_lr(tmp_path):
    config = experiment_from_dict({
        "models": {"standard": {"preset": "debug", "attention": "standard"}, "diff": {"preset": "debug"}},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "retrieval": {"lr_by_model": {"standard": 1e-3, "diff": 1e-3}},
        "grounded": {**SMALL, "lr_by_model": {"diff": 2e-3}, "recipes": ["scaled-init"]},
    })
    result = run_experiment(config, ["standard", "diff"], [0], tmp_path, progress=False)
    assert {name: m.sweep.best_lr for name, m in result.models.items()} == {
        "standard": {"scaled-init": 1e-3}, "diff": {"scaled-init": 2e-3}}
    assert (tmp_path / "diff" / "scaled-init" / "lr-0.002" / "seed-0.json").is_file()


def test_the_settings_are_checked_by_name():
    for fields, message in (({"agree_share": 1.0}, "grounded.agree_share"),
                            ({"answerable_share": 0.0}, "grounded.answerable_share"),
                            ({"closed_book": 16}, "grounded.closed_book"),
                            ({"entities": 11}, "context_facts \\+ questions = 12"),
                            ({"length": 30}, "length 30 is too short"),
                            ({"questions": 7}, "questions \\(7\\) must not exceed context_facts"),
                            ({"recipes": ["nope"]}, "grounded.recipes: no init recipe 'nope'"),
                            ({"steps": 0}, "grounded.steps must be positive"),
                            ({"eval_episodes": 1, "questions": 2, "context_facts": 2}, "at least 3 are needed")):
        with pytest.raises(ConfigError, match=message):
            GroundedConfig(**fields)
    with pytest.raises(ConfigError, match="unknown key 'grounded.nope'|grounded.*nope"):
        load_experiment("tiny", ["grounded.nope=1"])


# --- the claims and the report -------------------------------------------------------------------------


def _lm(names):
    models = {n: _summary(n, [3.0, 3.1]) for n in names}
    sweeps = {n: _lm_sweep(n, {None: (1e-3, {1e-3: [3.0, 3.1]})}) for n in names}
    return LanguageModelling(Budget(4, 2, 32, 0, {}), models, sweeps, [])


def test_the_claims_read_grounded_accuracy_and_the_lookback_ratio_along_training():
    def runs(accuracies, lookbacks, halfway):
        return [_run(a, lb, curve=[(0, 0.0, (0.5, 0.5)), (4, h, (0.5, 0.5)), (8, a, lb)])
                for a, lb, h in zip(accuracies, lookbacks, halfway)]

    grounded = _grounded({"standard": runs([0.40, 0.42, 0.44], [(0.6, 0.8), (0.6, 0.6), (0.7, 0.7)], [0.3, 0.3, 0.3]),
                          "diff": runs([0.50, 0.54, 0.52], [(0.4, 0.4), (0.3, 0.5), (0.4, 0.6)], [0.3, 0.31, 0.29])})
    config = load_experiment("tiny")
    rows = {r.claim: r for r in paper_claims(config, _lm(["standard", "diff"]), None, {}, grounded)}
    accuracy = rows["Contextual hallucination"]
    # DIFF 0.50, 0.54, 0.52 (mean 0.52, s² 0.0004) against 0.40, 0.42, 0.44 (mean 0.42, s² 0.0004): Welch df 4.
    half = 2.776 * math.sqrt(0.0004 / 3 + 0.0004 / 3)
    assert accuracy.difference.delta == pytest.approx(0.10)
    assert accuracy.difference.low == pytest.approx(0.10 - half, abs=1e-3)
    assert accuracy.paper.startswith("+0.07 to +0.19") and accuracy.better == "higher"
    assert [(p.fraction, p.budget) for p in accuracy.along] == [(0.5, "12 episodes"), (1.0, "24 episodes")]
    assert accuracy.along[0].difference.delta == pytest.approx(0.0)  # level halfway
    assert accuracy.verdict == "depends on the budget: inconclusive at 1/2, agrees at the end"
    lookback = rows["Contextual hallucination: lookback ratio"]
    # per seed, the mean over layers: Transformer 0.7, 0.6, 0.7; DIFF 0.4, 0.4, 0.5.
    assert lookback.ours.per_seed == pytest.approx((0.4, 0.4, 0.5))
    assert lookback.base.per_seed == pytest.approx((0.7, 0.6, 0.7))
    assert lookback.difference.delta == pytest.approx(-0.7 / 3)
    # No claim of the paper, and no better side: the verdict says which model is higher.
    assert lookback.paper_sign == 0 and lookback.verdict.endswith("DIFF lower at the end")
    # Every other model gets the same rows against the Transformer and against DIFF.
    grounded.models["gated"] = _grounded({"gated": runs([0.45] * 3, [(0.5, 0.5)] * 3, [0.3] * 3)}).models["gated"]
    variants = variant_comparisons(config, _lm(["standard", "diff", "gated"]), None, {}, grounded)
    assert {(v.baseline, v.claim) for v in variants if v.claim != "Language modelling"} == {
        (b, c) for b in ("Transformer", "DIFF") for c in ("Contextual hallucination", "Lookback ratio")}
    report = "\n".join(grounded_lines(grounded))
    assert "| grounded accuracy (higher) | 0.420 ± 0.020 | 0.520 ± 0.020 | 0.450 ± 0.000 |" in report
    assert "| Transformer | 1 | counterfactual | 1.000 |" in report and "step 8" in report
