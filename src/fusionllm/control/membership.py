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


class Membership:
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.members: dict[int, Member] = {}
        self.state = "joining"
        self.full = asyncio.Event()
        self._norms: dict[int, dict[int, float]] = {}
        self._norm_done: dict[int, asyncio.Future] = {}
        self.participants: set[int] = set()

    async def register(self, msg: dict[str, Any]) -> dict[str, Any]:
        version, protocol = msg.get("version"), msg.get("protocol")
        if version != __version__ or protocol != PROTOCOL_VERSION:
            raise AuthError(
                f"version mismatch: worker runs fusionllm {version} (protocol {protocol}), coordinator runs "
                f"fusionllm {__version__} (protocol {PROTOCOL_VERSION}); install the same version on both"
            )
        if self.state != "joining" or len(self.members) >= self.expected:
            raise FusionError(f"the run already has its {self.expected} workers")
        address = str(msg.get("address", ""))
        if ":" not in address:
            raise FusionError(f"worker address {address!r} is not HOST:PORT")
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
        if member is not None:
            member.last_seen = time.monotonic()
        return {"state": self.state}

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
