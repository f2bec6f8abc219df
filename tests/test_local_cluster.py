"""A local cluster's PIDs file: what it started, by PID, for callers that must signal or check it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusionllm.launch.local_cluster import (
    PIDS_FILE,
    ClusterPids,
    read_pids,
    run_local_cluster,
    start_ticks,
)

# Stands in for `python -m fusionllm coordinator|worker` (no torch, no training): the coordinator writes its
# port file, waits until the PIDs file lists both workers, records what it read, and ends; the workers end after it.
FAKE = """
import json, os, sys, time
from pathlib import Path
from fusionllm.launch.local_cluster import read_pids
run_dir, role = Path(os.environ["FAKE_RUN_DIR"]), sys.argv[3]
deadline = time.monotonic() + 60
if role == "coordinator":
    Path(sys.argv[sys.argv.index("--port-file") + 1]).write_text("1")  # as a coordinator that listens (the workers are started then)
    while ((p := read_pids(run_dir)) is None or len(p.workers) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    (run_dir / "seen.part").write_text(json.dumps({"me": os.getpid(), "all": p.all(), "running": p.running()}))
    (run_dir / "seen.part").replace(run_dir / "seen.json")
else:
    while not (run_dir / "seen.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
"""


def test_a_local_cluster_lists_every_process_it_starts_while_they_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake.py").write_text(FAKE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {tmp_path / "fake.py"} -m fusionllm "$@"\n')
    python.chmod(0o755)
    run_dir = tmp_path / "run"
    monkeypatch.setenv("FAKE_RUN_DIR", str(run_dir))
    monkeypatch.setattr(sys, "executable", str(python))
    assert run_local_cluster([], 2, run_dir) == 0
    seen = json.loads((run_dir / "seen.json").read_text())
    assert seen["all"][0] == seen["me"] and len(seen["all"]) == 3 == len(set(seen["all"]))  # the coordinator first, then the workers
    assert seen["running"] == seen["all"]  # all three were running when the coordinator looked
    after = read_pids(run_dir)
    assert after is not None and after.stopped and after.launcher == os.getpid()
    assert after.all() == seen["all"] and after.running() == []  # stopped and waited for
    assert after.running(launcher=True) == [os.getpid()]  # this process ran the cluster, and still runs


def test_a_pid_is_running_only_while_it_is_the_process_that_was_started(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        ours = ClusterPids(launcher=os.getpid(), coordinator=proc.pid, start_ticks={proc.pid: ticks})
        assert ours.running() == [proc.pid]
        reused = ClusterPids(launcher=os.getpid(), coordinator=proc.pid, start_ticks={proc.pid: ticks + 1})
        assert reused.running() == []  # the same number given to another process since is not ours
    finally:
        proc.kill()
        proc.wait()
    assert ours.running() == []
    assert read_pids(tmp_path) is None and not (tmp_path / PIDS_FILE).exists()
