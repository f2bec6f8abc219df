"""Workers nobody can connect to (``--behind-nat``) train through relays, exactly like one process.

In process, on loopback: a worker behind NAT is one that the coordinator does not try to reach; its
listen host (127.0.0.x) stands for its NAT's public address, as the relay sees it. The testbed's real
NAT (namespaces, nftables masquerade) is covered in ``test_testbed_nat.py`` and ``experiments/nat.py``.

Why these can fail: a relayed tensor that is lost, doubled or changed moves a loss beyond 1e-5; a
worker that is not served through its relay never joins (its private address is not reachable);
a relay that dies without the worker moving to another leaves the run without it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.launch.inprocess import InProcessCluster, cluster_config
from fusionllm.runtime.reference.single import train_single
from fusionllm.runtime.reference.verify import TOLERANCE
from fusionllm.runtime.worker.nat_link import NatLink
from fusionllm.transport.stream import DataClient

STEPS = 4


def _train(steps: int = STEPS) -> TrainConfig:
    return TrainConfig(model="gpt-nano", steps=steps, batch_size=8, seq_len=32, lr=3e-3, warmup=1, eval_every=0, seed=0)


def _close(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    for a, b in zip(losses, reference, strict=True):
        assert abs(a - b) <= TOLERANCE * abs(b), (losses, reference)


@pytest.fixture
def data_clients(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every data-plane client made: (address, whether its messages carry a MAC)."""
    made: list[tuple[str, bool]] = []
    init = DataClient.__init__

    def record(self: DataClient, address: str, token: str, **kw: object) -> None:
        init(self, address, token, **kw)  # type: ignore[arg-type]
        made.append((address, self.mac))

    monkeypatch.setattr(DataClient, "__init__", record)
    return made


@pytest.mark.parametrize("same_nat", [False, True])
def test_workers_behind_nat_train_like_one_process(same_nat: bool, data_clients: list[tuple[str, bool]]) -> None:
    """Workers 1 and 2 behind NAT (two NATs, or one), hosted by the coordinator's relay; a pipeline of
    three stages, so activations and gradients flow 0 <-> 1 <-> 2."""
    train = _train()
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.2" if same_nat else "127.0.0.3"]
    options = [{"listen": f"{h}:0", **({"behind_nat": True} if i else {})} for i, h in enumerate(hosts)]
    coordinator_relay = {}

    async def main() -> list:
        async with InProcessCluster(train, cluster_config(3, micro_batches=2), worker_options=options) as c:
            result = await c.run()
            coordinator_relay["bytes"] = c.coordinator.reach.relay.bytes_relayed()
            coordinator_relay["lines"] = list(c.lines)
        return [result, c.workers]

    result, ws = asyncio.run(main())
    _close(result.losses, train_single(train).losses)
    assert ws[0].nat.tunnel is None and ws[1].nat.tunnel is not None and ws[2].nat.tunnel is not None
    assert coordinator_relay["bytes"] > 0
    lines = "\n".join(coordinator_relay["lines"])
    assert "worker 1 is behind NAT: reached through relay the coordinator" in lines, lines
    peers1 = ws[1].peers
    if same_nat:  # on their LAN: worker 1 reaches worker 2 at its own address, with no relay
        assert peers1.data_addresses[2] == ws[2].nat.lan_data_address and 2 not in peers1.relayed
        assert "direct to [2] (same NAT)" in lines
    else:  # through the relay, every tensor with its MAC
        assert peers1.data_addresses[2] == ws[2].me.data_address != ws[2].nat.lan_data_address
        assert 2 in peers1.relayed and (ws[2].me.data_address, True) in data_clients
    assert 0 not in peers1.relayed and (ws[0].me.data_address, False) in data_clients  # to a reachable worker: direct
    assert (ws[1].me.data_address, True) in data_clients  # worker 0 to worker 1: through the relay


async def _after_the_relay_joined(c: InProcessCluster) -> None:
    """Workers behind NAT ask for a relay once a worker offering one has joined (a relay started first)."""
    while c.coordinator is None or not any(m.info.relay_offer for m in c.coordinator.membership.members.values()):
        await asyncio.sleep(0.02)


@pytest.fixture
def relay_first(monkeypatch: pytest.MonkeyPatch) -> dict:
    holder: dict = {}
    reach = NatLink.reach

    async def later(self: NatLink, joining: Any) -> None:
        if self.config.behind_nat and not holder.get("off"):
            await _after_the_relay_joined(holder["cluster"])
        await reach(self, joining)

    monkeypatch.setattr(NatLink, "reach", later)
    return holder


@pytest.mark.parametrize("relay_joins_first", [True, False])
def test_a_worker_that_offers_to_relay_hosts_the_workers_behind_nat(relay_joins_first: bool, relay_first: dict) -> None:
    """Workers behind NAT use the relay a worker offers; those that joined before it (hosted by the
    coordinator's relay meanwhile) move to it before the first plan."""
    train = _train()
    options = [{"listen": "127.0.0.1:0", "relay": True}, {"listen": "127.0.0.2:0", "behind_nat": True}, {"listen": "127.0.0.3:0", "behind_nat": True}]
    if not relay_joins_first:
        options = options[1:] + options[:1]  # (the workers start together: the NATed ones join first or with it)
    relay_first["off"] = not relay_joins_first

    async def main() -> tuple:
        async with InProcessCluster(train, cluster_config(3, micro_batches=2), worker_options=options) as c:
            relay_first["cluster"] = c
            result = await c.run()
            moved = c.coordinator.reach.relay.bytes_relayed()
        return result, c.workers, moved

    result, ws, through_coordinator = asyncio.run(main())
    _close(result.losses, train_single(train).losses)
    relay = next(w for w in ws if w.config.relay)
    natted = [w for w in ws if w.config.behind_nat]
    assert [w.nat.relay for w in natted] == [relay.nat.relay_offer] * 2
    assert relay.nat.relay_server.bytes_relayed() > through_coordinator


def test_a_relay_that_dies_costs_a_re_plan_and_its_workers_move(tmp_path, relay_first: dict) -> None:
    """Worker 0 relays for workers 1 and 2 and dies mid-run: they move to the coordinator's relay and the
    run re-plans on them from the newest checkpoint, and finishes."""
    train = _train(steps=10)
    cluster = cluster_config(3, micro_batches=2, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, dead_after=6.0, step_timeout=60.0)
    options = [{"listen": "127.0.0.1:0", "relay": True}, {"listen": "127.0.0.2:0", "behind_nat": True}, {"listen": "127.0.0.3:0", "behind_nat": True}]
    seen: dict = {}

    async def main() -> None:
        async with InProcessCluster(train, cluster, worker_options=options, stop_timeout=20.0) as c:
            relay_first["cluster"] = c
            killed = asyncio.Event()

            def on_step(record: dict) -> None:
                if record.get("step") == 4 and not killed.is_set():
                    killed.set()
                    c.workers[0].done.set()  # the relay's worker stops: its servers and its relay go

            c.on_step = on_step
            run = asyncio.create_task(c.run())
            await asyncio.wait({run}, timeout=600)
            c.on_step = lambda _: None
            seen["result"] = run.result()
            seen["lines"] = list(c.lines)
            seen["relays"] = [w.nat.relay for w in c.workers]
            seen["coordinator_relay"] = f"127.0.0.1:{c.coordinator.reach.relay_port}"
            seen["moves"] = c.coordinator.membership.moves

    asyncio.run(main())
    lines = "\n".join(seen["lines"])
    assert "lost worker(s) [0]" in lines, lines
    assert seen["relays"][1] == seen["relays"][2] == seen["coordinator_relay"], seen["relays"]
    assert seen["moves"] == 2
    assert len(seen["result"].losses) >= 10 - 4  # it went on from a checkpoint to the last step


def test_routes_keep_lan_traffic_on_the_lan_and_mark_relayed_peers() -> None:
    from fusionllm.control.reach import routes
    from fusionllm.transport.worker_info import WorkerInfo

    infos = {
        0: WorkerInfo(address="pub:1", data_address="pub:2"),
        1: WorkerInfo(address="relay:11", data_address="relay:12", relay="relay:9", seen="nat-a", lan_address="10.0.0.1:1", lan_data_address="10.0.0.1:2"),
        2: WorkerInfo(address="relay:21", data_address="relay:22", relay="relay:9", seen="nat-a", lan_address="10.0.0.2:1", lan_data_address="10.0.0.2:2"),
        3: WorkerInfo(address="relay:31", data_address="relay:32", relay="relay:9", seen="nat-b", lan_address="10.0.0.3:1", lan_data_address="10.0.0.3:2"),
    }
    addresses, data, through = routes(infos, 1)
    assert addresses[2] == "10.0.0.2:1" and data[2] == "10.0.0.2:2"  # behind the same NAT: its own address
    assert data[3] == "relay:32" and data[0] == "pub:2"  # another NAT: its relay; a reachable worker: direct
    assert sorted(through) == [3]
    _, data0, through0 = routes(infos, 0)
    assert data0[1] == "relay:12" and sorted(through0) == [1, 2, 3]


def test_relayed_links_are_costed_at_the_nat_uplinks() -> None:
    from fusionllm.cluster.hardware import Hardware, relayed
    from fusionllm.cluster.spec import parse_cluster

    spec = parse_cluster("""
[sites.a]
devices = 1
cpus = 0.5
bandwidth = "1gbit"
[sites.h]
devices = 2
cpus = 0.5
bandwidth = "1gbit"
nat = true
uplink = "20mbit"
[[links]]
sites = ["a", "h"]
bandwidth = "100mbit"
""")
    hw = Hardware.from_spec(spec)
    assert relayed(spec, 0, 1) and not relayed(spec, 1, 2)  # into the NAT site; on its LAN
    assert hw.bps(0, 1) == hw.bps(1, 0) == 20e6  # the uplink, slower than the link
    assert hw.bps(1, 2) == 1e9
