"""The real runtime in one process (``fusionllm.launch.inprocess``) trains exactly like one plain PyTorch process.

Why this can fail: every case below runs a coordinator and 2-4 workers over gRPC and the TCP data
plane on 127.0.0.1, each worker running its lowered action list (F, B, SEND/RECV, REDUCE, STEP),
and compares with ``train_single`` and a plain autograd reference built from the same spec, seed
and batches: the loss of every step within 1e-5 relative, and every gradient of the first step,
captured on each worker right before its optimizer step (after the replica and tied-weight
all-reduce), by parameter name. A lost or doubled micro-batch, a wrong loss scale, a gradient summed
on the wrong side of a tied weight, a replica that skipped its all-reduce or a batch fed to the wrong
micro-batch moves a loss or a gradient far beyond 1e-5; ``test_the_check_sees_a_skipped_all_reduce``
shows it does. This is how runtime tests are written from now on: in-process, seconds per case.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import numpy as np
import pytest
import torch

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import AuthError, ConfigError, FusionError
from fusionllm.data import Batcher, load_corpus
from fusionllm.launch.inprocess import (
    HarnessError,
    InProcessCluster,
    cluster_config,
    run_in_process,
)
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_model
from fusionllm.runtime.backends.numpy_backend import NumpyStage
from fusionllm.runtime.backends.torch_backend import TorchStage
from fusionllm.runtime.reference.single import train_single
from fusionllm.runtime.reference.verify import TOLERANCE, rel_err
from fusionllm.runtime.worker.peers import Inbox
from fusionllm.runtime.worker.worker import COORDINATOR_SERVICE
from fusionllm.transport.rpc import RpcClient

STEPS, BATCH, SEQ = 3, 8, 32
TIED = "wte.weight"  # the GPTs tie the LM head to the token embedding
STEP_TIMEOUT = 120.0  # a hang fails the case in minutes, not in the default ten


def _train(model: str = "gpt-nano") -> TrainConfig:
    return TrainConfig(model=model, steps=STEPS, batch_size=BATCH, seq_len=SEQ, lr=3e-3, warmup=1, eval_every=0, seed=0)


@functools.cache
def _reference(train: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of ``train_single`` and the first step's gradients of a plain autograd model."""
    losses = train_single(train).losses
    model = build_model(train.model, seed=train.seed)
    train_tokens, _ = load_corpus(train.data).split(0.1)
    x, y = Batcher(train_tokens, train.batch_size, train.seq_len, train.seed).get(0)
    lm_loss(model(x), y).backward()
    assert abs(lm_loss(model(x), y).item() - losses[0]) <= TOLERANCE * abs(losses[0])  # the two references agree
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _grads_of(stage: Any) -> dict[str, torch.Tensor]:
    if isinstance(stage, NumpyStage):
        return {n: torch.from_numpy(np.array(g)) for n, g in stage.executor.param_grads().items() if g is not None}
    return {n: p.grad.detach().clone() for n, p in stage.executor.trainable().items() if p.grad is not None}


@pytest.fixture
def first_grads(monkeypatch: pytest.MonkeyPatch) -> dict[int, dict[str, torch.Tensor]]:
    """Each stage's gradients when its optimizer step first runs (keyed by ``id`` of the stage backend)."""
    captured: dict[int, dict[str, torch.Tensor]] = {}
    for cls in (TorchStage, NumpyStage):
        def step(self: Any, coef: float, lr: float, _orig: Any = cls.step) -> None:
            captured.setdefault(id(self), _grads_of(self))
            _orig(self, coef, lr)

        monkeypatch.setattr(cls, "step", step)
    return captured


def _mismatches(workers: list, captured: dict[int, dict[str, torch.Tensor]], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative error of every captured gradient (``worker i: name``) above the tolerance, and the
    reference parameters no worker had a gradient for."""
    bad: dict[str, float] = {}
    seen: set[str] = set()
    for i, w in enumerate(workers):
        assert w.runtime is not None, f"worker {i} never got a stage"
        grads = captured.get(id(w.runtime.backend))
        assert grads, f"worker {i}: no gradients were captured before its optimizer step"
        for name, g in grads.items():
            assert name in ref, f"worker {i}: gradient of {name!r}, which the model does not have"
            seen.add(name)
            err = rel_err(g, ref[name])
            if not err <= TOLERANCE:
                bad[f"worker {i}: {name}"] = err
    for name in ref.keys() - seen:
        bad[f"no worker: {name}"] = float("inf")
    return bad


def _check(result: Any, workers: list, captured: dict, train: TrainConfig) -> None:
    ref_losses, ref_grads = _reference(train)
    assert len(result.losses) == len(ref_losses) == STEPS
    errs = [abs(a - b) / abs(b) for a, b in zip(result.losses, ref_losses, strict=True)]
    assert max(errs) <= TOLERANCE, (result.losses, ref_losses)
    bad = _mismatches(workers, captured, ref_grads)
    assert not bad, sorted(bad.items(), key=lambda kv: -kv[1])[:5]
    assert all(w.exit_code == 0 for w in workers)


CASES = [
    # (workers, replicas, schedule, micro_batches, model)
    (2, None, "1f1b", 2, "gpt-micro"),
    (2, None, "gpipe", 4, "gpt-nano"),
    (3, None, "1f1b", 4, "gpt-nano"),
    (3, None, "gpipe", 2, "gpt-nano"),
    (4, None, "1f1b", 2, "gpt-nano"),
    (4, None, "gpipe", 4, "gpt-micro"),
    (4, [1, 2, 1], "1f1b", 4, "gpt-nano"),
    (3, [1, 2], "gpipe", 2, "gpt-nano"),
    (3, [2, 1], "gpipe", 2, "gpt-nano"),  # the first stage replicated: REDUCE once hung here (groups tagged by index)
    (4, [2, 2], "1f1b", 2, "gpt-nano"),
]


@pytest.mark.parametrize(("workers", "replicas", "schedule", "micro_batches", "model"), CASES,
                         ids=lambda v: str(v).replace(" ", "") if isinstance(v, list) else None)
def test_pipeline_equals_one_process(workers: int, replicas: list[int] | None, schedule: str, micro_batches: int, model: str,
                                     first_grads: dict) -> None:
    train = _train(model)
    cluster = cluster_config(workers, schedule=schedule, micro_batches=micro_batches, replicas=replicas, step_timeout=STEP_TIMEOUT)
    result, ws = run_in_process(train, cluster)
    _check(result, ws, first_grads, train)
    stages = {w.runtime.stage.index for w in ws}
    assert len(stages) == (len(replicas) if replicas else workers)
    holders = [i for i, w in enumerate(ws) if TIED in w.runtime.executor.trainable()]
    assert len(holders) >= 2  # the tied weight is shared by the first and the last stage: its all-reduce is checked
    if replicas:  # replicas of a stage end the step with the same (all-reduced) gradients and weights
        for s in stages:
            copies = [w for w in ws if w.runtime.stage.index == s]
            base = copies[0].runtime.state_tensors()
            for other in copies[1:]:
                for k, v in other.runtime.state_tensors().items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(base[k])), (s, k)


def test_numpy_worker_equals_one_process(first_grads: dict) -> None:
    """A NumPy worker (no autograd) in the middle of a torch pipeline: the same losses and gradients."""
    train = _train("gpt-nano")
    result, ws = run_in_process(train, cluster_config(3, schedule="1f1b", micro_batches=2), backends=["torch", "numpy", "torch"])
    assert isinstance(ws[1].runtime.backend, NumpyStage)
    _check(result, ws, first_grads, train)


def test_the_check_sees_a_skipped_all_reduce(first_grads: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the tied weight's all-reduce: each side keeps only its own part of the gradient, the
    losses of step 0 still agree, and the comparison names the tied weight."""
    monkeypatch.setattr(TorchStage, "set_flat_grads", lambda self, names, flat: None)
    train = _train("gpt-nano")
    result, ws = run_in_process(train, cluster_config(2, micro_batches=2))
    ref_losses, ref_grads = _reference(train)
    assert abs(result.losses[0] - ref_losses[0]) <= TOLERANCE * abs(ref_losses[0])
    bad = _mismatches(ws, first_grads, ref_grads)
    assert bad and all(TIED in k for k in bad), bad


# ---- the harness itself ------------------------------------------------------------------------------
def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


@functools.lru_cache(maxsize=1)
def _threads_after_one_run() -> frozenset[int]:
    """The threads a first cluster leaves for good: grpc's process-wide poller, started once."""
    run_in_process(_train("gpt-nano"), workers=1)
    return frozenset(_threads())


def test_async_cluster_authenticates_stays_quiet_and_leaves_nothing_running(capfd: pytest.CaptureFixture[str]) -> None:
    train = _train("gpt-nano")

    async def main() -> tuple[Any, InProcessCluster]:
        before = asyncio.all_tasks()
        async with InProcessCluster(train, cluster_config(2, micro_batches=2)) as c:
            running = asyncio.create_task(c.run())
            while not c.port and not running.done():
                await asyncio.sleep(0.01)
            stranger = RpcClient(f"127.0.0.1:{c.port}", COORDINATOR_SERVICE, "not-the-token-" * 3)
            with pytest.raises(AuthError):
                await stranger.call("Heartbeat", {"worker": 0}, timeout=10)
            await stranger.close()
            result = await running
        assert asyncio.all_tasks() - before == {asyncio.current_task()} - before
        return result, c

    threads = _threads() | _threads_after_one_run()
    result, c = asyncio.run(main())
    assert len(result.losses) == STEPS and all(np.isfinite(result.losses))
    assert len(c.token) == 64 and c.cluster.token == c.token and all(w.config.token == c.token for w in c.workers)
    assert any("waiting for 2 workers" in line for line in c.lines) and len(c.steps) == STEPS
    assert _threads() <= threads, [t.name for t in threading.enumerate()]
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)  # the coordinator's lines are kept in c.lines, not printed


def test_a_failing_step_stops_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker's first wait for a tensor raises: the run fails with the step's action grid, and
    no task, server or thread of the cluster is left. (Only one failing worker would leave the others
    waiting for their tensors until the step timeout before the coordinator reports it.)"""

    async def broken(self: Inbox, key: Any, timeout: float) -> Any:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Inbox, "get", broken)
    threads = _threads() | _threads_after_one_run()
    with pytest.raises(FusionError, match=r"(?s)injected failure.*action grid"):
        run_in_process(_train("gpt-nano"), cluster_config(2, micro_batches=2, step_timeout=STEP_TIMEOUT))
    assert _threads() <= threads


def test_a_worker_that_cannot_join_fails_the_run(capfd: pytest.CaptureFixture[str]) -> None:
    """A worker with another token is refused by the coordinator: the run fails at once (not after the
    join timeout), naming the worker, and the other worker and the coordinator are stopped."""
    threads = _threads() | _threads_after_one_run()
    with pytest.raises(HarnessError, match="worker 1 .*exited with status 2"):
        run_in_process(_train("gpt-nano"), workers=2, worker_options=[{}, {"token": "another-token-" * 3}])
    assert _threads() <= threads
    assert "refused" in capfd.readouterr().err


def test_bad_arguments_fail_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="backend 'tensorflow'"):
        InProcessCluster(_train("gpt-nano"), workers=2, backends=["torch", "tensorflow"])
    with pytest.raises(ConfigError, match="backends names 1 workers"):
        InProcessCluster(_train("gpt-nano"), workers=2, backends=["torch"])
