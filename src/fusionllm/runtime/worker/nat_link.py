"""A worker behind NAT: found out at join, served through a relay, moved to another when it goes away.

Before it registers, a worker asks the coordinator to connect back to it (``Reach``; skipped with
``--behind-nat``). When that fails it opens a tunnel to the relay the coordinator names
(``transport/relay.py``) and registers with the relay's public ports as its addresses, its own
addresses as LAN addresses (for peers behind the same NAT) and the public host the relay saw.

When its relay goes away the worker asks for another relay (avoiding the dead one), opens a tunnel
there and tells the coordinator its new addresses in a heartbeat at once (``moved_from``); the run
re-plans around the lost relay (it was a worker) with this worker at its new address.

A reachable worker started with ``--relay`` also runs a relay that hosts others.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fusionllm.core.errors import FusionError, TransportError
from fusionllm.runtime.worker.worker_config import Identity, WorkerConfig, listen_host
from fusionllm.transport.control import Reach, ReachReply
from fusionllm.transport.relay import Relay, Tunnel
from fusionllm.transport.rpc import RpcClient

MOVE_WITHIN_S = 60.0  # how long a worker whose relay went away keeps looking for another

Joining = Callable[..., Awaitable[dict[str, Any]]]  # a call made while joining: (method, msg, timeout=) -> reply


class NatLink:
    """How this worker is reached: directly, or through a relay's tunnel (and, with ``--relay``, the relay
    it offers others). It rewrites ``me``'s addresses when it is hosted or moves; ``announce`` tells the
    coordinator at once after a move (a heartbeat). ``make_tunnel`` opens tunnels (``transport/relay.py``'s
    ``Tunnel``; tests give a fake)."""

    def __init__(self, config: WorkerConfig, coordinator: RpcClient, me: Identity, done: asyncio.Event,
                 announce: Callable[[], Awaitable[None]], make_tunnel: Callable[..., Tunnel] = Tunnel) -> None:
        self.config = config
        self.make_tunnel = make_tunnel
        self.coordinator = coordinator
        self.me = me
        self.done = done
        self.announce = announce
        self.nonce = secrets.token_hex(8)  # Ping answers carry it: the coordinator connecting back reached this process
        self.tunnel: Tunnel | None = None
        self.relay_server: Relay | None = None
        self.relay_offer = ""
        self.seen = ""
        self.lan_address = self.lan_data_address = ""
        self._watch: asyncio.Task | None = None
        self.moved_from = ""  # the address before the last move, until a heartbeat reply shows the coordinator knows the new one

    @property
    def relay(self) -> str:
        """The relay that hosts this worker ("": reachable)."""
        return self.tunnel.relay if self.tunnel is not None else ""

    def heartbeat_fields(self) -> dict[str, str]:
        """What a Heartbeat says about NAT."""
        return {"moved_from": self.moved_from, "relay": self.relay}

    def register_fields(self) -> dict[str, str]:
        """What Register says about NAT."""
        if self.tunnel is None:
            return {"relay_offer": self.relay_offer}
        return {"relay": self.tunnel.relay, "seen": self.seen, "lan_address": self.lan_address, "lan_data_address": self.lan_data_address}

    def move_known(self) -> None:
        """The coordinator knows this worker at its new address: heartbeats stop saying where it moved from."""
        self.moved_from = ""

    def _local(self, address: str) -> str:
        """Where a tunnel's sessions connect: this worker's own server (loopback when it listens on all hosts)."""
        port = address.rpartition(":")[2]
        return f"{listen_host(self.config) or '127.0.0.1'}:{port}"

    def _relay_address(self, relay: str) -> str:
        """The coordinator names its own relay by port only: it is at the host this worker joined."""
        host, _, port = relay.rpartition(":")
        return relay if host else f"{self.config.join.rpartition(':')[0]}:{port}"

    async def start_relay_offer(self, advertise_host: str) -> None:
        """With ``--relay``: start the relay this worker offers to workers behind NAT."""
        if not self.config.relay:
            return
        self.relay_server = Relay(self.config.token, role="worker relay")
        host = self.config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        port = await self.relay_server.start(host, self.config.relay_port)
        self.relay_offer = f"{advertise_host}:{port}"
        self.me.log.info("relaying for workers behind NAT on %s", self.relay_offer)

    async def reach(self, joining: Joining) -> None:
        """Ask the coordinator to connect back; when it cannot, be hosted by a relay."""
        me = self.me
        direct = (me.address, me.data_address)
        reply = ReachReply.from_wire(await joining(
            "Reach", Reach(me.address, me.data_address, self.config.behind_nat, nonce=self.nonce).to_wire(), timeout=30))
        if reply.reachable:
            return
        if self.relay_server is not None:
            raise FusionError(f"--relay: the coordinator cannot reach this worker ({reply.why}); only a reachable worker can relay")
        self.lan_address, self.lan_data_address = direct
        relay = self._relay_address(reply.relay)
        await self._host_at(relay)
        me.log.warning("the coordinator cannot connect to this worker (%s): reached through the relay %s as %s",
                       reply.why, relay, me.address)

    async def _host_at(self, relay: str) -> None:
        tunnel = self._tunnel(relay)
        self.me.address, self.me.data_address = await tunnel.open()
        self.tunnel, self.seen = tunnel, tunnel.seen.rpartition(":")[0]
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._watch_relay())

    def _tunnel(self, relay: str) -> Tunnel:
        """A tunnel whose sessions reach this worker's own servers, leaving from its --listen host when it names one."""
        return self.make_tunnel(relay, self.config.token, [self._local(self.lan_address), self._local(self.lan_data_address)],
                                source=listen_host(self.config))

    async def on_rehome(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The coordinator moves this worker to a relay offered by a worker (one joined after it): the
        new tunnel first, then the answer (it travels through the old one), then the old one closes."""
        relay = str(msg.get("relay", ""))
        if self.tunnel is None or not relay:
            raise FusionError("Rehome: this worker is not hosted by a relay")
        old, me = self.tunnel, self.me
        self.moved_from = self.moved_from or me.address  # a heartbeat before the coordinator took the answer says so
        await self._host_at(relay)
        me.log.info("moved from the relay %s to %s: reached as %s", old.relay, relay, me.address)
        asyncio.get_running_loop().call_later(2.0, lambda: asyncio.ensure_future(old.close()))
        return {"address": me.address, "data_address": me.data_address, "relay": relay}

    async def _watch_relay(self) -> None:
        me = self.me
        while not self.done.is_set() and self.tunnel is not None:
            tunnel = self.tunnel
            await tunnel.lost.wait()
            if self.done.is_set():
                return
            if tunnel is not self.tunnel:
                continue  # moved on purpose (Rehome)
            old, dead = me.address, self.tunnel.relay
            me.log.warning("the relay %s went away; finding another", dead)
            began = time.monotonic()
            avoid = [dead]
            while not self.done.is_set():
                relay = ""
                try:
                    reply = ReachReply.from_wire(await self.coordinator.call(
                        "Reach", Reach(self.lan_address, self.lan_data_address, True, avoid, nonce=self.nonce).to_wire(), timeout=10))
                    relay = self._relay_address(reply.relay)
                    with contextlib.suppress(Exception):
                        await self.tunnel.close()
                    tunnel = self._tunnel(relay)
                    me.address, me.data_address = await tunnel.open()
                    self.tunnel = tunnel
                    break
                except (FusionError, OSError) as exc:
                    if time.monotonic() - began > MOVE_WITHIN_S:
                        me.log.error("found no relay within %.0f s (%s): this worker cannot be reached", MOVE_WITHIN_S, exc)
                        return
                    if relay and isinstance(exc, TransportError):
                        avoid.append(relay)
                    await asyncio.sleep(0.5)
            self.moved_from = self.moved_from or old  # every heartbeat carries it until the coordinator took the move
            await self.announce()
            me.log.warning("moved to the relay %s: reached as %s after %.1f s", self.tunnel.relay, me.address, time.monotonic() - began)

    async def stop(self) -> None:
        """Stop watching the relay, close the tunnel and the relay offered."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        if self.tunnel is not None:
            await self.tunnel.close()
        if self.relay_server is not None:
            await self.relay_server.stop()
