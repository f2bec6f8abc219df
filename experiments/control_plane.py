#!/usr/bin/env python
"""Bytes through the coordinator: per step, per evaluation, per checkpoint, and for setting up.

How it measures. The coordinator (`fusionllm coordinator`) runs alone in a network namespace of its
own, joined to the root namespace by one veth pair; the four workers (`fusionllm worker`) run in
the root namespace and listen on the root end's address. Every byte the coordinator sends or
receives therefore crosses that veth, and nothing else does: worker-to-worker tensors go to
addresses of the root namespace and stay there. The kernel's counters of the root end
(/sys/class/net/<if>/statistics/{rx,tx}_bytes) are read before each run and then every 0.05 s
while it runs; rx is coordinator -> workers ("down"), tx is workers -> coordinator ("up").
They count whole frames: payload, gRPC, HTTP/2, TCP/IP and Ethernet headers, ACKs, heartbeats.
IPv6 is off on both ends so that no neighbour discovery adds to them.

Attribution, inside each run (not as differences of whole runs: shipping the initial weights at
setup varies by a few hundred KB from run to run, which swamped a step's few KB for gpt2). Every
0.05 s a sampler counts the step records in the metrics JSONL and then reads the counters, so
each sample says "this many steps were done, and this many bytes had crossed". In a run of k
steps, S1 is the first sample that saw a step record (n1 records, usually 1) and Sk the first
that saw all k; their counter difference covers nk - n1 whole steps (the records are written
after a step and its evaluation, before its checkpoint, so each such interval holds one next
step, one evaluation under --eval-every 1 and one checkpoint under --checkpoint-every 1).
Three runs of the same model, batch and seed:
  ak: k steps      ek: k steps, --eval-every 1      ck: k steps, --checkpoint-every 1
  per step       = (Sk - S1) / (nk - n1)                 in ak
  per evaluation = that figure in ek - that figure in ak
  per checkpoint = that figure in ck - that figure in ak
  setup          = S1 of ak: from the first process to the first step record (joining, planning,
                   shipping stages and the first step itself; the shutdown after the last
                   record is in the JSON as "teardown", in no column)
The step seconds are (time of Sk - time of S1) / (nk - n1), read the same way.

Why it is fair to old and new code alike. Nothing here knows how the coordinator talks to the
workers: it starts the two public commands with the same flags and counts what the kernel
carried, so moving the data, evaluation or checkpoints out of the coordinator shows up as bytes
that no longer cross the veth, whatever the messages look like. Both codes run the same model,
data, seed and flags on the same machine, one run at a time. Heartbeats (every 2 s from each
worker) are driven by time, not by steps: they are counted in whichever phase they fall, so a
phase's bytes include about `heartbeat B/s x its seconds`. The heartbeat rate is measured on its
own (four workers joined to a coordinator that waits for a fifth: nothing else moves), and the
table also gives the bytes per step without the heartbeats of the step's seconds (per step net);
the JSON has the same for an evaluation and a checkpoint (per_eval_net, per_checkpoint_net, from
the extra seconds per step that --eval-every 1 / --checkpoint-every 1 took).

    .venv/bin/python experiments/control_plane.py --code both --models gpt-micro,gpt2
    .venv/bin/python experiments/control_plane.py --code after   # only the new code again
    .venv/bin/python experiments/control_plane.py --report-only   # table and plot again from the JSON

It counts bytes, not seconds, so a busy machine changes only the step seconds (and with them the
heartbeats in per step); it needs no bench lock, but runs one cluster at a time.

Needs root (network namespaces, veth). "before" is commit 731f1e9, checked out as a git worktree
at /tmp/fcp-before (made if absent) and run with that tree's src first on PYTHONPATH; "after" is
this working tree. Results merge into control_plane.json by (model, code), so codes and models can
be run separately. Writes control_plane.json, control_plane.md and control_plane.png.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import kept_provenance, pyplot, read_metrics, results_dir, stop, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "731f1e9"
BEFORE_TREE = Path("/tmp/fcp-before")
PREFIX = "fcp-"  # namespaces and links of this benchmark (the testbed's are fusion-*)
PORT = 7000  # the coordinator's port, inside its own namespace
WORKERS = 4
RUN_FLAGS = ["--batch-size", "4", "--seq-len", "64", "--micro-batches", "4", "--seed", "0", "--warmup", "1", "--eval-batches", "4"]
RUN_TIMEOUT_S = 3600.0
HEARTBEAT_WINDOW_S = 30.0  # 4 workers x one beat per 2 s: 60 beats, so a beat more or less is under 2 %


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _sh(*cmd: str, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


class CoordinatorLink:
    """A namespace for the coordinator and the veth pair that is its only way out.

    Root end ``fcp-h<pid>`` at ``<net>.1``, namespace end ``eth0`` at ``<net>.2`` in ``fcp-c<pid>``.
    Removed on exit, on error and on Ctrl+C (only what this object made).
    """

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.netns, self.host_if = f"{PREFIX}c{tag}", f"{PREFIX}h{tag}"
        self.made_ns = self.made_link = False
        used = _sh("ip", "-4", "addr", "show") + _sh("ip", "-4", "route", "show")
        net = next((f"10.241.{i}" for i in range(os.getpid() % 200, 250) if f"10.241.{i}." not in used), None)
        if net is None:
            raise RuntimeError("no free 10.241.x.0/30 subnet for the coordinator's veth")
        self.root_addr, self.coord_addr = f"{net}.1", f"{net}.2"

    def __enter__(self) -> CoordinatorLink:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("needs root: the coordinator runs in a network namespace of its own")
        ns, host = self.netns, self.host_if
        _sh("ip", "netns", "add", ns)
        self.made_ns = True
        _sh("ip", "link", "add", host, "type", "veth", "peer", "name", f"{PREFIX}p{os.getpid()}")
        self.made_link = True
        _sh("ip", "link", "set", f"{PREFIX}p{os.getpid()}", "netns", ns)
        in_ns = ["ip", "netns", "exec", ns]
        _sh(*in_ns, "ip", "link", "set", f"{PREFIX}p{os.getpid()}", "name", "eth0")
        _sh("sysctl", "-qw", f"net.ipv6.conf.{host}.disable_ipv6=1")  # no neighbour discovery on the counters
        _sh(*in_ns, "sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=1")
        _sh("ip", "addr", "add", f"{self.root_addr}/30", "dev", host)
        _sh("ip", "link", "set", host, "up")
        _sh(*in_ns, "ip", "addr", "add", f"{self.coord_addr}/30", "dev", "eth0")
        _sh(*in_ns, "ip", "link", "set", "eth0", "up")
        _sh(*in_ns, "ip", "link", "set", "lo", "up")

    def down(self) -> None:
        if self.made_ns:
            for pid in _sh("ip", "netns", "pids", self.netns, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)  # only our coordinator lives there
            _sh("ip", "netns", "delete", self.netns, check=False)  # takes the veth pair with it
            self.made_ns = False
        if self.made_link and Path(f"/sys/class/net/{self.host_if}").exists():
            _sh("ip", "link", "delete", self.host_if, check=False)
        self.made_link = False

    def counters(self) -> tuple[int, int]:
        """(coordinator -> workers, workers -> coordinator) bytes so far, as the root end counts them."""
        stats = Path(f"/sys/class/net/{self.host_if}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


@dataclass(frozen=True)
class Scenario:
    name: str  # ak, ek, ck (idle: the heartbeat run)
    steps: int
    flags: tuple[str, ...] = ()


def _records(path: Path) -> list[dict[str, Any]]:
    return read_metrics(path, missing_ok=True).records


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "step" in r and "event" not in r]


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Sampler(threading.Thread):
    """The number of step records, then the counters, every 0.05 s: the run as a time series.

    Records first: a sample's counters were read after its records appeared, at both ends of an
    interval alike, so the bytes of the step that follows a record are never counted before it.
    """

    PERIOD_S = 0.05

    def __init__(self, link: CoordinatorLink, metrics: Path) -> None:
        super().__init__(daemon=True)
        self.link, self.metrics = link, metrics
        self.series: list[tuple[float, int, int, int]] = []  # (s since start, down, up, step records)
        self.halt = threading.Event()
        self._size, self._n = -1, 0

    def _count(self) -> int:
        with contextlib.suppress(FileNotFoundError):
            size = self.metrics.stat().st_size
            if size != self._size:  # parse again only when the file grew
                self._size, self._n = size, len(_steps(_records(self.metrics)))
        return self._n

    def run(self) -> None:
        began = time.monotonic()
        while not self.halt.is_set():
            n = self._count()
            down, up = self.link.counters()
            self.series.append((time.monotonic() - began, down, up, n))
            self.halt.wait(self.PERIOD_S)


def code_env(code: str) -> dict[str, str]:
    """The environment that makes `python -m fusionllm` run that code (checked by importing it)."""
    tree = ROOT if code == "after" else BEFORE_TREE
    if code == "before" and not (BEFORE_TREE / "src" / "fusionllm").exists():
        _sh("git", "-C", str(ROOT), "worktree", "add", "--detach", str(BEFORE_TREE), BEFORE_COMMIT)
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "FUSIONLLM_TESTBED": "off"}
    env.pop("FUSIONLLM_LOGLEVEL", None)
    where = subprocess.run([sys.executable, "-c", "import fusionllm; print(fusionllm.__file__)"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(tree / "src")):
        raise RuntimeError(f"--code {code}: python imports fusionllm from {where}, not from {tree / 'src'}")
    return env


def run_once(link: CoordinatorLink, env: dict[str, str], model: str, sc: Scenario, tmp: Path, *, idle_s: float = 0.0) -> dict[str, Any]:
    """One coordinator and four workers; the veth's bytes from before the first process to after the last.

    With ``idle_s``: the coordinator waits for a fifth worker that never comes, so the four send
    nothing but their heartbeats; everything is stopped after ``idle_s`` seconds.
    """
    run_dir = tmp / f"{model}-{sc.name}"
    run_dir.mkdir(parents=True)
    token = run_dir / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    metrics, ckpt = run_dir / "metrics.jsonl", run_dir / "ckpt"
    base = [sys.executable, "-m", "fusionllm"]
    coord_cmd = ["ip", "netns", "exec", link.netns, *base, "coordinator", "--listen", f"{link.coord_addr}:{PORT}", "--token-file", str(token),
                 "--workers", str(WORKERS + 1 if idle_s else WORKERS), "--model", model, "--steps", str(sc.steps), *RUN_FLAGS, "--metrics", str(metrics),
                 "--checkpoint-dir", str(ckpt), *sc.flags]
    procs: list[subprocess.Popen] = []
    logs = []
    sampler = Sampler(link, metrics)
    before = link.counters()
    began = time.monotonic()
    try:
        log = open(run_dir / "coordinator.log", "wb")  # noqa: SIM115 - closed in finally
        logs.append(log)
        procs.append(subprocess.Popen(coord_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, cwd=run_dir))
        sampler.start()
        for i in range(WORKERS):
            log = open(run_dir / f"worker-{i}.log", "wb")  # noqa: SIM115
            logs.append(log)
            procs.append(subprocess.Popen(
                [*base, "worker", "--join", f"{link.coord_addr}:{PORT}", "--token-file", str(token), "--rank", str(i),
                 "--listen", f"{link.root_addr}:0", "--threads", "1"],
                env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, cwd=run_dir,
            ))
        if idle_s:
            time.sleep(idle_s)
            return {"series": list(sampler.series)}
        rc = procs[0].wait(RUN_TIMEOUT_S)
        deadline = time.monotonic() + 15  # workers hear "finished" within a heartbeat or two
        for p in procs[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
    finally:
        stop(procs)
        sampler.halt.set()
        if sampler.is_alive():
            sampler.join()
        for log in logs:
            log.close()
    wall = time.monotonic() - began
    time.sleep(0.5)  # the last FIN/ACKs
    after = link.counters()
    if rc != 0:
        tail = (run_dir / "coordinator.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{model} {sc.name}: coordinator exited {rc}; logs in {run_dir}\n{tail}")
    records = _records(metrics)
    steps = _steps(records)
    if len(steps) != sc.steps:
        raise RuntimeError(f"{model} {sc.name}: {len(steps)} step records in {metrics}, expected {sc.steps}")
    ckpt_dirs = [d for d in ckpt.iterdir() if d.is_dir() and not d.name.startswith(".")] if ckpt.exists() else []
    row = {"scenario": sc.name, "steps": sc.steps, "flags": list(sc.flags), "wall_s": round(wall, 2),
           "down": after[0] - before[0], "up": after[1] - before[1],
           "evaluations": sum(1 for r in records if any(k.startswith("val") for k in r)),
           "checkpoint_dirs": len(ckpt_dirs), "checkpoint_bytes_on_disk": _du(ckpt),
           "params": None,
           "series": [(round(t, 2), d - before[0], u - before[1], n) for t, d, u, n in sampler.series]}
    first = next((p for p in records if p.get("event") == "plan"), None)
    if first is not None:  # one plan's parameters (a re-plan would repeat them)
        row["params"] = sum(s.get("params", 0) for s in first.get("stages", [])) or None
    shutil.rmtree(ckpt, ignore_errors=True)  # gpt2's checkpoints are GBs
    return row


def heartbeat_rate(link: CoordinatorLink, env: dict[str, str], tmp: Path, seconds: float = 54.0, last: float = 0.0) -> float:
    """Bytes/s through the coordinator while four joined workers wait: their heartbeats (and replies).

    The rate over the last ``last`` seconds of ``seconds`` (the workers start, load torch and join first).
    """
    last = last or HEARTBEAT_WINDOW_S
    series = run_once(link, env, "gpt-micro", Scenario("idle", 1), tmp, idle_s=seconds)["series"]
    t1, d1, u1, _ = series[-1]
    t0, d0, u0, _ = next(s for s in series if s[0] >= t1 - last)
    return ((d1 - d0) + (u1 - u0)) / (t1 - t0)


def in_run(series: list[tuple[float, int, int, int]], steps: int) -> dict[str, Any]:
    """S1 (the first sample with a step record) and Sk (the first with all ``steps``), and per step between them."""
    s1 = next((s for s in series if s[3] >= 1), None)
    sk = next((s for s in series if s[3] >= steps), None)
    if s1 is None or sk is None or sk[3] <= s1[3]:
        raise RuntimeError(f"no two samples with different step counts in {len(series)} samples (steps={steps}): "
                           "the run was too short to be sampled; more steps")
    n = sk[3] - s1[3]
    return {"s1": list(s1), "sk": list(sk), "intervals": n, "step_s": (sk[0] - s1[0]) / n,
            "per_step_down": (sk[1] - s1[1]) / n, "per_step_up": (sk[2] - s1[2]) / n}


def model_bytes(env: dict[str, str], model: str, runs: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(parameters, bytes of the float32 weights): from the plan record, else by building the model."""
    params = runs["ak"].get("params")
    if not params:
        code = ("import sys; from fusionllm.models.spec import build_model; from fusionllm.data import ByteTokenizer; "
                "m = build_model(sys.argv[1], ByteTokenizer().vocab_size, seed=0); print(sum(p.numel() for p in m.parameters()))")
        params = int(subprocess.run([sys.executable, "-c", code, model], env=env, capture_output=True, text=True, check=True).stdout.split()[-1])
    return params, params * 4


def _thin(series: list[tuple[float, int, int, int]], every_s: float = 1.0) -> list[tuple[float, int, int, int]]:
    """For the JSON: every sample where the step count changed, and one a second otherwise."""
    out: list[tuple[float, int, int, int]] = []
    for s in series:
        if not out or s[3] != out[-1][3] or s[0] >= out[-1][0] + every_s or s is series[-1]:
            out.append(s)
    return out


def measure(link: CoordinatorLink, code: str, model: str, k: int, tmp: Path, heartbeat: float) -> dict[str, Any]:
    env = code_env(code)
    scenarios = [Scenario("ak", k), Scenario("ek", k, ("--eval-every", "1")), Scenario("ck", k, ("--checkpoint-every", "1"))]
    runs, inside = {}, {}
    for sc in scenarios:
        r = runs[sc.name] = run_once(link, env, model, sc, tmp)
        i = inside[sc.name] = in_run(r["series"], k)
        r["in_run"] = {**i, "teardown_down": r["down"] - i["sk"][1], "teardown_up": r["up"] - i["sk"][2]}
        print(f"  {model} {code} {sc.name}: {r['wall_s']:.1f} s, down {r['down']:,} B, up {r['up']:,} B, "
              f"{r['evaluations']} evaluations, {r['checkpoint_dirs']} checkpoints; in run: {i['intervals']} steps of {i['step_s']:.2f} s, "
              f"{i['per_step_down']:,.0f} B down + {i['per_step_up']:,.0f} B up each", flush=True)
    if runs["ek"]["evaluations"] != k:
        raise RuntimeError(f"{model} {code} ek: {runs['ek']['evaluations']} evaluations, expected one per step ({k})")
    out: dict[str, Any] = {"model": model, "code": code, "commit": BEFORE_COMMIT if code == "before" else _sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD").strip() + "+working tree",
                           "steps_k": k, "evaluations": inside["ek"]["intervals"], "checkpoints": inside["ck"]["intervals"],
                           "method": "in-run: counters sampled with the step records, S1 = first record, Sk = k-th record"}
    for d in ("down", "up"):
        per_step = inside["ak"][f"per_step_{d}"]
        out[f"setup_{d}"] = inside["ak"]["s1"][1 if d == "down" else 2]
        out[f"per_step_{d}"] = round(per_step)
        out[f"per_eval_{d}"] = round(inside["ek"][f"per_step_{d}"] - per_step)
        out[f"per_checkpoint_{d}"] = round(inside["ck"][f"per_step_{d}"] - per_step)
        out[f"teardown_{d}"] = runs["ak"]["in_run"][f"teardown_{d}"]
    for what in ("setup", "per_step", "per_eval", "per_checkpoint", "teardown"):
        out[what] = out[f"{what}_down"] + out[f"{what}_up"]
    out["params"], out["model_bytes"] = model_bytes(env, model, runs)
    out["checkpoint_bytes_on_disk"] = runs["ck"]["checkpoint_bytes_on_disk"] // k if runs["ck"]["checkpoint_bytes_on_disk"] else None
    step_s = inside["ak"]["step_s"]
    out["step_s"] = round(step_s, 2)
    out["eval_s"] = round(inside["ek"]["step_s"] - step_s, 2)  # the extra seconds per step that evaluating took
    out["checkpoint_s"] = round(inside["ck"]["step_s"] - step_s, 2)
    out["heartbeat_Bps"], out["heartbeat_window_s"] = round(heartbeat), HEARTBEAT_WINDOW_S
    # what a step, an evaluation, a checkpoint cost beyond the heartbeats that fall in their seconds
    out["per_step_net"] = round(out["per_step"] - heartbeat * step_s)
    out["per_eval_net"] = round(out["per_eval"] - heartbeat * (inside["ek"]["step_s"] - step_s))
    out["per_checkpoint_net"] = round(out["per_checkpoint"] - heartbeat * (inside["ck"]["step_s"] - step_s))
    out["runs"] = {name: {key: v for key, v in r.items() if key != "series"} for name, r in runs.items()}
    out["series"] = {name: _thin(r["series"]) for name, r in runs.items()}
    return out


def _fmt(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{WORKERS} workers (local, one process each, --threads 1), the coordinator in its own network namespace; batch 4 x 64 tokens, "
             "4 micro-batches, seed 0. Bytes are Ethernet frames on the coordinator's veth, both directions "
             "(down: coordinator to workers, up: workers to coordinator); heartbeats included, except in per step net.", "",
             "| model | code | k | setup | per step | per step net | per evaluation | per checkpoint | model size (float32) | checkpoint on disk | step (s) | heartbeats (B/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(what: str, r: dict[str, Any] = r) -> str:
            return f"{_fmt(r[what])} ({_fmt(r[what + '_down'])} down, {_fmt(r[what + '_up'])} up)"
        lines.append(f"| {r['model']} | {r['code']} | {r['steps_k']} | {cell('setup')} | {cell('per_step')} | {_fmt(r.get('per_step_net'))} | {cell('per_eval')} | "
                     f"{cell('per_checkpoint')} | {_fmt(r['model_bytes'])} ({r['params'] / 1e6:.1f} M params) | {_fmt(r['checkpoint_bytes_on_disk'])} | "
                     f"{r['step_s']} | {r['heartbeat_Bps']} |")
    lines += ["", "Measured inside each run, not as differences of whole runs: every 0.05 s the number of step records in the metrics JSONL, "
              "then the veth's counters. S1 is the first sample that saw a step record, Sk the first that saw all k (n1, nk records). "
              "per step = (Sk - S1)/(nk - n1) in ak, a run of k steps; per evaluation = the same figure in ek (k steps, --eval-every 1) minus that of ak; "
              "per checkpoint = the same in ck (k steps, --checkpoint-every 1) minus that of ak (a record is written after its step's evaluation "
              "and before its checkpoint, so each of the nk - n1 intervals holds one step, one evaluation in ek, one checkpoint in ck); "
              "setup = S1 of ak (joining, planning, shipping the stages and the first step; the shutdown after Sk is in the JSON as teardown). "
              "Heartbeats are included in every column but per step net = per step - heartbeats x step seconds ((time of Sk - time of S1)/(nk - n1)); "
              "heartbeats: four joined workers, a coordinator waiting for a fifth, bytes/s over the last "
              "heartbeat_window_s seconds of the idle run (in the JSON). "
              "The models use the byte tokenizer (256 token ids), so gpt2 has 86 M parameters here, not 124 M."]
    nets = [f"{r['model']} {r['code']}: {_fmt(r['per_eval_net'])} per evaluation ({r['eval_s']} s), {_fmt(r['per_checkpoint_net'])} per checkpoint ({r['checkpoint_s']} s)"
            for r in rows if "per_eval_net" in r]
    if nets:
        lines += ["", "Without the heartbeats of the seconds an evaluation / a checkpoint added to a step: " + "; ".join(nets) + "."]
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    models = list(dict.fromkeys(r["model"] for r in rows))
    kinds = [("setup", "setup"), ("per_step", "per step"), ("per_eval", "per evaluation"), ("per_checkpoint", "per checkpoint"), ("model_bytes", "model size")]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        width = 0.8 / len(mine)
        for i, r in enumerate(mine):
            values = [max(1, r[key]) for key, _ in kinds]
            xs = [x + (i - (len(mine) - 1) / 2) * width for x in range(len(kinds))]
            bars = ax.bar(xs, values, width, label=f"{r['code']} ({r['commit']})")
            for bar, v in zip(bars, values, strict=True):
                ax.text(bar.get_x() + bar.get_width() / 2, v * 1.3, _fmt(v), ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_yscale("log")
        ax.set_ylim(1e2, max(r["per_eval"] for r in mine + [{"per_eval": r["model_bytes"]} for r in mine]) * 300)
        ax.set_xticks(range(len(kinds)), [label for _, label in kinds], rotation=15)
        ax.set_ylabel("bytes through the coordinator")
        ax.set_title(f"{model}, local:{WORKERS}")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", choices=["before", "after", "both"], default="both")
    ap.add_argument("--models", default="gpt-micro,gpt2")
    ap.add_argument("--steps", default="gpt-micro:30,5", help="k, steps of each run (>= 2): N, or MODEL:N,...,N (the last for the rest)")
    ap.add_argument("--out", type=Path, default=results_dir("control_plane"))
    ap.add_argument("--report-only", action="store_true", help="rewrite the table and the plot from control_plane.json; run nothing")
    args = ap.parse_args()
    steps: dict[str, int] = {}
    for part in args.steps.split(","):
        name, _, n = part.rpartition(":")
        if not n.isdigit() or int(n) < 2:
            ap.error(f"--steps {part!r}: expected N or MODEL:N with N >= 2 (per step is measured between the first and the last step record)")
        steps[name] = int(n)
    codes = ["before", "after"] if args.code == "both" else [args.code]
    path = args.out / "control_plane.json"
    if args.report_only:  # the table and the plot again, from the JSON
        doc = json.loads(path.read_text())
        write(args.out, "control_plane", doc["results"], table(doc["results"]), {**kept_provenance(doc), **{k: doc[k] for k in ("workers", "run_flags", "before_commit")}})
        plot(doc["results"], args.out / "control_plane.png")
        return 0

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    new = []
    with tempfile.TemporaryDirectory(prefix="fcp-") as tmp, CoordinatorLink() as link:
        idle0 = link.counters()
        time.sleep(2)
        idle = sum(link.counters()) - sum(idle0)
        print(f"coordinator namespace {link.netns} at {link.coord_addr}, veth {link.host_if} at {link.root_addr}; idle bytes in 2 s: {idle}", flush=True)
        heartbeat = {}
        for code in codes:
            heartbeat[code] = heartbeat_rate(link, code_env(code), Path(tmp) / code)
            print(f"  {code}: heartbeats of {WORKERS} idle workers {heartbeat[code]:.0f} B/s", flush=True)
        for model in args.models.split(","):
            for code in codes:
                new.append(measure(link, code, model, steps.get(model, steps.get("", 5)), Path(tmp) / code, heartbeat[code]))
    old = []
    if path.exists():
        old = json.loads(path.read_text()).get("results", [])
    keys = {(r["model"], r["code"]) for r in new}
    rows = [r for r in old if (r["model"], r["code"]) not in keys] + new
    rows.sort(key=lambda r: (r["model"] != "gpt-micro", r["model"], r["code"] != "before"))
    write(args.out, "control_plane", rows, table(rows), {"workers": WORKERS, "run_flags": RUN_FLAGS, "before_commit": BEFORE_COMMIT})
    plot(rows, args.out / "control_plane.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
