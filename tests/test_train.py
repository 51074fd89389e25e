"""The trainer: schedule and recipes, exact resume, gradient accumulation, NaN handling, atomic
checkpoints, signals. Tiny models ("debug" preset) on a small byte-level dataset."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diff_transformer.checkpoint import CheckpointError, load_checkpoint_tokenizer
from diff_transformer.data import corpus_documents, prepare
from diff_transformer.model import LanguageModel
from diff_transformer.train import ConfigError, TrainingError, train
from diff_transformer.train import state as state_module
from diff_transformer.train import step as step_module
from diff_transformer.train.config import OptimConfig, config_from_dict
from diff_transformer.train.distributed import Environment
from diff_transformer.train.config import RECIPES
from diff_transformer.train.optim import WarmupLinearSchedule, parameter_groups
from diff_transformer.train.state import TRAINING_STATE_FILE, find_checkpoint
from diff_transformer.train.trainer import DataPlan, read_metrics


@pytest.fixture(scope="session")
def byte_dataset(tmp_path_factory) -> Path:
    """About 60 KB of the embedded corpus as byte-level token shards (vocab 257)."""
    directory = tmp_path_factory.mktemp("data")
    text = "".join(text for _, text in corpus_documents()[:2])[:60_000]
    (directory / "text.txt").write_text(text)
    prepare([directory / "text.txt"], directory / "shards", tokenizer="bytes", progress=False)
    return directory / "shards"


def debug_data(dataset: Path, out_dir: Path, models=None, **sections) -> dict:
    """A debug-preset config file's data: 6 steps of 8 sequences of 32 tokens, evaluation every 3 steps;
    ``sections`` merged over it."""
    data = {
        "model": {"preset": "debug"},
        "models": models or {"diff": {"attention": "diff"}},
        "data": {"dataset": str(dataset), "seq_len": 32, "batch_size": 8, "eval_sequences": 8},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "run": {"steps": 6, "eval_every": 3, "log_every": 1, "out_dir": str(out_dir), "tensorboard": False,
                "progress": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def debug_config(dataset: Path, out_dir: Path, models=None, **sections) -> "TrainConfig":  # noqa: F821
    """The trainer's config of :func:`debug_data`."""
    return config_from_dict(debug_data(dataset, out_dir, models, **sections))


def debug_experiment(dataset: Path, out_dir: Path, models=None, **sections) -> "ExperimentConfig":  # noqa: F821
    """The whole config of :func:`debug_data`, its experiment sections too."""
    from diff_transformer.experiments.config import experiment_from_dict

    return experiment_from_dict(debug_data(dataset, out_dir, models, **sections))


def losses(out_dir: Path, kind: str = "train") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == kind}


# --- optimizer and schedule ------------------------------------------------------------------


def test_schedule_warms_up_then_decays_linearly_to_the_floor():
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, betas=(0.9, 0.95), weight_decay=0.0)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupLinearSchedule(optimizer, config, total_steps=14)
    seen = []
    for _ in range(16):
        seen.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    assert seen[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # warmup
    assert seen[4] == pytest.approx(1.0) and seen[9] == pytest.approx(0.55)  # halfway through the decay
    assert seen[14:] == pytest.approx([0.1, 0.1])  # the floor, held after the last step
    restored = WarmupLinearSchedule(optimizer, config, total_steps=14)
    restored.load_state_dict(schedule.state_dict())
    assert restored.current_lr == pytest.approx(0.1)


def test_recipes_fill_only_the_fields_left_unset():
    config = OptimConfig(recipe="paper-3b", lr=1e-3)
    assert config.lr == 1e-3  # explicit value kept
    assert (config.min_lr, config.warmup_steps, config.betas, config.weight_decay) == (1.28e-5, 1000, (0.9, 0.95), 0.1)
    scaling = OptimConfig(recipe="paper-scaling")
    assert scaling.betas == (0.9, 0.98) and scaling.lr == RECIPES["paper-scaling"]["lr"] == 1.5e-4
    with pytest.raises(ConfigError, match="lr"):
        OptimConfig(min_lr=0.0, warmup_steps=1, betas=(0.9, 0.95), weight_decay=0.0)


def test_weight_decay_applies_to_matrices_not_to_norms_and_lambdas():
    from diff_transformer.config import ModelConfig

    model = LanguageModel(ModelConfig.from_preset("debug"))
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])
    assert {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]} >= {"lambda_q1", "weight"}


# --- data plan -----------------------------------------------------------------------------------


def test_micro_batches_cut_the_global_batch_across_processes(byte_dataset, tmp_path):
    config = debug_config(byte_dataset, tmp_path, data={"micro_batch_size": 2})
    whole = DataPlan(config, 32, Environment(0, 1, 0, torch.device("cpu")))
    parts = [DataPlan(config, 32, Environment(r, 2, r, torch.device("cpu"))) for r in range(2)]
    assert whole.accumulation == 4 and parts[0].accumulation == 2
    step = 5
    expected = torch.cat([x for x, _ in whole.micro_batches(step)])
    got = torch.cat([x for plan in parts for x, _ in plan.micro_batches(step)])
    assert torch.equal(expected, got)
    with pytest.raises(ConfigError, match="micro_batch_size=3"):
        DataPlan(debug_config(byte_dataset, tmp_path, data={"micro_batch_size": 3}), 32,
                 Environment(0, 1, 0, torch.device("cpu")))


def test_micro_batches_drawn_in_blocks_are_the_windows_of_each_steps_samples(byte_dataset, tmp_path):
    """The plan draws the window starts of STARTS_AHEAD steps at once: the same windows as get_batch of
    each step's sample indices, on either side of a block's end, in any order of steps, on every process."""
    from diff_transformer.train.trainer import STARTS_AHEAD

    config = debug_config(byte_dataset, tmp_path, data={"micro_batch_size": 2})
    for rank in range(2):
        plan = DataPlan(config, 32, Environment(rank, 2, rank, torch.device("cpu")))
        for step in (STARTS_AHEAD + 1, 0, STARTS_AHEAD - 1, STARTS_AHEAD, 7 * STARTS_AHEAD + 3):
            first = step * 8 + rank * 4
            expected = [plan.train.get_batch(range(start, start + 2), 32, seed=0) for start in (first, first + 2)]
            got = list(plan.micro_batches(step))
            assert len(got) == 2
            for (inputs, targets), (want_inputs, want_targets) in zip(got, expected):
                assert torch.equal(inputs, want_inputs) and torch.equal(targets, want_targets)


def test_clip_gradients_is_clip_grad_norm_bit_for_bit():
    from diff_transformer.config import ModelConfig

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug"))
    grads = [torch.randn_like(p) * 3 for p in model.parameters()]
    for clip in (1.0, 0.0, 1e6):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        norm = step_module.clip_gradients(model, clip)
        clipped = [p.grad.clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        expected = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        assert norm == float(expected)
        assert all(torch.equal(a, p.grad) for a, p in zip(clipped, model.parameters()))


def test_compile_auto_compiles_the_training_step_of_long_runs_only(byte_dataset, tmp_path):
    from diff_transformer.train.config import COMPILE_AUTO_MIN_STEPS

    run = debug_config(byte_dataset, tmp_path, run={"compile": "auto"}).run
    assert run.compile_training(COMPILE_AUTO_MIN_STEPS) and not run.compile_training(COMPILE_AUTO_MIN_STEPS - 1)
    assert not run.compile_training(None)  # a budget in seconds: its steps unknown
    assert debug_config(byte_dataset, tmp_path, run={"compile": True}).run.compile_training(1)
    assert not debug_config(byte_dataset, tmp_path).run.compile_training(10**6)
    with pytest.raises(ConfigError, match="run.compile must be true, false or auto"):
        debug_config(byte_dataset, tmp_path, run={"compile": "sometimes"})


def test_data_mix_replaces_samples_by_generated_examples(byte_dataset, tmp_path):
    config = debug_config(byte_dataset, tmp_path, data={"seq_len": 64, "mix": {"mqar": 0.5}})
    plan = DataPlan(config, 64, Environment(0, 1, 0, torch.device("cpu")))
    targets = torch.cat([t for _, t in plan.micro_batches(0)])
    masked_rows = int(((targets == -100).sum(1) > 0).sum())
    assert 0 < masked_rows < len(targets)  # some rows generated (scored on recalled values only), some corpus
    with pytest.raises(ConfigError, match="no-such-generator"):
        debug_config(byte_dataset, tmp_path, data={"mix": {"no-such-generator": 0.1}})


# --- training, checkpoints, resume ---------------------------------------------------------------


@pytest.mark.slow  # three training runs
def test_resume_continues_exactly_like_a_straight_run(byte_dataset, tmp_path):
    straight = train(debug_config(byte_dataset, tmp_path / "straight"))
    first = train(debug_config(byte_dataset, tmp_path / "split", run={"stop_at_step": 3}))
    assert first.status == "paused" and first.steps == 3
    second = train(debug_config(byte_dataset, tmp_path / "split"), resume=True)
    assert straight.status == second.status == "completed" and second.steps == 6
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]  # each step logged once after the resume
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    assert abs(straight.final_val_loss - second.final_val_loss) <= 1e-6
    assert losses(tmp_path / "straight", "val").keys() == losses(tmp_path / "split", "val").keys() == {3, 6}


def test_the_heldout_loss_is_the_final_model_on_the_heldout_windows(byte_dataset, tmp_path):
    """data.heldout_sequences: scored once, at the end, on the windows between the validation windows;
    the oracle reads those windows off the split by hand and scores the saved model on them."""
    from diff_transformer.data import TokenShards

    result = train(debug_config(byte_dataset, tmp_path, data={"heldout_sequences": 4}))
    model = LanguageModel.from_pretrained(Path(result.checkpoint)).eval()
    val = TokenShards(byte_dataset, "val")
    spacing = (val.num_tokens - 33) / 7  # 8 validation windows of 32 (+1) tokens
    starts = [round((gap + 0.5) * spacing) for gap in (0, 2, 4, 6)]
    tokens = torch.tensor([val.tokens[s:s + 33].tolist() for s in starts])
    with torch.no_grad():
        logits = model(tokens[:, :-1])[0].double()
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert result.final_heldout_loss == pytest.approx(float(expected), abs=1e-5)
    assert json.loads((tmp_path / "summary.json").read_text())["final_heldout_loss"] == result.final_heldout_loss
    assert abs(result.final_heldout_loss - result.final_val_loss) > 1e-6  # other windows than the validation's
    with pytest.raises(ConfigError, match="data.heldout_sequences"):
        debug_config(byte_dataset, tmp_path, data={"heldout_sequences": 8})


@pytest.mark.slow  # trains a BPE tokenizer and a model
def test_checkpoint_loads_as_a_model_with_its_tokenizer(byte_dataset, tmp_path):
    result = train(debug_config(byte_dataset, tmp_path))
    checkpoint = Path(result.checkpoint)
    assert checkpoint == tmp_path / "checkpoint"
    model = LanguageModel.from_pretrained(checkpoint)
    assert model.config.attention == "diff" and model.num_parameters() == result.parameters
    assert load_checkpoint_tokenizer(checkpoint, model.config.vocab_size).vocab_size == 257
    state = torch.load(checkpoint / TRAINING_STATE_FILE, weights_only=True)  # no pickled objects inside
    progress = {k: state["progress"][k] for k in ("step", "samples", "tokens")}  # and the time it took
    assert progress == {"step": 6, "samples": 48, "tokens": 6 * 8 * 32}
    training = json.loads((checkpoint / "config.json").read_text())["training"]  # what readers of a checkpoint see
    assert (training["step"] == 6 and training["tokens"] == 6 * 8 * 32
            and training["checkpoint_id"] == state["checkpoint_id"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["peak_memory_kind"] == "peak RSS"
    assert summary["peak_memory_bytes"] > 0 and summary["tokens_per_s"] > 0
    # Throughput counts the steps after the first (which warms up): 5 steps of 8 × 32 tokens.
    assert summary["tokens_per_s"] * summary["train_seconds"] == pytest.approx(5 * 8 * 32)
    assert summary["train_seconds"] < summary["wall_seconds"]


def test_the_meter_times_only_what_it_is_told_and_averages_each_log_window():
    from diff_transformer.train.trainer import _Meter

    meter = _Meter(tokens_per_step=100)
    meter.add(5.0, loss=4.0, timed=False)  # the warm-up step
    meter.add(2.0, loss=3.0, timed=True)
    meter.add(2.0, loss=2.0, timed=True)
    assert meter.train_seconds == 4.0 and meter.tokens_per_s == 50.0
    assert meter.close_window()["loss"] == 3.0  # mean over the window's three steps
    meter.add(1.0, loss=1.0, timed=True)
    assert meter.close_window()["loss"] == 1.0 and meter.window_steps == 0


@pytest.mark.slow  # three training runs
def test_gradient_accumulation_follows_the_full_batch(byte_dataset, tmp_path):
    train(debug_config(byte_dataset, tmp_path / "full"))
    train(debug_config(byte_dataset, tmp_path / "accumulated", data={"micro_batch_size": 2}))
    a, b = losses(tmp_path / "full"), losses(tmp_path / "accumulated")
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])


def test_existing_checkpoint_is_not_overwritten_without_resume(byte_dataset, tmp_path):
    config = debug_config(byte_dataset, tmp_path, run={"steps": 1})
    with pytest.raises(TrainingError, match="no training checkpoint"):
        train(config, resume=True)
    train(config)
    with pytest.raises(TrainingError, match="--resume"):
        train(config)


def test_resume_refuses_a_config_that_changes_the_model_or_the_data(byte_dataset, tmp_path):
    train(debug_config(byte_dataset, tmp_path, run={"stop_at_step": 1}))
    with pytest.raises(CheckpointError, match=r"data\.seq_len: 32 -> 16"):
        train(debug_config(byte_dataset, tmp_path, data={"seq_len": 16}), resume=True)
    with pytest.raises(CheckpointError, match=r"model\.attention: 'diff' -> 'standard'"):
        train(debug_config(byte_dataset, tmp_path, models={"diff": {"attention": "standard"}}), resume=True)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(byte_dataset, tmp_path, monkeypatch):
    real = step_module.token_loss_sum
    calls = {"n": 0}

    def poisoned(model, inputs, targets, separator=None):
        calls["n"] += 1
        loss = real(model, inputs, targets, separator)
        return loss * float("nan") if calls["n"] == 3 else loss  # the third training forward: step 3

    monkeypatch.setattr(step_module, "token_loss_sum", poisoned)
    config = debug_config(byte_dataset, tmp_path, run={"checkpoint_every": 1, "eval_every": 100})
    result = train(config)
    assert result.status == "diverged" and result.steps == 2
    assert "not finite" in result.message
    good = find_checkpoint(tmp_path / "checkpoint")
    assert good is not None
    assert torch.load(good / TRAINING_STATE_FILE, weights_only=True)["progress"]["step"] == 2
    assert torch.isfinite(LanguageModel.from_pretrained(good).embed.weight).all()


@pytest.mark.slow  # two training runs
def test_a_crash_while_writing_leaves_the_previous_checkpoint_intact(byte_dataset, tmp_path, monkeypatch):
    train(debug_config(byte_dataset, tmp_path, run={"steps": 2}))
    before = (tmp_path / "checkpoint" / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(state_module.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        train(debug_config(byte_dataset, tmp_path, run={"steps": 4}), resume=True, lengthen=True)
    monkeypatch.undo()
    found = find_checkpoint(tmp_path / "checkpoint")
    assert found == tmp_path / "checkpoint"
    assert (found / "model.safetensors").read_bytes() == before
    assert torch.load(found / TRAINING_STATE_FILE, weights_only=True)["progress"]["step"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint.tmp")]


@pytest.mark.slow  # a training subprocess
def test_sigterm_saves_a_checkpoint_before_exiting(byte_dataset, tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "config.yaml"
    import yaml

    data = debug_config(byte_dataset, out, run={"steps": 100_000, "eval_every": 100_000}).to_dict()
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "diff_transformer", "train", "--config", str(config)],
                               env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not losses(out) and time.monotonic() < deadline:  # wait until training is under way
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr  # 143: stopped by SIGTERM, checkpoint saved
    assert "SIGTERM" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    state = torch.load(out / "checkpoint" / TRAINING_STATE_FILE, weights_only=True)
    assert state["progress"]["step"] == summary["steps"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_uses_bf16_autocast_and_reports_allocated_memory(byte_dataset, tmp_path):
    result = train(debug_config(byte_dataset, tmp_path, run={"device": "cuda", "steps": 3}))
    assert result.status == "completed" and result.device == "cuda"
    assert result.peak_memory_kind == "max allocated" and result.peak_memory_bytes > 0
    assert all(math.isfinite(loss) for loss in losses(tmp_path).values())
    model = LanguageModel.from_pretrained(tmp_path / "checkpoint")
    assert model.embed.weight.dtype == torch.float32  # autocast leaves the weights in fp32


def test_a_dataset_vocabulary_larger_than_the_model_is_refused_naming_the_model(byte_dataset, tmp_path):  # noqa: F811
    models = {"diff": {"attention": "diff", "vocab_size": 100}}  # the byte dataset has 257 ids
    with pytest.raises(ConfigError, match=r"vocabulary of 257 tokens, more than model 'diff''s vocab_size=100"):
        train(debug_config(byte_dataset, tmp_path / "run", models=models))
    assert not (tmp_path / "run").exists()
