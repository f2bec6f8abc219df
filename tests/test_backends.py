"""Workers of different frameworks in one run: NumPy workers without torch, placed by what they run."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fusionllm.control.capabilities import place
from fusionllm.core.errors import FusionError
from fusionllm.core.metrics import read_metrics
from fusionllm.graph.ir import OpGraph
from fusionllm.models.spec import build_model
from fusionllm.npexec.executor import supported_kinds
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.schedule.plan import make_plan
from fusionllm.transport.worker_info import WorkerInfo
from tests.conftest import Started

BASE = [sys.executable, "-m", "fusionllm"]
TORCH = WorkerInfo(backend="torch", kinds="all")
NUMPY = WorkerInfo(backend="numpy", kinds=tuple(sorted(supported_kinds())))


def _graph(spec: str) -> OpGraph:
    return trace_lm(build_model(spec, 256, seed=0), 2, 16, spec=spec)


def _workers(plan) -> dict[int, int]:  # noqa: ANN001 - stage index by worker
    return {w: s.index for s in plan.stages for w in s.workers}


# ---- placement (no processes) ------------------------------------------------------------------
def test_default_gpt_plan_keeps_a_numpy_worker_in_the_middle() -> None:
    graph = _graph("gpt-micro")
    plan = make_plan(graph, 3)
    said: list[str] = []
    assert place(graph, plan, {0: TORCH, 1: NUMPY, 2: TORCH}, said.append) is plan
    assert not said


def test_a_numpy_worker_moves_to_the_stage_it_can_run() -> None:
    """tests.zoo:skip_tied: stages 0 and 1 hold ops NumPy lacks, stage 2 (the tied head) does not."""
    graph = _graph("tests.zoo:skip_tied")
    plan = make_plan(graph, 3)
    said: list[str] = []
    placed = place(graph, plan, {0: TORCH, 1: NUMPY, 2: TORCH}, said.append)
    assert _workers(placed) == {0: 0, 1: 2, 2: 1}
    assert [s.nodes for s in placed.stages] == [s.nodes for s in plan.stages]
    assert said and "stage 2 -> worker 1" in said[0]


def test_unrunnable_model_is_refused_with_the_missing_kinds() -> None:
    graph = _graph("tests.zoo:dense")  # every stage has a torch.cat and a user block
    plan = make_plan(graph, 3)
    with pytest.raises(FusionError) as err:
        place(graph, plan, {0: TORCH, 1: NUMPY, 2: TORCH})
    msg = str(err.value)
    assert "worker 1 (numpy) cannot run op kinds ['function:torch.cat', 'submodule:tests.zoo._Block']" in msg
    assert "\n" not in msg
    with pytest.raises(FusionError, match=r"no worker can run op kinds \['function:torch.cat', 'submodule:tests.zoo._Block'\]"):
        place(graph, make_plan(graph, 2), {0: NUMPY, 1: NUMPY})


@pytest.mark.slow  # a fresh Python process
def test_worker_path_of_the_numpy_backend_imports_no_torch() -> None:
    code = (
        "import sys, fusionllm.cli.main, fusionllm.runtime.worker.worker\n"
        "from fusionllm.runtime.backends.backend import load_backend\n"
        "b = load_backend('numpy'); b.matmul_flops('cpu', 0.01); b.unpack(b.pack({'x': __import__('numpy').ones(3, 'float32')}))\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, bad[:5]\n"
        "load_backend('torch'); assert 'torch' in sys.modules  # the check can fail\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_both_backends_pack_the_same_safetensors_bytes() -> None:
    import numpy as np
    import torch

    from fusionllm.runtime.backends.backend import load_backend

    arrays = {"param/w": np.arange(12, dtype=np.float32).reshape(3, 4), "adam/step/w": np.array([3.0], np.float32), "param/i": np.arange(5)}
    torch_b, numpy_b = load_backend("torch"), load_backend("numpy")
    blob = numpy_b.pack(arrays)
    assert blob == torch_b.pack({k: torch.from_numpy(v) for k, v in arrays.items()})
    assert all(np.array_equal(torch_b.unpack(blob)[k].numpy(), v) for k, v in arrays.items())
    assert all(np.array_equal(numpy_b.unpack(blob)[k], v) for k, v in arrays.items())


# ---- real processes ------------------------------------------------------------------------------
# the default learning rate and warmup: at --lr 1e-2 --warmup 2 this run is chaotic (torch float32 and
# float64 part by 12% at step 6), and any two float32 kernels diverge as much as torch does from itself
COMMON = ["--batch-size", "8", "--seed", "1", "--eval-every", "0"]


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path: Path, started: Started):
    yield
    left = started.stop(tmp_path)  # the test's own by handle, then its run directory only (the machine is shared)
    assert not left, f"processes left running: {left}"


def _train(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None, workers: int = 3) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"{name}.jsonl"
    proc = subprocess.run(
        [*BASE, "train", "--cluster", f"local:{workers}", *COMMON, "--metrics", str(out), "--run-dir", str(tmp / name), *args],
        capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})},
    )
    return proc, out


def _losses(path: Path) -> list[float]:
    return read_metrics(path).losses()


def _torch_losses(tmp: Path, *args: str) -> list[float]:
    """The all-torch reference: plain PyTorch in one process (``--single-process``), which a pipeline
    of torch workers matches to 1e-5 (tests/test_cluster.py), in one process instead of five. One
    thread: on a busy machine more only slow it down (tenfold, on two cores shared with other runs)."""
    out = tmp / "torch.jsonl"
    proc = subprocess.run([*BASE, "train", "--single-process", "--threads", "1", *COMMON, "--metrics", str(out), *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(out)


def _assert_close(a: list[float], b: list[float], tol: float = 1e-4) -> None:
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= tol * abs(y), f"step {i}: {x} vs {y}"


def _imported_torch(log: Path) -> bool:
    """Whether the process that wrote ``log`` under PYTHONPROFILEIMPORTTIME imported torch."""
    return re.search(r"^import time:.*\|\s+torch(\.|$)", log.read_text(), re.MULTILINE) is not None


@pytest.mark.slow
def test_numpy_worker_in_a_gpt_pipeline_matches_all_torch(tmp_path: Path) -> None:
    """gpt-micro, 10 steps: the middle stage in NumPy (no torch in its process) gives torch's losses."""
    with ThreadPoolExecutor(1) as pool:  # the one-thread reference beside the cluster run
        reference = pool.submit(_torch_losses, tmp_path, "--model", "gpt-micro", "--steps", "10")
        mixed, out = _train(tmp_path, "mixed", "--model", "gpt-micro", "--steps", "10", "--backends", "torch,numpy,torch",
                            env={"PYTHONPROFILEIMPORTTIME": "1"})
        torch_losses = reference.result()
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    _assert_close(_losses(out), torch_losses)
    assert re.search(r"worker 1 \(cpu, numpy [0-9.]+ @ [^)]*\): stage 1", mixed.stderr)
    assert re.search(r"worker 0 \(cpu, torch [0-9][^ ]* @ [^)]*\): stage 0", mixed.stderr)
    assert "worker 1 numpy (torch not loaded)" in mixed.stderr
    assert not _imported_torch(tmp_path / "mixed" / "worker-1.log")
    assert _imported_torch(tmp_path / "mixed" / "worker-0.log")  # the check sees torch where it is


@pytest.mark.slow
def test_numpy_worker_moves_to_a_stage_it_runs_and_shares_a_tied_weight(tmp_path: Path) -> None:
    """tests.zoo:skip_tied: the NumPy worker takes the tied head (the plan had it elsewhere), and
    the head's gradient is all-reduced between a torch and a NumPy worker."""
    args = ["--model", "tests.zoo:skip_tied", "--steps", "6", "--seq-len", "16"]
    mixed, out = _train(tmp_path, "mixed", *args, "--backends", "torch,numpy,torch")
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    assert "moved stages to workers that can run their ops" in mixed.stderr
    assert re.search(r"worker 1 \(cpu, numpy [0-9.]+ @ [^)]*\): stage 2", mixed.stderr)
    _assert_close(_losses(out), _torch_losses(tmp_path, *args))  # one tied weight there: the all-reduce must add up
    assert read_metrics(out).records[-1]["bytes"].get("w1->w0", 0) > 0  # the tied weight's reduce


@pytest.mark.slow
def test_model_a_numpy_worker_cannot_run_is_refused_before_training(tmp_path: Path) -> None:
    # two workers: the torch one could run either stage, the NumPy one neither (every stage has a torch.cat and a user block)
    proc, out = _train(tmp_path, "dense", "--model", "tests.zoo:dense", "--steps", "2", "--seq-len", "16", "--backends", "numpy,torch", workers=2)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no assignment of the 2 stages"), last
    assert "['function:torch.cat', 'submodule:tests.zoo._Block']" in last
    assert "Traceback" not in proc.stderr
    assert not out.exists() or not out.read_text().strip()


@pytest.mark.slow
def test_backends_must_name_one_framework_per_worker() -> None:
    proc = subprocess.run([*BASE, "train", "--cluster", "local:3", "--backends", "torch,numpy"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--backends 'torch,numpy': expected 3 comma-separated names" in proc.stderr.strip().splitlines()[-1]
