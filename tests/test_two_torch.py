"""Two torch versions in one pipeline: a worker from another environment (the oldest torch pyproject.toml
allows) between two of this one's. It needs that environment
(``~/.cache/fusionllm/torch-2.4.1``, 5 GB): ``make test-two-torch`` makes it and runs the test; ``make test``
leaves it out (marker ``two_torch``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fusionllm.core.metrics import read_metrics

OLD = Path.home() / ".cache" / "fusionllm" / "torch-2.4.1" / "bin" / "python"
COMMON = ["--model", "gpt-nano", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--seed", "1", "--eval-every", "0"]

pytestmark = pytest.mark.slow


def _losses(path: Path) -> list[float]:
    return read_metrics(path).losses()


@pytest.mark.two_torch  # `make test-two-torch` builds OLD, then runs it
def test_a_worker_on_torch_2_4_in_a_torch_2_13_pipeline_trains_like_one_process(tmp_path: Path) -> None:
    if not OLD.exists():
        pytest.fail(f"no second torch environment at {OLD}: `make test-two-torch` builds it")
    version = subprocess.run([str(OLD), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, timeout=120)
    if version.returncode != 0 or not version.stdout.startswith("2.4"):
        pytest.fail(f"{OLD} has no torch 2.4 ({version.stderr.strip()[-200:]}): remove it and run `make test-two-torch`")
    mixed, single = tmp_path / "mixed.jsonl", tmp_path / "single.jsonl"
    proc = subprocess.run([sys.executable, "-m", "fusionllm", "train", "--cluster", "local:3", *COMMON, "--worker-python", f"1={OLD}",
                           "--metrics", str(mixed), "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 (cpu, torch 2.4" in proc.stderr and "worker 0 (cpu, torch 2.13" in proc.stderr, proc.stderr[-3000:]
    subprocess.run([sys.executable, "-m", "fusionllm", "train", "--single-process", *COMMON, "--metrics", str(single)],
                   check=True, capture_output=True, timeout=300)
    a, b = _losses(mixed), _losses(single)
    assert len(a) == len(b) == 3
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True)), (a, b)


def test_worker_python_is_checked(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fusionllm", "train", "--cluster", "local:2", *COMMON, "--worker-python", "5=/nope",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--worker-python '5=/nope': expected I=PATH with I a worker index 0..1" in proc.stderr, proc.stderr
