"""Bad steps: what the coordinator does when the workers' numeric guards refused a tensor.

The workers have already made sure that nobody applied the step (``runtime/stage/guards.py``). Here the
coordinator names the suspect (the sender of each refused tensor, or the worker upstream where its
spike started: ``blame.py``), counts strikes against it (by its address, which outlives a
renumbering), and follows ``--numeric-guard``:

- ``retry``: run the step once more from the same state (same batch, same learning rate, same
  dropout masks); a second bad attempt skips the step (its batch is not used, the next step
  follows). A worker blamed ``--evict-after`` times within ``STRIKE_WINDOW`` steps is evicted: the
  run is planned again without it, from the live weights of the others (``Evict``), and the step
  runs on the new plan. Older strikes are forgotten: a healthy run can meet a genuine spike that
  the guard refuses (two strikes: the attempt and its retry, docs/reliability.md), and a second one
  hundreds of steps later must not evict a healthy worker; a failing device keeps failing.
  A **data spike** is told apart on the retry: the same refused tensors with the same finite norms
  (each at most ``SPIKE_CAP`` times its estimate) are the batch, not a worker. Their strikes are
  taken back, and the step runs once more with only non-finite values refused (``Step.trust_norms``),
  so that the estimates learn the new norms; a NaN, or a norm a million times its estimate (a
  flipped exponent bit, the tests' ``scale@M``), stays a strike however often it repeats.
- ``stop``: the run ends with an error naming the worker.

Every bad attempt is a metrics event ``{"event": "bad_step", ...}`` naming the suspects.
"""

from __future__ import annotations

import math
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.transport.control import StepDone

from .blame import sources
from .config import ClusterConfig, Evict, Say
from .membership import Membership

STRIKE_WINDOW = 200  # steps a strike counts for
SPIKE_CAP = 1e4  # a refused norm at most this many times its estimate, the same on the retry, may be the data (not a strike)


class Strikes:
    """The bad-step rule, the same for every group: who is blamed, how often lately, and what follows."""

    def __init__(self, cluster: ClusterConfig, membership: Membership, event: Any, say: Say) -> None:
        """``event``: where a ``bad_step`` record goes (the metrics file and the dashboard)."""
        self.cluster, self.membership, self.event, self.say = cluster, membership, event, say
        self.by_address: dict[str, list[int]] = {}  # per worker address: the steps of the bad tensors blamed on it lately
        self._signatures: dict[tuple[int | None, int], list[tuple]] = {}  # (group, step) -> its last attempt's bad tensors
        self._trusting: dict[tuple[int | None, int], bool] = {}  # (group, step) -> its next attempt trusts the norms
        self._blamed: dict[tuple[int | None, int], list[int]] = {}  # (group, step) -> per bad tensor of its last attempt, the worker blamed

    def count(self, w: int) -> int:
        """Worker ``w``'s strikes within the window."""
        member = self.membership.members.get(w)
        return len(self.by_address.get(member.address, [])) if member is not None else 0

    def judge(self, step: int, attempt: int, replies: dict[int, StepDone], *, group: int | None = None) -> int:
        """Record a bad attempt of ``step`` and decide: the next attempt's number, or -1 to skip the step.
        Raises ``Evict`` when a suspect reached ``--evict-after`` strikes, and ``FusionError`` with
        ``--numeric-guard stop``. ``group``: the group the step belongs to (a run of several)."""
        c = self.cluster
        if not all(rep.skipped for rep in replies.values()):
            applied = sorted(w for w, rep in replies.items() if not rep.skipped)
            raise FusionError(f"step {step}: workers {applied} applied a step others refused; the stages have diverged (resume from a checkpoint)")
        bad = sorted((b for rep in replies.values() for b in rep.bad), key=lambda b: (b.suspect, b.kind, b.edge, b.mb, b.detector))
        members = self.membership.members
        signature = sorted((b.suspect, b.kind, b.edge, b.mb, f"{b.ratio:.6g}") for b in bad)
        key = (group, step)
        # where each refused tensor's spike started (blame.py); an attempt that meets the same tensors names the same
        # workers: the first attempt's estimates had not yet learnt the spike's accepted part (a retry's have)
        repeated = attempt >= 1 and signature == self._signatures.get(key)  # the same refused tensors as the attempt before
        blamed = self._blamed[key] if repeated else sources(bad, replies, c.guard_factor)
        self._blamed[key] = blamed
        named = sorted(set(blamed))
        spike = (repeated and bool(bad) and self.cluster.numeric_guard == "retry"
                 and all(math.isfinite(b.ratio) and 0 < b.ratio <= SPIKE_CAP for b in bad) and not self._trusting.get(key))
        for old in [k for k in self._signatures if k[1] <= step - STRIKE_WINDOW]:  # steps long done: forgotten
            self._signatures.pop(old, None)
            self._trusting.pop(old, None)
            self._blamed.pop(old, None)
        self._signatures[key] = signature
        if spike:  # the same finite norms as the attempt before: the data, not a worker (its strikes are taken back)
            self._trusting[key] = True
        else:
            self._trusting.pop(key, None)
        for w in named:
            address = members[w].address if w in members else f"worker {w}"
            kept = [s for s in self.by_address.get(address, []) if s > step - STRIKE_WINDOW]
            self.by_address[address] = [s for s in kept if s != step] if spike else [*kept, step]
        why = "; ".join(sorted({f"{b.kind} {b.edge} from worker {b.suspect}: {b.why}" + (f" (a spike that started at worker {w})" if w != b.suspect else "")
                                for b, w in zip(bad, blamed, strict=True)})) or "the gradient norm is not finite"
        event: dict[str, Any] = {
            "event": "bad_step", "step": step, "attempt": attempt, "suspects": named,
            "addresses": {str(w): members[w].address for w in named if w in members},
            "strikes": {str(w): self.count(w) for w in named if w in members},
            "bad": [{"suspect": b.suspect, "detector": b.detector, "kind": b.kind, "edge": b.edge, "mb": b.mb, "why": b.why, "source": w}
                    for b, w in zip(bad, blamed, strict=True)],
        }
        if group is not None:
            event["group"] = group
        evict = {w for w in named if c.evict_after and event["strikes"].get(str(w), 0) >= c.evict_after}
        if c.numeric_guard == "stop":
            event["action"] = "stop"
        elif spike:
            event["action"] = "trust"
            evict = set()
        elif evict:
            event["action"] = "evict"
        else:
            event["action"] = "retry" if attempt == 0 else "skip"
        self.event(event)
        who = f"worker(s) {named}" if named else "no single worker"
        where = f"group {group} " if group is not None else ""
        if event["action"] == "stop":
            raise FusionError(f"{where}step {step}: a bad tensor ({why}); blamed: {who}. Stopped (--numeric-guard stop); "
                              f"--numeric-guard retry skips such steps and evicts a worker that keeps sending them")
        if event["action"] == "evict":
            raise Evict(evict, f"{max(event['strikes'][str(w)] for w in evict)} bad tensors ({why})", step)
        if event["action"] == "trust":
            self.say(f"{where}step {step} attempt {attempt + 1}: the same norms as the attempt before ({why}): a spike in the data, "
                     "not a strike; running it once more with only non-finite values refused")
            return attempt + 1
        self.say(f"{where}step {step} attempt {attempt + 1}: bad tensor ({why}); blamed: {who}; "
                 + ("running it again" if event["action"] == "retry" else "skipping the step"))
        return 1 if event["action"] == "retry" else -1

    def data_spike(self, step: int, group: int | None = None) -> bool:
        """Whether the next attempt of ``step`` runs trusting the norms (``judge`` saw a data spike)."""
        return self._trusting.get((group, step), False)
