"""Faults on loopback: a worker killed or hung mid-run, the coordinator killed, a spare joining."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fusionllm.core.metrics import read_metrics
from fusionllm.launch.local_cluster import read_pids
from tests.conftest import Started, coordinator_port

pytestmark = pytest.mark.slow  # real processes

BASE = [sys.executable, "-m", "fusionllm"]
RUN = ["--model", "gpt-micro", "--batch-size", "8", "--seq-len", "64", "--eval-every", "0", "--seed", "3"]


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path: Path, started: Started):
    yield
    left = started.stop(tmp_path)  # the test's own by handle, then its run directory only (the machine is shared)
    assert not left, f"processes left running: {left}"


def _records(path: Path) -> list[dict]:
    """Step records and events but the plans, in file order (empty before the file is written)."""
    return [r for r in read_metrics(path, missing_ok=True).records if r.get("event") != "plan"]


def _wait_steps(path: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(read_metrics(path, missing_ok=True).steps) >= n:
            return
        assert proc.poll() is None, "training ended early"
        time.sleep(0.1)
    raise AssertionError(f"no step {n} within {timeout} s")


def _workers(run_dir: Path, *ranks: int) -> list[int]:
    """The PIDs of the workers of these ranks, as the local cluster of ``run_dir`` lists them."""
    pids = read_pids(run_dir)
    assert pids is not None, f"{run_dir}: no PIDs file"
    return [pids.workers[r] for r in ranks if r in pids.workers]


def _losses(records: list[dict], start: int) -> dict[int, float]:
    """The last loss recorded for each step from ``start`` on (steps after a recovery run again)."""
    return {r["step"]: r["loss"] for r in records if "step" in r and r["step"] >= start}


def _resumed_reference(tmp_path: Path, ckpt: Path, workers: int, steps: int) -> dict[int, float]:
    """Losses of a plain run resumed from the same checkpoint on the same number of workers, with
    RUN's settings: an in-process cluster (the same coordinator and workers, gRPC and data plane as
    the processes, without their start-up), one torch thread as each local worker process has."""
    import torch

    from fusionllm.core.config import TrainConfig
    from fusionllm.launch.inprocess import cluster_config, run_in_process

    ref_dir = tmp_path / "ref-ckpt"
    ref_dir.mkdir()
    shutil.copytree(ckpt, ref_dir / ckpt.name)
    opts = dict(zip(RUN[::2], RUN[1::2], strict=True))
    train = TrainConfig(model=opts["--model"], steps=steps, batch_size=int(opts["--batch-size"]), seq_len=int(opts["--seq-len"]),
                        eval_every=int(opts["--eval-every"]), seed=int(opts["--seed"]))
    records: list[dict] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_in_process(train, cluster_config(workers, checkpoint_dir=str(ref_dir), resume=True), on_step=records.append)
    finally:
        torch.set_num_threads(threads)
    return _losses(records, int(ckpt.name.split("-")[1]))


@pytest.mark.parametrize("how", ["kill", pytest.param("hang", marks=pytest.mark.soak)])  # a hung worker: test_collectives_process [hang] and test_restart
def test_a_lost_worker_costs_a_re_plan_not_the_run(tmp_path: Path, how: str) -> None:
    ckpt, out, run_dir = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "run"
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:4", *RUN, "--steps", "14", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
                             "--metrics", str(out), "--run-dir", str(run_dir), "--dead-after", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = []
    try:
        _wait_steps(out, 1, proc)
        victim = _workers(run_dir, 2)  # found before step 7: the signal goes the moment it is seen
        assert len(victim) == 1
        _wait_steps(out, 7, proc)
        os.kill(victim[0], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "hang":  # lost once the recovery is recorded: end it then (the local cluster would wait 13 s for it at the end)
            deadline = time.monotonic() + 300
            while not read_metrics(out, missing_ok=True).of("recovery"):
                assert proc.poll() is None, "training ended before the hung worker was lost"
                assert time.monotonic() < deadline, "the hung worker was not lost within 300 s"
                time.sleep(0.1)
            os.kill(victim[0], signal.SIGKILL)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in victim:
            if how == "hang":
                with_suppressed = subprocess.run(["kill", "-9", str(pid)], capture_output=True)
                assert with_suppressed.returncode in (0, 1)
    assert proc.returncode == 0, text[-3000:]
    records = _records(out)
    events = [r for r in records if r.get("event") == "recovery"]
    assert len(events) == 1 and events[0]["lost"] == [2] and events[0]["workers"] == 3, events
    assert max(r["step"] for r in records if "step" in r) == 13
    if how == "hang":
        assert "no heartbeat" in events[0]["why"]
    start = events[0]["resumed_from_step"]
    assert start in (5, 10)  # the newest complete checkpoint when the worker was lost
    after = _losses(records[records.index(events[0]) :], start)
    reference = _resumed_reference(tmp_path, ckpt / f"step-{start:06d}", 3, 14)
    assert sorted(after) == sorted(reference) == list(range(start, 14))
    for step, loss in reference.items():
        assert abs(after[step] - loss) <= 1e-5 * abs(loss), (step, after[step], loss)


def test_workers_stop_when_the_coordinator_dies_and_resume_continues(tmp_path: Path) -> None:
    from fusionllm.transport.auth import load_token

    token = tmp_path / "token"
    load_token(token, create=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "m.jsonl"
    coord = subprocess.Popen([*BASE, "coordinator", "--listen", "127.0.0.1:0", "--token-file", str(token), "--workers", "2", *RUN, "--steps", "400",
                              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--metrics", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[subprocess.Popen] = []
    proc = None
    try:
        port = coordinator_port(coord.stdout)
        workers = [subprocess.Popen([*BASE, "worker", "--join", f"127.0.0.1:{port}", "--token-file", str(token), "--coordinator-timeout", "4"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        _wait_steps(out, 8, coord)
        coord.kill()
        coord.wait()
        steps_done = max(r["step"] for r in read_metrics(out).steps)
        newest = sorted(ckpt.glob("step-*"))[-1]  # complete ones only: a checkpoint is written as .tmp-step-* and renamed when whole
        again = tmp_path / "again.jsonl"
        # the resumed run starts while the old workers wait out their --coordinator-timeout (its own token and port)
        proc = subprocess.Popen([*BASE, "train", "--cluster", "local:2", *RUN, "--steps", str(steps_done + 4), "--checkpoint-dir", str(ckpt), "--resume",
                                 "--metrics", str(again), "--run-dir", str(tmp_path / "run2")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for w in workers:
            w.wait(timeout=30)  # on their own: no orphans
            assert w.returncode != 0
        _, err = proc.communicate(timeout=600)
    finally:
        for p in [coord, *workers, proc]:
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, err[-3000:]
    resumed = [r["step"] for r in read_metrics(again).steps]
    assert resumed[0] == int(newest.name.split("-")[1]) and resumed[-1] == steps_done + 3


def test_a_spare_that_joins_mid_run_takes_the_place_of_a_lost_worker(tmp_path: Path) -> None:
    ckpt, out, run_dir = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "run"
    # --dead-after 60: worker 1 is held (SIGSTOP) while the spare starts, and must be lost by its kill, not by its silence
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:3", *RUN, "--steps", "12", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
                             "--metrics", str(out), "--run-dir", str(run_dir), "--dead-after", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    spare = None
    try:
        port = coordinator_port(proc.stdout)
        _wait_steps(out, 1, proc)
        victim = _workers(run_dir, 1)
        assert len(victim) == 1
        _wait_steps(out, 4, proc)  # a checkpoint (step 3) to recover from
        os.kill(victim[0], signal.SIGSTOP)  # the run stands still mid-step until the spare is in: it joins mid-run however slowly it starts
        spare = subprocess.Popen([*BASE, "worker", "--join", f"127.0.0.1:{port}", "--token-file", str(run_dir / "token")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "FUSIONLLM_LOGLEVEL": "INFO"})
        joined = ""
        while "joined" not in joined and spare.stderr:  # registered (a fixed sleep lost this race on a busy machine)
            joined = spare.stderr.readline()
            assert joined or spare.poll() is None, "the spare exited before it joined"
        threading.Thread(target=spare.stderr.read, daemon=True).start()  # keep its pipe drained
        assert proc.poll() is None
        os.kill(victim[0], signal.SIGKILL)
        text, _ = proc.communicate(timeout=300)
    finally:
        for p in (proc, spare):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, text[-3000:]
    metrics = read_metrics(out)
    events = metrics.of("recovery")
    assert len(events) == 1 and events[0]["workers"] == 3  # two left + the spare
    assert max(r["step"] for r in metrics.steps) == 11


def test_a_worker_that_joins_a_hierarchical_run_forms_a_group_of_its_own(tmp_path: Path) -> None:
    out, run_dir = tmp_path / "m.jsonl", tmp_path / "run"
    # --dead-after 60: both groups are held (SIGSTOP) while the spare starts; their silence must not lose them
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:2", *RUN, "--steps", "16", "--sync", "hierarchical", "--groups", "0/1",
                             "--inner-steps", "4", "--fragments", "2", "--metrics", str(out), "--run-dir", str(run_dir), "--dead-after", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    spare, early = None, []
    try:
        port = coordinator_port(proc.stdout)
        _wait_steps(out, 1, proc)
        held = _workers(run_dir, 0, 1)
        assert len(held) == 2
        _wait_steps(out, 3, proc)
        for pid in held:  # the run stands still until the spare is in: it joins mid-run however slowly it starts
            os.kill(pid, signal.SIGSTOP)
        try:
            spare = subprocess.Popen([*BASE, "worker", "--join", f"127.0.0.1:{port}", "--token-file", str(run_dir / "token")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "FUSIONLLM_LOGLEVEL": "INFO"})
            said = ""
            while "joined" not in said and spare.stderr:  # registered: a spare the coordinator sees
                said = spare.stderr.readline()
                assert said or spare.poll() is None, "the spare exited before it joined"
            threading.Thread(target=spare.stderr.read, daemon=True).start()  # keep its pipe drained
            for line in proc.stdout if proc.stdout else []:  # and until the coordinator scheduled its join: no group runs ahead
                early.append(line)
                if "a new group at outer round" in line:
                    break
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        rest, _ = proc.communicate(timeout=600)
        text = "".join(early) + rest
    finally:
        for p in (proc, spare):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, text[-3000:]
    records = _records(out)
    joined = [r for r in records if r.get("event") == "group_joined"]
    assert len(joined) == 1 and joined[0]["workers"] == [2], text[-3000:]
    steps = {g: [r for r in records if "step" in r and r.get("group") == g] for g in range(3)}
    assert len(steps[0]) == len(steps[1]) == 16
    assert len(steps[2]) == 4 * (4 - joined[0]["round"])  # from its first round to the end
    assert "joined at outer round" in text
