"""Keep the memory that freed tensors leave, for the next step, instead of giving it back to the OS.

On CPU, PyTorch allocates tensors with the C library's malloc. glibc serves a large request from
a fresh mmap or from the top of its heap, and gives memory back to the kernel when a large block
is freed (munmap) or when more than a threshold lies free at the top of the heap (trim). The
next step then touches new pages: one page fault per 4 KiB, each zero-filled by the kernel.
A training step frees most of what its forward allocated (the activations kept for the
backward), so this happens every step. DIFF's CPU backend keeps its attention maps for the
backward (ops/materialized.py), about 8 MiB per layer at the tiny preset, batch 8: its forward
took 12,000–16,000 page faults per step and the Transformer's almost none, which was most of
the gap between their training speeds on this project's CPU machine (BENCHMARKS.md, issue 12).

:func:`keep_freed_memory` sets glibc's two thresholds once per process (``mallopt``): blocks up
to 32 MiB (the most glibc allows) come from the heap, and the heap is trimmed only when 1 GiB
lies free at its top. The price: the process keeps its peak heap, as PyTorch's CUDA caching
allocator keeps its peak on the GPU. The ``diff-transformer`` command calls it at start;
library users may call it themselves. It does nothing where malloc is not glibc's, or where the
user already chose these thresholds (``MALLOC_MMAP_THRESHOLD_`` and the like, the same in
``GLIBC_TUNABLES``, a preloaded jemalloc or tcmalloc), or with ``DIFF_TRANSFORMER_KEEP_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import os
import platform

OPT_OUT_ENV = "DIFF_TRANSFORMER_KEEP_MEMORY"
# mallopt option numbers, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30  # an int: mallopt takes one
# what a user sets to choose these thresholds (or the like) himself: then they are left as they are
THRESHOLD_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
THRESHOLD_TUNABLES = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")  # in GLIBC_TUNABLES

_applied = False  # set once the thresholds are in place in this process


def _user_tuned_malloc() -> bool:
    env = os.environ
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(name in env for name in THRESHOLD_VARIABLES) or any(name in tunables for name in THRESHOLD_TUNABLES):
        return True
    preload = env.get("LD_PRELOAD", "")
    return "jemalloc" in preload or "tcmalloc" in preload


def keep_freed_memory() -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process (see the module's docstring).
    Returns True if they are set (now or by an earlier call), False where it does nothing."""
    global _applied
    if _applied:
        return True
    if os.environ.get(OPT_OUT_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or _user_tuned_malloc():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting either threshold also stops glibc's own adjustment of them
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def keeps_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` has set the thresholds in this process."""
    return _applied
