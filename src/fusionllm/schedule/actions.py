"""Pipeline schedules as data: per-worker lists of small actions with a text form.

``2F5`` is stage 2's forward of micro-batch 5; ``2SEND_F5`` sends its activations on,
``2RECV_B5`` waits for the gradients of its outputs; ``2REDUCE`` sums gradients shared with other
workers (replicas, tied weights); ``2STEP`` clips with the global norm and applies the optimizer.
A schedule is made of compute actions by a pure function (``gpipe``, ``one_f_one_b``), then
``lower`` inserts the communication. The runtime dispatches actions; it decides nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE", "STEP")
_NO_MB = ("REDUCE", "STEP")
_TEXT = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE|STEP|F|B)(\d*)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str
    mb: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}")
        if (self.mb is None) != (self.kind in _NO_MB):
            raise ValueError(f"action {self.kind} {'takes no' if self.kind in _NO_MB else 'needs a'} micro-batch")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _TEXT.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. 2F5, 2SEND_B3, 1STEP)")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None)


def gpipe(stage: int, num_stages: int, mbs: Sequence[int]) -> list[Action]:
    """All forwards, then all backwards (in the same order)."""
    return [Action(stage, "F", m) for m in mbs] + [Action(stage, "B", m) for m in mbs]


def one_f_one_b(stage: int, num_stages: int, mbs: Sequence[int]) -> list[Action]:
    """Warm up with (num_stages - stage - 1) forwards, then alternate one forward, one backward."""
    warmup = min(len(mbs), max(0, num_stages - stage - 1))
    out = [Action(stage, "F", m) for m in mbs[:warmup]]
    fwd, bwd = list(mbs[warmup:]), list(mbs)
    while fwd or bwd:
        if fwd:
            out.append(Action(stage, "F", fwd.pop(0)))
        if bwd and (not fwd or len(bwd) > len(fwd)):
            out.append(Action(stage, "B", bwd.pop(0)))
    return out


SCHEDULES: dict[str, Callable[[int, int, Sequence[int]], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def lower(stage: int, compute: Sequence[Action], *, recv_f: bool, send_f: bool, recv_b: bool, send_b: bool, reduce: bool) -> list[Action]:
    """Insert communication around compute actions, then REDUCE (if shared gradients) and STEP."""
    out: list[Action] = []
    for a in compute:
        if a.kind == "F":
            out += [Action(a.stage, "RECV_F", a.mb)] if recv_f else []
            out.append(a)
            out += [Action(a.stage, "SEND_F", a.mb)] if send_f else []
        elif a.kind == "B":
            out += [Action(a.stage, "RECV_B", a.mb)] if recv_b else []
            out.append(a)
            out += [Action(a.stage, "SEND_B", a.mb)] if send_b else []
        else:
            raise ValueError(f"lower() takes compute actions only, got {a}")
    if reduce:
        out.append(Action(stage, "REDUCE"))
    out.append(Action(stage, "STEP"))
    return out


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward has run and backward has not (their activations are
    kept): what a program holds in memory at its peak."""
    live, peak = 0, 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            live -= 1
    return peak


def format_grid(lists: dict[str, Sequence[Action]], failed: tuple[str, int] | None = None) -> str:
    """The action lists as a grid (one row per worker); the failing cell is marked with ``!``."""
    width = max((len(str(a)) for acts in lists.values() for a in acts), default=4) + 2
    name_w = max((len(k) for k in lists), default=6)
    lines = []
    for worker, acts in lists.items():
        cells = []
        for i, a in enumerate(acts):
            text = str(a)
            if failed == (worker, i):
                text = f"!{text}!"
            cells.append(text.ljust(width))
        lines.append(f"{worker.ljust(name_w)} | {''.join(cells).rstrip()}")
    return "\n".join(lines)
