"""The validated form of a cluster file: sites, the links between them, and the devices they hold.

Every class checks its fields when constructed, whether it was parsed from TOML or built in code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from fusionllm.cluster.units import format_rate
from fusionllm.core.errors import ConfigError

MAX_DEVICES = 100_000  # simulated clusters may be large; the testbed itself takes at most 230
MAX_CPUS = 64.0  # per worker; a larger quota is almost certainly a typo

_SITE_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def _check_latency(value: float, key: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{key}: latency must be a finite number of ms >= 0, got {value!r}")


@dataclass(frozen=True)
class SiteSpec:
    """Devices that share fast links: `devices` workers, each with a quota of `cpus` cores."""

    name: str
    devices: int
    cpus: float
    bandwidth_bps: int  # between two workers of this site, each direction
    latency_ms: float = 0.0  # one-way; the testbed delays it (testbed/delay.py)
    device_flops: float | None = None  # peak flop/s of one device, for the simulator
    device_memory: int | None = None  # bytes of one device, for the simulator
    nat: bool = False  # behind a NAT: its workers open connections out, nothing from outside reaches them
    uplink_bps: int | None = None  # a NAT site's access link, each direction (None: ClusterSpec.uplink_bps's default)

    def __post_init__(self) -> None:
        key = f"sites.{self.name}"
        if not isinstance(self.name, str) or not _SITE_NAME.fullmatch(self.name):
            raise ConfigError(
                f"sites.{self.name!r}: a site name uses 1 to 32 letters, digits, '_' or '-', got {self.name!r}"
            )
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ConfigError(
                f"{key}.devices: must be a whole number >= 1 (workers at site {self.name}), got {self.devices!r}"
            )
        if (
            isinstance(self.cpus, bool)
            or not isinstance(self.cpus, (int, float))
            or not math.isfinite(self.cpus)
        ):
            raise ConfigError(
                f"{key}.cpus: must be a number of cores such as 0.5, got {self.cpus!r}"
            )
        if self.cpus <= 0:
            raise ConfigError(f"{key}.cpus: must be > 0, got {self.cpus!r}")
        if self.cpus > MAX_CPUS:
            raise ConfigError(
                f"{key}.cpus: must be <= {MAX_CPUS:g} cores per worker, got {self.cpus!r}"
            )
        if (
            isinstance(self.bandwidth_bps, bool)
            or not isinstance(self.bandwidth_bps, int)
            or self.bandwidth_bps <= 0
        ):
            raise ConfigError(
                f"{key}.bandwidth: must be a positive whole number of bit/s, got {self.bandwidth_bps!r}"
            )
        _check_latency(self.latency_ms, f"{key}.latency")
        if self.device_flops is not None and not (
            isinstance(self.device_flops, (int, float)) and self.device_flops > 0
        ):
            raise ConfigError(f"{key}.device_flops: must be > 0 flop/s, got {self.device_flops!r}")
        if self.device_memory is not None and (
            isinstance(self.device_memory, bool)
            or not isinstance(self.device_memory, int)
            or self.device_memory <= 0
        ):
            raise ConfigError(
                f"{key}.device_memory: must be a positive whole number of bytes, got {self.device_memory!r}"
            )
        if not isinstance(self.nat, bool):
            raise ConfigError(f"{key}.nat: must be true or false, got {self.nat!r}")
        if self.uplink_bps is not None:
            if (
                isinstance(self.uplink_bps, bool)
                or not isinstance(self.uplink_bps, int)
                or self.uplink_bps <= 0
            ):
                raise ConfigError(
                    f"{key}.uplink: must be a positive whole number of bit/s, got {self.uplink_bps!r}"
                )
            if not self.nat:
                raise ConfigError(
                    f"{key}.uplink: only a NAT site has an uplink; add nat = true to site {self.name}, or remove uplink"
                )


@dataclass(frozen=True)
class LinkSpec:
    """The path between any worker of site `a` and any of site `b`: bandwidth each direction."""

    a: str
    b: str
    bandwidth_bps: int
    latency_ms: float = 0.0  # one-way; the testbed delays it (testbed/delay.py)

    def __post_init__(self) -> None:
        key = f"link {self.a}-{self.b}"
        if self.a == self.b:
            raise ConfigError(
                f"{key}: a link joins two different sites; site {self.a}'s own bandwidth is sites.{self.a}.bandwidth"
            )
        if (
            isinstance(self.bandwidth_bps, bool)
            or not isinstance(self.bandwidth_bps, int)
            or self.bandwidth_bps <= 0
        ):
            raise ConfigError(
                f"{key}: bandwidth must be a positive whole number of bit/s, got {self.bandwidth_bps!r}"
            )
        _check_latency(self.latency_ms, f"{key}.latency")

    @property
    def key(self) -> frozenset[str]:
        return frozenset((self.a, self.b))


@dataclass(frozen=True)
class DeviceSpec:
    """One worker: its index in the cluster (0..N-1), its site and what it can do."""

    index: int
    site: str
    cpus: float
    flops: float | None
    memory: int | None


@dataclass(frozen=True)
class ClusterSpec:
    """Sites in file order and one link for every pair of sites; devices are numbered site by site."""

    sites: dict[str, SiteSpec]
    links: dict[frozenset[str], LinkSpec]
    name: str = "cluster"
    _device_sites: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sites:
            raise ConfigError("sites: a cluster needs at least one site")
        for name, site in self.sites.items():
            if site.name != name:
                raise ConfigError(f"sites.{name}: holds the SiteSpec of site {site.name}")
        for key, link in self.links.items():
            if key != link.key:
                raise ConfigError(f"link {link.a}-{link.b}: stored under the pair {sorted(key)}")
            for end in (link.a, link.b):
                if end not in self.sites:
                    raise ConfigError(
                        f"link {link.a}-{link.b}: unknown site {end}; sites are {', '.join(self.sites)}"
                    )
        missing = self._missing_pairs()
        if missing:
            a, b = missing[0]
            more = f" ({len(missing)} pairs lack a link in all)" if len(missing) > 1 else ""
            raise ConfigError(
                f"links: no [[links]] entry between sites {a} and {b}{more}; "
                f'add [[links]] sites = ["{a}", "{b}"] bandwidth = "20mbit"'
            )
        total = sum(site.devices for site in self.sites.values())
        if total > MAX_DEVICES:
            raise ConfigError(
                f"sites: {total} devices in total, at most {MAX_DEVICES}"
            )
        owners = tuple(site.name for site in self.sites.values() for _ in range(site.devices))
        object.__setattr__(self, "_device_sites", owners)

    def _missing_pairs(self) -> list[tuple[str, str]]:
        names = list(self.sites)
        return [
            (a, b)
            for i, a in enumerate(names)
            for b in names[i + 1 :]
            if frozenset((a, b)) not in self.links
        ]

    def devices(self) -> list[DeviceSpec]:
        """Every worker, sites in file order, numbered 0.. consecutively."""
        out = []
        for index, name in enumerate(self._device_sites):
            site = self.sites[name]
            out.append(DeviceSpec(index, name, site.cpus, site.device_flops, site.device_memory))
        return out

    @property
    def num_devices(self) -> int:
        return len(self._device_sites)

    @property
    def total_cpus(self) -> float:
        """Cores the testbed's quotas add up to (keep it near the machine's core count)."""
        return math.fsum(site.cpus * site.devices for site in self.sites.values())

    def site_of(self, i: int) -> SiteSpec:
        """The site of device `i`."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_devices:
            raise ConfigError(
                f"device {i!r}: no such device; cluster {self.name} has devices 0..{self.num_devices - 1}"
            )
        return self.sites[self._device_sites[i]]

    def link(self, a: str, b: str) -> LinkSpec:
        """The link between two different sites."""
        try:
            return self.links[frozenset((a, b))]
        except KeyError:
            raise ConfigError(f"cluster {self.name}: no link between sites {a} and {b}") from None

    def bandwidth(self, i: int, j: int) -> int:
        """Bit/s from device `i` to device `j` (each direction): the site's own, or the link's."""
        si, sj = self.site_of(i), self.site_of(j)
        if i == j:
            raise ConfigError(
                f"device {i}: bandwidth(i, j) needs two different devices, got i == j == {i}"
            )
        return si.bandwidth_bps if si is sj else self.link(si.name, sj.name).bandwidth_bps

    def latency_ms(self, i: int, j: int) -> float:
        """Latency from device `i` to device `j`, as recorded (0 on the diagonal)."""
        si, sj = self.site_of(i), self.site_of(j)
        if i == j:
            return 0.0
        return si.latency_ms if si is sj else self.link(si.name, sj.name).latency_ms

    def nat_sites(self) -> list[str]:
        """The sites behind a NAT, in file order."""
        return [name for name, site in self.sites.items() if site.nat]

    def is_natted(self, i: int) -> bool:
        """Whether device `i` sits behind its site's NAT (it can open connections, not accept them from outside)."""
        return self.site_of(i).nat

    def uplink_bps(self, site: str) -> int:
        """Bit/s of a site's access link, each direction: its `uplink`, or else the fastest of its
        links to other sites, or else (a cluster of one site) its own bandwidth."""
        if site not in self.sites:
            raise ConfigError(f"cluster {self.name}: unknown site {site!r}; sites are {', '.join(self.sites)}")
        s = self.sites[site]
        if s.uplink_bps is not None:
            return s.uplink_bps
        rates = [link.bandwidth_bps for link in self.links.values() if site in (link.a, link.b)]
        return max(rates, default=s.bandwidth_bps)

    def bandwidth_matrix(self) -> list[list[int]]:
        """bandwidth(i, j) for every pair of devices, 0 on the diagonal; symmetric."""
        n = self.num_devices
        return [[0 if i == j else self.bandwidth(i, j) for j in range(n)] for i in range(n)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (rates in bit/s and as text, latencies in ms)."""
        return {
            "name": self.name,
            "num_devices": self.num_devices,
            "total_cpus": self.total_cpus,
            "sites": {
                name: {
                    "devices": s.devices,
                    "cpus": s.cpus,
                    "bandwidth_bps": s.bandwidth_bps,
                    "bandwidth": format_rate(s.bandwidth_bps),
                    "latency_ms": s.latency_ms,
                    "device_flops": s.device_flops,
                    "device_memory": s.device_memory,
                    "nat": s.nat,
                    "uplink_bps": self.uplink_bps(name) if s.nat else None,
                    "uplink": format_rate(self.uplink_bps(name)) if s.nat else None,
                }
                for name, s in self.sites.items()
            },
            "links": [
                {
                    "sites": [link.a, link.b],
                    "bandwidth_bps": link.bandwidth_bps,
                    "bandwidth": format_rate(link.bandwidth_bps),
                    "latency_ms": link.latency_ms,
                }
                for link in self.links.values()
            ],
        }
