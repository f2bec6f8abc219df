"""H and the codecs of a grouping: how many inner steps a round and which codec per pair of groups.

``choose_inner_steps`` gives every group its H (the slowest group the base H, faster ones as many
steps as fit in the same wall time) and every pair of groups the least lossy codec whose traffic
hides behind the round (the hierarchical planner: the codec of the best measured per-token
efficiency that hides, ``planning.efficiency.outer_codec_candidates``); the hierarchical planner (``planning/hierarchy.py``) calls it for each H of
its goodput search; ``alone_rounds`` is what one group's rounds cost (no outer step).
docs/scheduler.md, "Hierarchical mode", explains the rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fusionllm.cost.model import HEADER_BYTES, CostModel
from fusionllm.schedule.plan import Request
from fusionllm.sim.rounds import GroupStep, RoundResult, Traffic, codec_ratio
from fusionllm.sim.utilization import device_busy, utilization

CODEC_LADDER = ("none", "q8", "q4", "q2", "topk:0.03", "topk:0.01")  # least lossy first
PREFERRED_CODEC = "q4"  # the lossiest the planner takes before it raises H (Streaming DiLoCo's 4 bits lose nothing measurable)
MIN_INNER_STEPS = 4  # the slowest group's H, unless --inner-steps says otherwise
MAX_INNER_STEPS = 500  # no group does more inner steps per round
HEADROOM = 0.5  # a round's traffic may keep the busiest link between groups busy this fraction of the round
TRAFFIC_FACTOR = 100.0  # bytes between groups per token at most 1/100 of what synchronous data parallelism would send
GOODPUT_H = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 100, 200, 500)  # the H the goodput search tries per grouping
H_LADDER = sorted({round(4 * 1.25**k) for k in range(40) if 4 * 1.25**k <= MAX_INNER_STEPS} | {MAX_INNER_STEPS})


@dataclass
class _Choice:
    hs: list[int]
    codecs: dict[tuple[int, int], str]  # unordered group pair -> codec
    hidden: bool  # the traffic fits the headroom


def choose_inner_steps(step_s: list[float], traffic: Traffic, cost: CostModel, *, inner_steps: int | None = None,
                       codec: str | None = None, headroom: float = HEADROOM, param_bytes: int | None = None,
                       traffic_factor: float = TRAFFIC_FACTOR, max_codec: str | None = None,
                       candidates: Sequence[str] | None = None) -> _Choice:
    """H per group and a codec per pair of groups (see docs/scheduler.md): the slowest group does the
    base H, every other group as many steps as fit in the same wall time; the base H is the smallest
    of ``H_LADDER`` (>= ``MIN_INNER_STEPS``) at which, with codecs no lossier than ``PREFERRED_CODEC``,
    every link between groups is busy at most ``headroom`` of the round, and every receiver decodes
    in at most that; each pair of groups then gets the least lossy codec that fits. Lossier codecs
    (q2, top-k) only when even ``MAX_INNER_STEPS`` does not hide the traffic with q4; none lossier
    than ``max_codec``.

    ``candidates`` (the hierarchical planner's: ``planning.efficiency.outer_codec_candidates``)
    replaces that ladder by the codecs in the order they are preferred, the best measured per-token
    efficiency first: each pair of groups gets the first of them that fits, at the H given (the
    planner tries each H and weighs the codec's efficiency into the goodput); none fits: the one of
    the fewest bytes.

    With ``param_bytes`` (the float32 bytes of the parameters), the base H is also large enough that
    the bytes between groups per token are ``traffic_factor`` times fewer than synchronous data
    parallelism over the same groups would send (a ring all-reduce of the gradients every step:
    ``2 (n-1) / n`` x param_bytes per group and step)."""
    n = len(step_s)
    slow = max(step_s)
    if codec:
        ladder, first = [codec], 0
    elif candidates:
        ladder, first = list(candidates), 0
    else:
        ladder = list(CODEC_LADDER)[: CODEC_LADDER.index(max_codec) + 1 if max_codec else None]
        first = ladder.index(PREFERRED_CODEC)
    fallback = min(ladder, key=codec_ratio) if candidates and not codec else ladder[-1]  # none fits: the fewest bytes
    # per unordered pair and codec: the longest busy time of one of its links per round; per receiver: decoding
    link_raw: dict[tuple[int, int], dict[tuple[int, int], list[int]]] = {}
    for (a, b, _f), links in traffic.items():
        pair = (min(a, b), max(a, b))
        for lk, raw in links.items():
            link_raw.setdefault(pair, {}).setdefault(lk, []).append(raw)
    busy: dict[tuple[tuple[int, int], str], float] = {}
    for p, links in link_raw.items():  # a link's messages: (ratio x raw + header) bytes at its rate, plus each one's overhead
        raw = np.array([sum(r) for r in links.values()], dtype=float)
        count = np.array([len(r) for r in links.values()], dtype=float)
        rate = np.array([cost.hw.bps(s, d) for s, d in links], dtype=float)
        per_bit = np.where(np.isfinite(rate), 8 / rate, 0.0)
        for c in ladder:
            busy[(p, c)] = float(np.max((codec_ratio(c) * raw + count * HEADER_BYTES) * per_bit + count * cost.message_overhead_s))
    decode: dict[tuple[tuple[int, int], str], dict[int, float]] = {}
    for p, links in link_raw.items():
        for c in ladder:
            per: dict[int, float] = {}
            if codec_ratio(c) < 1:
                for (_s, d), raws in links.items():
                    per[d] = per.get(d, 0.0) + sum(raws) / cost.decode_bytes_per_s
            decode[(p, c)] = per

    def scale(base: int) -> list[int]:
        return [max(1, round(base * slow / t)) for t in step_s]

    def fits(base: int, level: int) -> dict[tuple[int, int], str] | None:
        hs = scale(base)
        round_s = max(h * t for h, t in zip(hs, step_s, strict=True))
        chosen: dict[tuple[int, int], str] = {}
        for p in link_raw:
            ok = [c for c in ladder[first : level + 1] if busy[(p, c)] <= headroom * round_s]
            if not ok:
                return None
            chosen[p] = ok[0]
        load: dict[int, float] = {}
        for p, c in chosen.items():
            for d, s in decode[(p, c)].items():
                load[d] = load.get(d, 0.0) + s
        if max(load.values(), default=0.0) > headroom * round_s:
            return None
        if param_bytes and n > 1 and inner_steps is None:
            wire = sum(codec_ratio(chosen[p]) * sum(sum(r) for r in links.values()) for p, links in link_raw.items())
            # per token: data parallelism sends 2 (n-1)/n x param_bytes per group and step (n T tokens a
            # step), a round sends ``wire`` for sum(hs) x T tokens
            dp = 2 * (n - 1) * param_bytes / n
            if wire / sum(hs) > dp / traffic_factor:
                return None
        return chosen

    pairs = [(a, b) for a, b in itertools.combinations(range(n), 2)]
    if inner_steps is not None:
        for level in range(first, len(ladder)):
            if (chosen := fits(inner_steps, level)) is not None:
                return _Choice(scale(inner_steps), chosen, True)
        return _Choice(scale(inner_steps), dict.fromkeys(pairs, fallback), False)
    bases = [b for b in H_LADDER if b >= MIN_INNER_STEPS and max(scale(b)) <= MAX_INNER_STEPS] or [MIN_INNER_STEPS]
    for level in range(first, len(ladder)):
        for base in bases:
            if (chosen := fits(base, level)) is not None:
                return _Choice(scale(base), chosen, True)
    return _Choice(scale(bases[-1]), dict.fromkeys(pairs, fallback), False)


def alone_rounds(result: RoundResult, step: GroupStep, cost: CostModel, req: Request) -> RoundResult:
    """One group's rounds without an outer step: a round of a single group is its steps, and it pays
    for no boundary it does not have (the round simulator syncs every group it is given)."""
    h = result.inner_steps[0]
    round_s = h * step.step_s
    frac = device_busy({w: h * b for w, b in step.busy_s.items()}, round_s, len(cost.hw.devices))
    return replace(result, round_s=round_s, waits_s=[0.0], bytes_per_round={}, link_busy=0.0, tokens_per_s=h * req.tokens / round_s,
                   utilization=utilization(frac, cost), device_busy=frac, codec_cpu_s=[0.0])
