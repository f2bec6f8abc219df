"""The run measures the planner's finalists and commits to the best (``--finalists``).

Where the planner chose a grouping (``--sync auto``), its best candidates by prediction
(``planning/finalists.shortlist``) each train a few steps, one after the other, from live weights:
each is a grouping of its own (``Grouping.trial``), switched to by a regroup at a pause, and its
steps are training steps like any other. Their tokens/s is measured from their step records (the
first steps of each left out), and a placeholder grouping (``Grouping.decide``) becomes the
finalist with the most measured goodput (``planning/finalists.pick``) for the rest of the run, or up
to the next check (``--recheck-steps``). At a check, the committed plan's tokens/s since it was
chosen is compared with its measurement when chosen; where it moved by more than
``--recheck-threshold``, the planner is asked again (with the device speeds calibrated so far) and
its finalists measured again; else the same grouping goes on. Every choice is an event with each
finalist's predicted and measured figures.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from fusionllm.core.metrics import StepRecord
from fusionllm.planning.finalists import (
    Finalist,
    measured_rate,
    moved,
    pick,
    shortlist,
    trial_steps,
)

from .context import RunContext
from .grouping import Grouping


class Finalists:
    """The finalists of the grouping being chosen, their measurements, and the plan committed to."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.points: list[tuple[int, int, float]] = []  # the grouping in force's step records: (step, tokens, training seconds)
        self.committed: Finalist | None = None
        self.reference: float | None = None  # the committed finalist's measured tokens/s when chosen
        self.last_rate: float | None = None  # the last grouping's measured tokens/s

    def begin(self) -> None:
        """A grouping starts: its own measurement."""
        self.points = []

    def observe(self, record: StepRecord) -> None:
        self.points.append((record.step, record.tokens, record.elapsed_s))

    def ended(self, grouping: Grouping) -> None:
        """A grouping ended: its measured tokens/s, a finalist's kept with it."""
        self.last_rate = measured_rate(self.points, grouping.first)
        if grouping.trial is not None:
            grouping.trial.measured_tokens_per_s = self.last_rate

    def decided(self, grouping: Grouping) -> list[Grouping] | None:
        """A placeholder (``grouping.decide``) as the groupings it stands for: the best measured
        finalist (``commit``), or a check of the committed one (``recheck``); None for any other."""
        if grouping.groups != [] or not grouping.decide:
            return None
        return self.commit(grouping) if grouping.committed is None else self.recheck(grouping, self.last_rate)

    def trials(self, grouping: Grouping) -> list[Grouping] | None:
        """``grouping`` (the planner's choice, with its candidates) as the trials of its finalists and
        a decision after them; None where the run commits to the prediction (``--finalists`` 0 or 1,
        fewer than two candidates, or too few steps: the trials may take at most half of them)."""
        c = self.ctx.cluster
        if c.sync != "auto" or c.finalists < 2 or grouping.trial is not None or grouping.decide:
            return None
        alone = next((f for f in grouping.candidates if f.kind == "alone"), None)
        picks = shortlist([f for f in grouping.candidates if f is not alone], c.finalists, always=alone)
        if len(picks) < 2:
            return None
        lengths = [trial_steps(f, c.finalist_steps) for f in picks]
        if 2 * sum(lengths) > grouping.last - grouping.first:
            self.ctx.say(f"finalists: {sum(lengths)} steps to measure {len(picks)} of them is more than half of the "
                         f"{grouping.last - grouping.first} steps left; committing to the prediction")
            return None
        out, at = [], grouping.first
        for f, n in zip(picks, lengths, strict=True):
            groups, hier = as_run(f)
            out.append(Grouping(at, at + n, groups, hier=hier, trial=f))
            at += n
        out.append(Grouping(at, grouping.last, [], decide=tuple(picks)))
        self.ctx.event({"event": "finalists", "at_step": grouping.first, "steps": lengths, "finalists": [f.figures() for f in picks]})
        self.ctx.say(f"finalists: measuring {', '.join(f'{f.name} ({n} steps)' for f, n in zip(picks, lengths, strict=True))}, "
                     "then committing to the most measured goodput")
        return out

    def commit(self, grouping: Grouping) -> list[Grouping]:
        """The decision placeholder ``grouping`` as the best measured finalist, up to the next check."""
        best = pick(list(grouping.decide))
        by = "measured" if best.measured_goodput is not None else "predicted (none measured)"
        self.committed, self.reference = best, best.measured_tokens_per_s
        self.ctx.event({"event": "finalist_chosen", "at_step": grouping.first, "chose": best.name, "kind": best.kind, "by": by,
                        "finalists": [f.figures() for f in grouping.decide]})
        self.ctx.say(f"finalists: committing to {best.name} at step {grouping.first} (" + ", ".join(
            f"{f.name} {f.measured_tokens_per_s or 0:.0f} tokens/s measured, {f.predicted_tokens_per_s:.0f} predicted, "
            f"efficiency {f.efficiency:.2f}" for f in grouping.decide) + ")")
        return self.segment(best, grouping.first, grouping.last)

    def segment(self, best: Finalist, first: int, last: int) -> list[Grouping]:
        """``best`` from ``first`` to the next check (``--recheck-steps``), then the check; or to ``last``."""
        every = self.ctx.cluster.recheck_steps
        end = first + every if every and first + every + every // 2 < last else last  # no check in the last half interval
        groups, hier = as_run(best)
        run = Grouping(first, end, groups, hier=hier, committed=best)
        return [run] if end == last else [run, Grouping(end, last, [], decide=(best,), committed=best)]

    def recheck(self, grouping: Grouping, measured: float | None) -> list[Grouping]:
        """A check (``grouping.committed`` set on a placeholder): the committed plan goes on where its
        tokens/s (``measured``, over the last grouping) stayed within the threshold of its speed when
        chosen; else the planner is asked again (a placeholder with no groups) and its finalists measured."""
        best = grouping.committed
        assert best is not None
        c = self.ctx.cluster
        ref = self.reference
        due = measured is not None and ref is not None and moved(ref, measured, c.recheck_threshold)
        self.ctx.event({"event": "recheck", "at_step": grouping.first, "committed": best.name, "tokens_per_s_when_chosen": ref,
                        "tokens_per_s_now": measured, "threshold": c.recheck_threshold, "measure_again": due})
        if due:
            self.ctx.say(f"finalists: {best.name} moved from {ref:.0f} to {measured:.0f} tokens/s; planning and measuring again")
            return [replace(grouping, groups=[], decide=(), committed=None)]
        return self.segment(best, grouping.first, grouping.last)


def as_run(f: Finalist) -> tuple[list[list[int]] | None, Any]:
    """A finalist's groups and ``HierPlan`` as a grouping trains them: the fastest device alone is one
    group (no groups, no ``HierPlan``; its set-up is its device, ``alone_device``)."""
    return (None, None) if f.kind == "alone" else (f.groups, copy.deepcopy(f.setup))


def alone_device(grouping: Grouping) -> int | None:
    """The device a grouping trains on alone (a finalist of kind ``alone``), or None."""
    f = grouping.trial or grouping.committed
    return int(f.setup) if f is not None and f.kind == "alone" else None
