"""Who has joined: registration (with version checks), heartbeats, the per-step norm reduction."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fusionllm import __version__
from fusionllm.core.errors import AuthError, FusionError
from fusionllm.transport import PROTOCOL_VERSION


@dataclass
class Member:
    id: int
    address: str
    info: dict[str, Any]
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
        self._norms: dict[int, dict[int, float]] = {}
        self._norm_done: dict[int, asyncio.Future] = {}
        self.participants: set[int] = set()
        self.spares: set[int] = set()

    async def register(self, msg: dict[str, Any]) -> dict[str, Any]:
        version, protocol = msg.get("version"), msg.get("protocol")
        if version != __version__ or protocol != PROTOCOL_VERSION:
            raise AuthError(
                f"version mismatch: worker runs fusionllm {version} (protocol {protocol}), coordinator runs "
                f"fusionllm {__version__} (protocol {PROTOCOL_VERSION}); install the same version on both"
            )
        address = str(msg.get("address", ""))
        if ":" not in address:
            raise FusionError(f"worker address {address!r} is not HOST:PORT")
        if self.state == "running":  # a spare: taken in at the next re-plan
            if len(self.members) >= self.expected + MAX_SPARES:
                raise FusionError(f"the run already has {len(self.members)} workers and spares")
            member = Member(max(self.members, default=-1) + 1, address, dict(msg), origin=-2)
            self.members[member.id] = member
            self.spares.add(member.id)
            return {"worker": member.id, "spare": True}
        if self.state != "joining" or len(self.members) >= self.expected:
            raise FusionError(f"the run already has its {self.expected} workers")
        rank = msg.get("rank")
        if rank is None:
            rank = min(set(range(self.expected)) - set(self.members))
        elif not isinstance(rank, int) or not 0 <= rank < self.expected or rank in self.members:
            raise FusionError(f"worker rank {rank!r} is taken or outside 0..{self.expected - 1}")
        member = Member(rank, address, dict(msg))
        self.members[member.id] = member
        if len(self.members) == self.expected:
            self.full.set()
        return {"worker": member.id}

    async def heartbeat(self, msg: dict[str, Any]) -> dict[str, Any]:
        member = self.members.get(int(msg.get("worker", -1)))
        if member is not None and msg.get("address", member.address) == member.address:
            member.last_seen = time.monotonic()
        else:  # its id changed in a re-plan it has not heard of yet: find it by address
            for m in self.members.values():
                if m.address == msg.get("address"):
                    m.last_seen = time.monotonic()
        return {"state": self.state}

    def stale(self, seconds: float) -> list[int]:
        """Members whose last heartbeat is older than ``seconds``."""
        now = time.monotonic()
        return [m.id for m in self.members.values() if now - m.last_seen > seconds]

    def lose(self, ids: set[int]) -> None:
        """Forget lost workers, and every norm reduction in progress (its step will run again)."""
        for w in ids:
            self.members.pop(w, None)
            self.spares.discard(w)
        for fut in self._norm_done.values():
            if not fut.done():
                fut.set_exception(FusionError("the step was abandoned: a worker was lost"))
        self._norms.clear()
        self._norm_done.clear()

    def renumber(self) -> dict[int, int]:
        """Ids 0..n-1 for the members (spares included), in the order of their old ids: old -> new."""
        mapping = {old: new for new, old in enumerate(sorted(self.members))}
        self.members = {mapping[old]: m for old, m in self.members.items()}
        for new, m in self.members.items():
            m.id = new
        self.spares.clear()
        return mapping

    async def norm_reduce(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Each worker's share of the squared gradient norm; answers all with the sum."""
        step, worker, sq = int(msg["step"]), int(msg["worker"]), float(msg["sq"])
        if worker not in self.participants:
            raise FusionError(f"worker {worker} is not in the plan")
        shares = self._norms.setdefault(step, {})
        done = self._norm_done.setdefault(step, asyncio.get_running_loop().create_future())
        shares[worker] = sq
        if len(shares) == len(self.participants) and not done.done():
            done.set_result(sum(shares[w] for w in sorted(shares)))
        total = await asyncio.shield(done)
        self._norms.pop(step - 2, None)
        self._norm_done.pop(step - 2, None)
        return {"total": total}
