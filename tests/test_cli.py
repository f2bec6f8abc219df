"""The `fusionllm` command as a user runs it: real subprocesses, exit codes, one-line errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from fusionllm.core.metrics import read_metrics

pytestmark = pytest.mark.slow  # every test starts the `fusionllm` command


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusionllm", *args], capture_output=True, text=True, timeout=timeout)


def test_verify_builtin_model_passes() -> None:
    proc = run("verify", "--model", "gpt-mini", "--parts", "4", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("max_rel_err=")
    assert float(last.split("=")[1]) <= 1e-5


@pytest.mark.parametrize("task", ["vision", "tests.test_tasks:two_input_task"])
def test_verify_a_task(task: str) -> None:
    """`--task`: the built-in vision task (ResNet-18 in training mode) and a user's task by import path."""
    proc = run("verify", "--task", task, "--parts", "3", "--seed", "1", "--batch-size", "2", "--image-size", "16")
    assert proc.returncode == 0, proc.stderr
    assert "buffer" in proc.stdout or task != "vision"  # BatchNorm's running statistics are compared too
    assert float(proc.stdout.strip().splitlines()[-1].split("=")[1]) <= 1e-5


def test_unknown_task_is_one_clear_line() -> None:
    bad = run("verify", "--task", "nope")
    assert bad.returncode != 0 and "unknown task 'nope'" in bad.stderr and len(bad.stderr.strip().splitlines()) <= 2


@pytest.mark.parametrize("spec", ["tests.zoo:dense", "tests.zoo:skip_tied"])
def test_verify_model_defined_outside_the_package(spec: str) -> None:
    proc = run("verify", "--model", spec, "--parts", "4", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1].split("=")[1]) <= 1e-5


def test_bad_model_spec_is_one_clear_line() -> None:
    proc = run("verify", "--model", "no_such_module:factory")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: cannot import 'no_such_module'")
    assert "Traceback" not in proc.stderr


def test_train_single_process_writes_metrics_and_loss_falls(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = run(
        "train", "--single-process", "--model", "gpt-nano", "--steps", "20", "--batch-size", "8",
        "--seq-len", "32", "--lr", "1e-2", "--warmup", "5", "--eval-every", "10", "--metrics", str(metrics),
    )
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(metrics).steps
    assert [r["step"] for r in records] == list(range(20))
    assert all({"step", "loss", "tokens", "elapsed_s"} <= r.keys() for r in records)
    assert records[-1]["tokens"] == 20 * 8 * 32
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)  # 5.18 -> 3.33 in 20 steps (as in 40)
    assert "val_loss" in records[9] and "val_loss" in records[19]
    assert "final_loss=" in proc.stdout


def test_train_bad_corpus_path_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here.txt"
    proc = run("train", "--single-process", "--model", "gpt-nano", "--steps", "2", "--data", str(missing))
    assert proc.returncode == 2
    assert str(missing) in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


def test_train_without_single_process_says_what_to_do() -> None:
    proc = run("train", "--model", "gpt-nano", "--steps", "1")
    assert proc.returncode == 2 and "--single-process" in proc.stderr


def test_trace_writes_the_opgraph(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    proc = run("trace", "--model", "gpt2-xl", "--seq-len", "1024", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "module:fusionllm.models.gpt.Block" in proc.stdout
    from fusionllm.graph.ir import OpGraph

    graph = OpGraph.from_json(out.read_text())
    assert graph.num_params() > 1.4e9


def test_plan_json_counts_candidates_and_is_repeatable(tmp_path: Path) -> None:
    """`plan --json` on a random cluster file: the candidates OP-Fence judged (bounded by
    --plan-candidates), and the same plan twice."""
    import json

    from fusionllm.cli.main import DEFAULT_PLAN_CANDIDATES
    from fusionllm.cluster.random import ClusterShape, random_cluster_toml
    from fusionllm.planning.schedulers import DEFAULT_CANDIDATES

    assert DEFAULT_PLAN_CANDIDATES == DEFAULT_CANDIDATES
    cluster = tmp_path / "c.toml"
    cluster.write_text(random_cluster_toml(21, ClusterShape(devices=(6, 12))))
    # two processes, side by side (each plans on one core)
    procs = [subprocess.Popen([sys.executable, "-m", "fusionllm", "plan", "--cluster", str(cluster), "--model", "gpt-nano", "--seq-len", "64",
                               "--plan-candidates", "3", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr
        outs.append(json.loads(stdout))
    first, second = outs
    assert 1 <= first["candidates"]["judged"] <= 3 <= first["candidates"]["ranked"]
    assert first["plan"]["stages"] == second["plan"]["stages"] and first["micro_batches"] == second["micro_batches"]
