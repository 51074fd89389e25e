"""Budgets at equal cost: the training-FLOPs formula (against a hand count and against torch's
FlopCounterMode), run.budget in tokens, FLOPs and seconds (a fake clock: no timed test), exact
resume of a budgeted run, a study whose models each train to the same FLOPs, the verdicts read at
equal cost, and bad budgets refused by name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diff_transformer.checkpoint import CheckpointError
from diff_transformer.cli import main
from diff_transformer.config import ATTENTION_KINDS, ConfigError, ModelConfig
from diff_transformer.evaluation.stats import MeanStd
from diff_transformer.experiments.equal_cost import QUIET_SPREAD, Quietness, Trajectory, reading
from diff_transformer.flops import ATTENTION_COSTS, UnknownAttentionCost, training_flops
from diff_transformer.model import LanguageModel
from diff_transformer.train import train
from diff_transformer.train import trainer as trainer_module
from diff_transformer.train.budget import flops_per_token, resolve_steps
from diff_transformer.train.config import OptimConfig
from diff_transformer.train.optim import WarmupLinearSchedule
from diff_transformer.train.trainer import read_metrics
from test_train import byte_dataset, debug_config, debug_experiment, losses  # noqa: F401  (a fixture)

# --- the formula ----------------------------------------------------------------------------------

# The debug preset by hand: d_model E = 64, 2 layers, 2 DIFF heads of d = 16 (the other kinds: 4 heads of
# 16), vocabulary 512, SwiGLU inner width F = 64 · ceil(8 · 64 / 3 / 64) = 192.
E, LAYERS, VOCAB, F = 64, 2, 512, 192
# The weights of one layer's matrices, kind by kind (attention projections + the SwiGLU's 3·E·F):
LAYER_WEIGHTS = {
    "standard": 4 * E * E + 3 * E * F,  # q, k, v, o: E x E each
    "gated": 5 * E * E + 3 * E * F,  # and gate_proj E -> H·d = E
    "gated_headwise": 4 * E * E + E * 4 + 3 * E * F,  # and gate_proj E -> H = 4
    "diff": 4 * E * E + 3 * E * F,  # q E -> 2h·d = E, k E -> E, v E -> h·2d = E, o E x E
    "diff_symmetric": 3 * E * E + 3 * E * F,  # qk_proj serves as q and k
    "diff_v2": E * 2 * E + 3 * E * E + E * 4 + 3 * E * F,  # q E -> 2H·d = 2E, k, v, o; lambda_proj E -> H
    # gda_ratio 2: 2 signal heads, 1 noise head, 1 K/V group: q E -> (2 + 1)·16, k E -> 2·16, v E -> 32, o 64 -> E
    "gda": E * 48 + E * 32 + E * 32 + 64 * E + 3 * E * F,
    "xsa": 4 * E * E + 3 * E * F,
    "mta": 4 * E * E + 16 + 3 * E * F,  # and its gate, d = 16 -> 1 (kernels and mixings are not projections)
}
# what a kind needs beyond the preset; MTA's convolutions on layer 1 of the 2 (l % 2 == 1)
OVERRIDES = {"gda": {"gda_ratio": 2}, "mta": {"mta_conv_every": 2}}
# Forward FLOPs per (query, key) pair of one layer: 2 per multiply-add, over the score product (width 16)
# and the value product (width 16, or 32 for DIFF's value) of every map.
PAIR = {
    "standard": 2 * 4 * (16 + 16), "gated": 2 * 4 * (16 + 16), "gated_headwise": 2 * 4 * (16 + 16),
    "diff": 2 * 4 * (16 + 32),  # 2 DIFF heads x 2 maps, each times the 32-wide V
    "diff_symmetric": 2 * 4 * (16 + 32),
    "diff_v2": 2 * 8 * (16 + 16),  # one attention over 2H = 8 query heads
    "gda": 2 * 3 * (16 + 32),  # 2 signal maps and 1 noise map, each times the 32-wide V
    "xsa": 2 * 4 * (16 + 16),
    # the standard kind's, the head mixings (4 x 4 before the softmax, one group of 4 after it), and on layer 1
    # the two 6 x 11 key-query convolutions of each of the 4 heads
    "mta": (2 * 4 * (16 + 16) + 2 * 16 + 2 * 16, 2 * 4 * (16 + 16) + 2 * 16 + 2 * 16 + 2 * 2 * 4 * 6 * 11),
}
# Forward FLOPs per token of one layer beyond the projections: XSA's dot product with the own value and the
# component taken off (2·16 each, 4 heads); MTA's gate (16 -> 1) read by 3 more heads than the weights count.
TOKEN = {"xsa": 4 * 4 * 16, "mta": 2 * 3 * 16}


def pair_flops(kind: str, layer: int) -> int:
    per_pair = PAIR[kind]
    return per_pair[layer] if isinstance(per_pair, tuple) else per_pair


def hand_count(kind: str, t: int, causal: bool = True) -> float:
    """Training FLOPs of one debug-size sequence of ``t`` tokens, in float64: 3 x the forward, which is
    2 x the matrices' weights per token (the blocks' and the LM head's) and the pairs' products."""
    pairs = t * (t + 1) / 2 if causal else t * t
    forward = 2.0 * (LAYERS * LAYER_WEIGHTS[kind] + E * VOCAB) * t + LAYERS * t * TOKEN.get(kind, 0)
    forward += sum(pairs * pair_flops(kind, layer) for layer in range(LAYERS))
    return 3.0 * forward


@pytest.mark.parametrize("kind", sorted(PAIR))
@pytest.mark.parametrize("t", [1, 16, 33])
def test_the_flops_formula_is_the_hand_count(kind, t):
    config = ModelConfig.from_preset("debug", attention=kind, **OVERRIDES.get(kind, {}))
    assert training_flops(config, t).per_sequence == hand_count(kind, t)
    assert training_flops(config, t, causal=False).per_sequence == hand_count(kind, t, causal=False)
    assert training_flops(config, t).per_token == pytest.approx(hand_count(kind, t) / t, rel=1e-15)


def test_the_wide_head_transformer_costs_what_the_matched_one_does():
    """DIFF's head count at head dim 2d: the same matrices, the same products per pair."""
    wide = ModelConfig.from_preset("debug", attention="standard", diff_heads=True)
    assert training_flops(wide, 16).per_sequence == hand_count("standard", 16)


@pytest.mark.parametrize("kind", sorted(set(PAIR) - {"mta"}))
def test_the_formula_agrees_with_torch_flop_counter(kind):
    """FlopCounterMode on a forward and backward of the reference backend, which computes every score
    of the T x T square (causal=False) and counts matmuls only, as the formula does. The differences:
    the reference multiplies V once by DIFF's combined map P1 − λP2, where the formula counts the two
    value products of the paper's appendix (each map times V): 3 x 2·T²·h·2d per layer; XSA's
    correction is elementwise there (a product and a sum), the formula's per-token term. (MTA is not
    compared: its reference convolves and mixes the maps with shifted sums and elementwise products,
    which the counter does not count; the hand count above pins its term.)"""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug", attention=kind, **OVERRIDES.get(kind, {}))
    model = LanguageModel(config, attn_backend="reference")
    b, t = 2, 16
    tokens = torch.randint(0, config.vocab_size, (b, t + 1))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    # the second maps' value products (DIFF: one per head; GDA: one per noise head); DIFF V2 is one softmax
    # attention call: nothing combined
    combined = {"diff": config.n_heads, "diff_symmetric": config.n_heads, "gda": config.n_noise_heads}.get(kind, 0)
    one_value_product = 3 * 2 * t * t * combined * 2 * config.head_dim * LAYERS
    elementwise = 3 * LAYERS * t * TOKEN.get(kind, 0)
    assert counter.get_total_flops() == b * (hand_count(kind, t, causal=False) - one_value_product - elementwise)


def test_every_attention_kind_has_a_flops_term():
    """A new kind fails here until it adds its term to flops.ATTENTION_COSTS (see its docstring)."""
    assert set(ATTENTION_COSTS) == set(ATTENTION_KINDS)


def test_a_kind_without_a_term_raises_rather_than_counting_as_standard(monkeypatch):
    config = ModelConfig.from_preset("debug", attention="gated")
    monkeypatch.delitem(ATTENTION_COSTS, "gated")
    with pytest.raises(UnknownAttentionCost, match="no FLOPs term for attention 'gated'.*ATTENTION_COSTS"):
        training_flops(config, 16)
    assert flops_per_token(config, 16) is None  # its runs report no FLOPs...
    with pytest.raises(ConfigError, match="run.budget.kind=flops: models.gated: no FLOPs term"):  # ...nor a budget
        resolve_steps(config_for_budget("flops", 1e12), "gated", config, 32)


def config_for_budget(kind, amount, **run):
    """A trainer config (not read from disk) with a budget: data.batch_size 8 and seq_len 32."""
    from diff_transformer.train.config import config_from_dict

    return config_from_dict({"model": {"preset": "debug"}, "models": {"diff": {"attention": "diff"}},
                             "data": {"seq_len": 32, "batch_size": 8},
                             "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "betas": [0.9, 0.95],
                                       "weight_decay": 0.1},
                             "run": {"budget": {"kind": kind, "amount": amount}, **run}})


def test_a_budget_in_tokens_or_flops_is_the_steps_that_fit_in_it():
    diff = ModelConfig.from_preset("debug", attention="diff")
    tokens = resolve_steps(config_for_budget("tokens", 1000), "diff", diff, 32)
    assert tokens.run.steps == 3  # 1000 // (8 x 32)
    per_step = 8 * hand_count("diff", 32)
    flops = resolve_steps(config_for_budget("flops", 7.5 * per_step), "diff", diff, 32)
    assert flops.run.steps == 7
    assert resolve_steps(flops, "diff", diff, 32).run.steps == 7  # idempotent
    assert resolve_steps(config_for_budget("seconds", 60), "diff", diff, 32).run.steps == 300  # not used
    with pytest.raises(ConfigError, match=r"run.budget.amount=100 tokens is less than one optimizer step"):
        resolve_steps(config_for_budget("tokens", 100), "diff", diff, 32)
    with pytest.raises(ConfigError, match="run.stop_at_step=5 lies beyond the 3 steps of run.budget"):
        resolve_steps(config_for_budget("tokens", 1000, stop_at_step=5), "diff", diff, 32)


# --- the schedule over seconds -----------------------------------------------------------------------


def test_a_schedule_in_seconds_warms_up_in_steps_then_decays_over_the_seconds_left():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, betas=(0.9, 0.95), weight_decay=0.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = WarmupLinearSchedule(optimizer, optim, None, total_seconds=10.0)
    assert schedule.current_lr == 0.5  # step 0 of 2 of warmup
    schedule.step()
    schedule.spend(0.0)
    assert schedule.current_lr == 1.0
    schedule.step()
    schedule.spend(2.0)  # the warmup ended here: the decay runs over the 8 seconds left
    assert schedule.current_lr == 1.0
    schedule.step()
    schedule.spend(6.0)
    assert schedule.current_lr == pytest.approx(1.0 + (0.1 - 1.0) * 4 / 8, abs=1e-15)
    assert optimizer.param_groups[0]["lr"] == schedule.current_lr
    schedule.step()
    schedule.spend(12.0)
    assert schedule.current_lr == pytest.approx(0.1, abs=1e-15)  # held at the floor
    state = schedule.state_dict()
    again = WarmupLinearSchedule(optimizer, optim, None, total_seconds=10.0)
    again.load_state_dict(state)
    assert again.current_lr == schedule.current_lr and again.warmup_end_seconds == 2.0


# --- the trainer: budgets, a fake clock, resume ------------------------------------------------------


class FakeClock:
    """Each call is ``tick`` seconds after the last: every training step takes ``tick`` seconds."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.mark.slow  # a short run (nine steps)
def test_a_budget_in_seconds_stops_within_one_step_of_its_time(byte_dataset, tmp_path, monkeypatch):  # noqa: F811
    """Each step takes 0.25 s (a fake clock): the first step warms up (not timed), eight more spend the 2 s."""
    monkeypatch.setattr(trainer_module, "step_clock", FakeClock(0.25))
    result = train(debug_config(byte_dataset, tmp_path, run={"budget": {"kind": "seconds", "amount": 2.0}}))
    assert result.status == "completed" and result.budget_kind == "seconds"
    assert result.steps == 9 and result.train_seconds == 2.0
    assert result.train_seconds - 0.25 < 2.0  # a step fewer would not have spent the budget
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["train_seconds"] for r in records] == [0.25 * max(0, s - 1) for s in range(1, 10)]
    # The warmup (2 steps) ended after step 2, at 0.25 s; step 9 ran at the rate of the 1.75 s spent by then:
    # lr 3e-3 + (3e-4 − 3e-3) x (1.75 − 0.25) / (2 − 0.25).
    assert records[-1]["lr"] == pytest.approx(3e-3 + (3e-4 - 3e-3) * 1.5 / 1.75, rel=1e-12)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"] == [3, 6, 9]


@pytest.mark.slow  # three short runs
def test_a_run_with_a_flops_budget_resumes_exactly(byte_dataset, tmp_path):  # noqa: F811
    budget = {"kind": "flops", "amount": 5.5 * 8 * hand_count("diff", 32)}  # 5 steps
    straight = train(debug_config(byte_dataset, tmp_path / "straight", run={"budget": budget}))
    first = train(debug_config(byte_dataset, tmp_path / "split", run={"budget": budget, "stop_at_step": 2}))
    assert first.status == "paused" and first.steps == 2
    lengthened = r"run.budget.amount: .* \(to lengthen the run on purpose, --set run.budget.amount="
    for other, why in ((dict(budget, amount=2 * budget["amount"]), lengthened),
                       (dict(budget, kind="tokens"), "run.budget: .* flops -> .* tokens"),
                       (None, r"run.budget: .* flops -> null \(run.steps\)")):
        with pytest.raises(CheckpointError, match=why):  # a resumed run is the run that was started
            train(debug_config(byte_dataset, tmp_path / "split", run={"budget": other}), resume=True)
    second = train(debug_config(byte_dataset, tmp_path / "split", run={"budget": budget}), resume=True)
    assert straight.steps == second.steps == 5 and second.status == "completed"
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    assert all(abs(a[s] - b[s]) <= 1e-6 for s in a), (a, b)
    assert second.flops == straight.flops == pytest.approx(5 * 8 * hand_count("diff", 32), rel=1e-12)


@pytest.mark.slow  # two short runs
def test_a_budget_in_seconds_resumes_from_the_seconds_it_spent(byte_dataset, tmp_path, monkeypatch):  # noqa: F811
    """Paused after step 4 (0.75 s: steps 2 to 4 timed), resumed: its first step is untimed again, five more
    spend the 1.25 s left, and the decay goes on from 0.75 s."""
    monkeypatch.setattr(trainer_module, "step_clock", FakeClock(0.25))
    budget = {"kind": "seconds", "amount": 2.0}
    paused = train(debug_config(byte_dataset, tmp_path, run={"budget": budget, "stop_at_step": 4}))
    assert paused.status == "paused" and paused.train_seconds == 0.75
    resumed = train(debug_config(byte_dataset, tmp_path, run={"budget": budget}), resume=True)
    assert resumed.status == "completed" and resumed.steps == 10 and resumed.train_seconds == 2.0
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    assert lr[5] == pytest.approx(3e-3 + (3e-4 - 3e-3) * 0.5 / 1.75, rel=1e-12)  # at the 0.75 s saved
    assert lr[10] == pytest.approx(3e-3 + (3e-4 - 3e-3) * 1.5 / 1.75, rel=1e-12)
    again = train(debug_config(byte_dataset, tmp_path, run={"budget": budget}), resume=True)
    assert again.status == "finished"


# --- a study at equal FLOPs ---------------------------------------------------------------------------


@pytest.mark.slow  # a comparison of two models
def test_a_study_with_a_flops_budget_trains_each_model_to_the_same_flops(byte_dataset, tmp_path):  # noqa: F811
    from diff_transformer.experiments import compare

    models = {kind: {"attention": kind} for kind in ("standard", "diff", "diff_v2")}
    per_step = {kind: 8 * hand_count(kind, 32) for kind in models}
    budget = 6.5 * per_step["diff_v2"]  # DIFF V2: 6 steps; DIFF 6.98, the Transformer 7.08: as many as fit
    config = debug_experiment(byte_dataset, tmp_path / "unused", models=models,
                              run={"budget": {"kind": "flops", "amount": budget}},
                              compare={"evaluations": [], "seeds": 1})
    metrics = compare(config, tmp_path / "cmp", retrieval=False, progress=False)
    for name, model in metrics.models.items():
        assert model.steps == budget // per_step[name]
        assert budget - per_step[name] < model.flops <= budget  # the same FLOPs, within one step
        assert model.flops == pytest.approx(model.steps * per_step[name], rel=1e-12)
    assert [m.steps for m in metrics.models.values()] == [7, 6, 6]
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert f"Every model trained until it had spent a budget of {budget:.3g} training FLOPs (run.budget)" in report
    assert "The budget: equal training FLOPs" in report and "## Verdicts at equal cost" in report
    summaries = sorted((tmp_path / "cmp" / "runs").rglob("summary.json"))
    written = [path.stat().st_mtime_ns for path in summaries]
    again = compare(config, tmp_path / "cmp", retrieval=False, progress=False, resume=True)  # finished: reused
    assert again.models["diff"].flops == metrics.models["diff"].flops
    assert len(summaries) == 3 and [path.stat().st_mtime_ns for path in summaries] == written  # none trained again


# --- reading at equal cost ----------------------------------------------------------------------------


def track(tokens, values, per_token, seconds=None):
    return Trajectory({"tokens": list(tokens), "flops": [t * per_token for t in tokens],
                       "seconds": seconds}, list(values), values[-1])


def test_figures_at_another_cost_are_read_off_each_curve_at_the_least_spent():
    """Two seeds each; the model spends 2 FLOPs per token, DIFF 3: at equal FLOPs DIFF is read at the
    model's end, 400 FLOPs = 133.3 tokens, between its points at 100 and 150 tokens (by hand)."""
    model = [track([100, 200], [4.0, 3.0], 2.0), track([100, 200], [4.2, 3.2], 2.0)]
    diff = [track([100, 150, 200], [3.9, 3.5, 2.9], 3.0), track([100, 150, 200], [4.1, 3.7, 3.1], 3.0)]
    word = lambda d: "w"  # noqa: E731
    at_tokens = reading("tokens", "tokens", model, diff, word, None)
    assert at_tokens.at is None and at_tokens.ours == [3.0, 3.2] and at_tokens.base == [2.9, 3.1]
    at_flops = reading("flops", "tokens", model, diff, word, None)
    assert at_flops.at == 400.0
    share = (400 / 3 - 100) / 50
    assert at_flops.base == pytest.approx([3.9 + (3.5 - 3.9) * share, 4.1 + (3.7 - 4.1) * share], abs=1e-12)
    assert at_flops.ours == [3.0, 3.2]
    assert at_flops.difference.delta == pytest.approx(3.1 - (4.0 + (3.6 - 4.0) * share), abs=1e-12)


def test_time_is_judged_only_on_a_quiet_machine():
    timed = [track([1, 2], [2.0, 1.0], 1.0, seconds=[1.0, 2.0]), track([1, 2], [2.2, 1.2], 1.0, seconds=[1.0, 2.0])]
    slower = [track([1, 2], [2.0, 1.5], 1.0, seconds=[2.0, 4.0]), track([1, 2], [2.1, 1.4], 1.0, seconds=[2.0, 4.0])]
    noisy = Quietness.of("Transformer", [1000.0, 1200.0])  # spread 14%
    steady = Quietness.of("Transformer", [1000.0, 1010.0, 990.0])  # spread 1%
    assert not noisy.quiet and steady.quiet and steady.spread == pytest.approx(10 / 1000, rel=1e-12)
    # two runs a and b: std |a − b| / √2 over the mean (a + b) / 2; 1000 and 1070: 49.50 / 1035 = 4.78%
    assert Quietness.of("Transformer", [1000.0, 1070.0]).spread == pytest.approx(70 / 2**0.5 / 1035, rel=1e-12)
    assert Quietness.of("Transformer", [1000.0, 1070.0]).quiet and QUIET_SPREAD == 0.05
    assert reading("seconds", "tokens", timed, slower, lambda d: "w", noisy).verdict.startswith("not judged")
    at_time = reading("seconds", "tokens", timed, slower, lambda d: "w", steady)
    assert at_time.at == 2.0 and at_time.base == [2.0, 2.1]  # the slower model at 2 s: its first point
    assert at_time.ours == [1.0, 1.2]


def test_a_report_names_the_budget_kind_and_each_models_cost():
    from planted import compare_metrics, lm, summary

    from diff_transformer.experiments.report import render_report

    models = {"standard": summary("standard", [3.0, 3.1]), "diff": summary("diff", [2.9, 3.0])}
    for name, steps, flops in (("standard", 19, 4.19e9), ("diff", 18, 4.03e9)):
        models[name].steps, models[name].flops, models[name].flops_per_token = steps, flops, flops / 200
        models[name].train_seconds = [9.0, 11.0]
    language_models = lm(models)
    language_models.budget = dataclasses.replace(language_models.budget, kind="flops", amount=4.2e9)
    report = render_report(compare_metrics(language_models))
    assert ("Every model trained until it had spent a budget of 4.2e+09 training FLOPs (run.budget), in steps of "
            "2 sequences × 32 tokens (steps: Transformer 19, DIFF 18)") in report
    assert "| DIFF | diff | 1 | 18 | 200 | 10.0 s | 4.03e+09 |" in report
    assert "The budget: equal training FLOPs (run.budget in FLOPs" in report
    language_models.budget = dataclasses.replace(language_models.budget, kind="seconds", amount=600.0)
    assert "a budget of 600 training seconds" in render_report(compare_metrics(language_models))


# --- bad budgets, by name ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    (["compare", "--budget", "joules=3"], "--budget: 'joules=3' is not valid (KIND=AMOUNT with KIND one of tokens, "
     "flops, seconds"),
    (["compare", "--budget", "flops=-1"], "the amount of flops must be a positive number"),
    (["compare", "--budget", "tokens=1e6", "--steps", "3"], "--steps sets each run's length in steps and --budget"),
    (["compare", "--budget", "flops=10", "--out", "{tmp}/cmp"],
     "run.budget.amount=10 flops is less than one optimizer step"),
    (["compare", "--config", "scaling", "--budget", "flops=1e12", "--out", "{tmp}/cmp"],
     "run.budget: the scaling study counts its runs' lengths in steps"),
    (["train", "--config", "tiny", "--set", "run.budget.kind=flops"], "run.budget.amount is missing"),
    (["train", "--config", "tiny", "--set", "run.budget={{kind: joules, amount: 1}}"],
     "run.budget.kind must be one of tokens, flops, seconds"),
    (["train", "--config", "tiny", "--set", "run.budget={{kind: seconds, amount: .nan}}"],
     "run.budget.amount must be a finite number"),
    (["train", "--config", "tiny", "--set", "run.budget={{kind: seconds, amount: 0}}"],
     "run.budget.amount must be a positive finite number of seconds, got 0"),
], ids=["kind", "amount", "with-steps", "less-than-a-step", "scaling-study", "missing-amount", "train-kind",
        "nan", "zero"])
def test_a_bad_budget_is_refused_by_name_with_status_2(argv, expected, tmp_path, capsys):
    code = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0]
    assert not (tmp_path / "cmp").exists()  # refused before anything was written


def test_compare_budget_sets_run_budget(tmp_path, monkeypatch):
    import types

    import diff_transformer.experiments as experiments

    seen = {}

    def fake_compare(config, out, **options):
        seen["budget"], seen["steps"] = config.train.run.budget, config.train.run.steps
        return types.SimpleNamespace(wall_seconds=0.0)

    monkeypatch.setattr(experiments, "compare", fake_compare)
    assert main(["compare", "--budget", "flops=2.5e13", "--out", str(tmp_path / "cmp")]) == 0
    assert (seen["budget"].kind, seen["budget"].amount) == ("flops", 2.5e13)
    assert main(["compare", "--steps", "7", "--set", "run.budget={kind: tokens, amount: 1000}",
                 "--out", str(tmp_path / "cmp")]) == 0
    assert seen["budget"] is None and seen["steps"] == 7  # --steps: the length in steps, whatever was set


def test_quietness_needs_two_runs():
    assert Quietness.of("Transformer", [1000.0]).spread is None
    assert not Quietness.of("Transformer", [1000.0]).quiet
    spread = Quietness.of("T", [1.0, 3.0])  # mean 2, sample std √2: a spread of 71%, not quiet
    assert math.isclose(spread.spread, math.sqrt(2) / 2) and not spread.quiet
    assert Quietness.of("T", [100.0, 104.0]).quiet  # std 2.83 over 102: 2.8%, within the 5%


def test_a_grounded_runs_scores_are_read_along_its_curve_by_tokens_flops_and_seconds():
    """Accuracy 0, 0.3, 0.5 after 0, 4 and 8 steps of 4 episodes × 36 tokens (144 a step), 10 FLOPs a
    token, 2 s of training over the 8 steps: by hand, 0.4 at 6 steps = 864 tokens = 8,640 FLOPs = 1.5 s."""
    from planted import grounded_run

    from diff_transformer.experiments.equal_cost import curve_trajectory

    run = grounded_run(0.5, curve=[(0, 0.0, (0.5, 0.5)), (4, 0.3, (0.5, 0.5)), (8, 0.5, (0.5, 0.5))])
    run.flops_per_token, run.train_seconds = 10.0, 2.0
    track = curve_trajectory(run, lambda p: p.scores.accuracy, run.scores.accuracy, steps=8, tokens_per_step=144)
    assert track.costs == {"tokens": [0.0, 576.0, 1152.0], "flops": [0.0, 5760.0, 11520.0], "seconds": [0.0, 1.0, 2.0]}
    for measure, amount in (("tokens", 864.0), ("flops", 8640.0), ("seconds", 1.5)):
        assert track.at(measure, amount) == pytest.approx(0.4, abs=1e-12)
    assert track.final == 0.5
    run.flops_per_token = None  # a kind without a FLOPs term
    assert curve_trajectory(run, lambda p: p.scores.accuracy, 0.5, 8, 144).costs["flops"] is None


def test_the_verdicts_at_equal_cost_are_a_table_per_cost_each_model_a_row_with_its_parameters():
    """Hand-built verdicts of two models against DIFF on three tasks (language modelling, a retrieval task
    and an evaluation measured at the end only): a table at equal tokens (DIFF's own figures in its row),
    one at equal FLOPs without the evaluation, and one line for the time that was not judged."""
    from diff_transformer.evaluation.stats import Difference
    from diff_transformer.experiments.equal_cost import CostReading, EqualCost, EqualCostRow
    from diff_transformer.experiments.report import equal_cost_lines

    not_quiet = CostReading("seconds", None, verdict="not judged: the machine was not quiet enough")

    def row(model, task, experiment, parameters, ends, flops):
        measure = {"Language modelling": "loss", "Retrieval: mqar": "mqar accuracy", "Attention sink": "share"}[task]
        better = "higher" if task == "Retrieval: mqar" else "lower"
        ours, base = ends
        tokens = CostReading("tokens", None, ours, base, Difference(0.1, 0.05, 0.15), f"{model} worse")
        return EqualCostRow(task, measure, better, model, "DIFF", [tokens, flops, not_quiet], experiment, parameters)

    at_flops = CostReading("flops", 2.5e9, [3.1], [3.0], Difference(0.1, -0.2, 0.4), "inconclusive")
    end_only = CostReading("flops", None, verdict="measured at the end only")
    rows = []
    for model, lm_count, small_count in (("Transformer", 1_000, 10), ("DIFF V2", 1_200, 12)):
        rows += [row(model, "Language modelling", "language modelling", (lm_count, 1_001), ([3.1, 3.2], [3.0, 3.1]),
                     at_flops),
                 row(model, "Retrieval: mqar", "retrieval", (small_count, 11), ([0.2, 0.3], [0.4, 0.5]), at_flops),
                 row(model, "Attention sink", "language modelling", (lm_count, 1_001), ([0.3, 0.3], [0.1, 0.1]),
                     end_only)]
    quiet = {"language modelling": None, "retrieval": None, "grounded": None}
    text = "\n".join(equal_cost_lines(EqualCost("tokens", rows, quiet), seeds=2))
    tokens, flops, seconds = (text.split(f"### {h}\n")[1].split("\n### ")[0] for h in (
        "At equal tokens", "At equal training FLOPs", "At equal training time"))
    assert ("| Model | Parameters | Language modelling (lower) | Retrieval: mqar (higher) | Attention sink (lower) |"
            in tokens)
    assert "| DIFF | 1,001 · 11 | 3.05 ± 0.071 | 0.45 ± 0.071 | 0.1 ± 0 |" in tokens  # the base of the first row
    assert "| DIFF V2 | 1,200 · 12 | +0.1 [+0.05, +0.15] **DIFF V2 worse** |" in tokens
    assert "| Model | Parameters | Language modelling (lower) | Retrieval: mqar (higher) |\n" in flops
    assert "| DIFF | 1,001 · 11 | – | – |" in flops  # read with each pair, not its own
    read = "+0.1 [-0.2, +0.4] **inconclusive** (read at 2.5e+09)"
    assert f"| Transformer | 1,000 · 10 | {read} | {read} |" in flops
    assert "Measured at the end of training only (at the budget's measure): Attention sink (lower)." in flops
    assert seconds.strip().split("\n\n")[0] == "Not judged: the machine was not quiet enough."
    assert "Parameters" in text and "(language modelling · retrieval)" in text


def test_every_experiment_is_read_with_its_own_models_parameters_and_costs():
    """Three models, 2 seeds: language-model runs (FLOPs per token 2, DIFF 3), retrieval and grounded runs
    with their own parameter counts, the attention sink measured at the end. Every row carries its
    experiment's counts; DIFF V2's grounded accuracy at equal FLOPs reads DIFF's curve where DIFF V2's
    runs ended (by hand below); the sink is compared at equal tokens only."""
    from planted import grounded, grounded_run, lm, retrieval, retrieval_run, summary, training_run

    from diff_transformer.experiments import load_experiment
    from diff_transformer.experiments.equal_cost import equal_cost
    from diff_transformer.experiments.results import LogPoint, RunLog
    from diff_transformer.experiments.study import Sweep

    names = ("standard", "diff", "diff_v2")
    lm_count, small_count, grounded_count = {"standard": 1000, "diff": 1001, "diff_v2": 1200}, \
        {"standard": 10, "diff": 11, "diff_v2": 12}, {"standard": 20, "diff": 21, "diff_v2": 22}
    per_token = {"standard": 2.0, "diff": 3.0, "diff_v2": 2.0}
    models, sweeps = {}, {}
    for name in names:
        models[name] = summary(name, [3.0, 3.1])
        models[name].parameters = lm_count[name]
        runs = []
        for seed, loss in enumerate((3.0, 3.1)):
            run = training_run(name, seed, loss)
            run.summary.flops_per_token = per_token[name]
            run.log = RunLog(val=[LogPoint(2, 100, loss + 1.0, train_seconds=1.0),
                                  LogPoint(4, 200, loss, train_seconds=2.0)])
            runs.append(run)
        sweeps[name] = Sweep(name, {None: {1e-3: runs}}, {None: {1e-3: MeanStd.of([3.0, 3.1])}}, {None: {1e-3: 0}},
                             {None: 1e-3}, None)

    def small_runs(make, count, name, flops):
        out = [make(), make()]
        for run in out:
            run.parameters, run.flops_per_token = count[name], flops
        return out

    accuracy = {"standard": 0.3, "diff": 0.6, "diff_v2": 0.45}
    found = retrieval({n: small_runs(lambda n=n: retrieval_run(accuracy[n], accuracy[n]), small_count, n,
                                     per_token[n]) for n in names})
    answered = grounded({n: small_runs(lambda n=n: grounded_run(accuracy[n]), grounded_count, n, per_token[n])
                         for n in names})
    labels = {"standard": "Transformer", "diff": "DIFF", "diff_v2": "DIFF V2"}
    sink = {"standard": 0.4, "diff": 0.1, "diff_v2": 0.3}
    suite = {"attention-sink": {"models": {f"{labels[n]} s{s}": {"mean_over_layers": {"mean": sink[n] + s / 100}}
                                           for n in names for s in (0, 1)}}}
    result = equal_cost(load_experiment("tiny"), lm(models, sweeps), found, answered, suite)
    rows = {(r.model, r.task): r for r in result.rows}
    assert {task for _, task in rows} == {"Language modelling", "Retrieval: needle", "Retrieval: mqar",
                                          "Contextual hallucination", "Lookback ratio", "Attention sink"}
    v2 = {task: r for (model, task), r in rows.items() if model == "DIFF V2"}
    assert v2["Language modelling"].parameters == v2["Attention sink"].parameters == (1200, 1001)
    assert v2["Retrieval: mqar"].parameters == (12, 11) and v2["Retrieval: mqar"].experiment == "retrieval"
    assert v2["Contextual hallucination"].parameters == (22, 21)
    assert v2["Contextual hallucination"].experiment == "grounded"
    # Grounded: 8 steps × 4 examples × 36 tokens = 1,152 tokens, DIFF V2 2,304 FLOPs, DIFF 3,456: DIFF read at
    # 2,304 FLOPs = 768 tokens, 2/3 of the way along its curve from 0 (step 0) to 0.6 (step 8): 0.4.
    flops = v2["Contextual hallucination"].readings[1]
    assert flops.measure == "flops" and flops.at == pytest.approx(2304.0)
    assert flops.base == pytest.approx([0.4, 0.4], abs=1e-12) and flops.ours == pytest.approx([0.45, 0.45], abs=1e-12)
    tokens, at_flops = v2["Attention sink"].readings[:2]
    assert tokens.ours == [0.3, 0.31] and tokens.base == [0.1, 0.11] and tokens.at is None
    assert at_flops.verdict == "measured at the end only" and at_flops.difference is None
    # How quiet: the Transformer's runs in each experiment (every lr and seed), 2 each here; the planted
    # small runs all train at 1 token/s and the language-model runs at 1,000: no spread, quiet.
    for experiment, rate in (("language modelling", 1000.0), ("retrieval", 1.0), ("grounded", 1.0)):
        quiet = result.quietness[experiment]
        assert (quiet.reference, quiet.runs, quiet.tokens_per_s.mean, quiet.spread) == ("Transformer", 2, rate, 0.0)
        assert quiet.quiet
