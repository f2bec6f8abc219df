"""Peers of a worker reached in memory, and a fake world, for unit tests of the stage loop and its links.

``MemoryNet`` is a real ``PeerNet`` whose connection to a peer is a function call that files the
frames in that peer's real ``Inbox``: every tensor is framed, encoded and decoded as on the wire,
and the net keeps the header of every tensor it pushed (``sent``), for the test to read.
``FakeWorld`` has the interface of ``runtime/collective.World`` without a process group: it records
the groups it was asked to reduce, and a bucket it starts sums two members' equal gradients.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionllm.runtime.worker.peers import Inbox, PeerNet
from fusionllm.transport.frames import read_tensor


async def _frames(frames: list[bytes]) -> AsyncIterator[bytes]:
    for f in frames:
        yield bytes(f)


class _MemoryClient:
    """A peer's ``RpcClient`` whose ``Push`` files the frames straight into that peer's inbox."""

    def __init__(self, inbox: Inbox, log: list[dict]) -> None:
        self.inbox, self.log = inbox, log

    async def push(self, method: str, frames: list[bytes], timeout: float) -> None:
        header, _ = await read_tensor(_frames(frames))
        self.log.append(header)
        await self.inbox.receive(_frames(frames))

    async def close(self) -> None:
        pass


class MemoryNet(PeerNet):
    """A worker's peers, reached in memory: ``sent`` holds the header of every tensor it pushed."""

    def __init__(self, inboxes: dict[int, Inbox]) -> None:
        super().__init__({w: f"memory:{w}" for w in inboxes}, "token")
        self.inboxes: dict[int, Inbox] = inboxes
        self.sent: list[dict[str, Any]] = []

    def client(self, worker: int) -> Any:
        return _MemoryClient(self.inboxes[worker], self.sent)


Group = tuple[int, ...]


@dataclass
class _Spec:
    backend: str = "gloo"


@dataclass
class _Work:
    flat: torch.Tensor

    def wait(self) -> None:
        self.flat.mul_(2)  # two members with the same gradients: the sum is twice each


@dataclass
class FakeWorld:
    groups: set[Group]
    backend: str = "gloo"
    alive: bool = True
    reduced: list[Group] = field(default_factory=list)
    started: list[Group] = field(default_factory=list)
    in_flight: int = 0
    carried: set[tuple[int, int]] = field(default_factory=set)  # links (src, dst) whose activations and gradients it carries

    @property
    def spec(self) -> _Spec:
        return _Spec(self.backend)

    def reduces(self, group: Group) -> bool:
        return self.alive and group in self.groups

    async def reduce(self, group: Group, params: list[torch.Tensor]) -> None:
        self.reduced.append(group)

    def start(self, group: Group, flat: torch.Tensor) -> _Work:
        self.started.append(group)
        self.in_flight += 1
        return _Work(flat)

    def settled(self, works: int) -> None:
        self.in_flight -= works
