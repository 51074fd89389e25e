"""The compare report's diagnostics: curves from the runs' "diagnostics" records, the λ / attention-
branch RMS plot (its lines checked against means taken here by hand), the report's image line."""

import pytest

from diff_transformer.experiments import load_experiment, report, select_models
from diff_transformer.experiments.language_models import LanguageModelling
from diff_transformer.experiments.report import render_report, write_plots
from diff_transformer.experiments.results import LogPoint, RunLog, diagnostics_of
from diff_transformer.experiments.study import RunKey, sweep
from planted import compare_metrics, training_run


def run(name, seed, lambdas, rms, extra_step=False, diagnostics=True):
    """A finished run whose log holds diagnostics records at steps 2 and 4 (and 6)."""
    done = training_run(name, seed, 5.0)
    log = RunLog(train=[LogPoint(2, 64, loss=5.0)])
    if diagnostics:
        for i, step in enumerate([2, 4, 6] if extra_step else [2, 4]):
            log.diagnostics.append(LogPoint(step, 32 * step, lambdas=None if lambdas is None else tuple(lambdas[i]),
                                            attn_rms=tuple(rms[i])))
    done.log = log
    return done


def runs(diagnostics=True):
    return {
        "standard": [run("standard", 0, None, [[1.0, 2.0], [3.0, 4.0]], diagnostics=diagnostics),
                     run("standard", 1, None, [[2.0, 4.0], [5.0, 6.0]], diagnostics=diagnostics)],
        "diff": [run("diff", 0, [[0.2, 0.4], [0.3, 0.5], [9, 9]], [[1.0, 1.0], [1.0, 1.0], [9, 9]], extra_step=True,
                     diagnostics=diagnostics),
                 run("diff", 1, [[0.4, 0.6], [0.5, 0.9]], [[3.0, 1.0], [1.0, 2.0]], diagnostics=diagnostics)],
    }


def metrics_of(by_model):
    config = load_experiment("tiny")
    results = {RunKey(name, i, 1e-3): r
               for name, model_runs in by_model.items() for i, r in enumerate(model_runs)}
    sweeps = sweep(results, lambda r: r.final_val_loss, lower_is_better=True)
    return compare_metrics(LanguageModelling.of(config, sweeps, list(by_model), [None]))


def test_curves_keep_the_steps_every_seed_logged():
    curves = diagnostics_of(runs()["diff"])
    assert curves.step == [2, 4] and curves.tokens == [64, 128]  # step 6: seed 0 only
    assert curves.lambdas == [[(0.2, 0.4), (0.3, 0.5)], [(0.4, 0.6), (0.5, 0.9)]]
    assert diagnostics_of(runs()["standard"]).lambdas is None
    assert diagnostics_of(runs(diagnostics=False)["diff"]) is None


def test_the_plot_draws_the_mean_over_seeds_of_every_layer(tmp_path, monkeypatch):
    metrics = metrics_of(runs())
    drawn = {}
    save = report.save_plot
    monkeypatch.setattr(report, "save_plot", lambda fig, path: drawn.setdefault(path.name, fig) and save(fig, path))
    paths = write_plots(metrics, tmp_path)
    assert tmp_path / "diagnostics.png" in paths and (tmp_path / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    ax_lambda, ax_rms = drawn["diagnostics.png"].axes
    lines = {(line.get_color(), line.get_linestyle()): list(line.get_ydata()) for line in ax_lambda.lines}
    # DIFF is the second model (C1); layer 0 solid, layer 1 dashed; mean of the two seeds by hand
    assert lines[("C1", "-")] == pytest.approx([0.3, 0.4]) and lines[("C1", "--")] == pytest.approx([0.5, 0.7])
    assert len(lines) == 2  # the Transformer has no λ
    rms = {(line.get_color(), line.get_linestyle()): list(line.get_ydata())
           for line in ax_rms.lines if len(line.get_ydata())}
    assert rms[("C0", "-")] == pytest.approx([1.5, 4.0]) and rms[("C0", "--")] == pytest.approx([3.0, 5.0])
    assert rms[("C1", "-")] == pytest.approx([2.0, 1.0]) and rms[("C1", "--")] == pytest.approx([1.0, 1.5])
    assert list(ax_lambda.lines[0].get_xdata()) == pytest.approx([64e-6, 128e-6])  # millions of tokens
    assert "![λ and attention-branch RMS per layer](diagnostics.png)" in render_report(metrics)


def test_runs_without_diagnostics_get_no_plot_and_no_line(tmp_path):
    metrics = metrics_of(runs(diagnostics=False))
    assert write_plots(metrics, tmp_path) == [tmp_path / "loss.png"]
    assert "diagnostics.png" not in render_report(metrics)


def test_the_symmetric_variant_is_selected_by_its_kind():
    assert select_models(load_experiment("tiny"), ["standard", "diff", "diff_symmetric"]) == \
        ["standard", "diff", "diff_symmetric"]
