#!/usr/bin/env python
"""End to end: fusionllm against torch.distributed.pipelining, in the same emulated network.

For each cluster file (or random cluster, ``random:SEED``), one testbed (network namespaces, tc rate limits, CPU quotas) is brought up
and four systems train the same model on the same data, batch, sequence length and seed, one after
the other, in the same namespaces and on the same links:

1. ``peer``: PyTorch's ``torch.distributed.pipelining`` over gloo (``benchmarks/peer_pipelining.py``),
   GPipe, the blocks split evenly into one stage per device, in device order;
2. ``uniform``: fusionllm with the ``uniform`` scheduler (one stage per device, in device order),
   GPipe, no compression: the difference to the peer is the runtime alone;
3. ``opfence``: fusionllm with OP-Fence, no compression;
4. ``opfence+adatopk``: fusionllm with OP-Fence and AdaTopK;
5. ``hivemind``: data parallel with ``hivemind.Optimizer`` (local updates, parameters averaged
   every ``--hivemind-average-every`` steps, fp16 state averaging; ``benchmarks/peer_hivemind.py``),
   the batch of each step split over the devices. It runs in its own virtual environment
   (``benchmarks/.hivemind-venv``: hivemind 1.1.12 needs numpy < 2.4); without it the system is
   skipped. Make it with ``python benchmarks/e2e.py --make-hivemind-venv``.

``--task vision`` (``--model resnet18 --image-size 32`` by default) trains a ResNet of the vision
task on its seeded synthetic images instead: the peer splits it at residual blocks
(``peer_pipelining.py --task vision``), the fusionllm systems run ``--task vision``; tokens/s
becomes images/s and the validation accuracy is reported next to the loss (hivemind has no vision
task and is skipped).

Reported per run: median tokens/s over the steps after warm-up, the wall time to reach a validation
loss that every run reaches (the highest final validation loss among them), bytes per link as tc
counts them (packet headers included, the same counter for every system), and the simulator's
predicted step time next to the measured one. Writes e2e.json, e2e.md, e2e_tokens.png and
e2e_loss_time.png. Needs root (the testbed).

    python benchmarks/e2e.py [--quick] [--clusters three-sites uniform random:12] [--steps 120] [--merge] [--systems peer hivemind]
    python benchmarks/e2e.py --task vision --clusters three-sites --systems peer uniform opfence opfence+adatopk \
        --steps 60 --eval-every 20 --eval-batches 2 --out benchmarks/results/e2e/vision
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import exit_on_sigterm, kept_provenance, pyplot, read_metrics, results_dir, stop, write  # noqa: E402

from fusionllm.cluster.spec import load_cluster  # noqa: E402
from fusionllm.launch.local_cluster import run_local_cluster  # noqa: E402
from fusionllm.launch.offline import offline  # noqa: E402
from fusionllm.schedule.plan import Request  # noqa: E402
from fusionllm.sim.simulator import simulate  # noqa: E402
from fusionllm.testbed.testbed import Testbed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().parent / "peer_pipelining.py"
HIVEMIND_PEER = Path(__file__).resolve().parent / "peer_hivemind.py"
HIVEMIND_VENV = Path(__file__).resolve().parent / ".hivemind-venv"
# hivemind 1.1.12 with numpy < 2.4 (numpy 2.4 breaks its 8-bit decoder); torch pinned to the CPU build the project uses
HIVEMIND_PINS = ["hivemind==1.1.12", "numpy<2.4", "torch==2.13.0"]
HIVEMIND_LIGHT_DEPS = ["safetensors>=0.4,<1", "typer>=0.12,<1", "rich>=13,<16"]  # the project's own, less matplotlib
SYSTEMS = {  # name: (scheduler, schedule, codec); None: the peer; a function (added below): a system with its own runner
    "peer": None,
    "uniform": ("uniform", "gpipe", "none"),
    "opfence": ("opfence", "1f1b", "none"),
    "opfence+adatopk": ("opfence", "1f1b", "adatopk"),
    # data parallel by hand: two replicas of two stages (4 devices), the replica all-reduce on the data plane or in a gloo group
    "replicas": ("replicas:2,2", "1f1b", "none", "--collectives", "off"),
    "replicas+gloo": ("replicas:2,2", "1f1b", "none", "--collectives", "auto"),
}


CLUSTERS = ("three-sites", "uniform", "random:12", "random:7")
# --quick (``fusionllm bench --quick``): one cluster, the peer against fusionllm's modes, in under 10 minutes
QUICK_STEPS, QUICK_CLUSTERS, QUICK_SYSTEMS = 24, ("three-sites",), ("peer", "opfence", "opfence+adatopk", "hierarchical")


def task_args(args: argparse.Namespace) -> list[str]:
    return [] if args.task == "lm" else ["--task", args.task, "--image-size", str(args.image_size)]


def items_per_row(args: argparse.Namespace) -> int:
    """What one batch row counts for: seq_len tokens of a language model, one image for vision."""
    return args.seq_len if args.task == "lm" else 1


def unit(args: argparse.Namespace) -> str:
    return "tokens" if args.task == "lm" else "images"


def common_args(args: argparse.Namespace) -> list[str]:
    return [*task_args(args), "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--micro-batches", str(args.micro_batches), "--lr", str(args.lr), "--seed", str(args.seed), "--warmup", str(args.lr_warmup),
            "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches)]


def peer_launch(tb: Testbed, metrics: Path, training: list[str]) -> tuple[list[list[str]], dict[str, str]]:
    """The peer's command per device (in its namespace and CPU cgroup) and their environment."""
    n = len(tb.slots)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0" if tb.emulated else "lo"}
    port = str(29500 + int(time.time()) % 400)
    cmds = [[*s.command_prefix(), sys.executable, str(PEER), "--rank", str(s.index), "--world", str(n), "--master-addr", tb.slots[0].address,
             "--master-port", port, "--threads", str(s.threads()), "--timeout", "120", "--metrics", str(metrics), *training] for s in tb.slots]
    return cmds, env


def run_peer(tb: Testbed, args: argparse.Namespace, metrics: Path, log: Path) -> None:
    cmds, env = peer_launch(tb, metrics, common_args(args))
    with log.open("w") as out:
        procs = [subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT) for cmd in cmds]
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            stop(procs, grace=0)
    if any(codes):
        raise RuntimeError(f"the peer failed (exit codes {codes}); its log: {log}\n{log.read_text()[-2000:]}")


def run_fusion(tb: Testbed, path: Path, system: tuple[str, ...], args: argparse.Namespace, metrics: Path, run_dir: Path) -> None:
    scheduler, schedule, codec, *extra = system
    plan = ["--replicas", scheduler.split(":", 1)[1]] if scheduler.startswith("replicas:") else ["--scheduler", scheduler, "--hardware", str(path)]
    coord = [*common_args(args), *plan, "--schedule", schedule, "--compress", codec, "--metrics", str(metrics), *extra]
    worker_args, prefixes = tb.worker_launch()
    code = run_local_cluster(coord, len(tb.slots), run_dir, host=tb.coordinator_host, worker_args=worker_args, worker_prefixes=prefixes)
    if code != 0:
        raise RuntimeError(f"fusionllm {scheduler}/{codec} failed (exit {code}); logs in {run_dir}")


def hivemind_python() -> Path | None:
    """The hivemind virtual environment's interpreter, or None if it is not made (or broken)."""
    py = HIVEMIND_VENV / "bin" / "python"
    if not py.exists():
        return None
    ok = subprocess.run([str(py), "-c", "import hivemind, fusionllm"], capture_output=True).returncode == 0
    return py if ok else None


def make_hivemind_venv() -> int:
    """Create benchmarks/.hivemind-venv: hivemind and its pins, the project itself (no deps) and its light deps."""
    t0 = time.perf_counter()
    pip = [str(HIVEMIND_VENV / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    for cmd in ([sys.executable, "-m", "venv", str(HIVEMIND_VENV)], [*pip, *HIVEMIND_PINS],
                [*pip, "--no-deps", "-e", str(ROOT)], [*pip, *HIVEMIND_LIGHT_DEPS]):
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            print(f"failed: {' '.join(cmd)}", file=sys.stderr)
            return 1
    check = "import hivemind, numpy, torch; hivemind.DHT(start=True).shutdown(); print(hivemind.__version__, numpy.__version__, torch.__version__)"
    done = subprocess.run([str(HIVEMIND_VENV / "bin" / "python"), "-c", check], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"made {HIVEMIND_VENV}, but a DHT (its p2pd daemon) does not start there:\n{done.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"made {HIVEMIND_VENV} in {time.perf_counter() - t0:.0f} s; hivemind, numpy, torch: {done.stdout.strip()}; a DHT (p2pd) starts")
    return 0


def run_hivemind(tb: Testbed, args: argparse.Namespace, metrics: Path, log: Path) -> dict:
    """One peer_hivemind.py per device, in its namespace and CPU cgroup; rank 0 bootstraps the DHT.
    Writes ``metrics`` (merged, peer_pipelining's shape) and returns hivemind's own counts."""
    from peer_hivemind import merge

    py = hivemind_python()
    n = len(tb.slots)
    peers_file = log.with_suffix(".peers")
    peers_file.unlink(missing_ok=True)
    run_id = f"e2e-{os.getpid()}-{int(time.time())}"
    procs = []
    with log.open("w") as out:
        for s in tb.slots:
            cmd = [*s.command_prefix(), str(py), str(HIVEMIND_PEER), "--rank", str(s.index), "--world", str(n),
                   "--address", s.address, "--peers-file", str(peers_file), "--run-id", run_id, "--threads", str(s.threads()),
                   "--average-every", str(args.hivemind_average_every), "--compression", args.hivemind_compression,
                   "--timeout", "180", "--metrics", str(metrics), *common_args(args)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            stop(procs, grace=0)
    if any(codes):
        raise RuntimeError(f"hivemind failed (exit codes {codes}); its log: {log}\n{log.read_text()[-3000:]}")
    steps = merge(metrics, n)
    summary = json.loads(metrics.read_text().splitlines()[0])
    return {**summary, "elapsed_peers": [r["elapsed_peers"] for r in steps], "epochs": [r["epochs"] for r in steps]}


SYSTEMS["hivemind"] = run_hivemind


def run_hierarchical(tb: Testbed, args: argparse.Namespace, metrics: Path, log: Path) -> dict:
    """fusionllm --sync hierarchical: the planner forms groups from the cluster file (OP-Fence inside
    each), every group trains on its own data shard with the full batch, rounds of inner steps; the
    run's ``--steps`` is the fastest group's inner steps. Returns the plan and the outer traffic."""
    path = Path(args.cluster_file)
    coord = [*common_args(args), "--scheduler", "opfence", "--schedule", "1f1b", "--compress", "none", "--hardware", str(path),
             "--metrics", str(metrics), "--sync", "hierarchical", "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum),
             *(["--group-batch", str(args.group_batch)] if args.group_batch else []),
             *(["--inner-steps", str(args.inner_steps)] if args.inner_steps else [])]
    worker_args, prefixes = tb.worker_launch()
    run_dir = log.with_suffix("")
    code = run_local_cluster(coord, len(tb.slots), run_dir, host=tb.coordinator_host, worker_args=worker_args, worker_prefixes=prefixes)
    if code != 0:
        raise RuntimeError(f"fusionllm --sync hierarchical failed (exit {code}); logs in {run_dir}")
    lines = read_metrics(metrics).records
    plan = next(r for r in lines if r.get("event") == "plan")
    outer = next((r for r in lines if r.get("event") == "outer_bytes"), {})
    left_out = [r for r in lines if r.get("event") in ("left_out", "group_left")]
    return {"hier_plan": {k: plan.get(k) for k in ("groups", "fragments", "codec", "rounds", "outer_lr", "outer_momentum", "overlap")},
            "hier_predicted": plan.get("predicted", {}), "outer_payload_bytes": sum(outer.get("bytes", {}).values()), "left_out": left_out}


SYSTEMS["hierarchical"] = run_hierarchical


def summarize_hier(rec: list[dict], link_bytes: dict) -> dict:
    """A hierarchical run's row: tokens/s over the whole run (all groups), the validation loss of
    the outer weights at each evaluation."""
    steps = [r for r in rec if "loss" in r]
    evals = [r for r in rec if "val_loss" in r]
    wall = max(r["elapsed_s"] for r in rec)
    tokens = max(r["tokens"] for r in rec)
    first = statistics.mean(r["loss"] for r in steps[: max(1, len({r['group'] for r in steps}))])
    last = statistics.mean(r["loss"] for r in steps[-5:])
    return {
        "system": "hierarchical", "median_step_s": round(wall / max(1, len(steps)), 4), "tokens_per_s": round(tokens / wall, 1),
        "mean_tokens_per_s": round(tokens / wall, 1), "predicted_step_s": None, "sim_error": None,
        "first_loss": first, "last_loss": last, "trained": last < first - 0.5, "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "wall_s": wall, "tokens": tokens, "val_curve": [(r["step"], r["elapsed_s"], r["val_loss"]) for r in evals],
        "val_tokens": [(r["tokens"], r["val_loss"]) for r in evals],
        "link_bytes": {f"w{a}->w{b}": v for (a, b), v in sorted(link_bytes.items()) if v > 0}, "plan": "",
    }


def model_params(model: str, task: str = "lm", image_size: int = 32) -> int:
    if task != "lm":
        from fusionllm.models.task import build_task_model, load_task

        t = load_task(task, {"model": model, "data": None, "seed": 0, "batch_size": 1, "image_size": image_size})
        return sum(p.numel() for p in build_task_model(t, 0, device="meta").parameters())
    from fusionllm.models.spec import build_model

    return sum(p.numel() for p in build_model(model, 256, device="meta").parameters())


def device_busy(rec: list[dict], spec: Any) -> dict[str, float]:
    """Each worker's CPU seconds (its process, as it reports them with every step) over the CPU
    seconds its quota allowed, between its first and its last step."""
    quota = {d.index: d.cpus for d in spec.devices()}
    seen: dict[str, list[tuple[float, float]]] = {}
    for r in rec:
        for w, cpu in (r.get("cpu_s") or {}).items():
            seen.setdefault(w, []).append((r["elapsed_s"], cpu))
    out = {}
    wall = max((r["elapsed_s"] for r in rec), default=0.0) - min((r["elapsed_s"] for r in rec), default=0.0)
    for w, points in seen.items():
        if len(points) > 1 and quota.get(int(w)) and wall > 0:
            out[w] = round((points[-1][1] - points[0][1]) / (quota[int(w)] * wall), 3)
    return out


def summarize(name: str, rec: list[dict], args: argparse.Namespace, predicted: float | None, link_bytes: dict) -> dict:
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rec, rec[1:], strict=False)][args.warmup:]
    median = statistics.median(steps)
    losses = [r["loss"] for r in rec]
    per_step = args.batch_size * items_per_row(args)  # tokens (images for --task vision) per step
    return {
        "system": name, "median_step_s": round(median, 4), "tokens_per_s": round(per_step / median, 1),
        # the same steps' mean: lower than the median's when some steps stall (hivemind's averaging rounds)
        "mean_tokens_per_s": round(per_step / statistics.mean(steps), 1),
        "predicted_step_s": None if predicted is None else round(predicted, 4),
        "sim_error": None if predicted is None else round(predicted / median - 1, 4),
        "first_loss": losses[0], "last_loss": sum(losses[-5:]) / len(losses[-5:]),
        "trained": sum(losses[-5:]) / len(losses[-5:]) < losses[0] - args.trained_drop,
        "final_val_loss": rec[-1].get("val_loss"), "final_val_accuracy": rec[-1].get("val_accuracy"), "wall_s": rec[-1]["elapsed_s"],
        "val_curve": [(r["step"], r["elapsed_s"], r["val_loss"]) for r in rec if "val_loss" in r],
        "link_bytes": {f"w{a}->w{b}": v for (a, b), v in sorted(link_bytes.items()) if v > 0},
        "plan": rec[0].get("plan", ""),
    }


RANDOM_SHAPE = {"kind": "cpu", "sites": (3, 3), "devices": (4, 4), "latency": False}  # `random:SEED`: four devices in three sites


def cluster_path(name: str, tmp: Path) -> Path:
    """examples/clusters/NAME.toml, or for ``random:SEED`` a random CPU cluster written to ``tmp``."""
    if not name.startswith("random:"):
        return ROOT / "examples" / "clusters" / f"{name}.toml"
    from fusionllm.cluster.random import ClusterShape, random_cluster_toml

    path = tmp / f"random-{name.split(':', 1)[1]}.toml"
    path.write_text(random_cluster_toml(int(name.split(":", 1)[1]), ClusterShape(**RANDOM_SHAPE)))
    return path


def bench_cluster(name: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    path = cluster_path(name, tmp)
    spec = load_cluster(path)
    rows = []
    with Testbed(spec) as tb:
        if not tb.emulated:
            raise SystemExit(f"e2e needs the emulated testbed ({tb.why_not}): run it as root on Linux")
        for system in args.systems:
            metrics = tmp / f"{name}-{system}.jsonl"
            before = tb.link_bytes()
            print(f"[{name}] {system} ...", flush=True)
            extra = {}
            args.cluster_file = str(path)
            if callable(SYSTEMS[system]):
                extra = {system: SYSTEMS[system](tb, args, metrics, tmp / f"{name}-{system}.log")}
                predicted = None
            elif SYSTEMS[system] is None:
                run_peer(tb, args, metrics, tmp / f"{name}-peer.log")
                req = Request(args.batch_size, items_per_row(args), args.micro_batches, schedule="gpipe")
                _, _, cost, plan = offline(args.model, str(path), "uniform", req, task=args.task, image_size=args.image_size)
                predicted = simulate(plan, cost, req).step_time_s
            else:
                run_fusion(tb, path, SYSTEMS[system], args, metrics, tmp / f"{name}-{system}")
                predicted = None
            after = tb.link_bytes()
            lines = read_metrics(metrics).records
            rec = [r for r in lines if "step" in r]
            plan_event = next((r for r in lines if r.get("event") == "plan"), None)
            if predicted is None:
                predicted = rec[0].get("predicted_step_s")
            sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if system == "hierarchical":
                row = {"cluster": name, **summarize_hier(rec, sent), **extra}
            else:
                row = {"cluster": name, **summarize(system, rec, args, predicted, sent), **extra}
                row["val_tokens"] = [((r["step"] + 1) * args.batch_size * items_per_row(args), r["val_loss"]) for r in rec if "val_loss" in r]
            row["unit"] = unit(args)  # what tokens_per_s counts: tokens, or images for --task vision
            row["device_busy"] = device_busy(rec, spec)
            if plan_event is not None and system != "hierarchical":
                row["plan"] = json.dumps({k: plan_event.get(k) for k in ("stages", "micro_batches", "schedule")}, sort_keys=True)
                row["ratios"] = rec[-1].get("ratios", {})
            rows.append(row)
            acc = "" if row.get("final_val_accuracy") is None else f", val accuracy {row['final_val_accuracy']:.3f}"
            print(f"[{name}] {system}: {row['tokens_per_s']:.1f} {unit(args)}/s, val {row['final_val_loss']:.3f}{acc}, "
                  f"predicted {row['predicted_step_s']} s vs {row['median_step_s']} s", flush=True)
    trained = [r for r in rows if r["trained"]]
    target = max(r["final_val_loss"] for r in trained) if trained else float("nan")
    for r in rows:
        r["target_val_loss"] = target
        r["time_to_target_s"] = next((t for _, t, v in r["val_curve"] if v <= target + 1e-9), None)
    return rows


def retarget(rows: list[dict]) -> None:
    """Per cluster, the target validation loss (the highest final one of the systems that trained)
    and each system's time to it, over every row (also rows kept from an earlier run by --merge)."""
    for c in dict.fromkeys(r["cluster"] for r in rows):
        mine = [r for r in rows if r["cluster"] == c]
        trained = [r for r in mine if r["trained"]]
        target = max(r["final_val_loss"] for r in trained) if trained else float("nan")
        for r in mine:
            r["target_val_loss"] = target
            r["time_to_target_s"] = next((t for _, t, v in r["val_curve"] if v <= target + 1e-9), None)


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    u = unit(args)
    vision = args.task != "lm"
    shape = f"batch {args.batch_size} images {args.image_size}x{args.image_size} (task {args.task})" if vision else f"batch {args.batch_size} x {args.seq_len}"
    lines = [f"Model {args.model}, {shape}, {args.micro_batches} micro-batches, {args.steps} steps, seed {args.seed}, "
             f"lr {args.lr}; {u}/s from the median step after {args.warmup} warm-up steps (and from the mean of the same steps); validation every {args.eval_every} steps on "
             f"{args.eval_batches} held-out batches (evaluation time excluded from the clock for every system). Bytes: tc's counters, all links.", "",
             f"| cluster | system | {u}/s | vs peer | {u}/s (mean step) | predicted step (s) | measured step (s) | sim error | final val loss |"
             + (" final val accuracy |" if vision else "") + " time to target (s) | MB sent |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if vision else "")]
    fmt = ".1f" if vision else ".0f"
    for r in rows:
        peer = next((p for p in rows if p["cluster"] == r["cluster"] and p["system"] == "peer"), None)
        vs = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"
        pred = "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.3f}"
        err = "-" if r["sim_error"] is None else f"{r['sim_error']:+.0%}"
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
        trained = "" if r["trained"] else " (did not train)"
        mean = f"{r['mean_tokens_per_s']:{fmt}}" if "mean_tokens_per_s" in r else "-"
        acc = "-" if r.get("final_val_accuracy") is None else f"{r['final_val_accuracy']:.3f}"
        lines.append(f"| {r['cluster']} | {r['system']}{trained} | {r['tokens_per_s']:{fmt}} | {vs} | {mean} | {pred} | {r['median_step_s']:.3f} | {err} | "
                     f"{r['final_val_loss']:.3f} |" + (f" {acc} |" if vision else "") + f" {ttt} | {sum(r['link_bytes'].values()) / 1e6:.1f} |")
    clusters = dict.fromkeys(r["cluster"] for r in rows)
    lines.append("")
    for c in clusters:
        lines.append(f"{c}: target validation loss {next(r for r in rows if r['cluster'] == c)['target_val_loss']:.3f} (the highest final one).")
    for r in rows:
        if r["system"] == "hivemind" and "hivemind" in r:
            peers = r["hivemind"]["peers"]
            rounds = [len(p["averaged"]) for p in peers]
            lines.append(f"{r['cluster']} hivemind: {len(peers)} peers, averaging rounds per peer {rounds} (group sizes of peer 0 "
                         f"{peers[0]['averaged'] if peers else []}), failed {[p['failed'] for p in peers]}, resyncs "
                         f"{[p['resyncs'] for p in peers]}; val loss: the mean of the peers' own models.")
    lines += ["", "Device busy (each worker's process CPU seconds over its quota's, first to last step; fusionllm systems report them):", ""]
    for r in rows:
        if r.get("device_busy"):
            busy = r["device_busy"]
            lines.append(f"- {r['cluster']} {r['system']}: " + ", ".join(f"w{w} {v:.0%}" for w, v in sorted(busy.items())) + f" (min {min(busy.values()):.0%})")
    for r in rows:
        if r["system"] == "hierarchical" and "hierarchical" in r:
            h = r["hierarchical"]
            n = len(h["hier_plan"]["groups"])
            params = model_params(args.model, args.task, args.image_size)
            rows_per_step = args.group_batch or args.batch_size  # data parallelism with the groups' batch
            dp = 8 * params * (n - 1) / (n * rows_per_step * items_per_row(args))  # ring all-reduce of fp32 gradients, every step, per token
            measured = sum(r["link_bytes"].values()) / r["tokens"]
            lines += ["", f"{r['cluster']} hierarchical: {n} groups " + ", ".join(f"{g['workers']} H={g['inner_steps']}" for g in h["hier_plan"]["groups"])
                      + f", {h['hier_plan']['fragments']} fragments, codec {h['hier_plan']['codec']}, {h['hier_plan']['rounds']} rounds; "
                      f"bytes between workers per {u[:-1]} {measured:.1f} (tc, headers included) against {dp:.0f} for synchronous data parallelism "
                      f"over the same groups (computed: a ring all-reduce of {params:,} fp32 gradients every step): {dp / measured:.0f}x fewer; "
                      f"groups left out of a round: {len(h['left_out'])}."]
            sync = next((x for x in rows if x["cluster"] == r["cluster"] and x["system"] == "opfence+adatopk"), None)
            if sync and sync.get("time_to_target_s") and r.get("time_to_target_s"):
                lines.append(f"{r['cluster']}: time to the target validation loss, hierarchical {r['time_to_target_s']:.0f} s against OP-Fence + AdaTopK "
                             f"{sync['time_to_target_s']:.0f} s ({sync['time_to_target_s'] / r['time_to_target_s']:.1f}x faster).")
    lines += ["", f"OP-Fence + AdaTopK against OP-Fence alone ({u}/s; AdaTopK must never lose):", ""]
    for c in clusters:
        alone = next((r for r in rows if r["cluster"] == c and r["system"] == "opfence"), None)
        ada = next((r for r in rows if r["cluster"] == c and r["system"] == "opfence+adatopk"), None)
        if alone and ada:
            ratio = ada["tokens_per_s"] / alone["tokens_per_s"]
            lines.append(f"- {c}: {ratio:.2f}x ({ada['tokens_per_s']:{fmt}} vs {alone['tokens_per_s']:{fmt}}; plans {'the same' if ada['plan'] == alone['plan'] else 'different'}; "
                         f"{sum(ada['link_bytes'].values()) / 1e6:.1f} vs {sum(alone['link_bytes'].values()) / 1e6:.1f} MB sent)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a check in under 10 minutes: {QUICK_STEPS} steps on {', '.join(QUICK_CLUSTERS)}, "
                    f"systems {', '.join(QUICK_SYSTEMS)} (unless --clusters or --systems say otherwise)")
    ap.add_argument("--out", type=Path, default=results_dir("e2e"))
    ap.add_argument("--clusters", nargs="+", default=None,
                    help=f"names in examples/clusters, or random:SEED (four CPU devices in three sites); default {' '.join(CLUSTERS)}")
    ap.add_argument("--report", action="store_true", help="only rewrite e2e.md and the plots from e2e.json (with the arguments given)")
    ap.add_argument("--merge", action="store_true", help="keep the rows of the existing e2e.json not run this time")
    ap.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS), help="default: every system")
    ap.add_argument("--make-hivemind-venv", action="store_true", help=f"create {HIVEMIND_VENV.relative_to(ROOT)} for the hivemind system, then exit")
    ap.add_argument("--hivemind-average-every", type=int, default=8, help="hivemind: steps between parameter averaging rounds")
    ap.add_argument("--hivemind-compression", default="fp16", choices=("none", "fp16", "uint8"), help="hivemind: state averaging compression")
    ap.add_argument("--outer-lr", type=float, default=1.0, help="hierarchical: the outer optimiser's learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.0, help="hierarchical: the outer optimiser's Nesterov momentum")
    ap.add_argument("--inner-steps", type=int, default=None,
                    help="hierarchical: inner steps per round of the slowest group (default: the planner's choice)")
    ap.add_argument("--group-batch", type=int, default=None,
                    help="hierarchical: rows per inner step of every group (default --batch-size; --batch-size / groups keeps a step's tokens)")
    ap.add_argument("--task", default="lm", choices=("lm", "vision"), help="lm: GPTs on text; vision: ResNets on the seeded synthetic images")
    ap.add_argument("--model", default=None, help="default gpt-micro (--task lm), resnet18 (--task vision)")
    ap.add_argument("--image-size", type=int, default=32, help="--task vision: pixels square")
    ap.add_argument("--trained-drop", type=float, default=None,
                    help="a run trained if its last 5 losses average this much below its first (default 0.5 for lm, 0.15 for vision)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = ap.parse_args()
    args.clusters = args.clusters or list(QUICK_CLUSTERS if args.quick else CLUSTERS)
    args.systems = args.systems or list(QUICK_SYSTEMS if args.quick else SYSTEMS)
    exit_on_sigterm()
    args.model = args.model or ("gpt-micro" if args.task == "lm" else "resnet18")
    if args.trained_drop is None:
        args.trained_drop = 0.5 if args.task == "lm" else 0.15
    if args.make_hivemind_venv:
        return make_hivemind_venv()
    if args.report:  # the tables and plots again from e2e.json (targets over all its rows)
        saved = json.loads((args.out / "e2e.json").read_text())
        rows = saved["results"]
        retarget(rows)
        write(args.out, "e2e", rows, table(rows, args), {**kept_provenance(saved), "args": saved.get("args", {})})
        _plot(rows, args.out, unit(args))
        return 0
    if "hivemind" in args.systems and args.task != "lm":
        print("hivemind: skipped, peer_hivemind.py has no --task vision")
        args.systems = [s for s in args.systems if s != "hivemind"]
    if "hivemind" in args.systems and hivemind_python() is None:
        print(f"hivemind: skipped, no working {HIVEMIND_VENV.relative_to(ROOT)}; make it with: python benchmarks/e2e.py --make-hivemind-venv")
        args.systems = [s for s in args.systems if s != "hivemind"]
    if args.quick:
        args.steps, args.eval_every, args.eval_batches, args.lr_warmup, args.warmup = QUICK_STEPS, 8, 2, 8, 3
        args.out = args.out / "quick" if args.out == results_dir("e2e") else args.out
    rows = []
    old = args.out / "e2e.json"
    if args.merge and old.exists():  # keep the clusters not run this time (each cluster can be its own run)
        rows = [r for r in json.loads(old.read_text())["results"] if r["cluster"] not in args.clusters or r["system"] not in args.systems]
    with tempfile.TemporaryDirectory(prefix="fusion-e2e-") as tmpdir:
        for name in args.clusters:
            rows += bench_cluster(name, args, Path(tmpdir))
    retarget(rows)
    order = {c: i for i, c in enumerate(dict.fromkeys(r["cluster"] for r in rows))}
    rows.sort(key=lambda r: (order[r["cluster"]], list(SYSTEMS).index(r["system"])))
    write(args.out, "e2e", rows, table(rows, args), {"args": {k: v for k, v in vars(args).items() if k != "out"}})
    _plot(rows, args.out, unit(args))
    return 0


def _plot(rows: list[dict], out: Path, u: str = "tokens") -> None:
    plt = pyplot()

    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        vals = [next((r["tokens_per_s"] for r in rows if r["cluster"] == c and r["system"] == s), 0) for c in clusters]
        ax.bar([k + i * width for k in range(len(clusters))], vals, width, label=s)
    ax.set_xticks([k + width * (len(systems) - 1) / 2 for k in range(len(clusters))], clusters)
    ax.set_ylabel(f"{u}/s (median step)")
    ax.set_title("fusionllm vs torch.distributed.pipelining, same emulated links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_tokens.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(clusters), figsize=(6 * len(clusters), 4), squeeze=False)
    for ax, c in zip(axes[0], clusters, strict=True):
        for r in rows:
            if r["cluster"] == c:
                ax.plot([p[1] for p in r["val_curve"]], [p[2] for p in r["val_curve"]], marker="o", ms=3, label=r["system"])
        ax.axhline(next(r["target_val_loss"] for r in rows if r["cluster"] == c), color="0.6", lw=0.8, ls="--")
        ax.set_title(c)
        ax.set_xlabel("wall time (s, training only)")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_loss_time.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(clusters), figsize=(6 * len(clusters), 4), squeeze=False)
    for ax, c in zip(axes[0], clusters, strict=True):
        for r in rows:
            if r["cluster"] == c and r.get("val_tokens"):
                ax.plot([p[0] for p in r["val_tokens"]], [p[1] for p in r["val_tokens"]], marker="o", ms=3, label=r["system"])
        ax.set_title(c)
        ax.set_xlabel(f"{u} trained (all groups / replicas)")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_loss_tokens.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
