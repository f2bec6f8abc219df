"""What the scheduler and simulator know of a cluster: device speeds and memory, link rates.

Built from a cluster file (emulated or simulated clusters) or from probes of real workers.
A device is either a CPU share (``cpus``: cores of the reference machine, the testbed's CPU quota)
or an accelerator with a peak FLOP/s (``flops``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fusionllm.cluster.spec import ClusterSpec

DEFAULT_CPU_MEMORY = 4 << 30  # per emulated CPU worker, when the cluster file says nothing


@dataclass(frozen=True)
class Device:
    index: int
    site: str
    cpus: float | None = None  # a CPU share (cores of the reference machine)
    flops: float | None = None  # an accelerator's peak flop/s
    memory: int = DEFAULT_CPU_MEMORY
    speed: float = 1.0  # a CPU device's core speed over the modelled one, fitted to measured steps (planning/calibrate.py)

    @property
    def threads(self) -> int:
        return max(1, math.ceil(self.cpus)) if self.cpus else 1


@dataclass(frozen=True)
class Hardware:
    devices: tuple[Device, ...]
    bandwidth: tuple[tuple[float, ...], ...]  # bit/s, [src][dst]
    latency: tuple[tuple[float, ...], ...]  # seconds, [src][dst]
    name: str = "cluster"

    def __len__(self) -> int:
        return len(self.devices)

    def bps(self, i: int, j: int) -> float:
        return self.bandwidth[i][j]

    def subset(self, indices: list[int]) -> Hardware:
        """The devices ``indices``, renumbered ``0..k-1`` in that order (a plan on the subset names
        its devices by position, as on any Hardware)."""
        return Hardware(
            tuple(replace(self.devices[i], index=k) for k, i in enumerate(indices)),
            tuple(tuple(self.bandwidth[i][j] for j in indices) for i in indices),
            tuple(tuple(self.latency[i][j] for j in indices) for i in indices),
            self.name,
        )

    @staticmethod
    def from_spec(spec: ClusterSpec) -> Hardware:
        devices = []
        for d in spec.devices():
            memory = d.memory or DEFAULT_CPU_MEMORY
            devices.append(Device(d.index, d.site, None if d.flops else d.cpus, d.flops, memory))
        n = len(devices)
        bw = tuple(tuple(relayed_bps(spec, i, j) if i != j else math.inf for j in range(n)) for i in range(n))
        lat = tuple(tuple(spec.latency_ms(i, j) / 1000 if i != j else 0.0 for j in range(n)) for i in range(n))
        return Hardware(tuple(devices), bw, lat, spec.name)


def relayed(spec: ClusterSpec, i: int, j: int) -> bool:
    """Traffic between i and j goes through a relay: they are at different sites and one is behind NAT
    (workers behind one NAT reach each other on their LAN)."""
    si, sj = spec.site_of(i), spec.site_of(j)
    return si.name != sj.name and (si.nat or sj.nat)


def relayed_bps(spec: ClusterSpec, i: int, j: int) -> float:
    """The rate from i to j: a relayed link runs at the slowest of the link and each NAT site's uplink
    (both legs of the relay cross the NATed sites' access links)."""
    bps = float(spec.bandwidth(i, j))
    if relayed(spec, i, j):
        bps = min([bps, *(float(spec.uplink_bps(s.name)) for s in (spec.site_of(i), spec.site_of(j)) if s.nat)])
    return bps
