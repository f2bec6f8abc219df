"""Fault injection for tests and the soak benchmark: a worker that sends poisoned tensors on purpose.

``fusionllm worker --inject-fault nan@3 --inject-fault scale@6`` (test-only: a documented flag,
never an environment variable, so a production worker cannot pick it up by accident) makes the
worker corrupt what it *sends* at those steps, every attempt of them, as a worker with a broken
device would:

- ``nan@K``: the first element of every float tensor it sends at step K (activations, gradients,
  all-reduce chunks) becomes NaN;
- ``scale@M[:F]``: every gradient and all-reduce chunk it sends at step M is multiplied by F
  (default 1e6: a flipped exponent bit).

A worker that sends no tensors of that role (the first stage sends no gradients) injects nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusionllm.core.errors import ConfigError

KINDS = ("nan", "scale")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    factor: float = 1e6

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}" + (f":{self.factor:g}" if self.kind == "scale" else "")


def parse_fault(spec: str) -> Fault:
    """``nan@K`` or ``scale@M[:F]``."""
    kind, at, rest = spec.partition("@")
    step_text, _, factor_text = rest.partition(":")
    try:
        if kind not in KINDS or not at:
            raise ValueError
        step = int(step_text)
        factor = float(factor_text) if factor_text else 1e6
        if step < 0 or (factor_text and kind != "scale"):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--inject-fault {spec!r}: write nan@STEP or scale@STEP[:FACTOR], e.g. nan@3 or scale@6:1e6") from None
    return Fault(kind, step, factor)


def tamper(faults: tuple[Fault, ...], step: int, role: str, x: np.ndarray) -> np.ndarray:
    """What a faulty worker sends instead of ``x`` (``role``: act, grad or reduce); ``x`` itself is not changed."""
    for f in faults:
        if f.step != step or x.dtype != np.float32 or not x.size:
            continue
        if f.kind == "nan":
            x = np.array(x)
            x.reshape(-1)[0] = np.nan
        elif f.kind == "scale" and role in ("grad", "reduce"):
            x = x * np.float32(f.factor)
    return x
