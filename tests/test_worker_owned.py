"""Workers own their data, evaluation and checkpoints (issue 15), checked in one process (harness.py).

Each test can fail: the validation loss in the pipeline must equal the single process's, a
checkpoint's shards must hold exactly the weights the workers trained, a resumed run must continue
with the losses an uninterrupted one has, and a worker whose corpus differs must be fed by the
coordinator, not train on other data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionllm.control.config import RunConfig
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.runtime.reference.single import train_single

BASE = {"model": "gpt-nano", "batch_size": 8, "seq_len": 32, "lr": 1e-2, "warmup": 2, "seed": 4}


def _single(steps: int, eval_every: int = 0) -> list[dict]:
    out: list[dict] = []
    train_single(TrainConfig(steps=steps, eval_every=eval_every, eval_batches=2, **BASE), out.append)
    return out


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.mark.parametrize(("workers", "replicas", "schedule"), [(3, None, "1f1b"), (4, [1, 2, 1], "gpipe")])
def test_validation_loss_in_the_pipeline_equals_the_single_process(workers: int, replicas: list[int] | None, schedule: str) -> None:
    records: list[dict] = []
    cfg = cluster_config(workers, replicas=replicas, schedule=schedule, micro_batches=2, eval_every=2, eval_batches=2)
    run_in_process(TrainConfig(steps=4, **BASE), cfg, on_step=records.append)
    ref = _single(4, eval_every=2)
    got = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    want = [(r["step"], r["val_loss"]) for r in ref if "val_loss" in r]
    assert [s for s, _ in got] == [s for s, _ in want] == [1, 3]
    assert all(_close(a, b) for (_, a), (_, b) in zip(got, want, strict=True)), (got, want)
    assert all(_close(r["loss"], s["loss"]) for r, s in zip(records, ref, strict=True))


def test_checkpoint_shards_hold_the_trained_weights_and_a_resume_continues_exactly(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    cfg = cluster_config(3, micro_batches=2, checkpoint_dir=str(ck), checkpoint_every=2)
    _, workers = run_in_process(TrainConfig(steps=2, **BASE), cfg)
    step_dir = ck / "step-000002"
    state = json.loads((step_dir / "state.json").read_text())
    assert state["step"] == 2 and set(state["shards"]) == {"0", "1", "2"} and "token" not in state["cluster"]
    for w in workers:  # each stage's shard is what its worker holds now
        shard = load_file(step_dir / f"stage-{w.runtime.stage.index}.safetensors")
        mine = w.runtime.state_tensors()
        assert set(shard) == set(mine)
        assert all(torch.equal(shard[k], mine[k].cpu()) for k in mine)
        assert (step_dir / f"stage-{w.runtime.stage.index}.safetensors").stat().st_size == state["shards"][str(w.runtime.stage.index)]["nbytes"]
    # resume on another split (2 workers, other stage boundaries): workers read their tensors from the shards
    records: list[dict] = []
    run_in_process(TrainConfig(steps=4, **BASE), cluster_config(2, micro_batches=2, checkpoint_dir=str(ck), resume=True), on_step=records.append)
    ref = _single(4)
    assert [r["step"] for r in records] == [2, 3]
    assert all(_close(r["loss"], ref[r["step"]]["loss"]) for r in records), ([r["loss"] for r in records], [x["loss"] for x in ref])


def test_a_damaged_checkpoint_is_refused_on_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run_in_process(TrainConfig(steps=1, **BASE), cluster_config(2, micro_batches=2, checkpoint_dir=str(ck), checkpoint_every=1))
    shard = ck / "step-000001" / "stage-1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="manifest says"):
        run_in_process(TrainConfig(steps=2, **BASE), cluster_config(2, micro_batches=2, checkpoint_dir=str(ck), resume=True))


def test_a_worker_with_other_data_is_fed_by_the_coordinator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusionllm.runtime.worker import worker as worker_module
    from fusionllm.runtime.worker.worker_data import try_worker_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    train = TrainConfig(steps=3, data=str(corpus), eval_every=3, eval_batches=1, **BASE)
    calls: list[int] = []

    def one_other_copy(spec: object) -> tuple:  # the second worker to be assigned finds another file at that path
        calls.append(1)
        return (None, "the data differs from the coordinator's (test)") if len(calls) == 2 else try_worker_data(spec)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_module, "try_worker_data", one_other_copy)
    records: list[dict] = []
    _, workers = run_in_process(train, cluster_config(3, micro_batches=2, eval_every=3, eval_batches=1), on_step=records.append)
    assert sum(w.data_source is None for w in workers) == 1
    ref: list[dict] = []
    train_single(train, ref.append)
    assert all(_close(r["loss"], s["loss"]) for r, s in zip(records, ref, strict=True))
    assert _close(records[-1]["val_loss"], ref[-1]["val_loss"])


def test_run_config_round_trips_without_the_token(tmp_path: Path) -> None:
    run = RunConfig(TrainConfig(steps=3, **BASE), cluster_config(3, replicas=[1, 2], checkpoint_dir="/x", checkpoint_every=2, compress="adatopk"))
    text = run.to_json()
    assert run.cluster.token not in text
    back = RunConfig.from_json(text, listen="h:1", token="t" * 64, workers=3)
    assert back.train == run.train and back.cluster.replicas == [1, 2] and back.cluster.compress == "adatopk" and back.cluster.listen == "h:1"
    with pytest.raises(ConfigError, match="malformed"):
        RunConfig.from_json(text.replace('"steps"', '"stepz"'), listen="h:1", token="t", workers=3)
