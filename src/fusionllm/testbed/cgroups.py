"""cgroup-v1 CPU quotas: one group per worker, so one device is slower than another."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fusionllm.testbed.sh import PREFIX, TestbedError

ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def available() -> bool:
    return (ROOT / "cgroup.procs").exists()


def create(name: str, cpus: float) -> Path:
    """A cgroup allowing ``cpus`` cores; returns its directory."""
    path = ROOT / name
    try:
        path.mkdir(exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * PERIOD_US))))
    except OSError as exc:
        raise TestbedError(f"cannot create CPU cgroup {path}: {exc}") from None
    return path


def remove_all() -> list[str]:
    """Remove every fusion cgroup (moving stray processes to the root group first)."""
    removed = []
    if not ROOT.is_dir():
        return removed
    for path in sorted(ROOT.glob(f"{PREFIX}-*")):
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                (ROOT / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            os.rmdir(path)
            removed.append(path.name)
    return removed
