"""Training paths the main trainer tests leave out: the RNG state through a checkpoint, resume and
gradient accumulation under torchrun (DDP and FSDP2, gloo on CPU), torch.compile, bf16 autocast
on CPU, and a resume after switching the attention backend. Debug preset, a few steps each."""

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
import yaml

from diff_transformer.model import LanguageModel
from diff_transformer.train import train
from diff_transformer.train import step as step_module
from diff_transformer.train.state import rng_states, set_rng_states
from test_distributed import LOSS_TOLERANCE, free_port
from test_train import byte_dataset, debug_config, losses  # noqa: F401  (byte_dataset is a fixture)


def test_rng_states_survive_a_save_and_load(tmp_path):
    """torch and Python RNG states written with torch.save load back (weights_only) and replay."""
    torch.manual_seed(123)
    random.seed(456)
    torch.rand(7), random.random()  # move both away from their seeds
    torch.save({"rng": rng_states()}, tmp_path / "state.pt")
    expected = (torch.rand(5), [random.random() for _ in range(5)])
    torch.manual_seed(0)
    random.seed(0)
    set_rng_states(torch.load(tmp_path / "state.pt", weights_only=True)["rng"])
    got = (torch.rand(5), [random.random() for _ in range(5)])
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


@pytest.mark.slow  # interrupted and straight training runs
def test_resume_replays_the_random_streams_bit_for_bit(byte_dataset, tmp_path, monkeypatch):  # noqa: F811
    """A loss that draws from torch's and Python's global RNGs (as dropout would) at every micro-batch:
    a run paused at step 3 and resumed logs exactly the losses of a straight run."""
    real = step_module.token_loss_sum

    def noisy(model, inputs, targets, separator=None):
        noise = torch.rand(()) + random.random()  # in [0, 2): changes the loss by up to 2e-3 of itself
        return real(model, inputs, targets, separator) * (1 + 1e-3 * noise)

    monkeypatch.setattr(step_module, "token_loss_sum", noisy)
    def seed_all(seed):  # the streams a fresh process would start from (the trainer seeds only torch's)
        torch.manual_seed(seed)
        random.seed(seed)

    seed_all(0)
    train(debug_config(byte_dataset, tmp_path / "straight", run={"eval_every": 100}))
    seed_all(0)
    train(debug_config(byte_dataset, tmp_path / "split", run={"eval_every": 100, "stop_at_step": 3}))
    seed_all(999)  # scrambled: steps 4-6 draw what they draw only if the checkpoint restores the states
    train(debug_config(byte_dataset, tmp_path / "split", run={"eval_every": 100}), resume=True)
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(a[step] == b[step] for step in a), (a, b)  # bitwise: same weights, same draws


def torchrun(config, tmp_path, *, resume=False, name="config.yaml"):
    config_file = tmp_path / name
    config_file.write_text(yaml.safe_dump(config.to_dict()))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        "-m", "diff_transformer", "train", "--config", str(config_file), *(["--resume"] if resume else []),
    ]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def single_process_run(byte_dataset, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("single")
    train(debug_config(byte_dataset, out, run={"steps": 4, "eval_every": 2}))
    return out


@pytest.mark.slow  # two torchrun launches of 2 processes each
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_accumulate_and_resume_like_one(parallel, byte_dataset, single_process_run, tmp_path):  # noqa: F811
    """2 ranks × 2 micro-batches of 2 sequences (accumulation 2) = the single process's batch of 8;
    paused at step 2 and resumed under torchrun (rank 0 reads, the states are broadcast)."""
    out = tmp_path / parallel
    sections = dict(data={"micro_batch_size": 2}, run={"steps": 4, "eval_every": 2, "parallel": parallel})
    torchrun(debug_config(byte_dataset, out, **{**sections, "run": {**sections["run"], "stop_at_step": 2}}), tmp_path)
    done = torchrun(debug_config(byte_dataset, out, **sections), tmp_path, resume=True)
    assert "resuming from" in done.stderr and "at step 2" in done.stderr
    for kind in ("train", "val"):
        expected, got = losses(single_process_run, kind), losses(out, kind)
        assert expected.keys() == got.keys() and len(expected) >= 2
        for step in expected:
            assert abs(expected[step] - got[step]) <= LOSS_TOLERANCE, (kind, step, expected[step], got[step])


COMPILE_TOLERANCE = 1e-4  # inductor fuses and reorders fp32 sums; a few steps stay within 1e-4 nats


@pytest.mark.slow  # inductor compiles forward, backward and the eval graph: ~100 s on 2 busy cores
def test_compiled_training_on_cpu_follows_eager(byte_dataset, tmp_path):  # noqa: F811
    eager = train(debug_config(byte_dataset, tmp_path / "eager", run={"steps": 2, "eval_every": 2}))
    compiled = train(debug_config(byte_dataset, tmp_path / "compiled",
                                  run={"steps": 2, "eval_every": 2, "compile": True}))
    assert compiled.status == "completed"
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert a.keys() == b.keys() == {1, 2}
    for step in a:
        assert math.isfinite(b[step]) and abs(a[step] - b[step]) <= COMPILE_TOLERANCE, (step, a[step], b[step])
    assert abs(eager.final_val_loss - compiled.final_val_loss) <= COMPILE_TOLERANCE


BF16_TOLERANCE = 0.05  # nats: bf16 keeps 8 bits of mantissa; the debug model's loss is ~5.5


@pytest.mark.slow  # a training run under bf16 autocast
def test_bf16_autocast_training_on_cpu(byte_dataset, tmp_path):  # noqa: F811
    fp32 = train(debug_config(byte_dataset, tmp_path / "fp32", run={"steps": 3, "precision": "fp32"}))
    assert fp32.status == "completed"
    bf16 = train(debug_config(byte_dataset, tmp_path / "bf16", run={"steps": 3, "precision": "bf16"}))
    assert bf16.status == "completed"
    a, b = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert a.keys() == b.keys() == {1, 2, 3}
    assert any(a[s] != b[s] for s in a)  # autocast really ran in bf16
    for step in a:
        assert math.isfinite(b[step]) and abs(a[step] - b[step]) <= BF16_TOLERANCE, (step, a[step], b[step])
    assert LanguageModel.from_pretrained(tmp_path / "bf16" / "checkpoint").embed.weight.dtype == torch.float32


@pytest.mark.slow  # two training runs
def test_resume_after_switching_the_attention_backend(byte_dataset, tmp_path):  # noqa: F811
    """Saved while training on the reference backend, resumed on "auto": the run completes and
    follows a straight run (the backends agree to fp32 rounding)."""
    models = {"diff": {"attention": "diff"}}
    train(debug_config(byte_dataset, tmp_path / "straight", models=models))
    train(debug_config(byte_dataset, tmp_path / "split", models=models,
                       run={"stop_at_step": 3, "attn_backend": "reference"}))
    resumed = train(debug_config(byte_dataset, tmp_path / "split", models=models), resume=True)
    assert resumed.status == "completed" and resumed.steps == 6
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    saved = json.loads((tmp_path / "split" / "checkpoint" / "config.json").read_text())
    assert "attn_backend" not in saved["model"]  # a runtime setting: the checkpoint holds architecture only
