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

A site may sit behind a NAT (its workers open connections out; nothing from outside reaches
them unless they opened it)::

    [sites.home]
    devices = 2
    cpus = 0.5
    bandwidth = "1gbit"
    nat = true                  # default false
    uplink = "50mbit"           # its access link, each direction; default: the fastest of its links

The testbed emulates it (a router namespace that masquerades, see `fusionllm.testbed.testbed`);
``ClusterSpec.nat_sites()``, ``is_natted(i)`` and ``uplink_bps(site)`` tell everyone else.

Optional: ``latency = "5ms"`` on sites and links, one-way (a request and its answer cost twice
that); the simulator uses it and the testbed emulates it with a delaying forwarder in each worker's
namespace (`fusionllm.testbed.delay`; simulated only where ``nft`` is missing). Recorded for the
simulator only: on sites ``device = "a100"`` (a preset) or ``device_flops = "312tflops"`` /
``device_memory = "80GiB"``.

Every error is a one-line `ConfigError` of the form ``SOURCE: KEY.PATH: what is wrong``.

This module reads the file; the classes it builds are in `sites.py` and the quantities with
units (rates, latencies, flop/s, memory) in `units.py`. Every public name of the three is
importable from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fusionllm.cluster.sites import (
    MAX_CPUS,
    MAX_DEVICES,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    SiteSpec,
)
from fusionllm.cluster.units import (
    format_rate,
    parse_flops,
    parse_latency,
    parse_memory,
    parse_rate,
)
from fusionllm.core.errors import ConfigError

__all__ = [
    "DEVICE_PRESETS",
    "GiB",
    "LINK_KEYS",
    "MAX_CPUS",
    "MAX_DEVICES",
    "SITE_KEYS",
    "TOP_KEYS",
    "ClusterSpec",
    "DeviceSpec",
    "LinkSpec",
    "SiteSpec",
    "format_rate",
    "load_cluster",
    "parse_cluster",
    "parse_flops",
    "parse_latency",
    "parse_memory",
    "parse_rate",
]

GiB = 2**30

# Nominal peak dense fp16/bf16 tensor-core throughput (flop/s) and memory (bytes), from
# the vendors' data sheets. Real kernels reach a fraction of these; the simulator scales.
DEVICE_PRESETS: dict[str, tuple[float, int]] = {
    "a100": (312e12, 80 * GiB),  # A100 SXM 80 GB
    "h100": (989e12, 80 * GiB),  # H100 SXM
    "v100": (125e12, 32 * GiB),  # V100 SXM2 32 GB
    "rtx3090": (71e12, 24 * GiB),  # GeForce RTX 3090, fp32 accumulate
}

TOP_KEYS = ("name", "sites", "links")
SITE_KEYS = ("devices", "cpus", "bandwidth", "latency", "device", "device_flops", "device_memory", "nat", "uplink")
LINK_KEYS = ("sites", "bandwidth", "latency")


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
        nat=raw.get("nat", False),
        uplink_bps=parse_rate(raw["uplink"], f"{key}.uplink") if "uplink" in raw else None,
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
