"""The coordinator's side of checked outer steps: ask, judge, ask again, strike (``outer_checks.py``
has the rules; ``hierarchical.py`` calls ``check`` once per round of a fragment, for every group)."""

from __future__ import annotations

import asyncio
from typing import Any

from fusionllm.core.errors import FusionError, TransportError
from fusionllm.core.watch import watched
from fusionllm.transport.control import OuterCheck, OuterChecked, OuterResend

from .config import Evict
from .context import RunContext
from .hier_setup import GroupingRun
from .outer_checks import STRIKE_ROUNDS, Reports, Verdict, add_report, judge, update_estimates


class OuterStop(FusionError):
    """``--numeric-guard stop``: a refused pseudo-gradient ends the run (not only its group)."""


class OuterGuard:
    """Checks of the outer steps of one run: running norm estimates and strikes per group."""

    def __init__(self, ctx: RunContext, aggregate: str = "mean") -> None:
        self.ctx, self.aggregate = ctx, aggregate
        self.estimates: dict[int, dict[int, float]] = {}  # fragment -> group -> running norm estimate
        self.strikes: dict[int, list[int]] = {}  # group -> the rounds it was refused in lately
        self.evicting: dict[int, Evict] = {}  # group -> its eviction, raised in its own rounds (``evict_if_struck``)

    @property
    def on(self) -> bool:
        return self.ctx.cluster.numeric_guard != "off"

    async def check(self, hr: GroupingRun, f: int, r: int, groups: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
        """The groups of ``groups`` (-> tokens) whose deltas of round ``r`` of fragment ``f`` are
        averaged, and their scales. Refused ones are sent again once, then struck."""
        senders = sorted(groups)
        if not self.on or not senders:
            return groups, {}
        estimates = self.estimates.setdefault(f, {})
        verdict = judge(senders, await self.reports(hr, f, r, senders, []), estimates, self.aggregate)
        again: list[int] = []
        if verdict.refused and self.ctx.cluster.numeric_guard == "retry":
            again = sorted(g for g in verdict.refused if g in hr.alive)
            self.ctx.say(f"outer round {r} of fragment {f}: refused group(s) {again} ({self._why(verdict)}); asking them to send again")
            if await self.resend(hr, f, r, again):
                verdict = judge(senders, await self.reports(hr, f, r, senders, again), estimates, self.aggregate)
        update_estimates(estimates, verdict)
        # a record in the metrics file, not an event: a user sees the refusals (``strike``), not every check that passed
        self.ctx.metrics.write({"event": "outer_check", "fragment": f, "round": r, "norms": {str(g): round(n, 6) for g, n in verdict.norms.items()},
                        "cosines": {str(g): round(c, 4) for g, c in verdict.cosines.items()},
                        "refused": {str(g): why for g, why in verdict.refused.items()}, "sent_again": again,
                        "scales": {str(g): round(s, 4) for g, s in verdict.accepted.items() if s != 1.0}})
        for g, why in sorted(verdict.refused.items()):
            self.strike(hr, g, f, r, why)
        return {g: groups[g] for g in verdict.accepted}, dict(verdict.accepted)

    @staticmethod
    def _why(verdict: Verdict) -> str:
        return "; ".join(f"group {g}: {why}" for g, why in sorted(verdict.refused.items()))

    async def reports(self, hr: GroupingRun, f: int, r: int, senders: list[int], again: list[int]) -> Reports:
        """Every sending group's report (the sum of its workers'); a group with a worker that did not
        answer gives none (a partial sum would misjudge)."""
        msg = OuterCheck(f, r, senders, again).to_wire()
        calls: dict[tuple[int, int], Any] = {}
        for g in senders:
            run = hr.runs[g]
            for w in run.plan.workers:
                calls[(g, w)] = self.answer(w, run.clients[w].call_retrying("OuterCheck", msg, within=self.ctx.cluster.step_timeout,
                                                                            timeout=self.ctx.cluster.step_timeout))
        replies = await asyncio.gather(*calls.values(), return_exceptions=True)
        by_group: dict[int, list[OuterChecked]] = {}
        failed: set[int] = set()
        for (g, w), reply in zip(calls, replies, strict=True):
            try:
                if isinstance(reply, BaseException):
                    raise reply
                by_group.setdefault(g, []).append(OuterChecked.from_wire(reply))
            except (FusionError, OSError, asyncio.TimeoutError) as exc:
                failed.add(g)
                self.ctx.say(f"outer check of round {r} of fragment {f}: worker {w} of group {g} did not report ({exc})")
        out = Reports({}, {}, {})
        for g, got in by_group.items():
            if g not in failed:
                for rep in got:
                    add_report(out, g, rep.dots, rep.finite, rep.momentum_sq, rep.digests)
        return out

    async def answer(self, w: int, call: Any) -> Any:
        """``call``'s reply, unless worker ``w`` stops heart-beating for --dead-after meanwhile (hung:
        its connection stays open, so only its heartbeat tells): then a TransportError, and its group
        gives no report, instead of every group waiting for it until the step timeout. Its group's own
        loop finds it lost."""
        dead_after = self.ctx.cluster.dead_after

        def look() -> None:
            if w in self.ctx.membership.stale(dead_after) or w not in self.ctx.membership.members:
                raise TransportError(f"worker {w} stopped answering (no heartbeat for {dead_after:.0f} s)")

        return await watched(call, look)

    async def resend(self, hr: GroupingRun, f: int, r: int, groups: list[int]) -> bool:
        """Ask ``groups``' workers to push their deltas of round ``r`` again; False when one could not."""
        msg = OuterResend(f, r).to_wire()
        calls = [self.answer(w, hr.runs[g].clients[w].call_retrying("OuterResend", msg, within=self.ctx.cluster.step_timeout,
                                                                    timeout=self.ctx.cluster.step_timeout))
                 for g in groups for w in hr.runs[g].plan.workers]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        failed = [x for x in replies if isinstance(x, BaseException)]
        if failed:
            self.ctx.say(f"outer round {r} of fragment {f}: a group could not send again ({failed[0]})")
        return not failed

    def strike(self, hr: GroupingRun, g: int, f: int, r: int, why: str) -> None:
        """A refused delta of group ``g``: left out of the round; evicted at ``--evict-after`` strikes
        (rounds) within ``STRIKE_ROUNDS``; with ``--numeric-guard stop`` the run ends."""
        c = self.ctx.cluster
        rounds = [x for x in self.strikes.get(g, []) if x > r - STRIKE_ROUNDS and x != r] + [r]
        self.strikes[g] = rounds
        workers = sorted(hr.runs[g].plan.workers)
        action = "stop" if c.numeric_guard == "stop" else "evict" if c.evict_after and len(rounds) >= c.evict_after else "left out"
        self.ctx.event({"event": "outer_refused", "group": g, "fragment": f, "round": r, "why": why, "strikes": len(rounds),
                        "workers": workers, "action": action, "elapsed_s": round(self.ctx.run_seconds(hr.elapsed()), 4)})
        if action == "stop":
            raise OuterStop(f"outer round {r} of fragment {f}: group {g}'s pseudo-gradient was refused ({why}). Stopped "
                            f"(--numeric-guard stop); --numeric-guard retry leaves such a group out and evicts it at --evict-after strikes")
        self.ctx.say(f"outer round {r} of fragment {f}: group {g} left out ({why}); strike {len(rounds)}"
                     + (f" of {c.evict_after}" if c.evict_after else ""))
        if action == "evict" and g not in self.evicting:
            self.evicting[g] = Evict(set(workers), f"{len(rounds)} refused pseudo-gradients ({why})", hr.step_at(r))

    def evict_if_struck(self, g: int) -> None:
        """Group ``g``'s pseudo-gradients were refused ``--evict-after`` times: it is evicted from its
        own rounds (raised there), as a worker blamed for bad tensors is."""
        ev = self.evicting.pop(g, None)
        if ev is not None:
            raise ev
