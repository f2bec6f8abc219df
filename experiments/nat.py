#!/usr/bin/env python
"""Workers behind NAT on the testbed: equivalence, relayed throughput, and the cost of joining through a relay.

Two clusters, each inside the testbed (root; nftables), each trained with ``fusionllm coordinator``
and real ``fusionllm worker`` processes in their namespaces, compression off:

- ``nat-site``: site A (one reachable worker, started with ``--relay``) and site H behind NAT (two
  workers, ``uplink`` = the A-H link). H's workers talk to each other on their LAN and to A directly;
  what A sends them goes through A's relay (their tunnels).
- ``two-nats``: site A (reachable, ``--relay``) and two NAT sites H1 and H2 of one worker each: the two
  NATed workers exchange activations and gradients through A's relay (H1 -> A -> H2), never directly.

Each run plans with ``--scheduler params`` (a pipeline through every device, so activations and
gradients cross the relayed links) and no ``--hardware``: the coordinator probes every link through
the transport (through the relays where a link is relayed), and the plan record keeps those rates.
Reported:

- every step's loss against one process (``train_single``, the plan's micro-batches): goal 1e-5;
- each relayed link's probed rate against its shaped rate (the slowest of the link, the NAT sites'
  uplinks, and the relay's link): goal at least 90%;
- join time (``fusionllm worker`` start to registered, from the workers' own log line) of the NATed
  workers against the reachable one: goal at most 2 s more (all workers start together).

- ``random:SEED``: a random CPU cluster (``cluster.random``, 2-3 sites, 3-4 devices, random rates) whose
  sites are put behind NAT at random (at least one, never all: the first reachable worker relays).

    sudo python experiments/nat.py            # writes benchmarks/results/nat/nat.{json,md,png}
    sudo python experiments/nat.py --clusters nat-site two-nats random:1 random:2 --models gpt-micro gpt-nano
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    exit_on_sigterm,
    kept_provenance,
    pyplot,
    read_metrics,
    results_dir,
    write,
)

GOAL_LOSS, GOAL_RATE, GOAL_JOIN_S = 1e-5, 0.9, 2.0
CLUSTERS = {
    "nat-site": """name = "nat-site"
[sites.A]
devices = 1
cpus = 0.6
bandwidth = "1gbit"
[sites.H]
devices = 2
cpus = 0.6
bandwidth = "1gbit"
nat = true
uplink = "{rate}"
[[links]]
sites = ["A", "H"]
bandwidth = "{rate}"
""",
    "two-nats": """name = "two-nats"
[sites.A]
devices = 1
cpus = 0.6
bandwidth = "1gbit"
[sites.H1]
devices = 1
cpus = 0.6
bandwidth = "1gbit"
nat = true
[sites.H2]
devices = 1
cpus = 0.6
bandwidth = "1gbit"
nat = true
[[links]]
sites = ["A", "H1"]
bandwidth = "{rate}"
[[links]]
sites = ["A", "H2"]
bandwidth = "{rate}"
[[links]]
sites = ["H1", "H2"]
bandwidth = "{rate}"
""",
}
RANDOM_SHAPE = {"kind": "cpu", "sites": (2, 3), "devices": (3, 4), "latency": False}


def cluster_text(name: str, rate: str) -> str:
    """A named cluster's TOML; ``random:SEED``: a random CPU cluster with a random half of its sites
    (at least one, not all) behind NAT."""
    if not name.startswith("random:"):
        return CLUSTERS[name].format(rate=rate)
    import random

    from fusionllm.cluster.random import ClusterShape, random_cluster_toml

    seed = int(name.split(":", 1)[1])
    text = random_cluster_toml(seed, ClusterShape(**RANDOM_SHAPE))
    sites = re.findall(r"^\[sites\.(\w+)\]$", text, flags=re.M)
    rng = random.Random(f"nat-{seed}")
    natted = set(rng.sample(sites, rng.randint(1, len(sites) - 1)))
    return re.sub(r"^\[sites\.(\w+)\]$", lambda m: m.group(0) + ("\nnat = true" if m.group(1) in natted else ""), text, flags=re.M)


JOINED = re.compile(r"joined \S+ as worker (\d+), serving on (\S+), ([0-9.]+) s after it started")


def records(path: Path) -> list[dict]:
    return read_metrics(path).records


def train_args(args: argparse.Namespace, model: str) -> list[str]:
    return ["--model", model, "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--micro-batches", str(args.micro_batches), "--lr", str(args.lr), "--warmup", "2", "--seed", "0", "--eval-every", "0"]


def reference(args: argparse.Namespace, model: str, micro_batches: int, tmp: Path) -> list[float]:
    import torch

    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.reference.single import train_single

    torch.set_num_threads(1)
    metrics = tmp / f"single-{model}-{micro_batches}.jsonl"
    config = TrainConfig(model=model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=2, seed=0,
                         eval_every=0, metrics=str(metrics))
    return train_single(config, micro_batches=micro_batches).losses


def run_cluster(name: str, model: str, args: argparse.Namespace, tmp: Path) -> dict:
    from fusionllm.cluster.hardware import relayed
    from fusionllm.cluster.spec import parse_cluster
    from fusionllm.launch.local_cluster import run_local_cluster
    from fusionllm.testbed.testbed import Testbed

    text = cluster_text(name, args.rate)
    spec = parse_cluster(text, name.replace(":", "-"))
    slug = f"{name.replace(':', '-')}-{model}"
    metrics, run_dir = tmp / f"{slug}.jsonl", tmp / f"run-{slug}"
    os.environ["FUSIONLLM_LOGLEVEL"] = "INFO"  # the workers' join line
    with Testbed(spec) as tb:
        if not tb.emulated:
            raise SystemExit(f"the testbed is not emulated here ({tb.why_not}): run as root on Linux")
        worker_args, prefixes = tb.worker_launch()
        relays = [s.index for s in tb.slots if not s.nat][:1]
        for i in relays:
            worker_args[i] += ["--relay"]
        coord = [*train_args(args, model), "--compress", "none", "--scheduler", "params", "--probe-seconds", str(args.probe_seconds),
                 "--metrics", str(metrics)]
        print(f"[{name}, {model}] {len(tb.slots)} workers, NATed: {[s.index for s in tb.slots if s.nat]}, relay: worker {relays}", flush=True)
        code = run_local_cluster(coord, len(tb.slots), run_dir, host=tb.coordinator_host, worker_args=worker_args, worker_prefixes=prefixes)
        if code != 0:
            raise SystemExit(f"{name}: training failed (exit {code}); logs in {run_dir}")
        nat = {s.index: s.nat for s in tb.slots}
        shaped = {(i, j): tb.rate(i, j) for i in range(len(tb.slots)) for j in range(len(tb.slots)) if i != j}
    rec = records(metrics)
    plan = next(r for r in rec if r.get("event") == "plan")
    joins = {}
    for i in range(len(nat)):
        for line in (run_dir / f"worker-{i}.log").read_text(errors="replace").splitlines():
            m = JOINED.search(line)
            if m:
                joins[i] = float(m.group(3))
    losses = [r["loss"] for r in rec if "step" in r]
    ref = reference(args, model, int(plan["micro_batches"]), tmp)
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
    links = []
    hosts = {int(w): (info.get("address") or "").rpartition(":")[0] for w, info in plan["workers"].items()}
    for key, bps in plan.get("bandwidth_bps", {}).items():
        a, b = (int(w[1:]) for w in key.split("->"))
        through = relayed(spec, a, b) and nat[b]  # traffic into a NAT site goes through the relay that hosts b
        relay = (plan["workers"][str(b)].get("relay") or "").rpartition(":")[0] if through else ""
        via = next((w for w, h in hosts.items() if h == relay and not nat[w]), None) if relay else None
        path = [(a, b)] if not through or via is None else [p for p in ((a, via), (via, b)) if p[0] != p[1]]
        goal = min(shaped[p] for p in path)
        links.append({"link": key, "relayed": through, "relay": "none" if not through else f"w{via}" if via is not None else "coordinator",
                      "path": "->".join(f"w{x}" for x in [path[0][0], *(p[1] for p in path)]), "probed_bps": bps, "shaped_bps": goal,
                      "ratio": bps / goal})
    relayed_keys = {link["link"] for link in links if link["relayed"]}
    moved = sum(v for r in rec if "step" in r for k, v in (r.get("bytes") or {}).items() if k in relayed_keys)
    reachable = [joins[i] for i in joins if not nat[i]]
    natted = [joins[i] for i in joins if nat[i]]
    return {"cluster": name, "model": model, "sites": {s.name: ("NAT" if s.nat else "reachable") for s in spec.sites.values()}, "workers": len(nat), "natted": [i for i in nat if nat[i]], "steps": len(losses), "max_rel_loss_err": err,
            "micro_batches": plan["micro_batches"], "links": links, "join_s": joins, "relayed_training_bytes": moved,
            "stages": [s["workers"] for s in plan["stages"]],
            "join_extra_s": (max(natted) - max(reachable)) if natted and reachable else None,
            "first_step_s": next((r.get("step_s") for r in rec if r.get("step") == 0), None)}


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    out = ["| cluster | model | stages (workers) | steps | training bytes through relays | max loss error vs one process | join: reachable / NATed (s) | NATed extra (s) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reach = [f"{v:.2f}" for k, v in sorted(r["join_s"].items()) if int(k) not in r["natted"]]
        nat = [f"{v:.2f}" for k, v in sorted(r["join_s"].items()) if int(k) in r["natted"]]
        out.append(f"| {r['cluster']} | {r['model']} | {r['stages']} | {r['steps']} | {r['relayed_training_bytes'] / 1e6:.1f} MB | {r['max_rel_loss_err']:.1e} (goal {GOAL_LOSS:g}) | {', '.join(reach)} / {', '.join(nat)} "
                   f"| {r['join_extra_s']:+.2f} (goal <= {GOAL_JOIN_S:g}) |")
    out += ["", "| cluster | model | link | through a relay | path | probed | shaped | ratio (goal >= 0.9 on relayed links) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for link in r["links"]:
            out.append(f"| {r['cluster']} | {r['model']} | {link['link']} | {link['relay']} | {link['path']} | "
                       f"{link['probed_bps'] / 1e6:.1f} Mbit/s | {link['shaped_bps'] / 1e6:.1f} Mbit/s | {link['ratio']:.2f} |")
    for cap, what in ((1e9, "shaped at 1 Gbit/s or less"), (float("inf"), "all")):
        rel = sorted(link["ratio"] for r in rows for link in r["links"] if link["relayed"] and link["shaped_bps"] <= cap)
        direct = sorted(link["ratio"] for r in rows for link in r["links"] if not link["relayed"] and link["shaped_bps"] <= cap)
        if rel and direct:
            out += ["", f"Links {what}: {len(rel)} relayed, probed/shaped median {statistics.median(rel):.2f} (min {rel[0]:.2f}; "
                    f"{sum(x >= GOAL_RATE for x in rel)} of {len(rel)} at >= {GOAL_RATE}); {len(direct)} direct, median "
                    f"{statistics.median(direct):.2f} (min {direct[0]:.2f})."]
    out += ["", "Sites: " + "; ".join(f"{r['cluster']}: " + ", ".join(f"{k} {v}" for k, v in r["sites"].items())
                                      for r in {r["cluster"]: r for r in rows}.values()), "",
            f"Command: `python experiments/nat.py --rate {args.rate} --steps {args.steps} --clusters {' '.join(args.clusters)} --models {' '.join(args.models)}`; "
            "probed rates are the coordinator's own link probes (`MeasureTo`, through the relays), shaped rates what the testbed's tc allows."]
    return out


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, ratios, colours = [], [], []
    for r in rows:
        for link in r["links"]:
            labels.append(f"{r['cluster']} {r['model']}\n{link['link']}")
            ratios.append(link["ratio"])
            colours.append("tab:orange" if link["relayed"] else "tab:blue")
    ax.bar(range(len(ratios)), ratios, color=colours)
    ax.axhline(GOAL_RATE, color="k", ls="--", lw=1)
    ax.set_xticks(range(len(ratios)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("probed / shaped rate")
    ax.set_title("links on NAT clusters (orange: through a relay)")
    fig.tight_layout()
    fig.savefig(out / "nat.png", dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clusters", nargs="+", default=list(CLUSTERS), help=f"{', '.join(CLUSTERS)} or random:SEED")
    p.add_argument("--rate", default="40mbit", help="the links between sites (and the NAT sites' uplinks)")
    p.add_argument("--models", nargs="+", default=["gpt-micro"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--probe-seconds", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=results_dir("nat"))
    p.add_argument("--report", action="store_true", help="only rewrite nat.md and nat.png from nat.json (with the arguments given)")
    args = p.parse_args()
    exit_on_sigterm()
    if args.report:
        doc = json.loads((args.out / "nat.json").read_text())
        write(args.out, "nat", doc["results"], table(doc["results"], args), {**kept_provenance(doc), "goals": doc.get("goals", {})})
        plot(doc["results"], args.out)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusionllm-nat-") as tmp:
        for name in args.clusters:
            for model in args.models:
                rows.append(run_cluster(name, model, args, Path(tmp)))
    write(args.out, "nat", rows, table(rows, args), {"goals": {"loss": GOAL_LOSS, "relayed_rate": GOAL_RATE, "join_extra_s": GOAL_JOIN_S}})
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
