"""Random cluster files: what property tests and ``experiments/plan_fuzz.py`` plan on.

A generated cluster is an ordinary cluster file (TOML text), so it goes through the same parser,
checks and ``Hardware.from_spec`` as a user's file. The draw covers the shapes users bring: a few
big sites or many single machines, devices whose speed and memory differ up to ``spread`` x, links
from 8 Mbit/s to 10 Gbit/s, some with latency. The same seed gives the same file on any machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fusionllm.cluster.spec import ClusterSpec, format_rate, parse_cluster

MIN_BPS = 8_000_000
MAX_BPS = 10_000_000_000


@dataclass(frozen=True)
class ClusterShape:
    """The ranges a random cluster is drawn from."""

    sites: tuple[int, int] = (2, 10)
    devices: tuple[int, int] = (2, 64)
    kind: str = "gpu"  # "gpu": accelerators (simulation only); "cpu": CPU quotas (the testbed can run it)
    spread: float = 10.0  # fastest / slowest device, largest / smallest memory
    total_cpus: float = 2.0  # "cpu" clusters: quotas add up to about this (the machine's cores)
    latency: bool = True  # draw link latencies (the testbed delays them with its forwarders, testbed/delay.py)
    link_latency: float = 0.7  # with latency: the chance that a link between two sites has some (1: every one)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _rate(rng: random.Random, lo: float = MIN_BPS, hi: float = MAX_BPS) -> str:
    # whole Mbit/s keep the text short and exact
    return format_rate(max(1, round(_log_uniform(rng, lo, hi) / 1e6)) * 1_000_000)


def random_cluster_toml(seed: int, shape: ClusterShape = ClusterShape()) -> str:
    """A cluster file's text, a pure function of ``seed`` and ``shape``."""
    if shape.kind not in ("gpu", "cpu"):
        raise ValueError(f"ClusterShape.kind must be 'gpu' or 'cpu', got {shape.kind!r}")
    rng = random.Random(f"fusionllm-cluster-{seed}")
    n_dev = rng.randint(max(shape.devices[0], shape.sites[0]), shape.devices[1])
    n_sites = rng.randint(shape.sites[0], min(shape.sites[1], n_dev))
    # split the devices among the sites: some sites of one device, some large ones
    counts = [1] * n_sites
    for _ in range(n_dev - n_sites):
        counts[rng.randrange(n_sites) if rng.random() < 0.5 else rng.randrange(max(1, n_sites // 2))] += 1
    rng.shuffle(counts)
    speeds = [_log_uniform(rng, 1.0, shape.spread) for _ in range(n_sites)]
    lines = [f'name = "random-{shape.kind}-{seed}"', ""]
    if shape.kind == "cpu":
        scale = shape.total_cpus / sum(s * c for s, c in zip(speeds, counts, strict=True))
    for k, (count, speed) in enumerate(zip(counts, speeds, strict=True)):
        lines.append(f"[sites.s{k}]")
        lines.append(f"devices = {count}")
        if shape.kind == "cpu":
            lines.append(f"cpus = {max(0.05, round(speed * scale, 2))}")
        else:
            lines.append("cpus = 1")
            lines.append(f'device_flops = "{round(15 * speed)}tflops"')
            lines.append(f'device_memory = "{round(_log_uniform(rng, 80 / shape.spread, 80))}GiB"')
        lines.append(f'bandwidth = "{_rate(rng, 1e9, MAX_BPS) if rng.random() < 0.8 else _rate(rng)}"')
        if shape.latency and rng.random() < 0.5:
            lines.append(f'latency = "{rng.choice([0.05, 0.1, 0.5])}ms"')
        lines.append("")
    for a in range(n_sites):
        for b in range(a + 1, n_sites):
            lines += ["[[links]]", f'sites = ["s{a}", "s{b}"]', f'bandwidth = "{_rate(rng)}"']
            if shape.latency and rng.random() < shape.link_latency:  # (drawn either way: a seed's other draws stay put)
                lines.append(f'latency = "{rng.choice([1, 5, 10, 20, 50])}ms"')
            lines.append("")
    return "\n".join(lines)


def random_cluster(seed: int, shape: ClusterShape = ClusterShape()) -> ClusterSpec:
    return parse_cluster(random_cluster_toml(seed, shape), source=f"<random cluster {seed}>")


RANDOM_KINDS = {"random": (3, False), "random-latency": (3, True), "random2": (2, False), "random2-latency": (2, True)}  # name: (sites, latency)


def named_shape(kind: str, *, devices: int = 4, total_cpus: float = 2.0) -> ClusterShape:
    """The shape a benchmark's random cluster name (``RANDOM_KINDS``) is drawn from: ``devices`` CPU devices."""
    if kind not in RANDOM_KINDS:
        raise ValueError(f"unknown random cluster kind {kind!r}; known: {', '.join(RANDOM_KINDS)} (as KIND:SEED)")
    sites, latency = RANDOM_KINDS[kind]
    return ClusterShape(kind="cpu", sites=(sites, sites), devices=(devices, devices), total_cpus=total_cpus, latency=latency,
                        link_latency=1.0 if latency and sites == 2 else 0.7)


def named_cluster_toml(name: str, *, devices: int = 4, total_cpus: float = 2.0) -> str | None:
    """The cluster file's text of ``KIND:SEED`` (``RANDOM_KINDS``), or None when ``name`` is no such name
    (a cluster file's name)."""
    kind, sep, seed = name.partition(":")
    if not sep or kind not in RANDOM_KINDS:
        return None
    if not seed.isdigit():
        raise ValueError(f"{name!r}: the seed after {kind}: must be a non-negative integer, e.g. {kind}:31")
    return random_cluster_toml(int(seed), named_shape(kind, devices=devices, total_cpus=total_cpus))
