"""Making a plan and handing it out: trace, measure, schedule, place, validate, assign.

A worker receives the graph, the plan, its peers' addresses, the hyper-parameters, where to read
its data, and its stage's tensors: from the coordinator's fresh model (the first start), from the
weights carried over by a re-plan, or, on resume and recovery, as the path of a checkpoint whose
shards it reads itself.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan, Request, make_plan
from fusionllm.schedule.validate import validate_plan
from fusionllm.transport.control import WORKER_SERVICE, Assign, Assigned, Collective, Hyper
from fusionllm.transport.frames import CHUNK
from fusionllm.transport.messages import pack
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.shards import read_selected, stage_keep

from .capabilities import backend_of, place
from .collectives import World, carried_links, find_worlds, world_prefix
from .config import Run
from .limits import check_message_sizes
from .reach import routes


class SetupMixin:
    """The coordinator's planning half (``Coordinator`` mixes it in)."""

    async def _setup(self, *, recover: bool = False, carry: tuple[list[bytes], int] | None = None, graph: OpGraph | None = None) -> Run:
        """``graph``: the model already traced (a restart that checked the workers' live state against it)."""
        t, c = self.train, self.cluster
        if graph is None:
            graph = await asyncio.to_thread(self.task.trace, t.batch_size // c.micro_batches)  # minutes for a large model: heartbeats go on
        states: list[Any] = []  # safetensors blobs (or TensorSources) holding every tensor; each stage gets its own by name
        load: str | None = None
        self.start_step = 0
        if carry is not None:  # a re-plan: the weights and AdamW state as they are now
            states, self.start_step = carry
        elif c.resume or recover:
            load = self._resume(graph)
        if carry is None and load is None:
            states = [await asyncio.to_thread(self.task.initial_state)]
        addresses = {m.id: m.address for m in self.membership.members.values()}
        clients = {w: RpcClient(a, WORKER_SERVICE, c.token, tls=c.tls) for w, a in addresses.items()}
        replicas = None if recover or len(self.membership.members) != c.workers else c.replicas  # a hand-made layout no longer fits fewer workers
        if c.scheduler and replicas:
            raise ConfigError("--replicas sets the plan by hand; leave out --scheduler (or --replicas)")
        self.policy = None
        codec = parse_codec(c.compress)
        if c.scheduler:
            graph, plan, cost = await self._schedule(graph, clients)
        else:
            plan = make_plan(graph, len(self.membership.members), replicas=replicas, schedule=c.schedule, micro_batches=c.micro_batches)
            cost = await self._cost(graph, clients) if codec.kind == "adatopk" else None
        infos = {w: m.info for w, m in self.membership.members.items()}
        plan = await asyncio.to_thread(place, graph, plan, infos, self.say, self.task.refused_ops)  # each stage on workers that run its op kinds
        programs = await asyncio.to_thread(validate_plan, graph, plan)  # the plan shipped runs (InvalidPlan names the first broken rule)
        await asyncio.to_thread(check_message_sizes, graph, plan)  # and no message it makes exceeds the transport's limits
        if codec.kind == "adatopk":
            from fusionllm.control.adatopk import adatopk_policy
            self.policy, _ = adatopk_policy(plan, cost, Request(t.batch_size, self.task.items_per_row, plan.micro_batches))
            slow = {f"w{a}->w{b}": round(r, 4) for (a, b), r in self.policy.ratios().items() if r < 1}
            self.say(f"adatopk: compressed links {slow or 'none (no codec predicts a shorter step)'}")
        run = Run(graph, plan, clients, actions=programs)
        run.worlds = await self._worlds(run, infos, cost)
        carried = sorted(carried_links(run.worlds))
        if carried:  # the simulator prices them as gloo's (sim.simulator.with_carried); the plan metrics record lists them
            plan.meta["carried"] = [list(p) for p in carried]
            if cost is not None and "predicted_step_s" in plan.meta:
                from fusionllm.sim.simulator import simulate

                req = Request(t.batch_size, self.task.items_per_row, plan.micro_batches, plan.schedule)
                plan.meta["predicted_step_s"] = (await asyncio.to_thread(simulate, plan, cost, req)).step_time_s
        self._print_plan(run, addresses)
        await self._assign(run, addresses, states, load, codec)
        self.plan_record = self._plan_event(run, addresses, cost)
        self.status.event(self.plan_record)
        return run

    async def _assign(self, run: Run, addresses: dict[int, str], states: list[Any], load: str | None, codec: Any) -> None:
        t, c = self.train, self.cluster
        graph, plan = run.graph, run.plan
        hyper = Hyper(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, recv_timeout=c.step_timeout, compress=str(codec),
                      compress_roles=c.compress_roles, seed=t.seed, precision=t.precision,
                      recompute=t.recompute, guard=c.guard, guard_factor=c.guard_factor)
        graph_json, plan_json = graph.to_json(), plan.to_json()
        infos = {w: m.info for w, m in self.membership.members.items()}
        replies: dict[int, Assigned] = {}
        collective = self._collectives(run.worlds)

        async def assign(w: int) -> None:
            stage = plan.stage_of_worker(w)
            names = {p for nid in stage.nodes for p in graph.node(nid).params.values()}
            blob = await asyncio.to_thread(read_selected, states, stage_keep(names)) if states else b""
            peers, data, through = routes(infos, w)  # LAN addresses between workers behind one NAT (reach.py)
            head = Assign(worker=w, graph=graph_json, plan=plan_json, addresses={str(k): v for k, v in {**addresses, **peers}.items()}, hyper=hyper,
                          nbytes=len(blob), epoch=self.epoch, data_addresses={str(k): v for k, v in data.items() if v}, data=self.data_spec,
                          load=load, program=[str(a) for a in run.actions[w]], hier=run.hier,  # what the validator checked is what the worker runs
                          step=self.start_step, relayed=through, collective=collective.get(w))
            frames = [pack(head.to_wire())] + [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)]
            replies[w] = Assigned.from_wire(await run.clients[w].push("Assign", frames, timeout=c.step_timeout))
            if [Action.parse(a) for a in replies[w].actions] != run.actions[w]:
                raise FusionError(f"worker {w} runs another program than the one it was sent")

        await asyncio.gather(*(assign(w) for w in plan.workers))
        run.fed = {w for w, r in replies.items() if r.data != "own"}
        for w in sorted(run.fed):
            self.say(f"worker {w} reads no data of its own ({replies[w].data}); the coordinator sends its batches")
        if any(backend_of(infos[w]) != "torch" for w in plan.workers):
            self.say("backends: " + ", ".join(
                f"worker {w} {backend_of(infos[w])}" + ("" if replies[w].torch_loaded else " (torch not loaded)") for w in plan.workers
            ))
        self._graph_json, self._plan_json = graph_json, plan_json

    def _plan_event(self, run: Run, addresses: dict[int, str], cost: Any) -> dict[str, Any]:
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
            workers[str(w)] = {"address": addresses.get(w, m.address), "backend": backend_of(m.info), "device": m.info.device.kind,
                               "software": dict(m.info.software),
                               "site": hw.devices[w].site if hw is not None and w < len(hw) else None, "in_plan": w in plan.workers,
                               "relay": m.info.relay or None}
        bandwidth = {}
        if hw is not None:
            bandwidth = {f"w{a}->w{b}": hw.bps(a, b) for a in range(len(hw)) for b in range(len(hw)) if a != b and math.isfinite(hw.bps(a, b))}
        return {"event": "plan", "epoch": self.epoch, "scheduler": plan.meta.get("scheduler") or self.cluster.scheduler, "schedule": plan.schedule,
                "micro_batches": plan.micro_batches, "predicted_step_s": plan.meta.get("predicted_step_s"), "stages": stages,
                "workers": workers, "bandwidth_bps": bandwidth, "collectives": [world.record() for world in run.worlds],
                "carried": [f"w{a}->w{b}" for a, b in sorted(carried_links(run.worlds))]}

    async def _worlds(self, run: Run, infos: dict[int, Any], cost: Any) -> list[World]:
        """The plan's torch.distributed groups (``--collectives auto``): fast, uncompressed links between torch workers."""
        c = self.cluster
        if c.collectives == "off":
            return []
        hw = getattr(cost, "hw", None)
        members = sorted(self.membership.members.values(), key=lambda m: m.id)
        # a cluster file's rates judge the links, not host names (the testbed's namespaces share one host name)
        if hw is None and c.hardware and all(m.origin >= 0 for m in members):
            from fusionllm.control.planning import hardware_from_file

            hw = await asyncio.to_thread(lambda: hardware_from_file(c.hardware, c.workers).subset([m.origin for m in members]))
        ratios = self.policy.ratios() if self.policy is not None else None
        return await asyncio.to_thread(find_worlds, run.graph, run.plan, run.actions, infos, compress=c.compress, roles=c.compress_roles,
                                       ratios=ratios, bps=hw.bps if hw is not None else None, hosts=not c.hardware)

    def _collectives(self, worlds: list[World]) -> dict[int, Collective]:
        """Per member of a world, where and how it forms its process group."""
        if not worlds:
            return {}
        host = self.cluster.listen.rpartition(":")[0].strip("[]")
        store = f"{'' if host in ('', '0.0.0.0', '::') else host}:{self.rendezvous.port()}"  # an empty host: as the worker joined
        return {w: Collective(store, world_prefix(self.cluster.token, self.epoch, world.index), list(world.workers), world.backend, world.index,
                              [list(g) for g in world.reduce], [list(p) for p in world.carries])
                for world in worlds for w in world.workers}

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
        ref = await asyncio.to_thread(self.task.reference_flops)
        return await probe_hardware(self.membership.members, clients, seconds=c.probe_seconds, say=self.say, reference_flops=ref)

    async def _cost(self, graph: OpGraph, clients: dict[int, RpcClient]) -> Any:
        from fusionllm.cost.model import CostModel

        hw = await self._hardware(clients)
        return CostModel(graph, await asyncio.to_thread(self.task.estimate, graph), hw, recompute=self.train.recompute)

    async def _schedule(self, graph: OpGraph, clients: dict[int, RpcClient]) -> tuple[OpGraph, Plan, Any]:
        from fusionllm.control.planning import choose_plan
        from fusionllm.schedule.plan import Request

        t, c = self.train, self.cluster
        hw = await self._hardware(clients)
        req = Request(t.batch_size, self.task.items_per_row, c.micro_batches, c.schedule)
        work = await asyncio.to_thread(self.task.estimate, graph)
        infos = {w: m.info for w, m in self.membership.members.items()}

        def placed(p: Plan) -> Plan:  # capability placement inside the search: candidates are judged as they will run
            return place(graph, p, infos, lambda _: None, self.task.refused_ops)

        plan, cost = await asyncio.to_thread(choose_plan, graph, hw, c.scheduler, req, work=work, say=self.say,
                                             compress=str(parse_codec(c.compress)), place=placed, recompute=t.recompute)
        if plan.micro_batches != c.micro_batches:
            if t.batch_size % plan.micro_batches:
                raise FusionError(f"the scheduler chose {plan.micro_batches} micro-batches, which does not divide --batch-size {t.batch_size}")
            again = await asyncio.to_thread(self.task.trace, t.batch_size // plan.micro_batches)
            if [(n.id, n.kind) for n in again.nodes] != [(n.id, n.kind) for n in graph.nodes]:
                raise FusionError("the model traces differently at another micro-batch size; pass --micro-batches and a plan by hand")
            graph = again
        return graph, plan, cost

    def _print_plan(self, run: Run, addresses: dict[int, str]) -> None:
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
                dev = info.describe()
                self.say(f"  worker {w} ({dev} @ {addresses[w]}): stage {s.index}, {len(nodes)} ops, {params:,} params [{shown}]")
        for world in run.worlds:
            self.say(f"  {world.line()}")
        for line in self._relay_lines(addresses):
            self.say(line)
