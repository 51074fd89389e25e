"""Two CPU processes under torchrun (gloo) follow the single-process loss curve, with DDP and
with FSDP2, at the same global batch; their diagnostics (λ, attention-branch RMS, first-token and
negative map shares per layer, from the whole model) equal the single process's."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from diff_transformer.model import LanguageModel
from diff_transformer.train import train
from diff_transformer.train.trainer import read_metrics
from test_train import byte_dataset, debug_config, losses  # noqa: F401  (byte_dataset is a fixture)

# Not bit-exact: the gradient all-reduce and the validation sums add in another order than one
# process does, which moves fp32 losses by ~1e-6 over these few steps.
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_process(byte_dataset, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("single")
    config = debug_config(byte_dataset, out, run={"steps": 4, "eval_every": 2})
    result = train(config)
    return out, result


@pytest.mark.slow  # torchrun launches of 2 processes
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_follow_the_single_process_curve(parallel, byte_dataset, single_process, tmp_path):  # noqa: F811
    single_out, single_result = single_process
    out = tmp_path / parallel
    config_file = tmp_path / "config.yaml"
    config = debug_config(byte_dataset, out, run={"steps": 4, "eval_every": 2, "parallel": parallel})
    config_file.write_text(yaml.safe_dump(config.to_dict()))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        "-m", "diff_transformer", "train", "--config", str(config_file),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]

    for kind in ("train", "val"):
        expected, got = losses(single_out, kind), losses(out, kind)
        assert expected.keys() == got.keys() and expected
        for step in expected:
            assert abs(expected[step] - got[step]) <= LOSS_TOLERANCE, (kind, step, expected[step], got[step])

    def diagnostics(out_dir):
        return {r["step"]: r for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == "diagnostics"}

    expected, got = diagnostics(single_out), diagnostics(out)
    assert expected.keys() == got.keys() and expected
    for step, record in expected.items():
        for key in ("lambda", "attn_rms", "first_token_share", "negative_share"):
            if key in record:
                assert got[step][key] == pytest.approx(record[key], abs=LOSS_TOLERANCE), (key, step)
    assert "negative_share" in expected[2] and len(expected[2]["lambda"]) == len(expected[2]["first_token_share"]) == 2

    # The checkpoint written by rank 0 holds the full weights, close to the single process's.
    ours = LanguageModel.from_pretrained(out / "checkpoint").state_dict()
    reference = LanguageModel.from_pretrained(single_out / "checkpoint").state_dict()
    assert ours.keys() == reference.keys()
    for name in reference:
        assert torch.allclose(ours[name], reference[name], atol=WEIGHT_TOLERANCE, rtol=0), name


@pytest.mark.slow
def test_every_process_refuses_a_run_directory_in_use(byte_dataset, tmp_path):  # noqa: F811
    """Rank 0 finds the run directory locked by another process: every rank stops with the same
    error line (none waits for the others), and nothing is written."""
    from diff_transformer.files import claim_output_dir, lock_output_dir

    out = claim_output_dir(tmp_path / "run", "train-run")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(debug_config(byte_dataset, out, run={"steps": 2}).to_dict()))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        "-m", "diff_transformer", "train", "--config", str(config_file),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with lock_output_dir(out):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    refusal = f"error: {out}: in use by another diff-transformer process (pid {os.getpid()} on "
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and all(line.startswith(refusal) for line in lines), done.stderr[-3000:]
    assert "unexpected" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == [".diff-transformer"]
