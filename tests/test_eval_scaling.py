"""The scaling-law fitter and the matching fraction (paper Fig. 3)."""

import json

import numpy as np
import pytest

from diff_transformer.evaluation import scaling


def law(a, b, c):
    return lambda x: a * x ** (-b) + c


def test_fit_recovers_known_parameters():
    xs = np.geomspace(1e6, 1e9, 7)
    fit = scaling.fit_power_law(xs, law(120.0, 0.3, 1.8)(xs))
    assert fit.a == pytest.approx(120.0, rel=1e-3)
    assert fit.b == pytest.approx(0.3, rel=1e-3)
    assert fit.c == pytest.approx(1.8, rel=1e-3)
    assert fit.rmse < 1e-5 and not fit.fixed_c


def test_fit_is_robust_to_small_noise():
    xs = np.geomspace(1e7, 1e10, 8)
    ys = law(400.0, 0.35, 2.0)(xs) * (1 + 0.002 * np.sin(np.arange(8)))
    fit = scaling.fit_power_law(xs, ys)
    assert fit.c == pytest.approx(2.0, abs=0.15)
    assert fit(3e8) == pytest.approx(law(400.0, 0.35, 2.0)(3e8), rel=0.01)


def test_two_points_give_a_pure_power_law_and_one_is_an_error():
    fit = scaling.fit_power_law([1e6, 1e8], [4.0, 2.0])
    assert fit.fixed_c and fit.c == 0.0 and fit(1e6) == pytest.approx(4.0) and fit(1e8) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two distinct"):
        scaling.fit_power_law([1e6, 1e6], [4.0, 3.0])
    with pytest.raises(ValueError, match="positive"):
        scaling.fit_power_law([1e6, -1], [4.0, 3.0])


def test_matching_fraction_of_a_shifted_law():
    """DIFF's law is the Transformer's at 0.6x the parameters: the fraction must be 0.6."""
    base = law(300.0, 0.3, 1.9)
    sizes = [2e7, 5e7, 1e8, 3e8, 1e9]
    runs = [{"attention": "standard", "params": n, "tokens": 1e9, "loss": base(n)} for n in sizes]
    runs += [{"attention": "diff", "params": n, "tokens": 1e9, "loss": base(n / 0.6)} for n in sizes]
    result = scaling.evaluate(scaling.runs_from_json({"runs": runs}))
    match = result["matching"]["diff"]
    assert match["median_fraction"] == pytest.approx(0.6, rel=1e-3)
    assert all(e["fraction"] == pytest.approx(0.6, rel=1e-3) for e in match["fractions"])
    assert len(match["loss_differences_at_same_x"]) == 5
    report = scaling.report(result)
    assert "0.60×" in report and "agrees with the paper" in report


def test_runs_from_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"attention": "diff", "params": 10, "tokens": 5, "loss": 3.0}]))
    (tmp_path / "b.json").write_text(json.dumps({"models": {"s": {"attention": "standard", "parameters": 10,
                                                                  "tokens": 5, "final_val_loss": {"mean": 3.2}}}}))
    runs = scaling.load_runs([tmp_path / "a.json", tmp_path / "b.json"])
    assert [(r["attention"], r["loss"]) for r in runs] == [("diff", 3.0), ("standard", 3.2)]
    (tmp_path / "c.json").write_text(json.dumps([{"params": 1}]))
    with pytest.raises(ValueError, match="attention"):
        scaling.load_runs([tmp_path / "c.json"])
    result = scaling.evaluate(runs)
    assert result["matching"]["diff"]["median_fraction"] is None
    assert result["matching"]["diff"]["loss_differences_at_same_x"][0]["difference"] == pytest.approx(-0.2)
