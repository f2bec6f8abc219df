"""`--log-to tensorboard`: the run's records read back with TensorBoard's own reader.

Why these checks can fail: a tag written under another name, a step written at the wrong step, an
evaluation or an event dropped, or an event file left unflushed when the run ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.tensorboard import parse_log_to
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.runtime.reference.single import train_single

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(directory: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_to_names_a_directory_or_takes_one_beside_the_metrics(tmp_path: Path) -> None:
    assert parse_log_to("tensorboard:/x/tb", None) == Path("/x/tb")
    assert parse_log_to("tensorboard", str(tmp_path / "m.jsonl")) == tmp_path / "tensorboard"
    assert parse_log_to(None, None) is None
    for bad in ("wandb", "tensorboard:"):
        with pytest.raises(ConfigError, match="expected tensorboard or tensorboard:DIR"):
            TrainConfig(log_to=bad)


def test_a_distributed_run_writes_every_record_tensorboard_reads_back(tmp_path: Path) -> None:
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    train = TrainConfig(model="gpt-nano", steps=4, batch_size=4, seq_len=32, eval_every=2, eval_batches=1, warmup=0,
                        metrics=str(metrics), log_to=f"tensorboard:{tb}")
    run_in_process(train, cluster_config(2, micro_batches=2, eval_every=2, eval_batches=1))
    steps = [r for r in _jsonl(metrics) if "loss" in r and "event" not in r]
    acc = _read(tb)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in steps]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in steps], rtol=1e-6)
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("val/loss")] == [(r["step"], round(r["val_loss"], 5)) for r in steps if "val_loss" in r]
    tags = acc.Tags()["scalars"]
    assert {"train/lr", "train/tokens_per_s", "bytes/w0->w1", "bytes/w1->w0"} <= set(tags), tags
    assert any(t.startswith("busy/") for t in tags), tags
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")]
    assert any(t.startswith("plan:") for t in texts), texts[:3]


def test_the_one_process_reference_writes_them_too(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    result = train_single(TrainConfig(model="gpt-nano", steps=3, batch_size=4, seq_len=32, eval_every=3, eval_batches=1, warmup=0,
                                      log_to=f"tensorboard:{tb}"))
    acc = _read(tb)
    np.testing.assert_allclose([e.value for e in acc.Scalars("train/loss")], result.losses, rtol=1e-6)
    assert len(acc.Scalars("val/loss")) == 1
