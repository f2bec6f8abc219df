"""`fusionllm report`: a run's metrics file as a markdown page with PNG plots.

Reads the JSON-lines metrics a run wrote (`--metrics`): step records, and `plan`, `recovery` and
`replan` events. Writes report.md and loss.png, tokens.png, bytes.png, ratios.png (when AdaTopK ran)
into the output directory. matplotlib is imported only here, when plotting.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import read_metrics

MAX_METRICS = 1 << 30


def load_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    steps, events = metrics.steps, [r for r in metrics.records if "event" in r]
    if not steps:
        raise ConfigError(f"{path}: no step records")
    return steps, events


def write_report(metrics: Path, out: Path) -> Path:
    steps, events = load_metrics(metrics)
    out.mkdir(parents=True, exist_ok=True)
    last = {r["step"]: r for r in steps}  # after a recovery a step runs again: its last record counts
    ordered = [last[s] for s in sorted(last)]
    figures = _plots(ordered, out)
    plan = next((e for e in reversed(events) if e.get("event") == "plan"), None)
    lines = [f"# Training report: {metrics.name}", ""]
    first, final = ordered[0], ordered[-1]
    vals = [r for r in ordered if "val_loss" in r]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(ordered, ordered[1:], strict=False) if b["step"] == a["step"] + 1]
    lines += ["| | |", "|---|---|",
              f"| steps | {len(ordered)} (step {first['step']} to {final['step']}) |",
              f"| loss | {first['loss']:.4f} at the first step, {statistics.fmean(r['loss'] for r in ordered[-10:]):.4f} over the last 10 |",
              f"| validation loss | {vals[-1]['val_loss']:.4f} at step {vals[-1]['step']} |" if vals else "| validation loss | not measured (`--eval-every`) |",
              *[f"| validation {key.removeprefix('val_')} | {vals[-1][key]:.4f} at step {vals[-1]['step']} |"
                for key in sorted(k for k in (vals[-1] if vals else {}) if k.startswith("val_") and k != "val_loss")],
              f"| tokens/s | {final.get('tokens_per_s', 0):,.0f} overall; median step {statistics.median(times):.3f} s |" if times else "| tokens/s | - |",
              f"| predicted step | {final['predicted_step_s']:.3f} s |" if final.get("predicted_step_s") else "| predicted step | - (no scheduler) |",
              f"| compression | {final.get('compress', 'none')} |", ""]
    if plan:
        lines += [f"## Plan ({plan.get('scheduler') or 'balanced by parameters'}, {plan.get('schedule')}, {plan.get('micro_batches')} micro-batches)", "",
                  "| stage | workers | layers | parameters |", "|---|---|---|---|"]
        for s in plan.get("stages", []):
            layers = ", ".join(s.get("layers", [])[:6]) + (" ..." if len(s.get("layers", [])) > 6 else "")
            lines.append(f"| {s['stage']} | {', '.join(f'w{w}' for w in s['workers'])} | {layers} | {s['params']:,} |")
        lines.append("")
    others = [e for e in events if e.get("event") in ("recovery", "replan")]
    if others:
        lines += ["## Events", ""] + [f"- {e['event']}: " + ", ".join(f"{k} {v}" for k, v in e.items() if k != "event") for e in others] + [""]
    lines += ["## Plots", ""] + [f"![{name}]({name})" for name in figures] + [""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def _plots(steps: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)

    x = [r["step"] for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["loss"] for r in steps], label="training loss", lw=1)
    vals = [r for r in steps if "val_loss" in r]
    if vals:
        ax.plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    metric = next((k for r in vals for k in r if k.startswith("val_") and k != "val_loss"), None)
    if metric:  # a task's metric (accuracy) next to the loss, on its own axis
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in vals if metric in r], [r[metric] for r in vals if metric in r], "s--", color="tab:green",
                 label=metric.removeprefix("val_"))
        ax2.set_ylabel(metric.removeprefix("val_"))
        ax2.legend(loc="center right")
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r.get("tokens_per_s", 0) for r in steps], label="tokens/s (since the start)")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(x, [r.get("step_s", 0) for r in steps], color="tab:orange", lw=0.8, label="step time (s)")
    if any(r.get("predicted_step_s") for r in steps):
        ax2.plot(x, [r.get("predicted_step_s") or float("nan") for r in steps], color="tab:red", ls="--", lw=0.8, label="predicted step (s)")
    ax2.set_ylabel("seconds")
    fig.legend(loc="lower right", fontsize=8)
    save(fig, "tokens.png")

    links = sorted({k for r in steps for k in r.get("bytes", {})})
    if links:
        fig, ax = plt.subplots(figsize=(7, 4))
        for link in links:
            ax.plot(x, [r.get("bytes", {}).get(link, 0) / 1024 for r in steps], label=link, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("KiB sent per step")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "bytes.png")
    ratios = sorted({k for r in steps for k in r.get("ratios", {})})
    if ratios:
        fig, ax = plt.subplots(figsize=(7, 4))
        for link in ratios:
            ax.plot(x, [r.get("ratios", {}).get(link, 1.0) for r in steps], label=link, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("AdaTopK byte target (1 = raw)")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "ratios.png")
    return written
