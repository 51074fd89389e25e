"""Fault injection (issue 13): a training process killed at random moments and inside the
checkpoint write, signals, a diverging learning rate, a changed config, a full disk. After each
fault the last checkpoint loads, and --resume reaches the same losses as a run never interrupted.

Debug-size model (2 layers, d 64) on ~30 KB of byte-level text, 10 steps of 8 x 32 tokens, one
torch thread everywhere, so that the subprocess and the in-process runs compute the same sums.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from diff_transformer.checkpoint import FAULT_ENV, CheckpointError
from diff_transformer.cli import main
from diff_transformer.data import corpus_documents, prepare
from diff_transformer.model import LanguageModel
from diff_transformer.train import load_config, train
from diff_transformer.train.state import TRAINING_STATE_FILE, find_checkpoint
from diff_transformer.train.trainer import read_metrics

STEPS = 10
TOLERANCE = 1e-6


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fault-data")
    (directory / "text.txt").write_text("".join(text for _, text in corpus_documents()[:2])[:30_000])
    prepare([directory / "text.txt"], directory / "shards", tokenizer="bytes", progress=False)
    return directory / "shards"


def write_config(dataset: Path, out_dir: Path, **run) -> Path:
    """A YAML config of the debug model, checkpointing after every step."""
    data = {
        "model": {"preset": "debug"},
        "models": {"diff": {"attention": "diff"}},
        "data": {"dataset": str(dataset), "seq_len": 32, "batch_size": 8, "eval_sequences": 8},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "run": {"steps": STEPS, "eval_every": 5, "log_every": 1, "checkpoint_every": 1, "out_dir": str(out_dir),
                "tensorboard": False, "progress": True, **run},
    }
    path = out_dir.with_suffix(".yaml")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def losses(out_dir: Path, kind: str = "train") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == kind}


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> dict:
    """The uninterrupted run: its per-step training losses and its validation losses."""
    out = tmp_path_factory.mktemp("fault-ref") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(load_config(str(write_config(dataset, out, progress=False))))
    finally:
        torch.set_num_threads(threads)
    assert result.status == "completed"
    return {"train": losses(out), "val": losses(out, "val"), "final": result.final_val_loss}


def launch(config: Path, **env_extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.Popen([sys.executable, "-m", "diff_transformer", "train", "--config", str(config)],
                            env=env, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended early ({process.returncode}): {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def resume_and_compare(config: Path, out: Path, reference: dict) -> float:
    """Resume in this process; every loss must match the uninterrupted run. Returns the largest difference."""
    result = train(load_config(str(config)), resume=True)
    assert result.status == "completed" and result.steps == STEPS
    got, got_val = losses(out), losses(out, "val")
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(got_val) == sorted(reference["val"])
    differences = [abs(got[s] - reference["train"][s]) for s in got] + [abs(got_val[s] - reference["val"][s]) for s in got_val]
    differences.append(abs(result.final_val_loss - reference["final"]))
    assert max(differences) <= TOLERANCE, differences
    return max(differences)


def checkpoint_step(directory: Path) -> int:
    return torch.load(directory / TRAINING_STATE_FILE, weights_only=True)["progress"]["step"]


# --- SIGKILL ----------------------------------------------------------------------------------------

RNG = random.Random(13)
KILLS = [("inside-write", "written", 4), ("inside-swap", "swapped", 6)] + [
    ("random", None, RNG.randint(2, STEPS - 2))
]


@pytest.mark.slow  # training subprocesses, killed and resumed
@pytest.mark.parametrize("point, at", [k[1:] for k in KILLS], ids=[k[0] for k in KILLS])
def test_sigkill_then_resume_matches_an_uninterrupted_run(point, at, dataset, reference, tmp_path):
    """SIGKILL inside the checkpoint write (the new version complete but not in place; the old one
    renamed aside), or at a random moment after step ``at``: the newest complete checkpoint loads
    and resuming from it reproduces every loss."""
    out = tmp_path / "run"
    config = write_config(dataset, out)
    marker = tmp_path / "paused"
    if point is not None:  # the at-th checkpoint write pauses at that point; kill it there
        process = launch(config, **{FAULT_ENV: f"{point}:{at}:{marker}"})
        wait_for(marker.exists, process)
    else:
        process = launch(config)
        wait_for(lambda: max(losses(out), default=0) >= at, process)
        time.sleep(RNG.uniform(0, 0.2))
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL

    found = find_checkpoint(out / "checkpoint")
    assert found is not None
    if point == "written":  # the new version never took the name: the previous one is there
        assert found == out / "checkpoint" and checkpoint_step(found) == at - 1
    if point == "swapped":  # killed between the two renames: the previous version, under .old
        assert found == out / ".checkpoint.old" and checkpoint_step(found) == at - 1
    assert LanguageModel.from_pretrained(found).num_parameters() > 0
    resumed_at = checkpoint_step(found)
    difference = resume_and_compare(config, out, reference)
    assert not (out / ".checkpoint.old").exists()
    print(f"kill {point or 'random'} at step {at}: resumed from step {resumed_at} -> max loss difference {difference:.1e}")


# --- SIGTERM / SIGINT -------------------------------------------------------------------------------


@pytest.mark.slow  # training subprocesses, killed and resumed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_then_resume_matches(signum, dataset, reference, tmp_path):
    out = tmp_path / "run"
    config = write_config(dataset, out, checkpoint_every=0)
    process = launch(config)
    wait_for(lambda: max(losses(out), default=0) >= 3, process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr  # a signal stopped it after saving a checkpoint: not a failure
    assert signal.Signals(signum).name in stderr and "continue with --resume" in stderr
    assert "Traceback" not in stderr
    # stderr is a pipe: plain progress lines, no carriage-return redraws
    assert "\r" not in stderr and "diff: " in stderr and " step (" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and checkpoint_step(out / "checkpoint") == summary["steps"]
    resume_and_compare(config, out, reference)


# --- divergence, changed config, full disk ----------------------------------------------------------


def test_a_diverging_learning_rate_stops_with_the_step_and_keeps_the_last_good_checkpoint(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    config = write_config(dataset, out, progress=False)
    code = main(["train", "--config", str(config), "--set", "optim.lr=1e30", "--set", "optim.warmup_steps=0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "step 2: loss nan" in err and "is not finite" in err and "the last good checkpoint is kept" in err
    assert json.loads((out / "summary.json").read_text())["status"] == "diverged"
    good = find_checkpoint(out / "checkpoint")
    assert checkpoint_step(good) == 1
    assert all(torch.isfinite(t).all() for t in LanguageModel.from_pretrained(good).state_dict().values())


@pytest.mark.parametrize(
    "override, named",
    [("model.n_layers=3", "model.n_layers: 2 -> 3"), ("data.seq_len=16", "data.seq_len: 32 -> 16"),
     ("data.batch_size=4", "data.batch_size: 8 -> 4"), ("run.data_seed=7", "run.data_seed: 0 -> 7")],
    ids=["model", "seq-len", "batch", "data-seed"],
)
def test_resuming_with_a_changed_model_or_data_is_refused_by_name(override, named, dataset, tmp_path_factory, capsys):
    out = tmp_path_factory.mktemp("changed") / "run"
    config = write_config(dataset, out, stop_at_step=1, progress=False)
    assert main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume", "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cannot resume with a different" in err[0]
    assert named in err[0]


def test_a_full_disk_leaves_the_previous_checkpoint_intact_and_says_so(dataset, tmp_path, monkeypatch, capsys):
    from diff_transformer import checkpoint as checkpoint_module

    out = tmp_path / "run"
    config = write_config(dataset, out, stop_at_step=2, progress=False)
    assert main(["train", "--config", str(config)]) == 0
    before = {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", no_space)
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("resuming from") and err[1:] == [f"error: step 3: could not write the checkpoint to {out / 'checkpoint'} (No space left on device); "
                   f"the previous checkpoint {out / 'checkpoint'} (step 2) is intact"]
    assert {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir()} == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")] == []
    monkeypatch.undo()
    LanguageModel.from_pretrained(out / "checkpoint")


def test_a_training_state_from_another_run_is_refused(dataset, tmp_path):
    runs = {}
    for name, seed in (("a", 0), ("b", 1)):
        out = tmp_path / name
        config = write_config(dataset, out, stop_at_step=2, progress=False, seed=seed)
        assert train(load_config(str(config))).status == "paused"
        runs[name] = (config, out)
    (config, out), (_, other) = runs["a"], runs["b"]
    shutil.copy(other / "checkpoint" / TRAINING_STATE_FILE, out / "checkpoint" / TRAINING_STATE_FILE)
    with pytest.raises(CheckpointError, match=r"training_state\.pt: from another run or another save"):
        train(load_config(str(config)), resume=True)
