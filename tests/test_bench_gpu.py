"""``diff-transformer bench gpu``: the refusal without CUDA, and the report logic run on CPU
with the CPU backends (the GPU itself is exercised only by running the command on one)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from diff_transformer import ops
from diff_transformer.bench import gpu
from diff_transformer.bench.gpu import Case, GpuBenchSettings, correctness_report, run_gpu_bench, write_report
from diff_transformer.cli import main

# Small CPU shapes: MHA, GQA with S > T, non-causal, left padding (d = 96), one query.
CPU_CASES = (
    Case("mha-odd", 1, 2, 2, 19, 19, 16),
    Case("gqa-cache", 2, 4, 2, 7, 23, 16),
    Case("gqa-noncausal", 1, 2, 1, 9, 14, 32, causal=False),
    Case("gqa-d96-left-pad", 2, 2, 1, 11, 11, 96, pads=(0, 6)),
    Case("decode", 2, 4, 2, 1, 17, 16),
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_refuses_without_cuda(tmp_path, capsys):
    assert main(["bench", "gpu", "--out", str(tmp_path / "gpu")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bench gpu needs a CUDA device (") and "torch.cuda.is_available() is False" in err
    assert not (tmp_path / "gpu").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
@pytest.mark.slow  # the script in a subprocess
def test_gpu_check_script_refuses_without_cuda_writing_nothing(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(script), str(tmp_path / "check")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: the GPU check needs a CUDA GPU (torch {torch.__version__} sees no CUDA device: "
        "torch.cuda.is_available() is False)"
    ]
    assert not (tmp_path / "check").exists()
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert usage.returncode == 2 and usage.stderr == "error: usage: scripts/gpu_check.sh OUTDIR\n"


@pytest.mark.slow  # every backend's correctness on CPU
def test_correctness_report_on_cpu_backends():
    backends = ("sdpa", "sdpa_split", "decode") + (("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ())
    rows = correctness_report("cpu", backends=backends, dtypes=("float32",), cases=CPU_CASES)
    # every backend on every case it applies to; "decode" only on the single-query case
    assert {(r["backend"], r["case"]) for r in rows} == {
        (b, c.name) for b in backends for c in CPU_CASES if b != "decode" or c.queries == 1
    }
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert all(set(r["max_rel"]) == set(gpu.OUTPUTS) for r in rows)
    assert max(r["max_rel"]["out"] for r in rows) < 1e-5


def test_correctness_report_catches_a_wrong_backend(monkeypatch):
    def off_by_a_bit(*args, **kwargs):
        return ops.sdpa_split_diff_attention(*args, **kwargs) * 1.01

    def crashes(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setitem(ops.DIFF_BACKENDS, "sdpa", off_by_a_bit)
    monkeypatch.setitem(ops.DIFF_BACKENDS, "sdpa_split", crashes)
    rows = correctness_report("cpu", backends=("sdpa", "sdpa_split"), dtypes=("float32",), cases=CPU_CASES[:1])
    by = {r["backend"]: r for r in rows}
    assert not by["sdpa"]["passed"] and by["sdpa"]["max_rel"]["out"] > 5e-3
    assert not by["sdpa_split"]["passed"] and "boom" in by["sdpa_split"]["note"]
    assert "FAIL" in gpu.correctness_table(rows)


@pytest.mark.slow  # the whole report on CPU
def test_whole_report_on_cpu_writes_json_and_markdown(tmp_path):
    settings = GpuBenchSettings(
        device="cpu", backends=("sdpa", "sdpa_split", "decode"), dtypes=("float32", "bfloat16"), cases=CPU_CASES[:2],
        bench_dtype="float32", lengths=(32,),
        heads=4, head_dim=16, preset="debug", model_length=16, decode_tokens=3, repeats=1, compare_hf=False,
    )
    report = run_gpu_bench(settings, progress=False)
    json_path, md_path = write_report(tmp_path / "out", report)
    data = json.loads(json_path.read_text())
    rows = data["correctness"]
    assert {r["backend"] for r in rows} == {"sdpa", "sdpa_split"}  # "decode" has no single-query case here
    assert all(r["passed"] for r in rows), rows
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"} and data["correctness_passed"]
    assert data["attention"]["benchmark"] == "attention" and data["model"]["benchmark"] == "model"
    md = md_path.read_text()
    assert "## Correctness against the fp32 reference" in md and "## Attention backends" in md and "## Models" in md
    assert "| sdpa_split | bfloat16 | gqa-cache |" in md
    # the fused kernel is opt-in: the report says how to turn it on, and here why it cannot run
    assert "## The fused Triton kernel" in md and 'attn_backend="triton"' in md and "cannot run here" in md
    assert "model_triton" not in data  # not timed where it cannot run


def test_time_budget_skips_later_phases(tmp_path):
    settings = GpuBenchSettings(device="cpu", dtypes=("float32",), cases=CPU_CASES[:1], time_budget_s=0.0)
    report = run_gpu_bench(settings, progress=False)
    assert "attention" not in report and "model" not in report
    assert any("time budget" in n for n in report["notes"])
    assert "## Notes" in gpu.format_markdown(report)


def test_time_budget_flag_reaches_the_settings(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(settings, progress=True):
        seen["budget"] = settings.time_budget_s
        return {"correctness_passed": True, "triton": {"turn_on": "-"}}

    monkeypatch.setattr(gpu, "cuda_problem", lambda: None)
    monkeypatch.setattr(gpu, "run_gpu_bench", fake_run)
    monkeypatch.setattr(gpu, "write_report", lambda out, report: (tmp_path / "a.json", tmp_path / "a.md"))
    assert main(["bench", "gpu", "--out", str(tmp_path / "gpu"), "--time-budget", "180"]) == 0
    assert seen["budget"] == 180.0
    assert main(["bench", "gpu", "--out", str(tmp_path / "gpu")]) == 0 and seen["budget"] == 480.0
