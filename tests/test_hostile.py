"""Hostile input against a running cluster: random bytes and unauthenticated calls to every port.

The cluster refuses them, keeps serving, and the run's losses equal those of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fusionllm.core.metrics import read_metrics
from fusionllm.launch.local_cluster import read_pids
from fusionllm.transport.messages import pack
from tests.conftest import coordinator_port

pytestmark = pytest.mark.slow  # real processes

BASE = [sys.executable, "-m", "fusionllm"]
# 24 steps: the attack (well under a second) ends within the first few, and the run goes on after it
RUN = ["--model", "gpt-micro", "--steps", "24", "--batch-size", "8", "--seq-len", "64", "--eval-every", "0", "--seed", "5"]
METHODS = ["/fusionllm.Worker/Step", "/fusionllm.Worker/Evaluate", "/fusionllm.Worker/SaveShard", "/fusionllm.Worker/GetState", "/fusionllm.Worker/Shutdown", "/fusionllm.Worker/Abort",
           "/fusionllm.Coordinator/Register", "/fusionllm.Coordinator/Heartbeat", "/no.Such/Method"]


def _listening(pids: list[int]) -> list[int]:
    out = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True).stdout
    return sorted({int(m.group(1)) for line in out.splitlines() for pid in pids if f"pid={pid}," in line
                   for m in [re.search(r"127\.0\.0\.1\]?:(\d+)", line)] if m})


def _raw(port: int, rng: random.Random) -> None:
    """Random bytes, a truncated HTTP/2 preface, a huge declared length: then hang up."""
    for payload in (rng.randbytes(rng.randint(1, 5000)), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(64),
                    (2**31).to_bytes(4, "little") + rng.randbytes(100), b""):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(0.3)
                with contextlib.suppress(OSError):
                    s.recv(100)
        except OSError:
            pass


async def _calls(port: int, rng: random.Random) -> list[str]:
    """Unauthenticated and wrong-token gRPC calls with random bodies: every one must be refused."""
    codes = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        for method in METHODS:
            for meta in ((), (("x-fusionllm-token", "guess"), ("x-fusionllm-protocol", "1"))):
                body = rng.choice([rng.randbytes(rng.randint(0, 300)), pack({"step": 10**12, "worker": -1, "sq": 1e300, "address": "1.2.3.4:5"})])
                try:
                    await chan.unary_unary(method)(body, metadata=meta, timeout=3)
                    codes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code().name)
    return codes


def test_random_bytes_and_outsiders_do_not_disturb_a_running_cluster(tmp_path: Path) -> None:
    ref, ref_log = tmp_path / "ref.jsonl", tmp_path / "ref.log"
    # the undisturbed run beside the attacked one (each alone keeps about one of the two cores busy); the
    # attack only aims at the other's ports (its coordinator's, and its workers' by their run directory)
    with ref_log.open("w") as log:
        clean = subprocess.Popen([*BASE, "train", "--cluster", "local:3", *RUN, "--collectives", "off", "--metrics", str(ref), "--run-dir", str(tmp_path / "ref")],
                                 stdout=log, stderr=subprocess.STDOUT)

    out, run_dir = tmp_path / "m.jsonl", tmp_path / "run"
    # --collectives off: every port the workers listen on is then fusionllm's own (gloo's ports, which a
    # torch.distributed world opens, do not authenticate: docs/runtime.md "Which tensors go where")
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:3", *RUN, "--collectives", "off", "--metrics", str(out), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = random.Random(7)
    codes: list[str] = []
    try:
        coord_port = coordinator_port(proc.stdout)
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        pids = read_pids(run_dir)
        workers = list(pids.workers.values()) if pids else []
        ports = _listening(workers)
        assert len(workers) == 3 and len(ports) >= 6  # a control port and a data port each
        for port in [coord_port, *ports]:
            _raw(port, rng)
            codes += asyncio.run(_calls(port, rng))
        # (the run may have ended meanwhile on a busy machine: what counts is that it ended well, with the clean run's losses)
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            clean.wait(timeout=600)
        if clean.poll() is None:
            clean.kill()
    assert clean.returncode == 0, ref_log.read_text()[-2000:]
    assert proc.returncode == 0, text[-3000:]
    assert "OK" not in codes and set(codes) <= {"UNAUTHENTICATED", "UNIMPLEMENTED", "UNAVAILABLE", "INTERNAL", "UNKNOWN"}, set(codes)
    assert read_metrics(out).losses() == read_metrics(ref).losses()  # the run went on exactly as without the attack
    assert os.path.exists(run_dir / "token")
