"""The live dashboard of a running local:3 training, in headless Chromium: every worker is on the page,
and the page updates. The screenshot is kept in tests/artifacts/ (and the DOM next to it)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fusionllm.control.dashboard import parse_address
from fusionllm.core.errors import ConfigError

BASE = [sys.executable, "-m", "fusionllm"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chromium(url: str, profile: Path, *what: str) -> str:
    proc = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=1000,1300", "--virtual-time-budget=4000", *what, url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _shown_step(dom: str) -> int:
    m = re.search(r"step (\d+) of 2000", dom)
    assert m, dom[:2000]
    return int(m.group(1))


@pytest.mark.slow  # real processes and a browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian chromium package (apt-get install chromium)")
def test_the_dashboard_shows_every_worker_and_updates(tmp_path: Path) -> None:
    port = _free_port()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:3", "--model", "gpt-micro", "--steps", "2000", "--batch-size", "8", "--seq-len", "64",
                             "--eval-every", "10", "--dashboard", f"127.0.0.1:{port}", "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        status: dict = {}
        while time.monotonic() < deadline and len(status.get("records", [])) < 12:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(OSError):
                status = json.loads(urllib.request.urlopen(url + "api/status", timeout=5).read())
            time.sleep(0.3)
        assert len(status["workers"]) == 3 and status["state"] == "running"
        first_dom = _chromium(url, tmp_path / "profile1", "--dump-dom")
        deadline = time.monotonic() + 120
        while status["records"][-1]["step"] + 1 <= _shown_step(first_dom):  # until a step after the one first shown is done
            assert time.monotonic() < deadline and proc.poll() is None, "training stopped making steps"
            time.sleep(0.1)
            with contextlib.suppress(OSError):
                status = json.loads(urllib.request.urlopen(url + "api/status", timeout=5).read())
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        _chromium(url, tmp_path / "profile2", f"--screenshot={shot}")
        second_dom = _chromium(url, tmp_path / "profile3", "--dump-dom")
        (ARTIFACTS / "dashboard.html").write_text(second_dom)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for w in ("0", "1", "2"):
        assert f'data-worker="{w}"' in second_dom  # each worker is drawn on the cluster map
        assert status["workers"][w]["address"] in json.dumps(status)
    assert sorted(re.findall(r'<td class="worker">(w\d)</td>', second_dom)) == ["w0", "w1", "w2"]  # each has its stage in the plan table
    assert _shown_step(second_dom) > _shown_step(first_dom)  # the page updates as training goes on
    assert shot.stat().st_size > 20_000  # a real picture, not an empty page


def test_dashboard_address_errors_are_one_clear_line() -> None:
    assert parse_address("127.0.0.1:8080") == ("127.0.0.1", 8080)
    for bad in ("8080", "host:", "host:http", ":80"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_address(bad)
