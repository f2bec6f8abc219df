"""The worker's parts (coordinator link, NAT, worlds, the step running now), each built with fakes:
no processes, no sockets.

Why these checks can fail: a part that reaches into another's attributes (building it with only its
constructor's arguments fails), a link that does not tell a restarted coordinator the stage it holds
or keeps obeying the coordinator it left, a worker behind NAT that does not move when its relay goes
away (or moves without telling the coordinator), a world that is not torn down after a failed
formation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from fusionllm.core.errors import FusionError, TransportError
from fusionllm.runtime.worker.coordinator_link import CoordinatorLink
from fusionllm.runtime.worker.nat_link import NatLink
from fusionllm.runtime.worker.running import Running
from fusionllm.runtime.worker.worker_config import Identity, WorkerConfig
from fusionllm.runtime.worker.world_link import WorldLink
from fusionllm.transport.control import (
    Collective,
    Heartbeat,
    HeartbeatReply,
    LiveState,
    Reach,
    ReachReply,
    Register,
    Registered,
    StepDone,
)

TOKEN = "t" * 32


class FakeCoordinator:
    """Answers each call from ``answers[method]`` (a function of the message; it may raise)."""

    def __init__(self, answers: dict[str, Callable[[dict], dict]]) -> None:
        self.answers, self.calls, self.closed = answers, [], 0

    async def call(self, method: str, msg: dict, timeout: float | None = None) -> dict:
        self.calls.append((method, msg))
        return self.answers[method](msg)

    async def close(self) -> None:
        self.closed += 1

    def sent(self, method: str) -> list[dict]:
        return [m for name, m in self.calls if name == method]


BACKEND = SimpleNamespace(name="numpy", software=lambda: {"numpy": "2"}, kinds=lambda: "*", threads=lambda: 1,
                          matmul_flops=lambda device, seconds: 2e9)


def _config(**options: Any) -> WorkerConfig:
    return WorkerConfig(**{"join": "127.0.0.1:1", "token": TOKEN, "listen": "127.0.0.1:0", "heartbeat_s": 0.01, **options})


def a_link(answers: dict[str, Callable[[dict], dict]] | None = None, outer_step: int | None = None,
           **options: Any) -> tuple[CoordinatorLink, SimpleNamespace]:
    """A coordinator link built from fakes; ``parts`` holds them (and the exit codes asked for)."""
    config = _config(**options)
    coordinator = FakeCoordinator(answers or {})
    me = Identity(address="10.0.0.5:7000", data_address="10.0.0.5:7001")
    done = asyncio.Event()
    stops: list[int] = []

    def stop(code: int) -> None:
        stops.append(code)
        done.set()

    async def announce() -> None:
        return None

    nat = NatLink(config, coordinator, me, done, announce)  # type: ignore[arg-type]
    running = Running()
    link = CoordinatorLink(config, BACKEND, coordinator, me, nat, running, done, stop, lambda: outer_step)  # type: ignore[arg-type]
    return link, SimpleNamespace(coordinator=coordinator, me=me, done=done, stops=stops, nat=nat, running=running)


def _live(step: int = 5, outer: bool = False) -> LiveState:
    return LiveState(step, stage=1, stages=2, epoch=0, plan="p", graph="g", seed=0, outer=outer)


def test_the_link_registers_what_the_worker_is_and_takes_the_id_it_is_given() -> None:
    link, parts = a_link({"Register": lambda msg: Registered(3, "aaaa").to_wire()})
    asyncio.run(link.register({"kind": "cpu"}))
    sent = Register.from_wire(parts.coordinator.sent("Register")[0])
    assert (sent.address, sent.data_address, sent.backend, sent.probe) == ("10.0.0.5:7000", "10.0.0.5:7001", "numpy", {"matmul_flops": 2e9})
    assert sent.relay_offer == "" and sent.relay == "" and sent.live is None
    assert parts.me.id == 3 and link.incarnation == "aaaa" and link.join_s >= 0


def test_a_restarted_coordinator_is_told_the_stage_held_and_the_old_one_is_refused() -> None:
    link, parts = a_link()
    link._joined(Registered(3, "aaaa"))
    link.hold(_live(step=5))

    def register(msg: dict) -> dict:
        parts.done.set()  # one round is enough
        return Registered(3, "bbbb").to_wire()

    parts.coordinator.answers.update({"Heartbeat": lambda msg: HeartbeatReply("running", incarnation="bbbb").to_wire(), "Register": register})
    link._request = Register(version="v", protocol=1, address="old:1")
    asyncio.run(asyncio.wait_for(link.heartbeat(), 10))
    again = Register.from_wire(parts.coordinator.sent("Register")[0])
    assert again.live == _live(step=5) and again.rank == 3 and again.address == "10.0.0.5:7000"
    assert Heartbeat.from_wire(parts.coordinator.sent("Heartbeat")[0]).worker == 3
    assert link.fence("aaaa") is not None and "newer one" in link.fence("aaaa") and link.fence("bbbb") is None
    assert parts.stops == []


def test_a_worker_the_coordinator_dropped_aborts_its_step_and_joins_as_a_spare() -> None:
    link, parts = a_link()
    link._joined(Registered(3, "aaaa"))
    link._request = Register(version="v", protocol=1, address="old:1")

    def register(msg: dict) -> dict:
        parts.done.set()
        return Registered(7, "aaaa", spare=True).to_wire()

    parts.coordinator.answers.update({"Heartbeat": lambda msg: HeartbeatReply("running", incarnation="aaaa", known=False).to_wire(),
                                      "Register": register})

    async def main() -> asyncio.Task:
        step = asyncio.create_task(parts.running.run(asyncio.Event().wait()))  # a step that would never end
        await asyncio.sleep(0)
        await asyncio.wait_for(link.heartbeat(), 10)
        assert await step is None  # aborted, not failed
        return step

    asyncio.run(main())
    assert Register.from_wire(parts.coordinator.sent("Register")[0]).rank is None and parts.me.id == 7


def test_the_link_stops_the_worker_when_the_run_finished_or_the_coordinator_stays_away() -> None:
    link, parts = a_link({"Heartbeat": lambda msg: HeartbeatReply("finished").to_wire()})
    asyncio.run(asyncio.wait_for(link.heartbeat(), 10))
    assert parts.stops == [0]

    def gone(msg: dict) -> dict:
        raise TransportError("connection refused")

    link, parts = a_link({"Heartbeat": gone}, coordinator_timeout=0.0)
    asyncio.run(asyncio.wait_for(link.heartbeat(), 10))
    assert parts.stops == [1] and parts.coordinator.closed == 1  # the next try on a new connection


def test_a_completed_step_advances_the_stage_held_and_a_skipped_one_does_not() -> None:
    link, _ = a_link()
    assert link.held() is None
    link.hold(_live(step=2))

    async def reply(done: StepDone) -> StepDone:
        return done

    asyncio.run(link.counted(4, reply(StepDone(skipped=True))))
    assert link.held() is not None and link.held().step == 4  # the steps before it are complete; this one is not
    asyncio.run(link.counted(4, reply(StepDone())))
    assert link.held().step == 5
    outer, _ = a_link(outer_step=12)
    outer.hold(_live(step=2, outer=True))
    assert outer.held().step == 12  # hierarchical mode: the outer weights' step is what a restarted coordinator resumes from
    none, _ = a_link(outer_step=None)
    none.hold(_live(outer=True))
    assert none.held() is None


class FakeTunnel:
    opened: list[FakeTunnel] = []

    def __init__(self, relay: str, token: str, targets: list[str], *, source: str = "") -> None:
        self.relay, self.targets, self.source = relay, targets, source
        self.seen, self.lost, self.closed = "", asyncio.Event(), False
        FakeTunnel.opened.append(self)

    async def open(self) -> list[str]:
        self.seen = "203.0.113.9:4000"
        n = len(FakeTunnel.opened)
        return [f"{self.relay.rpartition(':')[0]}:{n}1", f"{self.relay.rpartition(':')[0]}:{n}2"]

    async def close(self) -> None:
        self.closed = True


def test_a_worker_nobody_reaches_is_hosted_by_a_relay_and_moves_when_it_goes_away() -> None:
    FakeTunnel.opened = []
    config = _config()
    relays = iter([":9", "10.0.0.8:9"])  # the coordinator's own (by port), then a worker's
    coordinator = FakeCoordinator({"Reach": lambda msg: ReachReply(False, why="no route", relay=next(relays)).to_wire()})
    me = Identity(address="10.0.0.5:7000", data_address="10.0.0.5:7001")
    done, announced = asyncio.Event(), asyncio.Event()

    async def announce() -> None:
        announced.set()

    nat = NatLink(config, coordinator, me, done, announce, make_tunnel=FakeTunnel)  # type: ignore[arg-type]

    async def main() -> None:
        await nat.reach(coordinator.call)
        first = FakeTunnel.opened[0]
        assert first.relay == "127.0.0.1:9" and first.targets == ["127.0.0.1:7000", "127.0.0.1:7001"] and first.source == "127.0.0.1"
        assert (me.address, me.data_address) == ("127.0.0.1:11", "127.0.0.1:12")
        assert nat.register_fields() == {"relay": "127.0.0.1:9", "seen": "203.0.113.9", "lan_address": "10.0.0.5:7000",
                                         "lan_data_address": "10.0.0.5:7001"}
        first.lost.set()  # the relay went away
        await asyncio.wait_for(announced.wait(), 10)
        assert first.closed and nat.relay == "10.0.0.8:9" and me.address == "10.0.0.8:21"
        assert nat.heartbeat_fields() == {"moved_from": "127.0.0.1:11", "relay": "10.0.0.8:9"}
        nat.move_known()
        assert nat.heartbeat_fields()["moved_from"] == ""
        done.set()
        await nat.stop()
        assert FakeTunnel.opened[1].closed

    asyncio.run(main())
    asked = [Reach.from_wire(m) for m in coordinator.sent("Reach")]
    assert asked[0].behind_nat is False and asked[1].avoid == ["127.0.0.1:9"] and asked[1].address == "10.0.0.5:7000"


def test_a_reachable_worker_offers_no_tunnel_and_a_relay_must_be_reachable() -> None:
    coordinator = FakeCoordinator({"Reach": lambda msg: ReachReply(True).to_wire()})
    nat = NatLink(_config(), coordinator, Identity(), asyncio.Event(), announce=lambda: asyncio.sleep(0))  # type: ignore[arg-type]
    asyncio.run(nat.reach(coordinator.call))
    assert nat.tunnel is None and nat.register_fields() == {"relay_offer": ""} and nat.relay == ""
    with pytest.raises(FusionError, match="not hosted by a relay"):
        asyncio.run(nat.on_rehome({"relay": "10.0.0.8:9"}))
    nat.relay_server = object()  # type: ignore[assignment]  # started with --relay
    coordinator.answers["Reach"] = lambda msg: ReachReply(False, why="no route").to_wire()
    with pytest.raises(FusionError, match="only a reachable worker can relay"):
        asyncio.run(nat.reach(coordinator.call))


class FakeWorld:
    def __init__(self, spec: Collective, worker: int, join_host: str, own_host: str, timeout: float, device: str, fail: bool = False) -> None:
        self.spec, self.worker, self.hosts, self.fail = spec, worker, (join_host, own_host), fail
        self.alive, self.left = True, asyncio.Event()

    def form(self) -> None:
        if self.fail:
            raise RuntimeError("store unreachable")

    def leave(self) -> None:
        self.left_in_thread = True


SPEC = Collective(store=":5", prefix="x", ranks=[0, 1], backend="gloo", group=2)


def test_a_world_is_formed_dropped_without_waiting_and_torn_down_after_a_failed_formation() -> None:
    made: list[FakeWorld] = []

    def make(*args: Any, fail: bool = False) -> FakeWorld:
        made.append(FakeWorld(*args, fail=fail))
        return made[-1]

    async def main() -> None:
        worlds = WorldLink(_config(), "torch", make_world=make)
        world = await worlds.join(SPEC, 1, 5.0)
        assert world is worlds.world and world.hosts == ("127.0.0.1", "127.0.0.1")
        worlds.drop()
        assert worlds.world is None and not world.alive
        await worlds.left(5.0)
        assert world.left_in_thread
        failing = WorldLink(_config(), "torch", make_world=lambda *a: make(*a, fail=True))
        with pytest.raises(FusionError, match="forming process group 2 with workers \\[0, 1\\] failed: RuntimeError"):
            await failing.join(SPEC, 1, 5.0)
        assert failing.world is None and not made[-1].alive
        await failing.left(5.0)
        assert made[-1].left_in_thread

    asyncio.run(main())
    with pytest.raises(FusionError, match="runs numpy: it cannot join"):
        asyncio.run(WorldLink(_config(), "numpy", make_world=make).join(SPEC, 1, 5.0))


def test_an_abort_ends_the_running_step_and_a_settle_that_runs_out_aborts_it() -> None:
    async def main() -> None:
        running = Running()
        assert not await running.abort()  # nothing running
        step = asyncio.create_task(running.run(asyncio.Event().wait()))
        await asyncio.sleep(0)
        assert await running.abort() and await step is None and running.task is None
        quick = asyncio.create_task(running.run(asyncio.sleep(0, result="done")))
        await asyncio.sleep(0)
        assert await running.settle(10) and await quick == "done"
        stuck = asyncio.create_task(running.run(asyncio.Event().wait()))
        await asyncio.sleep(0)
        assert not await running.settle(0.01) and await stuck is None

    asyncio.run(main())


def test_the_worker_is_composed_of_its_parts() -> None:
    from fusionllm.runtime.worker.worker import Worker

    worker = Worker(WorkerConfig(join="127.0.0.1:1", token=TOKEN, backend="numpy", handle_signals=False))
    assert worker.link.nat is worker.nat and worker.link.me is worker.me is worker.nat.me and worker.link.running is worker.running
    assert asyncio.run(worker._on_ping({})) == {"worker": None, "nonce": worker.nat.nonce}
    worker.me.named(4)
    assert worker.id == 4 and worker.link.beat().worker == 4
