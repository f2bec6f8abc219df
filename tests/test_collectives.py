"""Worlds (control/collectives.py): which torch workers form a torch.distributed group, without processes;
and (slow) gloo's sum giving every member the same bits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from fusionllm.control.collectives import find_worlds, world_prefix
from fusionllm.control.config import ClusterConfig
from fusionllm.core.errors import ConfigError, WireError
from fusionllm.models import build_model
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.schedule.plan import make_plan
from fusionllm.schedule.validate import validate_plan
from fusionllm.transport.control import Assign, Collective, Hyper
from fusionllm.transport.worker_info import DeviceInfo, WorkerInfo


@pytest.fixture(scope="module")
def graph():
    return trace_lm(build_model("gpt-nano", device="meta"), 2, 32)


def _infos(n: int, **per: dict) -> dict[int, WorkerInfo]:
    """``n`` torch workers on one host, each its own process; ``per`` overrides worker ``w<i>``'s fields."""
    return {w: replace(WorkerInfo(backend="torch", hostname="h", pid=100 + w, device=DeviceInfo("cpu")), **per.get(f"w{w}", {})) for w in range(n)}


def _worlds(graph, n: int, infos: dict, replicas: list[int] | None = None, **kw):
    plan = make_plan(graph, n, replicas=replicas, micro_batches=2)
    return find_worlds(graph, plan, validate_plan(graph, plan), infos, **kw)


def test_replicas_on_one_host_form_one_gloo_world_with_every_reduce_group(graph) -> None:
    (world,) = _worlds(graph, 4, _infos(4), replicas=[2, 2])
    assert world.workers == (0, 1, 2, 3) and world.backend == "gloo"
    assert world.reduce == ((0, 1), (0, 1, 2, 3), (2, 3))  # stage replicas, and wte tied with lm_head
    assert world.carries == ((0, 2), (1, 3), (2, 0), (3, 1))  # each replica's pipeline, both directions
    assert world.line() == "group 0: w0,w1,w2,w3 (gloo), all-reduces w0,w1; w0,w1,w2,w3; w2,w3; carries w0->w2, w1->w3, w2->w0, w3->w1"
    assert world.record()["carries"] == [[0, 2], [1, 3], [2, 0], [3, 1]]


def test_compressed_or_slow_links_or_numpy_workers_split_worlds(graph) -> None:
    # another host for workers 2 and 3: two worlds, each a stage's replicas; the tied weight crosses hosts
    two = _worlds(graph, 4, _infos(4, w2={"hostname": "g"}, w3={"hostname": "g"}), replicas=[2, 2])
    assert [(w.workers, w.reduce) for w in two] == [((0, 1), ((0, 1),)), ((2, 3), ((2, 3),))]
    assert [w.carries for w in two] == [(), ()]  # the pipeline's links cross hosts: the data plane
    # the cost model's rates decide over host names (the testbed's namespaces share one host)
    rates = {"bps": lambda a, b: 1e10 if (a < 2) == (b < 2) else 1e8}
    assert [w.workers for w in _worlds(graph, 4, _infos(4), replicas=[2, 2], hosts=False, **rates)] == [(0, 1), (2, 3)]
    # probed rates (no cluster file): one host is fast whatever the probe measured, and a fast link joins two hosts
    assert [w.workers for w in _worlds(graph, 4, _infos(4), replicas=[2, 2], **rates)] == [(0, 1, 2, 3)]
    assert [w.workers for w in _worlds(graph, 4, _infos(4, w1={"hostname": "g"}), replicas=[2, 2], **rates)] == [(0, 1, 2, 3)]
    # compressed links between replicas (AdaTopK's ratios): each replica's pipeline (raw) still forms a world, but no group reduces through it
    pipes = _worlds(graph, 4, _infos(4), replicas=[2, 2], compress="adatopk", ratios={(a, b): 0.5 for a, b in ((0, 1), (1, 0), (2, 3), (3, 2), (0, 3), (3, 0), (1, 2), (2, 1))})
    assert [(w.workers, w.reduce) for w in pipes] == [((0, 2), ()), ((1, 3), ())]
    assert [w.carries for w in pipes] == [((0, 2), (2, 0)), ((1, 3), (3, 1))]
    # compressed pipeline links: the replicas' world all-reduces, but carries no pipeline link
    acts = _worlds(graph, 4, _infos(4), replicas=[2, 2], compress="adatopk", ratios={(a, b): 0.5 for a in (0, 1) for b in (2, 3)} | {(b, a): 0.5 for a in (0, 1) for b in (2, 3)})
    assert [(w.workers, w.carries) for w in acts] == [((0, 1), ()), ((2, 3), ())]
    assert _worlds(graph, 4, _infos(4), replicas=[2, 2], compress="fp16") == []
    # adatopk: links its policy leaves raw only
    ratios = {(0, 2): 0.5, (2, 0): 0.5, (1, 3): 0.5, (3, 1): 0.5, (0, 3): 0.5, (3, 0): 0.5, (1, 2): 0.5, (2, 1): 0.5}
    assert [w.workers for w in _worlds(graph, 4, _infos(4), replicas=[2, 2], compress="adatopk", ratios=ratios)] == [(0, 1), (2, 3)]
    # a NumPy worker is in no world; one process (the harness) makes no world
    assert [w.workers for w in _worlds(graph, 4, _infos(4, w3={"backend": "numpy"}), replicas=[2, 2])] == [(0, 1, 2)]
    assert _worlds(graph, 2, {w: replace(i, pid=7) for w, i in _infos(2).items()}) == []


def test_nccl_only_when_every_member_is_on_a_cuda_device_of_its_own(graph) -> None:
    def cuda(gpu: str, **more: str) -> dict:
        return {"device": DeviceInfo("cuda", gpu=gpu), **more}

    assert _worlds(graph, 2, _infos(2, w0=cuda("GPU-a"), w1=cuda("GPU-b")))[0].backend == "nccl"
    assert _worlds(graph, 2, _infos(2, w0=cuda("GPU-a")))[0].backend == "gloo"
    # three processes on one GPU (local:3 --device cuda on a one-GPU machine): NCCL would refuse the
    # group ("Duplicate GPU detected"), as it did on the H200 before this rule
    assert _worlds(graph, 2, _infos(2, w0=cuda("GPU-a"), w1=cuda("GPU-a")))[0].backend == "gloo"
    assert _worlds(graph, 2, _infos(2, w0=cuda(""), w1=cuda("")))[0].backend == "gloo"  # not known: not assumed
    # the same PCI address on two hosts is two GPUs
    pci = "pci:0:1:0"
    assert _worlds(graph, 2, _infos(2, w0=cuda(pci), w1=cuda(pci, hostname="g")), hosts=False,
                   bps=lambda a, b: 1e10)[0].backend == "nccl"


def test_a_device_report_names_its_gpu_and_a_long_one_is_cut() -> None:
    assert DeviceInfo.from_map({"kind": "cuda", "gpu": "GPU-1234"}).gpu == "GPU-1234"
    assert DeviceInfo.from_map({"kind": "cuda"}).gpu == ""
    assert len(DeviceInfo.from_map({"kind": "cuda", "gpu": "x" * 10_000}).gpu) == 128


def test_the_prefix_needs_the_token_and_differs_per_epoch_and_group() -> None:
    p = world_prefix("secret", 0, 0)
    assert len(p) == 64 and p not in {world_prefix("other", 0, 0), world_prefix("secret", 1, 0), world_prefix("secret", 0, 1)}


def test_collective_travels_typed_in_assign() -> None:
    spec = Collective("127.0.0.1:1234", "ab" * 32, [0, 2], "gloo", 0, [[0, 2]], [[0, 2], [2, 0]])
    head = Assign(worker=0, graph="{}", plan="{}", addresses={}, hyper=Hyper(lr=1e-3), nbytes=0, collective=spec)
    assert Assign.from_wire(head.to_wire()).collective == spec
    assert Assign.from_wire({**head.to_wire(), "collective": None}).collective is None
    with pytest.raises(WireError, match="ranks"):
        Assign.from_wire({**head.to_wire(), "collective": {**spec.to_wire(), "ranks": ["0"]}})


def test_collectives_option_is_checked() -> None:
    assert ClusterConfig(listen="127.0.0.1:0", token="t", workers=2).collectives == "auto"
    with pytest.raises(ConfigError, match="--collectives 'on'"):
        ClusterConfig(listen="127.0.0.1:0", token="t", workers=2, collectives="on")


GLOO_SUM = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("p", store), rank=rank, world_size=3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1_000_003, generator=g) * 10 ** torch.randint(-6, 6, (1_000_003,), generator=g)  # sums that depend on the order
    dist.all_reduce(x)
    sys.stdout.buffer.write(x.numpy().tobytes())
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_gloo_sum_gives_every_member_the_same_bits(tmp_path: Path) -> None:
    """Why it can fail: an all-reduce where each member adds the others' values in its own order
    gives members different roundings, and replicas would drift apart step by step."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "sum.py"
    script.write_text(GLOO_SUM)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store.port)], stdout=subprocess.PIPE) for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(outs[0]) == 4 * 1_000_003 and outs[0] == outs[1] == outs[2]


def test_workers_behind_nat_are_in_no_world(graph) -> None:
    """gloo's full mesh connects every pair directly: a worker reached through a relay cannot be a member."""
    natted = _infos(4, w2={"relay": "r:1"}, w3={"relay": "r:1"})
    assert [w.workers for w in _worlds(graph, 4, natted, replicas=[2, 2])] == [(0, 1)]


def test_workers_of_two_torch_versions_are_in_no_world_together(graph) -> None:
    mixed = _infos(3, w1={"software": {"torch": "2.4.1"}})
    for w in (0, 2):
        mixed[w] = replace(mixed[w], software={"torch": "2.13.0"})
    # a pipeline 0 -> 1 -> 2 whose middle worker runs another torch: only the tied weight's holders (0, 2) share a world
    assert [(w.workers, w.carries) for w in _worlds(graph, 3, mixed)] == [((0, 2), ())]


def test_a_gpu_is_known_by_its_uuid_else_its_pci_address() -> None:
    from types import SimpleNamespace

    from fusionllm.runtime.backends.torch_backend import gpu_identity

    assert gpu_identity(SimpleNamespace(uuid="GPU-1", pci_bus_id=3)) == "GPU-1"
    assert gpu_identity(SimpleNamespace(uuid="", pci_domain_id=0, pci_bus_id=3, pci_device_id=0)) == "pci:0:3:0"
    assert gpu_identity(SimpleNamespace()) == ""
