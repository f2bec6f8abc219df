"""The cluster file: sites of devices, their CPU quotas, and the bandwidth of every link.

One TOML file describes a cluster for the emulated testbed (namespaces, tc, CPU
quotas), the planner and the simulator alike::

    name = "three-sites"        # optional
    [sites.A]
    devices = 2                 # workers at this site
    cpus = 0.5                  # CPU quota per worker, in cores: the emulated device speed
    bandwidth = "1gbit"         # between two workers of this site, each direction
    [[links]]
    sites = ["A", "B"]
    bandwidth = "20mbit"        # each direction, between any worker of A and any of B

Optional keys, recorded for the simulator only (the testbed does not emulate them):
``latency = "5ms"`` on sites and links, and on sites ``device = "a100"`` (a preset)
or ``device_flops = "312tflops"`` / ``device_memory = "80GiB"``.

Every error is a one-line `ConfigError` of the form ``SOURCE: KEY.PATH: what is wrong``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fusionllm.core.errors import ConfigError

MAX_DEVICES = 100_000  # simulated clusters may be large; the testbed itself takes at most 240
MAX_CPUS = 64.0  # per worker; a larger quota is almost certainly a typo

GiB = 2**30

# Nominal peak dense fp16/bf16 tensor-core throughput (flop/s) and memory (bytes), from
# the vendors' data sheets. Real kernels reach a fraction of these; the simulator scales.
DEVICE_PRESETS: dict[str, tuple[float, int]] = {
    "a100": (312e12, 80 * GiB),  # A100 SXM 80 GB
    "h100": (989e12, 80 * GiB),  # H100 SXM
    "v100": (125e12, 32 * GiB),  # V100 SXM2 32 GB
    "rtx3090": (71e12, 24 * GiB),  # GeForce RTX 3090, fp32 accumulate
}

# Decimal, as tc reads them: 1kbit = 1000 bit/s.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_LATENCY_UNITS_MS = {"s": Decimal(1000), "ms": Decimal(1), "us": Decimal("0.001")}
_FLOPS_UNITS = {"flops": 1, "gflops": 10**9, "tflops": 10**12}
_MEMORY_UNITS = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-z]+)", re.IGNORECASE)
_SITE_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")

TOP_KEYS = ("name", "sites", "links")
SITE_KEYS = ("devices", "cpus", "bandwidth", "latency", "device", "device_flops", "device_memory")
LINK_KEYS = ("sites", "bandwidth", "latency")


# --- quantities with units -------------------------------------------------------------


def _quantity(
    text: object, key: str, units: dict[str, Any], what: str, example: str
) -> tuple[Decimal, Any]:
    """Split "20 mbit" into (Decimal("20"), multiplier); reject anything else, naming `key`."""
    names = ", ".join(units)
    hint = f"expected {what} like {example!r} (units {names})"
    if not isinstance(text, str):
        raise ConfigError(
            f"{key}: {hint}, got {text!r} ({type(text).__name__}); write it as a quoted string"
        )
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or match.group(2).lower() not in units:
        raise ConfigError(f"{key}: {hint}, got {text!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
        raise ConfigError(f"{key}: {hint}, got {text!r}") from None
    return number, units[match.group(2).lower()]


def parse_rate(text: str, key: str = "bandwidth") -> int:
    """A tc-style rate ("20mbit", "1.5gbit", "8 Mbit") in bits per second; > 0 and whole."""
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match and match.group(2).lower().endswith("bps"):
        raise ConfigError(
            f"{key}: {text!r} is ambiguous (tc reads 'mbps' as megabytes/s); "
            f"write bits per second with bit, kbit, mbit or gbit, e.g. '{match.group(1)}mbit'"
        )
    number, unit = _quantity(text, key, _RATE_UNITS, "a rate", "20mbit")
    bps = number * unit
    if bps <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    if bps != bps.to_integral_value():
        raise ConfigError(f"{key}: must be a whole number of bit/s, got {text!r}")
    return int(bps)


def format_rate(bps: int) -> str:
    """The shortest tc-style text for `bps` bit/s ("20mbit", "1.5gbit"); `parse_rate` reads it back."""
    if isinstance(bps, bool) or not isinstance(bps, int) or bps <= 0:
        raise ConfigError(f"format_rate: expected a positive whole number of bit/s, got {bps!r}")
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda item: -item[1]):
        if bps >= scale:
            value = (Decimal(bps) / scale).normalize()
            return f"{value:f}{unit}"
    raise AssertionError("unreachable: bps >= 1")  # pragma: no cover


def parse_latency(text: str, key: str = "latency") -> float:
    """A latency ("5ms", "250us", "0.1s") in milliseconds; >= 0."""
    number, unit = _quantity(text, key, _LATENCY_UNITS_MS, "a latency", "5ms")
    if number < 0:
        raise ConfigError(f"{key}: must be >= 0, got {text!r}")
    return float(number * unit)


def parse_flops(text: str, key: str = "device_flops") -> float:
    """A device's peak throughput ("312tflops") in flop/s; > 0."""
    number, unit = _quantity(text, key, _FLOPS_UNITS, "a throughput", "312tflops")
    if number <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    return float(number * unit)


def parse_memory(text: str, key: str = "device_memory") -> int:
    """A memory size ("80GiB", "16GB") in bytes; > 0 and whole."""
    number, unit = _quantity(text, key, _MEMORY_UNITS, "a memory size", "80GiB")
    size = number * unit
    if size <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    if size != size.to_integral_value():
        raise ConfigError(f"{key}: must be a whole number of bytes, got {text!r}")
    return int(size)


# --- the specs -------------------------------------------------------------------------


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
    latency_ms: float = 0.0  # recorded for the simulator, not emulated
    device_flops: float | None = None  # peak flop/s of one device, for the simulator
    device_memory: int | None = None  # bytes of one device, for the simulator

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


@dataclass(frozen=True)
class LinkSpec:
    """The path between any worker of site `a` and any of site `b`: bandwidth each direction."""

    a: str
    b: str
    bandwidth_bps: int
    latency_ms: float = 0.0  # recorded for the simulator, not emulated

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


# --- the parser ------------------------------------------------------------------------


def _no_unknown_keys(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = [k for k in table if k not in known]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(known)}")


def _site(name: str, raw: object) -> SiteSpec:
    key = f"sites.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{key}: site {name} must be a table ([sites.{name}]), got {type(raw).__name__} {raw!r}"
        )
    _no_unknown_keys(raw, SITE_KEYS, key)
    for required, example in (("devices", "2"), ("cpus", "0.5"), ("bandwidth", '"1gbit"')):
        if required not in raw:
            raise ConfigError(
                f"{key}.{required}: missing for site {name}; add {required} = {example}"
            )
    flops = memory = None
    if "device" in raw:
        preset = raw["device"]
        if not isinstance(preset, str) or preset.lower() not in DEVICE_PRESETS:
            raise ConfigError(
                f"{key}.device: unknown preset {preset!r}; presets: {', '.join(DEVICE_PRESETS)}"
            )
        flops, memory = DEVICE_PRESETS[preset.lower()]
    if "device_flops" in raw:  # explicit values override the preset
        flops = parse_flops(raw["device_flops"], f"{key}.device_flops")
    if "device_memory" in raw:
        memory = parse_memory(raw["device_memory"], f"{key}.device_memory")
    return SiteSpec(
        name=name,
        devices=raw["devices"],
        cpus=raw["cpus"],
        bandwidth_bps=parse_rate(raw["bandwidth"], f"{key}.bandwidth"),
        latency_ms=parse_latency(raw["latency"], f"{key}.latency") if "latency" in raw else 0.0,
        device_flops=flops,
        device_memory=memory,
    )


def _link(
    k: int, raw: object, sites: dict[str, SiteSpec], seen: dict[frozenset[str], int]
) -> LinkSpec:
    key = f"links[{k}]"
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{key}: must be a table written [[links]], got {type(raw).__name__} {raw!r}"
        )
    _no_unknown_keys(raw, LINK_KEYS, key)
    if "sites" not in raw:
        raise ConfigError(
            f'{key}.sites: missing; add sites = ["A", "B"] naming the two sites it joins'
        )
    pair = raw["sites"]
    if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(s, str) for s in pair):
        raise ConfigError(f"{key}.sites: must list exactly two site names, got {pair!r}")
    a, b = pair
    for end in (a, b):
        if end not in sites:
            raise ConfigError(f"{key}.sites: unknown site {end!r}; sites are {', '.join(sites)}")
    if a == b:
        raise ConfigError(
            f"{key}.sites: a link joins two different sites, got {a} twice; "
            f"site {a}'s own bandwidth is sites.{a}.bandwidth"
        )
    pair_key = frozenset((a, b))
    if pair_key in seen:
        raise ConfigError(
            f"{key}.sites: duplicate link between sites {a} and {b} (first at links[{seen[pair_key]}])"
        )
    seen[pair_key] = k
    if "bandwidth" not in raw:
        raise ConfigError(
            f'{key}.bandwidth: missing for the link between sites {a} and {b}; add bandwidth = "20mbit"'
        )
    return LinkSpec(
        a=a,
        b=b,
        bandwidth_bps=parse_rate(raw["bandwidth"], f"{key}.bandwidth (sites {a}, {b})"),
        latency_ms=parse_latency(raw["latency"], f"{key}.latency (sites {a}, {b})")
        if "latency" in raw
        else 0.0,
    )


def _cluster(doc: dict[str, Any], default_name: str) -> ClusterSpec:
    _no_unknown_keys(doc, TOP_KEYS, "top level")
    name = doc.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"name: must be a non-empty string, got {name!r}")
    raw_sites = doc.get("sites")
    if raw_sites is None:
        raise ConfigError(
            "sites: missing; add at least one [sites.NAME] table with devices, cpus and bandwidth"
        )
    if not isinstance(raw_sites, dict):
        raise ConfigError(
            f"sites: must be tables written [sites.NAME], got {type(raw_sites).__name__} {raw_sites!r}"
        )
    if not raw_sites:
        raise ConfigError(
            "sites: empty; add at least one [sites.NAME] table with devices, cpus and bandwidth"
        )
    sites = {site_name: _site(site_name, raw) for site_name, raw in raw_sites.items()}
    raw_links = doc.get("links", [])
    if not isinstance(raw_links, list):
        raise ConfigError(
            f"links: must be tables written [[links]], got {type(raw_links).__name__} {raw_links!r}"
        )
    seen: dict[frozenset[str], int] = {}
    links = {}
    for k, raw in enumerate(raw_links):
        link = _link(k, raw, sites, seen)
        links[link.key] = link
    return ClusterSpec(sites=sites, links=links, name=name.strip())


def parse_cluster(text: str, source: str = "<string>") -> ClusterSpec:
    """Read a cluster file's text; `source` names it in errors (and, stem only, is the default name)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{source}: not valid TOML: {detail}") from None
    default_name = "cluster" if source.startswith("<") else Path(source).stem
    try:
        return _cluster(doc, default_name)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster file (TOML) from disk."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: cluster file not found (examples are in examples/clusters/)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the cluster file: {exc}") from None
    return parse_cluster(text, source=str(path))
