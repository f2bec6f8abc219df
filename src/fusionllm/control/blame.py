"""Blame that follows the source: a spike that grew along the pipeline is blamed where it started.

A receiver refuses a tensor whose norm is ``--guard-factor`` times its running estimate and names
the sender (``runtime/stage/guards.py``). A spike can grow on its way: one CI run had a gradient 11x its
estimate at the last stage, 50x one stage earlier and 169x the next, where it was refused, naming a
stage that only passed on what it was given. Every worker reports, per step attempt, how far the
tensors it *accepted* exceeded their estimates (per kind and sender, measured by itself as
receiver) and how far the tensors it *sent* exceeded its own estimate of what it sends (per kind).

The rule, from the named sender back: if it accepted a tensor of the same kind (a gradient's spike
may also come from the forward pass: then activations) at least ``sqrt(--guard-factor)`` times its
estimate (10x by default) from a worker that *itself* reports having sent one at least that large,
the blame moves to that worker, and on from there; the largest such excess first. Both ends must say
so: a worker cannot pass its blame to an honest one by claiming it was sent a large tensor (the
honest sender's own report says otherwise), and a worker that hides what it sent keeps the blame
where the guard put it (on the stage that crossed the factor, as without this rule). A spike in the
data repeats on the retry and is not a strike wherever it is blamed (``bad_steps.py``).
"""

from __future__ import annotations

import math

from fusionllm.transport.control import BadTensor, StepDone

DIRECTION = {"act": "act", "grad": "grad", "norm": "grad", "reduce": "grad", "own": "grad"}  # what a refused kind grew from


def threshold(guard_factor: float) -> float:
    """The excess (norm over estimate) from which a tensor that was accepted counts as the start of a spike."""
    return math.sqrt(guard_factor)


def source(bad: BadTensor, replies: dict[int, StepDone], limit: float) -> int:
    """The worker a refused tensor's spike started at: its sender, or a worker upstream of it (above)."""
    at, kind = bad.suspect, DIRECTION.get(bad.kind, "grad")
    seen = {(at, kind)}  # (worker, direction): a stage passed on the way back can be the start of the forward spike
    while (rep := replies.get(at)) is not None:
        step_to = _upstream(rep, kind, replies, limit, seen)
        if step_to is None and kind == "grad":  # a gradient's spike may have grown from the activations
            step_to = _upstream(rep, "act", replies, limit, seen)
            kind = "act" if step_to is not None else kind
        if step_to is None:
            return at
        at = step_to
        seen.add((at, kind))
    return at


def _upstream(rep: StepDone, kind: str, replies: dict[int, StepDone], limit: float, seen: set[tuple[int, str]]) -> int | None:
    """The sender of the largest accepted tensor of ``kind`` over ``limit`` that the sender confirms."""
    best: tuple[float, int] | None = None
    for src, ratio in rep.received_excess.get(kind, {}).items():
        try:
            w = int(src)
        except ValueError:
            continue
        sender = replies.get(w)
        if (w, kind) in seen or sender is None or not ratio >= limit or not sender.sent_excess.get(kind, 0.0) >= limit:
            continue
        if best is None or ratio > best[0]:
            best = (ratio, w)
    return None if best is None else best[1]


def sources(bad: list[BadTensor], replies: dict[int, StepDone], guard_factor: float) -> list[int]:
    """Per refused tensor, the worker to blame (``source``)."""
    limit = threshold(guard_factor)
    return [source(b, replies, limit) for b in bad]
