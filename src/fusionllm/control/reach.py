"""Workers nobody can reach (behind NAT): the coordinator checks each joining worker, and hosts or
finds a relay for those it cannot connect back to.

A joining worker asks ``Reach`` with its addresses and a nonce. The coordinator connects back to
both its ports (with the token, within ``REACH_S``) and checks that the answer carries the nonce (a
private address may name another machine on the coordinator's side). When that fails, or the worker
says ``--behind-nat``, the reply names a relay: a reachable worker that offered ``--relay`` (the one
hosting fewest), else the coordinator's own (``transport/relay.py``). The worker then joins with the
relay's public ports as its addresses.

Peers behind the same NAT (the relay saw them come from one public host) are given each other's own
addresses: their tensors stay on their LAN. Every other link to a relayed worker goes through its
relay; the plan printout marks those links, the probes measure them through the relay, and their
tensors carry a MAC per message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.transport.control import WORKER_SERVICE, Reach, ReachReply
from fusionllm.transport.relay import Relay
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.stream import DataClient
from fusionllm.transport.worker_info import WorkerInfo

REACH_S = 1.5  # how long connecting back to a joining worker may take (the worker probes its device meanwhile)


async def connect_back(address: str, data_address: str, nonce: str, token: str, tls: Any = None, timeout: float = REACH_S) -> str:
    """'' when both of a worker's ports answer with the token (and its Ping with ``nonce``); else why not."""
    client = RpcClient(address, WORKER_SERVICE, token, tls=tls)
    try:
        reply = await client.call("Ping", {}, timeout=timeout)
        if nonce and reply.get("nonce") != nonce:
            return f"{address} answers, but it is another process (a private address of another machine?)"
    except FusionError as exc:
        return str(exc)
    finally:
        await client.close()
    data = DataClient(data_address, token, tls=tls)
    try:
        await asyncio.wait_for(data._connect(), timeout)  # the handshake only
    except (FusionError, asyncio.TimeoutError) as exc:
        return f"data port {data_address}: {exc or 'timed out'}"
    finally:
        await data.close()
    return ""


def relayed(info: WorkerInfo) -> bool:
    return info.relayed


def same_nat(a: WorkerInfo, b: WorkerInfo) -> bool:
    """Two workers behind one NAT: the relay saw both come from the same public host."""
    return a.relayed and b.relayed and bool(a.seen) and a.seen == b.seen and bool(a.lan_address)


def routes(infos: Mapping[int, WorkerInfo], w: int) -> tuple[dict[int, str], dict[int, str], list[int]]:
    """The addresses worker ``w`` uses for every member (LAN addresses for a peer behind its own NAT),
    and which of them go through a relay."""
    addresses, data, through = {}, {}, []
    me = infos.get(w, WorkerInfo())
    for p, info in infos.items():
        if p != w and same_nat(me, info):
            addresses[p], data[p] = info.lan_address, info.lan_data_address or info.data_address
        else:
            addresses[p], data[p] = info.address, info.data_address
            if info.relayed and p != w:
                through.append(p)
    return addresses, data, through


class Reachability:
    """The coordinator's relay for workers nobody can reach, and its answer to their Reach call."""

    def __init__(self, cluster: Any, membership: Any, say: Any) -> None:
        self.cluster, self.membership, self.say = cluster, membership, say
        self.relay = Relay(self.cluster.token, role="coordinator relay")
        self.relay_port = 0

    async def start_relay(self) -> None:
        host = self.cluster.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        self.relay_port = await self.relay.start(host, self.cluster.relay_port)

    async def stop_relay(self) -> None:
        with contextlib.suppress(Exception):
            await self.relay.stop()

    def _own_relay(self) -> str:
        """The coordinator's relay: an empty host means the host each worker joined the coordinator at."""
        host = self.cluster.listen.rpartition(":")[0]
        return f"{'' if host.strip('[]') in ('0.0.0.0', '::', '') else host}:{self.relay_port}"

    async def on_reach(self, msg: dict[str, Any]) -> dict[str, Any]:
        req = Reach.from_wire(msg)
        if not req.behind_nat:
            why = await connect_back(req.address, req.data_address, req.nonce, self.cluster.token, self.cluster.tls)
            if not why:
                return ReachReply(True).to_wire()
        else:
            why = "it says it is behind NAT (--behind-nat)"
        return ReachReply(False, why, self._choose_relay(set(req.avoid))).to_wire()

    def _choose_relay(self, avoid: set[str]) -> str:
        """A reachable worker's relay (the least loaded) when one is offered, else the coordinator's."""
        infos = [m.info for m in self.membership.members.values()]
        load: dict[str, int] = {}
        for info in infos:
            if info.relay:
                load[info.relay] = load.get(info.relay, 0) + 1
        offers = sorted({i.relay_offer for i in infos if i.relay_offer and not i.relayed} - avoid)
        if offers:
            return min(offers, key=lambda r: (load.get(r, 0), r))
        return self._own_relay()

    async def rehome(self) -> None:
        """Before the first plan: workers behind NAT that the coordinator hosts because they joined before
        any worker offered to relay move to the offered relays (a reachable worker's link, not the
        coordinator's, then carries their traffic)."""
        hosted = [m for m in self.membership.members.values() if m.info.relayed and self._is_own(m.info.relay)]
        if not hosted or not any(m.info.relay_offer for m in self.membership.members.values()):
            return
        for member in hosted:
            relay = self._choose_relay(set())
            if self._is_own(relay):
                return
            client = RpcClient(member.address, WORKER_SERVICE, self.cluster.token, tls=self.cluster.tls)
            try:
                reply = await client.call("Rehome", {"relay": relay}, timeout=30)
            except FusionError as exc:
                self.say(f"worker {member.id} stays on the coordinator's relay: moving it to {relay} failed ({exc})")
                continue
            finally:
                await client.close()
            member.address = str(reply["address"])
            member.info = member.info.moved(member.address, str(reply["data_address"]), str(reply["relay"]))

    def relay_lines(self, addresses: dict[int, str]) -> list[str]:
        """What the plan printout says about workers behind NAT."""
        infos = {w: m.info for w, m in self.membership.members.items() if w in addresses}
        lines = []
        for w in sorted(infos):
            if infos[w].relayed:
                relay = infos[w].relay
                lan = sorted(p for p in infos if p != w and same_nat(infos[w], infos[p]))
                via = "the coordinator" if self._is_own(relay) else relay
                lines.append(f"  worker {w} is behind NAT: reached through relay {via}" + (f"; direct to {lan} (same NAT)" if lan else ""))
        return lines

    def _is_own(self, relay: str) -> bool:
        host, _, port = relay.rpartition(":")
        own = self.cluster.listen.rpartition(":")[0]
        return port == str(self.relay_port) and (host in ("", own) or own.strip("[]") in ("0.0.0.0", "::", ""))
