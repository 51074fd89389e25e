"""Starting a run from another checkpoint's weights (run.init_from, ``train --init-from``): a new
context length and RoPE θ are allowed, any other change of the model is refused by name; the
optimizer, schedule and step count start fresh; --resume continues such a run from its own
checkpoint; two CPU processes under torchrun start from the same weights as one."""

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from diff_transformer.cli import main
from diff_transformer.config import ModelConfig
from diff_transformer.data import corpus_documents, prepare
from diff_transformer.model import LanguageModel
from diff_transformer.train import ConfigError, load_config, train
from diff_transformer.train.distributed import Environment
from diff_transformer.train.trainer import DataPlan, _Run, check_training
from test_distributed import free_port
from test_train import byte_dataset, debug_config, losses  # noqa: F401  (byte_dataset is a fixture)


@pytest.fixture(scope="module")
def source(byte_dataset, tmp_path_factory):  # noqa: F811
    """A debug DIFF model trained 3 steps at 32 tokens, max_seq_len 128, θ 10,000."""
    out = tmp_path_factory.mktemp("source")
    result = train(debug_config(byte_dataset, out, run={"steps": 3}))
    return Path(result.checkpoint)


def extended(dataset, out, source_dir, model=None, **sections):
    """The same model with a longer context and another θ, started from ``source_dir``."""
    sections = {**sections, "run": {"init_from": str(source_dir), **sections.get("run", {})}}
    fields = {"attention": "diff", "max_seq_len": 256, "rope_theta": 40_000.0, **(model or {})}
    return debug_config(dataset, out, models={"diff": fields}, **sections)


def cpu() -> Environment:
    return Environment(0, 1, 0, torch.device("cpu"))


def test_a_run_starts_from_the_weights_with_a_fresh_optimizer_and_its_own_context(byte_dataset, source, tmp_path):  # noqa: F811
    config = extended(byte_dataset, tmp_path, source)
    with contextlib.ExitStack() as held:  # the run's directory locks, released at the end
        run = _Run.prepare(check_training(config, "diff"), cpu(), held)
    saved = LanguageModel.from_pretrained(source).state_dict()
    ours = run.raw_model.state_dict()
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)
    assert run.progress.step == 0 and not run.optimizer.state  # fresh optimizer and step count
    assert run.schedule.current_lr == pytest.approx(config.optim.lr / config.optim.warmup_steps)  # warmup restarts
    assert run.raw_model.config.max_seq_len == 256 and run.raw_model.config.rope_theta == 40_000.0
    # The RoPE table is not part of the weights: it is computed from the new θ for the new length.
    assert not [k for k in saved if "rope" in k]
    d = run.raw_model.config.head_dim
    positions = torch.arange(256, dtype=torch.float64)[:, None]
    angles = positions * 40_000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None, :]  # (256, d/2)
    table = run.raw_model._rope_table(torch.device("cpu"))
    assert table.shape == (256, d // 2, 2)
    assert torch.allclose(table[..., 0].double(), angles.cos(), atol=5e-5)  # fp32 angles up to 255 rad
    assert torch.allclose(table[..., 1].double(), angles.sin(), atol=5e-5)
    run.log.close()


@pytest.mark.parametrize("theta", [10_000.0, 40_000.0])
def test_the_first_step_scores_the_checkpoint_as_it_was_saved(byte_dataset, source, tmp_path, theta):  # noqa: F811
    """The loss of step 1 (taken before the first update) is the checkpoint's loss on that batch, with the
    longer context, at the new θ; at the old θ it is the checkpoint's own loss."""
    config = extended(byte_dataset, tmp_path, source, model={"rope_theta": theta}, data={"seq_len": 48},
                      run={"steps": 2, "eval_every": 2})
    result = train(config)
    assert result.status == "completed" and result.steps == 2 and result.tokens == 2 * 8 * 48
    assert result.init_from == str(source)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["init_from"] == str(source)

    inputs, targets = next(DataPlan(config, 48, cpu()).micro_batches(0))
    oracle = LanguageModel(ModelConfig.from_preset("debug", attention="diff", max_seq_len=256, rope_theta=theta))
    oracle.load_state_dict(LanguageModel.from_pretrained(source).state_dict())
    with torch.no_grad():
        expected = oracle(inputs, targets)[1].item()
    assert losses(tmp_path)[1] == pytest.approx(expected, abs=1e-5)
    if theta == 10_000.0:
        with torch.no_grad():
            assert LanguageModel.from_pretrained(source)(inputs, targets)[1].item() == pytest.approx(expected, abs=1e-6)


def test_a_plain_save_pretrained_checkpoint_works_too(byte_dataset, source, tmp_path):  # noqa: F811
    plain = LanguageModel.from_pretrained(source).save_pretrained(tmp_path / "plain")  # no training state, no tokenizer
    result = train(extended(byte_dataset, tmp_path / "run", plain, run={"steps": 1}))
    assert result.status == "completed"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"attention": "standard"}, "model.attention"),
        ({"n_layers": 3}, "model.n_layers"),
        ({"d_model": 128, "n_heads": 2}, "model.d_model"),
        ({"n_kv_heads": 1}, "model.n_kv_heads"),
        ({"vocab_size": 1024}, "model.vocab_size"),
        ({"ffn_hidden": 128}, "model.ffn_hidden"),
        ({"head_norm": False}, "model.head_norm"),
        ({"lambda_init": 0.8}, "model.lambda_init"),
        ({"norm_eps": 1e-6}, "model.norm_eps"),
    ],
)
def test_any_other_change_of_the_model_is_refused_by_name(byte_dataset, source, tmp_path, change, named):  # noqa: F811
    with pytest.raises(ConfigError, match=rf"run\.init_from: .*{named.replace('.', '[.]')}: .*"
                                          r"may change only max_seq_len and rope_theta"):
        train(extended(byte_dataset, tmp_path, source, model=change))
    assert not (tmp_path / "checkpoint").exists()


def test_a_missing_checkpoint_is_named_before_anything_else(tmp_path):
    config = load_config("paper-3b-64k")  # its init_from is a placeholder, and its dataset is not there either
    with pytest.raises(ConfigError,
                       match=rf"run\.init_from: {config.run.init_from} is not a checkpoint \(no such directory\)"):
        train(config, "diff")
    path = tmp_path / "config.yaml"
    data = config.to_dict()
    data["run"].update(out_dir=str(tmp_path / "out"), init_from=str(tmp_path / "nowhere"))
    path.write_text(yaml.safe_dump(data))
    assert main(["train", "--config", str(path), "--model", "diff"]) == 2


def test_the_run_may_not_write_over_the_checkpoint_it_starts_from(byte_dataset, source, tmp_path):  # noqa: F811
    copy = tmp_path / "run" / "checkpoint"
    shutil.copytree(source, copy)
    with pytest.raises(ConfigError, match="run would replace"):
        train(extended(byte_dataset, tmp_path / "run", copy))


def test_a_checkpoint_of_another_tokenizer_is_refused(byte_dataset, tmp_path):  # noqa: F811
    """The same model (vocabulary 8,192) trained on byte tokens cannot start a run on BPE tokens."""
    text = tmp_path / "text.txt"
    text.write_text(corpus_documents()[0][1][:20_000])
    prepare([text], tmp_path / "bpe", progress=False)
    wide = {"attention": "diff", "vocab_size": 8192}
    first = train(debug_config(byte_dataset, tmp_path / "bytes", models={"diff": wide}, run={"steps": 1}))
    with pytest.raises(ConfigError, match="another tokenizer"):
        train(debug_config(tmp_path / "bpe", tmp_path / "run", models={"diff": wide},
                           run={"steps": 1, "init_from": first.checkpoint}))


@pytest.mark.slow  # trains, extends and resumes
def test_resume_continues_an_extended_run_from_its_own_checkpoint(byte_dataset, source, tmp_path):  # noqa: F811
    """The resumed run reproduces the straight one exactly, even when the checkpoint it started from
    is gone: resuming reads the run's own checkpoint and ignores run.init_from."""
    moved = tmp_path / "source"
    shutil.copytree(source, moved)
    straight = train(extended(byte_dataset, tmp_path / "straight", moved))
    train(extended(byte_dataset, tmp_path / "split", moved, run={"stop_at_step": 3}))
    shutil.rmtree(moved)
    second = train(extended(byte_dataset, tmp_path / "split", moved), resume=True)
    assert second.status == "completed" and second.steps == 6
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    assert abs(straight.final_val_loss - second.final_val_loss) <= 1e-6


def test_the_command_line_flag_sets_run_init_from_and_refuses_resume(byte_dataset, source, tmp_path, capsys):  # noqa: F811
    path = tmp_path / "config.yaml"
    config = extended(byte_dataset, tmp_path / "run", source, run={"steps": 1})
    data = config.to_dict()
    data["run"]["init_from"] = None
    path.write_text(yaml.safe_dump(data))
    assert main(["train", "--config", str(path), "--init-from", str(source)]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["init_from"] == str(source)
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--init-from", str(source), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--init-from" in err[0] and "--resume" in err[0]
    assert main(["train", "--config", str(path), "--init-from", str(tmp_path / "nothing")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_start_from_the_same_weights_as_one(byte_dataset, source, tmp_path, parallel):  # noqa: F811
    """Rank 0 reads the checkpoint and broadcasts it: every loss of the extended run under torchrun
    follows the single-process run (the same tolerance as tests/test_distributed.py)."""
    single = train(extended(byte_dataset, tmp_path / "single", source, run={"steps": 3, "eval_every": 3}))
    config = extended(byte_dataset, tmp_path / parallel, source,
                      run={"steps": 3, "eval_every": 3, "parallel": parallel})
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.to_dict()))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        "-m", "diff_transformer", "train", "--config", str(config_file),
    ]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind in ("train", "val"):
        expected, got = losses(tmp_path / "single", kind), losses(tmp_path / parallel, kind)
        assert expected.keys() == got.keys() and expected
        for step in expected:
            assert abs(expected[step] - got[step]) <= 1e-5, (kind, step, expected[step], got[step])
    assert math.isfinite(single.final_val_loss)
