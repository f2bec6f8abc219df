"""torch.distributed inside a fence, with real processes (``init_process_group`` is once per process,
so the in-process harness never forms a world): replicas and tied weights all-reduced through gloo
train as one process does, and a lost worker's world forms again with the workers left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionllm.core.metrics import read_metrics
from fusionllm.launch.local_cluster import read_pids
from tests.conftest import Started

pytestmark = pytest.mark.slow  # real processes

BASE = [sys.executable, "-m", "fusionllm"]
RUN = ["--model", "gpt-nano", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--seed", "3"]


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path: Path, started: Started):
    yield
    left = started.stop(tmp_path)
    assert not left, f"processes left running: {left}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("single") / "single.jsonl"
    subprocess.run([*BASE, "train", "--single-process", *RUN, "--steps", "4", "--metrics", str(out)], check=True, capture_output=True, timeout=300)
    return _losses(out)


def _records(path: Path) -> list[dict]:
    return read_metrics(path, missing_ok=True).records


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in _records(path) if "step" in r]


def _train(tmp_path: Path, *args: str) -> tuple[str, list[dict]]:
    out = tmp_path / "m.jsonl"
    proc = subprocess.run([*BASE, "train", *args, *RUN, "--steps", "4", "--metrics", str(out), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout + proc.stderr, _records(out)


# [off] in `make test`: test_cluster.py::test_replicated_stage_with_skip_edges_and_tied_weights (replicas and a
# tied head reduced on the data plane's ring, --collectives off, against one process)
@pytest.mark.parametrize("mode", ["auto", pytest.param("off", marks=pytest.mark.soak)])
def test_replicas_and_tied_weights_through_gloo_train_as_one_process(tmp_path: Path, mode: str, reference: list[float]) -> None:
    """Why it can fail: a bucket summed twice or not at all, gradients copied back to the wrong
    parameters, replicas that end with different sums, or a group formed in another order on one
    member (a hang: new_group is collective)."""
    text, records = _train(tmp_path, "--cluster", "local:4", "--replicas", "2,2", "--collectives", mode)
    losses = [r["loss"] for r in records if "step" in r]
    assert len(losses) == len(reference) == 4
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, reference, strict=True)), (losses, reference)
    plan = next(r for r in records if r.get("event") == "plan")
    moved = records[-1]["bytes"]
    replica_bytes = moved.get("w0->w1", 0) + moved.get("w2->w3", 0)  # the replicas' all-reduce, when it goes over the data plane
    if mode == "auto":
        assert "group 0: w0,w1,w2,w3 (gloo), all-reduces w0,w1; w0,w1,w2,w3; w2,w3" in text.replace("\n", " ").replace("  ", " "), text[-2000:]
        assert plan["collectives"] == [{"group": 0, "workers": [0, 1, 2, 3], "backend": "gloo", "reduce": [[0, 1], [0, 1, 2, 3], [2, 3]],
                                        "carries": [[0, 2], [1, 3], [2, 0], [3, 1]]}]
        assert replica_bytes == 0  # gloo carried it
    else:
        assert "(gloo)" not in text and plan["collectives"] == []
        assert replica_bytes > 0


# (make test-soak) in `make test`, the pipeline test's [auto] sums the tied weight through gloo (w0,w2), and the
# replicas test's [auto] does on workers that also carry activations to each other (w0,w2 of w0,w1,w2,w3)
@pytest.mark.soak
def test_a_tied_weight_across_a_pipeline_through_gloo_trains_as_one_process(tmp_path: Path, reference: list[float]) -> None:
    """wte (stage 0) and lm_head (stage 1) are one tensor: its two gradients summed through gloo."""
    text, records = _train(tmp_path, "--cluster", "local:2")
    losses = [r["loss"] for r in records if "step" in r]
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, reference, strict=True)) and len(losses) == 4, (losses, reference)
    assert "group 0: w0,w1 (gloo), all-reduces w0,w1" in text, text[-2000:]


# [kill] in `make test`: test_recovery.py::test_a_lost_worker_costs_a_re_plan_not_the_run[kill] (its world of 4 forms again with 3)
@pytest.mark.parametrize("how", [pytest.param("kill", marks=pytest.mark.soak), "hang"])
def test_a_lost_worker_forms_the_world_again_with_the_workers_left(tmp_path: Path, how: str) -> None:
    """Why it can fail: survivors stuck in an all-reduce with the dead (or hung: its sockets stay
    open, so gloo waits for its timeout) worker, a process group not destroyed before the next one
    forms, or a new group under the old epoch's keys."""
    out, run_dir, ckpt = tmp_path / "m.jsonl", tmp_path / "run", tmp_path / "ckpt"
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:4", "--replicas", "2,2", *RUN, "--steps", "12", "--checkpoint-dir", str(ckpt),
                             "--checkpoint-every", "2", "--metrics", str(out), "--run-dir", str(run_dir), "--dead-after", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = 0
    try:
        deadline = time.monotonic() + 240
        while len([r for r in _records(out) if "step" in r]) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "training ended early or never reached step 4"
            time.sleep(0.1)
        pids = read_pids(run_dir)  # the local cluster lists the processes it started
        assert pids is not None and 2 in pids.workers
        victim = pids.workers[2]
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "hang":  # once the others trained to the end without it, end it: train's own clean-up of a stopped worker
            # (SIGTERM, 5 s, SIGKILL) is test_recovery.py's [hang]; here it only cost time
            deadline = time.monotonic() + 240
            while proc.poll() is None and max((r["step"] for r in _records(out) if "step" in r), default=-1) < 11:
                assert time.monotonic() < deadline, "the others never reached the last step"
                time.sleep(0.1)
            os.kill(victim, signal.SIGKILL)
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim and how == "hang":
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    assert proc.returncode == 0, text[-3000:]
    records = _records(out)
    (event,) = [r for r in records if r.get("event") == "recovery"]
    assert event["lost"] == [2] and event["workers"] == 3
    assert max(r["step"] for r in records if "step" in r) == 11
    flat = text.replace("\n", " ")
    assert "group 0: w0,w1,w2,w3 (gloo)" in flat and "group 0: w0,w1,w2 (gloo)" in flat, text[-3000:]
    plans = [r for r in records if r.get("event") == "plan"]
    assert plans[-1]["collectives"][0]["workers"] == [0, 1, 2]


# [off] in `make test`: test_cluster.py::test_replicated_stage_with_skip_edges_and_tied_weights (activations and
# gradients on the data plane, --collectives off, against one process)
@pytest.mark.parametrize("mode", ["auto", pytest.param("off", marks=pytest.mark.soak)])
def test_a_pipeline_in_one_world_sends_activations_and_gradients_through_gloo(tmp_path: Path, mode: str, reference: list[float]) -> None:
    """Why it can fail: a message matched with another (a tag reused within a step, or posted out of
    order on one end), a header read as the wrong shape or dtype, gradients of two peers summed in
    another order, or one end using the world while the other waits on the data plane (a hang)."""
    text, records = _train(tmp_path, "--cluster", "local:3", "--collectives", mode)
    losses = [r["loss"] for r in records if "step" in r]
    assert len(losses) == 4 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, reference, strict=True)), (losses, reference)
    links = ("w0->w1", "w1->w0", "w1->w2", "w2->w1")
    plan = next(r for r in records if r.get("event") == "plan")
    steps = [r for r in records if "step" in r]
    if mode == "auto":
        assert "carries w0->w1, w1->w0, w1->w2, w2->w1" in text.replace("\n", " ").replace("  ", " "), text[-2000:]
        assert "group 0: w0,w1,w2 (gloo), all-reduces w0,w2;" in text.replace("\n", " ").replace("  ", " "), text[-2000:]  # the tied wte/lm_head
        assert plan["carried"] == list(links) and plan["collectives"][0]["carries"] == [[0, 1], [1, 0], [1, 2], [2, 1]]
        for r in steps:
            assert all(r["bytes"].get(link, 0) == 0 for link in links), r["bytes"]  # nothing on the data plane
            assert all(r["carried_bytes"][link] > 0 for link in links), r["carried_bytes"]
    else:
        assert "carries" not in text and plan["carried"] == []
        for r in steps:
            assert all(r["bytes"][link] > 0 for link in links) and "carried_bytes" not in r, r
