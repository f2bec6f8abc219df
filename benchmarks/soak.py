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
  time) sends a NaN at step K; the step is retried and skipped (a second one evicts that worker).

Reported per fault: the seconds training lost (the window from the fault to the first step completed
after the fault was over, less the fault-free time of the steps made in that window), the steps run
again, and the events the coordinator wrote.
At the end, every step's loss (the last time it ran) and every weight of the final checkpoint are
compared with one PyTorch process trained on the same batches that skipped the same steps.

    python benchmarks/soak.py --quick            # 10 minutes (root)
    python benchmarks/soak.py                    # one hour
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

ROOT = Path(__file__).resolve().parents[1]
PY = [sys.executable, "-m", "fusionllm"]
KINDS = ("kill", "hang", "coordinator", "drop", "slow", "nan")
PORT = 7450
DROP_S, SLOW_S, SLOW_FACTOR = 10.0, 60.0, 10
SLOWER = 2.0  # steps under faults (fewer workers after a loss, a slow link) take up to this many times the calibrated one


@dataclass
class Proc:
    slot: int
    port: int
    popen: subprocess.Popen
    nan_steps: tuple[int, ...] = ()
    stopped: bool = False
    injected: tuple[int, ...] = ()  # the NaN steps it was started with (kept when an eviction clears nan_steps)

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


    def lost(self, step_s: float) -> float | None:
        """Seconds of training the fault cost: the window from the fault to the first step after it
        was over, less the time the steps made in that window took before the fault."""
        return None if self.first_new_step_at is None else round(self.first_new_step_at - self.began - self.progress * (self.step_s or step_s), 2)


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
        plans = [r for _, r in self.records if r.get("event") == "plan"]
        if not plans:
            return []
        return [w["address"] for w in plans[-1]["workers"].values() if w.get("in_plan", True)]


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

    # ---- processes -------------------------------------------------------------------------------
    def train_args(self, steps: int) -> list[str]:
        a = self.args
        return ["--model", a.model, "--steps", str(steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(a.seed),
                "--lr", str(a.lr), "--warmup", "20", "--eval-every", "0", "--micro-batches", "4"]

    def start_coordinator(self, steps: int, *, resume: bool, ckpt: Path) -> None:
        metrics = self.tmp / f"metrics-{self.incarnation}.jsonl"
        self.metrics.files.append(metrics)
        cmd = [*PY, "coordinator", "--listen", f"{self.host}:{PORT}", "--token-file", str(self.token), "--workers", str(len(self.tb.slots)),
               *self.train_args(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--keep-checkpoints", "3",
               "--dead-after", str(self.args.dead_after), "--max-recoveries", "1000", "--metrics", str(metrics), "--join-timeout", "600",
               *(["--resume"] if resume else [])]
        log = (self.logs / f"coordinator-{self.incarnation}.log").open("w")
        self.coordinator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.incarnation += 1

    def start_worker(self, slot: int, nan_steps: tuple[int, ...] = ()) -> Proc:
        s = self.tb.slots[slot]
        port = self.next_port
        self.next_port += 1
        cmd = [*s.command_prefix(), *PY, "worker", "--join", f"{self.host}:{PORT}", "--token-file", str(self.token),
               "--listen", f"{s.address}:{port}", "--threads", str(s.threads()), "--coordinator-timeout", "300",
               *[x for k in nan_steps for x in ("--inject-fault", f"nan@{k}")]]
        log = (self.logs / f"worker-{slot}-{port}.log").open("w")
        proc = Proc(slot, port, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), nan_steps, injected=nan_steps)
        self.workers.append(proc)
        return proc

    def address_of(self, p: Proc) -> str:
        return f"{self.tb.slots[p.slot].address}:{p.port}"

    def in_plan(self, *, avoid_nan: bool = True) -> list[Proc]:
        planned = set(self.metrics.plan_addresses())
        return [p for p in self.workers if p.alive and not p.stopped and self.address_of(p) in planned and not (avoid_nan and p.nan_steps)]

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
        n_events = len(self.metrics.events())
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
            fault.ok = self.wait_for("recovery", lambda: self.events_since(n_events, "recovery"), 120)
            if fault.kind == "hang":
                v.popen.kill()
                v.popen.wait()
            self.start_worker(v.slot)  # a new process, a new address: it joins as a spare
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
            fault.target = ", ".join(self.address_of(p) for p in self.workers if p.nan_steps)
            nan_at = {k for p in self.workers for k in p.nan_steps}
            fault.ok = self.wait_for("the bad step", lambda: [e for e in self.metrics.events("bad_step") if e["step"] in nan_at], 1800)
            k = min((e["step"] for e in self.metrics.events("bad_step") if e["step"] in nan_at), default=None)
            before = [(t, r) for t, r in self.metrics.steps() if k is not None and r["step"] == k - 1]
            if before:
                fault.began, fault.last_step_before = before[-1][0], k - 1
            if self.wait_for("an eviction", lambda: self.events_since(n_events, "evict") or self.events_since(n_events, "bad_step")[-1:]
                             and self.events_since(n_events, "bad_step")[-1].get("action") == "skip", 120) and self.events_since(n_events, "evict"):
                for p in [p for p in self.workers if p.nan_steps]:
                    p.popen.wait(timeout=60)  # an evicted worker is told to leave
                    p.nan_steps = ()
                    self.start_worker(p.slot)  # and a healthy one takes its namespace, as a spare
        over = time.monotonic()  # the fault is over (link back, run recovered, new coordinator started): the first step after it ends the window
        if fault.kind == "nan" and fault.last_step_before >= 0:  # its window: from step K-1's record to the first step after K
            over = fault.began
        self.wait_for("progress", lambda: any(t >= over and r["step"] > fault.last_step_before for t, r in self.metrics.steps()[-50:])
                      or self.metrics.last_step() >= steps - 1, 300)
        end = next(((t, r["step"]) for t, r in self.metrics.steps() if t >= over and r["step"] > fault.last_step_before), None)
        if end is not None:
            skipped = {e["step"] for e in self.metrics.events("bad_step") if e.get("action") == "skip" and fault.last_step_before < e["step"] < end[1]}
            fault.first_new_step_at, fault.progress = end[0], end[1] - fault.last_step_before - len(skipped)  # a skipped step is no progress
        fault.events = [e for e in self.metrics.events()[n_events:]]
        if fault.kind == "nan":
            nan_at = {k for p in self.workers for k in p.nan_steps} | {k for p in self.workers for k in p.injected}
            fault.events = [e for e in self.metrics.events() if e["event"] in ("bad_step", "evict") and e.get("step", e.get("at_step")) in nan_at]


def calibrate(soak: Soak, ckpt: Path, steps: int) -> float:
    """Median step seconds of a short fault-free run of the same setup."""
    soak.start_coordinator(steps, resume=False, ckpt=ckpt)
    for slot in range(len(soak.tb.slots)):
        soak.start_worker(slot)
    assert soak.coordinator is not None
    rc = soak.coordinator.wait(timeout=900)
    if rc != 0:
        raise SystemExit(f"calibration run failed (exit {rc}); see {soak.logs}")
    soak.metrics.poll()
    times = [r["step_s"] for _, r in soak.metrics.steps()][5:]
    soak.stop_all()
    return statistics.median(times)


def reference(args: argparse.Namespace, steps: int, skip: set[int]) -> tuple[list[float], dict]:
    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.single import train_single

    cfg = TrainConfig(model=args.model, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed, warmup=20,
                      eval_every=0, threads=1)
    result = train_single(cfg, skip=frozenset(skip))
    return result.losses, {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def final_state(ckpt: Path) -> tuple[int, dict]:
    from safetensors.torch import load_file

    from fusionllm.core.checkpoints import latest_checkpoint

    last = latest_checkpoint(ckpt)
    if last is None:
        raise SystemExit(f"no checkpoint in {ckpt}")
    state: dict = {}
    for shard in sorted(last.glob("stage-*.safetensors")):
        for key, value in load_file(shard).items():
            if key.startswith("param/"):
                state.setdefault(key.removeprefix("param/"), value)
    return int(json.loads((last / "state.json").read_text())["step"]), state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 minutes, each fault kind once")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--fault-every", type=float, default=None, help="seconds between faults (default: 300, --quick 85)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dead-after", type=float, default=12.0)
    ap.add_argument("--out", type=Path, default=results_dir("soak"))
    args = ap.parse_args()
    exit_on_sigterm()
    minutes = args.minutes or (10.0 if args.quick else 60.0)
    every = args.fault_every or (85.0 if args.quick else 300.0)

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
        step_s = calibrate(soak, tmp / "ckpt-calibrate", 40)
        soak.metrics = Metrics()
        rng = random.Random(args.seed)
        n_faults = max(1, int(minutes * 60 // every) - 1)
        kinds: list[str] = []
        while len(kinds) < n_faults:
            cycle = list(KINDS)
            rng.shuffle(cycle)
            kinds += cycle
        faults = [Fault(k, every * (i + 1)) for i, k in enumerate(kinds[:n_faults])]
        busy = sum({"kill": 10, "hang": args.dead_after + 10, "coordinator": 20, "drop": 10, "slow": SLOW_S, "nan": 2}[f.kind] for f in faults)
        steps = int((minutes * 60 - busy) / step_s)
        nan_steps = tuple(int(f.at / (step_s * SLOWER)) for f in faults if f.kind == "nan")  # reached before its time, even with faults
        print(f"cluster {spec.name}: {len(tb.slots)} workers; fault-free step {step_s:.3f} s; {steps} steps; "
              f"faults: {', '.join(f'{f.kind}@{f.at:.0f}s' for f in faults)}; NaN at steps {nan_steps}", flush=True)
        ckpt = tmp / "ckpt"
        soak.started = time.monotonic()
        soak.start_coordinator(steps, resume=False, ckpt=ckpt)
        nan_slot = rng.randrange(len(tb.slots))
        for slot in range(len(tb.slots)):
            soak.start_worker(slot, nan_steps if slot == nan_slot else ())
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
        steps_seen = soak.metrics.steps()
        last: dict[int, dict] = {}
        runs: dict[int, int] = {}
        for _, r in steps_seen:
            last[r["step"]] = r
            runs[r["step"]] = runs.get(r["step"], 0) + 1
        skipped = {e["step"] for e in soak.metrics.events("bad_step") if e.get("action") == "skip"}
        done_step, state = final_state(ckpt) if rc == 0 else (-1, {})
        ref_losses, ref_state = reference(args, steps, skipped)
        ref_steps = [s for s in range(steps) if s not in skipped]
        loss_err = max((abs(last[s]["loss"] - ref) / abs(ref) for s, ref in zip(ref_steps, ref_losses, strict=True) if s in last), default=float("nan"))
        per_tensor = {k: (float((state[k].double() - v.double()).norm() / max(float(v.double().norm()), 1e-12)),
                          float((state[k].double() - v.double()).abs().max())) for k, v in ref_state.items() if k in state and v.is_floating_point()}
        weight_err = max((e for e, _ in per_tensor.values()), default=float("nan"))
        worst = sorted(per_tensor.items(), key=lambda kv: -kv[1][0])[:3]
        missing = [s for s in ref_steps if s not in last]
        summary = {
            "cluster": spec.name, "minutes": minutes, "fault_every_s": every, "steps": steps, "fault_free_step_s": step_s, "wall_s": round(wall, 1),
            "coordinator_exit": rc, "steps_completed": len(last), "steps_missing": missing[:20], "steps_skipped": sorted(skipped),
            "steps_redone": sum(n - 1 for n in runs.values()), "final_checkpoint_step": done_step,
            "max_rel_loss_err": loss_err, "max_rel_weight_err": weight_err, "worst_tensors": {k: {"rel_norm_err": e, "max_abs_diff": d} for k, (e, d) in worst},
            "weights_compared": len(per_tensor), "weights_missing": sorted(k for k in ref_state if k not in state),
            "weights_expected": len(ref_state), "events": {k: len(soak.metrics.events(k)) for k in ("recovery", "bad_step", "evict", "resume", "replan")},
        }
        rows = []
        for f in faults:
            lost = f.lost(step_s)
            rows.append({"kind": f.kind, "at_s": round(f.began - soak.started, 1), "target": f.target, "ok": f.ok, "note": f.note,
                         "last_step_before": f.last_step_before, "training_lost_s": lost, "events": f.events})
    table = [f"Cluster `{summary['cluster']}` (random, seed {args.seed}; {len(spec.devices())} CPU workers), {args.model}, batch {args.batch_size} x {args.seq_len}, "
             f"a checkpoint every step, --dead-after {args.dead_after:g}; a fault every {every:.0f} s over {minutes:.0f} min.", "",
             f"- steps: {summary['steps_completed']} of {steps} completed (coordinator exit {rc}); skipped (bad tensors): {summary['steps_skipped']}; "
             f"run again: {summary['steps_redone']}",
             f"- against one process that skipped the same steps: losses within {loss_err:.2g} (relative), final weights within {weight_err:.2g} "
             f"(|a - b| / |b| per tensor; {summary['weights_compared']} float tensors; largest: "
             + ", ".join(f"{k} {e:.2g}" for k, (e, _) in worst) + ")",
             f"- fault-free step: {step_s:.3f} s; wall {summary['wall_s']:.0f} s", "",
             "| fault | at (s) | target | training lost (s) | events | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ev = ", ".join(e["event"] + (f"/{e.get('action')}" if e["event"] == "bad_step" else "") for e in r["events"]) or "-"
        table.append(f"| {r['kind']} | {r['at_s']:.0f} | {r['target']} | {r['training_lost_s']} | {ev} | {r['note'] or ('' if r['ok'] else 'FAILED')} |")
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        if r["training_lost_s"] is not None:
            by_kind.setdefault(r["kind"], []).append(r["training_lost_s"])
    table += ["", "| fault kind | times | training lost, max (s) | mean (s) |", "|---|---|---|---|"]
    for k, v in sorted(by_kind.items()):
        table.append(f"| {k} | {len(v)} | {max(v):.2f} | {statistics.mean(v):.2f} |")
    name = "soak_quick" if args.quick else "soak"
    write(args.out, name, {"summary": summary, "faults": rows}, table)
    return 0 if rc == 0 and not missing else 1


if __name__ == "__main__":
    os.environ.setdefault("FUSIONLLM_LOGLEVEL", "INFO")
    raise SystemExit(main())
