"""A worker process's memory: resident bytes now and at peak (the step record's ``rss``), and glibc's
threshold for giving freed memory back to the system.

Plain functions of the process, apart from the worker so that a benchmark (``benchmarks/memory.py``)
and the CLI use them without a worker.
"""

from __future__ import annotations

import os
import sys


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


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mapping, given
    back to the system when freed. By default the threshold rises to the size of the largest block
    freed (up to 32 MiB), after which the weights a worker receives, unpacks and copies into its
    stage stay resident as heap it never returns: a stage's peak then held about 2x its parameter
    bytes more than it uses (benchmarks/memory.py). False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
