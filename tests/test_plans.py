"""The whole plan checked before any work, and no study replaces another.

- The suite's cache is its own: a fresh machine is the test machine (conftest.py).
- Every command and study refuses a setting it cannot run before it tokenizes the corpus (the cache
  stays empty), imports or trains anything, and a refused ``train`` creates no run.out_dir.
- ``compare --out DIR`` into a folder holding a study: refused without ``--resume`` / ``--overwrite``;
  ``--resume`` only for the same study (the field that differs named); ``--overwrite`` replaces it as a
  whole (moved aside, deleted once the new one completes; kept whole if it does not), never deleting a
  file no study writes.
- SIGINT / SIGTERM end ``train`` and ``compare`` with 130 / 143, one line each, no traceback, whatever
  the process (or the study's child) is doing: real processes, real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from diff_transformer.cli import main
from diff_transformer.data import prepare
from diff_transformer.experiments import compare
from diff_transformer.experiments.output import aside_path, foreign_study_entries, study_differences
from diff_transformer.files import CACHE_ENV
from diff_transformer.train.config import shipped_configs
from test_resume import snapshot
from test_train import byte_dataset, debug_data, debug_experiment  # noqa: F401  (byte_dataset is a fixture)

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


# --- a fresh machine is the test machine -----------------------------------------------------------


def test_the_suite_builds_its_cache_in_a_folder_of_its_own():
    """conftest.py points DIFF_TRANSFORMER_CACHE at a folder made for the session (unless the caller
    named one): nothing from ~/.cache is read, nothing is written there."""
    folder = Path(os.environ[CACHE_ENV])
    assert folder.is_dir() and folder != Path.home() / ".cache" / "diff-transformer"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """An empty cache: the embedded corpus is not tokenized yet, as on a fresh machine."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cache


# --- the whole plan before any work ------------------------------------------------------------------


@pytest.mark.parametrize("setting, refusal", [
    ("models.diff.scale_residual_init=false",
     "models.diff.scale_residual_init=False disagrees with init recipe 'scaled-init'"),
    ("run.attn_backend=decode", "run.attn_backend=decode takes one query per sequence"),
], ids=["pinned-recipe-field", "backend-of-a-later-model"])
def test_a_contradiction_in_the_config_is_refused_before_the_corpus_is_tokenized(setting, refusal, empty_cache,
                                                                                 tmp_path, capsys):
    """The issue's case: the Transformer's runs come first, and their data check tokenized the corpus
    (13 s) before DIFF's config was built and refused; so for a backend DIFF's runs cannot take (the
    Transformer's can): every run's settings are checked before any run's data."""
    line = one_error_line(capsys, "compare", "--set", setting, "--out", str(tmp_path / "cmp"))
    assert refusal in line
    assert list(empty_cache.iterdir()) == [] and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_study_refuses_a_setting_it_cannot_run_before_any_work(name, empty_cache, tmp_path, capsys):
    """run.attn_backend=flex trains on CUDA only: every study (the comparison, long context, scaling,
    conversion; their -gpu and paper sizes) refuses it, or an input it cannot read (the pretrained
    studies, which train nothing, their missing checkpoints), with nothing tokenized and no output folder."""
    line = one_error_line(capsys, "compare", "--config", name, "--set", "run.attn_backend=flex", "--set",
                          "run.device=cpu", "--out", str(tmp_path / "cmp"))
    assert any(refusal in line for refusal in ("run.attn_backend=flex trains on CUDA only", "convert.source",
                                                "pretrained.models.diff.checkpoint", "pretrained.device=cuda")), line
    assert list(empty_cache.iterdir()) == [] and not (tmp_path / "cmp").exists()


def test_train_refuses_before_the_corpus_and_creates_nothing(empty_cache, tmp_path, capsys):
    line = one_error_line(capsys, "train", "--model", "diff", "--set", "run.attn_backend=flex", "--set",
                          "run.device=cpu", "--set", f"run.out_dir={tmp_path / 'run'}")
    assert "run.attn_backend=flex trains on CUDA only" in line
    assert list(empty_cache.iterdir()) == [] and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def short_train_split(tmp_path_factory) -> Path:
    """A dataset whose train split holds 20 tokens and validation split about 300."""
    root = tmp_path_factory.mktemp("short-train")
    (root / "text.txt").write_text("the cat sat on the mat and looked at the sea " * 7)
    prepare([root / "text.txt"], root / "data", tokenizer="bytes", val_fraction=0.94, seed=0, progress=False)
    return root / "data"


def test_train_refused_for_a_train_split_too_short_creates_no_run_directory(short_train_split, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(debug_data(short_train_split, tmp_path / "run")))
    line = one_error_line(capsys, "train", "--config", str(config))
    assert "the train split of" in line and "too few for one window of seq_len 32" in line
    assert not (tmp_path / "run").exists()


def test_a_mixture_task_whose_examples_do_not_fit_is_refused_by_name(byte_dataset, tmp_path, capsys):  # noqa: F811
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(debug_data(byte_dataset, tmp_path / "run", data={"mix": {"needle": 0.1}})))
    line = one_error_line(capsys, "train", "--config", str(config))
    assert line.startswith("error: data.mix: the 'needle' task at data.seq_len=32: generated example of ")
    assert "raise data.seq_len or take 'needle' out of data.mix" in line and not (tmp_path / "run").exists()


# --- no study replaces another: refusals (a study's folder as compare leaves it) ------------------------


def fake_study(out: Path, record: dict) -> dict[str, str]:
    """A folder as a finished comparison leaves it (marker, config.yaml, a report, a run); its snapshot."""
    run = out / "runs" / "diff" / "lr-0.003" / "seed-0"
    (run / "checkpoint").mkdir(parents=True)
    (out / ".diff-transformer").write_text('{"kind": "compare"}\n')
    (out / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    (out / "report.md").write_text("# the earlier study\n")
    (out / "metrics.json").write_text("{}\n")
    (run / ".diff-transformer").write_text('{"kind": "train-run"}\n')
    (run / "summary.json").write_text("{}\n")
    (run / "checkpoint" / "config.json").write_text('{"format": "diff-transformer"}\n')
    (run / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    return snapshot(out)


def study_config(dataset: Path, tmp_path: Path, **sections):
    return debug_experiment(dataset, tmp_path / "unused", models={"diff": {"attention": "diff"}},
                            run={"steps": 1, "eval_every": 1}, compare={"seeds": 1, "evaluations": []}, **sections)


def record_of(config) -> dict:
    from diff_transformer.experiments.comparison import study_record

    return study_record(config, names=["diff"], seeds=1, lr_grid=[], jobs=1, retrieval=False)


def test_a_second_study_into_a_study_folder_is_refused_and_changes_nothing(byte_dataset, tmp_path, capsys):  # noqa: F811
    """The issue's data loss: another optim.lr into a finished comparison replaced its report, metrics,
    config and checkpoints. Now refused, naming the folder and both options; every file as it was."""
    config = study_config(byte_dataset, tmp_path)
    out = tmp_path / "cmp"
    before = fake_study(out, record_of(config))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(debug_data(byte_dataset, tmp_path / "unused", models={"diff": {"attention": "diff"}},
                                              run={"steps": 1, "eval_every": 1},
                                              compare={"seeds": 1, "evaluations": []})))
    line = one_error_line(capsys, "compare", "--config", str(path), "--no-retrieval", "--set", "optim.lr=1e-3",
                          "--out", str(out))
    assert line == (f"error: {out}: already holds a diff-transformer comparison; pass --resume to continue that "
                    "study, or --overwrite to replace it (or choose another --out)")
    line = one_error_line(capsys, "compare", "--config", str(path), "--no-retrieval", "--set", "optim.lr=1e-3",
                          "--out", str(out), "--resume")
    assert line.startswith(f"error: {out}: --resume continues the study it holds, and this one differs: "
                           "optim.lr: 0.003 -> 0.001")
    (out / "notes.txt").write_text("mine")
    line = one_error_line(capsys, "compare", "--config", str(path), "--no-retrieval", "--out", str(out),
                          "--overwrite")
    assert "also notes.txt, which no study writes and --overwrite would delete with it" in line
    (out / "notes.txt").unlink()
    line = one_error_line(capsys, "compare", "--config", str(path), "--out", str(out), "--resume", "--overwrite")
    assert "give one of them" in line
    assert snapshot(out) == before and not aside_path(out).exists()


def test_resume_compares_the_study_field_by_field():
    before = {"name": "a", "optim": {"lr": 0.003, "recipe": None},
              "compare": {"jobs": 2, "seeds": 3, "evaluations": []},
              "run": {"steps": 4, "progress": True, "device": "cpu", "seed": 0},
              "models": {"diff": {"attention": "diff", "label": "DIFF", "optim": {"lr": 0.003}}}}
    now = json.loads(json.dumps(before))
    now.update(name="b")
    now["compare"].update(jobs=1, evaluations=["outliers"])  # how many at once, the evaluations: may change
    now["run"].update(progress=False, device="cuda")
    now["models"]["diff"]["label"] = "DIFF {n_heads}×{head_dim}"
    assert study_differences(before, now) == []
    now["compare"]["seeds"] = 2
    now["run"]["seed"] = 1
    del now["models"]["diff"]["optim"]
    now["data"] = {"seq_len": 64}
    assert study_differences(before, now) == ["compare.seeds: 3 -> 2", "run.seed: 0 -> 1", "data.seq_len: unset -> 64",
                                              "models.diff.optim.lr: 0.003 -> unset"]


def test_overwrite_deletes_only_what_a_study_writes(tmp_path):
    out = tmp_path / "cmp"
    fake_study(out, {})
    assert foreign_study_entries(out) == []
    (out / "runs" / "diff" / "notes.txt").write_text("mine")
    (out / "runs" / "diff" / "lr-0.003" / "seed-0" / "checkpoint" / "export.bin").write_bytes(b"x")
    (out / "link").symlink_to(tmp_path)
    assert foreign_study_entries(out) == ["link", "runs/diff/lr-0.003/seed-0/checkpoint/export.bin",
                                          "runs/diff/notes.txt"]


# --- no study replaces another: real studies --------------------------------------------------------------


@pytest.mark.slow  # three small comparisons (one run each, in its own process)
def test_resume_continues_the_same_study_and_overwrite_replaces_it_whole(byte_dataset, tmp_path, capsys):  # noqa: F811
    config = study_config(byte_dataset, tmp_path)
    out = tmp_path / "cmp"
    compare(config, out, retrieval=False, progress=False)
    weights = out / "runs" / "diff" / "lr-0.003" / "seed-0" / "checkpoint" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    compare(config, out, retrieval=False, resume=True, progress=False)  # the same study: its run reused
    assert weights.stat().st_mtime_ns == stamp
    first = snapshot(out)

    # --overwrite that stops before it completes: the earlier study kept whole beside it
    other = study_config(byte_dataset, tmp_path, optim={"lr": 1e-3, "min_lr": 1e-4})

    def stop(checkpoints, folder):
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        compare(other, out, retrieval=False, overwrite=True, evaluation=stop, progress=False)
    aside = aside_path(out)
    assert snapshot(aside) == first and (out / "runs" / "diff" / "lr-0.001" / "seed-0").is_dir()
    assert "kept in" in capsys.readouterr().err
    # --resume completes the replacement, and only then is the earlier study deleted
    compare(other, out, retrieval=False, resume=True, progress=False)
    assert not aside.exists() and not (out / "runs" / "diff" / "lr-0.003").exists()
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["lr"] == 1e-3

    compare(config, out, retrieval=False, overwrite=True, progress=False)  # a whole replacement
    assert not aside.exists() and not (out / "runs" / "diff" / "lr-0.001").exists()
    assert (out / "runs" / "diff" / "lr-0.003" / "seed-0" / "summary.json").is_file()


# --- interrupts: real processes, real signals --------------------------------------------------------------


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "diff_transformer", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for(process: subprocess.Popen, text: str, seen: list[str], limit: float = 120.0) -> None:
    """Read the process's stderr until a line holds ``text``."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            raise AssertionError(f"ended before {text!r}: {''.join(seen)}")
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"no {text!r} within {limit} s: {''.join(seen)}")


def stopped(process: subprocess.Popen, signum: int, seen: list[str]) -> tuple[int, list[str]]:
    process.send_signal(signum)
    rest = process.communicate(timeout=180)[1]
    lines = [line for line in "".join(seen + [rest]).splitlines() if line.strip()]
    assert not any("Traceback" in line or line.startswith("error:") for line in lines), "\n".join(lines)
    return process.returncode, lines


@pytest.mark.slow  # real processes: torch starts in each
@pytest.mark.parametrize("moment, signum", [(0.3, signal.SIGINT), (1.0, signal.SIGTERM), ("training", signal.SIGINT),
                                            ("training", signal.SIGTERM)])
def test_train_stopped_at_any_moment_exits_128_plus_the_signal_with_one_line(moment, signum, byte_dataset,  # noqa: F811
                                                                            tmp_path):
    """While Python and torch start (a signal is held until torch has loaded: raised in its C++
    import it aborts the process), while it checks, and in the loop (which saves a checkpoint)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(debug_data(byte_dataset, tmp_path / "run", run={"steps": 10_000, "progress": True,
                                                                                     "eval_every": 10_000})))
    process = start(["train", "--config", str(config)], tmp_path)
    seen: list[str] = []
    if moment == "training":
        wait_for(process, "step/s", seen)
    else:
        time.sleep(moment)
    code, lines = stopped(process, signum, seen)
    name = signal.Signals(signum).name
    assert code == 128 + signum, lines
    if moment == "training":
        assert lines[-1].startswith(f"{name} received") or "--resume" in lines[-1], lines
    else:
        assert lines[-1] == f"interrupted by {name}: the run stopped without saving a checkpoint (its last one, " \
                            "if any, is intact)", lines


@pytest.mark.slow  # real processes: a study and its runs
@pytest.mark.parametrize("moment, signum", [(0.5, signal.SIGINT), ("child starting", signal.SIGINT),
                                            ("child starting", signal.SIGTERM), ("children training", signal.SIGTERM),
                                            ("children training", signal.SIGHUP)])
def test_compare_stopped_at_any_moment_exits_128_plus_the_signal_with_the_resume_hint(moment, signum,
                                                                                      byte_dataset,  # noqa: F811
                                                                                      tmp_path):
    """While compare starts; while its first run's process is still importing torch (the issue's
    case: that child died with a traceback and compare exited 2); while two runs train."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signum == signal.SIGHUP:
        pytest.skip("SIGHUP is ignored here (nohup), and so in the study this test starts")
    config = tmp_path / "config.yaml"
    models = {"standard": {"attention": "standard"}, "diff": {"attention": "diff"}}
    config.write_text(yaml.safe_dump(debug_data(
        byte_dataset, tmp_path / "unused", models=models,
        run={"steps": 10_000, "eval_every": 10_000}, compare={"seeds": 1, "evaluations": [], "jobs": 2})))
    process = start(["compare", "--config", str(config), "--no-retrieval", "--out", str(tmp_path / "cmp")], tmp_path)
    seen: list[str] = []
    if moment == "child starting":
        wait_for(process, "2 runs, 2 at a time", seen)
    elif moment == "children training":  # both runs have logged a step
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "cmp" / "runs").glob("*/*/seed-0/metrics.jsonl"))) < 2:
            assert time.monotonic() < deadline and process.poll() is None, "the runs did not start"
            time.sleep(0.1)
    else:
        time.sleep(moment)
    code, lines = stopped(process, signum, seen)
    name = signal.Signals(signum).name
    assert code == 128 + signum, lines
    assert lines[-1].startswith(f"interrupted by {name}") and "--resume" in lines[-1], lines
    said = [line for line in lines if "received: saving" in line or "stopped at step" in line or "interrupted" in line]
    assert said == [lines[-1]], lines  # one line, as the README says: not one more per running run


# --- other commands: what is read from config.json alone is checked before the weights ----------------------


@pytest.fixture
def unreadable_weights(tmp_path):
    """Checkpoints whose weights file is damaged: a refusal that config.json decides must come first."""
    from diff_transformer import LanguageModel, ModelConfig

    made = {}
    for name, attention in (("diff_v2", "diff_v2"), ("no-tokenizer", "diff")):
        LanguageModel(ModelConfig.from_preset("debug", attention=attention)).save_pretrained(tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(b"damaged")
        made[name] = tmp_path / name
    return made


def test_export_hf_refuses_a_layout_the_model_lacks_before_reading_the_weights(unreadable_weights, tmp_path,
                                                                                capsys):
    line = one_error_line(capsys, "export-hf", str(unreadable_weights["diff_v2"]), str(tmp_path / "hf"), "--layout",
                          "motif")
    assert "--layout motif: this model has attention='diff_v2'" in line and not (tmp_path / "hf").exists()


def test_generate_refuses_a_checkpoint_without_a_tokenizer_before_reading_the_weights(unreadable_weights, capsys):
    line = one_error_line(capsys, "generate", str(unreadable_weights["no-tokenizer"]), "--prompt", "Hello")
    assert line.endswith("holds no tokenizer; pass --tokenizer")
