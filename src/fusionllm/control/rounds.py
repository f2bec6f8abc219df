"""The round arithmetic of a grouping, the components that own it, and a bounded wait on its condition.

``RoundClock``: where each group is (its rounds, the round it is in, the user's step an inner step
is at); ``DataOffsets``: which batch each inner step reads; ``PauseSchedule``: the rounds before
which every group pauses. Pure functions: which pauses write a checkpoint, which round a resumed
run starts at.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field


@dataclass
class RoundClock:
    """The user's steps ``first`` to ``last`` as rounds: group -> inner steps of each of its rounds
    (every group has as many rounds; a faster group more inner steps in each), the first round a
    group takes part in (one that joined), the round each is in, and the round a re-plan ends every
    group before (``end_at``)."""

    first: int
    last: int
    lengths: dict[int, list[int]]
    first_round: dict[int, int] = field(default_factory=dict)
    current: dict[int, int] = field(default_factory=dict)
    end_at: int | None = None
    replan_why: str = ""
    # the run's tokens at ``first`` in global batches, less ``first``: where the groupings before this one
    # trained more tokens than their steps (a finalist's trial of groups of several H rounds its rounds up),
    # every step reads the learning-rate schedule this much further on, at the run's tokens (phases.py)
    shift: float = 0.0

    @property
    def rounds(self) -> int:
        return len(next(iter(self.lengths.values())))

    def user_step(self, g: int, i: int) -> int:
        """The user's step at group ``g``'s inner step ``i`` (of this grouping): its place on ``first`` to ``last``."""
        return self.first + i * (self.last - self.first) // max(1, sum(self.lengths[g]))

    def step_at(self, p: int, alive: set[int]) -> int:
        """The user's step once rounds ``0 .. p - 1`` are done: counted in the live group with the
        fewest inner steps per round (a checkpoint's step, and the step a restart resumes at)."""
        ref = min((self.lengths[g] for g in alive), key=sum, default=None)
        return self.first + sum(ref[:p]) if ref is not None else self.first

    def crossed(self, k: int, every: int) -> bool:
        """Whether round ``k``'s end passes a multiple of ``every`` user steps, counted in the group
        with the fewest inner steps (of every group that took part, so that all groups agree)."""
        ref = min(self.lengths.values(), key=sum)
        return (self.first + sum(ref[: k + 1])) // every > (self.first + sum(ref[:k])) // every

    def reached(self) -> int:
        """The user's step where every group ended (``end_at``): counted in the slowest group, on
        ``first`` to ``last``."""
        ref = min(self.lengths.values(), key=sum)
        done = sum(ref[: self.end_at]) if self.end_at is not None else sum(ref)
        return self.first + done * (self.last - self.first) // max(1, sum(ref))

    def expected(self, r: int, alive: set[int]) -> set[int]:
        """The live groups that take part in round ``r`` (a group that joined later does not)."""
        return {g for g in alive if self.first_round.get(g, 0) <= r}

    def join(self, g: int, like: int, k0: int) -> None:
        """Group ``g`` takes part from round ``k0``, with group ``like``'s rounds."""
        self.lengths[g] = list(self.lengths[like])
        self.first_round[g] = self.current[g] = k0


@dataclass
class DataOffsets:
    """Which batch each inner step reads: group ``g`` of the first plan's ``n`` groups reads
    ``start + i * n + g`` (``start``: the first batch no earlier grouping read), a group that joined
    reads batches of its own from ``base[g]``; ``next`` is past every batch read so far (where the
    next grouping's data starts)."""

    start: int
    n: int
    base: dict[int, int] = field(default_factory=dict)
    next: int = 0

    def batch(self, g: int, i: int) -> int:
        """The batch group ``g``'s inner step ``i`` reads."""
        return self.base[g] + i if g in self.base else self.start + i * self.n + g

    def read(self, batch: int) -> None:
        """``batch`` was read (a step ran on it, or was skipped: it is spent either way)."""
        self.next = max(self.next, batch + 1)

    def join(self, g: int, longest: int) -> None:
        """Group ``g`` joins: batches past every one another group reads in ``longest`` inner steps."""
        self.base[g] = self.start + (self.n + len(self.base)) * longest


@dataclass
class PauseSchedule:
    """The rounds before which every group pauses (``hier_pauses.py``), those that write a
    checkpoint, the pause at which spares join, the last pause done, and the groups waiting."""

    pauses: set[int]
    ckpt_rounds: set[int]
    resumed: int = 0
    join_at: int | None = None
    arrived: set[int] = field(default_factory=set)


async def wait_notified(cond: asyncio.Condition, timeout: float) -> None:
    """``cond.wait()`` for at most ``timeout`` seconds; the caller holds ``cond``'s lock.

    Not ``asyncio.wait_for(cond.wait(), timeout)``: when the task is cancelled in the loop turn in
    which the wait was notified, Python 3.11's ``wait_for`` returns the result and the cancellation
    is lost, so a loop around it never ends (the coordinator's pauser hung that way when the last
    group finished). Here the timeout is a notification from a timer task, and a cancellation
    always reaches the caller."""

    async def wake() -> None:
        await asyncio.sleep(timeout)
        async with cond:
            cond.notify_all()  # the other waiters re-check their conditions: a spurious wake-up is harmless

    timer = asyncio.create_task(wake())
    try:
        await cond.wait()
    finally:
        timer.cancel()


def budget_rounds(steps: int, inner_steps: list[int]) -> int:
    """Rounds of a grouping whose groups take ``inner_steps`` (H) each round, so that its inner steps add
    up to the run's token budget: ``steps`` of the global batch, which the groups share (each inner step
    is 1/len(groups) of it). Groups of one H: ``ceil(steps / H)``, each group ``steps`` inner steps;
    groups of several H: the fast ones take more than ``steps`` and the slow ones fewer, and together
    as many as the groups would at one H (counting rounds by the largest H alone left a grouping's
    tokens, and so its learning-rate schedule in tokens, short of every other system's)."""
    return max(1, math.ceil(steps * len(inner_steps) / max(1, sum(inner_steps))))


def checkpoint_rounds(lengths: list[int], every: int) -> set[int]:
    """The pauses (round indices ``p``: before round ``p`` starts) at which a checkpoint is written:
    after the first round whose cumulative steps ``lengths`` reach each multiple of ``every``."""
    out, done = set(), 0
    for k, h in enumerate(lengths[:-1]):  # the run's end writes the last one
        if every and (done + h) // every > done // every:
            out.add(k + 1)
        done += h
    return out


def resume_round(lengths: list[int], step: int) -> int:
    """The round to start from when ``step`` steps (of the slowest group) are done."""
    done, k = 0, 0
    while k < len(lengths) and done + lengths[k] <= step:
        done += lengths[k]
        k += 1
    return k
