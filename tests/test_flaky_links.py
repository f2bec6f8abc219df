"""A link that drops for a few seconds costs seconds, not the run (issue 19, flapping links).

The links are real TCP on loopback, dropped by a proxy (``fusionllm.testbed.flaky.FlakyLink``) that
resets every connection while it is down. The outages end on events (the senders tried again so many
times), never after a sleep.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import FusionError, WireError
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import InProcessCluster, cluster_config
from fusionllm.runtime.worker.peers import Inbox, PeerNet
from fusionllm.runtime.worker.worker import Worker, WorkerConfig
from fusionllm.testbed.flaky import FlakyLink, FlakyNet
from fusionllm.testbed.sh import can_emulate
from fusionllm.testbed.testbed import STATE
from fusionllm.transport.frames import tensor_frames
from fusionllm.transport.stream import DataServer

TOKEN = "flaky-link-token-" * 3
ROOT = Path(__file__).resolve().parents[1]
EMULATED, WHY = can_emulate()


async def _stream(frames: list[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield f


def _message(mb: int, array: np.ndarray, *, msg: str | None, attempt: int = 0) -> list[bytes]:
    header: dict[str, Any] = {"kind": "act", "step": 4, "mb": mb, "edge": "e", "src": 0, "epoch": 0, "attempt": attempt,
                              "dtype": "float32", "shape": list(array.shape), "codec": "raw"}
    if msg is not None:
        header["msg"] = msg
    return list(tensor_frames(header, memoryview(array).cast("B")))


def test_a_copy_of_a_filed_tensor_is_dropped_and_a_different_one_refused() -> None:
    """Why it can fail: an inbox that files a key once refuses the copy a sender sends again after
    losing the first one's ack (the run dies of a dropped link); one that files every copy would
    accept a different tensor under a used key."""

    async def main() -> None:
        inbox = Inbox(1 << 20)
        a, b = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
        key = ("act", 4, 0, "e", 0)
        await inbox.receive(_stream(_message(0, a, msg="m1")))
        await inbox.receive(_stream(_message(0, a, msg="m1")))  # sent again: its ack was lost
        assert inbox.resent == 1
        with pytest.raises(WireError, match="different tensor"):
            await inbox.receive(_stream(_message(0, b, msg="m2")))
        with pytest.raises(WireError, match="different tensor"):  # a sender that stamps no id cannot resend
            await inbox.receive(_stream(_message(0, a, msg=None)))
        assert np.array_equal(await inbox.get(key, 5), a)
        await inbox.receive(_stream(_message(0, a, msg="m1")))  # a copy that comes after the tensor was read
        with pytest.raises(WireError, match="different tensor"):
            await inbox.receive(_stream(_message(0, b, msg="m3")))
        await inbox.receive(_stream(_message(0, b, msg="m4", attempt=1)))  # the step run again after a bad tensor
        assert np.array_equal(await inbox.get(key, 5), b)
        stale = inbox.stale
        await inbox.receive(_stream(_message(0, a, msg="m5", attempt=0)))  # a late one of the earlier attempt
        assert inbox.stale == stale + 1 and inbox.resent == 2

    asyncio.run(main())


def test_a_push_rides_out_a_dropped_link(caplog: pytest.LogCaptureFixture) -> None:
    """Why it can fail: the tensor reached the peer but its ack did not, then the link stayed down
    for several connection attempts; a push that does not connect again, or a peer that refuses the
    copy sent again, fails the step."""

    async def main() -> tuple[Inbox, int]:
        inbox = Inbox(1 << 20)
        server = DataServer(TOKEN, inbox.receive, max_payload=1 << 20)
        link = FlakyLink(("127.0.0.1", await server.start("127.0.0.1")))
        await link.start()
        net = PeerNet({}, TOKEN, data_addresses={1: link.address})
        try:
            first, second = np.arange(4, dtype=np.float32), np.full(5, 2.0, np.float32)
            await net.push(1, {"kind": "act", "step": 0, "mb": 0, "edge": "e", "src": 0}, first, 30)  # the link is up
            link.cut_on_reply()  # the next ack is lost and the link goes down
            push = asyncio.create_task(net.push(1, {"kind": "act", "step": 0, "mb": 1, "edge": "e", "src": 0}, second, 120))
            trying = asyncio.create_task(link.wait_resets(4))  # the sender kept trying while the link was down
            await asyncio.wait({push, trying}, return_when=asyncio.FIRST_COMPLETED)
            trying.cancel()
            assert not push.done(), f"the push ended while the link was down: {push.exception()}"
            link.restore()
            await push
            assert np.array_equal(await inbox.get(("act", 0, 1, "e", 0), 5), second)
            assert np.array_equal(await inbox.get(("act", 0, 0, "e", 0), 5), first)
            return inbox, link.cuts
        finally:
            await net.close()
            await link.stop()
            await server.stop()

    with caplog.at_level(logging.WARNING):
        inbox, cuts = asyncio.run(main())
    assert cuts == 1 and inbox.resent == 1  # the copy sent again was dropped, the first one kept
    lines = [r.getMessage() for r in caplog.records]
    assert sum("dropped" in line for line in lines) == 1 and sum("is back after" in line for line in lines) == 1, lines


def test_a_network_that_drops_mid_step_costs_seconds_not_the_run(tmp_path: Path) -> None:
    """Every link of a 3-worker pipeline (control, data, heartbeats) drops twice: in the middle of
    step 2, when worker 1 has filed a tensor whose ack is then lost, and as the checkpoint after step
    4 begins; each time it stays down until the senders have tried several times. Why it can fail:
    the coordinator's calls break (without retries the workers look dead and the run is re-planned
    or lost); a worker that runs a repeated Step twice, or whose step is cancelled with the broken
    call, hangs the pipeline; a data push that gives up, or a receiver that refuses the copy sent
    again, fails the step. The run must finish with the losses of an undisturbed run, with no
    recovery and no re-plan."""
    train = TrainConfig(model="gpt-nano", steps=5, batch_size=8, seq_len=32, lr=3e-3, warmup=1, eval_every=0, seed=0)

    def config(name: str) -> Any:
        return cluster_config(3, micro_batches=2, step_timeout=120.0, checkpoint_dir=str(tmp_path / name), checkpoint_every=4)

    async def undisturbed() -> list[float]:
        async with InProcessCluster(train, config("ref")) as c:
            return (await c.run()).losses

    async def flapping() -> tuple[list[float], InProcessCluster, FlakyNet]:
        net = FlakyNet(3, lambda: cluster.port)
        options = await net.start()
        links, data, control = net.links, net.data, net.control
        second = asyncio.Event()

        def on_step(record: dict) -> None:
            if record["step"] == 1:  # step 2 starts next: drop everything when worker 1 acks its first tensor
                data[1].cut_on_reply(also=[link for link in links if link is not data[1]])
            if record["step"] == 3:  # the checkpoint of 4 steps comes next
                net.cut()
                second.set()

        async def end_outage() -> None:
            await data[1].wait_resets(5)  # its senders tried again (backing off)
            await control[1].wait_resets(5)  # and the coordinator's channel to worker 1 five times (backing off: seconds)
            net.restore()
            await second.wait()
            await control[1].wait_resets(control[1].resets + 3)
            net.restore()

        try:
            async with InProcessCluster(train, config("flap"), worker_options=options, on_step=on_step) as cluster:
                ending = asyncio.create_task(end_outage())
                try:
                    result = await cluster.run()
                    assert ending.done(), "the run finished while the links were still down"
                finally:
                    ending.cancel()
            return result.losses, cluster, net
        finally:
            await net.stop()

    reference = asyncio.run(undisturbed())
    losses, cluster, net = asyncio.run(flapping())
    assert losses == reference  # the same steps, run once each, as without the outage
    assert [r["step"] for r in cluster.steps] == list(range(train.steps))
    assert cluster.coordinator is not None and cluster.coordinator.recovery.recoveries == 0 and cluster.coordinator.recovery.replans == 0
    assert all(link.cuts == 2 for link in net.links)
    assert sorted(p.name for p in (tmp_path / "flap").iterdir()) == sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert cluster.workers[1].inbox.resent >= 1  # the tensor whose ack was lost came again and was dropped
    assert sum(w.repeated_calls for w in cluster.workers) >= 1  # a broken Step call was answered by the run under way


def test_a_call_asked_again_is_answered_by_the_same_run() -> None:
    """Why it can fail: a worker that runs a Step (or an Evaluate, a SaveShard) asked again after a
    dropped link broke the first call would run it twice (a step's tensors sent twice, its update
    applied twice); one whose run is cancelled with the broken call would never answer."""

    async def main() -> None:
        worker = Worker(WorkerConfig(join="127.0.0.1:1", token=TOKEN, backend="numpy"))
        started, go, runs = asyncio.Event(), asyncio.Event(), []

        async def work() -> dict[str, Any]:
            runs.append(len(runs))
            started.set()
            await go.wait()
            return {"run": runs[-1]}

        first = asyncio.create_task(worker._once("Step", (3, 0), work))
        await started.wait()
        first.cancel()  # the call broke with the link
        again = asyncio.create_task(worker._once("Step", (3, 0), work))
        go.set()
        assert await again == {"run": 0} and runs == [0] and worker.repeated_calls == 1
        assert await worker._once("Step", (3, 0), work) == {"run": 0}  # asked once more after it ended: the kept reply
        assert await worker._once("Step", (3, 1), work) == {"run": 1}  # a later attempt is another run
        assert await worker._once("Evaluate", (3, 0), work) == {"run": 2}  # so is another method's call

    asyncio.run(main())


def test_an_abort_that_overtakes_its_step_is_remembered_until_the_next_assignment() -> None:
    """Why it can fail: a Step call that arrives after its Abort (the two crossed on the network)
    would start a step whose peers accept nothing any more, and wait for their tensors until the
    step timeout."""
    from fusionllm.transport.control import Step, StepDone

    async def main() -> None:
        worker = Worker(WorkerConfig(join="127.0.0.1:1", token=TOKEN, backend="numpy"))
        with pytest.raises(FusionError, match="Step before Assign"):  # without the Abort, the Step would try to run
            await worker._on_step(Step(3, 1e-3).to_wire())
        await worker._on_abort({})
        done = StepDone.from_wire(await asyncio.wait_for(worker._on_step(Step(3, 1e-3).to_wire()), 5))
        assert done.aborted and worker.running.task is None  # answered at once, nothing started

    asyncio.run(main())


TESTBED_STEPS = 16  # the link drops after step 6; the steps after it show the run goes on, to the same losses
UNIFORM = ROOT / "examples" / "clusters" / "uniform.toml"


def _testbed_train(tmp_path: Path, tag: str, *cluster: str) -> tuple[subprocess.Popen, Path]:
    """A run on the emulated uniform cluster; or, given ``cluster`` flags, the same plan elsewhere."""
    out = tmp_path / f"{tag}.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "fusionllm", "train", *(cluster or ["--cluster", str(UNIFORM)]),
                             "--scheduler", "params", "--sync", "synchronous", "--replan-factor", "0",  # a pipeline through all 4 workers, kept as planned
                             "--model", "gpt-nano", "--steps", str(TESTBED_STEPS), "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--seed", "2",
                             "--metrics", str(out), "--run-dir", str(tmp_path / f"run-{tag}")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def _records(path: Path) -> list[dict]:
    return read_metrics(path, missing_ok=True).records


@pytest.mark.slow  # like tests/test_testbed.py: processes in network namespaces, root only
@pytest.mark.testbed
@pytest.mark.skipif(not EMULATED, reason=f"testbed needs root on Linux with iproute2: {WHY}")
def test_a_veth_down_for_five_seconds_costs_seconds_not_the_run(tmp_path: Path) -> None:
    """Worker 1's veth (of the emulated uniform cluster) goes down for 5 s mid-run: its packets are
    dropped both ways and nothing is reset, so calls and pushes in flight stall and new connections
    time out. Why it can fail: the worker's heartbeats stop for the outage and then some (they must
    not reach --dead-after, 10 s), a stalled call or push must neither give up nor be run twice, and
    the losses must equal an undisturbed run's, with no recovery and no re-plan."""
    # the undisturbed reference: the same plan (the cluster file's devices: --hardware) on loopback. The
    # losses follow from the plan, not from the links (a testbed run gives the same, bit for bit), and
    # loopback spares a second testbed: its namespaces, and its workers' start-up at half a CPU each
    ref, ref_out = _testbed_train(tmp_path, "ref", "--cluster", "local:4", "--hardware", str(UNIFORM))
    text, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, text[-3000:]
    proc, out = _testbed_train(tmp_path, "flap")
    try:
        while proc.poll() is None and len([r for r in _records(out) if "step" in r]) < 6:
            time.sleep(0.02)
        assert proc.poll() is None, "training ended before the link could drop"
        assert json.loads(STATE.read_text()).get("owner") == proc.pid, "the live testbed is not this run's"  # (the machine is shared)
        subprocess.run(["ip", "link", "set", "fusion-v1", "down"], check=True)
        try:
            time.sleep(5.0)  # the outage itself, not a wait for something to happen
        finally:
            subprocess.run(["ip", "link", "set", "fusion-v1", "up"], check=True)
        assert proc.poll() is None and len([r for r in _records(out) if "step" in r]) < TESTBED_STEPS, "the run did not wait for the link"
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, text[-3000:]
    records = _records(out)
    assert [r["step"] for r in records if "step" in r] == list(range(TESTBED_STEPS))
    assert [r.get("event") for r in records if r.get("event") not in (None, "plan", "calibrated")] == []  # no recovery, no re-plan
    assert [r["loss"] for r in records if "step" in r] == [r["loss"] for r in _records(ref_out) if "step" in r]


def test_an_assignment_is_sent_again_whole_over_a_dropped_link() -> None:
    """Why it can fail: an Assign whose reply was lost (or whose stream broke) ends the setup and costs
    a re-plan; one sent again must arrive whole, and the worker takes only a whole one."""
    from fusionllm.transport.rpc import RpcClient, RpcServer

    async def main() -> None:
        taken: list[bytes] = []

        async def assign(frames: AsyncIterator[bytes]) -> dict[str, Any]:
            whole = b"".join([f async for f in frames])  # nothing changes before the whole stream is read
            taken.append(whole)
            return {"n": len(whole)}

        server = RpcServer("test.Svc", TOKEN, control={}, streams={"Assign": assign})
        link = FlakyLink(("127.0.0.1", await server.start("127.0.0.1:0")))
        await link.start()
        client = RpcClient(link.address, "test.Svc", TOKEN)
        frames = [b"head"] + [bytes([i]) * 65536 for i in range(8)]
        try:
            link.cut_on_reply()  # the first assignment is taken, its reply lost, and the link stays down a while
            push = asyncio.create_task(client.push_retrying("Assign", frames, within=60, timeout=30))
            await link.wait_cut()
            await link.wait_resets(3)
            assert not push.done(), f"the push ended while the link was down: {push.exception()}"
            link.restore()
            assert (await push)["n"] == sum(map(len, frames))
            assert taken and all(t == b"".join(frames) for t in taken), [len(t) for t in taken]
        finally:
            await client.close()
            await link.stop()
            await server.stop(0)

    asyncio.run(main())
