"""A coordinator that restarts while its workers run on (issue 19, part 2), and a worker dropped alive.

Why these can fail: the workers must keep their stages while no coordinator answers, notice the new
one, and report the step their stages completed; the restarted coordinator must gather every stage's
weights and AdamW state and hand them out without losing or repeating a step. A step lost, run
twice, or resumed from the wrong state moves the losses after the restart far beyond 1e-5 relative
of an undisturbed run of the same processes' layout, which is what each case compares with.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fusionllm.control.restart import live_group
from fusionllm.core.checkpoints import latest_checkpoint
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import TransportError
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import InProcessCluster, cluster_config
from fusionllm.launch.local_cluster import free_port
from fusionllm.transport.auth import load_token
from fusionllm.transport.control import Heartbeat, HeartbeatReply, LiveState, Registered
from tests.conftest import Started, hang_in_checkpoint

BASE = [sys.executable, "-m", "fusionllm"]
STEPS = 40  # long enough that a kill after step 2 lands mid-run, even on a busy machine
RUN = ["--model", "gpt-nano", "--batch-size", "8", "--seq-len", "32", "--steps", str(STEPS), "--warmup", "2", "--seed", "1", "--eval-every", "0"]
TOL = 1e-5


class Cluster:
    """A coordinator and its workers as processes on one loopback port, stopped by handle."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.token = root / "token"
        load_token(self.token, create=True)
        self.port = free_port()
        self.workers: list[subprocess.Popen] = []
        self.procs: list[subprocess.Popen] = []

    def coordinator(self, metrics: Path, *extra: str, workers: int = 2) -> subprocess.Popen:
        log = open(self.root / f"{metrics.stem}.log", "wb")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen([*BASE, "coordinator", "--listen", f"127.0.0.1:{self.port}", "--token-file", str(self.token),
                                 "--workers", str(workers), *RUN, "--metrics", str(metrics), "--checkpoint-dir", str(self.root / "ckpt"), *extra],
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def start_workers(self, n: int = 2) -> None:
        for i in range(n):
            log = open(self.root / f"worker-{i}.log", "wb")  # noqa: SIM115
            self.workers.append(subprocess.Popen([*BASE, "worker", "--join", f"127.0.0.1:{self.port}", "--token-file", str(self.token),
                                                  "--threads", "1", "--coordinator-timeout", "120"], stdout=log, stderr=subprocess.STDOUT))
            log.close()
        self.procs.extend(self.workers)

    def log(self, name: str) -> str:
        return (self.root / name).read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _records(path: Path) -> list[dict]:
    return read_metrics(path, missing_ok=True).records


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(path) if "step" in r and "loss" in r}


def _wait_for(what: str, ready: Callable[[], bool], watched: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert all(p.poll() is None for p in watched), f"a process ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)


def _assert_close(got: dict[int, float], reference: dict[int, float]) -> None:
    for step, loss in got.items():
        assert abs(loss - reference[step]) <= TOL * abs(reference[step]), (step, loss, reference[step])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of an undisturbed run: the same coordinator and workers, nobody stopped."""
    c = Cluster(tmp_path_factory.mktemp("reference"))
    try:
        coord = c.coordinator(c.root / "m.jsonl")
        c.start_workers()
        assert coord.wait(timeout=600) == 0, c.log("m.log")[-3000:]
        for w in c.workers:
            assert w.wait(timeout=60) == 0
    finally:
        c.stop()
    losses = _losses(c.root / "m.jsonl")
    assert sorted(losses) == list(range(STEPS))
    return losses


@pytest.fixture
def cluster(tmp_path: Path, started: Started):
    c = Cluster(tmp_path)
    yield c
    c.stop()
    left = started.stop(tmp_path)
    assert not left, f"processes left running: {left}"


def _resume_event(path: Path) -> dict:
    events = [r for r in _records(path) if r.get("event") == "resume"]
    assert len(events) == 1, events
    return events[0]


@pytest.mark.slow
def test_a_killed_coordinator_restarted_continues_from_the_workers_live_state(cluster: Cluster, reference: dict[int, float]) -> None:
    c, first, second = cluster, cluster.root / "m1.jsonl", cluster.root / "m2.jsonl"
    coord = c.coordinator(first)
    c.start_workers()
    _wait_for("step 2", lambda: len(_losses(first)) >= 3, [coord, *c.workers])
    coord.kill()
    killed = time.monotonic()
    coord.wait()
    before = _losses(first)
    assert max(before) < STEPS - 1, "the run ended before the kill: make it longer"
    again = c.coordinator(second, "--resume")
    restarted = time.monotonic()
    _wait_for("a step after the restart", lambda: bool(_losses(second)), [again, *c.workers])
    stepped = time.monotonic()
    assert again.wait(timeout=600) == 0, c.log("m2.log")[-3000:]
    for w in c.workers:  # the same processes, told at the end that the run is over
        assert w.wait(timeout=60) == 0
    event = _resume_event(second)
    print(f"\ncoordinator restart: {stepped - restarted:.1f} s from the new coordinator's start to its first step "
          f"({event['seconds']:.1f} s of it from its Coordinator object to the resumed plan), {stepped - killed:.1f} s from the kill")
    after = _losses(second)
    assert event["from"] == "live" and event["live_workers"] == 2, event
    # the step in flight when it was killed is completed by the workers: its loss is not recorded, its update is kept
    assert max(before) + 1 <= event["resumed_from_step"] <= max(before) + 2 and sorted(after) == list(range(event["resumed_from_step"], STEPS)), (max(before), event)
    _assert_close({**before, **after}, reference)
    for i in range(2):
        assert "re-joined the coordinator" in c.log(f"worker-{i}.log")
    assert latest_checkpoint(c.root / "ckpt") is None  # nothing but the live state to continue from


@pytest.mark.slow
def test_sigint_writes_a_final_checkpoint_and_a_restart_continues_live(cluster: Cluster, reference: dict[int, float]) -> None:
    c, first, second = cluster, cluster.root / "m1.jsonl", cluster.root / "m2.jsonl"
    coord = c.coordinator(first)
    c.start_workers()
    _wait_for("step 2", lambda: len(_losses(first)) >= 3, [coord, *c.workers])
    coord.send_signal(signal.SIGINT)
    assert coord.wait(timeout=120) == 128 + signal.SIGINT, c.log("m1.log")[-3000:]
    before = _losses(first)
    reached = max(before) + 1
    assert reached < STEPS, "the run ended before the signal: make it longer"
    ckpt = latest_checkpoint(c.root / "ckpt")
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] == reached, (ckpt, reached)
    assert "final checkpoint" in c.log("m1.log")
    assert all(w.poll() is None for w in c.workers)  # told to wait for a restart, not to exit
    again = c.coordinator(second, "--resume")
    assert again.wait(timeout=600) == 0, c.log("m2.log")[-3000:]
    for w in c.workers:
        assert w.wait(timeout=60) == 0
    event = _resume_event(second)
    assert event["from"] == "live" and event["resumed_from_step"] == reached, event
    after = _losses(second)
    assert sorted({**before, **after}) == list(range(STEPS))  # not a step lost, none run twice
    _assert_close({**before, **after}, reference)


@pytest.mark.slow
def test_a_restart_with_a_stage_missing_continues_from_the_newest_checkpoint(cluster: Cluster, reference: dict[int, float]) -> None:
    c, first, second = cluster, cluster.root / "m1.jsonl", cluster.root / "m2.jsonl"
    coord = c.coordinator(first, "--checkpoint-every", "2")
    c.start_workers()
    _wait_for("step 4", lambda: len(_losses(first)) >= 5, [coord, *c.workers])
    coord.kill()
    coord.wait()
    c.workers[1].kill()  # while no coordinator runs: its stage is gone
    c.workers[1].wait()
    newest = latest_checkpoint(c.root / "ckpt")
    assert newest is not None
    at = json.loads((newest / "state.json").read_text())["step"]
    again = c.coordinator(second, "--resume", workers=1)
    assert again.wait(timeout=600) == 0, c.log("m2.log")[-3000:]
    assert c.workers[0].wait(timeout=60) == 0
    event = _resume_event(second)
    assert event["from"] == "checkpoint" and event["resumed_from_step"] == at and "held by no worker" in event["why_not_live"], event
    after = _losses(second)
    assert sorted(after) == list(range(at, STEPS))
    _assert_close(after, reference)


HIER = ["--sync", "hierarchical", "--groups", "0/1", "--inner-steps", "2", "--fragments", "1", "--micro-batches", "2", "--blocking-sync"]


def _group_losses(path: Path) -> dict[tuple[int, int], float]:
    return {(r["group"], r["inner_step"]): r["loss"] for r in _records(path) if "inner_step" in r and "loss" in r}


@pytest.mark.slow
def test_a_killed_hierarchical_coordinator_restarted_continues_from_one_groups_outer_state(cluster: Cluster) -> None:
    """Hierarchical mode: the workers report the step of the outer weights and momentum every
    fragment applied; the restarted coordinator reads one group's and starts every group there, on
    the batches it would have read. The first loss of each group after the restart is the
    undisturbed run's at that step (the outer weights are what each group's weights were then)."""
    c = cluster
    ref, first, second = c.root / "ref.jsonl", c.root / "m1.jsonl", c.root / "m2.jsonl"
    coord = c.coordinator(ref, *HIER)
    c.start_workers()
    assert coord.wait(timeout=600) == 0, c.log("ref.log")[-3000:]
    for w in c.workers:
        assert w.wait(timeout=60) == 0
    reference = _group_losses(ref)
    assert sorted(reference) == [(g, i) for g in (0, 1) for i in range(STEPS)]
    shutil.rmtree(c.root / "ckpt", ignore_errors=True)  # (the reference's last checkpoint)
    c.workers.clear()
    coord = c.coordinator(first, *HIER)
    c.start_workers()
    _wait_for("an outer round applied", lambda: len(_group_losses(first)) >= 8, [coord, *c.workers])
    coord.kill()
    coord.wait()
    assert all(w.poll() is None for w in c.workers)
    again = c.coordinator(second, *HIER, "--resume")
    assert again.wait(timeout=600) == 0, c.log("m2.log")[-3000:]
    for w in c.workers:
        assert w.wait(timeout=60) == 0
    event = _resume_event(second)
    at = event["resumed_from_step"]
    assert event["from"] == "live" and event["live_workers"] == 2, event
    assert at >= 2 and at % 2 == 0, event  # a round boundary
    after = _group_losses(second)
    assert sorted(after) == [(g, i) for g in (0, 1) for i in range(at, STEPS)]
    for g in (0, 1):
        assert abs(after[(g, at)] - reference[(g, at)]) <= TOL * abs(reference[(g, at)]), (g, at, after[(g, at)], reference[(g, at)])
    assert latest_checkpoint(c.root / "ckpt") is None  # nothing but the live state to continue from


@pytest.mark.slow  # about 10 s: the make test tier
def test_a_worker_dropped_alive_rejoins_as_a_spare_under_its_new_address(tmp_path: Path) -> None:
    """A worker whose link to the coordinator drops past --dead-after is re-planned around; when the
    link comes back, under another address, it registers again as a spare and the next re-plan
    (another worker lost) takes it in."""
    train = TrainConfig(model="gpt-nano", steps=100_000, batch_size=8, seq_len=32, lr=3e-3, warmup=1, eval_every=0, seed=0)
    cluster = cluster_config(3, dead_after=4.0, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3, step_timeout=120.0)
    options = [{"heartbeat_s": 0.5}, {"heartbeat_s": 0.5}, {"heartbeat_s": 0.5, "listen": "0.0.0.0:0"}]

    async def until(what: str, ready: Callable[[], bool], run: asyncio.Task, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert not run.done(), f"the run ended while waiting for {what}: {run.exception() if not run.cancelled() else 'cancelled'}"
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
            await asyncio.sleep(0.05)

    async def main() -> None:
        async with InProcessCluster(train, cluster, worker_options=options) as c:
            run = asyncio.create_task(c.run())
            try:
                await until("step 2", lambda: len(c.steps) >= 3, run)
                dropped = c.workers[2]
                assert dropped.me.address.startswith("127.0.0.1:")
                real_call, outage = dropped.coordinator.call, [True]

                async def call(method: str, msg: dict, **kw: object) -> dict:
                    if outage[0]:
                        raise TransportError(f"{dropped.config.join} is unreachable ({method}): the link is down")
                    return await real_call(method, msg, **kw)

                dropped.coordinator.call = call  # type: ignore[method-assign]
                dropped.link.host_towards_coordinator = lambda: "127.0.0.2"  # back on another network
                coordinator = c.coordinator
                assert coordinator is not None
                # recoveries counts from the start of a recovery; the member goes once its survivors are aborted
                await until("the dropped worker's loss", lambda: coordinator.recovery.recoveries >= 1 and len(coordinator.membership.members) == 2, run)
                assert coordinator.recovery.recoveries == 1
                outage[0] = False
                spare = lambda: [m for w, m in coordinator.membership.members.items() if w in coordinator.membership.spares]  # noqa: E731
                await until("the spare", lambda: bool(spare()), run)
                assert spare()[0].address.startswith("127.0.0.2:") and dropped.me.address.startswith("127.0.0.2:")
                c.workers[1].done.set()  # another worker goes: the re-plan takes the spare in
                await until("the second recovery", lambda: coordinator.recovery.recoveries >= 2, run)
                steps = len(c.steps)
                await until("steps on the new plan", lambda: len(c.steps) >= steps + 3, run)
                addresses = {m.address for m in coordinator.membership.members.values()}
                assert dropped.me.address in addresses and len(addresses) == 2
                assert {w["address"] for w in coordinator.setup.plan_record["workers"].values() if w["in_plan"]} == addresses
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)

    asyncio.run(main())


def test_a_worker_that_hangs_in_a_checkpoint_is_lost_by_its_heartbeat_not_the_step_timeout(tmp_path: Path) -> None:
    """A hung worker (SIGSTOP: its connections stay open) in the middle of a checkpoint: the
    coordinator must watch heartbeats there as it does during steps, lose the worker after
    --dead-after and re-plan. Before that watch it waited for the SaveShard reply until the step
    timeout (an hour here: the test would time out)."""
    train = TrainConfig(model="gpt-nano", steps=100_000, batch_size=8, seq_len=32, lr=3e-3, warmup=1, eval_every=0, seed=0)
    cluster = cluster_config(3, dead_after=3.0, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, step_timeout=3600.0)

    async def main() -> None:
        async with InProcessCluster(train, cluster, worker_options={"heartbeat_s": 0.5}) as c:
            run = asyncio.create_task(c.run())
            try:
                deadline = time.monotonic() + 120
                while len(c.steps) < 1:
                    assert not run.done() and time.monotonic() < deadline, "no first step"
                    await asyncio.sleep(0.05)
                hung_now = hang_in_checkpoint(c.workers[-1])  # the last stage: the checkpoint asks it for its shard
                coordinator = c.coordinator
                assert coordinator is not None
                deadline = time.monotonic() + 300
                while not (coordinator.recovery.recoveries >= 1 and len(coordinator.membership.members) == 2):
                    assert not run.done(), f"the run ended: {run.exception() if not run.cancelled() else 'cancelled'}"
                    assert time.monotonic() < deadline, "the hung worker was never lost (the checkpoint waits for it)"
                    await asyncio.sleep(0.05)
                assert hung_now[0], "the worker was lost before it hung in the checkpoint"
                steps = len(c.steps)
                while len(c.steps) < steps + 2:
                    assert not run.done() and time.monotonic() < deadline, "no steps after the recovery"
                    await asyncio.sleep(0.05)
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)

    asyncio.run(main())


# ---- the pieces, without processes ---------------------------------------------------------------
def _held(step: int, stage: int, stages: int = 2, plan: str = "p", epoch: int = 0) -> LiveState:
    return LiveState(step, stage, stages, epoch, plan, "g", 1)


def test_live_state_is_usable_only_with_every_stage_at_one_step() -> None:
    assert live_group({0: _held(7, 0), 1: _held(7, 1)}) == (7, {0: 0, 1: 1})
    assert live_group({0: _held(7, 0), 1: _held(7, 1), 2: _held(7, 1)}) == (7, {0: 0, 1: 1})  # a replica: one holder is enough
    assert "held by no worker" in str(live_group({0: _held(7, 0)}))
    assert "different steps" in str(live_group({0: _held(7, 0), 1: _held(6, 1)}))
    assert "stage" in str(live_group({0: _held(7, 0), 1: _held(7, 1, plan="other")}))  # two plans, neither whole
    assert live_group({}) == "no worker holds a stage"
    assert "step" in str(live_group({0: _held(-1, 0), 1: _held(-1, 1)}))  # assigned, step unknown
    # an older plan whole too: the newest step wins
    assert live_group({0: _held(3, 0, plan="old"), 1: _held(3, 1, plan="old"), 2: _held(9, 0), 3: _held(9, 1)}) == (9, {0: 2, 1: 3})


def test_a_coordinator_says_who_it_is_and_whom_it_does_not_know() -> None:
    from fusionllm import __version__
    from fusionllm.control.membership import Membership
    from fusionllm.transport import PROTOCOL_VERSION

    async def main() -> None:
        m = Membership(2)
        base = {"version": __version__, "protocol": PROTOCOL_VERSION}
        live = _held(5, 1).to_wire()
        first = Registered.from_wire(await m.register({**base, "address": "h:1", "rank": 1, "live": live}))
        assert first.worker == 1 and first.incarnation == m.incarnation and not first.spare
        again = Registered.from_wire(await m.register({**base, "address": "h:1", "rank": 1, "live": live}))
        assert again.worker == 1 and len(m.members) == 1  # a retried Register is the same member
        taken = Registered.from_wire(await m.register({**base, "address": "h:2", "rank": 1, "live": _held(5, 0).to_wire()}))
        assert taken.worker == 0  # back with a stage: its old id is taken, so it takes another
        beat = HeartbeatReply.from_wire(await m.heartbeat(Heartbeat(1, "h:1").to_wire()))
        assert beat.known and beat.incarnation == m.incarnation
        assert not HeartbeatReply.from_wire(await m.heartbeat(Heartbeat(1, "h:9").to_wire())).known  # a new address
        m.state = "running"
        spare = Registered.from_wire(await m.register({**base, "address": "h:9"}))
        assert spare.spare and spare.worker == 2
        assert Membership(2).incarnation != m.incarnation

    asyncio.run(main())
