"""`fusionllm coordinator`: wait for the workers, trace, plan, hand out stages, drive training.

Every step the coordinator sends each worker the token ids and targets of the micro-batches its
stage needs, the workers run their action lists (talking to each other directly), and the worker
holding the loss reports it back. Metrics, the progress callback and checkpoints happen here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import ConfigError, FusionError, TransportError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.data import Batcher, ByteTokenizer, load_corpus
from fusionllm.graph.ir import OpGraph
from fusionllm.models.spec import build_model
from fusionllm.runtime.checkpoint import (
    latest_checkpoint,
    pack_tensors,
    read_checkpoint,
    unpack_tensors,
    write_checkpoint,
)
from fusionllm.runtime.model_graph import model_tensors, trace_lm
from fusionllm.runtime.optim import lr_at
from fusionllm.runtime.peers import WORKER_SERVICE
from fusionllm.runtime.single import TrainConfig, TrainResult
from fusionllm.runtime.tensors import tensor_to_wire
from fusionllm.runtime.worker import COORDINATOR_SERVICE
from fusionllm.schedule.actions import Action, format_grid
from fusionllm.schedule.plan import Plan, make_plan, routes
from fusionllm.schedule.validate import validate_plan
from fusionllm.transport.frames import CHUNK
from fusionllm.transport.messages import pack
from fusionllm.transport.rpc import RpcClient, RpcServer
from fusionllm.transport.tls import TlsFiles

from .capabilities import backend_of, place
from .dashboard import Dashboard
from .membership import Membership
from .status import RunStatus


@dataclass(frozen=True)
class ClusterConfig:
    listen: str
    token: str
    workers: int
    schedule: str = "1f1b"
    micro_batches: int = 4
    replicas: list[int] | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    join_timeout: float = 300.0
    step_timeout: float = 600.0
    scheduler: str | None = None  # None: the plan balanced by parameters (or --replicas)
    hardware: str | None = None  # a cluster file to plan with; None: probe the workers
    probe_seconds: float = 1.0
    compress: str = "none"  # none | fp16 | bf16 | topk:R | topk-token:R | adatopk
    eval_every: int = 0  # validation loss at the coordinator every N steps (and at the end); 0: never
    eval_batches: int = 4
    dead_after_s: float = 10.0  # a worker whose heartbeat (every 2 s) is older than this is lost
    max_recoveries: int = 3  # re-plans after lost workers before giving up
    replan_factor: float = 2.0  # with a scheduler: re-plan when steps take this many times the prediction (0: never)
    max_replans: int = 2
    dashboard: str | None = None  # HOST:PORT of the live dashboard (dashboard.py)
    tls: TlsFiles | None = None  # mutual TLS on every connection (transport/tls.py)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.checkpoint_every < 0:
            raise ConfigError("--checkpoint-every must be >= 0")
        parse_codec(self.compress)  # a bad --compress fails before any worker is waited for
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every and --resume need --checkpoint-dir")


Say = Callable[[str], None]
OnStep = Callable[[dict], None]


class Replan(FusionError):
    """The plan is far from what it promised (a link slowed down): plan again from the current state."""

    def __init__(self, why: str, next_step: int) -> None:
        super().__init__(why)
        self.why, self.next_step = why, next_step


class WorkerLost(FusionError):
    """Workers of the plan died or hung; the run goes on without them."""

    def __init__(self, workers: set[int], why: str) -> None:
        super().__init__(f"lost worker(s) {sorted(workers)}: {why}")
        self.workers, self.why = set(workers), why


@dataclass
class _Run:
    graph: OpGraph
    plan: Plan
    clients: dict[int, RpcClient]
    actions: dict[int, list[Action]] = field(default_factory=dict)
    bytes_before: dict[str, int] = field(default_factory=dict)


class Coordinator:
    def __init__(self, train: TrainConfig, cluster: ClusterConfig, *, say: Say = print, on_step: OnStep = lambda _: None, on_ready: Callable[[int], None] = lambda _: None) -> None:
        self.train, self.cluster = train, cluster
        self.say, self.on_step, self.on_ready = say, on_step, on_ready
        if train.batch_size % cluster.micro_batches:
            raise ConfigError(f"--batch-size {train.batch_size} must be a multiple of --micro-batches {cluster.micro_batches}")
        self.membership = Membership(cluster.workers)
        self.server = RpcServer(
            COORDINATOR_SERVICE, cluster.token, role="coordinator",
            control={"Register": self.membership.register, "Heartbeat": self.membership.heartbeat, "NormReduce": self.membership.norm_reduce},
            tls=cluster.tls,
        )
        self.port = 0
        self.epoch = 0  # bumped by every recovery or re-plan; workers drop tensors of an earlier epoch
        self.recoveries = 0
        self.replans = 0
        self.status = RunStatus(train.model, train.steps)
        self.plan_record: dict[str, Any] = {}
        self._measured: dict[tuple[int, int], float] = {}  # links measured far slower than planned (a re-plan uses them)

    async def run(self) -> TrainResult:
        self.port = await self.server.start(self.cluster.listen)
        host = self.cluster.listen.rpartition(":")[0]
        self.on_ready(self.port)
        self.say(f"coordinator on {host}:{self.port}, waiting for {self.cluster.workers} workers")
        dashboard = Dashboard(self.status) if self.cluster.dashboard else None
        if dashboard is not None and self.cluster.dashboard:
            dash_port = await dashboard.start(self.cluster.dashboard)
            self.say(f"dashboard on http://{self.cluster.dashboard.rpartition(':')[0]}:{dash_port}/")
        run: _Run | None = None
        try:
            try:
                await asyncio.wait_for(self.membership.full.wait(), self.cluster.join_timeout)
            except asyncio.TimeoutError:
                raise FusionError(
                    f"only {len(self.membership.members)} of {self.cluster.workers} workers joined within "
                    f"{self.cluster.join_timeout:.0f} s; start them with: fusionllm worker --join {host}:{self.port} --token-file FILE"
                ) from None
            self.membership.state = "running"
            self.status.state = "planning"
            run = await self._setup()
            self.status.state = "running"
            with JsonlWriter(self.train.metrics) as metrics:
                metrics.write(self.plan_record)
                while True:
                    try:
                        return await self._train(run, metrics)
                    except WorkerLost as lost:
                        run = await self._recover(run, lost, metrics)
                    except Replan as again:
                        run = await self._replan(run, again, metrics)
        finally:
            self.membership.state = "finished"
            self.status.state = "finished"
            await self._shutdown(run)
            await self.server.stop(0.5)
            if dashboard is not None:
                await dashboard.stop()

    # ---- setup -----------------------------------------------------------------------------------
    async def _setup(self, *, recover: bool = False, carry: tuple[dict[str, Any], int] | None = None) -> _Run:
        t, c = self.train, self.cluster
        model = build_model(t.model, ByteTokenizer().vocab_size, seed=t.seed)
        block = getattr(getattr(model, "config", None), "block_size", None)
        if isinstance(block, int) and t.seq_len > block:
            raise ConfigError(f"--seq-len {t.seq_len} exceeds the model's block size {block}")
        graph = trace_lm(model, t.batch_size // c.micro_batches, t.seq_len, spec=t.model)
        tensors: dict[str, torch.Tensor] = {f"param/{k}": v for k, v in model_tensors(model).items()}
        self.start_step = 0
        if carry is not None:  # a re-plan: the weights and AdamW state as they are now
            tensors, self.start_step = {**tensors, **carry[0]}, carry[1]
        elif c.resume or recover:
            tensors = self._resume(tensors)
        addresses = {m.id: m.address for m in self.membership.members.values()}
        clients = {w: RpcClient(a, WORKER_SERVICE, c.token, tls=c.tls) for w, a in addresses.items()}
        replicas = None if recover else c.replicas  # a hand-made layout no longer fits fewer workers
        if c.scheduler and replicas:
            raise ConfigError("--replicas sets the plan by hand; leave out --scheduler (or --replicas)")
        self.model = model
        self.policy = None
        codec = parse_codec(c.compress)
        if c.scheduler:
            graph, plan, cost = await self._schedule(model, graph, clients)
        else:
            plan = make_plan(graph, len(self.membership.members), replicas=replicas, schedule=c.schedule, micro_batches=c.micro_batches)
            cost = await self._cost(model, graph, clients) if codec.kind == "adatopk" else None
        infos = {w: m.info for w, m in self.membership.members.items()}
        plan = await asyncio.to_thread(place, graph, plan, infos, self.say)  # each stage on workers that run its op kinds
        await asyncio.to_thread(validate_plan, graph, plan)  # the plan shipped runs (InvalidPlan names the first broken rule)
        if codec.kind == "adatopk":
            from fusionllm.control.adatopk import adatopk_policy
            from fusionllm.schedule.plan import Request

            self.policy, _ = adatopk_policy(plan, cost, Request(t.batch_size, t.seq_len, plan.micro_batches))
            slow = {f"w{a}->w{b}": round(r, 4) for (a, b), r in self.policy.ratios().items() if r < 1}
            self.say(f"adatopk: compressed links {slow or 'none (no codec predicts a shorter step)'}")
        self.membership.participants = set(plan.workers)
        run = _Run(graph, plan, clients)
        self._print_plan(run, addresses)
        hyper = {"lr": t.lr, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip, "recv_timeout": c.step_timeout, "compress": str(codec),
                 "compress_roles": os.environ.get("FUSIONLLM_COMPRESS_ROLES", "act,grad,reduce")}
        graph_json, plan_json = graph.to_json(), plan.to_json()
        data_addresses = {str(m.id): str(m.info["data_address"]) for m in self.membership.members.values() if m.info.get("data_address")}

        async def assign(w: int) -> None:
            stage = plan.stage_of_worker(w)
            names = {p for nid in stage.nodes for p in graph.node(nid).params.values()}
            mine = {k: v for k, v in tensors.items() if k.split("/")[-1] in names and (k.startswith("param/") or k.startswith("adam/"))}
            blob = pack_tensors(mine)
            head = pack({"worker": w, "graph": graph_json, "plan": plan_json, "addresses": {str(k): v for k, v in addresses.items()},
                         "data_addresses": data_addresses, "hyper": hyper, "nbytes": len(blob), "epoch": self.epoch})
            frames = [head] + [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)]
            reply = await clients[w].push("Assign", frames, timeout=c.step_timeout)
            run.actions[w] = [Action.parse(a) for a in reply["actions"]]
            torch_loaded[w] = bool(reply.get("torch_loaded", True))

        torch_loaded: dict[int, bool] = {}
        await asyncio.gather(*(assign(w) for w in plan.workers))
        if any(backend_of(infos[w]) != "torch" for w in plan.workers):
            self.say("backends: " + ", ".join(
                f"worker {w} {backend_of(infos[w])}" + ("" if torch_loaded[w] else " (torch not loaded)") for w in plan.workers
            ))
        self._graph_json, self._plan_json = graph_json, plan_json
        self.plan_record = self._plan_event(run, addresses, cost)
        self.status.event(self.plan_record)
        return run

    def _plan_event(self, run: _Run, addresses: dict[int, str], cost: Any) -> dict[str, Any]:
        """The plan as a metrics record (and for the dashboard): stages, workers, links."""
        graph, plan = run.graph, run.plan
        stages = []
        for s in plan.stages:
            nodes = [graph.node(n) for n in s.nodes]
            names = {p for n in nodes for p in n.params.values()}
            stages.append({"stage": s.index, "workers": list(s.workers), "ops": len(nodes), "params": sum(graph.params[p].meta.numel for p in names),
                           "layers": [n.name for n in nodes if not n.kind.startswith(("method", "function", "property"))]})
        hw = getattr(cost, "hw", None)
        workers = {}
        for w, m in self.membership.members.items():
            workers[str(w)] = {"address": addresses.get(w, m.address), "backend": backend_of(m.info), "device": m.info.get("device", {}).get("kind", "?"),
                               "site": hw.devices[w].site if hw is not None and w < len(hw) else None, "in_plan": w in plan.workers}
        bandwidth = {}
        if hw is not None:
            bandwidth = {f"w{a}->w{b}": hw.bps(a, b) for a in range(len(hw)) for b in range(len(hw)) if a != b and math.isfinite(hw.bps(a, b))}
        return {"event": "plan", "epoch": self.epoch, "scheduler": plan.meta.get("scheduler") or self.cluster.scheduler, "schedule": plan.schedule,
                "micro_batches": plan.micro_batches, "predicted_step_s": plan.meta.get("predicted_step_s"), "stages": stages,
                "workers": workers, "bandwidth_bps": bandwidth}

    async def _hardware(self, clients: dict[int, RpcClient]) -> Any:
        from fusionllm.control.planning import (
            hardware_from_file,
            probe_hardware,
            with_measured_links,
        )

        c = self.cluster
        members = sorted(self.membership.members.values(), key=lambda m: m.id)
        if c.hardware and all(m.origin >= 0 for m in members):  # after a loss: the file's rows of the workers left
            hw = hardware_from_file(c.hardware, c.workers).subset([m.origin for m in members])
            return with_measured_links(hw, self._measured)
        return await probe_hardware(self.membership.members, clients, seconds=c.probe_seconds, say=self.say)

    async def _cost(self, model: Any, graph: OpGraph, clients: dict[int, RpcClient]) -> Any:
        from fusionllm.cost.model import CostModel
        from fusionllm.runtime.model_graph import graph_source, root_source
        from fusionllm.runtime.profile import estimate

        hw = await self._hardware(clients)
        work = await asyncio.to_thread(estimate, graph, source=graph_source(graph) or root_source(model), calibrate=True)
        return CostModel(graph, work, hw)

    async def _schedule(self, model: Any, graph: OpGraph, clients: dict[int, RpcClient]) -> tuple[OpGraph, Plan, Any]:
        from fusionllm.control.planning import choose_plan
        from fusionllm.runtime.model_graph import graph_source, root_source
        from fusionllm.schedule.plan import Request

        t, c = self.train, self.cluster
        hw = await self._hardware(clients)
        req = Request(t.batch_size, t.seq_len, c.micro_batches, c.schedule)
        plan, cost = await asyncio.to_thread(choose_plan, graph, hw, c.scheduler, req, source=graph_source(graph) or root_source(model), say=self.say,
                                             compress=str(parse_codec(c.compress)))
        if plan.micro_batches != c.micro_batches:
            if t.batch_size % plan.micro_batches:
                raise FusionError(f"the scheduler chose {plan.micro_batches} micro-batches, which does not divide --batch-size {t.batch_size}")
            again = trace_lm(model, t.batch_size // plan.micro_batches, t.seq_len, spec=t.model)
            if [(n.id, n.kind) for n in again.nodes] != [(n.id, n.kind) for n in graph.nodes]:
                raise FusionError("the model traces differently at another micro-batch size; pass --micro-batches and a plan by hand")
            graph = again
        return graph, plan, cost

    def _resume(self, fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        path = latest_checkpoint(self.cluster.checkpoint_dir or "")
        if path is None:
            self.say(f"--resume: no complete checkpoint in {self.cluster.checkpoint_dir}; starting from step 0")
            return fresh
        state, tensors, _files = read_checkpoint(path)
        for key in ("model", "seq_len", "batch_size", "seed"):
            if state["train"].get(key) != asdict(self.train).get(key):
                raise ConfigError(f"--resume: checkpoint {path} was made with {key}={state['train'].get(key)!r}, this run has {asdict(self.train).get(key)!r}")
        missing = [k for k in fresh if k not in tensors]
        if missing:
            raise ConfigError(f"--resume: checkpoint {path} lacks {missing[:4]}")
        self.start_step = int(state["step"])
        self.say(f"resuming from {path} at step {self.start_step}")
        return tensors

    def _print_plan(self, run: _Run, addresses: dict[int, str]) -> None:
        self.say(f"plan: {len(run.plan.stages)} stages, schedule {run.plan.schedule}, {run.plan.micro_batches} micro-batches per step")
        for w in sorted(set(addresses) - set(run.plan.workers)):
            self.say(f"  worker {w} ({addresses[w]}): idle (the plan is faster without it)")
        for s in run.plan.stages:
            nodes = [run.graph.node(n) for n in s.nodes]
            params = sum(run.graph.params[p].meta.numel for p in {p for n in nodes for p in n.params.values()})
            names = [n.name for n in nodes if not n.kind.startswith(("method", "function", "property"))]
            shown = ", ".join(names[:4]) + (f" +{len(names) - 4}" if len(names) > 4 else "")
            for w in s.workers:
                info = self.membership.members[w].info
                dev = f"{info.get('device', {}).get('kind', '?')}, {backend_of(info)}"
                self.say(f"  worker {w} ({dev} @ {addresses[w]}): stage {s.index}, {len(nodes)} ops, {params:,} params [{shown}]")

    # ---- training ----------------------------------------------------------------------------------
    async def _train(self, run: _Run, metrics: JsonlWriter) -> TrainResult:
        t, c = self.train, self.cluster
        corpus = load_corpus(t.data)
        train_tokens, val_tokens = corpus.split(0.1)
        batches = Batcher(train_tokens, t.batch_size, t.seq_len, t.seed)
        val_batches = Batcher(val_tokens, t.batch_size, t.seq_len, t.seed)
        r = routes(run.graph, run.plan)
        tok_edge, tgt_edge = (n.outputs[0].id for n in run.graph.input_nodes)
        mb_size = t.batch_size // run.plan.micro_batches
        result = TrainResult(num_params=run.graph.num_params())
        started = time.perf_counter()
        self._recent: deque[float] = deque(maxlen=8)
        self._links: dict[tuple[int, int], tuple[int, float]] = {}
        for step in range(self.start_step, t.steps):
            lr = lr_at(step, lr=t.lr, steps=t.steps, warmup=t.warmup)
            x, y = batches.get(step)
            calls = {}
            for w in run.plan.workers:
                stage = run.plan.stage_of_worker(w).index
                inputs: dict[str, dict[str, bytes]] = {}
                for mb in run.plan.mbs_of(w):
                    feeds = {}
                    for edge, data in ((tok_edge, x), (tgt_edge, y)):
                        if stage in r.consumers.get(edge, []):
                            feeds[edge] = tensor_to_wire(data[mb * mb_size : (mb + 1) * mb_size])
                    inputs[str(mb)] = feeds
                extra = {}
                if self.policy is not None:  # adatopk: this worker's outgoing links
                    extra = {"ratios": {str(b): r for (a, b), r in self.policy.ratios().items() if a == w}}
                calls[w] = run.clients[w].call("Step", {"step": step, "lr": lr, "inputs": inputs, **extra}, timeout=c.step_timeout)
            replies = await self._step_calls(run, calls)
            if any("failed" in rep for rep in replies.values()):
                await self._raise_if_lost(run, "a step failed")
            self._check_failures(run, step, replies)
            losses = {int(mb): v for rep in replies.values() for mb, v in rep["losses"].items()}
            if len(losses) != run.plan.micro_batches:
                raise FusionError(f"step {step}: got losses of micro-batches {sorted(losses)}, expected {run.plan.micro_batches}")
            loss = sum(losses[m] for m in sorted(losses)) / len(losses)
            result.losses.append(loss)
            result.tokens = (step + 1 - self.start_step) * x.numel()
            elapsed = time.perf_counter() - started
            record = {
                "step": step, "loss": loss, "tokens": result.tokens, "elapsed_s": round(elapsed, 4),
                "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1), "lr": lr,
                "grad_norm": next(iter(replies.values()))["grad_norm"],
                "step_s": round(max(rep["seconds"] for rep in replies.values()), 4),
                "bytes": self._link_bytes(run, replies),
            }
            if "predicted_step_s" in run.plan.meta:
                record["predicted_step_s"] = round(run.plan.meta["predicted_step_s"], 4)
            if c.compress != "none":
                record["compress"] = c.compress
            for w, rep in replies.items():
                for dst, (nbytes, busy, *_) in rep.get("link_stats", {}).items():
                    got, took = self._links.get((w, int(dst)), (0, 0.0))
                    self._links[(w, int(dst))] = (got + nbytes, took + busy)
            if self.policy is not None:
                record["ratios"] = {f"w{a}->w{b}": round(r, 5) for (a, b), r in self.policy.ratios().items()}
                if step > self.start_step:  # the first step's sends also open the connections
                    for w, rep in replies.items():
                        for dst, (nbytes, busy, *messages) in rep.get("link_stats", {}).items():
                            self.policy.observe((w, int(dst)), nbytes, busy, messages[0] if messages else 1)
                            record.setdefault("link_stats", {})[f"w{w}->w{dst}"] = [nbytes, round(busy, 5), *messages]
                record["link_fit"] = {f"w{a}->w{b}": [round(self.policy.bps[(a, b)]), round(self.policy.fixed_s.get((a, b), 0.0), 5)]
                                      for (a, b) in self.policy.loads if (a, b) in self.policy.bps}
            if c.eval_every and ((step + 1) % c.eval_every == 0 or step + 1 == t.steps):
                paused = time.perf_counter()
                record["val_loss"] = await self._guard(run, self._evaluate(run, val_batches))
                result.val_losses.append((step, record["val_loss"]))
                started += time.perf_counter() - paused  # elapsed_s and tokens/s count training only
            metrics.write(record)
            self.status.step(record)
            self.on_step(record)
            done = step + 1
            if c.checkpoint_every and (done % c.checkpoint_every == 0 or done == t.steps):
                await self._guard(run, self._checkpoint(run, done))
            self._recent.append(record["step_s"])
            if done < t.steps:
                self._check_plan(run, done)
        result.elapsed_s = time.perf_counter() - started
        return result

    # ---- a plan gone wrong -------------------------------------------------------------------------
    def _check_plan(self, run: _Run, done: int) -> None:
        """Raise Replan when the last 8 steps took far longer than the plan's prediction."""
        c = self.cluster
        predicted = run.plan.meta.get("predicted_step_s")
        if not (c.scheduler and c.replan_factor > 0 and predicted and len(self._recent) == self._recent.maxlen):
            return
        if self.replans >= c.max_replans:
            return
        median = statistics.median(self._recent)
        if median > c.replan_factor * predicted:
            raise Replan(f"steps take {median:.2f} s, the plan predicted {predicted:.2f} s", done)

    def _measured_links(self) -> dict[tuple[int, int], float]:
        """Bits/s of the links that carried enough traffic lately to judge (bytes over busy time)."""
        return {link: got * 8 / took for link, (got, took) in self._links.items() if got >= 256 << 10 and took > 0}

    async def _replan(self, run: _Run, again: Replan, metrics: JsonlWriter) -> _Run:
        """Plan again with the links as measured, carrying the current weights and AdamW state over."""
        began = time.perf_counter()
        self.replans += 1
        self.say(f"re-planning: {again.why}")
        tensors: dict[str, Any] = {}
        for blob in (await self._guard(run, self._stage_states(run))).values():
            tensors.update(unpack_tensors(blob))
        self._measured = self._measured_links()
        await self._leave(run, set())
        old = run.plan.meta.get("predicted_step_s")
        run = await self._setup(carry=(tensors, again.next_step))
        event = {"event": "replan", "why": again.why, "at_step": again.next_step, "seconds": round(time.perf_counter() - began, 3),
                 "old_predicted_step_s": old, "predicted_step_s": run.plan.meta.get("predicted_step_s"),
                 "stages": len(run.plan.stages), "workers": sorted(run.plan.workers)}
        self._record(metrics, event)
        self.say(f"re-planned in {event['seconds']:.1f} s: {len(run.plan.stages)} stages on workers {event['workers']}")
        return run

    # ---- lost workers -----------------------------------------------------------------------------
    async def _step_calls(self, run: _Run, calls: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """Every worker's Step reply, watching heartbeats meanwhile: a dead or hung worker is lost
        within dead_after_s (killed processes at once: their calls fail)."""
        tasks = {w: asyncio.create_task(call) for w, call in calls.items()}
        try:
            while True:
                _, pending = await asyncio.wait(tasks.values(), timeout=1.0, return_when=asyncio.FIRST_EXCEPTION)
                errors = [t.exception() for t in tasks.values() if t.done() and not t.cancelled() and t.exception() is not None]
                if errors:
                    await self._raise_if_lost(run, str(errors[0]))
                    raise errors[0]  # type: ignore[misc]
                if not pending:
                    return {w: t.result() for w, t in tasks.items()}
                stale = set(self.membership.stale(self.cluster.dead_after_s)) & set(run.plan.workers)
                if stale:
                    raise WorkerLost(stale, f"no heartbeat for {self.cluster.dead_after_s:.0f} s")
        finally:
            for t in tasks.values():
                t.cancel()

    async def _guard(self, run: _Run, work: Any) -> Any:
        """Evaluation and checkpoints talk to workers too: a dead one there is a lost worker."""
        try:
            return await work
        except TransportError as exc:
            await self._raise_if_lost(run, str(exc))
            raise

    async def _raise_if_lost(self, run: _Run, why: str) -> None:
        async def alive(w: int) -> bool:
            try:
                await run.clients[w].call("Ping", {}, timeout=3)
                return True
            except FusionError:
                return False

        answers = await asyncio.gather(*(alive(w) for w in run.plan.workers))
        dead = {w for w, ok in zip(run.plan.workers, answers, strict=True) if not ok}
        dead |= set(self.membership.stale(self.cluster.dead_after_s)) & set(run.plan.workers)
        if dead:
            raise WorkerLost(dead, why)

    async def _recover(self, run: _Run, lost: WorkerLost, metrics: JsonlWriter) -> _Run:
        """Re-plan on the workers left (and spares that joined), from the newest complete checkpoint."""
        c = self.cluster
        began = time.perf_counter()
        self.recoveries += 1
        if self.recoveries > c.max_recoveries:
            raise FusionError(f"{lost}; gave up after {c.max_recoveries} recoveries")
        self.say(f"lost worker(s) {sorted(lost.workers)} ({lost.why}); re-planning on the others")

        async def abort(w: int) -> bool:
            try:
                await run.clients[w].call("Abort", {}, timeout=10)
                return True
            except FusionError:
                return False

        survivors = [w for w in run.plan.workers if w not in lost.workers]
        answers = await asyncio.gather(*(abort(w) for w in survivors))
        gone = set(lost.workers) | {w for w, ok in zip(survivors, answers, strict=True) if not ok}
        await self._leave(run, gone)
        if not self.membership.members:
            raise FusionError(f"{lost}; no worker is left")
        self.membership.renumber()
        run = await self._setup(recover=True)
        event = {"event": "recovery", "lost": sorted(gone), "workers": len(self.membership.members), "resumed_from_step": self.start_step,
                 "seconds": round(time.perf_counter() - began, 3), "why": lost.why}
        self._record(metrics, event)
        self.say(f"recovered in {event['seconds']:.1f} s: {event['workers']} workers, continuing from step {self.start_step}")
        return run

    async def _leave(self, run: _Run, lost: set[int]) -> None:
        """Drop a plan before making the next one: its clients, lost workers, norms in flight; a new epoch."""
        for client in run.clients.values():
            await client.close()
        self.membership.lose(lost)
        self.epoch += 1

    def _record(self, metrics: JsonlWriter, event: dict[str, Any]) -> None:
        """A new plan and the event that made it, in the metrics and on the dashboard."""
        metrics.write(self.plan_record)
        metrics.write(event)
        self.status.event(event)

    def _link_bytes(self, run: _Run, replies: dict[int, dict[str, Any]]) -> dict[str, int]:
        out = {}
        for w, rep in replies.items():
            for dst, total in rep["bytes_to"].items():
                link = f"w{w}->w{dst}"
                out[link] = total - run.bytes_before.get(link, 0)
                run.bytes_before[link] = total
        return out

    def _check_failures(self, run: _Run, step: int, replies: dict[int, dict[str, Any]]) -> None:
        failed = [(w, rep["failed"]) for w, rep in replies.items() if "failed" in rep]
        if not failed:
            return
        # the first failure in time is usually the cause; others are workers left waiting
        w, info = min(failed, key=lambda f: ("Timeout" in f[1]["error"], f[0]))
        grid = format_grid({f"worker {k}": v for k, v in sorted(run.actions.items())}, (f"worker {w}", int(info["index"])))
        raise FusionError(f"step {step} failed on worker {w} at {info['action']}: {info['error']}\naction grid (the failing action is marked !):\n{grid}")

    async def _stage_states(self, run: _Run) -> dict[int, bytes]:
        """Each stage's weights and AdamW state (safetensors bytes), from its first worker."""
        out = {}
        for s in run.plan.stages:
            reply = await run.clients[s.workers[0]].call("GetState", {}, timeout=self.cluster.step_timeout)
            out[s.index] = reply["state"]
        return out

    async def _gather_weights(self, run: _Run) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for blob in (await self._stage_states(run)).values():
            out.update(unpack_tensors(blob))
        return out

    async def _evaluate(self, run: _Run, batches: Batcher) -> float:
        """Validation loss of the current weights, gathered from the stages, on this process."""
        from fusionllm.runtime.single import evaluate

        state = await self._gather_weights(run)
        named = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        with torch.no_grad():
            for key, value in state.items():
                if key.startswith("param/") and key[6:] in named:
                    named[key[6:]].copy_(value)
        return await asyncio.to_thread(evaluate, self.model, batches, self.cluster.eval_batches)

    async def _checkpoint(self, run: _Run, done: int) -> None:
        states = await self._stage_states(run)
        for blob in states.values():
            unpack_tensors(blob)  # refuse to write a checkpoint we could not read back
        files = {"plan.json": self._plan_json, "graph.json": self._graph_json}
        state = {"data_position": done, "train": asdict(self.train), "cluster": {k: v for k, v in asdict(self.cluster).items() if k != "token"}}
        path = write_checkpoint(self.cluster.checkpoint_dir or "", done, states, files, state)
        self.say(f"checkpoint {path}")

    async def _shutdown(self, run: _Run | None) -> None:
        clients = run.clients.values() if run else [RpcClient(m.address, WORKER_SERVICE, self.cluster.token, tls=self.cluster.tls) for m in self.membership.members.values()]
        for client in clients:
            with contextlib.suppress(FusionError):  # already gone: its heartbeat tells it the rest
                await client.call("Shutdown", {}, timeout=5)
            await client.close()


def run_coordinator(train: TrainConfig, cluster: ClusterConfig, **kwargs: Any) -> TrainResult:
    return asyncio.run(Coordinator(train, cluster, **kwargs).run())


__all__ = ["ClusterConfig", "Coordinator", "run_coordinator"]
