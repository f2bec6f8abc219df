"""AdaTopK in planning: the link policy of a plan, the plan-level check that it pays, OP-Fence on
links that AdaTopK would compress, and what each step tells every sender (``sender_budgets``).

AdaTopK's decision has two halves: here, per link, the byte target (``compress/policy.py``) and the
share of the error budgets; on the sender, per tensor, the codec that meets them
(``compress/adaptive.py``). The coordinator only carries these numbers from here to the workers."""

from __future__ import annotations

import math
from dataclasses import replace

from fusionllm.compress.policy import LinkLoad, LinkPolicy
from fusionllm.cost.model import CostModel
from fusionllm.planning.predict import predict
from fusionllm.planning.schedulers import make_schedule
from fusionllm.schedule.plan import Plan, Request, micro_batch_scale, routes, shared_groups

ADATOPK_PLAN_RATIO = 0.09  # about the bytes of the cheapest codecs within the error budgets on gpt-micro (eq:0.5 forward 0.10, eq:0.7 back 0.086)
COMPRESSED_PLAN_GAIN = 0.8  # a plan that relies on compression replaces the plain one only if predicted this much faster


def _mb_compute(plan: Plan, cost: CostModel, req: Request) -> dict[int, float]:
    """Per worker: compute seconds of one micro-batch (forward + backward, its quota applied)."""
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    out = {}
    for s in plan.stages:
        for w in s.workers:
            d = cost.hw.devices[w]
            out[w] = scaled.mean_compute_seconds(s.nodes, d, False) + scaled.mean_compute_seconds(s.nodes, d, True)
    return out


def link_policy(plan: Plan, cost: CostModel, req: Request) -> LinkPolicy:
    """AdaTopK's policy for a plan: per worker link what a step puts on it (activations forward, their
    gradients back, all-reduced gradients of replicas and tied weights), the link's rate, and per
    worker its compute and codec speed; every link's codec decided by the predicted step."""
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    graph = cost.graph
    edges = graph.edges()
    r = routes(graph, plan)
    per_mb = _mb_compute(plan, cost, req)
    compute = {w: per_mb[w] * len(plan.mbs_of(w)) for w in per_mb}
    loads: dict[tuple[int, int], LinkLoad] = {}
    crossings: dict[tuple[int, int], set[int]] = {}

    def add(link: tuple[int, int], nbytes: float, mb: int) -> None:
        load = loads.setdefault(link, LinkLoad())
        load.step_bytes += nbytes
        load.messages += 1
        crossings.setdefault(link, set()).add(mb)

    for e, consumers in r.consumers.items():
        if r.producer[e] < 0 or edges[e].meta.dtype != "float32":
            continue
        nbytes = scaled.edge_bytes(edges[e].meta.nbytes)
        for c in consumers:
            for mb in range(plan.micro_batches):
                a, b = plan.worker_for(r.producer[e], mb), plan.worker_for(c, mb)
                if a == b:
                    continue
                add((a, b), nbytes, mb)
                if edges[e].requires_grad:
                    add((b, a), nbytes, mb)
    for link, mbs in crossings.items():
        loads[link].first_bytes = loads[link].step_bytes / len(mbs)
    seen: set[tuple[int, ...]] = set()
    for entries in shared_groups(graph, plan).values():
        for group, _, nbytes in entries:
            if group in seen:
                continue
            seen.add(group)
            n = len(group)
            for i in range(n):
                load = loads.setdefault((group[i], group[(i + 1) % n]), LinkLoad())
                load.reduce_bytes += 2 * (n - 1) / n * nbytes
                load.messages += 2 * (n - 1)
    devices = cost.hw.devices
    policy = LinkPolicy(
        compute_s=compute, loads=loads, bps={link: cost.hw.bps(*link) for link in loads},
        encode_bps={d.index: cost.encode_bytes_per_s * cost.cpu_rate(d) for d in devices},
        decode_bps={d.index: cost.decode_bytes_per_s * cost.cpu_rate(d) for d in devices},
        overhead_s=cost.message_overhead_s, micro_batches=plan.micro_batches,
    )
    policy.decide_all()
    return policy


def adatopk_policy(plan: Plan, cost: CostModel, req: Request) -> tuple[LinkPolicy, CostModel]:
    """The plan's link policy, checked on the whole plan by the simulator: when the step it predicts
    with the policy's codecs (their CPU time on each sender and receiver included) is longer than
    without, every link stays raw. Returns the policy and the cost model that counts its codecs."""
    policy = link_policy(plan, cost, req)
    ratios = {link: t for link, t in policy.ratios().items() if t < 1.0}
    if not ratios:
        return policy, cost
    judged = replace(cost, ratios=ratios)
    if predict(plan, judged, req) > predict(plan, cost, req):  # (the simulator runs all-reduces raw: equal there is the policy's call)
        policy.keep_none()
        return policy, cost
    return policy, judged


def compression_aware(plan: Plan, cost: CostModel, req: Request) -> tuple[Plan, CostModel]:
    """OP-Fence again, on links that AdaTopK could compress: a link too slow for the budget (the
    uncompressed plan's stage time, shortened as if every device took part) carries its bytes x
    max(ADATOPK_PLAN_RATIO, what fits the budget). Each plan is then judged with its own link policy
    (``adatopk_policy``); the plan found on squeezed links replaces the plain one only when predicted
    clearly faster. Returns the plan and the cost model with its policy's codecs."""
    mb = _mb_compute(plan, cost, req)
    loads = link_policy(plan, cost, req).loads
    act = max((load.first_bytes for load in loads.values()), default=0.0) or max(e.meta.nbytes for e in cost.graph.edges().values())
    # a plan on every device has stages this much shorter than the uncompressed plan's
    budget = max(mb.values(), default=0.0) * len(set(plan.workers)) / len(cost.hw)
    ratios = {}
    for a in range(len(cost.hw)):
        for b in range(len(cost.hw)):
            bps = cost.hw.bps(a, b)
            if a == b or not math.isfinite(bps):
                continue
            seconds = act * 8 / bps
            if seconds > budget > 0:
                ratios[(a, b)] = max(ADATOPK_PLAN_RATIO, 0.8 * budget / seconds)
    _, judged = adatopk_policy(plan, cost, req)
    if not ratios:
        return plan, judged
    squeezed = replace(cost, ratios=ratios)
    again = make_schedule("opfence", squeezed, req, evaluate=predict)
    _, judged_again = adatopk_policy(again, cost, req)
    # the compressed plan must win clearly: on three-sites a 2% predicted gain measured 20% slower
    if predict(again, judged_again, req) < COMPRESSED_PLAN_GAIN * predict(plan, judged, req):
        return again, judged_again
    return plan, judged


def with_compression(plan: Plan, cost: CostModel, req: Request, compress: str) -> CostModel:
    """The cost model with each link's byte ratio under a codec (what `simulate --compress` uses)."""
    from fusionllm.compress.codecs import byte_ratio, parse_codec

    spec = parse_codec(compress)
    if spec.lossless:
        return cost
    if spec.adaptive:
        return adatopk_policy(plan, cost, req)[1]
    n = len(cost.hw)
    return replace(cost, ratios={(a, b): byte_ratio(spec) for a in range(n) for b in range(n) if a != b})


# ---- what each step tells the senders: the one place a worker's AdaTopK settings are decided ----------
def compressed_cuts(plan: Plan, policy: LinkPolicy | None) -> int:
    """Stage boundaries of ``plan`` whose links AdaTopK compresses (a byte target under 1, either way)."""
    if policy is None:
        return 0
    ratios = policy.ratios()
    return sum(any(ratios.get((a, b), 1.0) < 1.0 or ratios.get((b, a), 1.0) < 1.0 for a in s.workers for b in t.workers)
               for s, t in zip(plan.stages, plan.stages[1:], strict=False))


def budget_scale(plan: Plan, policy: LinkPolicy | None) -> float:
    """The share of the error budgets each compressed cut gets: an activation crosses every cut of
    the pipeline, and their errors add up (in squares: independent errors), so ``k`` cuts get
    1/sqrt(k) each and the last stage's input errs as much as one cut's budget. Measured on
    random-11 (three cuts at the full budget): validation loss +5.1% over four seeds, where one cut
    (slow-link) was within 1%. Gradients share it too, though their error is fed back: with their
    whole budget on random-11 (``eq:0.7``, 10.7x instead of 8.5x on their links) four seeds ended
    +1.13% against -0.39% shared, seed 1 +2.4% against -1.1% (random-11-actshare)."""
    return 1.0 / math.sqrt(max(1, compressed_cuts(plan, policy)))


def ratios_of(policy: LinkPolicy | None, worker: int) -> dict[str, float] | None:
    """What a Step tells ``worker`` about its links' AdaTopK ratios (None: no policy)."""
    return {str(b): r for (a, b), r in policy.ratios().items() if a == worker} if policy is not None else None


def sender_budgets(plan: Plan, policy: LinkPolicy | None, worker: int, cap: float) -> tuple[dict[str, float] | None, float, float]:
    """What a step tells ``worker``'s sender (``compress/adaptive.LinkCodecs.set_step``): its links' byte
    targets, the share of the error budgets its compressed cuts leave each (``budget_scale``) and the
    early cap (``compress/budget.budget_cap``; ``cap``). Without a policy (a fixed codec): none, 1, 1."""
    if policy is None:
        return None, 1.0, 1.0
    return ratios_of(policy, worker), budget_scale(plan, policy), cap
