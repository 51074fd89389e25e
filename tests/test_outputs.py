"""No output replaces what the project did not write: every writer of a directory refuses a file,
a non-empty directory of other files, the current directory or an ancestor, and the source it
reads; an earlier output of the project is replaced only when asked (--overwrite). After every
refusal the user's files are checked byte for byte."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from diff_transformer.cli import main
from diff_transformer.config import ModelConfig
from diff_transformer.files import OutputPathError, check_output_dir, claim_output_dir, project_output_kind
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer

from test_train import byte_dataset, debug_config  # noqa: F401  (fixture)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) with its SHA-256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def user_dir(tmp_path) -> Path:
    """A directory of the user's own files."""
    directory = tmp_path / "mine"
    (directory / "notes").mkdir(parents=True)
    (directory / "thesis.tex").write_text("\\section{Results}\n")
    (directory / "notes" / "todo.txt").write_text("everything\n")
    return directory


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(
        tmp_path / "ckpt", ByteTokenizer())


def refused(capsys, argv: list[str], message: str) -> None:
    """The command ends with exit status 2 and one error line containing ``message``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err


# --- the rule ---------------------------------------------------------------------------------


def test_check_output_dir_refuses_what_the_project_did_not_write(tmp_path, user_dir, monkeypatch):
    (tmp_path / "work" / "here").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "here")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="an existing file"):
        check_output_dir(tmp_path / "file", "checkpoint")
    with pytest.raises(OutputPathError, match="the current directory; "):
        check_output_dir(".", "checkpoint")
    with pytest.raises(OutputPathError, match="the current directory or one containing it"):
        check_output_dir(tmp_path / "work", "checkpoint")
    with pytest.raises(OutputPathError, match="which this command reads"):
        check_output_dir(tmp_path / "src", "hf-export", reading=[tmp_path / "src" / "ckpt"])
    with pytest.raises(OutputPathError, match=r"did not write \(it holds notes, thesis\.tex\)"):
        check_output_dir(user_dir / "notes" / "..", "checkpoint", overwrite=True)
    assert check_output_dir(tmp_path / "new", "checkpoint") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", "checkpoint") == tmp_path / "empty"


def test_an_output_of_the_project_is_replaced_only_when_asked(tmp_path, ckpt):
    assert project_output_kind(ckpt) == "checkpoint"
    with pytest.raises(OutputPathError, match="already holds a diff-transformer checkpoint; pass --overwrite"):
        check_output_dir(ckpt, "checkpoint")
    with pytest.raises(OutputPathError, match="holds a diff-transformer checkpoint, not a Hugging Face export"):
        check_output_dir(ckpt, "hf-export", overwrite=True)
    assert check_output_dir(ckpt, "checkpoint", overwrite=True) == ckpt
    runs = claim_output_dir(tmp_path / "runs", "eval")
    assert project_output_kind(runs) == "eval"
    (runs / "result.json").write_text("{}")
    assert claim_output_dir(runs, "eval") == runs  # filled file by file: reused


# --- save_pretrained ----------------------------------------------------------------------------


def test_save_pretrained_never_replaces_the_users_files(tmp_path, user_dir, monkeypatch):
    model = LanguageModel(ModelConfig.from_preset("debug"))
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match="did not write"):
        model.save_pretrained(user_dir)
    with pytest.raises(OutputPathError, match="did not write"):
        model.save_pretrained(user_dir, overwrite=True)
    monkeypatch.chdir(user_dir)
    with pytest.raises(OutputPathError, match="the current directory"):
        model.save_pretrained(".")
    with pytest.raises(OutputPathError, match="the current directory or one containing it"):
        model.save_pretrained("..", overwrite=True)
    assert snapshot(tmp_path) == before


def test_save_pretrained_replaces_a_checkpoint_only_with_overwrite(ckpt):
    other = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    before = snapshot(ckpt)
    with pytest.raises(OutputPathError, match="already holds a diff-transformer checkpoint"):
        other.save_pretrained(ckpt)
    assert snapshot(ckpt) == before
    other.save_pretrained(ckpt, overwrite=True)
    assert LanguageModel.from_pretrained(ckpt).embed.weight.equal(other.embed.weight)


# --- export-hf / import-hf ----------------------------------------------------------------------


@pytest.fixture
def hf():
    return pytest.importorskip("transformers")


def test_export_hf_into_a_directory_of_other_files_is_refused(capsys, hf, ckpt, user_dir):
    before = snapshot(user_dir)
    refused(capsys, ["export-hf", str(ckpt), str(user_dir)],
            "a non-empty directory that diff-transformer did not write")
    refused(capsys, ["export-hf", str(ckpt), str(user_dir), "--overwrite"], "did not write")
    assert snapshot(user_dir) == before


def test_export_hf_onto_its_own_checkpoint_or_run_is_refused(capsys, hf, ckpt, tmp_path):
    before = snapshot(tmp_path)
    refused(capsys, ["export-hf", str(ckpt), str(ckpt), "--overwrite"], f"{ckpt}, which this command reads")
    refused(capsys, ["export-hf", str(ckpt), str(tmp_path)], "contains")
    assert snapshot(tmp_path) == before
    LanguageModel.from_pretrained(ckpt)  # still a checkpoint of this project


def test_export_hf_onto_a_file_is_refused(capsys, hf, ckpt, tmp_path):
    (tmp_path / "out.txt").write_text("mine")
    refused(capsys, ["export-hf", str(ckpt), str(tmp_path / "out.txt")],
            "an output directory is needed, this is a file")
    assert (tmp_path / "out.txt").read_text() == "mine"


def test_export_hf_replaces_its_own_export_with_overwrite(capsys, hf, ckpt, tmp_path):
    out = tmp_path / "hf"
    assert main(["export-hf", str(ckpt), str(out)]) == 0
    assert project_output_kind(out) == "hf-export"
    refused(capsys, ["export-hf", str(ckpt), str(out)],
            "already holds a diff-transformer Hugging Face export; pass --overwrite")
    assert main(["export-hf", str(ckpt), str(out), "--overwrite"]) == 0
    hf.AutoModelForCausalLM.from_pretrained(str(out))


def test_import_hf_never_replaces_its_source_or_other_files(capsys, hf, ckpt, tmp_path, user_dir):
    out = tmp_path / "hf"
    assert main(["export-hf", str(ckpt), str(out)]) == 0
    before = snapshot(tmp_path)
    refused(capsys, ["import-hf", str(out), str(out), "--overwrite"], "which this command reads")
    refused(capsys, ["import-hf", str(out), str(user_dir)], "did not write")
    refused(capsys, ["import-hf", str(out), str(ckpt)], "already holds a diff-transformer checkpoint; pass --overwrite")
    assert snapshot(tmp_path) == before
    assert main(["import-hf", str(out), str(ckpt), "--overwrite"]) == 0


# --- prepare, train, compare, eval ----------------------------------------------------------------


def test_prepare_overwrite_never_replaces_the_users_files(capsys, tmp_path, user_dir):
    (tmp_path / "text.txt").write_text("Some text to tokenize.\n" * 50)
    before = snapshot(user_dir)
    refused(capsys, ["prepare", str(tmp_path / "text.txt"), "--out", str(user_dir), "--tokenizer", "bytes",
                     "--overwrite"], "did not write")
    refused(capsys, ["prepare", str(user_dir), "--out", str(user_dir), "--tokenizer", "bytes", "--overwrite"],
            "which this command reads")
    assert snapshot(user_dir) == before


def test_tokenizer_train_overwrite_replaces_only_a_tokenizer(capsys, tmp_path, user_dir):
    text = tmp_path / "text.txt"
    text.write_text("Some text to tokenize, and some more text to tokenize.\n" * 40)
    before = snapshot(tmp_path)
    for out in (user_dir / "thesis.tex", text):
        refused(capsys, ["tokenizer", "train", "--input", str(text), "--out", str(out), "--vocab-size", "260",
                         "--overwrite"], f"{out}: not a tokenizers JSON file, which is all --overwrite replaces")
    assert snapshot(tmp_path) == before
    out = tmp_path / "tok.json"
    argv = ["tokenizer", "train", "--input", str(text), "--out", str(out), "--vocab-size", "260"]
    assert main(argv) == 0
    refused(capsys, argv, f"{out} already exists; pass --overwrite")
    assert main([*argv, "--overwrite"]) == 0  # a tokenizer: replaced when asked


def _write_config(tmp_path: Path, dataset: Path, **run) -> Path:
    config = debug_config(dataset, tmp_path / "run")
    data = config.to_dict()
    data["run"].update(steps=2, eval_every=2, **run)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_train_never_replaces_the_users_files(capsys, byte_dataset, tmp_path, user_dir):  # noqa: F811
    (tmp_path / "ckpt-file").write_text("mine")
    config = _write_config(tmp_path, byte_dataset)
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--config", str(config), "--set", f"run.checkpoint_dir={user_dir}"], "did not write")
    refused(capsys, ["train", "--config", str(config), "--set", f"run.checkpoint_dir={tmp_path / 'ckpt-file'}"],
            "an existing file")
    refused(capsys, ["train", "--config", str(config), "--set", f"run.out_dir={user_dir}"], "did not write")
    refused(capsys, ["train", "--config", str(config), "--set", f"run.checkpoint_dir={byte_dataset}"],
            "which this command reads")
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()  # not even the run directory


def test_the_checkpoint_directory_is_never_the_run_directory_or_one_containing_it(capsys, byte_dataset,  # noqa: F811
                                                                                 tmp_path):
    """Every save replaces run.checkpoint_dir as a whole: run.out_dir (its logs) or a directory
    containing it is refused before anything is created."""
    config = _write_config(tmp_path, byte_dataset)
    before = snapshot(tmp_path)
    for directory in (tmp_path / "run", tmp_path):
        refused(capsys, ["train", "--config", str(config), "--set", f"run.checkpoint_dir={directory}"],
                f"run.checkpoint_dir: {directory} is run.out_dir {tmp_path / 'run'} or contains it")
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_compare_and_eval_never_fill_a_directory_of_other_files(capsys, ckpt, user_dir):
    before = snapshot(user_dir)
    refused(capsys, ["compare", "--out", str(user_dir), "--steps", "1"], "did not write")
    refused(capsys, ["eval", "outliers", "--checkpoint", str(ckpt), "--out", str(user_dir), "--quick"], "did not write")
    refused(capsys, ["eval", "outliers", "--checkpoint", str(ckpt), "--out", str(ckpt), "--quick"],
            "which this command reads")
    assert snapshot(user_dir) == before


def test_the_gpu_benchmark_report_never_fills_a_directory_of_other_files(user_dir, tmp_path):
    from diff_transformer.bench.gpu import write_report

    (user_dir / "gpu_bench.md").write_text("my own notes on the GPU\n")
    before = snapshot(user_dir)
    with pytest.raises(OutputPathError, match="did not write"):
        write_report(user_dir, {})
    assert snapshot(user_dir) == before
    out = claim_output_dir(tmp_path / "bench", "bench")  # an earlier report's directory is reused
    assert project_output_kind(out) == "bench"


# --- an output replaced as a whole never takes the user's files with it --------------------------


def test_an_output_holding_files_it_does_not_own_is_never_replaced(capsys, hf, ckpt, tmp_path):
    """A checkpoint, an export or a dataset into which the user put files of their own (notes, an
    export made inside a checkpoint) is refused even with --overwrite: replacing it would delete them."""
    export = tmp_path / "hf"
    assert main(["export-hf", str(ckpt), str(export)]) == 0
    shutil.copytree(ckpt, export / "back")  # the user's copy of a checkpoint put inside the export
    (tmp_path / "text.txt").write_text("Some text to tokenize.\n" * 50)
    data = tmp_path / "data"
    assert main(["prepare", str(tmp_path / "text.txt"), "--out", str(data), "--tokenizer", "bytes"]) == 0
    capsys.readouterr()
    (ckpt / "NOTES.md").write_text("what I tried\n")
    (data / "sources").mkdir()
    (data / "sources" / "raw.txt").write_text("the raw text\n")
    before = snapshot(tmp_path)
    refused(capsys, ["import-hf", str(export), str(ckpt), "--overwrite"],
            f"{ckpt}: holds a diff-transformer checkpoint and also NOTES.md, which are not part of it")
    refused(capsys, ["export-hf", str(ckpt), str(export), "--overwrite"],
            f"{export}: holds a diff-transformer Hugging Face export and also back, which are not part of it")
    refused(capsys, ["prepare", str(tmp_path / "text.txt"), "--out", str(data), "--tokenizer", "bytes", "--overwrite"],
            f"{data}: holds a diff-transformer dataset and also sources, which are not part of it")
    with pytest.raises(OutputPathError, match="also NOTES.md, which are not part of it"):
        LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(ckpt, overwrite=True)
    assert snapshot(tmp_path) == before
    (ckpt / "NOTES.md").unlink()  # the project's files alone: replaced when asked
    assert main(["import-hf", str(export), str(ckpt), "--overwrite"]) == 0


def test_training_never_deletes_files_put_into_its_checkpoint_directory(capsys, byte_dataset, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """Every save replaces the checkpoint directory: a file of the user's there is refused when the
    run resumes, and when it appears during a run the save is refused and the step named, with the
    file and the previous checkpoint intact."""
    from diff_transformer.train import trainer as trainer_module

    config = _write_config(tmp_path, byte_dataset, stop_at_step=1)
    assert main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    checkpoint = tmp_path / "run" / "checkpoint"
    (checkpoint / "NOTES.md").write_text("what I tried\n")
    before = snapshot(tmp_path / "run")
    refused(capsys, ["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=null"],
            f"{checkpoint}: holds a diff-transformer checkpoint and also NOTES.md, which are not part of it")
    assert snapshot(tmp_path / "run") == before
    (checkpoint / "NOTES.md").unlink()

    real = trainer_module.save_training_checkpoint

    def save_after_a_note(directory, *args, **kwargs):  # the user writes into it while the run goes on
        (Path(directory) / "NOTES.md").write_text("what I tried\n")
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "save_training_checkpoint", save_after_a_note)
    assert main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: step 2: could not write the checkpoint to {checkpoint} ({checkpoint}: holds a "
                              "diff-transformer checkpoint and also NOTES.md") and err[-1].endswith(
        f"the previous checkpoint {checkpoint} (step 1) is intact"), err
    assert (checkpoint / "NOTES.md").read_text() == "what I tried\n"
    LanguageModel.from_pretrained(checkpoint)


@pytest.mark.slow  # trains twice (3 s)
def test_a_new_run_never_replaces_the_logs_of_an_earlier_one(capsys, byte_dataset, tmp_path):  # noqa: F811
    """An earlier run's metrics.jsonl and summary.json are results: a new run into the same
    run.out_dir (its checkpoint elsewhere, or the earlier run ended before its first checkpoint)
    is refused with the files intact; --resume continues the earlier run as before."""
    config = _write_config(tmp_path, byte_dataset, checkpoint_dir=str(tmp_path / "first"))
    assert main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path / "run")
    refused(capsys, ["train", "--config", str(config), "--set", f"run.checkpoint_dir={tmp_path / 'second'}"],
            f"{tmp_path / 'run'} holds the logs of an earlier run (metrics.jsonl, summary.json), and there is no "
            f"checkpoint of it in {tmp_path / 'second'} to resume")
    assert snapshot(tmp_path / "run") == before and not (tmp_path / "second").exists()
    (tmp_path / "run" / "summary.json").unlink()  # a run killed before its first checkpoint: its metrics alone
    refused(capsys, ["train", "--config", str(config), "--set", f"run.checkpoint_dir={tmp_path / 'second'}"],
            "holds the logs of an earlier run (metrics.jsonl), and there is no checkpoint")
    assert main(["train", "--config", str(config), "--resume"]) == 0


# --- a training checkpoint is replaced only by its own run ----------------------------------------


HOLDER = """
import pathlib, sys, time
from diff_transformer.files import lock_output_dir
lock = lock_output_dir(sys.argv[1])
pathlib.Path(sys.argv[2]).write_text("locked")
time.sleep(120)
"""


def test_a_training_checkpoint_is_never_replaced_by_a_weights_only_write(capsys, hf, byte_dataset,  # noqa: F811
                                                                          tmp_path):
    """save_pretrained, import-hf and export-hf onto a run's checkpoint (or onto the ``.old`` version
    an interrupted save left) are refused, --overwrite or not, naming the training state; nothing is
    written inside a checkpoint; the run itself still replaces its checkpoint when resumed."""
    config = _write_config(tmp_path, byte_dataset, stop_at_step=1)
    assert main(["train", "--config", str(config)]) == 0
    checkpoint = tmp_path / "run" / "checkpoint"
    export = tmp_path / "hf"
    assert main(["export-hf", str(checkpoint), str(export)]) == 0  # reading a training checkpoint is fine
    capsys.readouterr()
    state = f"{checkpoint}: holds the training state of a run (training_state.pt), which only that run replaces"
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=re.escape(state)):
        LanguageModel.from_pretrained(checkpoint).save_pretrained(checkpoint, overwrite=True)
    for overwrite in ([], ["--overwrite"]):
        refused(capsys, ["import-hf", str(export), str(checkpoint), *overwrite], state)
        refused(capsys, ["export-hf", str(checkpoint), str(checkpoint), *overwrite], "which this command reads")
        refused(capsys, ["export-hf", str(checkpoint), str(checkpoint / "hf"), *overwrite],
                f"{checkpoint / 'hf'}: inside {checkpoint}, a diff-transformer checkpoint, which is written as a whole")
    assert snapshot(tmp_path) == before

    old = checkpoint.with_name(".checkpoint.old")  # a save interrupted between its two renames
    checkpoint.rename(old)
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=re.escape(f"{checkpoint}: has its previous version in {old}")):
        LanguageModel.from_pretrained(old).save_pretrained(checkpoint)
    refused(capsys, ["import-hf", str(export), str(checkpoint), "--overwrite"], "which holds the training state")
    assert snapshot(tmp_path) == before

    assert main(["train", "--config", str(config), "--resume", "--set", "run.stop_at_step=null"]) == 0  # its own run
    assert not old.exists() and torch.load(checkpoint / "training_state.pt", weights_only=True)["step"] == 2


def test_nothing_is_written_inside_a_running_run_or_a_project_output(capsys, hf, ckpt, tmp_path):
    """A directory another process is training into (its lock held) takes no output, not even one
    beside its checkpoint; nor does a checkpoint, an export or a dataset take a file (a tokenizer)."""
    import subprocess
    import sys
    import time

    run = claim_output_dir(tmp_path / "run", "train-run")
    marker = tmp_path / "locked"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and holder.poll() is None:
            time.sleep(0.05)
        before = snapshot(tmp_path)
        busy = f"{run}: in use by another diff-transformer process (pid {holder.pid} on "
        refused(capsys, ["export-hf", str(ckpt), str(run / "hf")], busy)
        refused(capsys, ["eval", "outliers", "--checkpoint", str(ckpt), "--out", str(run / "eval"), "--quick"], busy)
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    assert main(["export-hf", str(ckpt), str(run / "hf")]) == 0  # once the run has ended: a new output beside its logs
    capsys.readouterr()
    text = tmp_path / "text.txt"
    text.write_text("Some text to tokenize, and some more text to tokenize.\n" * 40)
    before = snapshot(tmp_path)
    for directory in (ckpt, run / "hf"):
        refused(capsys, ["tokenizer", "train", "--input", str(text), "--out", str(directory / "tokenizer.json"),
                         "--vocab-size", "260", "--overwrite"], f"inside {directory}, a diff-transformer")
    assert snapshot(tmp_path) == before


def test_another_rank_of_the_same_torchrun_job_is_not_another_writer(tmp_path, monkeypatch):
    """Under torchrun, rank 0 locks the run and every rank checks its directories: a lock held by a
    rank of the same job (same rendezvous) is not another writer; one of another job is."""
    import subprocess
    import sys
    import time

    job = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "r1"}
    run = claim_output_dir(tmp_path / "run", "train-run")
    marker = tmp_path / "locked"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(marker)], env={**os.environ, **job})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and holder.poll() is None:
            time.sleep(0.05)
        for name, value in job.items():
            monkeypatch.setenv(name, value)
        assert check_output_dir(run / "checkpoint", "checkpoint") == run / "checkpoint"  # rank 1 of the same job
        monkeypatch.setenv("MASTER_PORT", "29512")  # another job
        with pytest.raises(OutputPathError, match=re.escape(f"{run}: in use by another diff-transformer process (pid "
                                                            f"{holder.pid} on ")):
            check_output_dir(run / "checkpoint", "checkpoint")
    finally:
        holder.kill()
        holder.wait()
