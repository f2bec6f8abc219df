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
from typing import TYPE_CHECKING, Any

from fusionllm.core.errors import FusionError, TransportError
from fusionllm.transport.control import Heartbeat, Reach, ReachReply
from fusionllm.transport.relay import Relay, Tunnel

if TYPE_CHECKING:
    from fusionllm.runtime.worker import WorkerConfig
    from fusionllm.transport.control import Register
    from fusionllm.transport.rpc import RpcClient

MOVE_WITHIN_S = 60.0  # how long a worker whose relay went away keeps looking for another


class NatLink:
    """The NAT half of ``Worker`` (mixed in)."""

    config: WorkerConfig
    coordinator: RpcClient
    address: str
    data_address: str
    id: int | None
    done: asyncio.Event
    log: Any
    _request: Register | None

    if TYPE_CHECKING:  # CoordinatorLink's
        async def _joining(self, method: str, msg: dict[str, Any], timeout: float = 10) -> dict[str, Any]: ...

    def _init_nat(self) -> None:
        self.nonce = secrets.token_hex(8)  # Ping answers carry it: the coordinator connecting back reached this process
        self.tunnel: Tunnel | None = None
        self.relay_server: Relay | None = None
        self.relay_offer = ""
        self.seen = ""
        self.lan_address = self.lan_data_address = ""
        self._watch: asyncio.Task | None = None
        self.moved_from = ""  # the address before the last move, until a heartbeat reply shows the coordinator knows the new one

    def _beat(self) -> Heartbeat:
        relay = self.tunnel.relay if self.tunnel is not None else ""
        return Heartbeat(self.id or 0, self.address, moved_from=self.moved_from, data_address=self.data_address, relay=relay)

    def _local(self, address: str) -> str:
        """Where a tunnel's sessions connect: this worker's own server (loopback when it listens on all hosts)."""
        host, _, port = address.rpartition(":")
        listen = self.config.listen.rpartition(":")[0].strip("[]")
        return f"{'127.0.0.1' if listen in ('', '0.0.0.0', '::') else listen}:{port}"

    def _relay_address(self, relay: str) -> str:
        """The coordinator names its own relay by port only: it is at the host this worker joined."""
        host, _, port = relay.rpartition(":")
        return relay if host else f"{self.config.join.rpartition(':')[0]}:{port}"

    async def _start_relay_offer(self, advertise_host: str) -> None:
        if not self.config.relay:
            return
        self.relay_server = Relay(self.config.token, role="worker relay")
        host = self.config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        port = await self.relay_server.start(host, self.config.relay_port)
        self.relay_offer = f"{advertise_host}:{port}"
        self.log.info("relaying for workers behind NAT on %s", self.relay_offer)

    async def _reach(self) -> None:
        """Ask the coordinator to connect back; when it cannot, be hosted by a relay."""
        direct = (self.address, self.data_address)
        reply = ReachReply.from_wire(await self._joining(
            "Reach", Reach(self.address, self.data_address, self.config.behind_nat, nonce=self.nonce).to_wire(), timeout=30))
        if reply.reachable:
            return
        if self.relay_server is not None:
            raise FusionError(f"--relay: the coordinator cannot reach this worker ({reply.why}); only a reachable worker can relay")
        self.lan_address, self.lan_data_address = direct
        relay = self._relay_address(reply.relay)
        await self._host_at(relay)
        self.log.warning("the coordinator cannot connect to this worker (%s): reached through the relay %s as %s",
                         reply.why, relay, self.address)

    async def _host_at(self, relay: str) -> None:
        tunnel = self._tunnel(relay)
        self.address, self.data_address = await tunnel.open()
        self.tunnel, self.seen = tunnel, tunnel.seen.rpartition(":")[0]
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._watch_relay())

    def _tunnel(self, relay: str) -> Tunnel:
        """A tunnel whose sessions reach this worker's own servers, leaving from its --listen host when it names one."""
        listen = self.config.listen.rpartition(":")[0].strip("[]")
        source = "" if listen in ("", "0.0.0.0", "::") else listen
        return Tunnel(relay, self.config.token, [self._local(self.lan_address), self._local(self.lan_data_address)], source=source)

    def _nat_fields(self) -> dict[str, str]:
        """What Register says about NAT."""
        if self.tunnel is None:
            return {"relay_offer": self.relay_offer}
        return {"relay": self.tunnel.relay, "seen": self.seen, "lan_address": self.lan_address, "lan_data_address": self.lan_data_address}

    async def _on_rehome(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The coordinator moves this worker to a relay offered by a worker (one joined after it): the
        new tunnel first, then the answer (it travels through the old one), then the old one closes."""
        relay = str(msg.get("relay", ""))
        if self.tunnel is None or not relay:
            raise FusionError("Rehome: this worker is not hosted by a relay")
        old = self.tunnel
        self.moved_from = self.moved_from or self.address  # a heartbeat before the coordinator took the answer says so
        await self._host_at(relay)
        self.log.info("moved from the relay %s to %s: reached as %s", old.relay, relay, self.address)
        if self._request is not None:
            self._request.address, self._request.data_address, self._request.relay = self.address, self.data_address, relay
        asyncio.get_running_loop().call_later(2.0, lambda: asyncio.ensure_future(old.close()))
        return {"address": self.address, "data_address": self.data_address, "relay": relay}

    async def _watch_relay(self) -> None:
        while not self.done.is_set() and self.tunnel is not None:
            tunnel = self.tunnel
            await tunnel.lost.wait()
            if self.done.is_set():
                return
            if tunnel is not self.tunnel:
                continue  # moved on purpose (Rehome)
            old, dead = self.address, self.tunnel.relay
            self.log.warning("the relay %s went away; finding another", dead)
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
                    self.address, self.data_address = await tunnel.open()
                    self.tunnel = tunnel
                    break
                except (FusionError, OSError) as exc:
                    if time.monotonic() - began > MOVE_WITHIN_S:
                        self.log.error("found no relay within %.0f s (%s): this worker cannot be reached", MOVE_WITHIN_S, exc)
                        return
                    if relay and isinstance(exc, TransportError):
                        avoid.append(relay)
                    await asyncio.sleep(0.5)
            if self._request is not None:
                self._request.address, self._request.data_address = self.address, self.data_address
                self._request.relay = self.tunnel.relay
            self.moved_from = self.moved_from or old  # every heartbeat carries it until the coordinator took the move
            with contextlib.suppress(FusionError):
                await self.coordinator.call("Heartbeat", self._beat().to_wire(), timeout=10)
            self.log.warning("moved to the relay %s: reached as %s after %.1f s", self.tunnel.relay, self.address, time.monotonic() - began)

    async def _stop_nat(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        if self.tunnel is not None:
            await self.tunnel.close()
        if self.relay_server is not None:
            await self.relay_server.stop()
