"""The compare report's diagnostics: curves from the runs' "diagnostics" records, the λ / attention-
branch RMS plot (its lines checked against means taken here by hand), the report's image line."""

import pytest

from diff_transformer.experiments import report
from diff_transformer.experiments.compare import select_models
from diff_transformer.experiments.report import build_metrics, diagnostic_curves, render_report, write_plots
from diff_transformer.train.config import load_config


def run(seed, attention, lambdas, rms, extra_step=False):
    """A run summary as compare collects it, with diagnostics records at steps 2 and 4 (and 6)."""
    records = [{"kind": "train", "step": 2, "tokens": 64, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}]
    for i, step in enumerate([2, 4, 6] if extra_step else [2, 4]):
        record = {"kind": "diagnostics", "step": step, "tokens": 32 * step, "attn_rms": rms[i], "grad_norm": 1.0}
        if attention == "diff":
            record["lambda"] = lambdas[i]
        records.append(record)
    return dict(status="completed", final_val_loss=5.0, tokens_per_s=1.0, peak_memory_bytes=1 << 20,
                peak_memory_kind="peak RSS", parameters=100, tokens=128, train_seconds=1.0, wall_seconds=1.0,
                load_average=None, seed=seed, message="", device="cpu", metrics=records)


RUNS = {
    "standard": [run(0, "standard", None, [[1.0, 2.0], [3.0, 4.0]]), run(1, "standard", None, [[2.0, 4.0], [5.0, 6.0]])],
    "diff": [run(0, "diff", [[0.2, 0.4], [0.3, 0.5], [9, 9]], [[1.0, 1.0], [1.0, 1.0], [9, 9]], extra_step=True),
             run(1, "diff", [[0.4, 0.6], [0.5, 0.9]], [[3.0, 1.0], [1.0, 2.0]])],
}


def test_curves_keep_the_steps_every_seed_logged():
    curves = diagnostic_curves(RUNS["diff"])
    assert curves["step"] == [2, 4] and curves["tokens"] == [64, 128]  # step 6: seed 0 only
    assert curves["lambda"] == [[[0.2, 0.4], [0.3, 0.5]], [[0.4, 0.6], [0.5, 0.9]]]
    assert "lambda" not in diagnostic_curves(RUNS["standard"])
    assert diagnostic_curves([{**RUNS["diff"][0], "metrics": RUNS["diff"][0]["metrics"][:1]}]) is None


def test_the_plot_draws_the_mean_over_seeds_of_every_layer(tmp_path, monkeypatch):
    metrics = build_metrics(load_config("tiny"), RUNS, wall_seconds=1.0, nproc=1)
    drawn = {}
    save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.setdefault(path.name, fig) and save(fig, path))
    paths = write_plots(metrics, tmp_path)
    assert tmp_path / "diagnostics.png" in paths and (tmp_path / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    ax_lambda, ax_rms = drawn["diagnostics.png"].axes
    lines = {(line.get_color(), line.get_linestyle()): list(line.get_ydata()) for line in ax_lambda.lines}
    # DIFF is the second model (C1); layer 0 solid, layer 1 dashed; mean of the two seeds by hand
    assert lines[("C1", "-")] == pytest.approx([0.3, 0.4]) and lines[("C1", "--")] == pytest.approx([0.5, 0.7])
    assert len(lines) == 2  # the Transformer has no λ
    rms = {(line.get_color(), line.get_linestyle()): list(line.get_ydata()) for line in ax_rms.lines if len(line.get_ydata())}
    assert rms[("C0", "-")] == pytest.approx([1.5, 4.0]) and rms[("C0", "--")] == pytest.approx([3.0, 5.0])
    assert rms[("C1", "-")] == pytest.approx([2.0, 1.0]) and rms[("C1", "--")] == pytest.approx([1.0, 1.5])
    assert list(ax_lambda.lines[0].get_xdata()) == pytest.approx([64e-6, 128e-6])  # millions of tokens
    assert "![λ and attention-branch RMS per layer](diagnostics.png)" in render_report(metrics)


def test_runs_without_diagnostics_get_no_plot_and_no_line(tmp_path):
    bare = {name: [{**r, "metrics": [m for m in r["metrics"] if m["kind"] != "diagnostics"]} for r in runs]
            for name, runs in RUNS.items()}
    metrics = build_metrics(load_config("tiny"), bare, wall_seconds=1.0, nproc=1)
    assert write_plots(metrics, tmp_path) == [tmp_path / "loss.png"]
    assert "diagnostics.png" not in render_report(metrics)


def test_the_symmetric_variant_is_selected_by_its_kind():
    assert select_models(load_config("tiny"), ["standard", "diff", "diff_symmetric"]) == ["standard", "diff", "diff_symmetric"]
