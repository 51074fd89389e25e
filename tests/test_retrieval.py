"""The retrieval experiment: generated examples, what is scored, the attention split, a run end to end."""

import random

import pytest
import torch

from diff_transformer import LanguageModel
from diff_transformer.attention import AttentionTap
from diff_transformer.config import ConfigError
from diff_transformer.data.synthetic import BOS, NEEDLE, QUERY, symbolic_batch, symbolic_mqar, symbolic_needle
from diff_transformer.experiments.config import RetrievalConfig, experiment_from_dict
from diff_transformer.experiments.results import RetrievalRun, to_json
from diff_transformer.experiments.retrieval import (
    accuracy,
    attention_allocation,
    attention_shares,
    curve_area,
    evaluation_sets,
    examples_to_reach,
    run_experiment,
    run_one,
    training_batch,
)
from diff_transformer.train.config import OptimConfig

SMALL = dict(length=32, keys=8, values=8, noise_tokens=8, d_model=32, n_layers=1, n_heads=1, steps=3, batch_size=4,
             needles=[1, 3], depths=[0.0, 1.0], pairs=[2, 4], eval_samples=2, quantize_bits=[4])


def test_a_needle_document_holds_its_needles_the_query_and_the_answer():
    config = RetrievalConfig(**SMALL)
    for depth in (0.0, 0.5, 1.0):
        example = symbolic_needle(random.Random(1), config.task, 3, depth)
        tokens = example.tokens
        assert len(tokens) == config.length + 1 and tokens[0] == BOS
        assert tokens.count(NEEDLE) == 3 and tokens[-3] == QUERY
        start, end = example.answer_span
        assert tokens[start] == NEEDLE and end - start == 3
        key, value = tokens[start + 1], tokens[start + 2]
        assert tokens[-2] == key and tokens[-1] == value  # the query asks the queried needle's key
        needle_keys = [tokens[i + 1] for i, t in enumerate(tokens[:-3]) if t == NEEDLE]
        assert len(set(needle_keys)) == 3 and needle_keys.count(key) == 1  # distractors have other keys
        assert example.answer_positions == [config.length - 1] and example.query_start == config.length - 2
        noise = [t for i, t in enumerate(tokens[1:-3], 1) if not any(s <= i < s + 3 for s in
                 [j for j, x in enumerate(tokens[:-3]) if x == NEEDLE])]
        assert all(t in config.task.noise for t in noise) and len(noise) == config.length - 3 - 9
    # depth 0: the queried needle opens the body; depth 1: it closes it, just before the query.
    assert symbolic_needle(random.Random(2), config.task, 3, 0.0).answer_span[0] == 1
    assert symbolic_needle(random.Random(2), config.task, 3, 1.0).answer_span[1] == config.length - 2


def test_mqar_asks_each_key_again_and_scores_its_value():
    config = RetrievalConfig(**SMALL)
    example = symbolic_mqar(random.Random(3), config.task, 4)
    tokens = example.tokens
    pairs = {tokens[1 + 2 * i]: tokens[2 + 2 * i] for i in range(4)}
    assert len(example.answer_positions) == 4  # queries = None: every pair
    for position in example.answer_positions:
        assert pairs[tokens[position]] == tokens[position + 1]
    inputs, targets = symbolic_batch([example])
    assert inputs.shape == targets.shape == (1, config.length)
    scored = (targets[0] != -100).nonzero().flatten().tolist()
    assert scored == example.answer_positions
    assert [int(targets[0, p]) for p in scored] == [pairs[tokens[p]] for p in scored]


def test_training_batches_are_the_same_for_every_model_and_change_with_the_step():
    config = RetrievalConfig(**SMALL)
    a, b = training_batch(config, 5), training_batch(config, 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(training_batch(config, 6)[0], a[0])


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="too short"):
        RetrievalConfig(**{**SMALL, "needles": [8], "length": 24})
    with pytest.raises(ConfigError, match="retrieval.queries"):
        RetrievalConfig(**{**SMALL, "queries": 5})


class _Oracle(torch.nn.Module):
    """Predicts a fixed token everywhere: accuracy is the share of answers equal to it."""

    def __init__(self, token: int, vocab: int) -> None:
        super().__init__()
        self.token, self.vocab = token, vocab

    def forward(self, inputs):
        logits = torch.zeros(*inputs.shape, self.vocab)
        logits[..., self.token] = 1.0
        return logits, None


def test_accuracy_counts_only_the_answer_tokens():
    config = RetrievalConfig(**SMALL)
    examples = [symbolic_mqar(random.Random(i), config.task, 4) for i in range(6)]
    answers = [e.tokens[p + 1] for e in examples for p in e.answer_positions]
    token = max(set(answers), key=answers.count)
    expected = answers.count(token) / len(answers)
    assert accuracy(_Oracle(token, config.task.vocab_size), examples, batch_size=4) == pytest.approx(expected)


def test_attention_shares_put_a_planted_row_on_the_right_columns():
    """A known answer row: its mass must land in the answer, noise and other groups as planted,
    after the head mean and the division by the row sum (here 0.5, as for DIFF with λ = 0.5)."""
    config = RetrievalConfig(**SMALL)
    example = symbolic_needle(random.Random(4), config.task, 3, 0.5)
    start, end = example.answer_span
    S = config.length
    row = torch.zeros(1, 2, S)  # (B, H, S)
    row[0, 0, start + 2] = 0.5  # head 0: all on the queried value (answer)
    row[0, 1, 0] = 0.3  # head 1: on BOS (noise) ...
    row[0, 1, S - 1] = 0.2  # ... and on the query's key (other)
    (shares,) = attention_shares([row], [example])
    assert (shares.answer, shares.noise, shares.other) == pytest.approx((0.5, 0.3, 0.2))
    assert attention_shares([row * 0.04], [example]) == [None]  # row sum 0.02: no meaningful share


def test_attention_allocation_reads_the_last_row_of_p1_minus_lambda_p2():
    """On a DIFF model: the split of the query row of softmax₁ − λ·softmax₂ (λ from the model),
    computed here from the two softmax maps."""
    config = RetrievalConfig(**SMALL)
    torch.manual_seed(0)
    model = LanguageModel(config.model_config("diff"))
    examples = [symbolic_needle(random.Random(i), config.task, 3, d) for i, d in enumerate((0.0, 0.5, 1.0))]
    maps = {}

    class Keep(AttentionTap):
        def record(self, layer_index, m):
            maps[layer_index] = m.probs

    with torch.no_grad(), model.tap_attention(Keep()):
        model(symbolic_batch(examples)[0])
    (lam,) = model.lambdas()
    p1, p2 = maps[0]
    row = (p1 - lam * p2)[:, :, -1, :].mean(1)  # (B, S)
    row = row / row.sum(-1, keepdim=True)
    expected = {"answer": 0.0, "noise": 0.0, "other": 0.0}
    for i, e in enumerate(examples):
        start, end = e.answer_span
        answer, other = row[i, start:end].sum(), row[i, e.query_start:].sum()
        expected["answer"] += float(answer) / 3
        expected["other"] += float(other) / 3
        expected["noise"] += float(row[i].sum() - answer - other) / 3
    (shares,) = attention_allocation(model, examples)
    assert (shares.answer, shares.noise, shares.other) == \
        pytest.approx((expected["answer"], expected["noise"], expected["other"]), abs=1e-5)


@pytest.mark.slow  # trains every model and seed
def test_the_experiment_runs_every_model_and_seed_and_reports_by_difficulty(tmp_path):
    data = {
        "model": {"preset": "debug"},
        "models": {"standard": {"attention": "standard", "label": "Transformer"},
                   "diff": {"attention": "diff", "label": "DIFF"}},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "retrieval": {**SMALL, "lr_grid": [1e-3, 3e-3]},
    }
    config = experiment_from_dict(data)
    result = run_experiment(config, ["standard", "diff"], [0, 1], tmp_path, progress=False)
    for name, m in result.models.items():
        assert len(m.runs) == 2 and m.sweep.lr in (1e-3, 3e-3)
        scores = {lr: s.mean for lr, s in m.sweep.scores[None].items()}
        assert scores[m.sweep.lr] == max(scores.values())  # its own best: the highest mean accuracy
        assert scores[3e-3] == pytest.approx(sum(r.score for r in m.sweep.runs[None][3e-3]) / 2)
        run = m.runs[0]
        assert set(run.accuracy["needle"]) == {"N=1,depth=0", "N=1,depth=1", "N=3,depth=0", "N=3,depth=1"}
        assert set(run.accuracy["mqar"]) == {"D=2", "D=4"}
        assert set(run.quantized_accuracy) == {"full", "4"} and len(run.attention) == 1
        assert (tmp_path / name / "lr-0.001" / "seed-1.json").is_file()
    # Resuming reads the stored results instead of training again.
    again = run_experiment(config, ["standard", "diff"], [0, 1], tmp_path, resume=True, progress=False)
    assert to_json(again.models["diff"].runs) == to_json(result.models["diff"].runs)


def test_the_area_under_a_learning_curve_and_the_examples_to_a_target_match_a_hand_computation():
    points = [(0, 0.0), (100, 0.2), (200, 0.6), (400, 0.6)]
    # Trapezoids: 100·0.1 + 100·0.4 + 200·0.6 = 170, over a width of 400.
    assert curve_area(points) == pytest.approx(170 / 400)
    assert examples_to_reach(points, 0.4) == pytest.approx(150.0)  # halfway from 0.2 (at 100) to 0.6 (at 200)
    assert examples_to_reach(points, 0.6) == pytest.approx(200.0)
    assert examples_to_reach(points, 0.7) is None
    assert examples_to_reach([(10, 0.5), (20, 0.9)], 0.3) == 10  # reached by the first measurement


def test_the_curve_is_measured_before_training_and_after_each_fraction_of_the_steps():
    assert RetrievalConfig(steps=400).curve_steps == [0, 50, 100, 200, 400]
    assert RetrievalConfig(**{**SMALL, "steps": 3}).curve_steps == [0, 1, 2, 3]  # at least one step each, no repeats
    assert RetrievalConfig(**SMALL, curve=[0.5]).curve_steps == [0, 2, 3]
    config = RetrievalConfig(**SMALL)
    assert config.examples_seen("needle", 10) == 20 and config.examples_seen("mqar", 10) == 20
    with pytest.raises(ConfigError, match="retrieval.curve"):
        RetrievalConfig(curve=[0.0, 0.5])


def test_an_odd_batch_holds_one_needle_document_fewer_than_mqar_examples_and_the_counts_say_so():
    config = RetrievalConfig(**{**SMALL, "batch_size": 5})
    inputs, _ = training_batch(config, step=0)
    needle_rows = sum(int((row == NEEDLE).any()) for row in inputs)  # only needle documents hold NEEDLE
    assert (needle_rows, len(inputs) - needle_rows) == (2, 3)
    assert config.examples_seen("needle", 7) == 14 and config.examples_seen("mqar", 7) == 21


@pytest.mark.slow  # a training run
def test_a_run_records_its_learning_curve_from_the_untrained_model_to_the_end():
    config = RetrievalConfig(**{**SMALL, "steps": 4, "curve": [0.5]})
    optim = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, betas=(0.9, 0.95), weight_decay=0.1)
    result = run_one(config, optim, "diff", 0)
    assert [p.step for p in result.curve] == [0, 2, 4]
    assert result.curve[-1].accuracy == result.accuracy  # the last point is the end of training
    assert RetrievalRun.from_dict(to_json(result)) == result  # what a resumed study reads back
    torch.manual_seed(0)  # the same initialisation, untrained: the first point
    untrained = LanguageModel(config.model_config("diff")).eval()
    cells = {task: {cell: accuracy(untrained, examples) for cell, examples in by_cell.items()}
             for task, by_cell in evaluation_sets(config).items()}
    assert result.curve[0].accuracy == cells
    mqar = [(config.examples_seen("mqar", p.step), p.mean_accuracy["mqar"]) for p in result.curve]
    (x0, y0), (x1, y1), (x2, y2) = mqar
    assert result.curve_area["mqar"] == pytest.approx(((x1 - x0) * (y0 + y1) + (x2 - x1) * (y1 + y2)) / 2 / x2)


@pytest.mark.slow  # trains every model under two recipes, in two worker processes
def test_every_model_runs_under_every_recipe_and_is_reported_at_its_best(tmp_path):
    data = {
        "model": {"preset": "debug"},
        "models": {"standard": {"attention": "standard"}, "diff": {"attention": "diff"}},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "compare": {"recipes": ["scaled-init", "plain-init"]},
        "retrieval": {**SMALL, "lr_by_model": {"standard": 1e-3, "diff": 1e-3},
                      "lr_by_recipe": {"plain-init": {"standard": 3e-3}}},
    }
    config = experiment_from_dict(data)
    result = run_experiment(config, ["standard", "diff"], [0, 1], tmp_path / "pool", jobs=2, progress=False)
    assert result.recipes == ["scaled-init", "plain-init"]
    for name, m in result.models.items():
        score = {r: sum(run.score for run in m.sweep.at(r)) for r in m.sweep.runs}
        assert m.sweep.best_recipe == max(score, key=score.get) and m.runs == m.sweep.at(m.sweep.best_recipe)
        assert (tmp_path / "pool" / name / "plain-init" / ("lr-0.003" if name == "standard" else "lr-0.001")
                / "seed-1.json").is_file()
    plain = result.models["diff"].sweep.at("plain-init")[0]
    scaled = result.models["diff"].sweep.at("scaled-init")[0]
    assert plain.curve[0].accuracy != scaled.curve[0].accuracy or plain.losses != scaled.losses
    # One process, the same results: the pool only spreads the runs.
    alone = run_experiment(config, ["diff"], [1], tmp_path / "alone", recipes=["plain-init"], progress=False)
    assert alone.models["diff"].runs[0].accuracy == result.models["diff"].sweep.at("plain-init")[1].accuracy
