"""Timing, peak memory and a description of the machine, shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch



def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Best (smallest) wall time of ``fn()`` over ``repeats`` calls, in seconds, after ``warmup``
    untimed calls. Timing noise only ever adds time, and on a shared machine it is large, so the
    least disturbed run is the best estimate of what the call costs."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the profiler's C++ side prints start/stop lines there."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes allocated by one ``fn()`` at its peak, above what was allocated before it.

    CUDA: the caching allocator's peak counter. CPU: PyTorch has no such counter, so the call runs
    once under the profiler with memory recording, and the peak of the running sum of its
    allocations and frees is taken (tensors only: what the op itself asks for).
    """
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def memory_budget(device: torch.device) -> int:
    """Bytes a benchmark may plan to use: 60% of free GPU memory, or of the machine's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.6 * free)
    return int(0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def describe_machine(device: torch.device) -> dict[str, object]:
    """What the figures were measured on."""
    info: dict[str, object] = {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu"] = names[0]
    except OSError:
        pass
    return info
