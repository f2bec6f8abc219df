"""The outer loop of hierarchical mode on one worker: pseudo-gradients out, outer optimiser in.

Each worker keeps, for the trainable parameters of its stage, the **outer weights** (``anchor``:
the same on every holder of a parameter in every group) and the outer optimiser's momentum. When a
fragment syncs (``OuterSync``):

1. ``send``: the fragment's change since its last sync, ``delta = start - weights`` (DiLoCo's sign:
   a gradient), is encoded per parameter with error feedback and pushed to the holders of that
   parameter in the other groups (only the group's leader sends; a replica computes the same).
2. ``apply``: for each named round, the token-weighted average of the groups' decoded deltas
   (this worker's own group from what it encoded itself) is an outer step on the anchor:
   Nesterov SGD as ``torch.optim.SGD(nesterov=True)``.
3. The weights become the anchor, minus the own deltas sent but not applied yet (with overlap,
   they are averaged later), plus the progress made since the last send (with a delay of a few
   steps between send and apply, those steps are kept, as in Streaming DiLoCo's overlap).

Before a round is averaged, the coordinator may ask what arrived (``check``: ``runtime/stage/outer_check.py``)
and have a group send its delta again (``resend``); it then names the groups to average, the same for
every group, so the outer state stays identical everywhere.

An ``OuterSync`` is run as the outer actions of the worker's program (``OSEND``, ``ORECV``,
``OREDUCE``, ``OAPPLY``: ``schedule/outer_program.py``), each by its entry of ``HANDLERS``, so the
runtime runs what the validator checked and the simulator replayed.

Everything is NumPy float32 on the host; a worker of any backend runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.core.errors import FusionError, WireError
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.stage.faults import Fault, tamper_outer
from fusionllm.runtime.stage.outer_check import average, digests, report
from fusionllm.schedule.actions import OuterAction
from fusionllm.schedule.hierarchy import Exchange, HierPlan, exchange

Push = Callable[..., Awaitable[None]]  # (destination, header, array, (codec, payload), attempt=None)
Get = Callable[[tuple, float], Awaitable[np.ndarray | None]]
RESEND_ATTEMPT = 1 << 20  # the attempt stamped on a delta sent again: above any step's, so the receiver files it anew


class Average(NamedTuple):
    """One round's average to apply: the groups in it (-> their token weight), the run's step once it
    is applied (-1: unknown), per-group scales (``clipped``) and how the deltas are combined."""

    round: int
    groups: dict[int, float]
    step: int = -1
    scale: dict[int, float] | None = None
    aggregate: str = "mean"


def nesterov_step(anchor: np.ndarray, momentum: np.ndarray | None, grad: np.ndarray, lr: float, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """One step of SGD with Nesterov momentum, as torch computes it (dampening 0, no weight decay):
    ``buf = mu * buf + g`` (``g`` on the first step), ``p -= lr * (g + mu * buf)``."""
    buf = grad.copy() if momentum is None else mu * momentum + grad
    return anchor - lr * (grad + mu * buf), buf  # new arrays, never the old ones changed: a Snapshot keeps those


class Snapshot:
    """The outer weights and momentum at the newest run step that every fragment has applied: what a
    restarted coordinator reads (``GetState(outer)``), also while fragments are a round apart.

    It holds references, not copies: an outer step replaces a parameter's arrays (``nesterov_step``)
    and never writes into them, so the arrays of a fragment already a round ahead stay as they were.
    The memory it costs is those fragments' previous arrays: at most one outer state, none with one
    fragment."""

    def __init__(self, fragments: int, step: int, anchor: dict[str, np.ndarray], momentum: dict[str, np.ndarray]) -> None:
        self.at = [step] * fragments  # each fragment's step once its last applied round
        self.step = step
        self.anchor, self.momentum = dict(anchor), dict(momentum)

    def applied(self, fragment: int, step: int, anchor: dict[str, np.ndarray], momentum: dict[str, np.ndarray]) -> None:
        """Fragment ``fragment`` applied the round that ends at run step ``step`` (-1: unknown)."""
        if step < 0:
            return
        self.at[fragment] = max(self.at[fragment], step)
        if all(s == self.at[fragment] for s in self.at) and self.at[fragment] > self.step:
            self.step, self.anchor, self.momentum = self.at[fragment], dict(anchor), dict(momentum)

    def tensors(self) -> dict[str, np.ndarray]:
        out = {f"param/{n}": a for n, a in self.anchor.items()}
        out.update({f"outer/momentum/{n}": m for n, m in self.momentum.items()})
        return out


@dataclass
class OuterCall:
    """What the actions of one coordinator call (``OuterSync``) run with: the worker's weights, its
    push and inbox, the averages the coordinator decided (round -> ``Average``), and what they leave
    for the next action (the weights read once, the averages reduced, the bytes pushed)."""

    weights: Callable[[list[str]], dict[str, np.ndarray]]
    set_weights: Callable[[dict[str, np.ndarray]], None]
    push: Push
    get: Get
    worker: int
    timeout: float
    averages: dict[int, Average] = field(default_factory=dict)
    now: dict[str, np.ndarray] | None = None
    reduced: dict[int, dict[str, np.ndarray] | None] = field(default_factory=dict)
    sent_bytes: dict[int, int] = field(default_factory=dict)
    applied: bool = False


@dataclass
class _Fragment:
    exchange: Exchange
    start: dict[str, np.ndarray] = field(default_factory=dict)  # weights when this fragment's round began
    sent: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # round -> own decoded deltas (what the others got)
    true: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # round -> own exact deltas (not yet applied)
    encoded: dict[int, dict[str, tuple[str, bytes]]] = field(default_factory=dict)  # round -> what was pushed (a resend pushes it again)
    received: dict[int, dict[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # round -> group -> the deltas a check read
    applied: int | None = None  # the newest round applied (None: none yet)
    pushes: list[asyncio.Task] = field(default_factory=list)


class OuterState:
    """A worker's outer weights, momentum and error feedback, per fragment of the hierarchical plan."""

    def __init__(self, hier: HierPlan, exchanges: list[Exchange], group: int, initial: dict[str, np.ndarray],
                 momentum: dict[str, np.ndarray] | None = None, step: int = -1) -> None:
        self.hier, self.group = hier, group
        self.fragments = [_Fragment(e) for e in exchanges]
        self.anchor = {n: np.array(a, dtype=np.float32) for n, a in initial.items()}
        # a group that joins mid-run starts from the others' outer weights and momentum
        self.momentum: dict[str, np.ndarray] = {n: np.array(m, dtype=np.float32) for n, m in (momentum or {}).items() if n in self.anchor}
        self.feedback = ErrorFeedback()
        self.codec = parse_codec(hier.codec_of(group))  # one codec per sending group: every receiver decodes the same
        for frag in self.fragments:
            frag.start = {n: self.anchor[n].copy() for n in frag.exchange.mine}
        self.bytes_sent = 0
        self.snapshot = Snapshot(len(self.fragments), step, self.anchor, self.momentum)  # ``step``: the run step it starts at
        self.faults: tuple[Fault, ...] = ()  # tests only: a group that poisons what it pushes (runtime/stage/faults.py)
        self._applied: asyncio.Condition | None = None  # notified after each apply (a check waits for the previous round's)

    def _encode(self, name: str, delta: np.ndarray) -> tuple[tuple[str, bytes], np.ndarray]:
        out: list[tuple[str, bytes]] = []

        def roundtrip(total: np.ndarray) -> np.ndarray:
            out.append(encode(total, self.codec))
            return decode(out[0][0], out[0][1], total.shape)

        seen = self.feedback.apply(name, delta, roundtrip)
        return out[0], seen

    async def sync(self, fragment: int, round_: int, *, send: bool, apply: list[Average] | list[tuple],
                   weights: Callable[[list[str]], dict[str, np.ndarray]], set_weights: Callable[[dict[str, np.ndarray]], None],
                   push: Push, get: Get, worker: int, timeout: float) -> dict[int, int]:
        """One fragment's sync (see the module's steps), as the coordinator's ``OuterSync`` asks for it:
        its outer actions (``actions``) run through ``run``. ``apply``: the averages to apply, in
        order (``Average``, or its first three fields as a tuple). Returns the bytes pushed per
        destination worker."""
        averages = [Average(*item) for item in apply]
        call = OuterCall(weights, set_weights, push, get, worker, timeout, {a.round: a for a in averages})
        return await self.run(fragment, self.actions(fragment, round_, send=send, apply=[a.round for a in averages]), call)

    def actions(self, fragment: int, round_: int, *, send: bool, apply: list[int]) -> list[OuterAction]:
        """What one ``OuterSync`` asks of this worker, as its outer program's actions
        (``schedule/outer_program.py``): send and post the receive of ``round_``, then reduce and
        apply each round of ``apply``."""
        ex = self.fragments[fragment].exchange
        out = [OuterAction(self.group, "OSEND", fragment, round_, None, tuple(sorted(ex.sends))),
               OuterAction(self.group, "ORECV", fragment, round_, None, tuple(sorted(ex.receives)))] if send else []
        for r in apply:
            out += [OuterAction(self.group, "OREDUCE", fragment, r), OuterAction(self.group, "OAPPLY", fragment, r)]
        return out

    async def run(self, fragment: int, actions: list[OuterAction], call: OuterCall) -> dict[int, int]:
        """Run outer actions of ``fragment``, each by its entry of ``HANDLERS``; then, if any average
        was applied, the weights become the outer weights minus the own deltas sent but not applied
        yet, plus the progress made since the last send (the steps between a send and its apply are
        kept). Returns the bytes pushed per destination worker."""
        other = next((a for a in actions if a.index != fragment or a.kind == "INNER"), None)
        if other is not None:
            raise FusionError(f"outer action {other}: a call runs {', '.join(HANDLERS)} of fragment {fragment} only "
                              "(inner steps are the coordinator's Step)")
        frag = self.fragments[fragment]
        ex = frag.exchange
        if ex.mine and any(a.kind in ("OSEND", "OAPPLY") for a in actions):
            call.now = await asyncio.to_thread(call.weights, ex.mine)
        for a in actions:
            await HANDLERS[a.kind](self, frag, a, call)
        if call.applied and ex.mine:
            now = call.now or {}
            base = {n: self.anchor[n] - sum((d[n] for _, d in sorted(frag.true.items())), np.zeros_like(self.anchor[n])) for n in ex.mine}
            new = {n: base[n] + (now[n] - frag.start[n]) for n in ex.mine}
            await asyncio.to_thread(call.set_weights, new)
            frag.start = base
        done = [t for t in frag.pushes if t.done()]
        for t in done:
            frag.pushes.remove(t)
            t.result()  # a failed push fails the sync
        return call.sent_bytes

    async def _send(self, frag: _Fragment, a: OuterAction, call: OuterCall) -> None:
        """``OSEND``: the fragment's delta since its last send, encoded with error feedback, pushed."""
        ex = frag.exchange
        if not ex.mine or call.now is None:
            return
        now = call.now
        true = {n: frag.start[n] - now[n] for n in ex.mine}
        encoded = await asyncio.to_thread(lambda: {n: self._encode(n, d) for n, d in true.items()})
        frag.true[a.round] = true
        frag.sent[a.round] = {n: e[1] for n, e in encoded.items()}
        frag.encoded[a.round] = {n: self._pushed(a.round, e) for n, e in encoded.items()}
        self._push_all(frag, a.index, a.round, call.push, call.worker, call.sent_bytes)
        frag.start = {n: x.copy() for n, x in now.items()}

    async def _post(self, frag: _Fragment, a: OuterAction, call: OuterCall) -> None:
        """``ORECV``: nothing to do here; the inbox files what arrives and ``OREDUCE`` reads it."""

    async def _reduce(self, frag: _Fragment, a: OuterAction, call: OuterCall) -> None:
        """``OREDUCE``: the average the coordinator decided for the round (``call.averages``)."""
        avg = call.averages.get(a.round)
        if avg is None:
            raise FusionError(f"outer action {a}: the coordinator named no average of round {a.round}")
        call.reduced[a.round] = await self._average(frag, a.index, avg, call.get, call.timeout)

    async def _step(self, frag: _Fragment, a: OuterAction, call: OuterCall) -> None:
        """``OAPPLY``: the outer optimiser step on the anchor with the reduced average."""
        if a.round not in call.reduced:
            raise FusionError(f"outer action {a}: applied before its OREDUCE")
        step = call.reduced.pop(a.round)
        if step is not None:
            for n in frag.exchange.mine:
                self.anchor[n], self.momentum[n] = nesterov_step(self.anchor[n], self.momentum.get(n), step[n], self.hier.outer_lr,
                                                                  self.hier.outer_momentum)
        frag.applied = a.round
        call.applied = True
        self.snapshot.applied(a.index, call.averages[a.round].step, self.anchor, self.momentum)
        if self._applied is not None:
            async with self._applied:
                self._applied.notify_all()

    def _pushed(self, round_: int, encoded: tuple[tuple[str, bytes], np.ndarray]) -> tuple[str, bytes]:
        """What goes out for one parameter: its encoding (a poisoning group's, tampered: tests only)."""
        if not any(f.outer and f.kind != "outer-split" and f.step == round_ for f in self.faults):
            return encoded[0]
        return encode(tamper_outer(self.faults, round_, encoded[1]), self.codec)

    def _push_all(self, frag: _Fragment, fragment: int, round_: int, push: Push, worker: int, sent_bytes: dict[int, int],
                  attempt: int | None = None) -> None:
        for dst, names in frag.exchange.sends.items():
            for n in names:
                header = {"kind": "outer", "step": round_, "mb": fragment, "edge": n, "src": worker}
                payload = self._split(round_, frag, n, dst)
                array = frag.true[round_][n]  # its shape goes with the payload
                sending = push(dst, header, array, payload) if attempt is None else push(dst, header, array, payload, attempt=attempt)
                frag.pushes.append(asyncio.create_task(sending))
                sent_bytes[dst] = sent_bytes.get(dst, 0) + len(payload[1])

    def _split(self, round_: int, frag: _Fragment, name: str, dst: int) -> tuple[str, bytes]:
        """What goes to ``dst``: the same for every destination, but for a group that equivocates on
        purpose (tests only: ``outer-split@R``, its delta times 1.5 to odd-numbered workers)."""
        if dst % 2 == 0 or not any(f.kind == "outer-split" and f.step == round_ for f in self.faults):
            return frag.encoded[round_][name]
        return encode(1.5 * frag.sent[round_][name], self.codec)

    def resend(self, fragment: int, round_: int, push: Push, worker: int) -> dict[int, int]:
        """Push this fragment's delta of ``round_`` again, as it went out the first time (a checked
        outer step asks once when it refused it). Returns the bytes per destination."""
        frag = self.fragments[fragment]
        if round_ not in frag.encoded:
            raise FusionError(f"resend: fragment {fragment}'s delta of round {round_} was never sent or is applied already")
        sent: dict[int, int] = {}
        self._push_all(frag, fragment, round_, push, worker, sent, attempt=RESEND_ATTEMPT)
        return sent

    async def _received(self, frag: _Fragment, fragment: int, round_: int, g: int, src: int, names: list[str], get: Get,
                        timeout: float) -> dict[str, np.ndarray]:
        """Group ``g``'s deltas of ``names`` from its leader ``src`` (read once: a check keeps them for the apply)."""
        have = frag.received.setdefault(round_, {}).setdefault(g, {})
        for n in names:
            if n not in have:
                got = await get(("outer", round_, fragment, n, src), timeout)
                if got is None or got.shape != self.anchor[n].shape:
                    raise FusionError(f"worker {src} sent a malformed pseudo-gradient for {n} (round {round_})")
                have[n] = got.astype(np.float32, copy=False)
        return {n: have[n] for n in names}

    async def check(self, fragment: int, round_: int, groups: list[int], again: list[int], get: Get,
                    timeout: float) -> tuple[dict[str, dict[str, float]], dict[str, bool], float, dict[str, dict[str, str]]]:
        """``report`` on ``groups``' deltas of ``round_`` over the parameters this worker leads, once
        the previous round is applied here (the momentum every group has then). ``again``: groups
        that sent again, read anew."""
        frag = self.fragments[fragment]
        ex = frag.exchange
        if self._applied is None:
            self._applied = asyncio.Condition()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._applied:
            while frag.applied is not None and frag.applied < round_ - 1:
                if loop.time() >= deadline:
                    raise FusionError(f"outer check of round {round_}: round {round_ - 1} is not applied here after {timeout:.0f} s")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._applied.wait(), deadline - loop.time())
        for g in again:
            frag.received.get(round_, {}).pop(g, None)
        deltas: dict[int, dict[str, np.ndarray]] = {}
        if self.group in groups and ex.leads:
            own = frag.sent.get(round_)
            if own is None:
                raise FusionError(f"outer check of round {round_}: this group's delta of fragment {fragment} was never computed")
            deltas[self.group] = {n: own[n] for n in ex.leads}
        for src, (g, names) in ex.receives.items():
            lead = [n for n in names if n in ex.leads]
            if g in groups and lead:
                deltas.setdefault(g, {}).update(await self._received(frag, fragment, round_, g, src, lead, get, timeout))
        return await asyncio.to_thread(lambda: (*report(deltas, self.momentum, ex.leads), digests(deltas, ex.leads)))

    async def _average(self, frag: _Fragment, fragment: int, avg: Average, get: Get, timeout: float) -> dict[str, np.ndarray] | None:
        """The token-weighted average of the groups' deltas of ``avg.round`` over this worker's
        parameters (None: nothing to apply here); the round's own deltas are dropped."""
        ex = frag.exchange
        round_, groups = avg.round, avg.groups
        own_sent = frag.sent.pop(round_, None)
        frag.true.pop(round_, None)  # applied: no longer subtracted from the outer weights
        frag.encoded.pop(round_, None)
        if not ex.mine or not groups:
            frag.received.pop(round_, None)
            return None
        deltas: dict[int, dict[str, np.ndarray]] = {}
        if self.group in groups:
            if own_sent is None:
                raise FusionError(f"outer round {round_} of fragment {fragment}: this group's delta was never computed")
            deltas[self.group] = {n: own_sent[n] for n in ex.mine}
        for src, (g, names) in ex.receives.items():
            if g in groups:
                deltas.setdefault(g, {}).update(await self._received(frag, fragment, round_, g, src, names, get, timeout))
        frag.received.pop(round_, None)
        missing = sorted(g for g in groups if g not in deltas)
        if missing:
            raise FusionError(f"outer round {round_} of fragment {fragment}: no delta of group(s) {missing} reaches this worker")
        return await asyncio.to_thread(average, deltas, groups, ex.mine, scale=avg.scale, aggregate=avg.aggregate)

    async def drain(self) -> None:
        """Wait for every push still in flight (the end of a run)."""
        for frag in self.fragments:
            pending, frag.pushes = frag.pushes, []
            for t in pending:
                await t

    def cancel(self) -> None:
        for frag in self.fragments:
            for t in frag.pushes:
                t.cancel()
            frag.pushes.clear()

    def regroup(self, hier: HierPlan, exchanges: list[Exchange]) -> None:
        """The groups changed between two rounds (one joined, dead ones dropped): who sends what to
        whom changes; the outer weights, momentum and error feedback stay."""
        if len(exchanges) != len(self.fragments) or any(sorted(e.mine) != sorted(f.exchange.mine)
                                                         for e, f in zip(exchanges, self.fragments, strict=True)):
            raise FusionError("regroup: the new plan changes this worker's fragments (only groups may join or leave)")
        self.hier = hier
        for frag, e in zip(self.fragments, exchanges, strict=True):
            frag.exchange = e

    def outer_tensors(self) -> dict[str, np.ndarray]:
        """The outer weights (``param/<name>``) and momentum (``outer/momentum/<name>``) at the newest
        step every fragment applied (``snapshot.step``): what a group that joins, a checkpoint (every
        average applied: the current ones) and a restarted coordinator start from."""
        return self.snapshot.tensors()

    def anchor_of(self, names: list[str]) -> dict[str, np.ndarray]:
        return {n: self.anchor[n].copy() for n in names}


Handler = Callable[[OuterState, _Fragment, OuterAction, OuterCall], Awaitable[None]]
HANDLERS: dict[str, Handler] = {  # the dispatch table: one entry per outer action kind a worker runs
    "OSEND": OuterState._send, "ORECV": OuterState._post, "OREDUCE": OuterState._reduce, "OAPPLY": OuterState._step,
}


def hier_exchanges(graph: OpGraph, text: str, worker: int) -> tuple[HierPlan, list[Exchange]]:
    """The hierarchical plan an assignment (or a Regroup) carries, and ``worker``'s exchange of each fragment."""
    try:
        hier = HierPlan.from_json(text)
        hier.group_of(worker)
    except (ValueError, KeyError, TypeError, FusionError) as exc:
        raise WireError(f"malformed hierarchical plan ({type(exc).__name__}: {exc})") from None
    return hier, [exchange(graph, hier, worker, f) for f in range(len(hier.fragments))]


def outer_state(graph: OpGraph, text: str, worker: int, weights: Callable[[list[str]], dict[str, np.ndarray]],
                momentum: dict[str, np.ndarray], step: int = -1) -> OuterState:
    """``worker``'s outer state at assignment: the anchor is its stage's weights as assigned."""
    hier, exchanges = hier_exchanges(graph, text, worker)
    mine = sorted({n for e in exchanges for n in e.mine})
    return OuterState(hier, exchanges, hier.group_of(worker).index, weights(mine), momentum, step)
