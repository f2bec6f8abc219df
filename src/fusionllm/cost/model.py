"""The cost model: how long each action takes on a device or a link, and what a stage needs in memory.

Compute: a calibrated op time (measured on one reference CPU thread) runs at the device's speed;
an accelerator runs an op's counted FLOPs at ``gpu_efficiency`` of its peak. A transfer costs the
link latency, a per-message overhead, and its bytes at the link's rate (times the codec ratio).
``latency(src, dst)`` is one-way: a message arrives one latency after its transfer, and a sender that
waits for the ack (the data plane acks every tensor) waits one more, the reverse direction's.

A link that a ``torch.distributed`` world carries (``carried``: activations and gradients through
gloo's isend/irecv, ``runtime/dist/carrier.py``) costs gloo's measured time for its size (no codec, no
data-plane framing, no per-message overhead of the data plane), never less than its bytes at the
link's rate, and a fraction of the data plane's CPU per message (no copies into frames).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph

REFERENCE_FLOPS = 5e10  # one reference CPU thread, when ops are not calibrated
HEADER_BYTES = 120  # frame header and gRPC framing of one tensor message
# gloo isend/irecv of one tensor between two processes on 127.0.0.1, the receiver's wall time
# (bytes, seconds): benchmarks/collectives.py, benchmarks/results/collectives.md (1-64 MB:
# 0.52-1.93 GB/s; the data plane measured 0.45-0.22 GB/s on the same sizes).
GLOO_P2P_SECONDS = ((1 << 20, 2.0e-3), (4 << 20, 5.5e-3), (16 << 20, 14.1e-3), (64 << 20, 34.8e-3))


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through ``points`` (x ascending), extended past the ends along the end
    segments, never below the smallest measured time's share of x (times stay positive)."""
    xs = [p[0] for p in points]
    k = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return max(y, min(p[1] for p in points) * min(1.0, x / xs[0]))


def calibrated_hardware(hw: Hardware, speed: Mapping[int, float]) -> Hardware:
    """``hw`` with device ``i`` ``speed[i]`` times as fast: an accelerator's flop/s, or a CPU device's
    core speed (``Device.speed``: each action, its compute, messages and codecs, takes that much less
    CPU, its quota unchanged). Factors are measured against the uncalibrated hardware, so they are
    applied to it, once."""
    devices = list(hw.devices)
    for i, f in speed.items():
        if 0 <= i < len(devices) and f > 0 and math.isfinite(f):
            d = devices[i]
            devices[i] = replace(d, flops=d.flops * f) if d.flops else replace(d, speed=d.speed * f)
    return replace(hw, devices=tuple(devices))


@dataclass
class CostModel:
    graph: OpGraph
    work: dict[str, OpWork]
    hw: Hardware
    gpu_efficiency: float = 0.4  # achieved / peak for transformer blocks on accelerators
    op_overhead_s: float = 2e-5  # dispatch of one op (an op measured at one micro-batch size only)
    # The per-micro-batch and per-step CPU of the runtime, measured as CPU seconds per step of each
    # testbed worker (/proc/PID/stat) against the micro-batch count, on a model whose ops cost next
    # to nothing (gpt-nano, batch 16 x 8, uniform cluster, M = 1, 4, 16; docs/scheduler.md):
    # 3.8-5.8 ms per micro-batch on a middle stage (2 compute actions, 4 message ends), 1.9-3.3 ms on
    # the first and last stages (2 actions, 2 message ends), 5-9 ms per step, in two runs of
    # experiments/microbatch_cost.py's measurement.
    action_overhead_s: float = 4e-4  # one compute action beyond its ops: thread hand-off, feeds, outputs
    message_overhead_s: float = 2e-4  # one tensor message on the wire (stream set-up, wake-ups)
    message_cpu_s: float = 1e-3  # CPU one message costs its sender, and again its receiver: asyncio task, framing, the data plane, the inbox
    cpu_bytes_per_s: float = 2e9  # copying a tensor into the socket (sender) or out of it into a tensor (receiver)
    step_cpu_s: float = 5e-3  # a worker's CPU per step outside its actions: the Step call and reply, the norm reduction
    encode_bytes_per_s: float = 2.5e8  # a codec encoding float32 input (entropy-coded quantisation: 190-320 MB/s measured)
    decode_bytes_per_s: float = 8e8  # and decoding it (750-1000 MB/s measured)
    step_overhead_s: float = 6e-3  # the coordinator's Step round trip and the norm reduction
    optimizer_bytes_per_s: float = 4e8  # AdamW over fp32 parameters on one reference thread
    ratios: dict[tuple[int, int], float] = field(default_factory=dict)  # codec ratio per link
    # links (src, dst) a torch.distributed world carries (control/collectives.py ``carried_links``),
    # set by whoever knows the worlds (the coordinator, ``fusionllm plan``); the rest: the data plane
    carried: frozenset[tuple[int, int]] = frozenset()
    carried_message_cpu_s: float = 2e-4  # one end of a carried message: a thread hand-off and a 96-byte header, no copies
    # What a worker process holds beyond its tensors once it has trained a step: torch's kernels and
    # thread pools, the autograd engine, the allocator, gRPC and the data plane. Measured as peak -
    # base resident bytes of gpt-micro stages and of one gpt-micro process on this CPU machine
    # (benchmarks/memory.py: 115-117 MiB, where the tensors were 7-14 MiB).
    runtime_bytes: int = 115 << 20
    recompute: bool = False  # --recompute: module ops without buffers keep their inputs only and run forward again in the backward
    scale: float = 1.0  # micro-batch size / the micro-batch size the graph was traced with
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # shared by scaled copies

    def op_vector(self, device: Device) -> np.ndarray:
        """Per compute op (topological order), forward + backward seconds of one micro-batch (at
        ``scale``) under sustained load (a CPU device's quota applied): what the partitioner balances."""
        key = ("vec", device.flops, device.cpus, device.speed, self.scale)  # devices of the same speed share it
        if key not in self.memo:
            full = [self.op_seconds(n.id, device, False) + self.op_seconds(n.id, device, True) for n in self.graph.compute_nodes]
            self.memo[key] = np.array(full) / self.cpu_rate(device)
        return self.memo[key]

    def calibrated(self, speed: Mapping[int, float], step_overhead_s: float | None = None) -> CostModel:
        """The same model with devices ``speed`` times as fast as modelled (``calibrated_hardware``)
        and, where given, the per-step wall time beyond the actions (``step_overhead_s``): the
        calibration hook that ``planning/calibrate.py`` fits to measured steps."""
        overhead = self.step_overhead_s if step_overhead_s is None else step_overhead_s
        return replace(self, hw=calibrated_hardware(self.hw, speed), step_overhead_s=overhead, memo={})

    def positions(self) -> dict[str, int]:
        if "pos" not in self.memo:
            self.memo["pos"] = {n.id: i for i, n in enumerate(self.graph.compute_nodes)}
        return self.memo["pos"]

    def scaled(self, scale: float) -> CostModel:
        """The same model for micro-batches ``scale`` times as large (work and tensors grow linearly)."""
        return replace(self, scale=scale)  # shares ``memo``: its entries are keyed by scale

    def edge_bytes(self, nbytes: int) -> int:
        return int(nbytes * self.scale)

    # ---- compute -------------------------------------------------------------------------------
    def op_seconds(self, node_id: str, device: Device, backward: bool) -> float:
        """Seconds of one op on one micro-batch (at ``scale``), at full speed (a CPU device's quota is
        applied by the simulator, see ``cpu_rate``)."""
        if backward and self.recompute and self.recomputed(node_id):
            return self._op_seconds(node_id, device, True) + self._op_seconds(node_id, device, False)
        return self._op_seconds(node_id, device, backward)

    def recomputed(self, node_id: str) -> bool:
        """Whether ``--recompute`` checkpoints this op (a module whose forward updates no buffer)."""
        node = self.graph.node(node_id)
        return (node.kind.startswith("module:") or node.kind == "submodule") and all(self.graph.params[p].trainable for p in node.params.values())

    def _op_seconds(self, node_id: str, device: Device, backward: bool) -> float:
        w = self.work[node_id]
        flops = w.bwd_flops if backward else w.fwd_flops
        if device.flops:
            return flops * self.scale / (device.flops * self.gpu_efficiency) + self.op_overhead_s
        measured = w.bwd_s if backward else w.fwd_s
        if measured is None:
            return flops * self.scale / REFERENCE_FLOPS + self.op_overhead_s
        points = w.bwd_at if backward else w.fwd_at
        if len(points) >= 2:
            return interpolate(points, self.scale)
        # measured at one size only: all but a dispatch's worth grows with the micro-batch
        return max(measured - self.op_overhead_s, 0.0) * self.scale + self.op_overhead_s

    def compute_seconds(self, nodes: Iterable[str], device: Device, backward: bool) -> float:
        """Full-speed seconds (a CPU device's quota is applied on top, see ``cpu_rate``)."""
        return sum(self.op_seconds(n, device, backward) for n in nodes) + self.action_overhead_s

    @staticmethod
    def cpu_rate(device: Device) -> float:
        """Average fraction of full speed a CPU device gets (its quota, times its calibrated core
        speed); 1 for accelerators (their calibration scales their flop/s)."""
        return min(1.0, device.cpus / device.threads) * device.threads * device.speed if device.cpus else device.speed

    def mean_compute_seconds(self, nodes: Iterable[str], device: Device, backward: bool) -> float:
        """Seconds under sustained load (quota applied): what the partitioner balances."""
        t = self.compute_seconds(nodes, device, backward)
        return t / self.cpu_rate(device)  # (1 for an accelerator)

    # ---- communication -----------------------------------------------------------------------------
    def is_carried(self, src: int, dst: int) -> bool:
        """Whether a world carries the link (gloo/NCCL point to point) instead of the data plane."""
        return (src, dst) in self.carried

    def ratio(self, src: int, dst: int) -> float:
        return 1.0 if self.is_carried(src, dst) else self.ratios.get((src, dst), 1.0)

    def wire_bytes(self, nbytes: int, src: int, dst: int) -> float:
        if self.is_carried(src, dst):
            return float(nbytes)
        return nbytes * self.ratio(src, dst) + HEADER_BYTES

    def transfer_seconds(self, nbytes: float, src: int, dst: int, *, raw: bool = False) -> float:
        """Time a message occupies the link (without latency); ``raw``: not through the link's codec."""
        bps = self.hw.bps(src, dst)
        if self.is_carried(src, dst) and not raw:  # gloo's measured time, bounded by the link's rate
            return max(nbytes * 8 / bps if math.isfinite(bps) else 0.0, interpolate(GLOO_P2P_SECONDS, nbytes))
        wire = nbytes + HEADER_BYTES if raw else self.wire_bytes(nbytes, src, dst)
        return (wire * 8 / bps if math.isfinite(bps) else 0.0) + self.message_overhead_s

    def latency(self, src: int, dst: int) -> float:
        return self.hw.latency[src][dst]

    def allreduce_round_seconds(self, nbytes: int, group: list[int]) -> float:
        """One round of the ring: each member sends its chunk to the next and waits for the ack (a
        round trip) and for the previous member's chunk before the next round (``runtime/dist/reduce.py``)."""
        n = len(group)
        ring = [(group[i], group[(i + 1) % n]) for i in range(n)]
        return max(self.transfer_seconds(math.ceil(nbytes / n), a, b, raw=True) + self.latency(a, b) + self.latency(b, a) for a, b in ring)

    def site_reduce_seconds(self, nbytes: float, sites: Sequence[Sequence[int]], ratio: float) -> tuple[float, float]:
        """Wall seconds to sum ``nbytes`` of gradients over ``sites`` (each a list of workers, its leader
        first) as ``Plan.reduce`` does, and the part of them the leaders' codec takes after the last
        gradient is in (what cannot overlap the backward). Within a site, the members send their
        gradients to the leader raw (in parallel, each on its own link; the leader takes them in one
        after the other); the leaders encode their sums at ``ratio`` of the bytes (1: raw), send them
        to every other leader and decode every leader's payload, their own included; each leader sends
        the total back into its site raw. A quota device spends its CPU at its quota's rate."""
        def cpu(w: int, seconds: float) -> float:
            return seconds / self.cpu_rate(self.hw.devices[w])

        def into_site(a: int, b: int) -> float:  # a raw message inside a site (a world's cost where one carries the link)
            return self.transfer_seconds(nbytes, a, b, raw=not self.is_carried(a, b)) + self.latency(a, b)

        gather = broadcast = 0.0
        for site in sites:
            lead, members = site[0], list(site[1:])
            if members:
                gather = max(gather, max(into_site(m, lead) for m in members)
                             + sum(cpu(lead, self.message_cpu_seconds(nbytes, m, lead)) for m in members))
                broadcast = max(broadcast, sum(cpu(lead, self.message_cpu_seconds(nbytes, lead, m)) for m in members)
                                + max(into_site(lead, m) + cpu(m, self.message_cpu_seconds(nbytes, lead, m)) for m in members))
        leaders = [site[0] for site in sites]
        codec = exchange = 0.0
        if len(leaders) > 1:
            wire = nbytes * ratio
            # encode the sum once; decode each leader's payload (its encoded bytes) and add it to a dense total (gpt-micro's
            # 3.4 MB gradient here, one thread, best of 7: topk:0.05 encodes in 9.7 ms and decodes in 0.4 ms; topk:0.01 in 2.6 and 0.2)
            if ratio < 1.0:
                codec = max(cpu(w, nbytes / self.encode_bytes_per_s + len(leaders) * (wire / self.decode_bytes_per_s + nbytes / self.cpu_bytes_per_s))
                            for w in leaders)
            sends = max(self.transfer_seconds(wire, a, b, raw=True) + self.latency(a, b) for a in leaders for b in leaders if a != b)
            ends = max(cpu(w, 2 * (len(leaders) - 1) * self.message_cpu_seconds(wire)) for w in leaders)
            exchange = sends + ends + codec
        return gather + exchange + broadcast, codec

    def site_reduce_cpu(self, nbytes: float, sites: Sequence[Sequence[int]], ratio: float) -> dict[int, float]:
        """Full-speed CPU seconds each worker spends on ``site_reduce_seconds``' reduce (its wall time
        counts them at the quota's rate; the calibration needs them per device): a member sends its
        gradients and takes the total in (two message ends), a leader takes each member's in and sends
        it the total, and exchanges its encoded sum with every other leader (codec included). Measured
        on random:41's dp plan (one leader of 3 in a site, 4 x 3.37 MB, benchmarks in docs/scheduler.md):
        the leader spent 15-17 ms a step more CPU than a lone leader, members none more."""
        out: dict[int, float] = {}
        leaders = [site[0] for site in sites]
        wire = nbytes * ratio
        for site in sites:
            lead, members = site[0], list(site[1:])
            for m in members:
                out[m] = out.get(m, 0.0) + self.message_cpu_seconds(nbytes, m, lead) + self.message_cpu_seconds(nbytes, lead, m)
                out[lead] = out.get(lead, 0.0) + self.message_cpu_seconds(nbytes, m, lead) + self.message_cpu_seconds(nbytes, lead, m)
        if len(leaders) > 1:
            for w in leaders:
                codec = nbytes / self.encode_bytes_per_s + len(leaders) * (wire / self.decode_bytes_per_s + nbytes / self.cpu_bytes_per_s) if ratio < 1.0 else 0.0
                out[w] = out.get(w, 0.0) + codec + 2 * (len(leaders) - 1) * self.message_cpu_seconds(wire)
        return out

    def optimizer_seconds(self, param_bytes: int, device: Device) -> float:
        """What a worker's STEP action costs it: AdamW over its parameters and, on a CPU device, the
        step's own work (``step_cpu_s``: the Step call, the norm reduction, the reply; the
        coordinator's round trip is ``step_overhead_s``, wall time)."""
        if device.flops:
            return param_bytes / 1e11  # memory bound on an accelerator
        return param_bytes / self.optimizer_bytes_per_s + self.step_cpu_s

    def codec_cpu_seconds(self, nbytes: float, src: int, dst: int, *, sender: bool) -> float:
        """CPU time of the link's codec on a message of ``nbytes`` raw bytes (0 on an uncompressed link)."""
        if self.ratio(src, dst) >= 1.0:
            return 0.0
        return nbytes / (self.encode_bytes_per_s if sender else self.decode_bytes_per_s)

    def message_cpu_seconds(self, nbytes: float, src: int | None = None, dst: int | None = None) -> float:
        """CPU time one end spends on a message: the runtime's fixed part (``message_cpu_s``, measured
        in the workers) and the copies (the data plane alone: 0.13 ms for both ends of a small
        message, 0.25 ms for 256 KiB, 0.73 ms for 1 MiB); on a link a world carries (``src``,
        ``dst`` given), ``carried_message_cpu_s``: gloo reads and writes the tensor in place."""
        if src is not None and dst is not None and self.is_carried(src, dst):
            return self.carried_message_cpu_s
        return self.message_cpu_s + nbytes / self.cpu_bytes_per_s

    # ---- memory ------------------------------------------------------------------------------------
    def stage_memory(self, nodes: list[str], in_flight: int) -> int:
        """Parameters, gradients, AdamW state (4x params), plus what autograd keeps for backward
        (each op's saved tensors, measured when the op was counted; its outputs where it was not),
        plus the process's own runtime (``runtime_bytes``)."""
        names = {p for n in nodes for p in self.graph.node(n).params.values()}
        params = sum(self.graph.params[p].meta.nbytes for p in names)
        saved = {n: self.work[n].saved_bytes or self.work[n].out_bytes for n in nodes}
        rerun = 0
        if self.recompute:  # a checkpointed op keeps its inputs; its own saved tensors live only while its backward runs
            edges = self.graph.edges()
            for n in nodes:
                if self.recomputed(n):
                    rerun = max(rerun, saved[n])
                    saved[n] = sum(edges[e].meta.nbytes for e in dict.fromkeys(self.graph.node(n).inputs))
        return self.runtime_bytes + 4 * params + int((in_flight * sum(saved.values()) + rerun) * self.scale)
