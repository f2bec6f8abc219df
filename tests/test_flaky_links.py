"""A link that drops for a few seconds costs seconds, not the run (issue 19, flapping links).

The links are real TCP on loopback, dropped by a proxy (``fusionllm.testbed.flaky.FlakyLink``) that
resets every connection while it is down. The outages end on events (the senders tried again so many
times), never after a sleep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import WireError
from fusionllm.harness import InProcessCluster, cluster_config
from fusionllm.runtime.peers import Inbox, PeerNet
from fusionllm.testbed.flaky import FlakyLink
from fusionllm.transport.frames import tensor_frames
from fusionllm.transport.stream import DataServer

TOKEN = "flaky-link-token-" * 3
WORKER_HOST, PROXY_HOST = "127.0.0.2", "127.0.0.3"  # a worker listens on one loopback address and is reached through the other


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
            await link.wait_resets(4)  # the sender kept trying while the link was down
            assert not push.done()
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


def test_a_network_that_drops_mid_step_costs_seconds_not_the_run() -> None:
    """Every link of a 3-worker pipeline (control, data, heartbeats) drops in the middle of step 2,
    when worker 1 has filed a tensor whose ack is then lost, and stays down until the senders have
    tried several times. Why it can fail: the coordinator's Step calls break mid-step (without
    retries the workers look dead and the run is re-planned or lost); a worker that runs a repeated
    Step twice, or whose step is cancelled with the broken call, hangs the pipeline; a data push that
    gives up, or a receiver that refuses the copy sent again, fails the step. The run must finish with
    the losses of an undisturbed run, with no recovery and no re-plan."""
    train = TrainConfig(model="gpt-nano", steps=5, batch_size=8, seq_len=32, lr=3e-3, warmup=1, eval_every=0, seed=0)

    async def undisturbed() -> list[float]:
        async with InProcessCluster(train, cluster_config(3, micro_batches=2, step_timeout=120.0)) as c:
            return (await c.run()).losses

    async def flapping() -> tuple[list[float], InProcessCluster, list[FlakyLink]]:
        to_coordinator = FlakyLink(lambda: ("127.0.0.1", cluster.port), host=PROXY_HOST)
        control = [FlakyLink(("", 0), host=PROXY_HOST) for _ in range(3)]
        data = [FlakyLink(("", 0), host=PROXY_HOST) for _ in range(3)]
        links = [to_coordinator, *control, *data]
        for link in links:
            await link.start()
        for link in (*control, *data):
            link.target = (WORKER_HOST, link.port)  # the worker listens on the proxy's port, on its own address
        options = [{"listen": f"{WORKER_HOST}:{control[i].port}", "data_port": data[i].port, "advertise": PROXY_HOST,
                    "join": to_coordinator.address} for i in range(3)]

        def on_step(record: dict) -> None:
            if record["step"] == 1:  # step 2 starts next: drop everything when worker 1 acks its first tensor
                data[1].cut_on_reply(also=[link for link in links if link is not data[1]])

        async def end_outage() -> None:
            await data[1].wait_resets(5)  # its senders tried again (backing off)
            await control[1].wait_resets(5)  # and the coordinator's channel to worker 1 five times (backing off: seconds)
            for link in links:
                link.restore()

        try:
            async with InProcessCluster(train, cluster_config(3, micro_batches=2, step_timeout=120.0), worker_options=options,
                                        on_step=on_step) as cluster:
                ending = asyncio.create_task(end_outage())
                try:
                    result = await cluster.run()
                    assert ending.done(), "the run finished while the links were still down"
                finally:
                    ending.cancel()
            return result.losses, cluster, links
        finally:
            for link in links:
                await link.stop()

    reference = asyncio.run(undisturbed())
    losses, cluster, links = asyncio.run(flapping())
    assert losses == reference  # the same steps, run once each, as without the outage
    assert [r["step"] for r in cluster.steps] == list(range(train.steps))
    assert cluster.coordinator is not None and cluster.coordinator.recoveries == 0 and cluster.coordinator.replans == 0
    assert all(link.cuts == 1 for link in links)
    assert cluster.workers[1].inbox.resent >= 1  # the tensor whose ack was lost came again and was dropped
    assert sum(w.repeated_steps for w in cluster.workers) >= 1  # a broken Step call was answered by the run under way
