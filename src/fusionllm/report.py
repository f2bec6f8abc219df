"""`fusionllm report`: a run's metrics file as a markdown page with PNG plots.

Reads the JSON-lines metrics a run wrote (`--metrics`) as typed records (``core/metrics.py``): step
records and events, of a synchronous run (one group) or a hierarchical one (several groups, their
outer syncs, validations of the outer weights in `eval` events). Writes report.md and loss.png, tokens.png, bytes.png, ratios.png (when AdaTopK ran)
into the output directory. matplotlib is imported only here, when plotting.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import (
    EvalRecord,
    EventRecord,
    OuterRecord,
    PlanRecord,
    Record,
    StepRecord,
    event_line,
    parse_record,
    read_metrics,
)

MAX_METRICS = 1 << 30


def load_metrics(path: Path) -> tuple[list[StepRecord], list[Record]]:
    """(step records, events) of a metrics file, or of the one .jsonl file in a run directory."""
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if len(files) != 1:
            raise ConfigError(f"{path}: found {len(files)} .jsonl files; give the metrics file itself (the run's --metrics)")
        path = files[0]
    if not path.is_file():
        raise ConfigError(f"{path}: no such metrics file (write one with `fusionllm train ... --metrics FILE`)")
    if path.stat().st_size > MAX_METRICS:
        raise ConfigError(f"{path}: larger than {MAX_METRICS >> 20} MiB; is it a metrics file?")
    metrics = read_metrics(path)
    steps: list[StepRecord] = []
    events: list[Record] = [parse_record(raw) for raw in metrics.records if "event" in raw]
    for raw in metrics.steps:
        if "step" in raw and "loss" in raw:
            try:
                steps.append(StepRecord.from_json(raw))
            except TypeError as exc:
                raise ConfigError(f"{path}: step {raw.get('step')} is not a step record ({exc})") from None
    if not steps:
        raise ConfigError(f"{path}: no step records")
    return steps, events


@dataclass
class Validation:
    """One validation: ``step`` is the last step trained before it (a step record's own step)."""

    step: int
    loss: float
    metrics: dict[str, float]


def validations(steps: list[StepRecord], events: list[Record]) -> list[Validation]:
    """Every validation of the run: in step records (synchronous) or ``eval`` events (the outer weights)."""
    out = [Validation(r.step, r.val_loss, r.val_metrics) for r in steps if r.val_loss is not None]
    out += [Validation(e.step - 1, e.val_loss, e.val_metrics) for e in events if isinstance(e, EvalRecord)]
    return sorted(out, key=lambda v: v.step)


def write_report(metrics: Path, out: Path) -> Path:
    steps, events = load_metrics(metrics)
    out.mkdir(parents=True, exist_ok=True)
    last = {(r.step, -1 if r.group is None else r.group): r for r in steps}  # after a recovery a step runs again: its last record counts
    ordered = [last[k] for k in sorted(last)]  # the user's steps; with several groups, one record of each group per step
    vals = validations(ordered, events)
    plan = next((e for e in reversed(events) if isinstance(e, PlanRecord)), None)
    outers = [e for e in events if isinstance(e, OuterRecord)]
    figures = _plots(ordered, vals, out)
    grouped = plan is not None and plan.hierarchical or any(r.group is not None for r in ordered)
    first, final = ordered[0], ordered[-1]
    if grouped:  # the groups' steps interleave: each record's own step time
        times = [r.step_s for r in ordered if r.step_s]
    else:
        times = [b.elapsed_s - a.elapsed_s for a, b in zip(ordered, ordered[1:], strict=False) if b.step == a.step + 1]
    predicted = final.predicted_step_s or (plan and next((g.predicted_step_s for g in plan.groups if g.predicted_step_s), None))
    lines = [f"# Training report: {metrics.name}", "", "| | |", "|---|---|",
             f"| steps | {len({r.step for r in ordered})} (step {first.step} to {final.step}{', each trained by every group' if grouped else ''}) |"]
    if grouped:
        by_group: dict[int, list[StepRecord]] = {}
        for r in ordered:
            by_group.setdefault(r.group if r.group is not None else 0, []).append(r)
        lines.append("| groups | " + "; ".join(f"group {g}: {len(rs)} steps, loss {statistics.fmean(r.loss for r in rs[-10:]):.4f} over its last 10"
                                               for g, rs in sorted(by_group.items())) + " |")
    lines += [f"| loss | {first.loss:.4f} at the first step, {statistics.fmean(r.loss for r in ordered[-10:]):.4f} over the last 10 |",
              f"| validation loss{' (outer weights)' if grouped else ''} | {vals[-1].loss:.4f} at step {vals[-1].step} |" if vals
              else "| validation loss | not measured (`--eval-every`) |",
              *[f"| validation {key} | {vals[-1].metrics[key]:.4f} at step {vals[-1].step} |" for key in sorted(vals[-1].metrics if vals else {})],
              f"| tokens/s | {final.tokens_per_s:,.0f} overall; median step {statistics.median(times):.3f} s |" if times else "| tokens/s | - |",
              f"| predicted step | {predicted:.3f} s |" if predicted else "| predicted step | - (no scheduler) |",
              f"| compression | {final.compress or 'none'} |"]
    noise = [r for r in ordered if r.noise_scale is not None]
    if noise:  # planning/noise_scale.py: where the batch stands against it says whether a larger one (or more groups) pays
        quarter = noise[len(noise) // 4]
        lines.append(f"| gradient noise scale | {noise[-1].noise_scale:,.4g} rows at step {noise[-1].step} ({quarter.noise_scale:,.4g} at step {quarter.step}) |")
    if outers or grouped:
        sent = sum(sum(o.bytes.values()) for o in outers)
        lines.append(f"| outer syncs | {sum(o.sent for o in outers)}, {_size(sent)} sent |")
    lines.append("")
    if plan:
        lines += _plan_lines(plan)
    if outers:
        links: dict[str, int] = {}
        for o in outers:
            for link, n in o.bytes.items():
                links[link] = links.get(link, 0) + n
        lines += ["## Outer syncs", "", f"{sum(o.sent for o in outers)} syncs of {len({(o.fragment, o.round) for o in outers})} "
                  f"(fragment, round) pairs; bytes sent per link:", "", "| link | bytes |", "|---|---|",
                  *[f"| {link} | {_size(n)} |" for link, n in sorted(links.items())], ""]
    others = [e for e in events if not isinstance(e, PlanRecord | OuterRecord | EvalRecord)
              and not (isinstance(e, EventRecord) and e.kind in ("outer_bytes", "outer_check"))]  # a refusal is its own event
    if others:
        lines += ["## Events", ""] + [f"- {event_line(e)}" for e in others] + [""]
    lines += ["## Plots", ""] + [f"![{name}]({name})" for name in figures] + [""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def _plan_lines(plan: PlanRecord) -> list[str]:
    lines = [f"## Plan ({plan.summary()})", ""]
    for g in plan.groups:
        if plan.hierarchical:
            more = [f"{g.inner_steps} inner steps" if g.inner_steps else "", g.schedule or "",
                    f"{g.micro_batches} micro-batches" if g.micro_batches else "",
                    f"predicted {g.predicted_step_s:.3f} s/step" if g.predicted_step_s else ""]
            lines += [f"### Group {g.group}: workers {', '.join(f'w{w}' for w in g.workers)}" + "".join(f", {m}" for m in more if m), ""]
        lines += ["| stage | workers | layers | parameters |", "|---|---|---|---|"]
        for s in g.stages:
            layers = ", ".join(s.layers[:6]) + (" ..." if len(s.layers) > 6 else "") if s.layers else "-"
            lines.append(f"| {s.stage} | {', '.join(f'w{w}' for w in s.workers)} | {layers} | {'-' if s.params is None else f'{s.params:,}'} |")
        lines.append("")
    return lines


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _plots(steps: list[StepRecord], vals: list[Validation], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)

    x = [r.step for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    groups = sorted({r.group for r in steps if r.group is not None})
    if groups:  # a hierarchical run: each group's inner steps
        for g in groups:
            ax.plot([r.step for r in steps if r.group == g], [r.loss for r in steps if r.group == g], label=f"group {g} training loss", lw=1)
    else:
        ax.plot(x, [r.loss for r in steps], label="training loss", lw=1)
    if vals:
        ax.plot([v.step for v in vals], [v.loss for v in vals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    metric = next((k for v in vals for k in v.metrics), None)
    if metric:  # a task's metric (accuracy) next to the loss, on its own axis
        ax2 = ax.twinx()
        ax2.plot([v.step for v in vals if metric in v.metrics], [v.metrics[metric] for v in vals if metric in v.metrics], "s--", color="tab:green",
                 label=metric)
        ax2.set_ylabel(metric)
        ax2.legend(loc="center right")
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r.tokens_per_s for r in steps], label="tokens/s (since the start)")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(x, [r.step_s for r in steps], color="tab:orange", lw=0.8, label="step time (s)")
    if any(r.predicted_step_s for r in steps):
        ax2.plot(x, [r.predicted_step_s or float("nan") for r in steps], color="tab:red", ls="--", lw=0.8, label="predicted step (s)")
    ax2.set_ylabel("seconds")
    fig.legend(loc="lower right", fontsize=8)
    save(fig, "tokens.png")

    links = sorted({k for r in steps for k in r.bytes})
    if links:
        fig, ax = plt.subplots(figsize=(7, 4))
        for link in links:
            ax.plot(x, [r.bytes.get(link, 0) / 1024 for r in steps], label=link, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("KiB sent per step")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "bytes.png")
    ratios = sorted({k for r in steps for k in r.ratios or {}})
    if ratios:
        fig, ax = plt.subplots(figsize=(7, 4))
        for link in ratios:
            ax.plot(x, [(r.ratios or {}).get(link, 1.0) for r in steps], label=link, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("AdaTopK byte target (1 = raw)")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "ratios.png")
    return written
