"""A Gantt chart of a simulated step: device x time, forward / backward / send / reduce / step."""

from __future__ import annotations

from pathlib import Path

from fusionllm.sim.simulator import SimResult

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "send": "#55a868", "REDUCE": "#8172b3", "STEP": "#937860"}


def _kind(label: str) -> str:
    if label.startswith("send"):
        return "send"
    for k in ("REDUCE", "STEP"):
        if label.endswith(k):
            return k
    return "B" if "B" in label.lstrip("0123456789")[:1] else "F"


def plot_gantt(result: SimResult, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({w for w, *_ in result.timeline})
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(workers) + 1.5))
    for w, label, start, end in result.timeline:
        kind = _kind(label)
        lane = workers.index(w) + (0.3 if kind == "send" else 0.0)
        height = 0.25 if kind == "send" else 0.55
        ax.broken_barh([(start, max(end - start, 1e-6))], (lane - height / 2, height), color=COLOURS[kind])
    ax.set_yticks(range(len(workers)), [f"w{w}" for w in workers])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"one step: {result.step_time_s:.3f} s, bubble {result.bubble_fraction:.0%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["forward", "backward", "send (link busy)", "all-reduce", "step"], loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
