"""The Python API (``fusionllm.train``, ``plan``, ``Cluster``, ``Run``): docs/python.md's example runs as
written, options are checked before anything starts, and a run interrupted or failed leaves no process."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import fusionllm
from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import Metrics, read_metrics
from fusionllm.launch.api import TRAIN_DEFAULTS, resolve_options
from fusionllm.launch.local_cluster import read_pids
from tests.test_tasks import two_input_task

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    """A child Python that imports this checkout's fusionllm and the tests' task factories."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _doc_code() -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "python.md").read_text(), re.S))


def test_the_documented_example_runs_and_equals_one_process(tmp_path: Path) -> None:
    """Every Python block of docs/python.md, in order, as one script in a fresh directory: the
    distributed run's validation loss equals the single process's (the script asserts it), the
    cluster files it names are read, and the documented output is what it prints."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    proc = subprocess.run([sys.executable, "-c", _doc_code()], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shown = re.search(r"What it prints.*?```\n(.*?)```", (ROOT / "docs" / "python.md").read_text(), re.S)
    assert shown is not None
    for line in shown.group(1).splitlines():
        assert line in proc.stdout, f"docs/python.md shows {line!r}, the example printed:\n{proc.stdout[-3000:]}"
    run_dir = tmp_path / "runs" / "python-example"
    assert (run_dir / "config.toml").is_file() and (run_dir / "metrics.jsonl").is_file()
    pids = read_pids(run_dir)
    assert pids is not None and pids.stopped and pids.running() == []


def test_a_factory_on_workers_equals_its_task_object_in_one_process(tmp_path: Path) -> None:
    """``task=`` the factory function (workers import it by name) against ``task=`` the Task object
    (this process): the same losses, validation losses and accuracies; the Run answers from records."""
    before = signal.getsignal(signal.SIGINT)
    opts = {"steps": 4, "batch_size": 8, "micro_batches": 2, "eval_every": 2, "eval_batches": 2}
    dist = fusionllm.train(task=two_input_task, cluster="local:2", run_dir=tmp_path / "run", **opts)
    one = fusionllm.train(task=two_input_task(), **opts)
    np.testing.assert_allclose(dist.losses, one.losses, rtol=1e-5)
    np.testing.assert_allclose([v for _, v in dist.val_losses], [v for _, v in one.val_losses], rtol=1e-5)
    assert [s for s, _ in dist.val_metrics] == [s for s, _ in one.val_metrics] == [1, 3]
    assert dist.metric_name == one.metric_name == "accuracy"
    assert dist.metric == pytest.approx(one.metric, abs=1e-6)
    assert dist.plan is not None and len(dist.plan["stages"]) == 2 and one.plan is None
    assert dist.options["task"] == "tests.test_tasks:two_input_task"
    assert one.model == "TwoInputs" and one.module is not None
    assert dist.run_dir == tmp_path / "run" and read_metrics(tmp_path / "run" / "metrics.jsonl").records == dist.records
    assert signal.getsignal(signal.SIGINT) == before  # no handler left behind


def test_the_api_takes_the_commands_options_with_the_same_defaults() -> None:
    """TRAIN_DEFAULTS and `fusionllm train`'s parameters cannot drift apart."""
    from fusionllm.cli.train import train as cli_train

    cli = {n: p.default for n, p in inspect.signature(cli_train).parameters.items() if n not in ("ctx", "config_file", "print_config")}
    assert cli == TRAIN_DEFAULTS


@pytest.mark.parametrize(("options", "message"), [
    ({"batchsize": 8}, "unknown option 'batchsize': did you mean batch_size"),
    ({"stepz": 8}, "unknown option 'stepz'"),
    ({"steps": "10"}, "steps='10': expected int"),
    ({"lr": True}, "lr=True: expected int or float"),
    ({"resume": 1}, "resume=1: expected bool"),
])
def test_a_bad_option_is_one_error_naming_it_before_anything_starts(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        fusionllm.train(cluster="local:2", **options)


def test_a_config_file_gives_options_that_keywords_override(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 7\nmodel = "gpt-nano"\n\n[cluster]\nrun-dir = "runs/x"\n')
    values = resolve_options(path, {"steps": 9}).values()
    assert values["steps"] == 9 and values["model"] == "gpt-nano" and values["run_dir"] == Path("runs/x")
    path.write_text("[train]\nstep = 7\n")
    with pytest.raises(ConfigError, match=r"\[train\] has no key 'step'"):
        resolve_options(path, {})


def test_what_cannot_reach_a_worker_process_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a Task object trains in this process only"):
        fusionllm.train(task=two_input_task(), cluster="local:2", run_dir=tmp_path)

    def local_factory() -> None: ...

    with pytest.raises(ConfigError, match="worker processes cannot import it"):
        fusionllm.train(task=local_factory, cluster="local:2", run_dir=tmp_path)
    with pytest.raises(ConfigError, match="choose one"):
        fusionllm.train(cluster="local:2", single_process=True, run_dir=tmp_path)
    assert not (tmp_path / "run.json").exists()


def test_a_cluster_from_text_is_written_into_the_run_directory(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "clusters" / "two-sites.toml").read_text()
    cluster = fusionllm.Cluster.from_toml(text)
    assert cluster.num_devices == fusionllm.Cluster.from_file(ROOT / "examples" / "clusters" / "two-sites.toml").num_devices
    path = cluster.file_in(tmp_path)
    assert path.read_text() == text and path.parent == tmp_path.resolve()
    with pytest.raises(ConfigError, match="not valid TOML"):
        fusionllm.Cluster.from_toml("[sites")


def test_run_reads_evaluations_of_steps_and_of_groups() -> None:
    records = [{"event": "plan", "stages": []}, {"step": 0, "loss": 3.0, "tokens": 10}, {"step": 1, "loss": 2.0, "tokens": 20, "val_loss": 2.5},
               {"event": "eval", "step": 4, "val_loss": 2.2, "val_accuracy": 0.5}, {"event": "recovery", "step": 4}]
    run = fusionllm.Run(Metrics.from_records(records), model="m")
    assert run.losses == [3.0, 2.0] and run.tokens == 20 and run.val_losses == [(1, 2.5), (4, 2.2)]
    assert run.val_loss == 2.2 and run.metric_name == "accuracy" and run.metric == 0.5 and run.val_metrics == [(4, 0.5)]
    assert [e["event"] for e in run.events] == ["eval", "recovery"] and run.plan == {"event": "plan", "stages": []}


INTERRUPTED = textwrap.dedent("""
    import signal, sys
    import fusionllm
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job starts with SIGINT ignored)
    try:
        fusionllm.train(model="gpt-nano", cluster="local:2", steps=100000, batch_size=4, seq_len=32, micro_batches=2,
                        eval_every=0, run_dir=sys.argv[1])
    except KeyboardInterrupt:
        print("KeyboardInterrupt raised", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
""")


def test_an_interrupted_run_stops_every_process_and_raises_keyboard_interrupt(tmp_path: Path) -> None:
    """Ctrl+C in a script (SIGINT once the run trains): KeyboardInterrupt reaches the script after the
    coordinator and both workers are stopped, and the script's handlers are as they were."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(run_dir)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(run_dir / "metrics.jsonl", missing_ok=True).steps:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt raised True True" in out, out[-3000:]
    pids = read_pids(run_dir)
    assert pids is not None and pids.stopped and len(pids.all()) == 3 and pids.running() == []


def test_a_failed_run_raises_run_failed_after_stopping_its_processes(tmp_path: Path) -> None:
    with pytest.raises(fusionllm.RunFailed) as failed:
        fusionllm.train(model="no_such_module:factory", cluster="local:2", steps=2, run_dir=tmp_path)
    assert failed.value.status != 0
    pids = read_pids(tmp_path)
    assert pids is not None and pids.stopped and pids.running() == []
    assert json.loads((tmp_path / "run.json").read_text())  # what it ran with is kept
