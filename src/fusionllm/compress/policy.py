"""AdaTopK's policy: the byte target of each link, chosen by the step time it predicts.

For every directed worker link the policy knows what one training step puts on it (activations or
their gradients per micro-batch, all-reduced gradients, messages), the link's rate, and per worker
the compute of a step and how fast it encodes and decodes. It predicts the step with each byte
target of a ladder (raw, fp16, 8/6/5-bit per-token quantisation, entropy-coded quantisation near
10x, and ``FLOOR``: as few bytes as the error budget allows), codec
CPU time included on the device that pays it (encode on the sender, decode on the receiver). The
sending worker turns a target into a codec (``budget.py``): the most accurate that meets it among
the codecs whose error, measured on the tensor, stays within the budget of its role (activations,
gradients); where none meets it, the cheapest within the budget. The policy decides time, the
budget accuracy.

Two rules pick the target:
- a link that is the step's **bottleneck** uncompressed (its raw bytes keep it busy longer than the
  slowest device computes a step, or it is slower than 500 Mbit/s) gets the lowest target whose predicted step is no longer than
  uncompressed: it stays compressed after compression has made the step compute-bound (on this CPU
  compute is slow; on GPUs it is about 100x faster and such a link is what the step waits for);
- any other link keeps ``none`` unless a target predicts a step at least ``gain`` shorter; among
  the targets within ``prefer`` of the fastest it takes the most accurate.

During training the workers report, per link and step, the bytes sent, the messages and the time
the link was busy. A message's busy time has a part that grows with its bytes, a fixed part (the
ack's way back, which queues behind the reverse direction's traffic) and host delays (a busy event
loop, a worker computing on a shared core) that vary from step to step and only ever add time: the
policy reads both parts from the fastest recent measurements (``fit``) and judges the link by the
part that grows with its bytes. Judging it by bytes / busy time instead, as the first policy did, made a compressed
link look slower the smaller its messages became, which lowered its target further: a spiral that
drove gradients to top-k 1% (docs/compression.md). A link is re-decided only when its fitted rate
moved by more than ``rethink`` since its last decision; it moves to a harder codec only when its
current one predicts a step more than ``prefer`` longer, and back to a lighter one whenever it pays.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FLOOR = 0.065  # the lowest target (hq2's bytes): the worker sends the cheapest codec within its error budget
LADDER = (1.0, 0.5, 0.27, 0.2, 0.17, 0.13, 0.105, 0.097, 0.088, FLOOR)  # none, fp16, q8, q6, q5, then entropy-coded steps
SLOW_BPS = 5e8  # links slower than this are compressed as far as the error budget allows (when not slower)
WINDOW = 32  # steps of measurements the fit of a link's fixed part per message looks at
RECENT = 8  # steps its rate is judged from
SPREAD = 1.25  # bytes per message must vary this much in the window to fit the fixed part


@dataclass
class LinkLoad:
    """What one training step puts on a directed link (raw float32 bytes)."""

    step_bytes: float = 0.0  # activations or gradients of all micro-batches: overlaps compute
    first_bytes: float = 0.0  # one micro-batch's: on the step's critical path (pipeline fill or drain)
    reduce_bytes: float = 0.0  # all-reduced gradients: after the backward pass, on the critical path
    messages: float = 0.0


@dataclass
class LinkPolicy:
    compute_s: dict[int, float]  # per worker: compute seconds of one step (its quota applied)
    loads: dict[tuple[int, int], LinkLoad] = field(default_factory=dict)
    bps: dict[tuple[int, int], float] = field(default_factory=dict)  # per link: the rate its bytes move at (bits/s)
    encode_bps: dict[int, float] = field(default_factory=dict)  # per worker: float32 bytes/s its codec encodes
    decode_bps: dict[int, float] = field(default_factory=dict)
    overhead_s: float = 2e-4  # fixed seconds per message before any is measured
    micro_batches: int = 1
    floor: float = FLOOR
    margin: float = 0.85  # a link should stay this busy at most over a step's compute
    gain: float = 0.03  # compress only for a predicted step this much shorter
    prefer: float = 0.05  # the most accurate codec within this of the fastest (every rung is acceptable; lighter is safer)
    rethink: float = 0.2  # re-decide a link whose fitted rate moved this much
    slow_bps: float = SLOW_BPS  # a link below this rate counts as a bottleneck
    targets: dict[tuple[int, int], float] = field(default_factory=dict)  # byte target per link (1.0: none)
    decided_bps: dict[tuple[int, int], float] = field(default_factory=dict)
    samples: dict[tuple[int, int], deque[tuple[float, float, float]]] = field(default_factory=dict)  # (messages, bytes, busy s)
    fixed_s: dict[tuple[int, int], float] = field(default_factory=dict)  # fitted fixed seconds per message
    planned_bps: dict[tuple[int, int], float] = field(default_factory=dict)  # the rate before any measurement

    # ---- the prediction ----------------------------------------------------------------------------
    def predicted_step(self, link: tuple[int, int], target: float, bps: float | None = None) -> float:
        """The step's seconds as this link and its codec shape them (the other links as they are)."""
        a, b = link
        load = self.loads.get(link, LinkLoad())
        rate = self.bps.get(link, float("inf")) if bps is None else bps
        per_byte = 8 / rate if rate > 0 else 0.0
        t = min(1.0, max(self.floor, target))
        coded = t < 1.0
        exposed_raw = load.first_bytes + load.reduce_bytes
        enc = 1 / self.encode_bps.get(a, 2.5e8) if coded else 0.0  # seconds per raw byte
        dec = 1 / self.decode_bps.get(b, 8e8) if coded else 0.0
        busy = (t * load.step_bytes * per_byte + load.messages * self.overhead_s) / self.margin
        # the pipeline's tensors are coded while the devices compute other micro-batches: their codec
        # time adds to each device's work; the all-reduced gradients are coded after the backward pass,
        # on the critical path only (counting them in both counted them twice: a reduce-only link from a
        # slow device looked slower compressed, and stayed raw)
        bound = max(max(self.compute_s.values(), default=0.0), self.compute_s.get(a, 0.0) + enc * load.step_bytes,
                    self.compute_s.get(b, 0.0) + dec * load.step_bytes, busy)
        return bound + t * exposed_raw * per_byte + (enc + dec) * exposed_raw

    def rate_at(self, link: tuple[int, int], target: float) -> float | None:
        """The link's rate as measured lately with messages at least as large as ``target`` sends.

        A shaper lets small messages through at line rate while its bucket refills between them: a
        link slowed to 2 Mbit/s carried eq:0.7's 6 KB messages in 1-2 ms each, and judged by them it
        looked fast enough for q6 again, which then took 33 ms per message (the codec went back and
        forth every few steps). A lighter codec is therefore judged by the median of the last three
        steps whose messages were as large as it would send, while they are in the window."""
        load = self.loads.get(link)
        window = self.samples.get(link)
        if load is None or not window or load.messages <= 0:
            return None
        size = 0.8 * target * (load.step_bytes + load.reduce_bytes) / load.messages
        fixed = self.fixed_s.get(link, self.overhead_s)
        rates = [w * 8 / max(y - n * fixed, 0.05 * y) for n, w, y in window if w / n >= size][-3:]
        return sorted(rates)[len(rates) // 2] if rates else None

    def judged_step(self, link: tuple[int, int], target: float) -> float:
        """``predicted_step``; a codec lighter than the link's current one at the rate the link showed
        for messages of that size (the current codec and harder ones at the link's fitted rate)."""
        general = self.bps.get(link, float("inf"))
        if target <= self.byte_target(link):
            return self.predicted_step(link, target, general)
        return self.predicted_step(link, target, min(general, self.rate_at(link, target) or general))

    def bottleneck(self, link: tuple[int, int]) -> bool:
        """Whether the link, uncompressed, is busy longer in a step than the slowest device computes, or
        is slower than ``slow_bps`` (with GPUs, whose compute is about 100x faster, such a link is what
        the step waits for, whatever this host's compute says)."""
        load = self.loads.get(link, LinkLoad())
        rate = self.bps.get(link, float("inf"))
        if self.planned_bps.get(link, rate) < self.slow_bps:  # the planned rate: a busy host's measurements wobble
            return True
        busy = (load.step_bytes * 8 / rate if rate > 0 else 0.0) + load.messages * self.overhead_s
        return busy / self.margin > max(self.compute_s.values(), default=0.0)

    def choose(self, link: tuple[int, int]) -> float:
        """The byte target for the link: on a bottleneck the lowest that predicts no longer a step than
        ``none``; elsewhere ``none`` unless a target clearly pays."""
        costs = {t: self.judged_step(link, t) for t in LADDER if t >= self.floor}
        if self.bottleneck(link):
            return min(t for t, c in costs.items() if c <= costs[1.0])
        best = min(costs.values())
        if best > (1 - self.gain) * costs[1.0]:
            return 1.0
        return max(t for t, c in costs.items() if c <= (1 + self.prefer) * best)

    def decide_all(self) -> None:
        for link in self.loads:
            self.targets[link] = self.choose(link)
            self.decided_bps[link] = self.bps.get(link, float("inf"))

    def keep_none(self) -> None:
        """Every link raw (the plan-level check found compression does not pay)."""
        for link in self.loads:
            self.targets[link] = 1.0
            self.decided_bps[link] = self.bps.get(link, float("inf"))

    def byte_target(self, link: tuple[int, int]) -> float:
        """Encoded / raw bytes for the link (1.0: uncompressed)."""
        return self.targets.get(link, 1.0)

    def ratios(self) -> dict[tuple[int, int], float]:
        """Byte target per link (1.0: uncompressed); the worker picks the codec (``adaptive_codec``)."""
        return {link: self.byte_target(link) for link in self.loads}

    # ---- measurements ------------------------------------------------------------------------------
    def observe(self, link: tuple[int, int], wire_bytes: float, busy_s: float, messages: float = 1.0) -> None:
        """One step's measurement of the link: ``messages`` carrying ``wire_bytes`` kept it busy ``busy_s``."""
        if wire_bytes <= 0 or busy_s <= 0 or messages <= 0:
            return
        window = self.samples.setdefault(link, deque(maxlen=WINDOW))
        window.append((float(messages), float(wire_bytes), float(busy_s)))
        rate = self.fit(link)
        if rate is None:
            return
        self.bps[link] = rate
        old = self.decided_bps.get(link, float("inf"))
        if link in self.loads and (old == float("inf") or abs(rate / old - 1) > self.rethink):
            current, best = self.byte_target(link), self.choose(link)
            # compress harder only for a clearly shorter step: measurements wobble, rungs should not
            if best >= current or self.judged_step(link, current) > (1 + self.prefer) * self.judged_step(link, best):
                self.targets[link] = best
            self.decided_bps[link] = rate

    def fit(self, link: tuple[int, int]) -> float | None:
        """The link's rate (bits/s), from busy = messages x fixed + bytes x 8 / rate + delays.

        Host delays (a busy event loop, a worker computing) only ever add time, so both parts are
        read from the fastest measurements: the fixed part from the lower envelope of time per
        message against bytes per message (when the window holds sizes ``SPREAD`` apart; else the
        last one fitted, or ``overhead_s``), the rate as the best of the last ``RECENT`` steps' rates
        with the fixed part taken off, at most the planned (probed or declared) rate. Small messages
        can pass a shaper faster than its rate (its bucket refills between them): that is why a
        codec lighter than the current one is judged by ``rate_at``, the rate messages of its own
        size showed, not by this one."""
        window = self.samples.get(link)
        if not window or len(window) < 3:
            return None
        fixed = self.fixed_s.get(link, self.overhead_s)
        per = [(w / n, y / n) for n, w, y in window]  # (bytes, seconds) per message
        smallest, largest = min(p[0] for p in per), max(p[0] for p in per)
        if largest >= SPREAD * smallest:
            middle = (smallest * largest) ** 0.5
            small = min((p for p in per if p[0] <= middle), key=lambda p: p[1])
            large = min((p for p in per if p[0] > middle), key=lambda p: p[1])
            c = (large[1] - small[1]) / (large[0] - small[0])
            o = small[1] - small[0] * c
            if c > 0 and o >= 0:
                fixed = o
        self.fixed_s[link] = fixed
        best = max(w * 8 / max(y - n * fixed, 0.05 * y) for n, w, y in list(window)[-RECENT:])
        return min(best, self.planned_bps.setdefault(link, self.bps.get(link, float("inf"))))
