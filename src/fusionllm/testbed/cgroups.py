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
        with contextlib.suppress(OSError):
            path.rmdir()  # not half made: the testbed records a cgroup once it is whole
        raise TestbedError(f"cannot create CPU cgroup {path}: {exc}") from None
    return path


def remove(names: list[str]) -> list[str]:
    """Remove these cgroups (moving processes still in them to the root group first); returns those removed."""
    removed = []
    for name in names:
        path = ROOT / name
        if not name.startswith(f"{PREFIX}-") or "/" in name or not path.is_dir():
            continue
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                (ROOT / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            os.rmdir(path)
            removed.append(name)
    return removed
