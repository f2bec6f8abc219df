"""AdaTopK's policy: how hard each link is compressed.

From the plan: a link whose transfer of one micro-batch's tensors takes longer than the bottleneck
stage's compute would become the bottleneck; its byte ratio is set so that the transfer fits in that
time (with a margin), within ``[r_min, 1]``; every other link stays uncompressed. During training the
ratio re-adapts from the link's measured throughput (an exponential moving average), so a link that
slows down is compressed harder, and one that recovers is relieved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusionllm.compress.codecs import topk_ratio_for

MIN_SAMPLE = 64 << 10  # bytes a link carries before its throughput is judged


@dataclass
class LinkPolicy:
    budget_s: float  # the bottleneck stage's compute per micro-batch
    r_min: float = 0.01
    margin: float = 0.8  # aim for this fraction of the budget
    smoothing: float = 0.5  # weight of a new throughput measurement
    bps: dict[tuple[int, int], float] = field(default_factory=dict)  # link -> estimated bits/s
    bytes_per_mb: dict[tuple[int, int], float] = field(default_factory=dict)  # raw bytes per micro-batch
    pending: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (bytes, busy s) not yet averaged

    def byte_target(self, link: tuple[int, int]) -> float:
        """Encoded / raw bytes for the link (1.0: uncompressed)."""
        nbytes = self.bytes_per_mb.get(link, 0.0)
        bps = self.bps.get(link, float("inf"))
        if nbytes <= 0 or bps == float("inf"):
            return 1.0
        seconds = nbytes * 8 / bps
        if seconds <= self.budget_s:
            return 1.0
        return max(self.r_min, min(1.0, self.margin * self.budget_s / seconds))

    def topk_ratio(self, link: tuple[int, int]) -> float:
        return max(self.r_min, topk_ratio_for(self.byte_target(link))) if self.byte_target(link) < 1.0 else 1.0

    def observe(self, link: tuple[int, int], wire_bytes: float, busy_s: float) -> None:
        """A measurement of the link: bytes that crossed it while it was busy for busy_s seconds.

        Measurements add up until the link has carried MIN_SAMPLE bytes (a compressed link may carry
        only a few kB per step), then update the moving average."""
        if wire_bytes <= 0 or busy_s <= 0:
            return
        got, took = self.pending.get(link, (0.0, 0.0))
        got, took = got + wire_bytes, took + busy_s
        if got < MIN_SAMPLE:
            self.pending[link] = (got, took)
            return
        self.pending.pop(link, None)
        measured = got * 8 / took
        old = self.bps.get(link)
        self.bps[link] = measured if old in (None, float("inf")) else (1 - self.smoothing) * old + self.smoothing * measured

    def ratios(self) -> dict[tuple[int, int], float]:
        """Byte target per link (1.0: uncompressed); the worker picks the codec (``adaptive_codec``)."""
        return {link: self.byte_target(link) for link in self.bytes_per_mb}
