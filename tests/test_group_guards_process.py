"""A group of a hierarchical run meets a worker that sends NaNs and garbage: real processes.

Why it can fail: a group's inner steps that do not go through the synchronous run's step (a NaN's
loss logged, the step never retried or skipped, the worker never evicted), blame that lands on the
worker that only received the NaN, an eviction that ends the run or strands the group's healthy
workers, or worker processes left running. The same faults as the in-process
``test_hierarchical`` test, through the command line: ``fusionllm coordinator`` and four
``fusionllm worker`` processes, one started with ``--inject-fault``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fusionllm.core.metrics import read_metrics
from tests.conftest import Started, assert_group_eviction, coordinator_port

pytestmark = pytest.mark.slow  # real processes

BASE = [sys.executable, "-m", "fusionllm"]


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path: Path, started: Started):
    yield
    left = started.stop(tmp_path)
    assert not left, f"processes left running: {left}"


def test_a_worker_of_a_group_that_sends_nan_and_garbage_is_retried_skipped_and_evicted_across_processes(tmp_path: Path) -> None:
    from fusionllm.transport.auth import load_token

    token, out = tmp_path / "token", tmp_path / "m.jsonl"
    load_token(token, create=True)
    # group 0 = workers 0, 1, 2 (a pipeline), group 1 = worker 3; group 0 of 2 reads batches 0, 2, 4, ...:
    # data step 4 is its inner step 2, data step 10 its inner step 5
    coord = subprocess.Popen([*BASE, "coordinator", "--listen", "127.0.0.1:0", "--token-file", str(token), "--workers", "4",
                              "--model", "gpt-nano", "--batch-size", "8", "--seq-len", "32", "--lr", "3e-3", "--warmup", "1", "--seed", "0",
                              "--steps", "16", "--eval-every", "0", "--micro-batches", "2", "--sync", "hierarchical", "--groups", "0,1,2/3",
                              "--inner-steps", "2", "--fragments", "1", "--evict-after", "3", "--metrics", str(out),
                              "--group-batch", "8"],  # 8 rows a group, as the in-process test
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[subprocess.Popen] = []
    try:
        seen: list[str] = []
        port = coordinator_port(coord.stdout, seen)
        for rank in range(4):
            faults = ["--inject-fault", "nan@4", "--inject-fault", "scale@10"] if rank == 1 else []
            workers.append(subprocess.Popen([*BASE, "worker", "--join", f"127.0.0.1:{port}", "--token-file", str(token), "--rank", str(rank),
                                             "--threads", "1", *faults], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        rest, _ = coord.communicate(timeout=600)
        for w in workers:
            w.wait(timeout=60)  # told to leave (the evicted one) or that the run is over
    finally:
        for p in [coord, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert coord.returncode == 0, "".join(seen) + (rest or "")[-3000:]
    assert_group_eviction(read_metrics(out))
