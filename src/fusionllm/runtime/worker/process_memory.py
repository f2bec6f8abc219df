"""A worker process's memory: resident bytes now and at peak (the step record's ``rss``), and glibc's
thresholds for giving freed memory back to the system: low while a stage is set up (the weights it
receives and unpacks are given back), high while it trains (a step's tensors are reused, not mapped
afresh each step).

Plain functions of the process, apart from the worker so that a benchmark (``benchmarks/memory.py``)
and the CLI use them without a worker.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def current_rss() -> int:
    """Bytes resident now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss() -> int:
    """The most bytes resident at once since the process began (getrusage; kilobytes on Linux)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
TRIM_DEFAULT = 128 << 10  # glibc's trim threshold before it adapts
WORKING_MMAP = 32 << 20  # the highest threshold glibc's own adaptation reaches (64-bit)


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mapping, given
    back to the system when freed (and trim the heap's free top beyond glibc's default). By default
    the threshold rises to the size of the largest block freed (up to 32 MiB), after which the
    weights a worker receives, unpacks and copies into its stage stay resident as heap it never
    returns: a stage's peak then held about 2x its parameter bytes more than it uses
    (benchmarks/memory.py). For setting a stage up; ``keep_working_memory`` once it trains. False
    where there is no glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_DEFAULT))


def keep_working_memory(threshold: int = WORKING_MMAP) -> bool:
    """Once a stage is set up: give back what the set-up freed (``malloc_trim``), then keep freed
    blocks below ``threshold`` for reuse, as a plain PyTorch process does once glibc's thresholds
    have adapted. With every block of 1 MiB or more mapped afresh, each step's activations and
    gradients were new zeroed pages: gpt-micro's one-device worker took 41k page faults and 113 ms
    of system time a step, a third of its CPU (experiments/one_device.py). False where there is no glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold))


def _glibc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
