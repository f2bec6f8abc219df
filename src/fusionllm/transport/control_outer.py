"""Control messages of hierarchical mode: the outer sync of one fragment, its check, and regrouping.

Part of the typed control messages (``transport/control.py``, which exports these names too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusionllm.transport.control_base import Message


@dataclass
class OuterApply(Message):
    round: int
    groups: dict[str, float]  # the groups whose deltas of this round are averaged -> their weight (tokens)
    step: int = -1  # the run's step once this round is applied (a restarted coordinator resumes there); -1: unknown
    scale: dict[str, float] = field(default_factory=dict)  # a group's delta times this before it is averaged (clipped; default 1)
    aggregate: str = "mean"  # mean | clipped | trimmed (runtime/stage/outer_check.py)


@dataclass
class OuterSync(Message):
    """Send this fragment's pseudo-gradient of ``round`` (``send``) and apply the listed rounds' averages."""

    fragment: int
    round: int
    send: bool = True
    apply: list[OuterApply] = field(default_factory=list)


@dataclass
class OuterSynced(Message):
    bytes_to: dict[str, int] = field(default_factory=dict)  # pseudo-gradient bytes pushed per destination worker
    seconds: float = 0.0


@dataclass
class OuterCheck(Message):
    """Before ``round`` of ``fragment`` is averaged: report on the deltas of ``groups`` (``again``:
    groups that sent again, read anew)."""

    fragment: int
    round: int
    groups: list[int]
    again: list[int] = field(default_factory=list)


@dataclass
class OuterChecked(Message):
    """Over the parameters this worker leads: per sending group, its dot products with each group's
    delta (key: the group) and with the outer momentum (key ``m``), and whether it is finite."""

    dots: dict[str, dict[str, float]] = field(default_factory=dict)
    finite: dict[str, bool] = field(default_factory=dict)
    momentum_sq: float = 0.0
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # per sending group, per parameter: its decoded delta's digest


@dataclass
class OuterResend(Message):
    """Push this fragment's delta of ``round`` again, as it went out (a checked outer step refused it)."""

    fragment: int
    round: int


@dataclass
class Regroup(Message):
    """Hierarchical mode: the groups changed (one joined, dead ones dropped): the new HierPlan, and
    the addresses of workers this one has not heard of (the joining group's)."""

    hier: str
    addresses: dict[str, str] = field(default_factory=dict)
    data_addresses: dict[str, str] = field(default_factory=dict)
