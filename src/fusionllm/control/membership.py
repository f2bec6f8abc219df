"""Who has joined: registration (with version checks) and heartbeats."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.errors import AuthError, FusionError
from fusionllm.core.version import __version__
from fusionllm.transport import PROTOCOL_VERSION
from fusionllm.transport.control import (
    Heartbeat,
    HeartbeatReply,
    Register,
    Registered,
)
from fusionllm.transport.worker_info import WorkerInfo


@dataclass
class Member:
    id: int
    address: str
    info: WorkerInfo
    last_seen: float = field(default_factory=time.monotonic)
    origin: int = -1  # the id it joined with (its device in a --hardware file); ids change when a re-plan renumbers

    def __post_init__(self) -> None:
        if self.origin < 0:
            self.origin = self.id


MAX_SPARES = 64


class Membership:
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.members: dict[int, Member] = {}
        self.state = "joining"
        self.full = asyncio.Event()
        self.spares: set[int] = set()
        self.moves = 0  # workers behind NAT that came back through another relay
        self.incarnation = secrets.token_hex(8)  # this coordinator process: workers that see another one re-register

    async def register(self, msg: dict[str, Any]) -> dict[str, Any]:
        version, protocol = msg.get("version"), msg.get("protocol")
        if version != __version__ or protocol != PROTOCOL_VERSION:
            raise AuthError(
                f"version mismatch: worker runs fusionllm {version} (protocol {protocol}), coordinator runs "
                f"fusionllm {__version__} (protocol {PROTOCOL_VERSION}); install the same version on both"
            )
        info = WorkerInfo.from_register(Register.from_wire(msg))  # every field of the right type before it is kept
        address = info.address
        if ":" not in address:
            raise FusionError(f"worker address {address!r} is not HOST:PORT")
        again = next((m for m in self.members.values() if m.address == address), None)
        if again is not None:  # a retried Register whose first try got through: the same member
            again.info, again.last_seen = info, time.monotonic()
            return Registered(again.id, self.incarnation, spare=again.id in self.spares).to_wire()
        if self.state == "running":  # a spare: taken in at the next re-plan
            if len(self.members) >= self.expected + MAX_SPARES:
                raise FusionError(f"the run already has {len(self.members)} workers and spares")
            member = Member(max(self.members, default=-1) + 1, address, info, origin=-2)
            self.members[member.id] = member
            self.spares.add(member.id)
            return Registered(member.id, self.incarnation, spare=True).to_wire()
        if self.state != "joining" or len(self.members) >= self.expected:
            raise FusionError(f"the run already has its {self.expected} workers")
        rank = info.rank
        if info.live is not None and (rank in self.members or not (isinstance(rank, int) and 0 <= rank < self.expected)):
            rank = None  # a worker coming back to a restarted coordinator asks for its old id, and takes any other
        if rank is None:
            rank = min(set(range(self.expected)) - set(self.members))
        elif not 0 <= rank < self.expected or rank in self.members:
            raise FusionError(f"worker rank {rank!r} is taken or outside 0..{self.expected - 1}")
        member = Member(rank, address, info)
        self.members[member.id] = member
        if len(self.members) == self.expected:
            self.full.set()
        return Registered(member.id, self.incarnation).to_wire()

    async def heartbeat(self, msg: dict[str, Any]) -> dict[str, Any]:
        beat = Heartbeat.from_wire(msg)
        member = self.members.get(beat.worker)
        if member is not None and beat.moved_from and member.address == beat.moved_from and beat.address:
            self._move(member, beat)  # behind NAT, its relay went away: it is hosted by another one now
        if member is None or beat.address not in ("", member.address):  # its id changed in a re-plan it has not heard of yet
            member = next((m for m in self.members.values() if m.address == beat.address), None)
        if member is not None:
            member.last_seen = time.monotonic()
        # unknown: this coordinator restarted, or dropped it (lost while alive, or back under a new address)
        return HeartbeatReply(self.state, self.incarnation, known=member is not None).to_wire()

    def _move(self, member: Member, beat: Heartbeat) -> None:
        member.address = beat.address
        member.info = member.info.moved(beat.address, beat.data_address, beat.relay)
        self.moves += 1

    def stale(self, seconds: float) -> list[int]:
        """Members whose last heartbeat is older than ``seconds``."""
        now = time.monotonic()
        return [m.id for m in self.members.values() if now - m.last_seen > seconds]

    def lose(self, ids: set[int]) -> None:
        """Forget lost workers."""
        for w in ids:
            self.members.pop(w, None)
            self.spares.discard(w)

    def renumber(self) -> dict[int, int]:
        """Ids 0..n-1 for the members (spares included), in the order of their old ids: old -> new."""
        mapping = {old: new for new, old in enumerate(sorted(self.members))}
        self.members = {mapping[old]: m for old, m in self.members.items()}
        for new, m in self.members.items():
            m.id = new
        self.spares.clear()
        return mapping
