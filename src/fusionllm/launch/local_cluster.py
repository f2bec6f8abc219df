"""`--cluster local:N`: a coordinator and N ordinary `fusionllm worker` processes on loopback.

Every child is started so that it dies with this process (Linux parent-death signal), is stopped
on error and Ctrl+C (SIGTERM, then SIGKILL), and is waited for: no process is left behind. The
children run in sessions of their own, so a terminal's Ctrl+C reaches only this process: it passes
one SIGINT on to the coordinator, which ends the step in flight and writes its final checkpoint
(bounded by ``stop_timeout``), and then stops them all.

Its caller learns the children's PIDs from ``<run_dir>/pids.json`` (``PIDS_FILE``), rewritten
atomically as each process starts and once more when all are stopped::

    {"launcher": 4100, "coordinator": 4101, "workers": {"0": 4102, "1": 4103},
     "start_ticks": {"4100": 881234, "4101": 881240, ...}, "stopped": false}

``launcher`` is the process running the cluster (``fusionllm train``); ``start_ticks`` is each
process's start time (``/proc/<pid>/stat``), so a reader never takes a PID the system has since
given to another process for one of ours. The coordinator's relay, if any, runs inside the
coordinator. Tests and benchmarks read the file with ``read_pids`` and signal those PIDs, never
processes found by their command line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fusionllm.core.errors import ConfigError
from fusionllm.transport.auth import load_token


def parse_cluster(spec: str) -> int:
    kind, _, count = spec.partition(":")
    if kind != "local" or not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--cluster {spec!r}: expected local:N with N >= 1 (for other machines, run `fusionllm coordinator` and `fusionllm worker`)")
    return int(count)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PIDS_FILE = "pids.json"
PORT_FILE = "coordinator.port"  # the port the coordinator listens on, written by it once it serves


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if no such process is running."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # a zombie has exited already


class _PidsWriter:
    """``<run_dir>/pids.json``, rewritten (write, then rename) each time the cluster starts a process."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / PIDS_FILE
        self.doc: dict = {"launcher": os.getpid(), "coordinator": None, "workers": {}, "start_ticks": {}, "stopped": False}
        self._ticks(os.getpid())
        self._write()

    def started(self, pid: int, worker: int | None = None) -> None:
        if worker is None:
            self.doc["coordinator"] = pid
        else:
            self.doc["workers"][str(worker)] = pid
        self._ticks(pid)
        self._write()

    def stopped(self) -> None:
        self.doc["stopped"] = True
        self._write()

    def _ticks(self, pid: int) -> None:
        ticks = start_ticks(pid)
        if ticks is not None:
            self.doc["start_ticks"][str(pid)] = ticks

    def _write(self) -> None:
        part = self.path.with_name(f".{PIDS_FILE}.part")
        part.write_text(json.dumps(self.doc))
        part.replace(self.path)


@dataclass(frozen=True)
class ClusterPids:
    """The processes a local cluster started, as its ``pids.json`` lists them."""

    launcher: int
    coordinator: int | None
    workers: dict[int, int] = field(default_factory=dict)  # rank -> PID
    start_ticks: dict[int, int] = field(default_factory=dict)  # PID -> start time
    stopped: bool = False  # every child was stopped and waited for

    def all(self) -> list[int]:
        """The coordinator and the workers (not the launcher), in that order."""
        return [*([self.coordinator] if self.coordinator is not None else []), *(self.workers[r] for r in sorted(self.workers))]

    def running(self, *, launcher: bool = False) -> list[int]:
        """Those of ``all()`` (and the launcher, if asked) still running as the process that was
        started (the same start time)."""
        pids = [*([self.launcher] if launcher else []), *self.all()]
        return [pid for pid in pids if pid in self.start_ticks and start_ticks(pid) == self.start_ticks[pid]]


def read_pids(run_dir: Path) -> ClusterPids | None:
    """The PIDs a local cluster started with ``run_dir``, or None before it wrote any."""
    try:
        doc = json.loads((Path(run_dir) / PIDS_FILE).read_text())
    except FileNotFoundError:
        return None
    return ClusterPids(
        launcher=int(doc["launcher"]), coordinator=doc["coordinator"], workers={int(k): int(v) for k, v in doc["workers"].items()},
        start_ticks={int(k): int(v) for k, v in doc["start_ticks"].items()}, stopped=bool(doc["stopped"]),
    )


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_local_cluster(
    coordinator_args: list[str],
    workers: int,
    run_dir: Path,
    *,
    threads: int | None = None,
    worker_args: list[list[str]] | None = None,
    host: str = "127.0.0.1",
    worker_prefixes: list[list[str]] | None = None,
    stop_timeout: float = 60.0,
    worker_pythons: dict[int, str] | None = None,
) -> int:
    """Start, run and stop a local cluster; returns the coordinator's exit status.

    ``worker_prefixes`` wrap each worker's command (the testbed runs it in a network namespace and a
    CPU cgroup); ``worker_args`` add flags per worker (its --listen address, --threads, --device);
    ``worker_pythons`` run worker i under another interpreter (another environment, e.g. another torch).
    The PIDs of the processes started are in ``run_dir / PIDS_FILE`` (``read_pids``) as they start.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    token_file = run_dir / "token"
    load_token(token_file, create=True)
    port = 0 if host == "127.0.0.1" else 7000  # 0: the coordinator takes a free port and writes it to PORT_FILE (no race for it)
    port_file = run_dir / PORT_FILE
    port_file.unlink(missing_ok=True)
    base = [sys.executable, "-m", "fusionllm"]
    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    procs: list[subprocess.Popen] = []
    logs = []
    pids = _PidsWriter(run_dir)
    try:
        coord = subprocess.Popen(
            [*base, "coordinator", "--listen", f"{host}:{port}", "--token-file", str(token_file), "--workers", str(workers),
             "--port-file", str(port_file), *coordinator_args],
            preexec_fn=_die_with_parent, start_new_session=True,
        )
        procs.append(coord)
        pids.started(coord.pid)
        port = _wait_for_port(port_file, coord)
        if port is None:  # it ended before listening (a bad option, a taken port): its error is on the terminal
            return coord.wait()
        for i in range(workers):
            log = open(run_dir / f"worker-{i}.log", "wb")  # noqa: SIM115 - closed in finally
            logs.append(log)
            extra = worker_args[i] if worker_args else ["--threads", str(threads)]
            prefix = worker_prefixes[i] if worker_prefixes else []
            python = (worker_pythons or {}).get(i)
            procs.append(subprocess.Popen(
                [*prefix, *([python, "-m", "fusionllm"] if python else base), "worker", "--join", f"{host}:{port}", "--token-file", str(token_file), "--rank", str(i), *extra],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, start_new_session=True,
            ))
            pids.started(procs[-1].pid, worker=i)
        rc = coord.wait()
        deadline = time.monotonic() + 8  # workers hear "finished" within one heartbeat (2 s)
        for p in procs[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        if rc != 0:
            _show_worker_errors(run_dir, workers)
        return rc
    except KeyboardInterrupt:
        if procs and procs[0].poll() is None:  # the coordinator ends the step in flight and writes its final checkpoint
            print(f"interrupted: the coordinator stops after the step in flight (at most {stop_timeout:.0f} s; Ctrl+C again stops at once)",
                  file=sys.stderr)
            procs[0].send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[0].wait(stop_timeout + 10)
        print("interrupted: stopping the local cluster", file=sys.stderr)
        return 130
    finally:
        # a second Ctrl+C (or SIGTERM) must not cut the clean-up short: children would be left behind
        # (only the main thread may set handlers: a script that runs the cluster from another thread cannot be interrupted anyway)
        main = threading.current_thread() is threading.main_thread()
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            stop_processes(procs)
            pids.stopped()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        for log in logs:
            log.close()


def _wait_for_port(path: Path, coord: subprocess.Popen) -> int | None:
    """The port the coordinator listens on, once it wrote it; None if it exited first."""
    while True:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
        if coord.poll() is not None:
            return None
        time.sleep(0.05)


def stop_processes(procs: list[subprocess.Popen], grace: float = 5.0, *, resume: bool = False) -> None:
    """Stop processes the caller started, by handle: SIGTERM, ``grace`` seconds, SIGKILL, and wait for
    each. ``resume`` first continues any that were stopped (SIGSTOP), so SIGTERM lands."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if resume:
                    p.send_signal(signal.SIGCONT)
                p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _show_worker_errors(run_dir: Path, workers: int) -> None:
    for i in range(workers):
        lines = (run_dir / f"worker-{i}.log").read_text(errors="replace").splitlines()
        bad = [line for line in lines if "error" in line.lower()]
        if bad:
            print(f"worker {i} ({run_dir / f'worker-{i}.log'}): {bad[-1]}", file=sys.stderr)
