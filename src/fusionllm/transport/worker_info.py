"""What the coordinator keeps of a worker's ``Register``: one frozen, typed record.

``Register`` is the wire message (checked field by field when it arrives); ``WorkerInfo`` is what
membership, placement, worlds, relays and the plan printout read afterwards, with the questions they
ask as properties (``runs_all_kinds``, ``version``, ``relayed``) instead of ``info.get(...)`` with a
default at every reader. The wire format is ``Register``'s; nothing here crosses a process boundary.
A worker behind NAT that moves to another relay gets a new record (``moved``), not a mutated one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from fusionllm.transport.control import LiveState, Register

ALL_KINDS = ("all", "*")  # a backend that runs every op kind of the registry ("*": Register's default)
DEFAULT_FLOPS = 0.0  # no probe: the planner uses its reference speed


@dataclass(frozen=True)
class DeviceInfo:
    """The worker's device as its backend described it (``backend.device_info``)."""

    kind: str = "cpu"  # cpu | cuda
    name: str = ""
    memory_bytes: int | None = None  # None: not reported (the planner assumes a default)
    cores: int | None = None
    gpu: str = ""  # a CUDA device's identity (its UUID, else its PCI address); "" where not known

    @classmethod
    def from_map(cls, raw: Mapping[str, object]) -> DeviceInfo:
        def number(key: str) -> int | None:
            value = raw.get(key)
            return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

        return cls(str(raw.get("kind") or "cpu"), str(raw.get("name") or ""), number("memory_bytes"), number("cores"),
                   str(raw.get("gpu") or "")[:128])


@dataclass(frozen=True)
class WorkerInfo:
    """One joined worker: its addresses, device, backend and software, and how it is reached."""

    address: str = ""
    data_address: str = ""
    backend: str = "torch"  # torch | numpy
    device: DeviceInfo = field(default_factory=DeviceInfo)
    software: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # package -> version
    kinds: str | tuple[str, ...] = "all"  # the op keys it runs, or "all"
    torch_loaded: bool = False
    hostname: str = ""
    pid: int = 0
    threads: int | None = None
    rank: int | None = None
    matmul_flops: float = DEFAULT_FLOPS  # its own device probe, FLOP/s
    live: LiveState | None = None  # the stage it holds, when it re-joins a (restarted) coordinator
    relay: str = ""  # behind NAT: the relay that hosts it; "": reachable
    seen: str = ""  # behind NAT: its public host as the relay saw it
    lan_address: str = ""  # behind NAT: its own addresses, for peers behind the same NAT
    lan_data_address: str = ""
    relay_offer: str = ""  # a reachable worker started with --relay: its relay's address
    version: str = ""  # fusionllm's version on the worker
    protocol: int = 0

    @classmethod
    def from_register(cls, msg: Register) -> WorkerInfo:
        return cls(
            address=msg.address, data_address=msg.data_address, backend=msg.backend or "torch", device=DeviceInfo.from_map(msg.device),
            software=MappingProxyType(dict(msg.software)), kinds=msg.kinds if isinstance(msg.kinds, str) else tuple(msg.kinds),
            torch_loaded=msg.torch_loaded, hostname=msg.hostname, pid=msg.pid, threads=msg.threads, rank=msg.rank,
            matmul_flops=float(msg.probe.get("matmul_flops", DEFAULT_FLOPS)), live=msg.live, relay=msg.relay, seen=msg.seen,
            lan_address=msg.lan_address, lan_data_address=msg.lan_data_address, relay_offer=msg.relay_offer,
            version=msg.version, protocol=msg.protocol,
        )

    @property
    def runs_all_kinds(self) -> bool:
        return isinstance(self.kinds, str) and self.kinds in ALL_KINDS

    @property
    def relayed(self) -> bool:
        """Behind NAT: every link to it that is not on its LAN goes through its relay."""
        return bool(self.relay)

    @property
    def torch_version(self) -> str:
        return self.software.get("torch", "")

    @property
    def backend_version(self) -> str:
        """The version of what runs its ops: torch's, or NumPy's for the NumPy backend."""
        return self.software.get("torch" if self.backend == "torch" else "numpy", "")

    def describe(self) -> str:
        """``cpu, torch 2.4.0``: the device and backend, as the plan printout shows them."""
        version = self.backend_version
        return f"{self.device.kind}, {self.backend}{' ' + version if version else ''}"

    def moved(self, address: str, data_address: str, relay: str) -> WorkerInfo:
        """The same worker reached through another relay (its relay went away, or it was re-homed)."""
        return replace(self, address=address, data_address=data_address, relay=relay)
