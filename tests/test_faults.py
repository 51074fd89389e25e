"""Fault injection: a training process killed at random moments and inside the checkpoint write,
signals, a diverging learning rate, a changed config, a full disk or a read-only file system under
every writer, two processes on one run directory. After each fault the last checkpoint loads,
--resume reaches the same losses as a run never interrupted, and an I/O failure is one ``error:``
line naming the file and the OS's reason, with exit status 2 and nothing half-written left.

Debug-size model (2 layers, d 64) on ~30 KB of byte-level text, 10 steps of 8 x 32 tokens, one
torch thread everywhere, so that the subprocess and the in-process runs compute the same sums.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from diff_transformer.checkpoint import CheckpointError, remove_abandoned_temporaries
from diff_transformer.cli import main
from diff_transformer.files import claim_output_dir, lock_output_dir
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
    return {"train": losses(out), "val": losses(out, "val"), "final": result.final_val_loss,
            "checkpoint": out / "checkpoint"}


def paused_at(spec: str) -> str:
    """The start of a child's script that replaces ``checkpoint.fault_point`` (the library's test hook):
    ``spec`` "POINT:N:FILE" makes the N-th directory write of the process create FILE and sleep at
    POINT ("written" or "swapped"), so that the test can kill it there."""
    point, count, marker = spec.split(":", 2)
    return ("import pathlib, time\nfrom diff_transformer import checkpoint\nseen = []\n"
            "def pause(point):\n"
            f"    if point == {point!r}:\n"
            "        seen.append(point)\n"
            f"        if len(seen) == {int(count)}:\n"
            f"            pathlib.Path({marker!r}).write_text(point)\n"
            "            time.sleep(120)\n"
            "checkpoint.fault_point = pause\n")


def launch(config: Path, *args: str, preexec_fn=None, pause: str | None = None) -> subprocess.Popen:
    """``diff-transformer train`` in a subprocess; ``pause``: where it stops (:func:`paused_at`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    script = (paused_at(pause) if pause else "") + "import sys\nfrom diff_transformer.cli import main\n" \
        "sys.exit(main(sys.argv[1:]))\n"
    return subprocess.Popen([sys.executable, "-c", script, "train", "--config", str(config), *args],
                            env=env, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


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
    differences = ([abs(got[s] - reference["train"][s]) for s in got]
                   + [abs(got_val[s] - reference["val"][s]) for s in got_val])
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
        process = launch(config, pause=f"{point}:{at}:{marker}")
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
    leftovers = list(out.glob(".checkpoint.tmp-*"))
    if point == "written":  # the new version never took the name: the previous one is there
        assert found == out / "checkpoint" and checkpoint_step(found) == at - 1
        assert len(leftovers) == 1 and (leftovers[0] / TRAINING_STATE_FILE).stat().st_size > 0  # the full new version
    if point == "swapped":  # killed between the two renames: the previous version, under .old
        assert found == out / ".checkpoint.old" and checkpoint_step(found) == at - 1
    assert LanguageModel.from_pretrained(found).num_parameters() > 0
    resumed_at = checkpoint_step(found)
    difference = resume_and_compare(config, out, reference)
    assert not (out / ".checkpoint.old").exists()
    assert list(out.glob(".checkpoint.tmp-*")) == []  # the killed write's temporary directory is removed
    print(f"kill {point or 'random'} at step {at}: resumed from step {resumed_at} "
          f"-> max loss difference {difference:.1e}")


# --- SIGTERM / SIGINT -------------------------------------------------------------------------------


@pytest.mark.slow  # training subprocesses, killed and resumed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_saves_then_resume_matches(signum, dataset, reference, tmp_path):
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signum == signal.SIGHUP:
        pytest.skip("SIGHUP is ignored here (nohup), and so in the run this test starts")
    out = tmp_path / "run"
    config = write_config(dataset, out, checkpoint_every=0)
    process = launch(config)
    wait_for(lambda: max(losses(out), default=0) >= 3, process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, stderr  # 130 / 143: stopped by the signal, checkpoint saved
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


@pytest.mark.slow  # trains twice (1.5 s)
def test_quiet_drops_only_the_summary_line_of_a_completed_run(dataset, tmp_path, capsys):
    for name, quiet in (("loud", []), ("quiet", ["--quiet"])):
        config = write_config(dataset, tmp_path / name, steps=2, progress=False)
        assert main(["train", "--config", str(config), *quiet]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        if quiet:
            assert err == []
        else:
            assert len(err) == 1 and err[0].startswith("diff: 2 steps, ") and "final validation loss" in err[0]


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


def prepare_text(directory: Path, text: str) -> Path:
    """``text`` prepared byte by byte into directory/shards (replacing what is there)."""
    (directory / "text.txt").write_text(text)
    prepare([directory / "text.txt"], directory / "shards", tokenizer="bytes", progress=False, overwrite=True)
    return directory / "shards"


FAULT_TEXT = "".join(text for _, text in corpus_documents()[:2])[:30_000]
PREPARED_AGAIN = [  # (case id, the text prepared again, what differs: "sizes", "tokens", None: nothing)
    ("other-text", FAULT_TEXT[:20_000], "sizes"),
    ("other-text-same-sizes", FAULT_TEXT.swapcase(), "tokens"),
    ("the-same-text", FAULT_TEXT, None),
]


@pytest.mark.parametrize("text, differs", [c[1:] for c in PREPARED_AGAIN], ids=[c[0] for c in PREPARED_AGAIN])
@pytest.mark.parametrize("legacy", [False, True], ids=["fingerprinted", "dataset-without-fingerprint"])
def test_resuming_on_a_dataset_prepared_again_is_refused_naming_it(text, differs, legacy, tmp_path, capsys):
    """Issue 43: `train --resume` after the run's dataset was prepared again from other text went on
    silently on the new data. The checkpoint records the dataset's fingerprint and sizes; another
    text (other sizes, or the same sizes and other tokens) is refused naming the dataset and what
    differs, and the run's files stay as they were; the same text prepared again goes on. A
    dataset prepared before meta.json carried a fingerprint gets one computed from its files."""
    shards = prepare_text(tmp_path, FAULT_TEXT)
    if legacy:  # as an earlier version wrote it
        meta = json.loads((shards / "meta.json").read_text())
        del meta["fingerprint"]
        (shards / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "run"
    config = write_config(shards, out, stop_at_step=1, progress=False)
    assert main(["train", "--config", str(config)]) == 0
    sizes = [json.loads((shards / "meta.json").read_text())]
    prepare_text(tmp_path, text)
    sizes.append(json.loads((shards / "meta.json").read_text()))
    before = snapshot(out)
    capsys.readouterr()
    code = main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=2"])
    err = capsys.readouterr().err.strip().splitlines()
    if differs is None:
        assert code == 0 and checkpoint_step(out / "checkpoint") == 2, err
        return
    if differs == "sizes":  # the two meta.json files' figures
        named = "; ".join(f"{split} tokens {a[split]['tokens']:,} -> {b[split]['tokens']:,}"
                          for split, (a, b) in (("train", sizes), ("val", sizes)))
    else:
        assert [m[s]["tokens"] for m in sizes for s in ("train", "val")] == [sizes[0]["train"]["tokens"],
                                                                           sizes[0]["val"]["tokens"]] * 2
        named = "the same sizes, other tokens (fingerprint sha256:"
    assert code == 2 and len(err) == 1 and err[0].startswith(
        f"error: --resume: the dataset {shards} is not the one the run trained on ({named}"), err
    assert err[0].endswith("): it was prepared again, from other text or with other settings; resume with the data the "
                           "run started with, or start a new run in another run.out_dir")
    assert snapshot(out) == before


def test_a_checkpoint_from_before_dataset_records_resumes_with_a_note(tmp_path, capsys):
    """A training state saved before checkpoints recorded their dataset: the run goes on, and says
    that the data could not be compared."""
    shards = prepare_text(tmp_path, FAULT_TEXT)
    out = tmp_path / "run"
    config = write_config(shards, out, stop_at_step=1, progress=False)
    assert main(["train", "--config", str(config)]) == 0
    path = out / "checkpoint" / TRAINING_STATE_FILE
    state = torch.load(path, weights_only=True)
    del state["dataset"]
    torch.save(state, path)
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=2"]) == 0
    assert (f"note: {out / 'checkpoint'} was saved before checkpoints recorded their dataset's fingerprint: whether "
            f"{shards} still holds the data the run trained on cannot be checked") in capsys.readouterr().err


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
    assert err[0].startswith("resuming from") and err[1:] == [f"error: step 3: could not write the checkpoint to "
                  f"{out / 'checkpoint'} (No space left on device); "
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


# --- one writer per run directory -------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) with its SHA-256."""
    return {str(q.relative_to(root)): hashlib.sha256(q.read_bytes()).hexdigest()
            for q in sorted(root.rglob("*")) if q.is_file()}


@pytest.mark.slow
def test_a_second_process_on_a_running_run_is_refused_naming_the_first(dataset, reference, tmp_path, capsys):
    """Two writers, one run: the second, with or without --resume, is refused with the first's pid
    and touches nothing (not even the first's half-written checkpoint). Once the first is killed,
    its lock is taken over with a note, and resuming reproduces the uninterrupted run."""
    out = tmp_path / "run"
    config = write_config(dataset, out, progress=False)
    marker = tmp_path / "paused"
    first = launch(config, pause=f"written:4:{marker}")  # holds the run, paused inside its 4th save
    wait_for(marker.exists, first)
    before = snapshot(out)
    assert any(name.startswith(".checkpoint.tmp-") for name in before)  # the first one's save in progress
    for extra in ([], ["--resume"]):
        assert main(["train", "--config", str(config), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: {out}: in use by another diff-transformer process "
            f"(pid {first.pid} on {socket.gethostname()}, since "
        ) and err[0].endswith("); wait for it to end, or choose another directory"), err
    assert snapshot(out) == before
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)

    resume_and_compare(config, out, reference)  # every step logged once: no rows of a second run
    err = capsys.readouterr().err
    assert f"note: {out / '.lock'}: taking over the lock of pid {first.pid} on " in err
    assert "which ended without releasing it" in err and "left by a checkpoint write that was interrupted" in err
    assert not (out / ".lock").exists()  # released when the run ended


def test_train_and_compare_refuse_a_directory_locked_by_another_process(dataset, tmp_path, capsys):
    runs = claim_output_dir(tmp_path / "run", "train-run")
    config = write_config(dataset, runs, progress=False)
    comparison = claim_output_dir(tmp_path / "cmp", "compare")
    (comparison / "report.md").write_text("the running comparison's report\n")
    for directory, argv in ((runs, ["train", "--config", str(config)]),
                            (comparison, ["compare", "--config", str(config), "--out", str(comparison), "--steps", "1",
                                          "--no-retrieval", "--no-eval"])):
        before = snapshot(directory)
        with lock_output_dir(directory):  # held by this process: another open of the lock file conflicts
            assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {directory}: in use by another diff-transformer process "
                                                   f"(pid {os.getpid()} on {socket.gethostname()}, since "), err
        assert snapshot(directory) == before  # the lock file is gone again, the rest untouched


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_note(tmp_path, capsys):
    """A lock file whose process is gone (no one holds its flock) is taken over; the note names the
    pid it was left by, and the file then names this process until it is released."""
    directory = claim_output_dir(tmp_path / "run", "train-run")
    (directory / ".lock").write_text(json.dumps({"pid": 2**22 + 1, "host": "elsewhere",
                                                 "since": "2000-01-01T00:00:00"}))
    with lock_output_dir(directory):
        assert json.loads((directory / ".lock").read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err == (f"note: {directory / '.lock'}: taking over the lock of pid {2**22 + 1} "
                                       "on elsewhere, since 2000-01-01T00:00:00, which ended without releasing it\n")
    assert not (directory / ".lock").exists()


def test_a_lock_probed_at_the_moment_it_is_taken_is_still_taken(tmp_path):
    """Checking whether a directory is being written probes its lock (shared, for an instant): a
    writer taking the lock in that instant (another rank checking the run it is about to lock)
    waits for the probe instead of refusing itself."""
    import fcntl
    import threading

    directory = claim_output_dir(tmp_path / "run", "train-run")
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the probe, held a little longer than probes are
    threading.Timer(0.03, os.close, [fd]).start()
    with lock_output_dir(directory):
        assert json.loads((directory / ".lock").read_text())["pid"] == os.getpid()


def test_only_abandoned_temporary_directories_are_removed(tmp_path):
    """A save's temporary directory is removed when no process holds its lock (its writer died),
    and kept while a writer holds it."""
    from diff_transformer.checkpoint import _locked_temporary_directory

    target = tmp_path / "checkpoint"
    abandoned = tmp_path / ".checkpoint.tmp-abandoned"
    (abandoned / "sub").mkdir(parents=True)
    (abandoned / "sub" / "weights").write_bytes(b"x" * 1000)
    (tmp_path / ".other.tmp-x").mkdir()  # another directory's: not ours to remove
    live, fd = _locked_temporary_directory(target)
    try:
        assert remove_abandoned_temporaries(target) == [abandoned]
        assert live.is_dir() and (tmp_path / ".other.tmp-x").is_dir() and not abandoned.exists()
    finally:
        os.close(fd)
    assert remove_abandoned_temporaries(target) == [live]


def test_a_killed_saves_temporary_directory_is_removed_on_resume_and_on_the_next_save(dataset, tmp_path, capsys):
    """What a save killed mid-write leaves (a full-size ``.checkpoint.tmp-*``, its lock gone with its
    process) is removed, with a note, when the run resumes; ``save_pretrained`` removes its own kind
    of leftover on its next write of the same directory."""
    out = tmp_path / "run"
    config = write_config(dataset, out, stop_at_step=1, progress=False)
    assert main(["train", "--config", str(config)]) == 0
    leftover = Path(shutil.copytree(out / "checkpoint", out / ".checkpoint.tmp-killed"))
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=2"]) == 0
    assert f"note: removed {leftover}, left by a checkpoint write that was interrupted" in capsys.readouterr().err
    assert not leftover.exists() and checkpoint_step(out / "checkpoint") == 2

    model = LanguageModel.from_pretrained(out / "checkpoint")
    target = model.save_pretrained(tmp_path / "model")
    other = Path(shutil.copytree(target, tmp_path / ".model.tmp-killed"))
    model.save_pretrained(target, overwrite=True)
    assert not other.exists() and sorted(q.name for q in tmp_path.iterdir() if q.name.startswith(".model")) == []


# --- exit statuses of an interrupted comparison ------------------------------------------------------


@pytest.mark.parametrize("code, name", [(130, "SIGINT"), (143, "SIGTERM")])
def test_compare_reads_a_child_stopped_by_a_signal_as_an_interruption(code, name, monkeypatch, capsys, tmp_path):
    import diff_transformer.experiments as experiments
    from diff_transformer.experiments.runner import StudyInterrupted, TrainingJob, run_jobs
    from diff_transformer.experiments.study import RunKey
    from diff_transformer.train import TrainingError

    class Exits(TrainingJob):  # a training process that exits with ``status`` at once
        def __init__(self, status):
            super().__init__(RunKey("m", 0, 1e-3), f"exits {status}", tmp_path / str(status), "m", None)
            self.status = status

        def command(self, resume, nproc):
            return [sys.executable, "-c", f"raise SystemExit({self.status})"]

        def cost(self):
            return 0.0

    with pytest.raises(StudyInterrupted, match=f"interrupted by {name}: ") as caught:
        run_jobs([Exits(code)], progress=False)
    assert caught.value.exit_status == code
    with pytest.raises(TrainingError, match=r"training failed \(exit code 2"):  # a failure stays one
        run_jobs([Exits(2)], progress=False)

    def interrupted(*args, **kwargs):
        raise StudyInterrupted(f"interrupted by {name}: ...", code - 128)

    monkeypatch.setattr(experiments, "compare", interrupted)
    assert main(["compare", "--steps", "1"]) == code
    assert capsys.readouterr().err == f"interrupted by {name}: ...\n"


# --- every writer: a full disk, a read-only file system, no permission -------------------------------

OS_ERRORS = [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system"),
             (errno.EACCES, "Permission denied")]


def _failing_torch_save(code: int):
    """torch.save as it fails on a full disk: a RuntimeError raised while the OSError is handled."""
    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 the first bytes")
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    return save


def _failing_save_file(code: int):
    """safetensors' save_file as it fails: its Rust error, the OS's code at the end of the message."""
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
    return save_file


@pytest.mark.parametrize("writer", ["torch", "safetensors"])
@pytest.mark.parametrize("code, reason", OS_ERRORS, ids=["ENOSPC", "EROFS", "EACCES"])
def test_a_checkpoint_writer_failing_is_one_error_line_and_the_previous_checkpoint_stays(
        writer, code, reason, dataset, tmp_path, monkeypatch, capsys):
    from diff_transformer import checkpoint as checkpoint_module

    out = tmp_path / "run"
    config = write_config(dataset, out, stop_at_step=2, progress=False)
    assert main(["train", "--config", str(config)]) == 0
    before = snapshot(out / "checkpoint")
    if writer == "torch":
        monkeypatch.setattr(torch, "save", _failing_torch_save(code))
    else:
        monkeypatch.setattr(checkpoint_module, "save_file", _failing_save_file(code))
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[1:] == [f"error: step 3: could not write the checkpoint to {out / 'checkpoint'} ({reason}); "
                       f"the previous checkpoint {out / 'checkpoint'} (step 2) is intact"], err
    assert snapshot(out / "checkpoint") == before
    assert [q.name for q in out.iterdir() if q.name.startswith(".checkpoint")] == []


def _fail_on(name: str, code: int, real):
    """``real`` (os.replace or open), failing with ``code`` when it would write a file called
    ``name``; the OSError names the file it was given (os.replace: the temporary file)."""
    renames = real is os.replace

    def call(*args, **kwargs):
        if renames:
            writes = Path(args[1]).name == name
        else:
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            writes = Path(args[0]).name == name and any(c in mode for c in "wax")
        if writes:
            raise OSError(code, os.strerror(code), str(args[0]))
        return real(*args, **kwargs)
    return call


@pytest.mark.parametrize("name", ["metrics.jsonl", "tensorboard", "summary.json", ".diff-transformer"])
@pytest.mark.parametrize("code, reason", OS_ERRORS, ids=["ENOSPC", "EROFS", "EACCES"])
def test_every_log_writer_failing_is_one_error_line_naming_the_file(name, code, reason, dataset, tmp_path,
                                                                    monkeypatch, capsys):
    """metrics.jsonl (appended), the TensorBoard event file, summary.json and the directory's marker
    (written atomically: the failure names the file, not its temporary): one line, exit 2, no
    empty or partial file, no traceback from a thread."""
    from diff_transformer.train import trainer as trainer_module
    from tensorboard.summary.writer import record_writer

    out = tmp_path / "run"
    config = write_config(dataset, out, progress=False, tensorboard=True, steps=2)
    if name == "metrics.jsonl":
        monkeypatch.setattr(trainer_module, "open", _fail_on(name, code, open), raising=False)
        expected = out / name
    elif name == "tensorboard":
        def write(self, data):
            self._writer.write(data[:5])  # a partial record, then the failure
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(record_writer.RecordWriter, "write", write)
        expected = out / "tensorboard" / "events.out.tfevents."
    else:  # written atomically: the failure comes at the rename of the temporary file
        monkeypatch.setattr(os, "replace", _fail_on(name, code, os.replace))
        expected = out / name
    assert main(["train", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {expected}") and err[0].endswith(f": {reason}"), captured.err
    assert "Traceback" not in captured.err and "Exception in thread" not in captured.err
    left = {q.name: q.stat().st_size for q in out.rglob("*") if q.is_file()}
    assert all(size > 0 for size in left.values()), left  # no empty file
    assert not any(".tmp" in q for q in left)  # no temporary file
    if name in ("metrics.jsonl", ".diff-transformer"):  # failed at the first record / at start
        assert "metrics.jsonl" not in left and not (out / "tensorboard").exists()
    if name == "tensorboard":  # the first record reached metrics.jsonl, then its event failed
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1] and not (out / "tensorboard").exists()


def _file_size_limit(limit: int):
    """For a child process: writes beyond ``limit`` bytes fail with EFBIG (and no SIGXFSZ)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_real_writers_failing_on_a_file_size_limit_are_one_error_line(dataset, reference, tmp_path):
    """The real writers (our metrics and event files, safetensors' Rust writer, torch's zip writer)
    under a file-size limit, which makes the kernel fail their writes (EFBIG) as a full disk would."""
    weights = (reference["checkpoint"] / "model.safetensors").stat().st_size
    state = (reference["checkpoint"] / TRAINING_STATE_FILE).stat().st_size
    assert weights < state
    lock_record = json.dumps({"pid": 2**22, "host": socket.gethostname(), "since": "2000-01-01T00:00:00"}) + "\n"
    cases = [  # (limit, the error line's text, the writer that fails)
        (len(lock_record) + 8, f"metrics.jsonl: {os.strerror(errno.EFBIG)}", "metrics.jsonl"),
        (weights // 2, f"could not write the checkpoint to {{out}}/checkpoint ({os.strerror(errno.EFBIG)}); "
                       "there is no earlier checkpoint", "safetensors"),
        ((weights + state) // 2, f"could not write the checkpoint to {{out}}/checkpoint ({os.strerror(errno.EFBIG)}); "
                                 "there is no earlier checkpoint", "torch.save"),
    ]
    for limit, expected, writer in cases:
        out = tmp_path / writer
        config = write_config(dataset, out, progress=False, tensorboard=True)
        process = launch(config, preexec_fn=_file_size_limit(limit))
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (writer, stderr)
        assert (stderr.count("\n") == 1 and stderr.startswith("error: ")
                and expected.format(out=out) in stderr), (writer, stderr)
        left = [q for q in out.rglob("*") if q.is_file()]
        assert all(q.stat().st_size > 0 for q in left) and not any(".tmp" in q.name for q in left), (writer, left)
        if writer != "metrics.jsonl":  # whole records only
            assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"] == [1]


def _no_temporaries_in(folder: Path, code: int, monkeypatch) -> None:
    """tempfile.mkstemp and mkdtemp, and creating a file with os.open (a writer's lock file beside its
    output), fail with ``code`` in ``folder`` (a full or read-only file system, or no permission,
    where every writer makes its lock file or temporary first); the OSError names the file, as the
    operating system's does."""
    import tempfile

    def no_new_file(path, flags, *args, real=os.open, **kwargs):
        if flags & os.O_CREAT and Path(path).parent.resolve() == folder.resolve() and not Path(path).exists():
            raise OSError(code, os.strerror(code), str(path))
        return real(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", no_new_file)

    for name in ("mkstemp", "mkdtemp"):
        def fail(*args, real=getattr(tempfile, name), **kwargs):
            where = kwargs.get("dir")
            if where is not None and Path(where).resolve() == folder.resolve():
                temporary = Path(where) / f"{kwargs.get('prefix', 'tmp')}x1y2z3{kwargs.get('suffix', '')}"
                raise OSError(code, os.strerror(code), str(temporary))
            return real(*args, **kwargs)
        monkeypatch.setattr(tempfile, name, fail)


@pytest.mark.parametrize("writer", ["export-hf", "import-hf", "prepare", "tokenizer", "eval", "save_pretrained",
                                    "write_atomically"])
@pytest.mark.parametrize("code, reason", OS_ERRORS, ids=["ENOSPC", "EROFS", "EACCES"])
def test_a_writer_that_cannot_create_its_temporary_names_its_output(writer, code, reason, tmp_path, monkeypatch,
                                                                    capsys):
    """The first thing every writer creates is a temporary file or directory beside its output: when
    the file system refuses it, the error names the output the user asked for, not the temporary."""
    from diff_transformer.config import ModelConfig
    from diff_transformer.files import write_text_atomically
    from diff_transformer.tokenizer import ByteTokenizer

    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    ckpt = model.save_pretrained(tmp_path / "ckpt", ByteTokenizer())
    (tmp_path / "text.txt").write_text("Some text to tokenize, and some more text to tokenize.\n" * 40)
    if writer == "import-hf":
        pytest.importorskip("transformers")
        assert main(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    folder = tmp_path / "full"
    folder.mkdir()
    out = folder / ("tok.json" if writer == "tokenizer" else "out")
    argv = {"export-hf": ["export-hf", str(ckpt), str(out)],
            "import-hf": ["import-hf", str(tmp_path / "hf"), str(out)],
            "prepare": ["prepare", str(tmp_path / "text.txt"), "--out", str(out), "--tokenizer", "bytes"],
            "tokenizer": ["tokenizer", "train", "--input", str(tmp_path / "text.txt"), "--out", str(out),
                          "--vocab-size", "260"],
            "eval": ["eval", "outliers", "--checkpoint", str(ckpt), "--out", str(out), "--quick", "--no-progress"],
            }.get(writer)
    if writer == "export-hf":
        pytest.importorskip("transformers")
    _no_temporaries_in(folder, code, monkeypatch)
    capsys.readouterr()
    if argv is not None:
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1:] == [f"error: {out}: {reason}"]
    else:
        with pytest.raises(OSError) as caught:
            if writer == "save_pretrained":
                model.save_pretrained(out)
            else:
                write_text_atomically(out, "a result\n")
        assert (caught.value.errno, caught.value.filename) == (code, str(out))
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("code, reason", OS_ERRORS, ids=["ENOSPC", "EROFS", "EACCES"])
def test_a_failure_building_the_corpus_cache_names_the_cache(code, reason, tmp_path, monkeypatch):
    """The default corpus is tokenized into the cache once; a full disk there (the shard writers'
    errors name no file) is an OSError naming the cache directory, and no temporary is left."""
    from diff_transformer.data import corpus as corpus_module

    def write_shards(documents, directory, *args, **kwargs):
        (directory / "train.bin").write_bytes(b"partial")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(corpus_module, "write_shards", write_shards)
    with pytest.raises(OSError) as caught:
        corpus_module.default_dataset(tmp_path / "cache", progress=False)
    target = next(iter((tmp_path / "cache").glob("corpus-*")), None)
    assert target is None and caught.value.errno == code
    assert (Path(caught.value.filename).parent == tmp_path / "cache"
            and Path(caught.value.filename).name.startswith("corpus-"))
    assert [q.name for q in (tmp_path / "cache").iterdir()] == [".corpus.lock"]


# --- one writer per dataset and per evaluation output ---------------------------------------------


def _start_paused(argv: list[str], marker: Path, pause: str | None = None, at: str | None = None) -> subprocess.Popen:
    """``diff-transformer ARGV`` in a subprocess that pauses while writing: at a fault point of a
    directory write (``at``, as :func:`paused_at` reads it), or, with ``pause`` ("module:function"), on
    entering that function; returns once it has paused (``marker`` exists)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    script = (paused_at(at) if at else "") + "import sys\nfrom diff_transformer.cli import main\n"
    if pause is not None:
        module, function = pause.split(":")
        script += (f"import importlib, pathlib, time\nmodule = importlib.import_module({module!r})\n"
                   f"def paused(*args, **kwargs):\n    pathlib.Path({str(marker)!r}).write_text('paused')\n"
                   f"    time.sleep(120)\nsetattr(module, {function!r}, paused)\n")
    script += "sys.exit(main(sys.argv[1:]))\n"
    process = subprocess.Popen([sys.executable, "-c", script, *argv], env=env, stderr=subprocess.PIPE, text=True)
    wait_for(marker.exists, process)
    return process


@pytest.mark.slow  # two processes at once (3 s)
def test_a_second_prepare_to_the_same_dataset_is_refused_naming_the_first(tmp_path, capsys):
    """Two `prepare` runs to one --out at once: the second (another input, with or without
    --overwrite) is refused with the first one's pid and touches nothing; once the first is gone,
    its leftovers are cleared and the dataset is the next run's."""
    for name in ("first", "second"):
        (tmp_path / f"{name}.txt").write_text(f"The {name} text, to be tokenized.\n" * 40)
    out = tmp_path / "data"
    marker = tmp_path / "paused"
    first = _start_paused(["prepare", str(tmp_path / "first.txt"), "--out", str(out), "--tokenizer", "bytes",
                           "--quiet"], marker, at=f"written:1:{marker}")
    try:
        before = snapshot(tmp_path)
        for extra in ([], ["--overwrite"]):
            assert main(["prepare", str(tmp_path / "second.txt"), "--out", str(out), "--tokenizer", "bytes",
                         "--quiet", *extra]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(
                f"error: {out}: in use by another diff-transformer process (pid {first.pid} on {socket.gethostname()}, "
                "since ") and err[0].endswith("); wait for it to end, or choose another directory"), err
        assert snapshot(tmp_path) == before
    finally:
        first.kill()
        first.communicate(timeout=30)
    assert main(["prepare", str(tmp_path / "second.txt"), "--out", str(out), "--tokenizer", "bytes", "--quiet"]) == 0
    assert f"taking over the lock of pid {first.pid}" in capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert [source["path"] for source in meta["sources"]] == [str(tmp_path / "second.txt")]
    assert sorted(q.name for q in tmp_path.iterdir()) == ["data", "first.txt", "paused", "second.txt"]


# A prepare whose tokenizing is slow (0.3 s a batch of 2,000 characters, in whichever process
# encodes it) and says when it has started: argv[1] is the file it creates then, the rest prepare's.
PREPARE_SLOWLY = """
import importlib, pathlib, sys, time
prepare_module = importlib.import_module("diff_transformer.data.prepare")
prepare_module.ENCODE_BATCH_CHARS = 2000
encode = prepare_module.encode_texts
def slowly(*args):
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(0.3)
    return encode(*args)
prepare_module.encode_texts = slowly  # the workers are forked after this: theirs too
from diff_transformer.cli import main
sys.exit(main(sys.argv[2:]))
"""


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # a subprocess each (its imports: several seconds on a shared machine)
@pytest.mark.parametrize("signum, workers", [(signal.SIGTERM, 2), (signal.SIGINT, 2), (signal.SIGTERM, 1),
                                             (signal.SIGINT, 1)],
                         ids=["SIGTERM-2-workers", "SIGINT-2-workers", "SIGTERM-1-worker", "SIGINT-1-worker"])
def test_prepare_stops_on_a_signal_with_its_workers_ended_and_nothing_left(signum, workers, tmp_path):
    """Issue 43: `prepare --workers 2` and SIGTERM to its pid left .NAME.lock and a .NAME.tmp-*
    folder, and two orphaned workers printing BrokenPipeError tracebacks. A real signal to a real
    process, mid-tokenizing: exit 128 + signal, one line saying so, no traceback, every worker
    ended, nothing beside --out, the input as it was."""
    (tmp_path / "in").mkdir()
    text = "".join(text for _, text in corpus_documents()[:3])
    for i in range(60):  # 60 documents of 2,500 characters: a batch each, 9 s of tokenizing in 2 processes
        (tmp_path / "in" / f"{i:02d}.txt").write_text(text[i * 2500:(i + 1) * 2500])
    before = snapshot(tmp_path / "in")
    out, started = tmp_path / "ds", tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", PREPARE_SLOWLY, str(started), "prepare", str(tmp_path / "in"),
                                "--out", str(out), "--tokenizer", "bytes", "--workers", str(workers)],
                               env=env, stderr=subprocess.PIPE, text=True)
    wait_for(started.exists, process)
    time.sleep(0.5)  # well into the tokenizing
    workers_seen = children(process.pid)
    assert len([pid for pid in workers_seen if alive(pid)]) == (workers if workers > 1 else 0)
    process.send_signal(signum)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err and "Error" not in err, err
    assert err.strip().splitlines()[-1] == (f"interrupted by {signal.Signals(signum).name}: prepare stopped, and {out} "
                                            "is as it was (nothing written)"), err
    assert [pid for pid in workers_seen if alive(pid)] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "started"]  # no dataset, lock or temporary folder
    assert snapshot(tmp_path / "in") == before


@pytest.mark.slow  # two processes at once (3 s)
def test_a_second_evaluation_into_the_same_output_is_refused_naming_the_first(tmp_path, capsys):
    """Two `eval` commands into one --out at once: the second (even another evaluation, even with
    --overwrite) is refused with the first one's pid before any model loads, and writes nothing."""
    from diff_transformer.config import ModelConfig
    from diff_transformer.tokenizer import ByteTokenizer

    ckpt = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(tmp_path / "ckpt",
                                                                                           ByteTokenizer())
    out = tmp_path / "eval"
    marker = tmp_path / "paused"
    first = _start_paused(["eval", "outliers", "--checkpoint", str(ckpt), "--out", str(out), "--quick",
                           "--no-progress"], marker, pause="diff_transformer.cli.evaluate:_load")
    try:
        before = snapshot(tmp_path)
        for argv in (["outliers", "--overwrite"], ["ar-hit"]):
            assert main(["eval", argv[0], "--checkpoint", str(ckpt), "--out", str(out), "--quick", "--no-progress",
                         *argv[1:]]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(
                f"error: {out}: in use by another diff-transformer process (pid {first.pid} on "), err
        assert snapshot(tmp_path) == before and not out.exists()
    finally:
        first.kill()
        first.communicate(timeout=30)


@pytest.mark.slow  # two processes at once (3 s)
def test_a_second_tokenizer_training_to_the_same_file_is_refused_naming_the_first(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("Some text to tokenize, and some more text to tokenize.\n" * 40)
    out = tmp_path / "tok.json"
    marker = tmp_path / "paused"
    argv = ["tokenizer", "train", "--input", str(text), "--out", str(out), "--vocab-size", "260"]
    first = _start_paused(argv, marker, pause="diff_transformer.data.bpe:train_bpe")
    try:
        before = snapshot(tmp_path)
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"error: {out}: in use by another diff-transformer process (pid {first.pid} on "), err
        assert snapshot(tmp_path) == before and not out.exists()
    finally:
        first.kill()
        first.communicate(timeout=30)
