#!/usr/bin/env python
"""Time to a target loss against a plain loop on the fastest device: every system side by side, on one emulated cluster.

For each cluster (a file of examples/clusters, or one nobody tuned on: ``random:SEED``,
``random-latency:SEED`` (four CPU devices in three sites, links drawn log-uniformly, latencies with the
second), ``random2:SEED``, ``random2-latency:SEED`` (in two sites, latency on the link between them),
``cluster/random.py``) one testbed (network namespaces, tc rate limits, CPU quotas) is brought up,
and for each seed these systems train the same model on the same data, global batch, sequence
length, learning-rate schedule, token budget and seed:

1. ``plain``: what a user runs on the fastest device: a plain PyTorch loop (one batch per step, no
   hooks, one thread, ``python -m fusionllm.runtime.reference.plain``) in that device's namespace
   and under its CPU quota: the baseline, and the run that sets the target;
2. ``single`` (a diagnostic, not run by default): ``fusionllm train --single-process`` there, the
   equivalence reference (micro-batches, hooks, exact norms);
3. ``peer``: ``torch.distributed.pipelining`` over gloo, GPipe, blocks split evenly, one stage per
   device (``benchmarks/peer_pipelining.py``);
4. ``opfence`` and ``opfence+adatopk``: fusionllm, synchronous, OP-Fence's plan, without and with AdaTopK;
5. ``hierarchical``: fusionllm ``--sync hierarchical``, the planner's groups, H and group batch;
6. ``auto``: what a user runs: ``fusionllm train --cluster FILE`` with the training flags and no
   other (no ``--sync``, schedule, micro-batches or codec: the defaults; it brings up the testbed
   itself, so this row counts no link bytes);
7. ``dp``: fusionllm's data-parallel plan, where the options declare one (``dp_flags``; the row is
   left out while none does). ``FUSION`` lists the fusionllm systems: a new one is one entry.

The protocol (issue 58):

- *Target*: the plain loop's validation loss at ``--target-at`` of the steps, as the mean of its
  last three evaluations (``Smoothed``: one evaluation can be a lucky dip). Every other system is
  stopped at the first evaluation whose mean of three is at or below it (within ``TOLERANCE``).
- *Tokens and schedule*: every system gets the same ``--steps`` of the same global batch; a grouping
  shares it among its groups. Each run's step records are checked against the schedule read at
  their token count (``core.config.lr_at_tokens``): ``lr off`` counts records whose learning rate
  lies outside one global step of it (a grouping's groups meet the schedule at every round's end,
  ``control/rounds.budget_rounds``, and go at their own pace within a round). Each row records its
  tokens to the target, trained, and the plan's budget.
- *Time*: one clock for every system, read by this script as the run's metrics file grows
  (``Watch``): from the first step to the record that reached the target, evaluation INCLUDED
  (every system evaluates as often, on as many batches; a run's own ``elapsed_s`` leaves evaluation
  out, which a grouping cannot do honestly while its other groups train). ``wall``: from launch
  (start-up, tracing, planning, probes and connections included).
- *Quotas*: the cluster's CPU quotas are scaled so that they add up to at most ``--quota-share``
  (80%) of this machine's cores: the coordinator, the kernel's network stack and the codecs need
  the rest. ``--full-quota`` runs the file's quotas too (a fully booked machine), reported beside.
- *Physical limit*: the quotas' sum over the fastest device's; each row gives its speed-up over the
  plain loop and that speed-up's fraction of the limit.

Predicted time to target: the simulator's step time times the steps the plain loop needed, and for
a plan of several groups the target's tokens over the predicted goodput.

Writes time_to_target.json (commit, command, machine, every run), .md (per cluster: medians over
seeds and their spread; per system: the median over clusters) and plots. Needs root (the testbed).

    python benchmarks/time_to_target.py --clusters random:31 random-latency:32 random2:33 random2-latency:34 --seeds 0 1 2 --steps 300
"""

from __future__ import annotations

import argparse
import json
import math
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import exit_on_sigterm, kept_provenance, pyplot, read_metrics, results_dir, stop, write  # noqa: E402
from e2e import ROOT, device_busy, peer_launch  # noqa: E402

from fusionllm.cluster.random import named_cluster_toml  # noqa: E402
from fusionllm.cluster.spec import load_cluster, parse_cluster  # noqa: E402
from fusionllm.core.config import lr_at_tokens  # noqa: E402
from fusionllm.launch.local_cluster import read_pids, run_local_cluster  # noqa: E402
from fusionllm.launch.offline import offline  # noqa: E402
from fusionllm.schedule.plan import Request  # noqa: E402
from fusionllm.sim.simulator import simulate  # noqa: E402
from fusionllm.testbed.testbed import Slot, Testbed  # noqa: E402


@dataclass(frozen=True)
class Fusion:
    """A fusionllm system: its coordinator flags, with the planner on the cluster file (``--scheduler
    opfence --hardware FILE``, as ``train --cluster FILE`` resolves it) and the run's ``--micro-batches``;
    ``user``: ``fusionllm train --cluster FILE`` itself, with these flags only (none: what a user runs)."""

    flags: tuple[str, ...]
    user: bool = False


def dp_flags() -> tuple[str, ...] | None:
    """The flag and value that select the data-parallel plan, where an option declares one
    (``core/options.py``: a mode with the value ``data-parallel`` or ``dp``); None while none does."""
    from fusionllm.core.options import leaves

    def values(kind: Any) -> set[Any]:
        return {v for a in get_args(kind) for v in ({a} if isinstance(a, str) else values(a))}

    for leaf in leaves().values():
        found = values(leaf.kind) & {"data-parallel", "dp"}
        if found:
            return (leaf.flag, sorted(found)[0])
    return None


FUSION: dict[str, Fusion] = {
    "opfence": Fusion(("--schedule", "1f1b", "--compress", "none", "--sync", "synchronous")),
    "opfence+adatopk": Fusion(("--schedule", "1f1b", "--compress", "adatopk", "--sync", "synchronous")),
    "hierarchical": Fusion(("--schedule", "1f1b", "--compress", "none", "--sync", "hierarchical")),
    "auto": Fusion((), user=True),  # train --cluster FILE: its defaults are --sync auto and the planner on the file (launch/config.default_sync)
    "auto-f2": Fusion(("--finalists", "2"), user=True),  # auto measuring 2 finalists: the planner's best and the fastest device alone
    # a diagnostic: the planner's groups synced as the efficiency sweep's one-process groups are (each average applied at
    # once, uncompressed, one fragment): what streaming, its delay and the 4-bit codec cost per token
    "hierarchical-exact": Fusion(("--schedule", "1f1b", "--compress", "none", "--sync", "hierarchical", "--blocking-sync", "--outer-codec",
                                  "none", "--fragments", "1")),
}
if (_dp := dp_flags()) is not None:
    FUSION["dp"] = Fusion(("--compress", "adatopk", *_dp))
BASELINES = ("plain", "single", "peer")
SYSTEMS = (*BASELINES, *FUSION)
DEFAULT_SYSTEMS = ("plain", "peer", "opfence", "opfence+adatopk", "hierarchical", "auto", *(("dp",) if "dp" in FUSION else ()))
# relative: the plain loop takes one batch a step, a pipeline micro-batches, and their sums round apart: on random:31 the
# synchronous plan's validation loss at step 30 was 2.7820 against the plain loop's 2.7799 (identical at steps 10 and 20),
# and at 1e-4 that cost it a whole evaluation interval; 1e-3 is a tenth of what 10 steps move the loss there
TOLERANCE = 1e-3
SMOOTH = 3  # validation losses averaged (``Smoothed``)
POLL_S = 0.05  # the clock's resolution: every system is read as often
QUOTA_SHARE = 0.8


# ---- one run, stopped at the target ---------------------------------------------------------------
class Watch(threading.Thread):
    """Reads a metrics file as it grows; at the first record ``hit(record)`` accepts, remembers it
    and the monotonic time it was seen, and calls ``stop_run`` once. It is every system's clock
    (``clock``): the first step record's own seconds plus the time from seeing it to seeing each
    evaluation, so a run is timed the same way whatever its records count (evaluation included)."""

    def __init__(self, metrics: Path, hit: Callable[[dict], bool], stop_run: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.metrics, self.hit, self.stop_run = metrics, hit, stop_run
        self.record: dict | None = None
        self.seen_at: float | None = None
        self.first: tuple[float, float] | None = None  # (monotonic time seen, the first step record's elapsed_s)
        self.curve: list[tuple[int | None, float, float]] = []  # (tokens, clock, validation loss) of every evaluation seen
        self.done = threading.Event()

    def clock(self, seen: float) -> float:
        """Seconds from the first step's start to a record seen at ``seen`` (monotonic)."""
        if self.first is None:
            return 0.0
        return round(self.first[1] + seen - self.first[0], 3)

    def see(self, rec: dict, now: float) -> bool:
        """One record, seen at ``now``: True once the target is hit."""
        if self.first is None and "loss" in rec and "step" in rec:
            self.first = (now, float(rec.get("elapsed_s") or 0.0))
        if rec.get("val_loss") is not None:
            self.curve.append((rec.get("tokens"), self.clock(now), rec["val_loss"]))
        if self.hit(rec):
            self.record, self.seen_at = rec, now
            return True
        return False

    def run(self) -> None:
        offset, tail = 0, b""
        while not self.done.is_set():
            if self.metrics.exists():
                with self.metrics.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                now = time.monotonic()
                offset += len(chunk)
                tail += chunk
                *lines, tail = tail.split(b"\n")
                for line in lines:
                    if self.see(json.loads(line) if line.strip() else {}, now):
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
    """The plain loop's run: its smoothed validation loss at ``step`` is the target."""
    mean = Smoothed()

    def hit(r: dict) -> bool:
        m = mean(r)
        if m is not None and r["step"] + 1 >= step:
            r["smoothed_val_loss"] = m
            return True
        return False

    return hit


def common_args(args: argparse.Namespace, seed: int, *, micro_batches: bool = True) -> list[str]:
    warm = ["--init-from", str(args.warm_dir[seed])] if args.warm_start else []
    micro = ["--micro-batches", str(args.micro_batches)] if micro_batches else []
    return [*warm, "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            *micro, "--lr", str(args.lr), "--seed", str(seed), "--warmup", str(args.lr_warmup),
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


def run_one_device(system: str, slot: Slot, args: argparse.Namespace, seed: int, metrics: Path, log: Path, watch: Watch) -> None:
    """``plain`` (one thread, one batch a step) or ``single`` (``--single-process``) in the fastest device's namespace and quota."""
    if system == "plain":
        cmd = [*slot.command_prefix(), sys.executable, "-m", "fusionllm.runtime.reference.plain", *common_args(args, seed, micro_batches=False),
               "--threads", "1", "--metrics", str(metrics)]
    else:
        cmd = [*slot.command_prefix(), sys.executable, "-m", "fusionllm", "train", "--single-process", *common_args(args, seed),
               "--threads", str(slot.threads()), "--metrics", str(metrics)]
    codes = run_procs([cmd], log, watch, args.timeout)
    if codes[0] != 0 and watch.record is None:
        raise RuntimeError(f"{system} on the fastest device failed (exit {codes[0]}); its log: {log}\n{log.read_text()[-2000:]}")


def run_peer(tb: Testbed, args: argparse.Namespace, seed: int, metrics: Path, log: Path, watch: Watch) -> None:
    cmds, env = peer_launch(tb, metrics, common_args(args, seed))
    codes = run_procs(cmds, log, watch, args.timeout, env)
    if any(codes) and watch.record is None:
        raise RuntimeError(f"the peer failed (exit codes {codes}); its log: {log}\n{log.read_text()[-2000:]}")


def interrupter(run_dir: Path) -> Callable[[], None]:
    """Stops a local cluster at the target: the coordinator (its PID from the run directory) stops
    after the step in flight; the launcher then stops the workers."""

    def interrupt() -> None:
        pids = read_pids(run_dir)
        if pids is not None and pids.coordinator is not None:
            os.kill(pids.coordinator, signal.SIGINT)

    return interrupt


def run_user(path: Path, system: str, args: argparse.Namespace, seed: int, metrics: Path, run_dir: Path, log: Path, watch: Watch) -> None:
    """``fusionllm train --cluster FILE`` as a user runs it (it brings up and takes down the testbed)."""
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(path), *common_args(args, seed, micro_batches=False),
           *(["--probe-links"] if args.probe else []), *FUSION[system].flags, "--metrics", str(metrics), "--run-dir", str(run_dir)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        watch.stop_run = interrupter(run_dir)
        watch.start()
        try:
            code = proc.wait(timeout=args.timeout)
        finally:
            watch.done.set()
            stop([proc], grace=30)
    if code != 0 and watch.record is None:
        raise RuntimeError(f"fusionllm train ({system}) failed (exit {code}); its log: {log}\n{log.read_text()[-2000:]}")


def run_fusion(tb: Testbed, path: Path, system: str, args: argparse.Namespace, seed: int, metrics: Path, run_dir: Path, watch: Watch) -> None:
    spec = FUSION[system]
    # --probe: the coordinator measures devices and links at the start, instead of the file's rates
    planner = ["--scheduler", "opfence", *([] if args.probe else ["--hardware", str(path)])]
    coord = [*common_args(args, seed), *planner, *spec.flags, "--metrics", str(metrics)]
    watch.stop_run = interrupter(run_dir)
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


def predicted_step(args: argparse.Namespace, cluster: Path, scheduler: str, schedule: str, micro_batches: int | None = None) -> float:
    req = Request(args.batch_size, args.seq_len, micro_batches or args.micro_batches, schedule=schedule)
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


# ---- the protocol's arithmetic (unit-tested: tests/test_time_to_target.py) --------------------------
def quota_scale(cpus: list[float], cores: int, share: float = QUOTA_SHARE) -> float:
    """What every device's CPU quota is multiplied by so that they add up to at most ``share`` of
    ``cores`` (1 when they already do: quotas are never raised)."""
    total = sum(cpus)
    if total <= 0 or cores < 1:
        raise ValueError(f"quotas {cpus} on {cores} cores: nothing to scale")
    return min(1.0, share * cores / total)


def physical_limit(cpus: list[float]) -> float:
    """The most any plan can gain over the fastest device alone: the quotas' sum over the largest."""
    return sum(cpus) / max(cpus)


def fraction_of_limit(speedup: float | None, limit: float) -> float | None:
    """A speed-up over the plain loop as a fraction of the physical limit."""
    return None if speedup is None else speedup / limit


def lr_off_schedule(records: list[dict], *, tokens_per_step: int, lr: float, steps: int, warmup: int) -> int:
    """Step records whose learning rate lies outside the schedule read at their token count
    (``lr_at_tokens``) by more than one global step either way: 0 for every system that follows the
    same schedule in tokens. A record's ``tokens`` count the run's tokens once its step is done
    (every group's, for several), so its step began at ``tokens - tokens_per_step``."""
    off = 0
    for r in records:
        if "loss" not in r or r.get("lr") is None or r.get("tokens") is None:
            continue
        at = r["tokens"] - tokens_per_step
        near = [lr_at_tokens(max(0.0, at + d * tokens_per_step), tokens_per_step=tokens_per_step, lr=lr, steps=steps, warmup=warmup)
                for d in (-1.0, -0.5, 0.0, 0.5, 1.0)]
        if not min(near) * (1 - 1e-6) <= r["lr"] <= max(near) * (1 + 1e-6):
            off += 1
    return off


def planned_tokens(lines: list[dict], args: argparse.Namespace) -> int:
    """The token budget of a run as planned: ``--steps`` global batches, or a grouping's rounds of
    inner steps of its groups' batch."""
    plan = next((r for r in lines if r.get("event") == "plan"), None)
    if plan is None or plan.get("sync") != "hierarchical":
        return args.steps * args.batch_size * args.seq_len
    groups = plan.get("groups") or []
    rows = (plan.get("predicted") or {}).get("group_batch") or args.batch_size // max(1, len(groups))
    lengths = plan.get("round_lengths")
    inner = sum(sum(v) for v in lengths.values()) if lengths else plan.get("rounds", 0) * sum(g["inner_steps"] for g in groups)
    return inner * rows * args.seq_len


# ---- one cluster ----------------------------------------------------------------------------------
def cluster_text(name: str) -> str:
    """The cluster file's text: a random cluster's name (``cluster/random.py``) or a file of examples/clusters."""
    return named_cluster_toml(name) or (ROOT / "examples" / "clusters" / f"{name}.toml").read_text()


def device_cpus(text: str) -> list[float]:
    """Every device's CPU quota in a cluster file's text."""
    return [float(d.cpus) for d in parse_cluster(text, source="<time_to_target cluster>").devices()]


def scale_quotas(text: str, scale: float) -> str:
    """Every ``cpus`` of a cluster file's text times ``scale``, rounded down to 0.001 core (never over the share)."""
    return re.sub(r"(?m)^(\s*cpus\s*=\s*)([0-9.]+)", lambda m: f"{m.group(1)}{math.floor(float(m.group(2)) * scale * 1000 + 1e-6) / 1000}", text)


def cluster_path(name: str, tmp: Path, *, full: bool, share: float = QUOTA_SHARE) -> tuple[Path, float]:
    """The cluster's file with its quotas scaled to at most ``share`` of this machine's cores (the
    file's own quotas with ``full``), written to ``tmp``; and the scale taken."""
    text = cluster_text(name)
    scale = 1.0 if full else quota_scale(device_cpus(text), os.cpu_count() or 1, share)
    path = tmp / f"{name.replace(':', '-')}{'-full' if full else ''}.toml"
    path.write_text(scale_quotas(text, scale))
    return path, scale


def row_of(system: str, cluster: str, seed: int, lines: list[dict], watch: Watch, launched: float, spec: Any, link_bytes: dict,
           args: argparse.Namespace) -> dict:
    steps = [r for r in lines if "loss" in r and "step" in r]
    hit = watch.record
    tps = [r["tokens_per_s"] for r in steps if r.get("tokens_per_s")]
    tokens_per_step = args.batch_size * args.seq_len
    return {
        "cluster": cluster, "seed": seed, "system": system,
        "time_to_target_s": None if hit is None or watch.seen_at is None else watch.clock(watch.seen_at),
        "own_clock_s": None if hit is None else hit.get("elapsed_s"),  # the run's own training clock (its evaluation left out, or not)
        "wall_to_target_s": None if hit is None or watch.seen_at is None else round(watch.seen_at - launched, 2),
        "tokens_to_target": None if hit is None else hit.get("tokens"), "tokens_trained": max((r.get("tokens") or 0 for r in lines), default=0),
        "token_budget": planned_tokens(lines, args),
        "lr_off": lr_off_schedule(steps, tokens_per_step=tokens_per_step, lr=args.lr, steps=args.steps, warmup=args.lr_warmup),
        "step_at_target": None if hit is None else hit.get("step"), "steps_run": len(steps),
        "tokens_per_s": tps[-1] if tps else None, "val_curve": watch.curve,
        "device_busy": device_busy(steps, spec), "link_mb": round(sum(link_bytes.values()) / 1e6, 2) if link_bytes else None,
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


def bench_cluster(name: str, args: argparse.Namespace, tmp: Path, *, full: bool = False) -> list[dict]:
    path, scale = cluster_path(name, tmp, full=full, share=args.quota_share)
    spec = load_cluster(path)
    cpus = [d.cpus for d in spec.devices()]
    quota = {"quota": "full" if full else f"<= {args.quota_share:.0%}", "quota_scale": round(scale, 4), "quota_sum": round(sum(cpus), 3),
             "cores": os.cpu_count(), "physical_limit": round(physical_limit(cpus), 3)}
    one = one_device_cluster(max(cpus), tmp)
    static = {"plain": predicted_step(args, one, "opfence", "1f1b", micro_batches=1), "single": predicted_step(args, one, "opfence", "1f1b"),
              "peer": predicted_step(args, path, "uniform", "gpipe")}
    rows: list[dict] = []
    for seed in args.seeds:
        if args.warm_start:
            args.warm_dir[seed] = warm_checkpoint(args, seed, tmp)
        target_step = max(args.eval_every, round(args.target_at * args.steps / args.eval_every) * args.eval_every)
        target: float | None = None
        for system in args.systems:
            tag = f"{name}{'-full' if full else ''}-{seed}-{system}"
            metrics, log = tmp / f"{tag}.jsonl", tmp / f"{tag}.log"
            metrics.unlink(missing_ok=True)
            if system == "plain":
                watch = Watch(metrics, at_budget(target_step), lambda: None)
            elif target is None:
                raise SystemExit("the plain loop runs first: it sets the target (put 'plain' first in --systems)")
            else:
                watch = Watch(metrics, reached(target), lambda: None)
            speed = machine_speed()
            print(f"[{name} seed {seed}, quota {quota['quota']}] {system} (machine: {speed} GFLOP/s on one core) ...", flush=True)
            fastest = None
            if system in FUSION and FUSION[system].user:  # train --cluster FILE brings up the testbed itself
                launched, link = time.monotonic(), {}
                run_user(path, system, args, seed, metrics, tmp / tag, log, watch)
            else:
                with Testbed(spec) as tb:
                    if not tb.emulated:
                        raise SystemExit(f"time_to_target needs the emulated testbed ({tb.why_not}): run it as root on Linux")
                    fastest = max(tb.slots, key=lambda s: s.cpus or 0.0)
                    before, launched = tb.link_bytes(), time.monotonic()
                    if system in ("plain", "single"):
                        run_one_device(system, fastest, args, seed, metrics, log, watch)
                    elif system == "peer":
                        run_peer(tb, args, seed, metrics, log, watch)
                    else:
                        run_fusion(tb, path, system, args, seed, metrics, tmp / tag, watch)
                    after = tb.link_bytes()
                    link = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            lines = read_metrics(metrics).records
            row = {**row_of(system, name, seed, lines, watch, launched, spec, link, args), **quota}
            if system == "plain":
                if watch.record is None:
                    raise RuntimeError(f"the plain loop did not reach step {target_step}; its log: {log}")
                target = watch.record["smoothed_val_loss"]
                row["fastest_slot"] = {"index": fastest.index, "cpus": fastest.cpus} if fastest else None
            row["target_val_loss"] = target
            row["warm_start"] = args.warm_start
            row["machine_gflops"] = speed
            row["target_tokens"] = target_step * args.batch_size * args.seq_len
            row["predicted_s"] = predicted_time(system, lines, target_step, row["target_tokens"], static)
            rows.append(row)
            got = "did not reach it" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s ({row['tokens_to_target']:,} tokens)"
            pred = "-" if row["predicted_s"] is None else f"{row['predicted_s']:.1f} s"
            print(f"[{name} seed {seed}] {system}: target {target:.4f}: {got}, predicted {pred}; lr off {row['lr_off']}; {row['plan']}", flush=True)
    return rows


# ---- the report -----------------------------------------------------------------------------------
def place(r: dict) -> str:
    """A row's cluster as the tables name it: the full-booking case apart from the headroom one."""
    return r["cluster"] + (" (full quota)" if r.get("quota") == "full" else "")


def speedup(row: dict, rows: list[dict]) -> float | None:
    """The plain loop's time to target over this row's (same cluster, quota and seed)."""
    base = next((r for r in rows if place(r) == place(row) and r["seed"] == row["seed"] and r["system"] == "plain"), None)
    if base is None or not base.get("time_to_target_s") or not row.get("time_to_target_s"):
        return None
    return base["time_to_target_s"] / row["time_to_target_s"]


def calibrated_error(row: dict, rows: list[dict]) -> float | None:
    """The prediction's error once the machine's speed at the time is taken out: the prediction times
    the plain loop's measured over predicted time (same cluster and seed), against the measured."""
    base = next((r for r in rows if place(r) == place(row) and r["seed"] == row["seed"] and r["system"] == "plain"), None)
    if base is None or not base.get("predicted_s") or not base.get("time_to_target_s") or not row.get("predicted_s") or not row.get("time_to_target_s"):
        return None
    return row["predicted_s"] * base["time_to_target_s"] / base["predicted_s"] / row["time_to_target_s"] - 1


def per_system(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((place(r), r["system"]), []).append(r)
    return out


def _t(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _spread(vals: list[float], n: int, fmt: str) -> str:
    """The median (min-max) of ``vals``, '-' unless every one of the ``n`` runs has one."""
    if not vals or len(vals) != n:
        return "-" if not vals else f"- ({len(vals)} of {n})"
    med = format(statistics.median(vals), fmt)
    lo, hi = format(min(vals), fmt), format(max(vals), fmt)
    return med if lo == hi else f"{med} ({lo}-{hi})"


def cluster_speedups(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """system -> cluster -> the median over seeds of the speed-up over the plain loop (None: a seed did not reach the target)."""
    out: dict[str, dict[str, float | None]] = {}
    for (cluster, system), rs in per_system(rows).items():
        ups = [speedup(r, rows) for r in rs]
        out.setdefault(system, {})[cluster] = statistics.median(ups) if ups and all(u is not None for u in ups) else None  # type: ignore[type-var]
    return out


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    warm = getattr(args, "warm_start", 0) or 0
    lines = [(f"Warm start: every system starts from {warm} steps of one worker (another data seed), its learning-rate warm-up and cosine "
              "schedule again. " if warm else "") + f"Model {args.model}, global batch {args.batch_size} x {args.seq_len}, {args.steps} steps for every "
             f"system (lr {args.lr}, {args.lr_warmup} warm-up, cosine, in tokens), validation every {args.eval_every} steps on {args.eval_batches} "
             f"batches; the tuned systems with {args.micro_batches} micro-batches, `auto` is `fusionllm train --cluster FILE` with its defaults. Target: the plain loop's validation "
             f"loss at step {round(args.target_at * args.steps)}, per seed, as the mean of its last {SMOOTH} evaluations. Time: one clock for every "
             f"system, from its first step to the first evaluation where the mean of the last {SMOOTH} is at or below the target, evaluation "
             "included; wall: from launch. Quotas: scaled to add up to at most the share of this machine's cores shown (full: the file's). "
             "Limit: the quotas' sum over the fastest device's; 'of limit': the speed-up over the plain loop over it. Medians over seeds, "
             "(min-max) the spread. 'lr off': step records more than one global step off the schedule at their tokens (0: the same schedule in tokens; a grouping's "
             "groups meet it at every round's end and go at their own pace within a round).", "",
             "| cluster | quota | limit | system | seeds | time to target (s) | wall (s) | vs plain | of limit | tokens to target | budget (tokens) | lr off | predicted (s) | calibrated error | plan (first seed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = per_system(rows)
    for (_, system), rs in groups.items():
        n = len(rs)
        times = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        walls = [r["wall_to_target_s"] for r in rs if r["wall_to_target_s"] is not None]
        ups = [u for u in (speedup(r, rows) for r in rs) if u is not None]
        fracs = [f for f in (fraction_of_limit(speedup(r, rows), r["physical_limit"]) for r in rs if r.get("physical_limit")) if f is not None]
        toks = [r["tokens_to_target"] for r in rs if r["tokens_to_target"] is not None]
        preds = [r["predicted_s"] for r in rs if r["predicted_s"] is not None]
        cal = [c for c in (calibrated_error(r, rows) for r in rs) if c is not None]
        first = rs[0]  # (rows measured before this protocol lack its fields)
        limit = f"{first['physical_limit']:.2f}x" if first.get("physical_limit") else "-"
        budget = f"{first['token_budget']:,}" if first.get("token_budget") else "-"
        off = max((r["lr_off"] for r in rs if r.get("lr_off") is not None), default="-")
        lines.append(f"| {first['cluster']} | {first.get('quota', '-')} | {limit} | {system} | {n} | {_spread(times, n, '.1f')} | "
                     f"{_spread(walls, n, '.0f')} | {_spread(ups, n, '.2f')} | {_spread(fracs, n, '.0%')} | {_spread(toks, n, ',.0f')} | "
                     f"{budget} | {off} | {_t(statistics.median(preds)) if preds else '-'} | "
                     f"{f'{statistics.median(cal):+.0%}' if cal and len(cal) == n else '-'} | {rs[0]['plan']}{_replans(rs)} |")
    lines += ["", "Over clusters (each cluster's median over seeds; a cluster where a seed missed the target counts as not reached):", "",
              "| system | clusters | reached | speed-up over plain: median over clusters (min-max) | of limit: median |", "|---|---|---|---|---|"]
    limits = {place(r): r.get("physical_limit") for r in rows}
    for system, by in cluster_speedups(rows).items():
        got = {c: u for c, u in by.items() if u is not None}
        fr = [u / lim for c, u in got.items() if (lim := limits[c])]
        lines.append(f"| {system} | {len(by)} | {len(got)} | {_spread(list(got.values()), len(by), '.2f')} | "
                     f"{f'{statistics.median(fr):.0%}' if fr and len(got) == len(by) else '-'} |")
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
    lines += ["", "Targets: " + "; ".join(f"{place(r)} seed {r['seed']}: {r['target_val_loss']:.4f}" for r in rows if r["system"] == "plain"), ""]
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
            out.setdefault((place(r), r["seed"]), []).append(r["machine_gflops"])
    return out


def plots(rows: list[dict], out: Path) -> None:
    plt = pyplot()
    clusters = list(dict.fromkeys(place(r) for r in rows))
    for axis, name, label in ((1, "time_to_target_time.png", "time from the first step, evaluation included (s)"), (0, "time_to_target_tokens.png", "tokens trained")):
        fig, axes = plt.subplots(1, len(clusters), figsize=(5.5 * len(clusters), 4), squeeze=False)
        for ax, c in zip(axes[0], clusters, strict=True):
            seed = min(r["seed"] for r in rows if place(r) == c)
            for r in rows:
                if place(r) == c and r["seed"] == seed and r["val_curve"]:
                    ax.plot([p[axis] for p in r["val_curve"]], [p[2] for p in r["val_curve"]], marker="o", ms=2, label=r["system"])
            ax.axhline(next(r["target_val_loss"] for r in rows if place(r) == c and r["seed"] == seed), color="0.5", lw=0.8, ls="--")
            ax.set_title(f"{c}, seed {seed}")
            ax.set_xlabel(label)
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(clusters)), 4))
    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if s != "plain"]
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        meds, lo, hi = [], [], []
        for c in clusters:
            ups = [u for u in (speedup(r, rows) for r in rows if place(r) == c and r["system"] == s) if u is not None]
            m = statistics.median(ups) if ups else 0.0
            meds.append(m)
            lo.append(m - min(ups) if ups else 0.0)
            hi.append(max(ups) - m if ups else 0.0)
        ax.bar([k + i * width for k in range(len(clusters))], meds, width, yerr=[lo, hi], capsize=2, label=s)
    for k, c in enumerate(clusters):  # the physical limit of each cluster
        lim = next((r.get("physical_limit") for r in rows if place(r) == c), None)
        if lim:
            ax.hlines(lim, k - width / 2, k + width * (len(systems) - 0.5), colors="0.3", linestyles="dotted")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xticks([k + width * (len(systems) - 1) / 2 for k in range(len(clusters))], clusters, fontsize=7)
    ax.set_ylabel("speed-up over the plain loop (median, min-max)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "time_to_target.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/time_to_target/MODEL")
    ap.add_argument("--clusters", nargs="+", default=["random:31", "random-latency:32", "random2:33", "random2-latency:34", "random:35",
                                                      "random2-latency:36"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--target-at", type=float, default=0.5, help="the target: the plain loop's validation loss at this fraction of the steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=4, help="the tuned systems' (auto takes the option's default)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--quota-share", type=float, default=QUOTA_SHARE,
                    help="the devices' CPU quotas are scaled to add up to at most this share of the machine's cores")
    ap.add_argument("--full-quota", action="store_true", help="also run every cluster with its file's quotas (a fully booked machine), reported beside")
    ap.add_argument("--probe", action="store_true",
                    help="fusionllm plans from devices and links it measures at the start (as a user without a cluster file would) "
                         "instead of the cluster file's nominal speeds")
    ap.add_argument("--warm-start", type=int, default=0, metavar="K",
                    help="every system starts from a checkpoint of K steps of one worker (another data seed); results in MODEL-warmK")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--merge", action="store_true", help="keep the rows of the existing JSON for clusters, seeds and systems not run this time")
    ap.add_argument("--report", action="store_true", help="only rewrite the table and plots from the JSON")
    args = ap.parse_args()
    if not 0 < args.quota_share <= 1:
        ap.error(f"--quota-share must be in (0, 1], got {args.quota_share}")
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
    meta: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "warm_dir")}, "systems": {k: list(v.flags) for k, v in FUSION.items()}}
    quotas = [False, True] if args.full_quota else [False]
    if args.merge and path.exists():  # rows kept from an earlier run carry its provenance
        old = json.loads(path.read_text())
        rows = [{**r, "measured": r.get("measured") or kept_provenance(old)} for r in old["results"]
                if r["cluster"] not in args.clusters or r["seed"] not in args.seeds or r["system"] not in args.systems
                or (r.get("quota") == "full") not in quotas]
    seeds = args.seeds
    with tempfile.TemporaryDirectory(prefix="fusion-ttt-") as tmpdir:
        for seed in seeds:  # every cluster at the first seed before any at the next; written after each
            for name in args.clusters:
                for full in quotas:
                    args.seeds = [seed]
                    rows += bench_cluster(name, args, Path(tmpdir), full=full)
                    args.seeds = seeds
                    write(out, "time_to_target", rows, table(rows, args), meta)
                    plots(rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
