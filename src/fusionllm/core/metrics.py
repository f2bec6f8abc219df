"""Metrics files: one JSON object per line, flushed as it is written, and the one reader of them.

A run's metrics file (``--metrics``) holds three kinds of record: ``plan`` records (``{"event":
"plan", ...}``, one at the start and one after each re-plan or recovery), step records (no
``"event"`` key: ``step``, ``loss``, ``tokens``, ...) and other events (``recovery``, ``replan``,
``eval``, ``bad_step``, ...). The report, tests and benchmarks read them with ``read_metrics``
rather than each splitting lines on its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError


class JsonlWriter:
    """Append-only JSON-lines file; `None` path writes nothing."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Metrics:
    """A metrics file split by kind; ``records`` keeps every record in file order."""

    records: list[dict[str, Any]] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # every event but the plans

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan in force at the end (a re-plan or recovery writes a new one), or None."""
        return self.plans[-1] if self.plans else None

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Metrics:
        """Records in file order, split by kind as ``read_metrics`` splits a file's lines."""
        out = cls()
        for rec in records:
            out.records.append(rec)
            if "event" not in rec:
                out.steps.append(rec)
            elif rec["event"] == "plan":
                out.plans.append(rec)
            else:
                out.events.append(rec)
        return out

    def losses(self) -> list[float]:
        """Each step record's loss, in file order (a step run again after a recovery appears twice)."""
        return [r["loss"] for r in self.steps]

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind (``"recovery"``, ``"eval"``, ...), in file order."""
        return [r for r in self.events if r["event"] == kind]


def read_metrics(path: str | Path, *, missing_ok: bool = False) -> Metrics:
    """Read a metrics file into plan, step and event records.

    A file still being written may end in a line not yet whole: a last line without its newline
    that is not JSON is left out. Any other line that is not a JSON object is a ``ConfigError``
    naming the file and line. ``missing_ok`` reads a file not written yet as empty."""
    path = Path(path)
    if not path.is_file():
        if missing_ok:
            return Metrics()
        raise ConfigError(f"{path}: no such metrics file (write one with `fusionllm train ... --metrics FILE`)")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # the last line, without its newline yet: a record being written
                break
            raise ConfigError(f"{path}:{i}: not JSON; is this a metrics file?") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{i}: not a JSON object")
        records.append(rec)
    return Metrics.from_records(records)


# ---- typed records: what a metrics file holds, for the writers and every reader ---------------------
# A metrics file is JSON lines: step records (no "event" key) and events ({"event": kind, ...}). The
# classes below are those lines as types. ``from_json`` keeps keys it does not know in ``extra`` (an
# older or newer file still reads, and ``to_json`` writes them back); ``line()`` is an event as one
# readable sentence, the same on the dashboard and in ``fusionllm report``.

_STEP_KEYS = ("step", "steps_total", "group", "round", "inner_step", "loss", "tokens", "elapsed_s", "tokens_per_s", "lr", "grad_norm",
              "step_s", "bytes", "cpu_s", "rss", "carried_bytes", "predicted_step_s", "compress", "ratios", "link_stats", "link_fit", "codecs", "noise_scale",
              "val_loss")


@dataclass
class StepRecord:
    """One training step of one group. ``step`` counts in the user's steps (``--steps``, of which
    there are ``steps_total``) whatever the grouping: with several groups, each group writes a record
    for each of its inner steps, at the user's step it is at (``inner_step`` the same for groups of
    equal H); a synchronous run's steps have no ``group``."""

    step: int
    loss: float
    tokens: int = 0  # trained so far (this run, every group)
    elapsed_s: float = 0.0  # training time so far (evaluations excluded)
    tokens_per_s: float = 0.0  # tokens / elapsed_s
    lr: float = 0.0
    grad_norm: float | None = None
    step_s: float = 0.0  # the slowest worker's step
    bytes: dict[str, int] = field(default_factory=dict)  # "w0->w1": bytes sent this step on the data plane
    cpu_s: dict[str, float] = field(default_factory=dict)  # worker -> CPU seconds this step
    rss: dict[str, list[int]] | None = None  # worker -> [resident bytes before, peak]
    carried_bytes: dict[str, int] | None = None  # "w0->w1": bytes carried by a torch.distributed world
    predicted_step_s: float | None = None
    compress: str | None = None  # the codec, when not "none"
    ratios: dict[str, float] | None = None  # AdaTopK's byte targets per link
    link_stats: dict[str, list[float]] | None = None  # "w0->w1": [bytes, busy s, messages]
    link_fit: dict[str, list[float]] | None = None  # "w0->w1": [fitted bit/s, fixed s]
    codecs: dict[str, dict[str, str]] | None = None  # AdaTopK: "w0->w1": {"act": "hq3"}, the codec each role last sent
    noise_scale: float | None = None  # the gradient noise scale so far, in rows (planning/noise_scale.py)
    val_loss: float | None = None
    val_metrics: dict[str, float] = field(default_factory=dict)  # "accuracy": 0.9 (written as val_accuracy)
    group: int | None = None  # hierarchical runs: the group, its outer round, the inner step in it
    round: int | None = None
    inner_step: int | None = None
    steps_total: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in _STEP_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out.update({f"val_{k}": v for k, v in self.val_metrics.items()})
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StepRecord:
        known = {k: raw[k] for k in _STEP_KEYS if k in raw}
        metrics = {k.removeprefix("val_"): v for k, v in raw.items() if k.startswith("val_") and k != "val_loss"}
        extra = {k: v for k, v in raw.items() if k not in known and not (k.startswith("val_") and k != "val_loss")}
        return cls(**known, val_metrics=metrics, extra=extra)


@dataclass
class EventRecord:
    """Any event: its kind and its fields (``fields["step"]`` and the like), as written."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"event": self.kind, **self.fields}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EventRecord:
        return cls(str(raw["event"]), {k: v for k, v in raw.items() if k != "event"})

    def line(self) -> str:
        """The event as one sentence: ``step 12: a bad step (nan in grad ...); retry``."""
        f = self.fields
        say = _LINES.get(self.kind)
        if say is not None:
            try:
                return say(f)
            except (KeyError, TypeError, ValueError, AttributeError):
                pass  # an older or newer event's fields: the plain form below
        return f"{self.kind.replace('_', ' ')}: " + ", ".join(f"{k} {v}" for k, v in f.items())


@dataclass
class EvalRecord:
    """A validation of the outer weights between rounds (hierarchical runs write these; a synchronous
    run's validation is in its step records' ``val_loss``)."""

    step: int  # the user's steps trained before it
    val_loss: float
    round: int | None = None
    tokens: int | None = None
    elapsed_s: float | None = None
    val_metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EvalRecord:
        metrics = {k.removeprefix("val_"): v for k, v in raw.items() if k.startswith("val_") and k != "val_loss"}
        known = ("event", "step", "val_loss", "round", "tokens", "elapsed_s")
        return cls(int(raw["step"]), float(raw["val_loss"]), raw.get("round"), raw.get("tokens"), raw.get("elapsed_s"), metrics,
                   {k: v for k, v in raw.items() if k not in known and not k.startswith("val_")})

    def to_json(self) -> dict[str, Any]:
        out = {"event": "eval", "step": self.step, "round": self.round, "val_loss": self.val_loss, "tokens": self.tokens,
               "elapsed_s": self.elapsed_s}
        return {k: v for k, v in out.items() if v is not None} | {f"val_{k}": v for k, v in self.val_metrics.items()} | self.extra


@dataclass
class OuterRecord:
    """One group's part of an outer sync: it sent fragment ``fragment``'s delta of round ``round``
    (``sent``) and applied the averages of the rounds in ``applied`` (round -> the groups averaged)."""

    group: int
    fragment: int
    round: int
    sent: bool = True
    applied: dict[str, dict[str, float]] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)  # "w0->w2": bytes of this sync
    seconds: float = 0.0
    elapsed_s: float | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> OuterRecord:
        return cls(int(raw["group"]), int(raw.get("fragment", 0)), int(raw["round"]), bool(raw.get("sent", True)), dict(raw.get("applied") or {}),
                   {str(k): int(v) for k, v in (raw.get("bytes") or {}).items()}, float(raw.get("seconds", 0.0)), raw.get("elapsed_s"))

    def to_json(self) -> dict[str, Any]:
        return {"event": "outer", "group": self.group, "fragment": self.fragment, "round": self.round, "sent": self.sent,
                "applied": self.applied, "bytes": self.bytes, "seconds": self.seconds, "elapsed_s": self.elapsed_s}

    def line(self) -> str:
        sent = f"sent {_size(sum(self.bytes.values()))}" if self.sent else "nothing to send"
        applied = f", applied round(s) {', '.join(sorted(self.applied, key=int))}" if self.applied else ""
        return f"group {self.group}: outer sync of round {self.round} (fragment {self.fragment}), {sent}{applied} in {self.seconds:.2f} s"


@dataclass
class StageRecord:
    stage: int
    workers: list[int]
    layers: list[str] = field(default_factory=list)  # empty: the record did not name them
    params: int | None = None


@dataclass
class GroupRecord:
    """One group's plan: a synchronous run's plan is one group (``inner_steps`` None)."""

    group: int
    workers: list[int]
    stages: list[StageRecord]
    inner_steps: int | None = None
    schedule: str | None = None
    micro_batches: int | None = None
    predicted_step_s: float | None = None


@dataclass
class PlanRecord:
    """The plan of a run (``{"event": "plan"}``), synchronous or hierarchical, as a set of groups."""

    groups: list[GroupRecord]
    sync: str = "synchronous"  # synchronous | hierarchical
    scheduler: str | None = None  # None: balanced by parameters (no --scheduler)
    epoch: int = 0
    rounds: int | None = None  # hierarchical: outer rounds, the outer codec and learning rate
    codec: str | None = None
    outer_lr: float | None = None
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # "0": address, backend, device, site, in_plan, relay
    bandwidth_bps: dict[str, float] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)  # the record as written

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PlanRecord:
        def stages(items: list[Any]) -> list[StageRecord]:
            return [StageRecord(int(s["stage"]), list(s["workers"]), list(s.get("layers") or []), s.get("params")) if isinstance(s, dict)
                    else StageRecord(i, list(s)) for i, s in enumerate(items)]  # older hierarchical records: each stage's workers

        if "groups" in raw:
            groups = [GroupRecord(int(g["group"]), list(g["workers"]), stages(g.get("stages") or []), g.get("inner_steps"), g.get("schedule"),
                                  g.get("micro_batches"), g.get("predicted_step_s")) for g in raw["groups"]]
        else:
            st = stages(raw.get("stages") or [])
            groups = [GroupRecord(0, sorted({w for s in st for w in s.workers}), st, None, raw.get("schedule"), raw.get("micro_batches"),
                                  raw.get("predicted_step_s"))]
        return cls(groups, str(raw.get("sync") or "synchronous"), raw.get("scheduler"), int(raw.get("epoch", 0)), raw.get("rounds"),
                   raw.get("codec"), raw.get("outer_lr"), dict(raw.get("workers") or {}), dict(raw.get("bandwidth_bps") or {}), dict(raw))

    def to_json(self) -> dict[str, Any]:
        return dict(self.raw)

    @property
    def hierarchical(self) -> bool:
        return self.sync == "hierarchical"

    def summary(self) -> str:
        """``balanced by parameters, 1F1B, 2 micro-batches``, or for groups ``2 groups, 4 inner steps, ...``."""
        how = self.scheduler or "balanced by parameters"
        if not self.hierarchical:
            g = self.groups[0] if self.groups else GroupRecord(0, [], [])
            parts = [how, g.schedule, f"{g.micro_batches} micro-batches" if g.micro_batches else None,
                     f"predicted {g.predicted_step_s:.3f} s/step" if g.predicted_step_s else None]
        else:
            inner = sorted({g.inner_steps for g in self.groups if g.inner_steps})
            parts = [f"{len(self.groups)} groups", how, f"{'/'.join(map(str, inner))} inner steps per outer round" if inner else None,
                     f"{self.rounds} rounds" if self.rounds else None, f"outer codec {self.codec}" if self.codec else None,
                     f"outer lr {self.outer_lr}" if self.outer_lr is not None else None]
        return ", ".join(p for p in parts if p)


Record = StepRecord | EventRecord | EvalRecord | OuterRecord | PlanRecord


def parse_record(raw: Mapping[str, Any]) -> Record:
    """One line of a metrics file as its type: a step, or an event (plan, eval and outer typed fully)."""
    kind = raw.get("event")
    if kind is None:
        return StepRecord.from_json(raw)
    typed = {"plan": PlanRecord, "eval": EvalRecord, "outer": OuterRecord}.get(str(kind))
    if typed is not None:
        try:
            return typed.from_json(raw)  # type: ignore[no-any-return, attr-defined]
        except (KeyError, TypeError, ValueError):
            pass  # a malformed typed event still reads, as a plain one
    return EventRecord.from_json(raw)


def event_line(record: Record) -> str:
    """Any event as one readable sentence (``PlanRecord``: its summary)."""
    if isinstance(record, OuterRecord):
        return record.line()
    if isinstance(record, EvalRecord):
        extra = "".join(f", {k} {v:.4f}" for k, v in record.val_metrics.items())
        return f"step {record.step}: validation loss {record.val_loss:.4f}{extra}" + (f" (outer round {record.round})" if record.round is not None else "")
    if isinstance(record, PlanRecord):
        return f"plan (epoch {record.epoch}): {record.summary()}"
    if isinstance(record, EventRecord):
        return record.line()
    return f"step {record.step}: loss {record.loss:.4f}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _workers(ws: Any) -> str:
    ws = list(ws)
    return ("worker " if len(ws) == 1 else "workers ") + ", ".join(map(str, ws))


def _groups(gs: Any) -> str:
    gs = list(gs)
    return ("group " if len(gs) == 1 else "groups ") + ", ".join(map(str, gs))


def _bad_step(f: Mapping[str, Any]) -> str:
    why = "; ".join(sorted({f"{b['kind']} {b['edge']} from worker {b['suspect']}: {b['why']}" for b in f.get("bad", [])})) or "the gradient norm is not finite"
    suspects = f" suspects {', '.join(f'w{w}' for w in f['suspects'])}," if f.get("suspects") else ""
    return f"step {f['step']}: bad step (attempt {f.get('attempt', 0)}),{suspects} {why}; {f.get('action', 'retry')}"


def _outer_check(f: Mapping[str, Any]) -> str:
    said = [f"refused {_groups(sorted(f['refused'], key=int))}" if f.get("refused") else "",
            f"sent again by {_groups(f['sent_again'])}" if f.get("sent_again") else "",
            "scaled " + ", ".join(f"group {g} by {s:.2f}" for g, s in sorted(f['scales'].items())) if f.get("scales") else ""]
    return f"outer round {f['round']} of fragment {f['fragment']} checked: " + ("; ".join(x for x in said if x) or "every pseudo-gradient accepted")


_LINES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "bad_step": _bad_step,
    "evict": lambda f: (f"evicted {_workers(f['workers'])} ({f['why']}): step {f['at_step']} runs again on {f['workers_left']} workers "
                        f"(took {f['seconds']:.1f} s)"),
    "recovery": lambda f: (f"lost {_workers(f['lost'])}" + (f" ({f['why']})" if f.get("why") else "")
                           + f": recovered with {f['workers']} workers from step {f['resumed_from_step']} in {f['seconds']:.1f} s"),
    "replan": lambda f: (f"re-planned at step {f['at_step']} ({f['why']}): {f['stages']} stages on {_workers(f['workers'])}"
                         + (f", predicted {f['predicted_step_s']:.3f} s/step" if f.get("predicted_step_s") else "")
                         + (f" (was {f['old_predicted_step_s']:.3f})" if f.get("old_predicted_step_s") else "") + f", in {f['seconds']:.1f} s"),
    "resume": lambda f: (f"resumed from {'the workers’ live state' if f['from'] == 'live' else 'a checkpoint'} at step {f['resumed_from_step']}"
                         + (f" ({f['why_not_live']})" if f.get("why_not_live") else "")),
    "auto": lambda f: (f"--sync auto chose {f['chose']} ({f['groups']} group{'s' if f['groups'] != 1 else ''}, predicted {f['tokens_per_s']:.0f} tokens/s "
                       f"at {f['efficiency']:.2f} per-token efficiency)"),
    "group_left": lambda f: f"group {f['group']} left the run: {f['why']}",
    "group_joined": lambda f: (f"group {f['group']} joined at outer round {f['round']} with {_workers(f['workers'])}"
                               + (f" (weights from group {f['source_group']})" if f.get("source_group") is not None else "")),
    "outer_check": lambda f: _outer_check(f),
    "outer_refused": lambda f: (f"outer round {f['round']} of fragment {f['fragment']}: group {f['group']}'s pseudo-gradient refused "
                                f"({f['why']}), strike {f['strikes']}: {f['action']}"),
    "left_out": lambda f: f"outer round {f['round']} of fragment {f['fragment']}: {_groups(f['groups'])} left out (too late)",
    "paused": lambda f: f"group {f['group']} paused at outer round {f['round']} for {f['seconds']:.2f} s",
    "join_failed": lambda f: f"{_workers(f['workers'])} could not join: {f['why']}",
    "outer_bytes": lambda f: f"outer syncs sent {_size(sum(f['bytes'].values()))} in all",
    "outer": lambda f: OuterRecord.from_json(f).line(),
    "eval": lambda f: event_line(EvalRecord.from_json(f)),
}
