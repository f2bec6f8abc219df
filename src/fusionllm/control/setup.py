"""Making a plan and handing it out: trace, measure, schedule, place, validate, assign.

A worker receives the graph, the plan, its peers' addresses, the hyper-parameters, where to read
its data, and its stage's tensors: from the coordinator's fresh model (the first start), from the
weights carried over by a re-plan, or, on resume and recovery, as the path of a checkpoint whose
shards it reads itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
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
from .collectives import RendezvousStore, World, carried_links, find_worlds, world_prefix
from .config import Run
from .context import RunContext
from .limits import check_message_sizes
from .plan_view import plan_event, plan_lines
from .reach import Reachability, routes
from .state import Checkpoints


class Setup:
    """Trace, plan, place, validate, size and assign: a plan in force (``Run``) for the members."""

    def __init__(self, ctx: RunContext, checkpoints: Checkpoints, reach: Reachability, rendezvous: RendezvousStore) -> None:
        self.ctx, self.checkpoints, self.reach, self.rendezvous = ctx, checkpoints, reach, rendezvous
        self.train, self.cluster, self.task, self.membership, self.say = ctx.train, ctx.cluster, ctx.task, ctx.membership, ctx.say
        self.plan_record: dict[str, Any] = {}  # the plan in force as a metrics record (a new plan writes it again)
        self._measured: dict[tuple[int, int], float] = {}
        self._probed: tuple[tuple[Any, ...], Any] | None = None  # the members last probed and what was measured
        self.calibration: dict[int, float] = {}  # device speeds fitted to measured steps (control/calibration.py): every later plan uses them

    @property
    def measured(self) -> dict[tuple[int, int], float]:
        """Links measured far slower than planned (a re-plan plans with them)."""
        return self._measured

    @measured.setter
    def measured(self, links: dict[tuple[int, int], float]) -> None:
        self._measured = links
        self._probed = None  # a re-plan measures the links again

    async def setup(self, *, recover: bool = False, carry: tuple[list[Any], int] | None = None, graph: OpGraph | None = None,
                    alone: int | None = None) -> Run:
        """The plan of a synchronous run (one group) over every member. Its weights: ``carry``
        (a re-plan: the states and the step they are at), the newest checkpoint (``--resume``, or
        ``recover``), or the task's initial state. ``graph``: the model already traced (a restart
        that checked the workers' live state against it); ``alone``: one stage on that worker, one
        micro-batch (the fastest device alone, a finalist)."""
        t, c, clock = self.train, self.cluster, self.ctx.clock
        if graph is None:
            graph = await asyncio.to_thread(self.task.trace, t.batch_size // (1 if alone is not None else c.micro_batches))  # minutes for a large model: heartbeats go on
        states: list[Any] = []  # safetensors blobs (or TensorSources) holding every tensor; each stage gets its own by name
        load: str | None = None
        clock.start_at(0)
        if carry is not None:  # a re-plan: the weights and AdamW state as they are now
            states, step = carry
            clock.start_at(step)
        elif c.resume or recover:
            found = self.checkpoints.resume(graph)
            if found is not None:
                load, step = found
                clock.start_at(step)
        if carry is None and load is None:
            states = [await asyncio.to_thread(self.task.initial_state)]
        addresses = {m.id: m.address for m in self.membership.members.values()}
        clients = {w: RpcClient(a, WORKER_SERVICE, c.token, tls=c.tls, incarnation=self.membership.incarnation) for w, a in addresses.items()}
        replicas = None if recover or len(self.membership.members) != c.workers else c.replicas  # a hand-made layout no longer fits fewer workers
        if c.scheduler and replicas:
            raise ConfigError("--replicas sets the plan by hand; leave out --scheduler (or --replicas)")
        codec = parse_codec(c.compress)
        if alone is not None:
            plan = make_plan(graph, 1, schedule=c.schedule, micro_batches=1)
            plan.stages[0].workers = [alone]
            cost = await self.cost(graph, clients) if codec.adaptive else None
        elif c.scheduler:
            graph, plan, cost = await self.schedule(graph, clients)
        else:
            plan = make_plan(graph, len(self.membership.members), replicas=replicas, schedule=c.schedule, micro_batches=c.micro_batches)
            cost = await self.cost(graph, clients) if codec.adaptive else None
        infos = {w: m.info for w, m in self.membership.members.items()}
        run = await self.placed_run(graph, plan, clients)
        plan = run.plan
        if codec.adaptive:
            run.policy = self.adatopk(plan, cost, t.batch_size)
        run.worlds = await self.worlds(run, infos, cost)
        carried = sorted(carried_links(run.worlds))
        if carried:  # the simulator prices them as gloo's (sim.simulator.with_carried); the plan metrics record lists them
            plan.meta["carried"] = [list(p) for p in carried]
            if cost is not None and "predicted_step_s" in plan.meta:
                from fusionllm.planning.predict import predict

                req = Request(t.batch_size, self.task.items_per_row, plan.micro_batches, plan.schedule)
                plan.meta["predicted_step_s"] = await asyncio.to_thread(predict, plan, cost, req)
        for line in plan_lines(run, addresses, self.membership.members):
            self.say(line)
        for line in self.reach.relay_lines(addresses):
            self.say(line)
        await self.assign(run, addresses, states, load, codec)
        self.plan_record = plan_event(run, addresses, self.membership.members, cost, epoch=clock.epoch, scheduler=c.scheduler)
        self.ctx.status.event(self.plan_record)
        return run

    async def placed_run(self, graph: OpGraph, plan: Plan, clients: dict[int, RpcClient]) -> Run:
        """One group's plan as it will run, the building block of every grouping's set-up: each stage
        on workers that run its op kinds, validated (``InvalidPlan`` names the first broken rule), no
        message over the transport's limits."""
        infos = {w: m.info for w, m in self.membership.members.items()}
        plan = await asyncio.to_thread(place, graph, plan, infos, self.say, self.task.refused_ops)
        programs = await asyncio.to_thread(validate_plan, graph, plan)
        await asyncio.to_thread(check_message_sizes, graph, plan)
        return Run(graph, plan, clients, actions=programs)

    def adatopk(self, plan: Plan, cost: Any, batch: int, *, indent: str = "") -> Any:
        """AdaTopK's link policy for ``plan`` (each group has its own)."""
        from fusionllm.planning.adatopk import adatopk_policy

        policy, _ = adatopk_policy(plan, cost, Request(batch, self.task.items_per_row, plan.micro_batches))
        slow = {f"w{a}->w{b}": round(r, 4) for (a, b), r in policy.ratios().items() if r < 1}
        self.say(f"{indent}adatopk: compressed links {slow or 'none (no codec predicts a shorter step)'}")
        return policy

    def data_spec(self, rows: int | None) -> Any:
        """The run's data (``ctx.data_spec``) as a group that reads ``rows`` rows per step reads it
        (None: the run's own batch): validation cuts the same windows into batches of that size."""
        spec, t = self.ctx.data_spec, self.train
        if spec is None or rows is None:
            return spec
        return replace(spec, batch_size=rows, eval_batches=self.cluster.eval_batches * (t.batch_size // rows))

    async def assign(self, run: Run, addresses: dict[int, str], states: list[Any], load: str | None, codec: Any, *,
                     rows: int | None = None) -> None:
        """Hand ``run``'s plan out: each worker its program, its stage's tensors, its peers; ``rows``:
        the rows a step of its group reads (None: the run's batch)."""
        t, c = self.train, self.cluster
        data_spec = self.data_spec(rows)
        graph, plan = run.graph, run.plan
        hyper = Hyper(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, recv_timeout=c.step_timeout, compress=str(codec),
                      seed=t.seed, precision=t.precision,
                      recompute=t.recompute, numeric_guard=c.numeric_guard, guard_factor=c.guard_factor)
        graph_json, plan_json = graph.to_json(), plan.to_json()
        infos = {w: m.info for w, m in self.membership.members.items()}
        replies: dict[int, Assigned] = {}
        collective = self.collectives(run.worlds)

        async def assign(w: int) -> None:
            stage = plan.stage_of_worker(w)
            names = set(plan.stage_params(graph, stage.index))
            blob = await asyncio.to_thread(read_selected, states, stage_keep(names)) if states else b""
            peers, data, through = routes(infos, w)  # LAN addresses between workers behind one NAT (reach.py)
            head = Assign(worker=w, graph=graph_json, plan=plan_json, addresses={str(k): v for k, v in {**addresses, **peers}.items()}, hyper=hyper,
                          nbytes=len(blob), epoch=self.ctx.clock.epoch, data_addresses={str(k): v for k, v in data.items() if v}, data=data_spec,
                          load=load, program=[str(a) for a in run.actions[w]], hier=run.hier,  # what the validator checked is what the worker runs
                          step=self.ctx.clock.start_step, relayed=through, collective=collective.get(w))
            frames = [pack(head.to_wire())] + [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)]
            # made again on a dropped link: a worker changes nothing before it has read the whole assignment, and a repeat
            # of one it took builds the same stage again
            replies[w] = Assigned.from_wire(await run.clients[w].push_retrying("Assign", frames, within=c.step_timeout, timeout=c.step_timeout))
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
        run.graph_json, run.plan_json = graph_json, plan_json

    async def worlds(self, run: Run, infos: dict[int, Any], cost: Any) -> list[World]:
        """The plan's torch.distributed groups (``--collectives auto``): fast, uncompressed links between torch workers."""
        c = self.cluster
        if c.collectives == "off":
            return []
        hw = getattr(cost, "hw", None)
        members = sorted(self.membership.members.values(), key=lambda m: m.id)
        # a cluster file's rates judge the links, not host names (the testbed's namespaces share one host name)
        if hw is None and c.hardware and all(m.origin >= 0 for m in members):
            from fusionllm.planning.choose import hardware_from_file

            hw = await asyncio.to_thread(lambda: hardware_from_file(c.hardware, c.workers).subset([m.origin for m in members]))
        ratios = run.policy.ratios() if run.policy is not None else None
        return await asyncio.to_thread(find_worlds, run.graph, run.plan, run.actions, infos, compress=c.compress,
                                       ratios=ratios, bps=hw.bps if hw is not None else None, hosts=not c.hardware)

    def collectives(self, worlds: list[World]) -> dict[int, Collective]:
        """Per member of a world, where and how it forms its process group."""
        if not worlds:
            return {}
        host = self.cluster.listen.rpartition(":")[0].strip("[]")
        store = f"{'' if host in ('', '0.0.0.0', '::') else host}:{self.rendezvous.port()}"  # an empty host: as the worker joined
        return {w: Collective(store, world_prefix(self.cluster.token, self.ctx.clock.epoch, world.index), list(world.workers), world.backend, world.index,
                              [list(g) for g in world.reduce], [list(p) for p in world.carries])
                for world in worlds for w in world.workers}

    async def hardware(self, clients: dict[int, RpcClient], *, calibrated: bool = True) -> Any:
        """The members' devices and links: from --hardware's file, or probed; with the device speeds
        fitted to measured steps (``calibration``) unless ``calibrated`` is False."""
        from fusionllm.cost.model import calibrated_hardware

        hw = await self._hardware(clients)
        return calibrated_hardware(hw, self.calibration) if calibrated and self.calibration else hw

    async def _hardware(self, clients: dict[int, RpcClient]) -> Any:
        from fusionllm.control.probe import probe_hardware
        from fusionllm.planning.choose import hardware_from_file, with_measured_links

        c = self.cluster
        members = sorted(self.membership.members.values(), key=lambda m: m.id)
        if c.hardware and all(m.origin >= 0 for m in members):  # after a loss: the file's rows of the workers left
            hw = hardware_from_file(c.hardware, c.workers).subset([m.origin for m in members])
            return with_measured_links(hw, self.measured)
        if self._probed is not None and len(self._probed[0]) == len(members) and all(a is b for a, b in zip(self._probed[0], members, strict=True)):
            return self._probed[1]  # the same members since the last probe (--sync auto plans groups, then one group): measured once
        ref = await asyncio.to_thread(self.task.reference_flops)
        hw = await probe_hardware(self.membership.members, clients, seconds=c.probe_seconds, say=self.say, reference_flops=ref)
        self._probed = (tuple(members), hw)
        return hw

    async def cost(self, graph: OpGraph, clients: dict[int, RpcClient]) -> Any:
        from fusionllm.cost.model import CostModel

        hw = await self.hardware(clients)
        return CostModel(graph, await asyncio.to_thread(self.task.estimate, graph), hw, recompute=self.train.recompute)

    async def schedule(self, graph: OpGraph, clients: dict[int, RpcClient]) -> tuple[OpGraph, Plan, Any]:
        """OP-Fence (or another --scheduler) over the members."""
        from fusionllm.planning.choose import choose_plan
        from fusionllm.schedule.plan import Request

        t, c = self.train, self.cluster
        hw = await self.hardware(clients)
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

