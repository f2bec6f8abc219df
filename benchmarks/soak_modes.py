"""What the soak (``soak.py``) does differently in hierarchical mode, and the faults both modes share
that need more than a signal: the group that poisons its pseudo-gradient and the second coordinator.

Hierarchical mode: three groups over the four workers (``0,1/2/3``: a two-stage pipeline and two
single workers), ``--inner-steps`` H, one fragment, blocking syncs, outer Nesterov (0.7, 0.9). A
worker lost or evicted takes its group out of the run; the replacement the soak starts (and the
lost group's other worker) form a new group at the next pause. The fault is over when that group
joined. At the end, the final validation loss is compared with a clean run of the same seed: three
groups in one plain PyTorch process (``runtime/single_groups.py``), which ``tests/test_single_groups.py``
holds equal to a distributed run of these settings.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

GROUPS = "0,1/2/3"
POISON_SLOT = 3  # a group of one worker: it leads every parameter of its group, so it sends every delta
POISONS = ("outer-flip", "outer-scale", "outer-nan")  # in turn, one per poison fault


def hier_args(inner_steps: int, eval_every: int) -> list[str]:
    return ["--sync", "hierarchical", "--groups", GROUPS, "--inner-steps", str(inner_steps), "--fragments", "1", "--blocking-sync",
            "--outer-lr", "0.7", "--outer-momentum", "0.9", "--outer-codec", "q4", "--eval-every", str(eval_every)]


def group_addresses(records: list[tuple[float, dict]]) -> list[str]:
    """The addresses of the workers in the live groups: the last plan, then the groups that left and
    joined after it."""
    at = max((i for i, (_, r) in enumerate(records) if r.get("event") == "plan"), default=None)
    if at is None:
        return []
    plan = records[at][1]
    workers = plan["workers"]
    if plan.get("sync") != "hierarchical":
        return [w["address"] for w in workers.values() if w.get("in_plan", True)]
    groups = {g["group"]: {workers[str(w)]["address"] for w in g["workers"] if str(w) in workers} for g in plan["groups"]}
    for _, r in records[at + 1:]:
        if r.get("event") == "group_left":
            groups.pop(r["group"], None)
        elif r.get("event") == "group_joined":
            groups[r["group"]] = set(r.get("addresses", {}).values())
    return sorted(set().union(*groups.values())) if groups else []


def group_of(records: list[tuple[float, dict]], address: str) -> int | None:
    """The index of the group that ``address`` joined last (the first plan's, or a ``group_joined``)."""
    found = None
    for _, r in records:
        if r.get("event") == "plan" and r.get("sync") == "hierarchical":
            ids = [w for w, x in r["workers"].items() if x["address"] == address]
            found = next((g["group"] for g in r["groups"] if ids and int(ids[0]) in g["workers"]), found)
        elif r.get("event") == "group_joined" and address in r.get("addresses", {}).values():
            found = r["group"]
    return found


def joined_with(records: list[tuple[float, dict]], address: str, since: int) -> float | None:
    """When (the benchmark clock) a group holding ``address`` joined, among the records from ``since``."""
    return next((t for t, r in records[since:] if r.get("event") == "group_joined" and address in r.get("addresses", {}).values()), None)


def step_key(r: dict) -> tuple[int, int]:
    """A step's identity: (group, inner step) in hierarchical mode, the step in synchronous mode."""
    return (r["group"], r["inner_step"]) if "inner_step" in r else (-1, r["step"])


def calibrated_step_s(steps: list[dict]) -> float:
    """Seconds per step of the run's clock: synchronous, the median step; hierarchical, the training
    time per inner step of the slowest group (the groups wait for it at every sync), past the first quarter."""
    if not steps or "inner_step" not in steps[0]:
        times = sorted(r["step_s"] for r in steps[5:])
        return times[len(times) // 2]
    ordered = sorted(steps, key=lambda r: r["elapsed_s"])
    first = ordered[len(ordered) // 4]
    last = ordered[-1]
    span = max(r["inner_step"] for r in ordered) - min(r["inner_step"] for r in ordered if r["elapsed_s"] >= first["elapsed_s"])
    return (last["elapsed_s"] - first["elapsed_s"]) / max(1, span)


def hier_reference(args: object, steps: int, inner_steps: int, eval_every: int) -> tuple[float, dict[int, float]]:
    """The final validation loss of a clean hierarchical run of the same seed, in one process, and its
    mean training loss per outer round."""
    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.reference.single_groups import Outer, train_groups_single

    cfg = TrainConfig(model=args.model, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed, warmup=20,
                      eval_every=eval_every, threads=1)
    records: list[dict] = []
    result = train_groups_single(cfg, Outer(len(GROUPS.split("/")), inner_steps, outer_lr=0.7, outer_momentum=0.9, codec="q4"),
                                 on_step=records.append)
    return result.val_losses[-1][1], round_losses(records)


def round_losses(records: list[dict]) -> dict[int, float]:
    """The mean training loss of every outer round, over its groups' inner steps (each step's last run)."""
    last = {(r["group"], r["inner_step"]): r for r in records if "inner_step" in r}
    by_round: dict[int, list[float]] = {}
    for r in last.values():
        by_round.setdefault(r["round"], []).append(r["loss"])
    return {k: sum(v) / len(v) for k, v in sorted(by_round.items())}


def gap_around(soak: dict[int, float], clean: dict[int, float], at_round: int, span: int = 20) -> float | None:
    """How much the run's training loss gap to the clean run (relative, per round) grew across a
    fault: its mean over the ``span`` rounds after ``at_round`` less its mean over the ``span`` before."""
    def mean_gap(rounds: range) -> float | None:
        gaps = [(soak[k] - clean[k]) / clean[k] for k in rounds if k in soak and k in clean]
        return sum(gaps) / len(gaps) if gaps else None

    before, after = mean_gap(range(at_round - span, at_round)), mean_gap(range(at_round + 1, at_round + 1 + span))
    return None if before is None or after is None else round(after - before, 5)


def second_coordinator(cmd: list[str], log: Path, timeout: float = 120.0) -> tuple[int | None, str]:
    """Start a second coordinator for the same run by mistake; its exit code (None: it was still up
    after ``timeout`` and was killed) and the last line it printed."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        began = time.monotonic()
        while proc.poll() is None and time.monotonic() - began < timeout:
            time.sleep(0.1)
        rc = proc.poll()
        if rc is None:
            proc.kill()
            proc.wait()
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    return rc, (lines[-1] if lines else "")
