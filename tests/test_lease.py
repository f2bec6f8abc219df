"""One coordinator per checkpoint directory (control/lease.py).

Why it can fail: a second coordinator that starts driving the same run (and writes the same
checkpoints) while the first is alive, a refusal that is not one line naming the first, or a lock
that outlives a killed coordinator (then a crashed run could not be restarted).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionllm.control.lease import Lease
from fusionllm.core.errors import ConfigError
from tests.conftest import Started

BASE = [sys.executable, "-m", "fusionllm"]


def test_a_second_lease_on_the_same_directory_is_refused_naming_the_first_until_it_is_released(tmp_path: Path) -> None:
    first = Lease(tmp_path, address="127.0.0.1:7000").take()
    with pytest.raises(ConfigError, match=rf"another coordinator \(PID \d+ on 127.0.0.1:7000\) is running with --checkpoint-dir {tmp_path}"):
        Lease(tmp_path).take()
    Lease(tmp_path / "other").take().release()  # another directory is free
    first.release()
    Lease(tmp_path).take().release()


@pytest.mark.slow
def test_a_killed_holder_frees_the_directory_and_a_live_coordinator_refuses_a_second_one(tmp_path: Path, started: Started) -> None:
    """Real processes: a ``fusionllm coordinator`` waiting for its workers holds the directory; a
    second one for it exits at once with one line and the first is unharmed; once the first is
    killed (SIGKILL: no clean-up ran), a third one takes the directory."""
    from fusionllm.transport.auth import load_token

    token, ckpt = tmp_path / "token", tmp_path / "ckpt"
    load_token(token, create=True)
    cmd = [*BASE, "coordinator", "--listen", "127.0.0.1:0", "--token-file", str(token), "--workers", "2", "--model", "gpt-nano",
           "--steps", "2", "--checkpoint-dir", str(ckpt), "--join-timeout", "300"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    third = None
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "waiting for" not in line and time.monotonic() < deadline:
            line = first.stdout.readline() if first.stdout else ""
        assert "waiting for" in line, "the first coordinator did not start"
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        said = [x for x in (second.stdout + second.stderr).splitlines() if x.strip()]
        assert any(re.search(rf"another coordinator \(PID {first.pid} on 127.0.0.1:0\) is running with --checkpoint-dir", x) for x in said), said
        assert not any("Traceback" in x for x in said), said
        assert first.poll() is None  # the first runs on
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        third = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = ""
        deadline = time.monotonic() + 120
        while "waiting for" not in line and time.monotonic() < deadline:
            line = third.stdout.readline() if third.stdout else ""
        assert "waiting for" in line, "a coordinator could not take the directory of a killed one"
    finally:
        for p in (first, third):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert not started.stop(tmp_path)
