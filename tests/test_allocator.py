"""allocator.keep_freed_memory, measured by the kernel's own count of page faults.

Each case runs in a fresh process (the thresholds are process-wide and cannot be unset): it
allocates 20 tensors of 4 MiB, touching every page, frees them all, and does it again four
times. With glibc's defaults the freed heap is usually trimmed and every round faults again on
about 20 × 1,024 pages; with the thresholds kept, the rounds after the first reuse the memory.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from diff_transformer import allocator
from diff_transformer.cli import main

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

PAGES_PER_ROUND = 20 * (4 << 20) // 4096  # 20,480 pages of 4 KiB

CHILD = """
import json, resource, sys
import torch
from diff_transformer.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "call" else None
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(1 << 20) for _ in range(20)]  # 20 x 4 MiB of fp32, every page written
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _child(call: bool, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD"))}
    clean.pop(allocator.OPT_OUT_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "call" if call else "skip"],
        env={**clean, **env}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def default_faults() -> list[int]:
    """Faults per round with glibc's defaults, from a process where the last rounds faulted again
    (not every process does: where glibc trims depends on what else lies at the top of its heap).
    Skips where three processes in a row never trimmed: then there is nothing to measure."""
    tries = [_child(call=False)["faults"] for _ in range(3)]
    for faults in tries:
        if min(faults[2:]) >= PAGES_PER_ROUND // 2:
            return faults
    pytest.skip(f"glibc kept freed memory by default here (faults per round {tries}): nothing to measure")


@glibc_only
def test_freed_memory_is_reused_instead_of_faulting_again(default_faults):
    kept = _child(call=True)
    assert kept["applied"] is True
    # after the first round the heap is reused: over the next three rounds together fewer faults
    # than a quarter of one round's pages (a tensor's 1,024 now and then, where the heap grows
    # past something else), against every page of every round by default
    assert sum(kept["faults"][1:]) < PAGES_PER_ROUND // 4, (kept["faults"], default_faults)


@glibc_only
@pytest.mark.parametrize(
    "env",
    [
        {allocator.OPT_OUT_ENV: "0"},
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
        {"LD_PRELOAD": "libjemalloc.so.2"},
    ],
    ids=["opt-out", "malloc-variable", "glibc-tunable", "preloaded-allocator"],
)
def test_opt_out_and_a_user_tuned_malloc_are_left_alone(env):
    assert _child(call=True, **env)["applied"] is False


def test_every_command_calls_it(monkeypatch):
    calls = []
    monkeypatch.setattr("diff_transformer.cli.keep_freed_memory", lambda: calls.append("called"))
    assert main(["info"]) == 0
    assert calls == ["called"]
