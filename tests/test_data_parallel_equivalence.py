"""A data-parallel plan with unequal shares trains as one process (issue 58, item 2).

Why it can fail: each replica runs its own share of the step's micro-batches (``share_order``), so a
micro-batch fed to the wrong replica, a share counted twice or left out, a loss scaled by the
replica's share instead of the step's micro-batches, or replicas whose summed gradients are not
the sum of all micro-batches', each shows in the loss of the next step and in the final weights.
The replicas' gradients are summed in another order than one process adds them (each replica's
own micro-batches first, then the reduce), so the comparison is to 1e-5 relative, not bit for bit.
The plan comes from the planner itself (``--scheduler dp`` on a cluster file of three unequal
devices joined by fast links, their speeds declared as accelerators' so that compute outweighs the per-message costs): one site, so ``Plan.reduce`` is None and the default reducers sum.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusionllm.core.config import TrainConfig
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.runtime.reference.single import train_single

CLUSTER = """name = "unequal-replicas"
[sites.A]
devices = 1
cpus = 1
device_flops = "20gflops"
bandwidth = "10gbit"
[sites.B]
devices = 1
cpus = 1
device_flops = "10gflops"
bandwidth = "10gbit"
[sites.C]
devices = 1
cpus = 1
device_flops = "5gflops"
bandwidth = "10gbit"
[[links]]
sites = ["A", "B"]
bandwidth = "10gbit"
[[links]]
sites = ["A", "C"]
bandwidth = "10gbit"
[[links]]
sites = ["B", "C"]
bandwidth = "10gbit"
"""


# four devices that cannot hold gpt-micro alone (at this batch), two fast and two slow, one site: two
# replicated pipelines of two stages, their lanes taking unequal shares
LANES = """name = "unequal-lanes"
[sites.A]
devices = 2
cpus = 1
device_flops = "20gflops"
device_memory = "127MiB"
bandwidth = "10gbit"
[sites.B]
devices = 2
cpus = 1
device_flops = "10gflops"
device_memory = "127MiB"
bandwidth = "10gbit"
[[links]]
sites = ["A", "B"]
bandwidth = "10gbit"
"""


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("cluster", "workers", "stages"), [(CLUSTER, 3, 1), (LANES, 4, 2)], ids=["replicas", "replicated-pipelines"])
def test_a_data_parallel_plan_with_unequal_shares_trains_as_one_process(tmp_path: Path, one_thread: None, cluster: str, workers: int,
                                                                        stages: int) -> None:
    """Fails if the replicas' shares do not add up to one process's step: every step's loss and every
    final weight within 1e-5 relative of the one-process run at the plan's micro-batches."""
    hardware = tmp_path / "cluster.toml"
    hardware.write_text(cluster)
    train = TrainConfig(model="gpt-micro", steps=4, batch_size=8, seq_len=32, seed=2, warmup=1, eval_every=0)
    result, running = run_in_process(train, cluster_config(workers, scheduler="dp", hardware=hardware, sync="synchronous", micro_batches=4))
    plan = running[0].runtime.plan
    assert len(plan.stages) == stages and len(set(plan.stages[0].shares or [])) > 1 and plan.reduce is None, plan.to_json()
    ref = train_single(train, micro_batches=plan.micro_batches)
    assert len(result.losses) == len(ref.losses) == 4
    assert all(abs(got - want) <= 1e-5 * abs(want) for got, want in zip(result.losses, ref.losses, strict=True)), (result.losses, ref.losses)
    want = ref.model.state_dict()
    held: set[str] = set()
    for w in running:
        weights = {k.removeprefix("param/"): v for k, v in w.runtime.state_tensors().items() if k.startswith("param/")}
        held |= set(weights)
        # per tensor, the norm of the difference against the tensor's; the attention's key bias apart: its
        # gradient is zero in exact arithmetic (softmax ignores a shift of every score of a row), so what
        # it gets is rounding, which AdamW scales up to a learning-rate step either way
        bad = {n: rel for n, v in weights.items() if (rel := _relative(n, v, want[n])) > 1e-5}
        assert bad == {}, (bad, plan.to_json())
    assert len(held) > 40


def _relative(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    if name.endswith("attn.c_attn.bias"):
        c = got.numel() // 3
        got, want = torch.cat([got[:c], got[2 * c :]]), torch.cat([want[:c], want[2 * c :]])
    return float((got - want).norm() / want.norm())
