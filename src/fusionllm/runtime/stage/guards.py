"""Numeric guards: every tensor a worker receives in a training step is checked before it is used.

A worker whose device starts returning NaNs, or whose memory flips a bit in an exponent, sends
tensors that are not finite or far larger than anything that edge carried before. The receiver
checks each activation, gradient and all-reduce chunk it is sent (one pass: the sum of squares,
non-finite when any element is) and compares its norm with a running estimate kept per (kind, edge,
sender). A bad tensor does not stop the step: it poisons it. The worker goes on (so nobody waits on
it), marks every tensor it sends afterwards as tainted, so that its receivers do not blame it for
what it forwards, and at the step's STEP action all workers learn, through the gradient-norm
exchange they do anyway, that somebody was poisoned: nobody applies the update. The coordinator
names the suspect (the sender of the first untainted bad tensor) and retries or skips the step
(``control/steps.py``).

The estimate learns only from tensors it accepted, after ``warmup`` observations; a norm above
``factor`` times the estimate is bad. A genuine loss spike of that size would be refused too: it is
retried, then skipped, as a bad one would be (``--guard-factor`` sets the factor).

Which tensors get the norm test: activations, their gradients, and each worker's share of the
squared gradient norm (dense: their norms move smoothly from step to step). All-reduce chunks are
only checked for non-finite values: a chunk of a sparse gradient (the rows of a token embedding
that only rare tokens touch) is near zero for hundreds of steps and then not, and the soak run
measured one at 1,120x its running estimate in a healthy run. A replica that sends a scaled chunk
is still caught, one step later in the pipeline of checks: the sum it poisons enters the owner's
share of the gradient norm, which is norm-tested (the blame then falls on that owner).

A spike can grow along the pipeline: a stage's gradients 11x their usual size become 50x one stage
further and 169x the next, where the guard refuses them and names the stage that sent the 169x. To
let the coordinator follow it back (``control/blame.py``), every worker also reports how far the
tensors it accepted exceeded their estimates (``StepState.received_excess``, per kind and sender)
and how far the tensors it sent exceeded its own estimate of what it sends (``SentNorms``,
``StepState.sent_excess``, per kind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fusionllm.transport.control import BadTensor

FLOATS = ("float16", "float32", "float64")
NORM_TESTED = ("act", "grad", "norm")  # the kinds whose norm is compared with a running estimate (see above)


def as_float(array: np.ndarray, dtype: str) -> np.ndarray | None:
    """The array as floats to check (bfloat16 travels as uint16 bit patterns); None: not a float."""
    if dtype == "bfloat16" and array.dtype == np.uint16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    if array.dtype.name in FLOATS:
        return array
    return None


def norm_of(x: np.ndarray) -> float:
    """The L2 norm (inf when any element is not finite); one pass in the array's own precision, a
    float64 pass only when that overflows."""
    flat = x.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        sq = float(np.dot(flat, flat)) if flat.size else 0.0
    if math.isfinite(sq):
        return math.sqrt(sq)
    if not np.isfinite(flat).all():
        return math.inf
    return float(np.linalg.norm(flat.astype(np.float64)))


@dataclass
class Estimate:
    mean: float = 0.0
    count: int = 0

    def ratio(self, norm: float, warmup: int) -> float:
        """``norm`` over the estimate (0: still warming up)."""
        return norm / self.mean if self.count >= warmup and self.mean > 0 else 0.0

    def learn(self, norm: float, alpha: float) -> None:
        self.mean = norm if self.count == 0 else (1 - alpha) * self.mean + alpha * norm
        self.count += 1


@dataclass
class NumericGuard:
    """One worker's checks of what it receives; ``estimates`` live as long as its assignment."""

    worker: int
    factor: float = 100.0
    warmup: int = 4
    alpha: float = 0.2
    estimates: dict[tuple, Estimate] = field(default_factory=dict)
    trust_norms: bool = False  # this attempt: only non-finite values are refused (a data spike seen twice: control/bad_steps.py)
    last_ratio: float = 0.0  # the ratio of the last tensor refused
    last_seen: float = 0.0  # the ratio of the last tensor accepted (0: its estimate is still warming up)

    def why_bad(self, key: tuple, norm: float) -> str | None:
        """The reason a tensor of this norm is refused on ``key`` (None: accepted, estimate updated)."""
        self.last_ratio = math.inf
        if not math.isfinite(norm):
            return "non-finite values"
        if key[0] not in NORM_TESTED:
            return None
        est = self.estimates.setdefault(key, Estimate())
        self.last_seen = est.ratio(norm, self.warmup)
        if not self.trust_norms and self.last_seen > self.factor:
            self.last_ratio = self.last_seen
            return f"norm {norm:.3g} is {self.last_seen:.3g}x its running estimate {est.mean:.3g} (limit {self.factor:g}x)"
        est.learn(norm, self.alpha)
        return None

    def check(self, kind: str, edge: str, mb: int, src: int, array: np.ndarray | None, dtype: str) -> BadTensor | None:
        """``array`` received from ``src``: a BadTensor naming ``src`` when it is refused."""
        self.last_seen = 0.0
        if array is None:
            return None
        x = as_float(array, dtype)
        if x is None:
            return None
        why = self.why_bad((kind, edge, src), norm_of(x))
        return None if why is None else BadTensor(src, self.worker, kind, edge, mb, why, self.last_ratio)

    def check_share(self, src: int, sq: float) -> BadTensor | None:
        """A worker's share of the squared gradient norm (its own gradients, which nobody else sees)."""
        why = self.why_bad(("norm", "sq", src), math.sqrt(sq) if sq >= 0 else math.nan)
        return None if why is None else BadTensor(src, self.worker, "norm", "sq", 0, why, self.last_ratio)


@dataclass
class SentNorms:
    """What a worker sends, measured against its own running estimate per (kind, edge, destination):
    the sender's side of the excess the coordinator follows back along the pipeline (``control/blame.py``).
    The estimate learns from every tensor under ``factor`` times it (what the receiver would accept)."""

    factor: float = 100.0
    warmup: int = 4
    alpha: float = 0.2
    estimates: dict[tuple, Estimate] = field(default_factory=dict)

    def measure(self, key: tuple, array: np.ndarray | None, dtype: str) -> float:
        """How many times its estimate this tensor's norm is (0: not a float, or still warming up; inf: not finite)."""
        x = None if array is None else as_float(array, dtype)
        if x is None:
            return 0.0
        norm = norm_of(x)
        if not math.isfinite(norm):
            return math.inf
        est = self.estimates.setdefault(key, Estimate())
        ratio = est.ratio(norm, self.warmup)
        if ratio <= self.factor:
            est.learn(norm, self.alpha)
        return ratio


def note(excess: dict, kind: str, ratio: float, src: int | None = None) -> None:
    """Keep the largest ratio per kind (and per sender, with ``src``) in a step's excess record."""
    if src is None:
        excess[kind] = max(excess.get(kind, 0.0), ratio)
    else:
        per = excess.setdefault(kind, {})
        per[src] = max(per.get(src, 0.0), ratio)


def suspects(bad: list[BadTensor]) -> list[int]:
    """The workers named by bad tensors, most-named first (ties: lower id)."""
    counts: dict[int, int] = {}
    for b in bad:
        counts[b.suspect] = counts.get(b.suspect, 0) + 1
    return sorted(counts, key=lambda w: (-counts[w], w))
