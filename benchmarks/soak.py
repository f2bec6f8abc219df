#!/usr/bin/env python
"""Soak: a long run on the testbed under a seeded schedule of faults, timed, and checked for equality.

A random CPU cluster (seeded; four workers whose CPU quotas add up to the machine's two cores, links
8 Mbit/s to 10 Gbit/s) is brought up in network namespaces. A coordinator and four worker processes
train gpt-micro with a checkpoint after every step. Every ``--fault-every`` seconds one fault from a
seeded order hits the run, each kind in turn:

- ``kill``: a worker of the plan gets SIGKILL; once the run recovered, a fresh worker process starts
  in its namespace under a new port (a new address) and joins as a spare;
- ``hang``: a worker of the plan gets SIGSTOP; after the recovery it is killed and replaced the same way;
- ``coordinator``: the coordinator gets SIGTERM (it writes a final checkpoint and tells the workers it
  will be back), and a new coordinator process starts with ``--resume`` on the same address;
- ``drop``: a worker's link (its veth) goes down for 10 s and comes back;
- ``slow``: a link between two workers of the plan runs at a tenth of its rate for 60 s;
- ``nan``: a worker launched with ``--inject-fault nan@K`` (the step the schedule expects at that
  time) sends a NaN at step K; the step is retried and skipped (a second one evicts that worker);
- ``second``: a second coordinator for the same run is started by mistake (the same checkpoint
  directory, another port, ``--resume``): it must be refused while the first is alive;
- ``poison`` (``--mode hierarchical``): a group of one worker pushes a flipped, x100 or NaN
  pseudo-gradient (``--inject-fault outer-flip@R`` and so on, in turn) from outer round R on; it
  must be refused and its group evicted, and a healthy worker takes its place as a new group.

``--mode hierarchical`` trains three groups (``soak_modes.py``); a fault that takes a worker takes
its group, and the fault is over when the replacement's group joined.

Reported per fault: the seconds training lost (the window from the fault to the first step completed
after the fault was over, less the fault-free time of the steps made in that window), the steps run
again, and the events the coordinator wrote.
At the end, synchronous mode: every step's loss (the last time it ran) and every weight of the
final checkpoint are compared with one PyTorch process trained on the same batches that skipped the
same steps; hierarchical mode: the final validation loss with a clean run of the same seed.

    python benchmarks/soak.py --quick            # 10 minutes (root)
    python benchmarks/soak.py                    # one hour
    python benchmarks/soak.py --mode hierarchical
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import exit_on_sigterm, results_dir, stop, write  # noqa: E402
from soak_modes import (  # noqa: E402
    POISON_SLOT,
    POISONS,
    calibrated_step_s,
    group_addresses,
    group_of,
    hier_args,
    joined_with,
    second_coordinator,
)
from soak_report import hier_summary, redone_per_fault, report, sync_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PY = [sys.executable, "-m", "fusionllm"]
KINDS = ("kill", "hang", "coordinator", "drop", "slow", "nan", "second")
HIER_KINDS = (*KINDS, "poison")
PORT = 7450
DROP_S, SLOW_S, SLOW_FACTOR = 10.0, 60.0, 10
SLOWER = 2.0  # steps under faults (fewer workers after a loss, a slow link) take up to this many times the calibrated one


def _poison_at(poison: str, r: int) -> str:
    """``outer-flip@R`` moved ``r`` rounds on: a poisoner pushes bad deltas three rounds running."""
    kind, _, at = poison.partition("@")
    return f"{kind}@{int(at) + r}"


@dataclass
class Proc:
    slot: int
    port: int
    popen: subprocess.Popen
    nan_steps: tuple[int, ...] = ()
    stopped: bool = False
    injected: tuple[int, ...] = ()  # the NaN steps it was started with (kept when an eviction clears nan_steps)
    poison: str = ""  # --inject-fault outer-...@R it was started with
    since: int = 0  # the benchmark's records when it started

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Fault:
    kind: str
    at: float  # seconds after the start, as scheduled
    began: float = 0.0  # benchmark clock
    target: str = ""
    last_step_before: int = -1
    first_new_step_at: float | None = None  # the first step completed after the fault was over
    progress: int = 0  # steps beyond the last one done before the fault, by then
    step_s: float = 0.0  # the median step of the 20 before the fault (fewer workers after a loss make steps slower)
    ok: bool = True
    note: str = ""
    events: list[dict] = field(default_factory=list)
    rate: float = 0.0  # hierarchical: step records per second in the 30 s before the fault
    redone: int = 0  # steps run again in its window
    loss_gap: float | None = None  # hierarchical: how much it moved the training loss's gap to the clean run
    nan_step: int | None = None  # a nan fault: the step whose NaN it reports

    def lost(self, step_s: float) -> float | None:
        """Seconds of training the fault cost: the window from the fault to the first step after it
        was over, less the time the steps made in that window took before the fault."""
        if self.first_new_step_at is None:
            return None
        if self.rate:  # hierarchical: the groups step side by side; the records' rate stands for the run's speed
            return round(self.first_new_step_at - self.began - self.progress / self.rate, 2)
        return round(self.first_new_step_at - self.began - self.progress * (self.step_s or step_s), 2)


class Metrics:
    """Step records and events of every coordinator incarnation, with the time each was seen."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self._read: dict[Path, int] = {}
        self.records: list[tuple[float, dict]] = []

    def poll(self) -> None:
        for path in self.files:
            if not path.exists():
                continue
            with path.open() as fh:
                fh.seek(self._read.get(path, 0))
                chunk = fh.read()
            whole = chunk[: chunk.rfind("\n") + 1]
            self._read[path] = self._read.get(path, 0) + len(whole.encode())
            now = time.monotonic()
            self.records += [(now, json.loads(line)) for line in whole.splitlines() if line.strip()]

    def steps(self) -> list[tuple[float, dict]]:
        return [(t, r) for t, r in self.records if "step" in r and "event" not in r]

    def events(self, kind: str | None = None) -> list[dict]:
        return [r for _, r in self.records if "event" in r and r["event"] != "plan" and (kind is None or r["event"] == kind)]

    def last_step(self) -> int:
        steps = self.steps()
        return max((r["step"] for _, r in steps), default=-1)

    def plan_addresses(self) -> list[str]:
        return group_addresses(self.records)


class Soak:
    def __init__(self, args: argparse.Namespace, tb: object, tmp: Path) -> None:
        self.args, self.tb, self.tmp = args, tb, tmp
        self.rng = random.Random(args.seed)
        self.token = tmp / "token"
        subprocess.run([*PY, "token", str(self.token)], check=True, capture_output=True)
        self.host = tb.coordinator_host
        self.metrics = Metrics()
        self.workers: list[Proc] = []
        self.coordinator: subprocess.Popen | None = None
        self.incarnation = 0
        self.next_port = 7100
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.started = time.monotonic()
        self.hier = args.mode == "hierarchical"
        self.eval_every = 0  # hierarchical: the run's steps, so that it evaluates once, at the end
        self.poisons: list[int] = []  # the rounds the next poisoners push their bad deltas at
        self.poisoned = 0
        self.nan_done: set[int] = set()  # NaN steps already reported by a fault

    # ---- processes -------------------------------------------------------------------------------
    def train_args(self, steps: int) -> list[str]:
        a = self.args
        mode = hier_args(a.inner_steps, self.eval_every or steps) if self.hier else ["--eval-every", "0"]
        return ["--model", a.model, "--steps", str(steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(a.seed),
                "--lr", str(a.lr), "--warmup", "20", "--micro-batches", "2" if self.hier else "4", *mode]

    def coordinator_cmd(self, steps: int, *, resume: bool, ckpt: Path, metrics: Path, port: int = PORT) -> list[str]:
        every = str(4 * self.args.inner_steps) if self.hier else "1"  # hierarchical: a checkpoint is a pause of every group
        return [*PY, "coordinator", "--listen", f"{self.host}:{port}", "--token-file", str(self.token), "--workers", str(len(self.tb.slots)),
                *self.train_args(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", every, "--keep-checkpoints", "3",
                "--dead-after", str(self.args.dead_after), "--max-recoveries", "1000", "--metrics", str(metrics), "--join-timeout", "600",
                *(["--resume"] if resume else [])]

    def start_coordinator(self, steps: int, *, resume: bool, ckpt: Path) -> None:
        metrics = self.tmp / f"metrics-{self.incarnation}.jsonl"
        self.metrics.files.append(metrics)
        cmd = self.coordinator_cmd(steps, resume=resume, ckpt=ckpt, metrics=metrics)
        log = (self.logs / f"coordinator-{self.incarnation}.log").open("w")
        self.coordinator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.incarnation += 1

    def start_worker(self, slot: int, nan_steps: tuple[int, ...] = (), *, rank: bool = False, poison: str = "") -> Proc:
        """``rank``: ask for the slot's worker id (the first workers; the groups are by id);
        ``poison``: ``outer-...@R``, pushed to the other groups from round R on."""
        s = self.tb.slots[slot]
        port = self.next_port
        self.next_port += 1
        cmd = [*s.command_prefix(), *PY, "worker", "--join", f"{self.host}:{PORT}", "--token-file", str(self.token),
               "--listen", f"{s.address}:{port}", "--threads", str(s.threads()), "--coordinator-timeout", "300",
               *[x for k in nan_steps for x in ("--inject-fault", f"nan@{k}")], *(["--rank", str(slot)] if rank else []),
               *[x for r in range(3) if poison for x in ("--inject-fault", _poison_at(poison, r))]]
        log = (self.logs / f"worker-{slot}-{port}.log").open("w")
        proc = Proc(slot, port, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), nan_steps, injected=nan_steps, poison=poison,
                    since=len(self.metrics.records))
        self.workers.append(proc)
        return proc

    def address_of(self, p: Proc) -> str:
        return f"{self.tb.slots[p.slot].address}:{p.port}"

    def in_plan(self, *, avoid_nan: bool = True) -> list[Proc]:
        planned = set(self.metrics.plan_addresses())
        # hierarchical: the NaN worker's group must stay as it is until its bad step (a group that joins again reads other batches)
        kept = {q.slot for q in self.workers if q.nan_steps} | ({0, 1} if self.hier and any(q.nan_steps for q in self.workers) else set())
        return [p for p in self.workers if p.alive and not p.stopped and self.address_of(p) in planned
                and not (avoid_nan and (p.nan_steps or p.poison or p.slot in kept))]

    def stop_all(self) -> None:
        stop([p.popen for p in self.workers] + [self.coordinator], grace=20, resume=True)  # a held worker is continued first

    # ---- waiting ---------------------------------------------------------------------------------
    def wait_for(self, what: str, check: object, timeout: float, *, quiet: bool = False) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.metrics.poll()
            if check():
                return True
            if self.coordinator is not None and self.coordinator.poll() is not None and what != "coordinator exit":
                return False
            time.sleep(0.05)
        if not quiet:
            print(f"  (gave up waiting for {what} after {timeout:.0f} s)", flush=True)
        return False

    def events_since(self, n: int, kind: str) -> list[dict]:
        return [e for e in self.metrics.events()[n:] if e["event"] == kind]

    # ---- faults ----------------------------------------------------------------------------------
    def hit(self, fault: Fault, steps: int, ckpt: Path) -> None:
        self.metrics.poll()
        fault.began = time.monotonic()
        fault.last_step_before = self.metrics.last_step()
        recent = [r["step_s"] for _, r in self.metrics.steps()[-20:]]
        fault.step_s = statistics.median(recent) if recent else 0.0
        if self.hier:
            fault.rate = len([t for t, _ in self.metrics.steps() if t >= fault.began - 30.0]) / 30.0
        n_events = len(self.metrics.events())
        n_records = len(self.metrics.records)
        over: float | None = None  # the fault is over (link back, run recovered, new coordinator started, new group joined)
        if fault.kind in ("kill", "hang"):
            victims = self.in_plan()
            if not victims:
                fault.ok, fault.note = False, "no worker of the plan to hit"
                return
            v = self.rng.choice(victims)
            fault.target = self.address_of(v)
            if fault.kind == "kill":
                v.popen.kill()
            else:
                v.popen.send_signal(signal.SIGSTOP)
                v.stopped = True
            lost = "group_left" if self.hier else "recovery"
            fault.ok = self.wait_for(lost, lambda: self.events_since(n_events, lost), 120)
            if fault.kind == "hang":
                v.popen.kill()
                v.popen.wait()
            new = self.start_worker(v.slot)  # a new process, a new address: it joins as a spare
            if self.hier:
                over = self.rejoined(fault, new, n_records)
        elif fault.kind == "coordinator":
            assert self.coordinator is not None
            fault.target = f"{self.host}:{PORT}"
            self.coordinator.send_signal(signal.SIGTERM)
            try:
                self.coordinator.wait(timeout=120)
            except subprocess.TimeoutExpired:
                fault.note = "the coordinator did not stop within 120 s of SIGTERM; killed"
                self.coordinator.kill()
                self.coordinator.wait()
            self.start_coordinator(steps, resume=True, ckpt=ckpt)
        elif fault.kind == "second":
            fault.target = f"{self.host}:{PORT + 1}"
            cmd = self.coordinator_cmd(steps, resume=True, ckpt=ckpt, metrics=self.tmp / "metrics-second.jsonl", port=PORT + 1)
            rc, line = second_coordinator(cmd, self.logs / f"second-{len(self.metrics.records)}.log")
            fault.note = f"exit {rc}: {line[:160]}"
            fault.ok = rc not in (None, 0) and "coordinator" in line and self.coordinator is not None and self.coordinator.poll() is None
        elif fault.kind == "drop":
            victims = self.in_plan(avoid_nan=False)
            v = self.rng.choice(victims)
            fault.target = self.address_of(v)
            veth = f"fusion-v{v.slot}"
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)
            try:
                time.sleep(DROP_S)
            finally:
                subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        elif fault.kind == "slow":
            victims = self.in_plan(avoid_nan=False)
            a, b = self.rng.sample(victims, 2) if len(victims) >= 2 else (victims[0], victims[0])
            fault.target = f"{self.address_of(a)} <-> {self.address_of(b)}"
            from fusionllm.testbed.testbed import set_link_rate

            rates = {(a.slot, b.slot): self.tb.spec.bandwidth(a.slot, b.slot), (b.slot, a.slot): self.tb.spec.bandwidth(b.slot, a.slot)}
            if a.slot != b.slot:
                for (i, j), bps in rates.items():
                    set_link_rate(i, j, max(8000, bps // SLOW_FACTOR))
                try:
                    self.wait_for("the slow period", lambda: False, SLOW_S, quiet=True)
                finally:
                    for (i, j), bps in rates.items():
                        set_link_rate(i, j, bps)
        elif fault.kind == "nan":  # the worker sends its NaN at a step fixed when it started: the window is around that step
            self.hit_nan(fault, n_events)
            over = fault.began  # its window: from step K-1's record to the first step after K
            if self.hier:  # the other groups step on meanwhile: the window ends with the first step after the last bad attempt
                nan_at = {k for p in self.workers for k in p.injected}
                over = max((t for t, r in self.metrics.records if r.get("event") == "bad_step" and r["step"] in nan_at), default=fault.began)
        elif fault.kind == "poison":
            over = self.hit_poison(fault, n_events, n_records)
        if over is None:
            self.metrics.poll()  # what a stopped coordinator wrote last is not progress after the fault
            over = time.monotonic()
        after = -1 if self.hier else fault.last_step_before  # hierarchical: a restarted coordinator counts the records anew
        self.wait_for("progress", lambda: any(t >= over and r["step"] > after for t, r in self.metrics.steps()[-50:])
                      or (not self.hier and self.metrics.last_step() >= steps - 1), 300)
        end = next(((t, r["step"]) for t, r in self.metrics.steps() if t >= over and r["step"] > after), None)
        if end is not None:
            skipped = {e["step"] for e in self.metrics.events("bad_step") if e.get("action") == "skip" and fault.last_step_before < e["step"] < end[1]}
            fault.first_new_step_at = end[0]
            if self.hier:  # every step record of the window is progress (the groups step side by side)
                fault.progress = len([t for t, _ in self.metrics.steps() if fault.began <= t < end[0]])
            else:
                fault.progress = end[1] - fault.last_step_before - len(skipped)  # a skipped step is no progress
        fault.events = [e for e in self.metrics.events()[n_events:] if e["event"] not in ("outer", "paused") and (e["event"] != "outer_check" or e["refused"])]
        if fault.kind == "nan":
            nan_at = {fault.nan_step} if fault.nan_step is not None else {k for p in self.workers for k in (*p.nan_steps, *p.injected)}
            fault.events = [e for e in self.metrics.events() if e["event"] in ("bad_step", "evict") and e.get("step", e.get("at_step")) in nan_at]

    def next_poison(self, at_round: int) -> str:
        """The kind of the next poisoner, in turn, and the first round it poisons."""
        self.poisoned += 1
        return f"{POISONS[(self.poisoned - 1) % len(POISONS)]}@{at_round}"

    def rejoined(self, fault: Fault, new: Proc, since: int) -> float | None:
        """Hierarchical: the time the group holding ``new`` joined (the fault is over then)."""
        address = self.address_of(new)
        if not self.wait_for("the new group", lambda: joined_with(self.metrics.records, address, since) is not None, 600):
            fault.ok, fault.note = False, f"{address} joined no group within 600 s"
            return None
        return joined_with(self.metrics.records, address, since)

    def hit_nan(self, fault: Fault, n_events: int) -> None:
        fault.target = ", ".join(self.address_of(p) for p in self.workers if p.nan_steps)
        nan_at = {k for p in self.workers for k in p.nan_steps} - self.nan_done  # a NaN step an earlier fault reported is not this one's
        fault.ok = self.wait_for("the bad step", lambda: [e for e in self.metrics.events("bad_step") if e["step"] in nan_at], 1800)
        k = min((e["step"] for e in self.metrics.events("bad_step") if e["step"] in nan_at), default=None)
        if k is not None:
            self.nan_done.add(k)
            fault.nan_step = k
        before = [(t, r) for t, r in self.metrics.steps() if k is not None and r["step"] == k - 1]
        if self.hier:  # the data step K is the worker's group's: the window starts at the record before the bad step's event
            bad_t = next((t for t, r in self.metrics.records if r.get("event") == "bad_step" and r["step"] in nan_at), None)
            before = [(t, r) for t, r in self.metrics.steps() if bad_t is not None and t < bad_t][-1:]
            if before:
                fault.began = before[-1][0]
        elif before:
            fault.began, fault.last_step_before = before[-1][0], k - 1
        def settled() -> list[dict]:  # the bad step's last attempt: skipped, or its worker evicted (the step may have come before the fault's time)
            return [e for e in self.metrics.events() if (e["event"] == "bad_step" and e["step"] in nan_at and e.get("action") == "skip")
                    or (e["event"] == "evict" and e.get("at_step", e.get("step")) in nan_at)] or self.events_since(n_events, "evict")

        if self.wait_for("an eviction", settled, 120) and any(e["event"] == "evict" for e in settled()):
            for p in [p for p in self.workers if p.nan_steps]:
                p.popen.wait(timeout=60)  # an evicted worker is told to leave
                p.nan_steps = ()
                self.start_worker(p.slot)  # and a healthy one takes its namespace, as a spare

    def hit_poison(self, fault: Fault, n_events: int, n_records: int) -> float | None:
        """The poisoner pushes its bad deltas at rounds fixed when it started: wait for its refusals and
        its eviction, then a worker takes its place (the next poisoner, if another poison fault follows)."""
        bad = next((p for p in self.workers if p.poison and p.popen.returncode is None), None)  # (it may have been evicted already)
        if bad is None:
            fault.ok, fault.note = False, "no poisoner"
            return None
        fault.target = f"{self.address_of(bad)} ({bad.poison})"
        n_records = bad.since  # its rounds come before the fault's time (they are scheduled early): look from its start

        address = self.address_of(bad)

        def since(kind: str) -> list[tuple[float, dict]]:  # the poisoner's group's refusals and eviction (not another group's)
            g = str(group_of(self.metrics.records, address))
            return [(t, r) for t, r in self.metrics.records[n_records:] if r.get("event") == kind
                    and (g in r.get("refused", {}) or address in r.get("addresses", {}).values())]

        if not self.wait_for("a refused pseudo-gradient", lambda: since("outer_check"), 1800):
            fault.ok = False
            return None
        fault.began = since("outer_check")[0][0]
        fault.ok = self.wait_for("the poisoner's eviction", lambda: since("evict"), 600)
        checks = [r for _, r in since("outer_check")]
        fault.note = (f"refused in rounds {sorted({e['round'] for e in checks})}, " + ("evicted" if fault.ok else "not evicted: killed by the soak")) if checks else ""
        try:
            bad.popen.wait(timeout=60)  # an evicted worker is told to leave
        except subprocess.TimeoutExpired:
            bad.popen.kill()
            bad.popen.wait()
        nxt = self.poisons.pop(0) if self.poisons else None
        new = self.start_worker(bad.slot, poison=self.next_poison(nxt) if nxt is not None else "")
        return self.rejoined(fault, new, n_records)


def calibrate(soak: Soak, ckpt: Path, steps: int) -> float:
    """Seconds per step of the run's clock in a short fault-free run of the same setup."""
    soak.eval_every = steps
    soak.start_coordinator(steps, resume=False, ckpt=ckpt)
    for slot in range(len(soak.tb.slots)):
        soak.start_worker(slot, rank=True)
    assert soak.coordinator is not None
    rc = soak.coordinator.wait(timeout=900)
    if rc != 0:
        raise SystemExit(f"calibration run failed (exit {rc}); see {soak.logs}")
    soak.metrics.poll()
    soak.stop_all()
    soak.workers.clear()
    return calibrated_step_s([r for _, r in soak.metrics.steps()])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("synchronous", "hierarchical"), default="synchronous")
    ap.add_argument("--quick", action="store_true", help="10 minutes, each fault kind once")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--fault-every", type=float, default=None, help="seconds between faults (default: 300, --quick 75)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--batch-size", type=int, default=None, help="default 8; hierarchical 12 (three groups of 4 rows)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--inner-steps", type=int, default=8, help="hierarchical: inner steps per round")
    ap.add_argument("--dead-after", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=results_dir("soak"))
    args = ap.parse_args()
    exit_on_sigterm()
    hier = args.mode == "hierarchical"
    args.batch_size = args.batch_size or (12 if hier else 8)
    minutes = args.minutes or (10.0 if args.quick else 60.0)
    every = args.fault_every or (75.0 if args.quick else 300.0)

    from fusionllm.cluster.random import ClusterShape, random_cluster
    from fusionllm.testbed.sh import can_emulate
    from fusionllm.testbed.testbed import Testbed

    ok, why = can_emulate()
    if not ok:
        print(f"soak needs the testbed (root, network namespaces): {why}", file=sys.stderr)
        return 2
    spec = random_cluster(args.seed, ClusterShape(sites=(2, 3), devices=(4, 4), kind="cpu", latency=False))
    with tempfile.TemporaryDirectory(prefix="fusion-soak-") as tmp_name, Testbed(spec) as tb:
        tmp = Path(tmp_name)
        soak = Soak(args, tb, tmp)
        step_s = calibrate(soak, tmp / "ckpt-calibrate", 48 if hier else 40)
        soak.metrics = Metrics()
        rng = random.Random(args.seed)
        n_faults = max(1, int(minutes * 60 // every) - 1)
        kinds: list[str] = []
        while len(kinds) < n_faults:
            cycle = list(HIER_KINDS if hier else KINDS)
            rng.shuffle(cycle)
            kinds += cycle
        faults = [Fault(k, every * (i + 1)) for i, k in enumerate(kinds[:n_faults])]
        busy = sum({"kill": 10, "hang": args.dead_after + 10, "coordinator": 20, "drop": 10, "slow": SLOW_S, "nan": 2, "second": 5,
                    "poison": 30}[f.kind] for f in faults)
        steps = int((minutes * 60 - busy) / step_s)
        # faults that cost less than their budget must not end the run before the last one: it runs a minute past it at least
        steps = max(steps, int((faults[-1].at + 60) / step_s))
        if hier:
            steps -= steps % args.inner_steps
        soak.eval_every = steps
        groups = 3 if hier else 1
        # reached before its time, even with faults; hierarchical: the data steps of the three groups' inner step there, one of which is the worker's
        nan_steps = tuple(int(f.at / (step_s * SLOWER)) * groups + j for f in faults if f.kind == "nan" for j in range(groups))
        # a poisoner's rounds come close before their fault's time (the rate measured in the calibration run, a little slower),
        # not in another fault's window; the fault waits for them if the run is slower still
        soak.poisons = [int(f.at / (step_s * 1.25 * args.inner_steps)) for f in faults if f.kind == "poison"]
        print(f"cluster {spec.name} ({args.mode}): {len(tb.slots)} workers; fault-free step {step_s:.3f} s; {steps} steps; "
              f"faults: {', '.join(f'{f.kind}@{f.at:.0f}s' for f in faults)}; NaN at steps {nan_steps}; poison at rounds {soak.poisons}", flush=True)
        ckpt = tmp / "ckpt"
        soak.started = time.monotonic()
        soak.start_coordinator(steps, resume=False, ckpt=ckpt)
        nan_slot = rng.randrange(2) if hier else rng.randrange(len(tb.slots))  # hierarchical: in the group of two, which sends tensors
        first_poison = soak.next_poison(soak.poisons.pop(0)) if soak.poisons else ""
        for slot in range(len(tb.slots)):
            soak.start_worker(slot, nan_steps if slot == nan_slot else (), rank=True, poison=first_poison if slot == POISON_SLOT else "")
        try:
            for f in faults:
                while time.monotonic() - soak.started < f.at and soak.coordinator.poll() is None:
                    soak.metrics.poll()
                    time.sleep(0.1)
                if soak.coordinator.poll() is not None:
                    f.ok, f.note = False, "the run had ended"
                    break
                print(f"[{time.monotonic() - soak.started:7.1f} s] step {soak.metrics.last_step()}: {f.kind}", flush=True)
                soak.hit(f, steps, ckpt)
                lost = f.lost(step_s)
                print(f"    target {f.target}; training lost {lost if lost is None else round(lost, 2)} s; events "
                      f"{[e['event'] + ('/' + e.get('action', '') if e['event'] == 'bad_step' else '') for e in f.events]} {f.note}", flush=True)
            rc = soak.coordinator.wait(timeout=max(60.0, minutes * 60 * 2))
        finally:
            soak.metrics.poll()
            soak.stop_all()
        wall = time.monotonic() - soak.started
        redone_per_fault(faults, soak.metrics.steps())
        if hier:
            summary = hier_summary(args, soak, steps, rc, ckpt, faults)
        else:
            summary = sync_summary(args, soak, steps, rc, ckpt)
        summary.update({"mode": args.mode, "cluster": spec.name, "minutes": minutes, "fault_every_s": every, "steps": steps, "fault_free_step_s": step_s,
                        "wall_s": round(wall, 1), "coordinator_exit": rc,
                        "events": {k: len(soak.metrics.events(k)) for k in ("recovery", "bad_step", "evict", "resume", "replan", "group_left",
                                                                            "group_joined", "outer_refused")}})
        rows = [{"kind": f.kind, "at_s": round(f.began - soak.started, 1), "target": f.target, "ok": f.ok, "note": f.note,
                 "last_step_before": f.last_step_before, "training_lost_s": f.lost(step_s), "steps_redone": f.redone, "loss_gap": f.loss_gap, "events": f.events} for f in faults]
    table = report(args, spec, summary, rows, every, minutes)
    name = ("soak_quick" if args.quick else "soak") + ("_hierarchical" if hier else "")
    write(args.out, name, {"summary": summary, "faults": rows}, table)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("FUSIONLLM_LOGLEVEL", "INFO")
    raise SystemExit(main())
