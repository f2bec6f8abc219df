#!/usr/bin/env python
"""Time to a target loss: every system side by side, on one emulated cluster, one after the other.

For each cluster (a file of examples/clusters, ``random:SEED`` or ``random-latency:SEED``: four CPU
devices in three sites, links drawn log-uniformly, with latencies for the second) one testbed
(network namespaces, tc rate limits, CPU quotas) is brought up, and for each seed these systems
train the same model on the same data, batch, sequence length, learning-rate schedule and seed:

1. ``fastest``: the fastest device alone, one plain PyTorch process (``fusionllm train
   --single-process``) in that device's namespace and under its CPU quota: the honest baseline;
2. ``peer``: ``torch.distributed.pipelining`` over gloo, GPipe, blocks split evenly, one stage per
   device (``benchmarks/peer_pipelining.py``);
3. ``opfence`` and ``opfence+adatopk``: fusionllm, synchronous, OP-Fence's plan, without and with AdaTopK;
4. ``hierarchical``: fusionllm ``--sync hierarchical``, the planner's groups, H and group batch;
5. ``auto``: fusionllm ``--sync auto``: the planner's choice of one group or several by predicted
   time to target (docs/scheduler.md, "Time to target").

The target is fixed before any other system runs, from the fastest device's own curve: its
validation loss at ``--target-at`` of the run's steps, as the mean of its last three evaluations
(two runs of the same math drift apart by float rounding, and one evaluation can be a lucky dip:
every system is judged on the same mean of three, ``Smoothed``). Each system then runs with the same
``--steps`` (so the same schedule) and is stopped as soon as a validation loss at or below the
target is recorded (within float32 rounding: ``TOLERANCE``), or runs to its last step. Times are
the runs' own training clocks (evaluation excluded, as every system records it) from their first
step; ``wall`` adds the start-up (tracing, planning, probes, connections) from launch.

Predicted time to target: the simulator's step time times the steps the fastest device needed
(synchronous systems take the same steps: the same math), and for a plan of several groups the
target's tokens over the predicted goodput (tokens/s times per-token efficiency).

``--cpu-scale`` multiplies every device's CPU quota (default 1: the cluster as its file says; a
cluster file's quotas add up to this machine's two cores, so four busy devices share them with the
coordinator and the kernel's network stack, which the fastest device alone does not).

Writes time_to_target.json, .md, and plots of validation against time and against tokens, and
time to target per system. Needs root (the testbed).

    python benchmarks/time_to_target.py --clusters three-sites random:21 random:22 random-latency:23 --seeds 0 1 --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import exit_on_sigterm, kept_provenance, pyplot, read_metrics, results_dir, stop, write  # noqa: E402
from e2e import ROOT, device_busy, peer_launch  # noqa: E402

from fusionllm.cluster.random import ClusterShape, random_cluster_toml  # noqa: E402
from fusionllm.cluster.spec import load_cluster  # noqa: E402
from fusionllm.launch.local_cluster import read_pids, run_local_cluster  # noqa: E402
from fusionllm.launch.offline import offline  # noqa: E402
from fusionllm.schedule.plan import Request  # noqa: E402
from fusionllm.sim.simulator import simulate  # noqa: E402
from fusionllm.testbed.testbed import Slot, Testbed  # noqa: E402

SYSTEMS = ("fastest", "peer", "opfence", "opfence+adatopk", "hierarchical", "auto", "hierarchical-exact")
FUSION = {  # coordinator flags of the fusionllm systems (with --scheduler opfence --hardware CLUSTER)
    "opfence": ["--schedule", "1f1b", "--compress", "none", "--sync", "synchronous"],
    "opfence+adatopk": ["--schedule", "1f1b", "--compress", "adatopk", "--sync", "synchronous"],
    "hierarchical": ["--schedule", "1f1b", "--compress", "none", "--sync", "hierarchical"],
    "auto": ["--schedule", "1f1b", "--compress", "none", "--sync", "auto"],
    # a diagnostic: the planner's groups synced as the efficiency sweep's one-process groups are (each average applied at
    # once, uncompressed, one fragment): what streaming, its delay and the 4-bit codec cost per token
    "hierarchical-exact": ["--schedule", "1f1b", "--compress", "none", "--sync", "hierarchical", "--blocking-sync", "--outer-codec", "none",
                           "--fragments", "1"],
}
TOLERANCE = 1e-4  # relative: a synchronous system's validation loss at the target's step equals the target up to float32 rounding
SMOOTH = 3  # validation losses averaged (``Smoothed``)
POLL_S = 0.25


# ---- one run, stopped at the target ---------------------------------------------------------------
class Watch(threading.Thread):
    """Reads a metrics file as it grows; at the first record ``hit(record)`` accepts, remembers it
    and the monotonic time it was seen, and calls ``stop_run`` once."""

    def __init__(self, metrics: Path, hit: Callable[[dict], bool], stop_run: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.metrics, self.hit, self.stop_run = metrics, hit, stop_run
        self.record: dict | None = None
        self.seen_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        offset, tail = 0, b""
        while not self.done.is_set():
            if self.metrics.exists():
                with self.metrics.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                tail += chunk
                *lines, tail = tail.split(b"\n")
                for line in lines:
                    rec = json.loads(line) if line.strip() else {}
                    if self.hit(rec):
                        self.record, self.seen_at = rec, time.monotonic()
                        self.stop_run()
                        return
            self.done.wait(POLL_S)


class Smoothed:
    """The mean of the last ``SMOOTH`` validation losses, updated by each record that has one: two runs
    of the same math drift apart by float rounding and read noisy curves (1-2% between evaluations
    at gpt-micro's size), so a target is set and reached on this mean, never on one lucky evaluation."""

    def __init__(self) -> None:
        self.vals: list[float] = []

    def __call__(self, r: dict) -> float | None:
        if r.get("val_loss") is None:
            return None
        self.vals.append(r["val_loss"])
        return statistics.fmean(self.vals[-SMOOTH:]) if len(self.vals) >= SMOOTH else None


def reached(target: float) -> Callable[[dict], bool]:
    mean = Smoothed()

    def hit(r: dict) -> bool:
        m = mean(r)
        if m is not None and m <= target * (1 + TOLERANCE):
            r["smoothed_val_loss"] = m
            return True
        return False

    return hit


def at_budget(step: int) -> Callable[[dict], bool]:
    """The fastest device's run: its smoothed validation loss at ``step`` is the target."""
    mean = Smoothed()

    def hit(r: dict) -> bool:
        m = mean(r)
        if m is not None and r["step"] + 1 >= step:
            r["smoothed_val_loss"] = m
            return True
        return False

    return hit


def common_args(args: argparse.Namespace, seed: int) -> list[str]:
    warm = ["--init-from", str(args.warm_dir[seed])] if args.warm_start else []
    return [*warm, "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--micro-batches", str(args.micro_batches), "--lr", str(args.lr), "--seed", str(seed), "--warmup", str(args.lr_warmup),
            "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches)]


def run_procs(cmds: list[list[str]], log: Path, watch: Watch, timeout: float, env: dict | None = None) -> list[int]:
    """Start the commands, watch, wait; stopped by their handles when the target is seen."""
    with log.open("w") as out:
        procs = [subprocess.Popen(c, env=env, stdout=out, stderr=subprocess.STDOUT) for c in cmds]
        watch.stop_run = lambda: stop(procs, grace=2)
        watch.start()
        try:
            return [p.wait(timeout=timeout) for p in procs]
        finally:
            watch.done.set()
            stop(procs, grace=0)


def run_fastest(tb: Testbed, slot: Slot, args: argparse.Namespace, seed: int, metrics: Path, log: Path, watch: Watch) -> None:
    cmd = [*slot.command_prefix(), sys.executable, "-m", "fusionllm", "train", "--single-process", *common_args(args, seed),
           "--threads", str(slot.threads()), "--metrics", str(metrics)]
    codes = run_procs([cmd], log, watch, args.timeout)
    if codes[0] != 0 and watch.record is None:
        raise RuntimeError(f"the fastest device's run failed (exit {codes[0]}); its log: {log}\n{log.read_text()[-2000:]}")


def run_peer(tb: Testbed, args: argparse.Namespace, seed: int, metrics: Path, log: Path, watch: Watch) -> None:
    cmds, env = peer_launch(tb, metrics, common_args(args, seed))
    codes = run_procs(cmds, log, watch, args.timeout, env)
    if any(codes) and watch.record is None:
        raise RuntimeError(f"the peer failed (exit codes {codes}); its log: {log}\n{log.read_text()[-2000:]}")


def run_fusion(tb: Testbed, path: Path, system: str, args: argparse.Namespace, seed: int, metrics: Path, run_dir: Path, watch: Watch) -> None:
    hardware = [] if args.probe else ["--hardware", str(path)]  # --probe: the coordinator measures devices and links at the start
    coord = [*common_args(args, seed), "--scheduler", "opfence", *hardware, *FUSION[system], "--metrics", str(metrics)]

    def interrupt() -> None:  # the coordinator stops after the step in flight; the launcher then stops the workers
        pids = read_pids(run_dir)
        if pids is not None and pids.coordinator is not None:
            os.kill(pids.coordinator, signal.SIGINT)

    watch.stop_run = interrupt
    watch.start()
    worker_args, prefixes = tb.worker_launch()
    try:
        code = run_local_cluster(coord, len(tb.slots), run_dir, host=tb.coordinator_host, worker_args=worker_args, worker_prefixes=prefixes)
    finally:
        watch.done.set()
    if code == 130 and watch.record is None:  # Ctrl+C: the local cluster stopped its processes and said so
        raise KeyboardInterrupt
    if code != 0 and watch.record is None:
        raise RuntimeError(f"fusionllm {system} failed (exit {code}); logs in {run_dir}")


SPEED_PROBE = ("import time, torch; torch.set_num_threads(1); a = torch.randn(256, 256); t = time.perf_counter(); n = 0\n"
               "while time.perf_counter() - t < 2.0:\n    a @ a; n += 1\n"
               "print(n * 2 * 256 ** 3 / (time.perf_counter() - t) / 1e9)")


def machine_speed() -> float:
    """GFLOP/s of one core (a 256x256 matmul for 2 s, no quota) just before a run: the machine's speed
    drifts (a shared host), and systems measured one after the other are only comparable if it did not."""
    out = subprocess.run([sys.executable, "-c", SPEED_PROBE], capture_output=True, text=True, check=True)
    return round(float(out.stdout.strip()), 2)


def warm_checkpoint(args: argparse.Namespace, seed: int, tmp: Path) -> Path:
    """A checkpoint part-way trained, every system's starting point with ``--warm-start K``: K steps of
    one synchronous worker on loopback (outside the testbed: not timed), at another data seed than the
    runs' (they do not see its batches again), written as a Hugging Face directory (``fusionllm export``)."""
    out = tmp / f"warm-{seed}"
    if (out / "config.json").is_file():
        return out
    ck, run_dir = tmp / f"warm-{seed}-ck", tmp / f"warm-{seed}-run"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:1", "--sync", "synchronous", "--model", args.model,
           "--steps", str(args.warm_start), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", "1",
           "--lr", str(args.lr), "--warmup", str(args.lr_warmup), "--seed", str(seed + 1000), "--eval-every", "0",
           "--checkpoint-dir", str(ck), "--checkpoint-every", str(args.warm_start), "--run-dir", str(run_dir), "--metrics", str(tmp / f"warm-{seed}.jsonl")]
    print(f"[warm start seed {seed}] {args.warm_start} steps on one worker ...", flush=True)
    for c in (cmd, [sys.executable, "-m", "fusionllm", "export", str(ck), "--hf", str(out)]):
        proc = subprocess.run(c, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the warm start failed: {' '.join(c[2:4])}\n{(proc.stdout + proc.stderr)[-2000:]}")
    return out


# ---- predictions ----------------------------------------------------------------------------------
def one_device_cluster(slot_cpus: float, tmp: Path) -> Path:
    path = tmp / f"one-device-{slot_cpus}.toml"
    path.write_text(f'name = "one-device"\n\n[sites.a]\ndevices = 1\ncpus = {slot_cpus}\nbandwidth = "10gbit"\n')
    return path


def predicted_step(args: argparse.Namespace, cluster: Path, scheduler: str, schedule: str) -> float:
    req = Request(args.batch_size, args.seq_len, args.micro_batches, schedule=schedule)
    _, _, cost, plan = offline(args.model, str(cluster), scheduler, req)
    return simulate(plan, cost, req).step_time_s


def predicted_time(system: str, lines: list[dict], target_steps: int, target_tokens: int, static: dict[str, float]) -> float | None:
    """Seconds to the target the planner predicts for this run (None: no prediction recorded)."""
    if system in static:
        return static[system] * target_steps
    plan = next((r for r in lines if r.get("event") == "plan"), None)
    if plan is None:
        return None
    if plan.get("sync") == "hierarchical":
        pred = plan.get("predicted", {})
        goodput = pred.get("goodput") or pred.get("tokens_per_s", 0.0) * pred.get("efficiency", 1.0)
        return target_tokens / goodput if goodput else None
    step = next((r.get("predicted_step_s") for r in lines if "loss" in r and r.get("predicted_step_s")), None)
    return None if step is None else step * target_steps


# ---- one cluster ----------------------------------------------------------------------------------
def cluster_path(name: str, tmp: Path, cpu_scale: float = 1.0) -> Path:
    """The cluster's file, every device's CPU quota times ``cpu_scale`` (written to ``tmp``)."""
    kind, _, seed = name.partition(":")
    if kind in ("random", "random-latency"):
        shape = ClusterShape(kind="cpu", sites=(3, 3), devices=(4, 4), latency=kind == "random-latency")
        text = random_cluster_toml(int(seed), shape)
    else:
        text = (ROOT / "examples" / "clusters" / f"{name}.toml").read_text()
    text = re.sub(r"(?m)^(\s*cpus\s*=\s*)([0-9.]+)", lambda m: f"{m.group(1)}{round(float(m.group(2)) * cpu_scale, 3)}", text)
    path = tmp / f"{name.replace(':', '-')}.toml"
    path.write_text(text)
    return path


def row_of(system: str, cluster: str, seed: int, lines: list[dict], watch: Watch, launched: float, spec: Any, link_bytes: dict) -> dict:
    steps = [r for r in lines if "loss" in r and "step" in r]
    evals = [r for r in lines if r.get("val_loss") is not None]
    hit = watch.record
    wall = None if hit is None or watch.seen_at is None else watch.seen_at - launched
    tps = [r["tokens_per_s"] for r in steps if r.get("tokens_per_s")]
    return {
        "cluster": cluster, "seed": seed, "system": system, "time_to_target_s": None if hit is None else hit["elapsed_s"],
        "wall_to_target_s": None if wall is None else round(wall, 2), "tokens_to_target": None if hit is None else hit.get("tokens"),
        "step_at_target": None if hit is None else hit.get("step"), "steps_run": len(steps),
        "tokens_per_s": tps[-1] if tps else None, "val_curve": [(r.get("tokens"), r["elapsed_s"], r["val_loss"]) for r in evals],
        "device_busy": device_busy(steps, spec), "link_mb": round(sum(link_bytes.values()) / 1e6, 2),
        "plan": plan_summary(lines), "replans": sum(1 for r in lines if r.get("event") == "replan"),
        "predicted_efficiency": next((r.get("predicted", {}).get("efficiency") for r in lines if r.get("event") == "plan" and r.get("sync") == "hierarchical"), None),
        "noise_scale": next((r["noise_scale"] for r in reversed(steps) if r.get("noise_scale") is not None), None),
    }


def plan_summary(lines: list[dict]) -> str:
    plan = next((r for r in lines if r.get("event") == "plan"), None)
    if plan is None:
        return ""
    if plan.get("sync") == "hierarchical":
        return f"{len(plan['groups'])} groups: " + "; ".join(f"{g['workers']} H={g['inner_steps']}" for g in plan["groups"])
    stages = plan.get("stages") or []
    return "1 group: " + " | ".join("+".join(f"w{w}" for w in s["workers"]) for s in stages) if stages else "1 group"


def bench_cluster(name: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    path = cluster_path(name, tmp, args.cpu_scale)
    spec = load_cluster(path)
    rows: list[dict] = []
    with Testbed(spec) as tb:
        if not tb.emulated:
            raise SystemExit(f"time_to_target needs the emulated testbed ({tb.why_not}): run it as root on Linux")
        fastest = max(tb.slots, key=lambda s: s.cpus or 0.0)
        static = {"fastest": predicted_step(args, one_device_cluster(fastest.cpus or 1.0, tmp), "opfence", "1f1b"),
                  "peer": predicted_step(args, path, "uniform", "gpipe")}
        for seed in args.seeds:
            if args.warm_start:
                args.warm_dir[seed] = warm_checkpoint(args, seed, tmp)
            target_step = max(args.eval_every, round(args.target_at * args.steps / args.eval_every) * args.eval_every)
            target: float | None = None
            for system in args.systems:
                metrics = tmp / f"{name}-{seed}-{system}.jsonl"
                metrics.unlink(missing_ok=True)
                if system == "fastest":
                    watch = Watch(metrics, at_budget(target_step), lambda: None)
                elif target is None:
                    raise SystemExit("the fastest device runs first: it sets the target (put 'fastest' first in --systems)")
                else:
                    watch = Watch(metrics, reached(target), lambda: None)
                speed = machine_speed()
                print(f"[{name} seed {seed}] {system} (machine: {speed} GFLOP/s on one core) ...", flush=True)
                before, launched = tb.link_bytes(), time.monotonic()
                log = tmp / f"{name}-{seed}-{system}.log"
                if system == "fastest":
                    run_fastest(tb, fastest, args, seed, metrics, log, watch)
                elif system == "peer":
                    run_peer(tb, args, seed, metrics, log, watch)
                else:
                    run_fusion(tb, path, system, args, seed, metrics, tmp / f"{name}-{seed}-{system}", watch)
                after = tb.link_bytes()
                lines = read_metrics(metrics).records
                row = row_of(system, name, seed, lines, watch, launched, spec, {k: after.get(k, 0) - before.get(k, 0) for k in after})
                if system == "fastest":
                    if watch.record is None:
                        raise RuntimeError(f"the fastest device did not reach step {target_step}; its log: {log}")
                    target = watch.record["smoothed_val_loss"]
                    row["fastest_slot"] = {"index": fastest.index, "cpus": fastest.cpus}
                row["target_val_loss"] = target
                row["warm_start"] = args.warm_start
                row["machine_gflops"] = speed
                row["target_tokens"] = target_step * args.batch_size * args.seq_len
                row["predicted_s"] = predicted_time(system, lines, target_step, row["target_tokens"], static)
                rows.append(row)
                got = "did not reach it" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s ({row['tokens_to_target']:,} tokens)"
                pred = "-" if row["predicted_s"] is None else f"{row['predicted_s']:.1f} s"
                print(f"[{name} seed {seed}] {system}: target {target:.4f}: {got}, predicted {pred}; {row['plan']}", flush=True)
    return rows


# ---- the report -----------------------------------------------------------------------------------
def calibrated_error(row: dict, rows: list[dict]) -> float | None:
    """The prediction's error once the machine's speed at the time is taken out: the prediction times
    the fastest device's measured over predicted time (same cluster and seed), against the measured."""
    fastest = next((r for r in rows if r["cluster"] == row["cluster"] and r["seed"] == row["seed"] and r["system"] == "fastest"), None)
    if fastest is None or not fastest.get("predicted_s") or not fastest.get("time_to_target_s") or not row.get("predicted_s") or not row.get("time_to_target_s"):
        return None
    return row["predicted_s"] * fastest["time_to_target_s"] / fastest["predicted_s"] / row["time_to_target_s"] - 1


def per_system(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["cluster"], r["system"]), []).append(r)
    return out


def _t(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    warm = getattr(args, "warm_start", 0) or 0
    lines = [(f"Warm start: every system starts from {warm} steps of one worker (another data seed), its learning-rate warm-up and cosine "
              "schedule again. " if warm else "") + f"Model {args.model}, batch {args.batch_size} x {args.seq_len}, {args.micro_batches} micro-batches, {args.steps} steps "
             f"(lr {args.lr}, {args.lr_warmup} warm-up, cosine), validation every {args.eval_every} steps on {args.eval_batches} batches. "
             f"Target: the fastest device's validation loss at step {round(args.target_at * args.steps)} of its run, per seed, as the mean of "
             f"its last {SMOOTH} evaluations. Time: the run's training clock to the first evaluation where the mean of the last {SMOOTH} is at or "
             f"below the target; wall: from launch (start-up included); CPU quotas x {args.cpu_scale}. "
             "'-': not reached within the run. Calibrated error: the prediction times the fastest device's measured over predicted time to "
             "target (the machine's speed then against the cost model's), against the measured.", "",
             "| cluster | system | seeds | time to target, min / median (s) | wall, median (s) | vs peer | vs fastest | predicted (s) | pred. error | calibrated error | tokens to target (median) | plan (first seed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = per_system(rows)
    for (cluster, system), rs in groups.items():
        times = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        med = statistics.median(times) if len(times) == len(rs) and times else None
        walls = [r["wall_to_target_s"] for r in rs if r["wall_to_target_s"] is not None]

        def ratio(other: str, med: float | None = med, cluster: str = cluster) -> str:
            ot = [r["time_to_target_s"] for r in groups.get((cluster, other), []) if r["time_to_target_s"] is not None]
            if med is None or not ot or len(ot) != len(groups[(cluster, other)]):
                return "-"
            return f"{statistics.median(ot) / med:.2f}x"

        preds = [r["predicted_s"] for r in rs if r["predicted_s"] is not None]
        pred = statistics.median(preds) if preds else None
        err = "-" if pred is None or med is None else f"{pred / med - 1:+.0%}"
        cal = [c for c in (calibrated_error(r, rows) for r in rs) if c is not None]
        cal_s = f"{statistics.median(cal):+.0%}" if cal and len(cal) == len(rs) else "-"
        toks = [r["tokens_to_target"] for r in rs if r["tokens_to_target"] is not None]
        reached_s = f"{_t(min(times)) if times else '-'} / {_t(med)}" + ("" if len(times) == len(rs) else f" ({len(times)} of {len(rs)} reached)")
        lines.append(f"| {cluster} | {system} | {len(rs)} | {reached_s} | {_t(statistics.median(walls)) if walls else '-'} | {ratio('peer')} | "
                     f"{ratio('fastest')} | {_t(pred)} | {err} | {cal_s} | {f'{statistics.median(toks):,.0f}' if toks else '-'} | {rs[0]['plan']}{_replans(rs)} |")
    kept: dict[tuple[str, int, str, str], list[str]] = {}
    for r in rows:
        if r.get("measured"):
            m = r["measured"]
            kept.setdefault((r["cluster"], r["seed"], m["commit"][:12], m["date"]), []).append(r["system"])
    if kept:
        lines += ["", "Rows kept from earlier runs (`--merge`): " + "; ".join(f"{c} seed {sd} ({', '.join(ss)}): commit {cm}, {d}"
                                                                        for (c, sd, cm, d), ss in kept.items())]
    speeds = [r["machine_gflops"] for r in rows if r.get("machine_gflops")]
    if speeds:
        lines += ["", f"Machine speed before each run (one core, GFLOP/s): {min(speeds):.1f}-{max(speeds):.1f}, median {statistics.median(speeds):.1f}; "
                  "per cluster and seed: " + "; ".join(f"{c} s{sd}: {min(v):.1f}-{max(v):.1f}" for (c, sd), v in _speeds(rows).items())]
    lines += ["", "Targets: " + "; ".join(f"{r['cluster']} seed {r['seed']}: {r['target_val_loss']:.4f}" for r in rows if r["system"] == "fastest"), ""]
    lines += ["Device busy (process CPU seconds over quota, fusionllm systems, first seed):", ""]
    for (cluster, system), rs in groups.items():
        if rs[0].get("device_busy"):
            busy = rs[0]["device_busy"]
            lines.append(f"- {cluster} {system}: " + ", ".join(f"w{w} {v:.0%}" for w, v in sorted(busy.items())))
    return lines


def _replans(rs: list[dict]) -> str:
    n = [r["replans"] for r in rs if r.get("replans") is not None]
    return f"; re-plans {'/'.join(map(str, n))}" if n and any(n) else ""


def _speeds(rows: list[dict]) -> dict[tuple[str, int], list[float]]:
    out: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r.get("machine_gflops"):
            out.setdefault((r["cluster"], r["seed"]), []).append(r["machine_gflops"])
    return out


def plots(rows: list[dict], out: Path) -> None:
    plt = pyplot()
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    for axis, name, label in ((1, "time_to_target_time.png", "training time (s)"), (0, "time_to_target_tokens.png", "tokens trained")):
        fig, axes = plt.subplots(1, len(clusters), figsize=(5.5 * len(clusters), 4), squeeze=False)
        for ax, c in zip(axes[0], clusters, strict=True):
            seed = min(r["seed"] for r in rows if r["cluster"] == c)
            for r in rows:
                if r["cluster"] == c and r["seed"] == seed and r["val_curve"]:
                    ax.plot([p[axis] for p in r["val_curve"]], [p[2] for p in r["val_curve"]], marker="o", ms=2, label=r["system"])
            ax.axhline(next(r["target_val_loss"] for r in rows if r["cluster"] == c and r["seed"] == seed), color="0.5", lw=0.8, ls="--")
            ax.set_title(f"{c}, seed {seed}")
            ax.set_xlabel(label)
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        vals = []
        for c in clusters:
            ts = [r["time_to_target_s"] for r in rows if r["cluster"] == c and r["system"] == s and r["time_to_target_s"] is not None]
            vals.append(statistics.median(ts) if ts else 0)
        ax.bar([k + i * width for k in range(len(clusters))], vals, width, label=s)
    ax.set_xticks([k + width * (len(systems) - 1) / 2 for k in range(len(clusters))], clusters)
    ax.set_ylabel("time to target, median over seeds (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "time_to_target.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/time_to_target/MODEL")
    ap.add_argument("--clusters", nargs="+", default=["three-sites", "random:21", "random:22", "random-latency:23"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS[:6]), choices=SYSTEMS)
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--target-at", type=float, default=0.6, help="the target: the fastest device's validation loss at this fraction of the steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--cpu-scale", type=float, default=1.0,
                    help="every device's CPU quota times this: the quotas of a cluster file add up to the machine's cores, and the "
                         "coordinator and the kernel's network stack need some (without it, four busy devices cannot all get theirs)")
    ap.add_argument("--probe", action="store_true",
                    help="fusionllm plans from devices and links it measures at the start (as a user without a cluster file would) "
                         "instead of the cluster file's nominal speeds")
    ap.add_argument("--warm-start", type=int, default=0, metavar="K",
                    help="every system starts from a checkpoint of K steps of one worker (another data seed); results in MODEL-warmK")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--merge", action="store_true", help="keep the rows of the existing JSON for clusters, seeds and systems not run this time")
    ap.add_argument("--report", action="store_true", help="only rewrite the table and plots from the JSON")
    args = ap.parse_args()
    exit_on_sigterm()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # kill -INT stops it cleanly even where it started with SIGINT ignored (nohup &)
    args.warm_dir = {}
    out = args.out or results_dir("time_to_target", args.model + (f"-warm{args.warm_start}" if args.warm_start else ""))
    path = out / "time_to_target.json"
    if args.report:
        saved = json.loads(path.read_text())
        ran = argparse.Namespace(**{**vars(args), **saved.get("args", {})})  # the table says what the runs were (steps, batch, target)
        write(out, "time_to_target", saved["results"], table(saved["results"], ran), {**kept_provenance(saved), "args": saved.get("args", {})})
        plots(saved["results"], out)
        return 0
    rows: list[dict] = []
    meta: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "warm_dir")}}
    if args.merge and path.exists():  # rows kept from an earlier run carry its provenance
        old = json.loads(path.read_text())
        rows = [{**r, "measured": r.get("measured") or kept_provenance(old)} for r in old["results"]
                if r["cluster"] not in args.clusters or r["seed"] not in args.seeds or r["system"] not in args.systems]
    seeds = args.seeds
    with tempfile.TemporaryDirectory(prefix="fusion-ttt-") as tmpdir:
        for seed in seeds:  # every cluster at the first seed before any at the next; written after each
            for name in args.clusters:
                args.seeds = [seed]
                rows += bench_cluster(name, args, Path(tmpdir))
                args.seeds = seeds
                write(out, "time_to_target", rows, table(rows, args), meta)
                plots(rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
