"""The stage loop (runtime/stage/stage_runtime.py) with fake peers: workers in one process, tensors in memory.

Why these checks can fail: a handler that sends an edge to the wrong peer, files it under another
key, or sums a replica's gradient twice changes the losses and the gradient norm against the same
model run as one stage; a reducer that is skipped leaves the replicas' weights apart; a bad tensor
that is not refused, or a poisoned step whose tensors are not stamped tainted, makes some worker
apply an update that the others skip.

The peers are real ``PeerNet``s and ``Inbox``es whose connection is a function call
(``tests/fake_peers.py``): every tensor is framed, encoded and decoded as on the wire, and the test
sees each header it carried.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from fusionllm.core.errors import FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.models.spec import build_model
from fusionllm.runtime.backends.backend import load_backend
from fusionllm.runtime.backends.model_graph import model_tensors, trace_lm
from fusionllm.runtime.dist.reducers import InOrder, OverlapReduce, RingReduce, WorldReduce
from fusionllm.runtime.stage.faults import Fault
from fusionllm.runtime.stage.stage_runtime import StageRuntime
from fusionllm.runtime.worker.peers import Inbox
from fusionllm.schedule.plan import Plan, make_plan, shared_groups, worker_actions
from fusionllm.transport.control import Hyper
from tests.fake_peers import FakeWorld, MemoryNet

BATCH, SEQ, STEPS = 4, 16, 3
NUMPY = load_backend("numpy")


@pytest.fixture(scope="module")
def nano() -> tuple[OpGraph, dict[str, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    torch.manual_seed(0)
    model = build_model("gpt-nano", seed=0)
    graph = OpGraph.from_json(trace_lm(model, BATCH // 2, SEQ).to_json())  # traced at the micro-batch size (two per batch)
    tensors = {k: v.numpy().copy() for k, v in model_tensors(model).items()}
    rng = np.random.default_rng(1)
    batch = (rng.integers(0, 256, (BATCH, SEQ)), rng.integers(0, 256, (BATCH, SEQ)))
    return graph, tensors, batch


def _workers(graph: OpGraph, plan: Plan, tensors: dict[str, np.ndarray], hyper: Hyper, faults: dict[int, tuple[Fault, ...]] | None = None,
             ) -> tuple[list[StageRuntime], dict[int, MemoryNet]]:
    inboxes = {w: Inbox(1 << 30) for w in plan.workers}
    nets = {w: MemoryNet(inboxes) for w in plan.workers}
    runtimes = []
    for w in plan.workers:
        shared = bool(shared_groups(graph, plan).get(w))
        program = worker_actions(graph, plan, w, shared_grads=shared)
        runtimes.append(StageRuntime(graph, plan, w, {k: v.copy() for k, v in tensors.items()}, hyper, nets[w], inboxes[w],
                                     backend=NUMPY, program=program, faults=(faults or {}).get(w, ())))
    return runtimes, nets


def _train(runtimes: list[StageRuntime], batch: tuple[np.ndarray, np.ndarray], steps: int = STEPS) -> list[list[Any]]:
    """Every worker runs ``steps`` steps together; per step, each worker's ``StepDone``."""

    async def all_steps() -> list[list[Any]]:
        out = []
        for step in range(steps):
            out.append(list(await asyncio.gather(*(r.run_step(step, 1e-2, r.feeds(*batch)) for r in runtimes))))
        return out

    return asyncio.run(all_steps())


def _losses(dones: list[Any]) -> list[float]:
    """The step's loss: the mean over micro-batches of the losses some worker holds."""
    per_mb = {mb: v for d in dones for mb, v in d.losses.items()}
    return [float(np.mean([per_mb[k] for k in sorted(per_mb)]))]


def _weights(r: StageRuntime) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in r.state_tensors().items() if k.startswith("param/")}


HYPER = Hyper(lr=1e-2, recv_timeout=20.0)
# AdamW divides by the root of the second moment: a gradient near zero (a bias at its start) turns
# float rounding of another summation order into weight differences of a few 1e-6 (lr 1e-2)
ADAM_ATOL = 5e-5


# ---- the loop -----------------------------------------------------------------------------------------
def test_a_two_stage_pipeline_over_fake_peers_trains_as_the_model_in_one_stage(nano) -> None:
    graph, tensors, batch = nano
    one, _ = _workers(graph, make_plan(graph, 1, micro_batches=2), tensors, HYPER)
    two, nets = _workers(graph, make_plan(graph, 2, micro_batches=2), tensors, HYPER)
    ref, got = _train(one, batch), _train(two, batch)
    for r, g in zip(ref, got, strict=True):
        assert _losses(g) == pytest.approx(_losses(r), rel=1e-5)
        assert g[0].grad_norm == pytest.approx(r[0].grad_norm, rel=1e-5)
        assert g[0].grad_norm == g[1].grad_norm  # every worker sums the same shares in the same order
    kinds = {(h["kind"], h["src"]) for h in nets[0].sent + nets[1].sent}
    assert ("act", 0) in kinds and ("grad", 1) in kinds and ("norm", 0) in kinds and ("norm", 1) in kinds
    assert ("act", 1) not in kinds and ("grad", 0) not in kinds  # the first stage sends activations only, the last gradients only
    whole = _weights(one[0])
    for r in two:
        for k, v in _weights(r).items():
            np.testing.assert_allclose(v, whole[k], rtol=1e-5, atol=ADAM_ATOL)


def test_replicas_sum_their_gradients_with_the_ring_reducer_and_stay_equal(nano) -> None:
    graph, tensors, batch = nano
    one, _ = _workers(graph, make_plan(graph, 1, micro_batches=2), tensors, HYPER)
    replicas, nets = _workers(graph, make_plan(graph, 2, replicas=[2], micro_batches=2), tensors, HYPER)
    assert isinstance(replicas[0].reducer, InOrder) and all(isinstance(p, RingReduce) for p in replicas[0].reducer.parts)
    ref, got = _train(one, batch), _train(replicas, batch)
    for r, g in zip(ref, got, strict=True):
        assert g[0].grad_norm == pytest.approx(r[0].grad_norm, rel=1e-5)
    assert any(h["kind"] == "reduce" for h in nets[0].sent)
    a, b, whole = _weights(replicas[0]), _weights(replicas[1]), _weights(one[0])
    for k in whole:
        np.testing.assert_array_equal(a[k], b[k])  # each chunk summed by one member, then copied: bit for bit
        np.testing.assert_allclose(a[k], whole[k], rtol=1e-5, atol=ADAM_ATOL)


def test_a_bad_tensor_taints_what_follows_and_no_worker_applies_the_step(nano) -> None:
    graph, tensors, batch = nano
    hyper = Hyper(lr=1e-2, recv_timeout=20.0, numeric_guard="retry")
    runtimes, nets = _workers(graph, make_plan(graph, 2, micro_batches=2), tensors, hyper, faults={0: (Fault("nan", 1),)})
    steps = _train(runtimes, batch, steps=2)
    assert not any(d.skipped for d in steps[0])
    first_stage, last_stage = steps[1]
    assert first_stage.skipped and last_stage.skipped  # the norm exchange tells the first stage, whose own tensors were fine
    assert {(b.suspect, b.detector, b.kind) for b in last_stage.bad} == {(0, 1, "act")}  # the sender is blamed, once
    assert not first_stage.bad  # the gradients it got back were tainted: taken without blame
    grads_back = [h for h in nets[1].sent if h["kind"] == "grad" and h["step"] == 1]
    assert grads_back and all(h.get("taint") == 1 for h in grads_back)
    assert not any(h.get("taint") for h in nets[1].sent if h["step"] == 0)


def test_a_skipped_step_leaves_the_weights_as_the_step_before_left_them(nano) -> None:
    graph, tensors, batch = nano
    hyper = Hyper(lr=1e-2, recv_timeout=20.0, numeric_guard="retry")
    clean, _ = _workers(graph, make_plan(graph, 2, micro_batches=2), tensors, hyper)
    faulty, _ = _workers(graph, make_plan(graph, 2, micro_batches=2), tensors, hyper, faults={0: (Fault("nan", 1),)})
    _train(clean, batch, steps=1)
    _train(faulty, batch, steps=2)
    for c, f in zip(clean, faulty, strict=True):
        expected, got = _weights(c), _weights(f)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k])


def test_a_failed_action_names_itself_and_the_worker(nano) -> None:
    graph, tensors, batch = nano
    runtimes, _ = _workers(graph, make_plan(graph, 2, micro_batches=2), tensors, Hyper(lr=1e-2, recv_timeout=0.2))
    with pytest.raises(FusionError, match=r"worker 1 failed at action 0 \(.*RECV_F.*TimeoutError"):
        asyncio.run(runtimes[1].run_step(0, 1e-2, runtimes[1].feeds(*batch)))  # its peer never runs: the receive times out


# ---- capabilities ---------------------------------------------------------------------------------------
def test_backends_declare_what_their_stages_can_do() -> None:
    from fusionllm.runtime.backends.numpy_backend import NumpyStage
    from fusionllm.runtime.backends.torch_backend import TorchStage

    assert TorchStage.capabilities.bf16 and TorchStage.capabilities.recompute and TorchStage.capabilities.keyed_random
    assert not (NumpyStage.capabilities.bf16 or NumpyStage.capabilities.recompute or NumpyStage.capabilities.keyed_random)


def test_a_numpy_stage_asked_for_bf16_is_refused_by_its_declaration(nano) -> None:
    graph, tensors, _ = nano
    with pytest.raises(FusionError, match="bf16 needs the torch backend"):
        _workers(graph, make_plan(graph, 1, micro_batches=2), tensors, Hyper(lr=1e-2, precision="bf16"))


def test_a_torch_stage_is_set_up_as_its_declaration_allows(nano) -> None:
    graph, tensors, batch = nano
    plan = make_plan(graph, 1, micro_batches=2)
    hyper = Hyper(lr=1e-2, recompute=True, precision="bf16", seed=7)
    r = StageRuntime(graph, plan, 0, {k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, hyper, MemoryNet({0: Inbox(1 << 20)}),
                     Inbox(1 << 20), backend=load_backend("torch"), program=worker_actions(graph, plan, 0, shared_grads=False))
    assert r.executor.recompute and r.executor.autocast == "bfloat16"
    asyncio.run(r.run_step(5, 1e-2, r.feeds(*batch)))
    assert r.executor.random_key == (7, 5)


def test_a_program_of_another_stage_is_refused(nano) -> None:
    graph, tensors, _ = nano
    plan = make_plan(graph, 2, micro_batches=2)
    with pytest.raises(FusionError, match="actions of another stage"):
        StageRuntime(graph, plan, 0, tensors, HYPER, MemoryNet({0: Inbox(1), 1: Inbox(1)}), Inbox(1), backend=NUMPY,
                     program=worker_actions(graph, plan, 1, shared_grads=False))


def test_the_reducer_is_chosen_again_when_the_stage_joins_its_world(nano) -> None:
    graph, tensors, _ = nano
    runtimes, _ = _workers(graph, make_plan(graph, 2, micro_batches=2), tensors, HYPER)
    r = runtimes[0]
    assert [type(p) for p in r.reducer.parts] == [RingReduce]  # the tied embedding, shared by both stages
    world = FakeWorld({(0, 1)}, carried={(0, 1)})
    r.use_world(world)
    assert isinstance(r.reducer, OverlapReduce) and [type(p) for p in r.reducer.parts] == [WorldReduce]
    assert r.sender.world is world and r.receiver.world is world


def test_a_worker_refuses_an_assignment_without_a_program(nano) -> None:
    """The coordinator ships the program its validator checked; a worker lowers no plan of its own."""
    from fusionllm.core.errors import WireError
    from fusionllm.runtime.worker.worker import Worker, WorkerConfig
    from fusionllm.transport.control import Assign
    from fusionllm.transport.messages import pack

    graph, _, _ = nano
    head = Assign(worker=0, graph=graph.to_json(), plan=make_plan(graph, 1, micro_batches=2).to_json(), addresses={}, hyper=HYPER, nbytes=0)

    async def assign() -> None:
        async def frames() -> Any:
            yield pack(head.to_wire())

        await Worker(WorkerConfig(join="127.0.0.1:1", token="t" * 32, handle_signals=False))._on_assign(frames())

    with pytest.raises(WireError, match="without a program"):
        asyncio.run(assign())
