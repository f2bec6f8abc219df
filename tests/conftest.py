import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# `tests.zoo:factory` model specs must import in this process and in CLI subprocesses
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("FUSIONLLM_ALLOW_IMPORTS", "tests.")
# caches go to a temporary directory of this test run (shared with the CLI subprocesses), never to the
# user's ~/.cache: calibrated op times, matplotlib's font list, anything else that honours XDG_CACHE_HOME
CACHE = tempfile.mkdtemp(prefix="fusionllm-test-cache-")
atexit.register(shutil.rmtree, CACHE, True)
os.environ["FUSIONLLM_CACHE"] = CACHE
os.environ["MPLCONFIGDIR"] = os.path.join(CACHE, "matplotlib")
os.environ["XDG_CACHE_HOME"] = CACHE

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)  # `make test` runs two pytest processes on two cores

TESTBED_TURN = Path(tempfile.gettempdir()) / "fusionllm-tests-testbed.lock"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``testbed`` go to one pytest-xdist worker (``--dist loadgroup``, `make test`):
    they take the machine's testbed one at a time, and spread over two workers one of them waited for
    the other's turn (80-96 s of a test's set-up in CI) instead of running the other tests."""
    for item in items:
        if item.get_closest_marker("testbed") is not None:
            item.add_marker(pytest.mark.xdist_group("testbed"))


@pytest.fixture(autouse=True)
def _one_testbed_at_a_time(request: pytest.FixtureRequest) -> Any:
    """A machine holds one emulated testbed at a time (a second refuses to start), and other pytest
    processes may run beside this one (`make test` runs two, pytest-xdist): a test marked
    ``testbed`` waits for its turn, an exclusive lock on a file of the machine's temporary
    directory, released when the test ends, also when its process dies. Only those: a test that
    merely mentions the testbed runs beside them."""
    if request.node.get_closest_marker("testbed") is None:
        yield
        return
    import fcntl

    with open(TESTBED_TURN, "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def counted_op_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Op times from counted FLOPs at the reference speed instead of timed on this host: a test whose
    assertion depends on which plan wins (a margin of 1.3-1.5x between candidates) then holds on a
    busy machine, where timed ops (CPU time, and more of it under load) can move that margin."""
    from fusionllm.launch import task
    from fusionllm.runtime.backends.profile import estimate

    monkeypatch.setattr(task._ModelTask, "estimate", lambda self, graph: estimate(graph, calibrate=False))


# ---- processes a test started: stopped by handle, and by its own run directory (never by name) -----
class Started(list):
    """The processes a test started (``subprocess.run`` and ``Popen`` alike), by handle."""

    def stop(self, root: Path) -> list[str]:
        """Kill what the test left running: its own processes by handle (with their group if they
        lead one), then the processes of every local cluster run under ``root``, the test's own
        directory, as their ``pids.json`` lists them (the ``train`` that ran it, unless that was this
        process, and the coordinator and workers it started). Returns what was running."""
        from fusionllm.launch.local_cluster import PIDS_FILE, read_pids

        left = []
        for p in self:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2)  # one the test killed a moment ago (a failing test's ``finally``) is not left running
            if p.poll() is None:
                left.append(f"{p.pid} {' '.join(map(str, p.args)) if isinstance(p.args, list) else p.args}")
                with contextlib.suppress(ProcessLookupError):
                    if p.own_group:
                        os.killpg(p.pid, signal.SIGKILL)  # and the workers it started
                    else:
                        p.kill()
                p.wait()
        for path in root.rglob(PIDS_FILE) if root.is_dir() else []:
            pids = read_pids(path.parent)
            for pid in pids.running(launcher=True) if pids else []:
                if pid == os.getpid():
                    continue  # a test that ran the local cluster in this process
                left.append(f"{pid} (listed in {path})")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return left


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    """Records every process the test starts; ``started.stop(run_dir)`` at teardown ends the leftovers."""
    handles = Started()

    class Recorded(subprocess.Popen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.own_group = bool(kwargs.get("start_new_session") or kwargs.get("process_group") == 0)
            handles.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return handles


def hang_in_checkpoint(worker: Any) -> list[bool]:
    """Make an in-process worker hang as a stopped process would once a checkpoint asks it for its
    shard: the SaveShard never answers and its calls to the coordinator (heartbeats) never return.
    Returns a flag list whose first item turns True when it hung."""
    import asyncio

    frozen, hung = asyncio.Event(), [False]  # never set
    real_call = worker.coordinator.call

    async def call(method: str, msg: dict, **kw: object) -> dict:
        if hung[0]:
            await frozen.wait()
        return await real_call(method, msg, **kw)

    async def save_shard(*_: object) -> dict:
        hung[0] = True
        await frozen.wait()
        return {}

    worker.coordinator.call = call
    worker._save_shard = save_shard
    return hung


def hang_in_outer_check(worker: Any) -> list[bool]:
    """As ``hang_in_checkpoint``, from the first OuterCheck on: that call and every later one it is
    asked (its steps too) never answer, and neither do its heartbeats."""
    import asyncio

    frozen, hung = asyncio.Event(), [False]  # never set
    real_call, real_once = worker.coordinator.call, worker._once

    async def call(method: str, msg: dict, **kw: object) -> dict:
        if hung[0]:
            await frozen.wait()
        return await real_call(method, msg, **kw)

    async def once(method: str, key: object, work: object) -> dict:
        if method == "OuterCheck" or hung[0]:
            hung[0] = True
            await frozen.wait()
        return await real_once(method, key, work)

    worker.coordinator.call, worker._once = call, once
    return hung


def two_site_cluster(path: Path) -> Path:
    """A cluster file of two sites of two CPUs each (20 and 10 TFLOP/s devices) behind 20 Mbit/s, written to ``path``."""
    path.write_text('name = "two"\n[sites.a]\ndevices = 2\ncpus = 1\ndevice_flops = "20tflops"\nbandwidth = "10gbit"\n'
                    '[sites.b]\ndevices = 2\ncpus = 1\ndevice_flops = "10tflops"\nbandwidth = "10gbit"\n'
                    '[[links]]\nsites = ["a", "b"]\nbandwidth = "20mbit"\n')
    return path


def assert_group_eviction(m: Any, steps: int = 16) -> None:
    """What a hierarchical run with groups 0,1,2 / 3 writes when worker 1 sends a NaN at data step 4
    and garbage at 10 (group 0 of 2 reads batches 0, 2, 4, ...: its inner steps 2 and 5): the
    synchronous run's retry, skip and eviction, all in group 0 and naming worker 1; workers 0 and 2
    form a new group; group 1 trains every step; every group's record has ``rss``."""
    import math

    bad = m.of("bad_step")
    assert [(e["step"], e["attempt"], e["action"], e["group"]) for e in bad] == [(4, 0, "retry", 0), (4, 1, "skip", 0), (10, 0, "evict", 0)]
    assert all(e["suspects"] == [1] for e in bad), bad  # never the workers that only received or forwarded it
    (evicted,) = m.of("evict")
    assert evicted["workers"] == [1] and evicted["group"] == 0
    (joined,) = m.of("group_joined")
    assert sorted(joined["workers"]) == [0, 2]
    assert [r["inner_step"] for r in m.steps if r["group"] == 0] == [0, 1, 3, 4]  # inner step 2 skipped; 5 evicted its worker
    assert len([r for r in m.steps if r["group"] == 1]) == steps  # the other group trained every step
    assert [r for r in m.steps if r["group"] == joined["group"]]  # the new group trained too
    assert all(math.isfinite(r["loss"]) and "rss" in r for r in m.steps)



# ---- waiting for processes: on what they say or write, never on a sleep long enough on a quiet machine ----
def coordinator_port(out: IO[str] | None, seen: list[str] | None = None, *, drain: bool = False) -> int:
    """The port a ``fusionllm coordinator --listen HOST:0`` says it listens on, read from ``out``
    (its stderr piped as text, or its stdout with stderr joined): it says it once it listens, so
    workers started after it find it. ``seen`` collects the lines read; ``drain``: a thread reads
    the rest (a full pipe would stall the coordinator)."""
    import re
    import threading

    lines = [] if seen is None else seen
    assert out is not None, "pipe the coordinator's output (text=True)"
    for line in out:
        lines.append(line)
        if m := re.search(r"coordinator on [\d.]+:(\d+)", line):
            if drain:
                threading.Thread(target=out.read, daemon=True).start()
            return int(m.group(1))
    raise AssertionError(f"the coordinator ended without saying its port: {''.join(lines)[-3000:]}")


def eventually(what: str, ready: Any, timeout: float = 120.0, every: float = 0.1) -> None:
    """Wait until ``ready()`` holds, at most ``timeout`` seconds (a bound for a hung run, never the
    expected time); fails naming ``what``."""
    import time

    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(every)


