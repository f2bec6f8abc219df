"""Checked outer steps (hierarchical mode): which groups' pseudo-gradients of a round are averaged.

Before a round of a fragment is averaged, every worker of every sending group reports on the
deltas it holds (``OuterCheck``; ``runtime/stage/outer_check.py``): their dot products with each other
and with the outer momentum, which every group holds alike, and whether each is finite. A group's
leaders cover the fragment once, so a group's report is the sum of its workers'. For each sender,
the coordinator takes the median of the groups' reports: with three groups or more, one group that
lies about another cannot frame it (with two, it can: docs/reliability.md's threat model).

A delta is refused (``judge``) when:

- a value is not finite;
- the groups that received it got different bytes (digests per parameter, three groups or more:
  a sender that equivocates would move the honest groups' outer weights apart);
- its norm is over ``NORM_FACTOR`` times the median of the other senders' norms this round (the
  only sender: over ``NORM_FACTOR`` times its own running estimate);
- it points against the outer momentum while the others point clearly along it (cosine under
  ``-DIRECTION_FLOOR`` and under minus half the others' median, which is over ``AGREE_FLOOR``);
- it points against the sum of the others while they agree among themselves (three groups or
  more; cosine under ``-SUM_FLOOR`` and under minus half their agreement, which is over
  ``SUM_FLOOR``): this also covers the first round, before there is a momentum, and the late rounds
  whose agreement with the momentum is under ``AGREE_FLOOR``.

Late in a run the honest groups' cosines with the momentum fall to 0.05-0.15, where a group that
joined with a fresh AdamW state reads -0.07 to -0.09 for rounds (measured in the hierarchical
soak, where such a group was evicted with a floor of 0.05): below ``AGREE_FLOOR`` of agreement a
direction says nothing, and only the norm rules hold.

With ``--numeric-guard retry`` a refused group sends its delta again once (a corruption on the way
is gone then; a bad delta comes back the same), and a delta refused twice is a strike against its
group: left out of the round, and evicted at ``--evict-after`` strikes within ``STRIKE_ROUNDS``
rounds. ``stop`` ends the run instead; ``off`` checks nothing. ``--outer-aggregate clipped``
scales each accepted delta down to at most ``CLIP_FACTOR`` times their median norm; ``trimmed``
averages each coordinate without its highest and lowest value (three groups or more, on the
workers).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

NORM_FACTOR = 10.0
DIRECTION_FLOOR = 0.05  # a refused direction points against the others' at least this much
AGREE_FLOOR = 0.2  # ... and only while the others agree at least this much with the momentum
SUM_FLOOR = 0.1  # ... or among themselves (three groups or more), and it against their sum by this much
CLIP_FACTOR = 2.0
STRIKE_ROUNDS = 20  # outer rounds a strike counts for
ESTIMATE_DECAY = 0.8  # the running norm estimate: old * decay + new * (1 - decay)


@dataclass(frozen=True)
class Reports:
    """The groups' reports on one round of one fragment, summed per reporting group."""

    dots: dict[int, dict[tuple[int, int], float]]  # reporting group -> (sender, sender or -1: the momentum) -> dot product
    finite: dict[int, dict[int, bool]]  # reporting group -> sender -> finite
    momentum_sq: dict[int, float]  # reporting group -> the momentum's squared norm over the fragment
    digests: dict[int, dict[int, dict[str, str]]] = field(default_factory=dict)  # reporting group -> sender -> parameter -> digest

    def split(self, g: int) -> str | None:
        """A parameter whose delta from ``g`` reached the other groups as different bytes (None: none)."""
        seen: dict[str, set[str]] = {}
        for h, by_sender in self.digests.items():
            if h != g:  # the sender's own word about itself is not evidence
                for n, d in by_sender.get(g, {}).items():
                    seen.setdefault(n, set()).add(d)
        return next((n for n, ds in sorted(seen.items()) if len(ds) > 1), None)

    def median(self, a: int, b: int) -> float:
        key = (min(a, b), max(a, b)) if b >= 0 else (a, -1)
        seen = [d[key] for d in self.dots.values() if key in d]
        return statistics.median(seen) if seen else 0.0

    def finite_of(self, g: int) -> bool:
        seen = [f[g] for f in self.finite.values() if g in f]
        return sum(seen) * 2 > len(seen) if seen else True  # the majority; a tie is not finite


def add_report(into: Reports, group: int, dots: dict[str, dict[str, float]], finite: dict[str, bool], momentum_sq: float,
               digests: dict[str, dict[str, str]] | None = None) -> None:
    """Add one worker's ``OuterChecked`` of group ``group`` to ``into``."""
    for g, by_name in (digests or {}).items():
        into.digests.setdefault(group, {}).setdefault(int(g), {}).update(by_name)
    mine = into.dots.setdefault(group, {})
    for g, row in dots.items():
        for h, v in row.items():
            key = (int(g), -1) if h == "m" else (min(int(g), int(h)), max(int(g), int(h)))
            mine[key] = mine.get(key, 0.0) + float(v)
    fin = into.finite.setdefault(group, {})
    for g, ok in finite.items():
        fin[int(g)] = fin.get(int(g), True) and bool(ok)
    into.momentum_sq[group] = into.momentum_sq.get(group, 0.0) + float(momentum_sq)


@dataclass
class Verdict:
    """Which senders are averaged (with their scale), which are refused and why, and what was measured."""

    accepted: dict[int, float] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    norms: dict[int, float] = field(default_factory=dict)
    cosines: dict[int, float] = field(default_factory=dict)  # with the outer momentum (absent: no momentum yet)


def _cos(dot: float, a: float, b: float) -> float | None:
    return dot / (a * b) if a > 0 and b > 0 else None


def judge(senders: list[int], reports: Reports, estimates: dict[int, float], aggregate: str = "mean") -> Verdict:
    """The verdict on ``senders``' deltas of one round (see the module's rules). ``estimates``: each
    sender's running norm estimate (used when it is the only sender)."""
    v = Verdict()
    m_norm = math.sqrt(statistics.median(reports.momentum_sq.values())) if reports.momentum_sq else 0.0
    finite = {g: reports.finite_of(g) for g in senders}
    for g in senders:
        v.norms[g] = math.sqrt(max(0.0, reports.median(g, g)))
        c = _cos(reports.median(g, -1), v.norms[g], m_norm)
        if c is not None:
            v.cosines[g] = c
    for g in senders:
        if not finite[g]:
            v.refused[g] = "not finite"
        elif (name := reports.split(g)) is not None:
            v.refused[g] = f"sent different deltas to different groups ({name})"
    for g in senders:
        if g in v.refused:
            continue
        others = [v.norms[x] for x in senders if x != g and finite[x]]
        ref = statistics.median(others) if others else estimates.get(g, 0.0)
        if ref > 0 and v.norms[g] > NORM_FACTOR * ref:
            what = "the others' median" if others else "its running estimate"
            v.refused[g] = f"norm {v.norms[g]:.3g}, {v.norms[g] / ref:.0f}x {what} ({ref:.3g})"
    for g in senders:
        if g in v.refused or g not in v.cosines:
            continue
        others_cos = [v.cosines[x] for x in senders if x != g and x in v.cosines and x not in v.refused]
        if others_cos:
            med = statistics.median(others_cos)
            if med > AGREE_FLOOR and v.cosines[g] < -DIRECTION_FLOOR and v.cosines[g] < -0.5 * med:
                v.refused[g] = f"points against the outer momentum (cosine {v.cosines[g]:.2f}, the others' {med:.2f})"
    for g in senders:
        others = [x for x in senders if x != g and x not in v.refused]
        if g in v.refused or len(others) < 2:
            continue
        sum_sq = sum(reports.median(a, b) for a in others for b in others)
        c = _cos(sum(reports.median(g, x) for x in others), v.norms[g], math.sqrt(max(0.0, sum_sq)))
        pairs = [_cos(reports.median(a, b), v.norms[a], v.norms[b]) for i, a in enumerate(others) for b in others[i + 1:]]
        agree = statistics.median([p for p in pairs if p is not None] or [0.0])
        if c is not None and agree > SUM_FLOOR and c < -SUM_FLOOR and c < -0.5 * agree:
            v.refused[g] = f"points against the other groups' sum (cosine {c:.2f}; they agree at {agree:.2f})"
    kept = [g for g in senders if g not in v.refused]
    med_norm = statistics.median([v.norms[g] for g in kept]) if kept else 0.0
    for g in kept:
        clip = CLIP_FACTOR * med_norm / v.norms[g] if aggregate == "clipped" and v.norms[g] > 0 else 1.0
        v.accepted[g] = min(1.0, clip)
    return v


def update_estimates(estimates: dict[int, float], verdict: Verdict) -> None:
    """Fold the accepted senders' norms into their running estimates."""
    for g in verdict.accepted:
        n = verdict.norms[g]
        estimates[g] = n if g not in estimates else ESTIMATE_DECAY * estimates[g] + (1 - ESTIMATE_DECAY) * n
