"""Plans chosen by measurement: the planner's shortlist, and the choice among measured finalists.

A prediction ranks candidates; it does not settle close calls. On a shared machine predicted step
times were 20-50% off, and a plan chosen on predictions alone picked the wrong candidate (issue 58).
Autotuners measure their finalists instead of trusting a model, and so does the run (``control/
finalists.py``): the planner's best few candidates by predicted goodput (``shortlist``) each train a
few steps from live weights (the steps count as training), their tokens/s is measured, and the run
commits to the best measured goodput (``pick``): measured tokens/s times the per-token efficiency the
planner's model gives that kind of plan (1 for a synchronous plan; ``planning/efficiency.py`` for
groups). It checks again when the committed plan's measured speed moves (``moved``).

A candidate is a ``Finalist`` of some ``kind`` (a synchronous plan, groups x H, and any other kind a
planner proposes): its predicted figures and what the run sets up to train it (``setup``). Nothing
here knows how a kind is trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIE = 0.03  # measured goodputs within 3% of the best are a tie: the better prediction wins
MEASURE_SKIP = 2  # a finalist's first steps (new connections, a new plan's first sends) are not measured


@dataclass
class Finalist:
    """One candidate plan: its name and kind, the groups it trains (None: one group of every
    device), its predicted tokens/s and per-token efficiency, its longest round in inner steps
    (a trial spans at least one), what the run sets up to train it (a ``HierPlan`` for groups,
    None where the set-up plans it), and, once trained, its measured tokens/s."""

    name: str
    kind: str
    groups: list[list[int]] | None
    predicted_tokens_per_s: float
    efficiency: float = 1.0
    round_steps: int = 1
    setup: Any = field(default=None, repr=False)
    measured_tokens_per_s: float | None = None

    @property
    def predicted_goodput(self) -> float:
        return self.predicted_tokens_per_s * self.efficiency

    @property
    def measured_goodput(self) -> float | None:
        return None if self.measured_tokens_per_s is None else self.measured_tokens_per_s * self.efficiency

    def figures(self) -> dict[str, Any]:
        """Its predicted and measured figures, for the choice's event."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "groups": self.groups,
                               "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 1), "efficiency": round(self.efficiency, 4),
                               "predicted_goodput": round(self.predicted_goodput, 1)}
        if self.measured_tokens_per_s is not None:
            out.update(measured_tokens_per_s=round(self.measured_tokens_per_s, 1), measured_goodput=round(self.measured_goodput or 0.0, 1))
        return out


def alone(device: int, speed: float, total_speed: float, one_group: float) -> Finalist:
    """The fastest device alone (one group, one device, one micro-batch): a finalist the shortlist
    always holds, since on unseen clusters the distributed plans measured 0.66-0.72x of a plain loop
    on that device while predicted 1.5x faster (issue 58). Its prediction is crude (the share of
    ``one_group``'s predicted tokens/s that the device's ``speed`` is of the ``total_speed``): the
    measurement decides."""
    share = speed / total_speed if total_speed > 0 else 1.0
    return Finalist(f"worker {device} alone", "alone", [[device]], max(1e-9, one_group * share), setup=device)


def shortlist(candidates: list[Finalist], n: int, always: Finalist | None = None) -> list[Finalist]:
    """The ``n`` candidates with the most predicted goodput, one of each set of groups, best first;
    ``always`` (the fastest device alone) takes the last place where it is not among them."""
    if always is not None and n >= 2:
        best = shortlist(candidates, n - 1)
        keys = {None if c.groups is None else tuple(tuple(g) for g in c.groups) for c in best}
        return best + ([always] if tuple(tuple(g) for g in always.groups or []) not in keys else [])
    out: list[Finalist] = []
    seen: set[Any] = set()
    for c in sorted(candidates, key=lambda c: -c.predicted_goodput):
        key = None if c.groups is None else tuple(tuple(g) for g in c.groups)
        if key in seen or c.predicted_goodput <= 0:
            continue
        seen.add(key)
        out.append(c)
        if len(out) == n:
            break
    return out


def pick(finalists: list[Finalist]) -> Finalist:
    """The finalist with the most measured goodput; among those within ``TIE`` of it, the one with the
    most predicted goodput (a measurement of a few steps cannot tell them apart). Unmeasured
    finalists (one that could not run) lose to any measured one."""
    measured = [f for f in finalists if f.measured_goodput is not None and f.measured_goodput > 0]
    if not measured:
        return max(finalists, key=lambda f: f.predicted_goodput)
    best = max(f.measured_goodput or 0.0 for f in measured)
    close = [f for f in measured if (f.measured_goodput or 0.0) >= best * (1 - TIE)]
    return max(close, key=lambda f: (f.predicted_goodput, f.measured_goodput or 0.0))


def moved(reference: float, now: float, threshold: float) -> bool:
    """Whether a measured speed moved by more than ``threshold`` (relative) either way."""
    if reference <= 0 or threshold <= 0:
        return False
    return abs(now / reference - 1.0) > threshold


def trial_steps(finalist: Finalist, steps: int) -> int:
    """Steps to measure ``finalist`` for: ``steps``, and at least its first measured step and one
    whole round (groups pay their outer sync once a round)."""
    return max(steps, MEASURE_SKIP + 2, finalist.round_steps + MEASURE_SKIP)


def measured_rate(points: list[tuple[int, int, float]], first: int, skip: int = MEASURE_SKIP) -> float | None:
    """Tokens/s over step records ``(step, tokens so far, training seconds so far)`` of a grouping
    that started at ``first``, its first ``skip`` steps left out; None with fewer than two."""
    kept = sorted((e, t) for s, t, e in points if s >= first + skip - 1)
    if len(kept) < 2 or kept[-1][0] <= kept[0][0]:
        return None
    return (kept[-1][1] - kept[0][1]) / (kept[-1][0] - kept[0][0])


def left_out(unused: list[int], chosen: str, candidates: list[dict[str, Any]]) -> dict[int, str]:
    """Why each device in ``unused`` is in no group of the chosen grouping (named ``chosen``), from
    the planner's candidates (their ``workers`` and ``time_to_target``, 1 the chosen one's): the
    best candidate that uses it and how much later it is predicted to reach a target loss, or that no
    candidate could plan it."""
    out: dict[int, str] = {}
    for d in sorted(unused):
        using = [c for c in candidates if any(d in g for g in c.get("workers", []))]
        if not using:
            out[d] = (f"no candidate grouping places it (every group tried with it ran out of memory, or the planning budget "
                      f"was spent); '{chosen}' does without it")
            continue
        best = min(using, key=lambda c: c.get("time_to_target", float("inf")))
        out[d] = (f"'{chosen}' is predicted to reach a target loss first; the best grouping that uses it, '{best['grouping']}' "
                  f"({best['groups']} group{'s' if best['groups'] != 1 else ''}), {best.get('time_to_target', float('inf')):.2f}x later")
    return out
