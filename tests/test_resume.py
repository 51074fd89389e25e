"""A resumed run is the run that was started, and a refused ``train`` leaves the file system as
it was: every setting that changes the numbers is compared with the checkpoint's (state.RESUME_RULES
classifies every config field), a run is lengthened only on purpose (``--set run.steps=N``), a
finished run's ``--resume`` writes nothing, and every refusal comes before any file or directory
is created (train.trainer.check_training). Debug-size model on byte-level text, a step or two each."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import typing
from pathlib import Path

import pytest
import yaml

from diff_transformer.cli import main
from diff_transformer.config import ModelConfig
from diff_transformer.data import prepare
from diff_transformer.model import LanguageModel
from diff_transformer.train import TrainingError, train
from diff_transformer.train import config as config_module
from diff_transformer.train import trainer as trainer_module
from diff_transformer.train.state import FREE, KEPT, LENGTHEN, RESUME_RULES, SAME, TRAIN_CONFIG_FILE
from diff_transformer.train.trainer import check_training, read_metrics
from test_train import byte_dataset, debug_config, losses  # noqa: F401  (byte_dataset is a fixture)

YAML_STEPS = 6  # run.steps of every config file below; runs are made shorter with --set run.steps=N


def write_config(dataset: Path, out_dir: Path, path: Path, **sections) -> Path:
    """A YAML config of the debug model (run.steps 6, TensorBoard on, evaluation every 2 steps)."""
    run = {"steps": YAML_STEPS, "eval_every": 2, "tensorboard": True, **sections.pop("run", {})}
    path.write_text(yaml.safe_dump(debug_config(dataset, out_dir, run=run, **sections).to_dict()))
    return path


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` (hidden ones too), files with their SHA-256."""
    return {str(q.relative_to(root)): hashlib.sha256(q.read_bytes()).hexdigest() if q.is_file() else "dir"
            for q in sorted(root.rglob("*"))}


def run_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """``diff-transformer ARGV`` in this process: (exit status, stderr lines)."""
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def refused(capsys, *argv: str) -> str:
    """The one error line of a refused ``diff-transformer ARGV`` (exit status 2)."""
    code, err = run_cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


@pytest.fixture(scope="module")
def finished(byte_dataset, tmp_path_factory) -> dict:  # noqa: F811
    """A run of 4 steps (--set run.steps=4 over the file's 6), finished; copy it before changing it."""
    root = tmp_path_factory.mktemp("finished")
    config = write_config(byte_dataset, root / "run", root / "config.yaml")
    assert main(["train", "--config", str(config), "--set", "run.steps=4"]) == 0
    return {"root": root, "config": config, "out": root / "run"}


@pytest.fixture
def finished_copy(finished, byte_dataset, tmp_path) -> dict:  # noqa: F811
    """The finished run copied into tmp_path, with a config file naming the copy."""
    out = tmp_path / "run"
    shutil.copytree(finished["out"], out)
    return {"config": write_config(byte_dataset, out, tmp_path / "config.yaml"), "out": out}


@pytest.fixture(scope="module")
def paused(byte_dataset, tmp_path_factory) -> dict:  # noqa: F811
    """A run paused after its first step (run.stop_at_step=1 on the command line), never changed."""
    root = tmp_path_factory.mktemp("paused")
    config = write_config(byte_dataset, root / "run", root / "config.yaml")
    assert main(["train", "--config", str(config), "--set", "run.stop_at_step=1"]) == 0
    return {"root": root, "config": config, "out": root / "run"}


# --- the classification ------------------------------------------------------------------------


def _unclassified(cls: type, rules: dict[str, str], where: str) -> list[str]:
    """The fields of dataclass ``cls`` that ``rules`` leaves out, the rules naming no field, and
    the rules that are not rules."""
    names = {f.name for f in dataclasses.fields(cls)}
    problems = [f"{where}{name}: not classified" for name in sorted(names - set(rules))]
    problems += [f"{where}{name}: no such field" for name in sorted(set(rules) - names)]
    return problems + [f"{where}{name}: rule {rule!r}" for name, rule in rules.items()
                       if isinstance(rule, str) and rule not in (SAME, FREE, LENGTHEN, KEPT)]


def test_every_field_of_every_config_dataclass_is_classified_for_resume():
    """A field added to a config dataclass later fails here until RESUME_RULES says whether a resumed
    run may change it; the model's own fields (ModelConfig) are all compared with config.json."""
    problems = _unclassified(config_module.TrainConfig, RESUME_RULES, "")
    for name, hint in typing.get_type_hints(config_module.TrainConfig).items():
        rules = RESUME_RULES.get(name)
        if isinstance(rules, dict):  # field by field: the section's dataclass (models: dict[str, ModelEntry])
            section = typing.get_args(hint)[1] if typing.get_origin(hint) is dict else hint
            problems += _unclassified(section, rules, f"{name}.")
    assert problems == []
    assert set(ModelConfig().to_dict()) == {f.name for f in dataclasses.fields(ModelConfig)}  # compared whole


# --- refused by name, nothing written ----------------------------------------------------------

# Each SAME setting: a value other than the run's, and how the refusal names the change
# (data.dataset: a copy of the dataset elsewhere, the same tokens under another name).
CHANGES = {
    "data.dataset": ("{copy}", "data.dataset: '{dataset}' -> '{copy}'"),
    "data.seq_len": ("16", "data.seq_len: 32 -> 16"),
    "data.batch_size": ("4", "data.batch_size: 8 -> 4"),
    "data.mix": ("{mqar: 0.1}", "data.mix: {} -> {'mqar': 0.1}"),  # (needle's examples need 128 tokens)
    "data.eval_sequences": ("4", "data.eval_sequences: 8 -> 4"),
    "data.within_documents": ("true", "data.within_documents: False -> True"),
    "data.long_document_tokens": ("64", "data.long_document_tokens: None -> 64"),
    "data.long_document_weight": ("2.0", "data.long_document_weight: 1.0 -> 2.0"),
    "data.packing": ("documents", "data.packing: 'none' -> 'documents'"),
    "optim.lr": ("0.01", "optim.lr: 0.003 -> 0.01"),
    "optim.min_lr": ("0.0001", "optim.min_lr: 0.0003 -> 0.0001"),
    "optim.warmup_steps": ("3", "optim.warmup_steps: 2 -> 3"),
    "optim.betas": ("[0.8, 0.9]", "optim.betas: (0.9, 0.95) -> (0.8, 0.9)"),
    "optim.weight_decay": ("0.0", "optim.weight_decay: 0.1 -> 0.0"),
    "optim.eps": ("1.0e-06", "optim.eps: 1e-08 -> 1e-06"),
    "optim.grad_clip": ("0.5", "optim.grad_clip: 1.0 -> 0.5"),
    "run.seed": ("1", "run.seed: 0 -> 1"),
    "run.data_seed": ("1", "run.data_seed: 0 -> 1"),
    "run.precision": ("bf16", "run.precision: 'fp32' -> 'bf16'"),  # the checkpoint's "auto", as it ran on the CPU
}


def test_every_setting_that_changes_the_numbers_has_a_refusal_case():
    same = {f"{section}.{name}" for section in ("data", "optim", "run")
            for name, rule in RESUME_RULES[section].items() if rule == SAME}
    assert same == set(CHANGES)


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_resuming_with_a_setting_that_changes_the_numbers_is_refused_by_name(key, paused, byte_dataset,  # noqa: F811
                                                                            capsys):
    copy = paused["root"] / "dataset-copy"
    if not copy.exists():
        shutil.copytree(byte_dataset, copy)
    value, named = (text.replace("{copy}", str(copy)).replace("{dataset}", str(byte_dataset)) for text in CHANGES[key])
    overrides = ["--set", f"{key}={value}"]
    if key == "data.long_document_weight":  # needs data.long_document_tokens (a second difference)
        overrides += ["--set", "data.long_document_tokens=64"]
    before = snapshot(paused["out"])
    line = refused(capsys, "train", "--config", str(paused["config"]), "--resume", *overrides)
    assert line.startswith(f"error: {paused['out'] / 'checkpoint'}: cannot resume with a different "), line
    assert named in line, line
    assert snapshot(paused["out"]) == before


@pytest.mark.parametrize("override, named", [
    ("model.n_layers=3", "model.n_layers: 2 -> 3"),
    ("models.diff.lambda_init=0.5", "model.lambda_init: None -> 0.5"),
    ("models.diff.optim.lr=0.01", "optim.lr: 0.003 -> 0.01"),  # a model's own optim field: the lr it trains with
    ("models.diff.ffn_activation=polynorm", "model.ffn_activation: 'silu' -> 'polynorm'"),  # the Motif fields
    ("models.diff.lambda_init_depth_offset=-1", "model.lambda_init_depth_offset: 0 -> -1"),
    ("models.diff.rope_scaling={kind: linear, factor: 2.0}",
     "model.rope_scaling: None -> {'kind': 'linear', 'factor': 2.0, 'low_freq_factor': None"),
], ids=["model", "model-field", "model-optim", "ffn-activation", "lambda-offset", "rope-scaling"])
def test_the_model_and_its_own_optimizer_fields_are_compared_too(override, named, paused, capsys):
    line = refused(capsys, "train", "--config", str(paused["config"]), "--resume", "--set", override)
    assert named in line, line


def test_free_settings_may_differ(paused):
    """Settings that only observe, or say where and how: the checks pass (the run would go on)."""
    config = config_module.load_config(str(paused["config"]), [
        "run.eval_every=1", "run.log_every=3", "run.diagnostics=false", "run.checkpoint_every=1",
        "run.tensorboard=false", "run.progress=false", "run.attn_backend=reference", "run.compile=true",
        "data.micro_batch_size=2", "data.heldout_sequences=2", "optim.recipe=paper-3b", "models.diff.label=D",
        "description=another",
    ])
    plan = check_training(config, "diff", resume=True)
    assert plan.resume.step == 1 and plan.resume.steps == YAML_STEPS and not plan.resume.finished


# --- run.steps ---------------------------------------------------------------------------------


def test_a_finished_run_resumed_says_so_and_writes_nothing(finished_copy, capsys):
    """summary.json, metrics.jsonl, TensorBoard and the checkpoint byte for byte as they were."""
    out, config = finished_copy["out"], finished_copy["config"]
    assert any((out / "tensorboard").iterdir())
    before = snapshot(out)
    code, err = run_cli(capsys, "train", "--config", str(config), "--resume", "--set", "run.steps=4")
    assert code == 0 and len(err) == 1, err
    assert err[0].startswith(f"{out / 'checkpoint'}: the run is finished (step 4 of run.steps=4); nothing done, "
                             "nothing written")
    assert snapshot(out) == before
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0 and summary["train_seconds"] > 0  # the run's own, never rewritten
    result = train(config_module.load_config(str(config), ["run.steps=4"]), resume=True)  # from Python
    assert result.status == "finished" and result.steps == 4 and result.tokens_per_s == summary["tokens_per_s"]
    assert snapshot(out) == before


def test_a_finished_run_does_not_become_longer_without_asking(finished_copy, capsys):
    """Without the --set run.steps=4 it was started with, the file's 6 steps are a difference."""
    before = snapshot(finished_copy["out"])
    line = refused(capsys, "train", "--config", str(finished_copy["config"]), "--resume")
    assert ("cannot resume with a different run.steps: 4 -> 6 (to lengthen the run on purpose, --set run.steps=6)"
            in line)
    assert snapshot(finished_copy["out"]) == before


def test_a_run_is_not_shortened_nor_ended_before_its_checkpoint(finished, paused, capsys):
    line = refused(capsys, "train", "--config", str(finished["config"]), "--resume", "--set", "run.steps=3")
    assert "run.steps: 4 -> 3, before the checkpoint's step 4" in line
    line = refused(capsys, "train", "--config", str(paused["config"]), "--resume", "--set", "run.steps=4")
    assert "run.steps: 6 -> 4 (a run is not shortened: its schedule decays over 6 steps)" in line


def test_a_stop_at_step_already_reached_is_refused(paused, capsys):
    line = refused(capsys, "train", "--config", str(paused["config"]), "--resume", "--set", "run.stop_at_step=1")
    assert f"run.stop_at_step=1: the checkpoint {paused['out'] / 'checkpoint'} is already at step 1" in line


def test_lengthening_on_purpose_recomputes_the_schedule_and_says_so(finished_copy, capsys):
    """4 steps lengthened to 5 (warmup 2, lr 3e-3, min_lr 3e-4): the 4-step schedule had reached its
    floor, the 5-step one decays from 3e-3 at step index 2 to 3e-4 at index 5, so step 5 (index 4)
    runs two thirds of the way down; the note gives both rates."""
    out = finished_copy["out"]
    code, err = run_cli(capsys, "train", "--config", str(finished_copy["config"]), "--resume", "--set", "run.steps=5")
    assert code == 0, err
    assert err[1] == ("note: lengthening the run from run.steps=4 to 5: the learning-rate schedule is recomputed for "
                      "5 steps (the decay to optim.min_lr now ends at step 5); the 4 steps taken followed the 4-step "
                      "schedule, so the run is not one started with run.steps=5: its lr goes from 0.0003 (the 4-step "
                      "schedule) to 0.0012 at step 5")
    lrs = {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(lrs) == [1, 2, 3, 4, 5] and lrs[5] == pytest.approx(3e-3 - (3e-3 - 3e-4) * 2 / 3)
    saved = yaml.safe_load((out / "checkpoint" / TRAIN_CONFIG_FILE).read_text())
    assert saved["run"]["steps"] == 5  # a later --resume needs no --set


@pytest.mark.slow  # three short runs
def test_a_run_lengthened_under_a_constant_schedule_is_the_longer_run(byte_dataset, tmp_path, capsys):  # noqa: F811
    """With min_lr = lr (constant after warmup) the steps taken had the longer run's rates: the
    note says so, and the lengthened run's losses are those of a run started at 4 steps, bitwise."""
    constant = {"optim": {"min_lr": 3e-3}}
    straight = write_config(byte_dataset, tmp_path / "straight", tmp_path / "straight.yaml", **constant)
    assert main(["train", "--config", str(straight), "--set", "run.steps=4"]) == 0
    split = write_config(byte_dataset, tmp_path / "split", tmp_path / "split.yaml", **constant)
    assert main(["train", "--config", str(split), "--set", "run.steps=2"]) == 0
    capsys.readouterr()
    code, err = run_cli(capsys, "train", "--config", str(split), "--resume", "--set", "run.steps=4")
    assert code == 0 and err[1].endswith("the 2 steps taken had the same rates under both lengths, so the run goes "
                                         "on as one started with run.steps=4"), err
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and all(a[s] == b[s] for s in a), (a, b)


# --- what a resumed run reports ----------------------------------------------------------------


def test_a_resumed_run_reports_the_runs_tokens_and_throughput(byte_dataset, tmp_path):  # noqa: F811
    """4 steps in two invocations of 2: each invocation's first step warms up untimed, so 2 steps of
    8 x 32 tokens are timed over the run; the summary's rate is theirs, its tokens the run's."""
    train(debug_config(byte_dataset, tmp_path, run={"steps": 4, "stop_at_step": 2}))
    result = train(debug_config(byte_dataset, tmp_path, run={"steps": 4}), resume=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(dataclasses.asdict(result)))
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 8 * 32 and summary["resumed_from"] == 2
    assert summary["tokens_per_s"] * summary["train_seconds"] == pytest.approx(2 * 8 * 32)
    assert 0 < summary["train_seconds"] < summary["wall_seconds"]


def test_a_signal_during_the_last_step_still_completes_the_run(byte_dataset, tmp_path, monkeypatch):  # noqa: F811
    """The run has done its steps when it sees the signal: completed, not "interrupted" (which a
    --resume could not continue)."""
    real = trainer_module._Run.gradients

    def signalled(run, stop_requested):
        loss, norm, votes = real(run, stop_requested)
        return loss, norm, 1 if run.progress.step == 1 else votes  # the second and last step

    monkeypatch.setattr(trainer_module._Run, "gradients", signalled)
    result = train(debug_config(byte_dataset, tmp_path, run={"steps": 2}))
    assert result.status == "completed" and result.steps == 2 and result.message == ""


def test_the_checkpoint_records_the_precision_autocast_ran_in(finished):
    saved = yaml.safe_load((finished["out"] / "checkpoint" / TRAIN_CONFIG_FILE).read_text())
    assert saved["run"]["precision"] == "fp32"  # "auto" on the CPU


@pytest.mark.slow  # three runs
def test_settings_that_only_observe_leave_the_run_bitwise_and_a_resumed_run_keeps_its_init_from(
        byte_dataset, tmp_path, capsys):  # noqa: F811
    """Paused at 2 with evaluation at every step and the diagnostics on, resumed to 4 with neither
    and a checkpoint at every step: the losses of a straight run, bit for bit. The run was started
    from another's weights (--init-from), and resuming without the flag keeps that."""
    source = debug_config(byte_dataset, tmp_path / "source", run={"steps": 1})
    assert train(source).status == "completed"
    first = tmp_path / "source" / "checkpoint"
    straight = write_config(byte_dataset, tmp_path / "straight", tmp_path / "straight.yaml",
                            run={"eval_every": 100, "diagnostics": False})
    assert main(["train", "--config", str(straight), "--set", "run.steps=4", "--init-from", str(first)]) == 0
    split = write_config(byte_dataset, tmp_path / "split", tmp_path / "split.yaml",
                         run={"eval_every": 1, "diagnostics": True})
    assert main(["train", "--config", str(split), "--set", "run.steps=4", "--set", "run.stop_at_step=2",
                 "--init-from", str(first)]) == 0
    assert main(["train", "--config", str(split), "--resume", "--set", "run.steps=4", "--set", "run.eval_every=100",
                 "--set", "run.diagnostics=false", "--set", "run.checkpoint_every=1", "--set", "run.log_every=1"]) == 0
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and all(a[s] == b[s] for s in a), (a, b)
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["init_from"] == str(first) and summary["resumed_from"] == 2
    saved = yaml.safe_load((tmp_path / "split" / "checkpoint" / TRAIN_CONFIG_FILE).read_text())
    assert saved["run"]["init_from"] == str(first)


# --- validate before creating ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_validation(tmp_path_factory) -> Path:
    """A byte dataset whose validation split is one 5-token document: no window of 32 + 1 tokens."""
    root = tmp_path_factory.mktemp("tiny-val")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"word {i} " * 200}) + "\n" for i in range(40))
                    + json.dumps({"text": "tiny"}) + "\n")
    meta = prepare([docs], root / "data", tokenizer="bytes", val_fraction=0.01, progress=False)
    assert meta["val"]["tokens"] == 5
    return root / "data"


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A save_pretrained checkpoint of the debug model (not a training checkpoint)."""
    directory = tmp_path_factory.mktemp("pretrained") / "model"
    LanguageModel(ModelConfig.from_preset("debug")).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def damaged_model(saved_model, tmp_path_factory) -> Path:
    """A copy of ``saved_model`` whose weights file lost its second half."""
    directory = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(saved_model, directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return directory


CREATE_NOTHING = [  # (case, --set overrides or extra arguments with {placeholders}, text of the error line)
    ("nothing-to-resume", ["--resume"], "--resume: no training checkpoint at {out}/checkpoint"),
    ("checkpoint-dir-is-a-model", ["--set", "run.checkpoint_dir={model}"],
     "{model}: already holds a diff-transformer checkpoint"),
    ("validation-split-too-small", ["--set", "data.dataset={tiny}"],
     "data.dataset: the val split of {tiny} has 5 tokens"),
    ("triton-on-cpu", ["--set", "run.attn_backend=triton"], "run.attn_backend=triton needs a CUDA GPU, and this run is "
                                                           "on the cpu"),
    ("decode-backend", ["--set", "run.attn_backend=decode"], "run.attn_backend=decode takes one query per sequence"),
    ("inside-the-dataset", ["--set", "run.out_dir={dataset}/run"], "run.out_dir: {dataset}/run lies inside {dataset}, "
                                                                 "which this run reads"),
    ("checkpoint-inside-the-dataset", ["--set", "run.checkpoint_dir={dataset}/ckpt"],
     "run.checkpoint_dir: {dataset}/ckpt lies inside {dataset}"),
    ("inside-init-from", ["--init-from", "{model}", "--set", "run.out_dir={model}/run"],
     "run.out_dir: {model}/run lies inside {model}"),
    ("init-from-damaged", ["--init-from", "{damaged}"],
     "run.init_from: {damaged}/model.safetensors: truncated or corrupted safetensors file"),
]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CREATE_NOTHING], ids=[c[0] for c in CREATE_NOTHING])
def test_a_refused_train_creates_nothing(argv, expected, byte_dataset, tiny_validation,  # noqa: F811
                                         saved_model, damaged_model, tmp_path, monkeypatch, capsys):
    from diff_transformer.ops import triton_diff

    monkeypatch.setattr(triton_diff, "INTERPRET", False)  # as outside the tests: no Triton interpreter on CPU
    out = tmp_path / "run"
    config = write_config(byte_dataset, out, tmp_path / "config.yaml")
    places = {"out": out, "model": saved_model, "tiny": tiny_validation, "dataset": byte_dataset,
              "damaged": damaged_model}
    watched = [tmp_path, byte_dataset, saved_model.parent]
    before = [snapshot(root) for root in watched]
    line = refused(capsys, "train", "--config", str(config), *[a.format(**places) for a in argv])
    assert line.startswith(f"error: {expected.format(**places)}"), line
    assert [snapshot(root) for root in watched] == before and not out.exists()


def test_a_cache_that_cannot_be_written_creates_no_run(byte_dataset, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The default corpus cannot be prepared (a read-only cache): refused before run.out_dir exists."""
    from diff_transformer.data import corpus as corpus_module

    def read_only(documents, directory, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(corpus_module, "write_shards", read_only)
    config = write_config(byte_dataset, tmp_path / "run", tmp_path / "config.yaml")
    line = refused(capsys, "train", "--config", str(config), "--set", "data.dataset=default",
                   "--set", f"data.cache_dir={tmp_path / 'cache'}")
    assert "Read-only file system" in line and not (tmp_path / "run").exists()


def test_check_training_is_the_check_train_makes(byte_dataset, tmp_path):  # noqa: F811
    """The public preflight refuses what train refuses, writes nothing, and describes the run."""
    config = debug_config(byte_dataset, tmp_path / "run", data={"batch_size": 6})
    with pytest.raises(ValueError, match="data.batch_size=6 must be divisible by the 4 processes"):
        check_training(config, processes=4)
    with pytest.raises(TrainingError, match="no training checkpoint"):
        check_training(config, resume=True)
    plan = check_training(config, processes=2)
    assert plan.resume is None and plan.out_dir == tmp_path / "run"
    assert plan.checkpoint_dir == tmp_path / "run" / "checkpoint"
    assert plan.data.per_process == 3 and list(tmp_path.iterdir()) == []


def test_resuming_on_a_dataset_prepared_again_with_another_tokenizer_is_refused(tmp_path, capsys):
    """The run's dataset path, prepared anew with a BPE of 300 tokens (within the model's 512): the
    checkpoint's weights read bytes, so the run cannot go on there."""
    from diff_transformer.data.bpe import train_bpe

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; 1234 " * 400)
    data = tmp_path / "data"
    prepare([text], data, tokenizer="bytes", progress=False)
    config = write_config(data, tmp_path / "run", tmp_path / "config.yaml", data={"eval_sequences": 2})
    assert main(["train", "--config", str(config), "--set", "run.stop_at_step=1"]) == 0
    train_bpe([text.read_text()], vocab_size=300, show_progress=False).save(str(tmp_path / "bpe.json"))
    prepare([text], data, tokenizer=tmp_path / "bpe.json", overwrite=True, progress=False)
    capsys.readouterr()
    before = snapshot(tmp_path / "run")
    line = refused(capsys, "train", "--config", str(config), "--resume")
    assert line.startswith(f"error: --resume: {tmp_path / 'run' / 'checkpoint'} was trained with another tokenizer "
                           "than the dataset's"), line
    assert snapshot(tmp_path / "run") == before


def test_train_help_states_the_resume_rules(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for rule in ("refused by name", "--set run.steps=N larger than the run's lengthens it",
                 "the learning-rate schedule is recomputed for N steps", "A finished run's --resume says so, exits 0 "
                 "and writes nothing", "--resume found the run finished"):
        assert rule in text, rule


@pytest.mark.slow  # a torchrun launch of 2 processes
def test_every_process_refuses_before_anything_is_created(byte_dataset, tmp_path):  # noqa: F811
    """Under torchrun, rank 0 finds nothing to resume: both ranks stop with the same one line (none
    waits for the other in a collective), and run.out_dir is not created."""
    import subprocess
    import sys

    from test_distributed import free_port

    config = write_config(byte_dataset, tmp_path / "run", tmp_path / "config.yaml")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "diff_transformer", "train", "--config", str(config), "--resume"]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    refusal = f"error: --resume: no training checkpoint at {tmp_path / 'run' / 'checkpoint'}"
    assert done.returncode != 0 and lines == [refusal] * 2, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
