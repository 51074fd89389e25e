"""The claims table: the difference's interval computed by hand, the verdict rule, the figures read."""

import math

import pytest

from diff_transformer.train import load_config
from diff_transformer.experiments.claims import difference, paper_claims, render_claims, t_quantile_95, verdict


def test_welch_interval_matches_a_hand_computation():
    # ours 1, 2, 3 (variance 1), base 0, 0, 0 (variance 0): se = sqrt(1/3), Welch df = 2, t(2) = 4.303.
    d = difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    half = 4.303 * math.sqrt(1 / 3)
    assert d["delta"] == pytest.approx(2.0)
    assert d["low"] == pytest.approx(2.0 - half, abs=1e-3) and d["high"] == pytest.approx(2.0 + half, abs=1e-3)
    # Equal variances and sizes: df = 2n − 2 = 4, t(4) = 2.776, se = sqrt(2·var/n).
    d = difference([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert d["delta"] == pytest.approx(-1.0)
    assert d["high"] == pytest.approx(-1.0 + 2.776 * math.sqrt(2 / 3), abs=1e-3)
    assert difference([1.0], [2.0]) == {"delta": -1.0, "low": None, "high": None}
    assert t_quantile_95(2.5) == pytest.approx((4.303 + 3.182) / 2) and t_quantile_95(1000) == 1.96


def test_the_verdict_follows_the_interval_and_the_papers_sign():
    assert verdict({"delta": -0.1, "low": -0.2, "high": -0.05}, -1) == "agrees"
    assert verdict({"delta": 0.1, "low": 0.05, "high": 0.2}, -1) == "contradicts"
    assert verdict({"delta": 0.1, "low": 0.05, "high": 0.2}, +1) == "agrees"
    assert verdict({"delta": 0.01, "low": -0.05, "high": 0.07}, -1) == "inconclusive"
    assert verdict({"delta": 0.01, "low": None, "high": None}, -1) == "inconclusive (one seed)"


def _metrics(diff_loss, base_loss, retrieval=None):
    def model(losses):
        return {"final_val_loss": {"per_seed": losses}, "seeds": list(range(len(losses)))}

    return {"models": {"standard": model(base_loss), "diff": model(diff_loss)}, **({"retrieval": retrieval} if retrieval else {})}


def _retrieval_run(needle, mqar, answer, noise, full, four):
    return {"mean_accuracy": {"needle": needle, "mqar": mqar},
            "attention": [{"answer": 0.0, "noise": 1.0, "other": 0.0}, {"answer": answer, "noise": noise, "other": 0.0}],
            "quantized_accuracy": {"full": full, "4": four}}


def test_claims_read_the_right_figures_of_each_model():
    config = load_config("tiny")
    retrieval = {"chance": 0.02, "settings": {"quantize_bits": [8, 4]}, "models": {
        "standard": {"runs": [_retrieval_run(0.55, 0.4, 0.2, 0.7, 0.6, 0.3), _retrieval_run(0.56, 0.5, 0.3, 0.6, 0.7, 0.3)]},
        "diff": {"runs": [_retrieval_run(0.85, 0.7, 0.5, 0.3, 0.8, 0.7), _retrieval_run(0.86, 0.8, 0.6, 0.2, 0.9, 0.8)]},
    }}
    suite = {"outliers": {"models": {
        "Transformer s0": {"attention_logits": {"top1": 40.0, "median": 2.0}, "hidden_states": {"top1": 9.0, "median": 3.0}},
        "Transformer s1": {"attention_logits": {"top1": 60.0, "median": 2.0}, "hidden_states": {"top1": 12.0, "median": 3.0}},
        "DIFF s0": {"attention_logits": {"top1": 10.0, "median": 1.0}, "hidden_states": {"top1": 6.0, "median": 2.0}},
        "DIFF s1": {"attention_logits": {"top1": 12.0, "median": 1.0}, "hidden_states": {"top1": 8.0, "median": 2.0}},
    }}}
    rows = {r["measure"].split(" (")[0]: r for r in paper_claims(config, _metrics([3.0, 3.2], [3.1, 3.3], retrieval), suite)}
    lm = rows["final validation loss"]
    assert lm["diff"]["mean"] == pytest.approx(3.1) and lm["transformer"]["mean"] == pytest.approx(3.2)
    assert lm["difference"]["delta"] == pytest.approx(-0.1) and lm["verdict"] == "inconclusive"
    needle = rows["needle accuracy, mean over difficulty cells"]
    assert needle["difference"]["delta"] == pytest.approx(0.3) and needle["verdict"] == "agrees"
    mqar = rows["mqar accuracy, mean over difficulty cells"]
    assert mqar["difference"]["delta"] == pytest.approx(0.3) and mqar["verdict"] == "inconclusive"  # ±0.30 > 0.30
    answer = rows["share of the answer row on the queried needle, last layer"]
    assert answer["diff"]["per_seed"] == [0.5, 0.6] and answer["transformer"]["per_seed"] == [0.2, 0.3]
    noise = rows["share of the answer row on noise and distractors, last layer"]
    assert noise["difference"]["delta"] == pytest.approx(0.25 - 0.65) and noise["verdict"] == "agrees"
    quant = rows["retrieval accuracy lost with 4-bit attention logits"]
    assert quant["diff"]["per_seed"] == pytest.approx([0.1, 0.1]) and quant["transformer"]["per_seed"] == pytest.approx([0.3, 0.4])
    logits = rows["top-1 / median magnitude of attention logits"]
    assert logits["diff"]["per_seed"] == [10.0, 12.0] and logits["transformer"]["per_seed"] == [20.0, 30.0]
    hidden = rows["top-1 / median magnitude of hidden states"]
    assert hidden["diff"]["per_seed"] == [3.0, 4.0] and hidden["transformer"]["per_seed"] == [3.0, 4.0]
    assert hidden["verdict"] == "inconclusive"
    table = "\n".join(render_claims(list(rows.values()), 2))
    assert "| Language modelling |" in table and "**agrees**" in table and "[95% CI]" in table


def test_retrieval_near_chance_is_not_tested():
    config = load_config("tiny")
    retrieval = {"chance": 0.1, "settings": {"quantize_bits": [4]}, "models": {
        "standard": {"runs": [_retrieval_run(0.10, 0.1, 0.1, 0.8, 0.1, 0.1)] * 2},
        "diff": {"runs": [_retrieval_run(0.15, 0.12, 0.1, 0.8, 0.1, 0.1), _retrieval_run(0.16, 0.12, 0.1, 0.8, 0.1, 0.1)]},
    }}
    rows = paper_claims(config, _metrics([3.0, 3.1], [3.0, 3.1], retrieval), {})
    needle = next(r for r in rows if r["measure"].startswith("needle"))
    assert needle["verdict"] == "not testable here" and "chance" in needle["note"]


def test_attention_claims_use_the_deepest_layer_measured_in_every_model():
    config = load_config("tiny")

    def run(layers):
        return {"mean_accuracy": {"needle": 0.5, "mqar": 0.5}, "attention": layers,
                "quantized_accuracy": {"full": 0.5, "4": 0.5}}

    share = lambda answer: {"answer": answer, "noise": 1.0 - answer, "other": 0.0}  # noqa: E731
    # DIFF's last layer has no measurable rows (None): layer 0 is compared, and the row says so.
    retrieval = {"chance": 0.02, "settings": {"quantize_bits": [4]}, "models": {
        "standard": {"runs": [run([share(0.1), share(0.3)]), run([share(0.2), share(0.3)])]},
        "diff": {"runs": [run([share(0.4), None]), run([share(0.5), share(0.9)])]},
    }}
    rows = {r["measure"]: r for r in paper_claims(config, _metrics([3.0, 3.1], [3.0, 3.1], retrieval), {})}
    answer = rows["share of the answer row on the queried needle, layer 0"]
    assert answer["diff"]["per_seed"] == [0.4, 0.5] and answer["transformer"]["per_seed"] == [0.1, 0.2]
    assert "not measurable" in answer["note"]
    # No layer measurable everywhere: one row, not testable, with no figures.
    retrieval["models"]["diff"]["runs"] = [run([None, None])] * 2
    rows = paper_claims(config, _metrics([3.0, 3.1], [3.0, 3.1], retrieval), {})
    noise = next(r for r in rows if r["claim"] == "Attention noise")
    assert noise["verdict"] == "not testable here" and noise["diff"] is None
    assert "| Attention noise | share of the answer row on noise and distractors (lower) | – | – | – |" in "\n".join(
        render_claims(rows, 2))
