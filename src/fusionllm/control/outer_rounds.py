"""The outer syncs of a grouping of several groups: who sent which round of which fragment, which
groups each round's average holds (decided once, for every group), and the calls that send and apply.

Each group calls ``sync`` at a fragment's sync point of its rounds (``hierarchical.py``) and at a
pause (``hier_pauses.py``); ``decide`` waits for the live groups that take part in a round, for at
most a round's time (twice the asking group's last round, at least ``--dead-after``), has their
deltas checked (``outer_guard.py``), and records the decision that every group then applies.
"""

from __future__ import annotations

import asyncio
import time

from fusionllm.transport.control import OuterApply, OuterSync, OuterSynced

from .context import RunContext
from .hier_setup import GroupingRun
from .outer_guard import OuterGuard
from .rounds import wait_notified
from .workers import Liveness


class OuterRounds:
    """The outer syncs of one grouping, and their state: deltas sent per (fragment, round), the
    groups and scales each round's average holds, and the bytes sent per link."""

    def __init__(self, ctx: RunContext, live: Liveness, guard: OuterGuard) -> None:
        self.ctx, self.live, self.guard = ctx, live, guard
        self.sent: dict[tuple[int, int], dict[int, float]] = {}  # (fragment, round) -> group -> tokens
        self.decided: dict[tuple[int, int], dict[int, float]] = {}  # (fragment, round) -> the groups averaged -> tokens
        self.scales: dict[tuple[int, int], dict[int, float]] = {}  # (fragment, round) -> group -> scale (clipped)
        self.deciding: dict[tuple[int, int], asyncio.Future] = {}  # decided once: the others wait for it
        self.outer_bytes: dict[str, int] = {}  # pseudo-gradient bytes per link, the whole grouping

    async def sync(self, hr: GroupingRun, g: int, f: int, r: int, tokens: int, apply: list[int], *,
                          send: bool = True, announce: bool | None = None) -> None:
        """Send fragment ``f``'s delta of round ``r`` (``send``), tell the other groups it is there or
        that there is none (``announce``, default ``send``), then apply the ``apply`` rounds' averages."""
        run = hr.runs[g]
        began = time.perf_counter()
        sent: dict[str, int] = {}
        self.guard.evict_if_struck(g)

        async def call(w: int, msg: OuterSync) -> OuterSynced:
            c = self.ctx.cluster  # a dropped link is ridden out: the worker answers a repeat with the same run
            return OuterSynced.from_wire(await run.clients[w].call_retrying("OuterSync", msg.to_wire(), within=c.step_timeout, timeout=c.step_timeout))

        if send:
            replies = await self.live.calls(run, {w: call(w, OuterSync(f, r, True)) for w in run.plan.workers})
            for w, rep in replies.items():
                for dst, n in rep.bytes_to.items():
                    sent[f"w{w}->w{dst}"] = sent.get(f"w{w}->w{dst}", 0) + n
                    self.outer_bytes[f"w{w}->w{dst}"] = self.outer_bytes.get(f"w{w}->w{dst}", 0) + n
        if send if announce is None else announce:
            async with hr.changed:
                self.sent.setdefault((f, r), {})[g] = float(tokens if send else 0)
                hr.changed.notify_all()
        applies = []
        for j in apply:  # one at a time: the checks of round j wait until every group applied round j - 1
            groups = await self.decide(hr, f, j, g)
            self.guard.evict_if_struck(g)
            scale = {str(x): v for x, v in self.scales.get((f, j), {}).items() if v != 1.0}
            # also with no group in it: the workers drop the round's deltas
            one = OuterApply(j, {str(x): w for x, w in groups.items()}, step=hr.step_at(j + 1), scale=scale,
                             aggregate="trimmed" if self.ctx.cluster.outer_aggregate == "trimmed" else "mean")
            await self.live.calls(run, {w: call(w, OuterSync(f, r, False, [one])) for w in run.plan.workers})
            applies.append(one)
        self.ctx.event({"event": "outer", "group": g, "fragment": f, "round": r, "sent": send,
                       "applied": {str(a.round): a.groups for a in applies}, "bytes": sent, "seconds": round(time.perf_counter() - began, 4),
                       "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})

    async def decide(self, hr: GroupingRun, f: int, r: int, asking: int) -> dict[int, float]:
        """The groups whose deltas of round ``r`` of fragment ``f`` are averaged: decided once, by
        the first group that needs it, after every live group sent it or a round's time passed, and
        after their deltas were checked (``outer_guard.py``); the others wait for that decision."""
        key = (f, r)
        async with hr.changed:
            if key in self.decided:
                return self.decided[key]
            waiting = self.deciding.get(key)
            if waiting is None:
                self.deciding[key] = decision = asyncio.get_running_loop().create_future()
        if waiting is not None:
            await asyncio.shield(waiting)
            return self.decided[key]
        groups: dict[int, float] = {}
        scales: dict[int, float] = {}
        try:
            async with hr.changed:
                groups = await self.senders(hr, f, r, asking)
            # the checks run outside the lock: a group that applies an earlier round meanwhile is not held up (they wait for it)
            groups, scales = await self.guard.check(hr, f, r, groups)
        finally:
            self.decided[key], self.scales[key] = groups, scales
            self.deciding.pop(key, None)
            decision.set_result(None)
        return groups

    async def senders(self, hr: GroupingRun, f: int, r: int, asking: int) -> dict[int, float]:
        """The live groups that sent round ``r`` of fragment ``f`` within a round's time (the caller
        holds ``hr.changed``)."""
        loop = asyncio.get_running_loop()
        patience = max(self.ctx.cluster.dead_after, 2.0 * hr.round_s.get(asking, time.perf_counter() - hr.started))
        deadline = loop.time() + patience
        while not hr.expected(r) <= set(self.sent.get((f, r), {})):
            left = deadline - loop.time()
            if left <= 0:
                break
            await wait_notified(hr.changed, left)
        got = self.sent.get((f, r), {})
        late = sorted(hr.expected(r) - set(got))
        if late:
            self.ctx.say(f"outer round {r} of fragment {f}: group(s) {late} left out (not there within {patience:.1f} s)")
            self.ctx.event({"event": "left_out", "fragment": f, "round": r, "groups": late, "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})
        return {x: w for x, w in got.items() if x in hr.alive and w > 0}

