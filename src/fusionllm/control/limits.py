"""The largest message a plan's programs can produce, against the transport's limits.

A run must never die on a message size (gpt2 once trained three steps on local:3 and then failed
with ``Sent message larger than max (352034408 vs. 268435456)``, pulling a stage's weights in one
gRPC message). Every kind of message is bounded here from the plan alone, before anything starts:

- control calls (gRPC, ``MAX_MESSAGE``): the assignment's head (graph and plan JSON), Step and
  its reply (they grow with micro-batches and links, not with the model), a page of state;
- weights in an assignment: ``CHUNK``-sized frames of one stream;
- tensors between workers (the data plane, the worker's ``max_payload``): one micro-batch's
  activation or gradient of a cut edge, and one all-reduce chunk of a replicated stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionllm.core.errors import ConfigError
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.plan import Plan, routes, shared_groups
from fusionllm.schedule.validate import programs
from fusionllm.transport.control import Assign, Hyper, StatePage, StepDone
from fusionllm.transport.frames import CHUNK
from fusionllm.transport.messages import MAX_MESSAGE, pack

from .state import PAGE

DATA_PLANE_MAX = 8 << 30  # WorkerConfig.max_payload's default


@dataclass(frozen=True)
class MessageSizes:
    assign_head: int  # graph + plan JSON + addresses + the longest program: the largest control message at setup
    weight_frame: int
    state_page: int
    step_reply: int  # a Step's reply with every link reported
    tensor: int  # the largest activation or gradient of one micro-batch on a cut edge
    reduce_chunk: int  # the largest ring all-reduce chunk of a replicated stage's gradients

    def control(self) -> int:
        return max(self.assign_head, self.weight_frame, self.state_page, self.step_reply)


def message_sizes(graph: OpGraph, plan: Plan, *, addresses: int | None = None) -> MessageSizes:
    n = addresses if addresses is not None else max(plan.workers) + 1
    progs = programs(graph, plan)
    longest = max(progs.values(), key=lambda p: sum(len(str(a)) for a in p)) if progs else []
    head = Assign(worker=n - 1, graph=graph.to_json(), plan=plan.to_json(), addresses={str(w): f"255.255.255.255:{65535}" for w in range(n)},
                  hyper=Hyper(lr=1.0), nbytes=1 << 40, epoch=1 << 30, data_addresses={str(w): "255.255.255.255:65535" for w in range(n)},
                  program=[str(a) for a in longest])
    reply = StepDone(losses={str(mb): 1.0 for mb in range(plan.micro_batches)}, bytes_to={str(w): 1 << 50 for w in range(n)},
                     link_stats={str(w): [float(1 << 50), 1e9, 1e9] for w in range(n)})
    r = routes(graph, plan)
    edges = graph.edges()
    tensor = max((edges[e].meta.nbytes for e in r.producer if r.consumers.get(e) and r.producer[e] >= 0), default=0)
    reduce_chunk = 0
    for groups in shared_groups(graph, plan).values():
        for group, _, nbytes in groups:
            reduce_chunk = max(reduce_chunk, -(-int(nbytes) // len(group)))  # one chunk per member of the ring
    return MessageSizes(
        assign_head=len(pack(head.to_wire())), weight_frame=CHUNK, state_page=len(pack(StatePage(b"\0" * 16, 1 << 50).to_wire())) + PAGE,
        step_reply=len(pack(reply.to_wire())), tensor=tensor, reduce_chunk=reduce_chunk,
    )


def check_message_sizes(graph: OpGraph, plan: Plan, *, max_message: int = MAX_MESSAGE, max_payload: int = DATA_PLANE_MAX) -> MessageSizes:
    """The plan's message sizes, or a ConfigError naming the one over its limit and what to do."""
    sizes = message_sizes(graph, plan)
    if sizes.control() > max_message:
        raise ConfigError(f"a control message of this plan would be {sizes.control():,} bytes, over the limit of {max_message:,} "
                          f"(assignment head {sizes.assign_head:,}): the graph is too large to ship; report it")
    big = max(sizes.tensor, sizes.reduce_chunk)
    if big > max_payload:
        raise ConfigError(f"a tensor of this plan would be {big:,} bytes, over the workers' limit of {max_payload:,}: "
                          "use more micro-batches (smaller activations) or raise the workers' --max-payload")
    return sizes
