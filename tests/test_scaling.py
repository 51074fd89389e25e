"""The scaling study (``compare --config scaling``): the axes it trains, the lr grid the engine extends
(a fake trainer), the trend in words on constructed cases, the report's words on planted runs (two sizes,
odd signs, few tokens per parameter), the shipped configs (the CPU one at ten or more tokens per
parameter everywhere), and an end-to-end run at the debug size whose metrics.json ``eval scaling`` reads
back to the same figures. The laws and the fraction themselves: tests/test_eval_scaling.py."""

import json
import math
import statistics
from pathlib import Path

import pytest

from diff_transformer.cli import main
from diff_transformer.experiments import compare, load_experiment
from diff_transformer.experiments.language_models import Machine
from diff_transformer.experiments.results import RunLog, TrainingRun
from diff_transformer.experiments.scaling import (
    analyse, non_embedding_parameters, render_report, scaling_keys, size_trend, sized_train, training_flops,
    trend_words,
)
from diff_transformer.experiments.study import RunKey, extended_sweep
from diff_transformer.model import LanguageModel
from diff_transformer.train.trainer import TrainResult
from test_train import byte_dataset, debug_experiment  # noqa: F401  (byte_dataset is a fixture)

SIZES = [1e5, 2e5, 4e5, 8e5, 1.6e6]


def test_the_trend_along_size_is_a_slope_per_doubling_with_its_interval():
    labels = {"diff": "DIFF", "standard": "Transformer"}
    # DIFF − Transformer = 0.10 − 0.02·log2(N / 1e5): it falls by 0.02 per doubling; two seeds a size.
    pairs = [(n, 0.10 - 0.02 * math.log2(n / 1e5) + e) for n in SIZES for e in (-0.001, 0.001)]
    trend = size_trend("diff", "standard", pairs, labels)
    assert trend.slope == pytest.approx(-0.02, abs=1e-9) and trend.low < -0.02 < trend.high < 0
    assert "falls with size, in favour of DIFF" in trend.words and "the gap shrinks" in trend.words
    flat = size_trend("diff", "standard", [(n, 0.05 + e) for n in SIZES for e in (-0.01, 0.01)], labels)
    assert flat.words.startswith("no trend measured")


@pytest.mark.parametrize("slope, mean_gap, words", [
    (-0.02, +0.1, "the gap shrinks as models grow (DIFF behind and closing)"),
    (-0.02, -0.1, "the gap grows as models grow (DIFF ahead by more)"),
    (+0.02, +0.1, "the gap grows as models grow (DIFF behind by more)"),
    (+0.02, -0.1, "the gap shrinks as models grow (DIFF ahead and closing)"),
])
def test_the_trend_words_say_which_way_the_gap_moves(slope, mean_gap, words):
    text = trend_words("DIFF", "Transformer", slope, slope - 0.01, slope + 0.01, mean_gap)
    assert words in text and ("falls" if slope < 0 else "rises") in text
    assert trend_words("DIFF", "Transformer", 0.01, -0.01, 0.03, 0.1).startswith("no trend measured")


def test_a_trend_needs_two_sizes_and_three_differences_and_says_what_it_had():
    labels = {"diff": "DIFF", "standard": "Transformer"}
    two = size_trend("diff", "standard", [(1e5, 0.1), (2e5, 0.2)], labels)  # two sizes, one seed each
    assert two.slope is None and two.words == ("no trend measured: 2 differences at 2 sizes (a slope's interval "
                                               "needs two sizes and three differences)")
    one = size_trend("diff", "standard", [(1e5, 0.1), (1e5, 0.2), (1e5, 0.3)], labels)
    assert one.words.startswith("no trend measured: 3 differences at 1 size ")
    measured = size_trend("diff", "standard", [(1e5, 0.1), (1e5, 0.12), (2e5, 0.2), (2e5, 0.21)], labels)
    assert measured.slope is not None  # two sizes, two seeds: a slope on 2 degrees of freedom


def test_the_axes_train_every_model_at_every_size_at_each_lr_of_its_grid():
    config = load_experiment("scaling")
    keys = scaling_keys(config, ["standard", "diff"], [0, 1, 2])
    steps = config.train.run.steps
    grids = {"w8": {1.6e-2, 3.2e-2, 6.4e-2}, "w12": {8e-3, 1.6e-2, 3.2e-2}, "w16": {8e-3, 1.6e-2, 3.2e-2},
             "w24": {4e-3, 8e-3, 1.6e-2}, "w32": {4e-3, 8e-3}, "w36": {4e-3, 8e-3}}
    assert len(keys) == 3 * 2 * sum(map(len, grids.values()))  # seeds × models × (sizes × lrs), one budget
    for size, grid in grids.items():
        assert {k.lr for k in keys if k.size == size} == grid
    assert {k.steps for k in keys} == {steps}
    assert [k.seed for k in keys] == sorted(k.seed for k in keys)  # seeds outermost
    # Each kind matched as the presets are: DIFF with half the heads of the same width.
    standard = sized_train(config, RunKey("standard", 0, 1e-3, None, "w24", steps)).model("standard").model_config()
    diff = sized_train(config, RunKey("diff", 0, 1e-3, None, "w24", steps)).model("diff").model_config()
    assert (standard.d_model, standard.n_layers) == (diff.d_model, diff.n_layers) == (24, 2)
    assert standard.n_heads == 2 * diff.n_heads and standard.head_dim == diff.head_dim


def test_the_cpu_config_is_a_regime_where_size_matters():
    """Five sizes or more over 16× or more, many small steps (a thousand or more; batches of 4 windows),
    tokens per non-embedding parameter from the paper's range's upper end (12) down to about 5 (the
    paper's Figure 3a spans 12 down to 0.76), three seeds, two lrs or more at every size (three at the
    smallest, where the best lr moves most with size), and the loss measured on held-out windows."""
    config = load_experiment("scaling")
    train = config.train
    tokens = train.run.steps * train.data.batch_size * train.data.seq_len
    counts = {(m, size): non_embedding_parameters(sized_train(config, RunKey(m, 0, 1e-3, None, size, 1)), m)
              for m in config.compare.models for size in config.scaling.sizes}
    assert len(config.scaling.sizes) >= 5 and config.compare.seeds >= 3
    assert train.run.steps >= 1000 and train.data.batch_size <= 4
    assert min(tokens / n for n in counts.values()) >= 4.5
    largest, smallest = list(config.scaling.sizes)[-1], list(config.scaling.sizes)[0]
    assert counts["standard", largest] / counts["standard", smallest] >= 16
    assert all(len(config.scaling.grid(size)) >= 2 for size in config.scaling.sizes)
    assert len(config.scaling.grid(smallest)) >= 3 and train.data.heldout_sequences > 0


@pytest.mark.slow  # builds every size of the paper's configs (7 s)
@pytest.mark.parametrize("name", ["scaling", "scaling-gpu", "scaling-paper"])
def test_the_shipped_scaling_configs_build_their_models_and_span_what_they_say(name):
    config = load_experiment(name)
    names = config.compare.models
    counts = []
    for size in config.scaling.sizes:
        trains = {m: sized_train(config, RunKey(m, 0, 1e-3, None, size, config.train.run.steps)) for m in names}
        for model, train in trains.items():
            assert LanguageModel(train.model(model).model_config(), device="meta").num_parameters() > 0
        counts.append(non_embedding_parameters(trains[names[0]], names[0]))
    assert counts == sorted(counts) and counts[-1] / counts[0] >= 8
    span = f"{counts[-1] / counts[0]:.1f}x"  # the span the config's opening comment states
    assert span in (Path(__file__).parents[1] / "src/diff_transformer/configs" / f"{name}.yaml").read_text()
    assert config.train.data.heldout_sequences > 0
    assert training_flops(config, names, list(range(config.compare.seeds))) > 0


def test_the_paper_config_is_figure_3a():
    config = load_experiment("scaling-paper")
    assert list(config.scaling.sizes) == ["830m", "1.4b", "2.8b", "6.8b", "13.1b"]
    train = config.train
    assert train.run.steps * train.data.batch_size * train.data.seq_len == 40_000 * 128 * 2048  # ≈ 10.5B tokens
    assert config.scaling.grid("2.8b") == [1.5e-4] and config.scaling.grid("6.8b") == [7.5e-5]


def test_flops_count_six_per_parameter_per_token_and_the_attention_maps(byte_dataset, tmp_path):  # noqa: F811
    config = debug_experiment(byte_dataset, tmp_path, models={"standard": {"attention": "standard"}},
                              run={"steps": 4}, scaling={"sizes": {"a": {"d_model": 32, "n_layers": 1, "n_heads": 1},
                                                                   "b": {"d_model": 64, "n_layers": 2, "n_heads": 1}}},
                              compare={"seeds": 1})
    expected = 0.0
    for size, (d, layers) in {"a": (32, 1), "b": (64, 2)}.items():
        train = sized_train(config, RunKey("standard", 0, 3e-3, None, size, 4))
        tokens = 4 * 8 * 32
        expected += tokens * (6 * (non_embedding_parameters(train, "standard") + 512 * d) + 6 * layers * 32 * d)
    assert training_flops(config, ["standard"], [0]) == pytest.approx(expected)


# --- the lr grid the engine extends ----------------------------------------------------------------------


def test_a_best_lr_at_an_end_of_its_grid_extends_the_grid_until_inside_or_the_limit():
    """A fake trainer whose loss is (ln(lr / optimum))²: the engine trains one lr further out, every seed,
    while the best lies at an end, up to the limit; the sweeps name the lrs added and the edges left."""
    optimum = {("a", 4): 1e-2, ("b", 4): 1e-1, ("c", 4): 1e-3, ("d", 4): 4e-3}
    trained: list[list[RunKey]] = []

    def train(keys):
        trained.append(list(keys))
        return {k: math.log(k.lr / optimum[k.size, k.steps]) ** 2 + 0.01 * k.seed for k in keys}

    grid = (2e-3, 4e-3, 8e-3)
    keys = [RunKey("m", seed, lr, None, size, 4) for seed in (0, 1) for size in "abcd" for lr in grid]
    sweeps = extended_sweep(keys, train, lambda loss: loss, lower_is_better=True, limit=2)
    assert trained[0] == keys
    # a: 8e-3 best, 1.6e-2 added, 8e-3 stays best (inside). b: 1.6e-2 then 3.2e-2, still at the top (limit).
    # c: 1e-3 added below, then 5e-4: the optimum 1e-3 inside. d: 4e-3 inside from the start.
    assert sorted({(k.size, k.lr) for batch in trained[1:] for k in batch}) == [
        ("a", 1.6e-2), ("b", 1.6e-2), ("b", 3.2e-2), ("c", 5e-4), ("c", 1e-3)]
    assert all(len([k for k in batch if (k.size, k.lr) == (size, lr)]) == 2  # every seed
               for batch in trained[1:] for size, lr in {(k.size, k.lr) for k in batch})
    by_size = {cell[1]: found for cell, found in sweeps.items()}
    assert by_size["a"].lr == 8e-3 and by_size["a"].added[None] == (1.6e-2,) and by_size["a"].edge(None) is None
    assert by_size["b"].lr == 3.2e-2 and by_size["b"].added[None] == (1.6e-2, 3.2e-2)
    assert by_size["b"].edge(None) == "high"  # the limit reached: the report names it
    assert by_size["c"].lr == pytest.approx(1e-3) and by_size["c"].edge(None) is None
    assert by_size["d"].added[None] == () and by_size["d"].lr == 4e-3
    # limit 0: the plain sweep, nothing added
    plain = extended_sweep(keys, train, lambda loss: loss, lower_is_better=True, limit=0)
    assert all(found.added[None] == () for found in plain.values())


# --- the report's words on planted runs -----------------------------------------------------------------


def planted_runs(config, keys, loss):
    """Every key a finished run of the trainer whose held-out loss is ``loss(key)`` (validation 0.01 lower)."""
    runs = {}
    for key in keys:
        train = sized_train(config, key)
        value = loss(key)
        summary = TrainResult(
            model=key.model, attention=config.attention(key.model), parameters=0, status="completed", steps=key.steps,
            tokens=key.steps * train.data.batch_size * train.data.seq_len, final_val_loss=value - 0.01,
            tokens_per_s=1000.0, peak_memory_bytes=1, peak_memory_kind="peak RSS", train_seconds=1.0, wall_seconds=1.0,
            load_average=None, device="cpu", world_size=1, checkpoint=None, final_heldout_loss=value)
        runs[key] = TrainingRun(key, summary, RunLog(), Path("unused"))
    return runs


def test_the_report_on_two_sizes_two_budgets_odd_signs_and_few_tokens_per_parameter():
    config = load_experiment("scaling", [
        "scaling.sizes={a: {d_model: 32, n_layers: 2, n_heads: 1}, b: {d_model: 64, n_layers: 3, n_heads: 1}}",
        "scaling.budgets=[0.5, 1.0]", "scaling.lr_grid=[4e-3]", "scaling.lr_grid_by_size={}", "run.steps=2",
        "compare.budget_note=''",
        "data.batch_size=1", "data.seq_len=8", "scaling.bootstrap_resamples=100"])
    names = ["standard", "diff", "diff_v2"]
    keys = scaling_keys(config, names, [0, 1])
    offset = {"standard": 0.0, "diff": +0.013, "diff_v2": -0.0021}  # DIFF behind, V2 ahead

    def loss(key):
        return 3.0 - 0.05 * (key.size == "b") - 0.01 * key.steps + offset[key.model] + 0.001 * key.seed

    sweeps = extended_sweep(keys, lambda ks: planted_runs(config, ks, loss), lambda r: r.final_val_loss,
                            lower_is_better=True, limit=0)
    metrics = analyse(config, names, sweeps, [0, 1], Machine.of("cpu", 1, 1))
    report = render_report(metrics)
    assert "at 2 sizes (a, b" in report and "and 2 budgets (1 step, 2 steps)" in report
    assert "four sizes" not in report and "three budgets" not in report  # no count the run does not have
    assert "no trend measured: 4 differences at 2 sizes" not in report  # 2 seeds × 2 sizes: a slope is measured
    # Tokens per parameter: 2 steps × 1 × 8 = 16 tokens over the Transformer's parameters, two significant figures
    small = metrics.point("standard", "a", 2)
    assert small.tokens == 16 and f"| {16 / small.non_embedding:.2g} |" in report
    assert "| 0.0 |" not in report
    # each kind its own parameter column
    for name in names:
        assert f"{metrics.point(name, 'b', 2).non_embedding:,}" in report
    assert "x^(−-" not in report and "(−-" not in report
    # two sizes: no law (three constants), and the report says so rather than a fraction
    assert "Along parameters: no fraction — DIFF, DIFF V2, Transformer: fewer than three distinct x" in report
    assert "0.595 and 0.622" not in report  # no fraction, so none beside the paper's
    # the gap in the table: DIFF − Transformer at b, 2 steps = +0.013 exactly (every seed shifted alike)
    assert metrics.gaps["diff"]["b"][2].delta == pytest.approx(0.013)
    assert "no trend: the difference is +0.013 at every size and seed" in report
    assert "nan" not in report and "1 runs" not in report and "1 steps" not in report
    # the loss column: the held-out loss; the validation loss (0.01 lower) the choice's
    assert metrics.loss_source == "held-out" and "held-out windows the lr choice never saw" in report
    seed_zero = loss(RunKey("diff", 0, 4e-3, None, "a", 2))
    assert metrics.point("diff", "a", 2).loss.mean == pytest.approx(seed_zero + 0.0005)  # seeds 0 and 1
    assert metrics.point("diff", "a", 2).final_val_loss.mean == pytest.approx(seed_zero + 0.0005 - 0.01)
    # the runs eval scaling reads: every seed of every point (3 models, 2 sizes, 2 budgets), its own parameters
    assert len(metrics.runs) == 3 * 2 * 2 * 2
    assert {(r["model"], r["params"]) for r in metrics.runs if r["size"] == "b"} == {
        (n, metrics.point(n, "b", 2).non_embedding) for n in names}


@pytest.mark.slow  # three sizes, two kinds, three seeds at the debug size
def test_the_study_runs_end_to_end_and_eval_scaling_reads_back_its_figures(byte_dataset, tmp_path):  # noqa: F811
    config = debug_experiment(
        byte_dataset, tmp_path / "unused",
        models={"standard": {"attention": "standard", "label": "Transformer"},
                "diff": {"attention": "diff", "label": "DIFF"}},
        data={"heldout_sequences": 4},
        run={"steps": 4, "eval_every": 2},
        compare={"seeds": 3, "evaluations": []},
        scaling={"sizes": {"a": {"d_model": 32, "n_layers": 1, "n_heads": 1},
                           "b": {"d_model": 48, "n_layers": 1, "n_heads": 1},
                           "c": {"d_model": 64, "n_layers": 2, "n_heads": 1}},
                 "budgets": [0.5, 1.0], "budget_sizes": ["b"], "lr_grid": [3e-3], "bootstrap_resamples": 200})
    out = tmp_path / "scaling"
    metrics = compare(config, out, progress=False)
    assert {(p.model, p.size, p.steps) for p in metrics.points} == {
        (m, s, 4) for m in ("standard", "diff") for s in "abc"} | {("standard", "b", 2), ("diff", "b", 2)}
    gap = metrics.gaps["diff"]["b"][4]
    per_seed = [metrics.point(m, "b", 4).loss.per_seed for m in ("diff", "standard")]
    assert gap.delta == pytest.approx(statistics.fmean(per_seed[0]) - statistics.fmean(per_seed[1]))
    summary = json.loads((out / "runs" / "diff" / "b" / "steps-2" / "lr-0.003" / "seed-1" / "summary.json").read_text())
    assert summary["final_heldout_loss"] is not None and metrics.loss_source == "held-out"
    assert [t.model for t in metrics.trends] == ["diff"]
    assert [(axis.x_kind, axis.size) for axis in metrics.laws] == [("params", None), ("tokens", "b")]
    assert "three distinct x" in metrics.laws[1].analysis.problem  # 2 budgets: no law over tokens
    report = (out / "report.md").read_text()
    for text in ("## The gap along size", "**The trend along size**", "## The matching fraction", "## The laws",
                 "Tokens / parameter", "DIFF parameters"):
        assert text in report, text
    for plot in ("scaling_params.png", "scaling_gap.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG", plot
    # eval scaling reads the study's metrics.json and gives the same figures, to the digit
    study = json.loads((out / "metrics.json").read_text())
    assert main(["eval", "scaling", "--results", str(out / "metrics.json"), "--out", str(tmp_path / "eval"),
                 "--resamples", "200"]) == 0  # the study's scaling.bootstrap_resamples
    again = json.loads((tmp_path / "eval" / "scaling.json").read_text())
    ours = study["laws"][0]["analysis"]["matching"]["diff"]
    assert {k: again["matching"]["diff"][k] for k in ("fraction", "interval", "identified", "reason", "estimate")} == {
        k: ours[k] for k in ("fraction", "interval", "identified", "reason", "estimate")}
    resumed = compare(config, out, resume=True, progress=False)  # every run reused
    assert resumed.points[0].loss == metrics.points[0].loss
