"""--recompute (activation checkpointing per stage): the same training, less memory planned."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fusionllm.core.config import TrainConfig
from fusionllm.cost.model import CostModel
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.models.spec import build_model
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate


def test_recomputed_stages_train_exactly_as_stored_ones_dropout_included() -> None:
    """Fails when the recomputed forward draws other dropout masks than the first (the RNG state
    not replayed) or when a checkpointed op loses its gradient."""
    for train in (TrainConfig(model="gpt-nano", steps=3, batch_size=8, seq_len=32, eval_every=0, warmup=0),
                  TrainConfig(task="tests.test_tasks:dropout_task", steps=4, batch_size=8, eval_every=0, warmup=0)):
        stored, _ = run_in_process(train, cluster_config(2, micro_batches=2))
        again, workers = run_in_process(replace(train, recompute=True), cluster_config(2, micro_batches=2))
        np.testing.assert_allclose(again.losses, stored.losses, rtol=1e-6)
        assert all(w.runtime.executor.recompute for w in workers)


def test_the_memory_model_keeps_inputs_only_and_counts_the_second_forward() -> None:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 4, 128)
    work = estimate(graph)
    plain, again = CostModel(graph, work, None), CostModel(graph, work, None, recompute=True)  # type: ignore[arg-type]
    nodes = [n.id for n in graph.compute_nodes]
    assert again.stage_memory(nodes, 4) < plain.stage_memory(nodes, 4) - 3 * (plain.stage_memory(nodes, 1) - plain.stage_memory(nodes, 0)) / 2
    block = next(n.id for n in graph.compute_nodes if n.name == "h.0")
    assert work[block].saved_bytes > 8 * work[block].out_bytes  # a block keeps far more than its output
    from fusionllm.cluster.hardware import Device

    cpu = Device(0, "s", 1.0, None, 1 << 30)
    assert again.op_seconds(block, cpu, True) > plain.op_seconds(block, cpu, True) + 0.9 * plain.op_seconds(block, cpu, False)
