"""One RunConfig builder for `fusionllm train` and `fusionllm coordinator` (launch/config.py).

These checks fail if the two commands drift apart again: a default that differs between them, the
coordinator's evaluation settings taken from somewhere else than the TrainConfig, or a run that
does not come back from ``run.json`` as it was written.
"""

import inspect
from pathlib import Path
from typing import Any

import pytest

from fusionllm.cli.run import coordinator
from fusionllm.cli.train import train
from fusionllm.control.config import RunConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.options import Options
from fusionllm.launch.config import (
    cluster_config,
    load_run,
    parse_groups,
    parse_replicas,
    train_config,
)


def _cluster(options: Options, train: Any) -> Any:
    return cluster_config(options, train, listen="127.0.0.1:0", token="-", workers=1)


def test_train_and_coordinator_have_the_same_default_for_every_option_they_share() -> None:
    ours = inspect.signature(train).parameters
    theirs = inspect.signature(coordinator).parameters
    shared = set(ours) & set(theirs)
    assert {"eval_every", "eval_batches", "steps", "compress", "sync"} <= shared
    differ = {name: (ours[name].default, theirs[name].default) for name in shared if ours[name].default != theirs[name].default}
    assert not differ, differ
    # --sync None: train resolves it per run (auto where a planner forms the plan, launch/config.default_sync); with
    # nothing to plan, and always for the coordinator, it is synchronous
    from fusionllm.launch.config import default_sync

    assert ours["sync"].default is None
    assert default_sync(None, scheduler=None, groups=None, replicas=None, regroup=None, resume=False) == "synchronous"
    assert _cluster(Options(), train_config(Options())).sync == "synchronous"


def test_the_coordinator_evaluates_as_the_train_config_says() -> None:
    options = Options.from_values({"model": "gpt-nano", "eval_every": 7, "eval_batches": 3})
    t = train_config(options)
    c = _cluster(options, t)
    assert (c.eval_every, c.eval_batches) == (t.eval_every, t.eval_batches) == (7, 3)


def test_a_run_written_by_train_reads_back_the_same_with_the_coordinators_address(tmp_path: Path) -> None:
    options = Options.from_values({"task": "vision", "metrics": tmp_path / "m.jsonl", "steps": 5, "precision": "bf16", "replicas": "1,2",
                                   "sync": "synchronous", "checkpoint_dir": tmp_path, "checkpoint_every": 2, "dead_after": 10.0})
    t = train_config(options)
    run = RunConfig(t, _cluster(options, t))
    path = tmp_path / "run.json"
    path.write_text(run.to_json())
    back = load_run(path, listen="127.0.0.1:5000", token="secret", workers=3)
    assert back.train == run.train and back.train.model == "resnet18"
    assert back.cluster.listen == "127.0.0.1:5000" and back.cluster.token == "secret" and back.cluster.workers == 3
    assert back.cluster.replicas == [1, 2] and back.cluster.compress == "bf16"  # --precision bf16 sends bf16 unless --compress says
    assert back.cluster.checkpoint_dir == str(tmp_path) and back.cluster.dead_after == 10.0


def test_the_vision_task_defaults_to_a_resnet_and_lists_parse_or_name_the_option() -> None:
    assert train_config(Options.from_values({"task": "vision"})).model == "resnet18"
    assert train_config(Options.from_values({"task": "lm"})).model == "gpt-micro"
    assert parse_replicas("1,2") == [1, 2] and parse_replicas(None) is None
    assert parse_groups("0,1/2/3") == [[0, 1], [2], [3]]
    with pytest.raises(ConfigError, match="--replicas"):
        parse_replicas("a,b")
