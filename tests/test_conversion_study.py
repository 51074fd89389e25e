"""The conversion study (``compare --config convert``): the tokens to recover against hand
interpolations, the verdicts against planted per-seed figures, the shipped configs' models built
on the meta device, what the study checks before it creates anything, and an end-to-end run at
the debug size that --resume then reuses whole."""

import dataclasses
import json
import math
import statistics
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import t as student_t

from diff_transformer.cli import main
from diff_transformer.config import ConfigError
from diff_transformer.convert import converted_config
from diff_transformer.data import prepare
from diff_transformer.evaluation.stats import mean_interval
from diff_transformer.experiments import compare, load_experiment
from diff_transformer.checkpoint import load_checkpoint_tokenizer
from diff_transformer.config import ModelConfig
from diff_transformer.experiments.conversion import (
    CONTINUED, Recovery, _lr_choice, check_given_source, check_source_data, conversion_plan, fine_tuning_axes,
    given_source, given_source_tokenizer, recovery_tokens, validation_windows, versus,
)
from diff_transformer.tokenizer import ByteTokenizer
from diff_transformer.model import LanguageModel
from diff_transformer.train.distributed import Environment
from diff_transformer.train.trainer import DataPlan
from test_convert import llama_directory
from test_train import byte_dataset, debug_experiment  # noqa: F401  (byte_dataset is a fixture)

MODELS = {"standard": {"attention": "standard", "label": "Transformer"}, "diff": {"attention": "diff", "label": "DIFF"}}
CONVERT = {"steps": 4, "warmup_steps": 1, "eval_every": 2, "lr_grid": [1e-3, 3e-3], "retrieval_options": {"windows": 2}}


def convert_experiment(dataset, out, data=None, **convert):
    """The debug models (4 source steps of 8 × 32 tokens), 2 seeds, fine-tuned 4 steps at 2 lrs."""
    return debug_experiment(dataset, out, models=MODELS, run={"steps": 4, "eval_every": 2},
                            compare={"seeds": 2, "evaluations": []}, convert={**CONVERT, **convert}, data=data or {})


# --- the tokens to recover --------------------------------------------------------------------------


def test_the_tokens_to_recover_are_read_linearly_where_the_curve_last_comes_down_through_the_source():
    tokens = [0, 100, 200, 300]
    # Starts above (a split conversion): between 100 (6.4) and 200 (6.1) it crosses 6.2 at 100 + 0.2/0.3·100.
    assert recovery_tokens(tokens, [6.6, 6.4, 6.1, 6.0], 6.2) == pytest.approx(100 + 100 * 2 / 3)
    # Starts at the source's loss, rises with the new warmup, comes back: 100 + (6.3 − 6.2)/(6.3 − 6.1)·100.
    assert recovery_tokens(tokens, [6.2, 6.3, 6.1, 6.05], 6.2) == pytest.approx(150.0)
    # Down, up again, down: the last crossing counts (200 + (6.25 − 6.2)/(6.25 − 6.15)·100).
    assert recovery_tokens(tokens, [6.5, 6.1, 6.25, 6.15], 6.2) == pytest.approx(250.0)
    assert recovery_tokens(tokens, [6.2, 6.1, 6.0, 5.9], 6.2) == 0.0  # never above: nothing to recover
    assert recovery_tokens(tokens, [6.6, 6.4, 6.1, 6.3], 6.2) is None  # ends above: not within the budget
    # An exact conversion starts at its source's loss to float rounding: not above it.
    assert recovery_tokens(tokens, [6.2 + 1e-7, 6.1, 6.0, 5.9], 6.2) == 0.0


def test_the_mean_tokens_to_recover_carry_students_interval_or_say_which_seeds_did_not():
    found = Recovery.of([1000.0, 1400.0, 1300.0], budget=4096)
    mean, sd = 1233.333, statistics.stdev([1000.0, 1400.0, 1300.0])  # 208.17
    half = 4.302653 * sd / math.sqrt(3)  # t(0.975, 2) by the table
    assert found.mean == pytest.approx(mean, abs=1e-3) and (found.low, found.high) == pytest.approx((mean - half,
                                                                                                   mean + half))
    assert mean_interval([2.0, 2.0]) == (2.0, 2.0) and mean_interval([1.0]) is None
    missing = Recovery.of([1000.0, None, 1300.0], budget=4096)
    assert missing.mean is None and missing.recovered == 2 and missing.low is None


# --- the verdicts against the continued Transformer -------------------------------------------------


def welch_by_hand(a, b):
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = student_t.ppf(0.975, df) * math.sqrt(va + vb)
    delta = statistics.fmean(a) - statistics.fmean(b)
    return delta, delta - half, delta + half


@pytest.mark.parametrize("ours, words", [
    ([6.10, 6.12, 6.11], "above the continued Transformer (worse)"),       # a split conversion behind
    ([5.95, 5.97, 5.96], "below the continued Transformer (better)"),
    ([6.00, 6.10, 5.90], "level with the continued Transformer (the interval holds 0)"),
])
def test_a_final_loss_is_above_below_or_level_with_the_continued_transformer_by_welchs_interval(ours, words):
    continued = [6.00, 6.01, 5.99]
    found = versus(ours, continued, "lower")
    assert found.words == words
    delta, low, high = welch_by_hand(ours, continued)
    assert (found.difference.delta, found.difference.low, found.difference.high) == pytest.approx((delta, low, high))
    # A figure where higher is better (MQAR accuracy) turns the words, not the interval.
    assert versus([0.3, 0.31, 0.32], [0.2, 0.21, 0.22], "higher").words == "above the continued Transformer (better)"
    assert versus([6.1], [6.0], "lower").words == "no interval (one seed)"
    assert versus(ours, continued, "lower", against="DIFF, from scratch").words == words.replace(
        "the continued Transformer", "DIFF, from scratch")


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Byte shards whose validation split holds several short documents (windows across them differ
    from windows inside them)."""
    root = tmp_path_factory.mktemp("documents")
    for i, size in enumerate((60, 90, 45, 120, 70, 100, 50, 80)):
        (root / "text").mkdir(exist_ok=True)
        (root / "text" / f"{i}.txt").write_text("".join(chr(ord("a") + (i + j) % 26) for j in range(size)))
    prepare([root / "text"], root / "shards", tokenizer="bytes", val_fraction=0.5, progress=False)
    return root / "shards"


@pytest.mark.parametrize("within_documents", [False, True])
def test_the_windows_scored_before_fine_tuning_are_the_ones_the_trainer_validates_on(short_documents, tmp_path,
                                                                                   within_documents):
    config = convert_experiment(short_documents, tmp_path, data={"within_documents": within_documents})
    finetune = conversion_plan(config).finetune
    trainer = DataPlan(finetune, 32, Environment(0, 1, 0, torch.device("cpu"))).validation_batches()
    inputs, targets = (torch.cat(parts) for parts in zip(*trainer))
    windows = validation_windows(finetune, CONTINUED)
    assert torch.equal(windows[:, :-1], inputs) and torch.equal(windows[:, 1:], targets)


# --- the configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["convert", "convert-gpu"])
def test_the_shipped_configs_build_every_model_of_the_study_on_the_meta_device(name):
    config = load_experiment(name)
    plan = conversion_plan(config)
    source = config.train.model(config.convert.source_model).model_config()
    v2 = ["diff_v2"] if config.convert.diff_v2 else []
    assert [arm.name for arm in plan.arms] == [CONTINUED, *config.convert.inits, *v2]
    for arm in plan.arms:
        built = plan.finetune.model(arm.name).model_config()
        # The fine-tuning entry describes the checkpoint the conversion writes (train --init-from accepts it).
        assert built == (source if arm.to is None else converted_config(source, arm.to, arm.init))
        assert LanguageModel(built, device="meta").num_parameters() > 0
    assert plan.finetune.run.steps == config.convert.steps and plan.finetune.run.data_seed == config.convert.data_seed
    if plan.scratch is not None:
        model = plan.scratch.model(config.convert.scratch_model).model_config()
        assert LanguageModel(model, device="meta").num_parameters() > 0
        assert plan.scratch.run.steps == plan.source_steps + config.convert.steps


def test_the_shipped_study_fine_tunes_on_other_batches_than_the_sources():
    config = load_experiment("convert")
    assert config.convert.data_seed != config.train.run.data_seed and config.compare.seeds == 3
    with pytest.raises(ConfigError, match="convert.data_seed=0 is run.data_seed"):
        load_experiment("convert", ["convert.data_seed=0"])


def test_each_fine_tuned_model_runs_at_its_own_lr_unless_a_grid_is_searched():
    # The shipped pilot's bests (configs/convert.yaml), one run per arm and seed.
    shipped = load_experiment("convert")
    lrs = {name: lr for (name, _), lr in fine_tuning_axes(shipped, conversion_plan(shipped), [0, 1, 2]).lrs.items()}
    assert lrs == {CONTINUED: (5e-4,), "exact": (5e-4,), "split": (2e-3,)}
    # An arm it does not name takes the source's lr (models.standard: 4e-3); a grid runs every arm at each.
    partial_table = load_experiment("convert", ["convert.lr_by_model={split: 1.0e-3}"])
    assert {name: lr for (name, _), lr in fine_tuning_axes(partial_table, conversion_plan(partial_table),
                                                           [0]).lrs.items()} == {
        CONTINUED: (4e-3,), "exact": (4e-3,), "split": (1e-3,)}
    searched = load_experiment("convert", ["convert.lr_grid=[1.0e-3, 3.0e-3]"])
    assert set(fine_tuning_axes(searched, conversion_plan(searched), [0]).lrs.values()) == {(1e-3, 3e-3)}
    # The report says which lrs were given and which searched.
    arm = lambda label, grid, lr: SimpleNamespace(label=label, grid=dict.fromkeys(grid), lr=lr)  # noqa: E731
    assert _lr_choice([arm("A", [1e-3, 3e-3], 1e-3), arm("B", [1e-3, 3e-3], 3e-3)]) == (
        "each at its own best learning rate of those tried")
    assert _lr_choice([arm("A", [5e-4], 5e-4), arm("B", [2e-3], 2e-3)]) == (
        "each at its own learning rate: one given, not searched here (A at 0.0005; B at 0.002; from "
        "convert.lr_by_model, a pilot's best, else the source's)")
    assert _lr_choice([arm("A", [5e-4], 5e-4), arm("B", [1e-3, 3e-3], 3e-3)]).endswith(
        "(A at 0.0005; from convert.lr_by_model, a pilot's best, else the source's); the others at their best of "
        "those tried")


@pytest.mark.parametrize("override, message", [
    ("convert.inits=[exact, twice]", "convert.inits: no init 'twice'"),
    ("convert.source_model=diff", "models.diff --to diff --init exact: .*attention='diff'"),
    ("convert.scratch_model=nothing", "convert.scratch_model: no model named 'nothing'"),
    ("convert.retrieval=needle", "convert.retrieval must be one of ar-hit, mqar"),
    ("convert.retrieval_options={window: 3}", "convert.retrieval_options: ar-hit has no option 'window'"),
    ("convert.source=somewhere", "convert.scratch_model: .*set convert.source_tokens"),
    ("scaling={sizes: {a: {d_model: 64}, b: {d_model: 96}}}", "scaling and convert: a config runs one study"),
    ("convert.lr_by_model={splits: 1.0e-3}", "convert.lr_by_model: no fine-tuned model 'splits'; choose from "
                                              "continued, exact, split, diff_v2"),
    ("convert.lr_by_model={exact: 0}", "convert.lr_by_model.exact must be a positive learning rate, got 0"),
])
def test_a_bad_convert_section_is_an_error_naming_it(override, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment("convert", [override])


def test_a_given_source_that_is_not_the_configured_model_is_refused_before_anything_is_created(tmp_path):
    source = LanguageModel(load_experiment("convert").train.model("diff").model_config())  # a DIFF, not the source
    source.save_pretrained(tmp_path / "diff-checkpoint")
    config = load_experiment("convert", [f"convert.source={tmp_path / 'diff-checkpoint'}",
                                         "convert.scratch_model=null"])
    with pytest.raises(ConfigError, match=r"convert.source: .*diff-checkpoint: holds a model with attention='diff'; "
                                          r"convert reads Transformers \(attention='standard'\)"):
        compare(config, tmp_path / "out", progress=False)  # said so, not "set the model's fields to the source's"
    assert not (tmp_path / "out").exists()


def test_a_source_without_a_tokenizer_is_refused_before_any_run_unless_one_is_named(byte_dataset, tmp_path,  # noqa: F811
                                                                                   capsys):
    """The issue's case: an imported source without a tokenizer trained the whole grid, then failed with
    advice to pass --tokenizer, which compare does not have. Refused first, naming the config field; with
    it, the source is saved into OUT/source/imported with that tokenizer, which every later step reads."""
    source = tmp_path / "no-tokenizer"
    LanguageModel(ModelConfig.from_dict({k: v for k, v in LLAMA_SHAPE.items() if k != "label"})).save_pretrained(source)
    def experiment(tokenizer=None):
        config = llama_experiment(byte_dataset, tmp_path / "unused", source)
        return dataclasses.replace(config, convert=dataclasses.replace(config.convert, source_tokenizer=tokenizer))

    config = experiment()
    with pytest.raises(ConfigError, match="holds no tokenizer.*set convert.source_tokenizer to it.*"
                                          "--set convert.source_tokenizer=path/to/tokenizer.json"):
        compare(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    named = experiment("bytes")
    check_given_source(named)
    with pytest.raises(ConfigError, match="reads another tokenizer than data.dataset"):  # the dataset's: bytes
        check_source_data(experiment("default"))
    check_source_data(named)
    imported = given_source(str(source), tmp_path / "imported", tokenizer=given_source_tokenizer(named), resume=False,
                            progress=False)
    assert imported == tmp_path / "imported" and isinstance(load_checkpoint_tokenizer(imported), ByteTokenizer)
    assert torch.equal(LanguageModel.from_pretrained(imported).embed.weight,
                       LanguageModel.from_pretrained(source).embed.weight)


@pytest.mark.parametrize("argv, expected", [
    (["--lr-grid", "1e-3,2e-3"], "takes neither --lr-grid, --retrieval-lr-grid nor --recipes: set convert.lr_grid"),
    (["--attention", "standard"], "takes no --attention: its models are convert.source_model"),
    (["--set", "convert.source={missing}"], "convert.source: {missing}: neither a checkpoint of this project nor a "
                                            "transformers model directory"),
])
def test_the_command_refuses_what_the_study_does_not_take_in_one_line_before_anything(argv, expected, tmp_path, capsys):
    missing = tmp_path / "missing"
    argv = [a.format(missing=missing) for a in argv] + (["--set", "convert.scratch_model=null"] if "--set" in argv
                                                         else [])
    assert main(["compare", "--config", "convert", "--out", str(tmp_path / "out"), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected.format(missing=missing) in lines[0]
    assert not (tmp_path / "out").exists()


LLAMA_SHAPE = {"attention": "standard", "vocab_size": 300, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
               "ffn_hidden": 160, "max_seq_len": 128, "norm_eps": 1e-6, "label": "Llama"}


def llama_experiment(dataset, out, llama, **fields):
    """The study from a transformers Llama directory (test_convert's: 2 layers, 4 heads over 2 key/value
    heads), one seed, its two DIFF conversions, no from-scratch reference."""
    return debug_experiment(dataset, out, models={"standard": {**LLAMA_SHAPE, **fields}},
                            model={"preset": None}, run={"steps": 1, "eval_every": 2},
                            compare={"seeds": 1, "evaluations": []},
                            convert={**CONVERT, "lr_grid": [3e-3], "source": str(llama), "scratch_model": None,
                                     "diff_v2": False})


@pytest.mark.slow  # transformers builds and saves a Llama
def test_a_transformers_llama_source_is_checked_against_its_model_entry_and_imported_once(byte_dataset, tmp_path,  # noqa: F811
                                                                                        capsys):
    llama_directory(tmp_path / "llama", 2, tokenizer=True)
    check_given_source(llama_experiment(byte_dataset, tmp_path, tmp_path / "llama"))  # its shape: accepted
    with pytest.raises(ConfigError, match=r"convert.source: .*llama holds another model than models.standard "
                                          r"describes \(n_kv_heads: 2 in the source, 4 in models.standard\)"):
        check_given_source(llama_experiment(byte_dataset, tmp_path, tmp_path / "llama", n_kv_heads=4))
    imported = given_source(str(tmp_path / "llama"), tmp_path / "imported", resume=False, progress=False)
    assert imported == tmp_path / "imported" and LanguageModel.from_pretrained(imported).config.n_kv_heads == 2
    marker = (imported / "config.json").stat().st_mtime_ns
    assert given_source(str(tmp_path / "llama"), tmp_path / "imported", resume=True, progress=False) == imported
    assert (imported / "config.json").stat().st_mtime_ns == marker  # reused, not imported again
    checkpoint = tmp_path / "checkpoint"
    LanguageModel.from_pretrained(imported).save_pretrained(checkpoint)  # one of this project's: used as it is
    assert given_source(str(checkpoint), tmp_path / "unused", resume=False, progress=False) == checkpoint


# --- end to end -------------------------------------------------------------------------------------


@pytest.mark.slow  # 2 sources, 2 conversions, 3 fine-tuned models at 2 lrs, a reference: 2 seeds at the debug size
def test_the_study_converts_fine_tunes_and_reports_and_resume_reuses_every_run(byte_dataset, tmp_path, capsys):  # noqa: F811
    config = convert_experiment(byte_dataset, tmp_path / "unused", diff_v2=False)  # DIFF V2: as exact, one more
    out = tmp_path / "study"
    metrics = compare(config, out, progress=False)  # compare dispatches on the convert section

    assert [arm.name for arm in metrics.arms] == [CONTINUED, "exact", "split"]
    windows = validation_windows(conversion_plan(config).finetune, CONTINUED)
    assert windows.shape == (8, 33)
    for seed, loss in zip((0, 1), metrics.source.loss.per_seed):
        # The source's loss on the fine-tuning's windows, scored by the study, is its run's final validation
        # loss (the trainer's code path, the same windows).
        source_run = json.loads((out / "source" / "runs" / "standard" / "lr-0.003" / f"seed-{seed}" / "summary.json")
                                .read_text())
        assert loss == pytest.approx(source_run["final_val_loss"], rel=1e-5)
    continued, exact, split = metrics.arms
    assert exact.start.per_seed == pytest.approx(metrics.source.loss.per_seed, abs=1e-5)  # an exact start
    assert split.start.mean != pytest.approx(metrics.source.loss.mean, abs=1e-3)
    for arm in metrics.arms:
        assert set(arm.grid) == {1e-3, 3e-3} and arm.lr == min(arm.grid, key=lambda lr: arm.grid[lr].mean)
        assert arm.curve.tokens == [0, 2 * 8 * 32, 4 * 8 * 32]
        for seed in (0, 1):
            run_dir = out / "finetune" / "runs" / arm.name / f"lr-{arm.lr:g}" / f"seed-{seed}"
            summary = json.loads((run_dir / "summary.json").read_text())
            start = (out / "source" / "runs" / "standard" / "lr-0.003" / f"seed-{seed}" / "checkpoint"
                     if arm.name == CONTINUED else out / "converted" / arm.name / f"seed-{seed}")
            assert summary["init_from"] == str(start) and summary["tokens"] == 4 * 8 * 32
            assert arm.final.per_seed[seed] == summary["final_val_loss"] == arm.curve.values[seed][-1]
            # The recovery figure is the curve's, read as the test reads it.
            assert arm.recovery.per_seed[seed] == recovery_tokens(arm.curve.tokens, arm.curve.values[seed],
                                                                  metrics.source.loss.per_seed[seed])
        assert arm.retrieval_before is not None and arm.retrieval_after is not None
    assert continued.final_versus is None and exact.final_versus.difference.delta == pytest.approx(
        exact.final.mean - continued.final.mean)
    assert exact.lambdas is not None and continued.lambdas is None
    reference = metrics.scratch
    assert reference.tokens == (4 + 4) * 8 * 32 and reference.final_versus.difference.delta == pytest.approx(
        reference.final.mean - continued.final.mean)
    assert reference.conversions["split"].difference.delta == pytest.approx(split.final.mean - reference.final.mean)
    # The retrieval figure of each checkpoint is the suite's, in OUT/retrieval.
    saved = json.loads((out / "retrieval" / "ar-hit.json").read_text())["models"]
    assert continued.retrieval_before.per_seed[0] == saved["source s0"]["ar_hit"]
    assert split.retrieval_after.per_seed[1] == saved["split s1 after"]["ar_hit"]
    report = (out / "report.md").read_text()
    for text in ("## What converting costs and gains", "Tokens to recover", "## Along fine-tuning",
                 "## Retrieval before and after", "## The conversions", "## Learning rates", "from scratch"):
        assert text in report, text
    assert (out / "conversion_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "metrics.json").read_text())["arms"][2]["name"] == "split"

    capsys.readouterr()
    again = compare(config, out, resume=True)  # every run and conversion reused, nothing trained again
    err = capsys.readouterr().err
    assert "training ->" not in err and "resuming" not in err and err.count("already done, reusing") == 2 + 4 + 12 + 2
    assert [a.final.per_seed for a in again.arms] == [a.final.per_seed for a in metrics.arms]
    assert again.arms[2].recovery == split.recovery


@pytest.mark.slow  # a transformers Llama imported, converted twice, three models fine-tuned: one seed
def test_the_study_runs_from_a_transformers_llama(byte_dataset, tmp_path):  # noqa: F811
    llama_directory(tmp_path / "llama", 2, tokenizer=True)
    config = llama_experiment(byte_dataset, tmp_path / "unused", tmp_path / "llama")
    out = tmp_path / "study"
    metrics = compare(config, out, progress=False)
    imported = out / "source" / "imported"
    assert metrics.source.given == str(tmp_path / "llama")
    assert metrics.source.parameters == LanguageModel.from_pretrained(imported).num_parameters()
    continued, exact, split = metrics.arms
    assert exact.start.per_seed == pytest.approx(metrics.source.loss.per_seed, abs=1e-5)
    summary = json.loads((out / "finetune" / "runs" / CONTINUED / "lr-0.003" / "seed-0" / "summary.json").read_text())
    assert summary["init_from"] == str(imported)
    assert exact.final_versus.words == "no interval (one seed)" and metrics.scratch is None
    assert "## What converting costs and gains" in (out / "report.md").read_text()
