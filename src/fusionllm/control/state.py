"""Evaluation, checkpoints and resuming, with the weights staying where they are.

The validation loss is computed in the pipeline: every worker runs its forward-only program over
the validation batches and the stage holding the loss reports one number per micro-batch.
Checkpoints are written by the workers, one safetensors shard per stage, into a temporary
directory the coordinator then completes with the plan, the graph and ``state.json`` (the
manifest, with each shard's size and sha256) and renames: a checkpoint is whole or absent. A shard
the coordinator cannot see (a worker on another machine without a shared directory) is fetched
page by page and written here. Resuming hands the workers the checkpoint's path.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from fusionllm.core.checkpoints import (
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    prune_checkpoints,
)
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.transport.control import (
    Evaluate,
    Evaluated,
    GetState,
    SaveShard,
    ShardSaved,
    StatePage,
)
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.shards import shard_keys, write_shard

from .config import ClusterConfig, Run, Say
from .steps import inputs_for
from .task import RunTask
from .workers import Liveness

PAGE = 32 << 20  # bytes of state per GetState call


class Checkpoints:
    """Evaluation, checkpoints, state reads and the checkpoint to resume from, for any group's plan."""

    def __init__(self, train: TrainConfig, cluster: ClusterConfig, task: RunTask, live: Liveness, say: Say) -> None:
        self.train, self.cluster, self.task, self.live, self.say = train, cluster, task, live, say

    async def stage_states(self, run: Run, only: set[int] | None = None) -> dict[int, bytes]:
        """Each stage's (or the ``only`` ones') weights and AdamW state (safetensors bytes), from its
        first worker, in pages no larger than ``PAGE``."""
        return {s.index: await self.read_state(run, s.workers[0]) for s in run.plan.stages if only is None or s.index in only}

    async def read_state(self, run: Run, worker: int, *, outer: bool = False) -> bytes:
        """One worker's packed state (``outer``: its outer weights and momentum), page by page."""
        return await self.read_pages(run.clients[worker], worker, outer=outer)

    async def read_pages(self, client: RpcClient, worker: int, *, outer: bool = False) -> bytes:
        chunks: list[bytes] = []
        total, offset = None, 0
        while total is None or offset < total:
            ask = GetState(offset, PAGE, outer=outer).to_wire()  # a page asked again (a dropped link) is the same page
            page = StatePage.from_wire(await client.call_retrying("GetState", ask, within=self.cluster.step_timeout, timeout=self.cluster.step_timeout))
            total = page.total
            if not page.data and offset < total:
                raise FusionError(f"worker {worker} sent an empty page of its state at {offset} of {total} bytes")
            chunks.append(page.data)
            offset += len(page.data)
        return b"".join(chunks)

    async def evaluate(self, run: Run, batches: int, at_step: int, *, outer: bool = False, first: int = 0) -> float:
        """Validation loss of the current weights over batches ``first`` to ``first + batches - 1``,
        computed by the workers in the pipeline (the mean of its micro-batches' losses)."""
        c = self.cluster

        async def ask(w: int) -> Evaluated:
            inputs = None
            if w in run.fed:
                inputs = {str(j): inputs_for(run, w, *self.task.eval_batch(j, c.eval_batches)) for j in range(first, first + batches)}
            msg = Evaluate(at_step, batches, inputs, outer, first).to_wire()  # asked again after a dropped link: the worker answers with the same run
            return Evaluated.from_wire(await run.clients[w].call_retrying("Evaluate", msg, within=c.step_timeout, timeout=c.step_timeout))

        replies = await self.live.calls(run, {w: ask(w) for w in run.plan.workers})
        failed = [(w, r.failed) for w, r in replies.items() if r.failed is not None]
        if failed:
            w, why = failed[0]
            raise FusionError(f"evaluation failed on worker {w} at {why.action}: {why.error}")
        losses = [v for r in replies.values() for per_mb in r.losses.values() for v in per_mb.values()]
        if len(losses) != batches * run.plan.micro_batches:
            raise FusionError(f"evaluation: got {len(losses)} micro-batch losses, expected {batches * run.plan.micro_batches}")
        metrics = [v for r in replies.values() for per_mb in r.metrics.values() for v in per_mb.values()]
        # a task's metric (accuracy) where the loss's stage computed it for every micro-batch
        run.val_metric = sum(metrics) / len(metrics) if len(metrics) == len(losses) else None
        return sum(losses) / len(losses)

    async def checkpoint(self, run: Run, done: int, *, outer: bool = False, extra: dict | None = None, plan_json: str | None = None) -> None:
        """Every stage's shard, then the manifest. ``outer`` (hierarchical mode): the shards hold
        ``run``'s group's outer weights and momentum (``extra`` goes into ``state.json``)."""
        tmp, final = begin_checkpoint(self.cluster.checkpoint_dir or "", done)

        async def save(stage: int, w: int) -> ShardSaved:
            msg = SaveShard(str(tmp), done, outer=outer).to_wire()
            c = self.cluster  # asked again after a dropped link: the worker answers with the same write
            return ShardSaved.from_wire(await run.clients[w].call_retrying("SaveShard", msg, within=c.step_timeout, timeout=c.step_timeout))

        saved = dict(zip([s.index for s in run.plan.stages],
                         await asyncio.gather(*(save(s.index, s.workers[0]) for s in run.plan.stages)), strict=True))
        shards = {}
        for k, shard in saved.items():
            path = tmp / f"stage-{k}.safetensors"
            if not (path.is_file() and path.stat().st_size == shard.nbytes):  # written on another machine: fetch it
                data = await self.read_state(run, next(s.workers[0] for s in run.plan.stages if s.index == k), outer=outer)
                _, digest = await asyncio.to_thread(write_shard, tmp, k, data)
                shard = ShardSaved(str(path), len(data), digest)
            shards[str(k)] = {"nbytes": shard.nbytes, "sha256": shard.sha256}
        state = {"step": done, "data_position": done, "train": asdict(self.train), "shards": shards,
                 "cluster": {k: v for k, v in asdict(self.cluster).items() if k not in ("token", "tls")}, **(extra or {})}
        files = {"plan.json": plan_json or run.plan_json, "graph.json": run.graph_json or run.graph.to_json(),
                 "state.json": json.dumps(state, indent=1)}
        await asyncio.to_thread(finish_checkpoint, tmp, final, files)
        self.say(f"checkpoint {final}")
        if self.cluster.keep_checkpoints:
            await asyncio.to_thread(prune_checkpoints, self.cluster.checkpoint_dir, self.cluster.keep_checkpoints)

    def resume(self, graph: OpGraph) -> tuple[str, int] | None:
        """The newest complete checkpoint's path (the workers read their shards) and its step,
        checked against this run; None when there is none."""
        path = latest_checkpoint(self.cluster.checkpoint_dir or "")
        if path is None:
            self.say(f"--resume: no complete checkpoint in {self.cluster.checkpoint_dir}; starting from step 0")
            return None
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"checkpoint {path} is unreadable: {exc}") from None
        for key in ("model", "seq_len", "batch_size", "seed"):
            if state["train"].get(key) != asdict(self.train).get(key):
                raise ConfigError(f"--resume: checkpoint {path} was made with {key}={state['train'].get(key)!r}, this run has {asdict(self.train).get(key)!r}")
        have: set[str] = set()
        for f in sorted(path.glob("stage-*.safetensors")):
            have.update(shard_keys(f))
        missing = [f"param/{p}" for p in graph.params if f"param/{p}" not in have]
        if missing:
            raise ConfigError(f"--resume: checkpoint {path} lacks {missing[:4]}")
        for k, meta in state.get("shards", {}).items():
            f = path / f"stage-{k}.safetensors"
            if f.stat().st_size != meta["nbytes"]:
                raise ConfigError(f"checkpoint {path}: {f.name} has {f.stat().st_size} bytes, the manifest says {meta['nbytes']} (damaged)")
        step = int(state["step"])
        self.say(f"resuming from {path} at step {step}")
        return str(path), step
