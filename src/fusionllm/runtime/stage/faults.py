"""Fault injection for tests and the soak benchmark: a worker that sends poisoned tensors on purpose.

``fusionllm worker --inject-fault nan@3 --inject-fault scale@6`` (test-only: a documented flag,
never an environment variable, so a production worker cannot pick it up by accident) makes the
worker corrupt what it *sends* at those steps, every attempt of them, as a worker with a broken
device would:

- ``nan@K``: the first element of every float tensor it sends at step K (activations, gradients,
  all-reduce chunks) becomes NaN;
- ``scale@M[:F]``: every gradient and all-reduce chunk it sends at step M is multiplied by F
  (default 1e6: a flipped exponent bit).

Hierarchical mode, a group that poisons its pseudo-gradient (``R``: an outer round; the worker must
be one of its group's leaders, which send): what it pushes to the other groups for round R (every
fragment, every attempt: a resend is poisoned too), while its own group averages the true one:

- ``outer-nan@R``: the first element of every pseudo-gradient becomes NaN;
- ``outer-scale@R[:F]``: pseudo-gradients times F (default 100);
- ``outer-flip@R``: pseudo-gradients with their sign flipped;
- ``outer-split@R``: different deltas to different groups (times 1.5 to odd-numbered workers).

A worker that sends no tensors of that role (the first stage sends no gradients) injects nothing.

A faulty worker's stage sends through a ``FaultyLinkSender``: the link sender of every worker, with
the corruption put in front of it, so the send path itself has no fault branch. The corruption comes
before the sender measures what it sends (``SentNorms``), as a broken device's would: the blame of a
spike (``control/blame.py``) follows the faulty worker's own report of it. That is why this is a
sender and not a wrapper around the peer network: a network sees a tensor after it was measured and
encoded, and never sees what a ``torch.distributed`` world carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionllm.core.errors import ConfigError
from fusionllm.runtime.stage.link_sender import LinkSender
from fusionllm.runtime.stage.step import StepState

KINDS = ("nan", "scale", "outer-nan", "outer-scale", "outer-flip", "outer-split")
SCALED = {"scale": 1e6, "outer-scale": 100.0}  # the default factor of each scaling kind


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    factor: float = 1e6

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}" + (f":{self.factor:g}" if self.kind in SCALED else "")

    @property
    def outer(self) -> bool:
        """A fault of a pseudo-gradient (``step`` is an outer round), not of a step's tensors."""
        return self.kind.startswith("outer-")


def parse_fault(spec: str) -> Fault:
    """``nan@K``, ``scale@M[:F]``, ``outer-nan@R``, ``outer-scale@R[:F]`` or ``outer-flip@R``."""
    kind, at, rest = spec.partition("@")
    step_text, _, factor_text = rest.partition(":")
    try:
        if kind not in KINDS or not at:
            raise ValueError
        step = int(step_text)
        factor = float(factor_text) if factor_text else SCALED.get(kind, Fault.factor)
        if step < 0 or (factor_text and kind not in SCALED):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--inject-fault {spec!r}: write nan@STEP, scale@STEP[:FACTOR], outer-nan@ROUND, outer-scale@ROUND[:FACTOR] or outer-flip@ROUND, "
                          "e.g. nan@3, scale@6:1e6 or outer-flip@2") from None
    return Fault(kind, step, factor)


def tamper(faults: tuple[Fault, ...], step: int, role: str, x: np.ndarray) -> np.ndarray:
    """What a faulty worker sends instead of ``x`` (``role``: act, grad or reduce); ``x`` itself is not changed."""
    for f in faults:
        if f.outer or f.step != step or x.dtype != np.float32 or not x.size:
            continue
        if f.kind == "nan":
            x = np.array(x)
            x.reshape(-1)[0] = np.nan
        elif f.kind == "scale" and role in ("grad", "reduce"):
            x = x * np.float32(f.factor)
    return x


def tamper_outer(faults: tuple[Fault, ...], round_: int, x: np.ndarray) -> np.ndarray:
    """What a poisoning group pushes instead of its pseudo-gradient ``x`` of outer round ``round_``."""
    for f in faults:
        if not f.outer or f.step != round_ or not x.size:
            continue
        if f.kind == "outer-nan":
            x = np.array(x, dtype=np.float32)
            x.reshape(-1)[0] = np.nan
        elif f.kind == "outer-scale":
            x = x * np.float32(f.factor)
        elif f.kind == "outer-flip":
            x = -x
    return x


class FaultyLinkSender(LinkSender):
    """A link sender that corrupts what it sends at its faults' steps (``tamper``), before it is measured."""

    def __init__(self, *args: Any, faults: tuple[Fault, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults

    def outgoing(self, st: StepState, header: dict, x: np.ndarray | None, role: str, dst: int,
                 dtype: str = "float32") -> tuple[dict, np.ndarray | None]:
        return super().outgoing(st, header, None if x is None else tamper(self.faults, st.step, role, x), role, dst, dtype)

    def as_carried(self, st: StepState, dst: int, kind: str, edge: str, t: Any) -> Any:
        if t is None:
            return t
        dtype = self.edges[edge].meta.dtype
        _, x = self.outgoing(st, {"edge": edge}, self.host(t), kind, dst, dtype)
        return None if x is None else self.backend.from_host(x, dtype)
