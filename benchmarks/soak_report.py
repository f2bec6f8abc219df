"""The soak's results (``soak.py``): steps run again per fault, the comparison with a reference at
the end (synchronous: one process that skipped the same steps, every loss and weight; hierarchical:
a clean run of the same seed, the final validation loss) and the markdown table."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from soak_modes import gap_around, hier_reference, round_losses, step_key


def reference(args: argparse.Namespace, steps: int, skip: set[int]) -> tuple[list[float], dict]:
    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.reference.single import train_single

    cfg = TrainConfig(model=args.model, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed, warmup=20,
                      eval_every=0, threads=1)
    result = train_single(cfg, skip=frozenset(skip))
    return result.losses, {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def final_state(ckpt: Path) -> tuple[int, dict]:
    from safetensors.torch import load_file

    from fusionllm.core.checkpoints import latest_checkpoint

    last = latest_checkpoint(ckpt)
    if last is None:
        raise SystemExit(f"no checkpoint in {ckpt}")
    state: dict = {}
    for shard in sorted(last.glob("stage-*.safetensors")):
        for key, value in load_file(shard).items():
            if key.startswith("param/"):
                state.setdefault(key.removeprefix("param/"), value)
    return int(json.loads((last / "state.json").read_text())["step"]), state


def redone_per_fault(faults: list[Any], steps: list[tuple[float, dict]]) -> None:
    """Steps run again in each fault's window: records of a step already recorded before it."""
    for f in faults:
        if f.first_new_step_at is None:
            continue
        seen = {step_key(r) for t, r in steps if t < f.began}
        f.redone = len([r for t, r in steps if f.began <= t <= f.first_new_step_at and step_key(r) in seen])


def sync_summary(args: argparse.Namespace, soak: Any, steps: int, rc: int | None, ckpt: Path) -> dict:
    """Every step's loss and every final weight against one process that skipped the same steps."""
    last: dict[int, dict] = {}
    runs: dict[int, int] = {}
    for _, r in soak.metrics.steps():
        last[r["step"]] = r
        runs[r["step"]] = runs.get(r["step"], 0) + 1
    skipped = {e["step"] for e in soak.metrics.events("bad_step") if e.get("action") == "skip"}
    done_step, state = final_state(ckpt) if rc == 0 else (-1, {})
    ref_losses, ref_state = reference(args, steps, skipped)
    ref_steps = [s for s in range(steps) if s not in skipped]
    errors = [(s, abs(last[s]["loss"] - ref) / abs(ref), last[s]["loss"], ref) for s, ref in zip(ref_steps, ref_losses, strict=True) if s in last]
    loss_err = max((e for _, e, _, _ in errors), default=float("nan"))
    # when the two drifted apart (summation orders differ after a re-plan; experiments/drift.py), and whether the
    # losses stayed alike in the mean: per 1,000 steps, the largest relative difference and both mean losses
    drift = [{"from_step": errors[i][0], "max_rel_loss_err": max(e for _, e, _, _ in errors[i : i + 1000]),
              "mean_loss": statistics.fmean(a for _, _, a, _ in errors[i : i + 1000]),
              "mean_loss_reference": statistics.fmean(b for _, _, _, b in errors[i : i + 1000])} for i in range(0, len(errors), 1000)]
    first_over = {f"1e{k}": next((s for s, e, _, _ in errors if e > 10.0**k), None) for k in (-5, -3, -2)}
    per_tensor = {k: (float((state[k].double() - v.double()).norm() / max(float(v.double().norm()), 1e-12)),
                      float((state[k].double() - v.double()).abs().max())) for k, v in ref_state.items() if k in state and v.is_floating_point()}
    weight_err = max((e for e, _ in per_tensor.values()), default=float("nan"))
    worst = sorted(per_tensor.items(), key=lambda kv: -kv[1][0])[:3]
    missing = [s for s in ref_steps if s not in last]
    return {"steps_completed": len(last), "steps_missing": missing[:20], "steps_skipped": sorted(skipped),
            "steps_redone": sum(n - 1 for n in runs.values()), "final_checkpoint_step": done_step,
            "max_rel_loss_err": loss_err, "first_step_over": first_over, "drift": drift, "max_rel_weight_err": weight_err, "worst_tensors": {k: {"rel_norm_err": e, "max_abs_diff": d} for k, (e, d) in worst},
            "weights_compared": len(per_tensor), "weights_missing": sorted(k for k in ref_state if k not in state), "weights_expected": len(ref_state),
            "passed": rc == 0 and not missing}


def hier_summary(args: argparse.Namespace, soak: Any, steps: int, rc: int | None, ckpt: Path, faults: list[Any] = ()) -> dict:
    """The final validation loss against a clean run of the same seed, and how much each fault moved
    the training loss's gap to it (``gap_around``; the fault's ``loss_gap``)."""
    runs: dict[tuple[int, int], int] = {}
    for _, r in soak.metrics.steps():
        runs[step_key(r)] = runs.get(step_key(r), 0) + 1
    evals = soak.metrics.events("eval")
    final = evals[-1]["val_loss"] if evals else float("nan")
    clean, clean_rounds = hier_reference(args, steps, args.inner_steps, steps)
    rel = (final - clean) / clean
    mine = round_losses([r for _, r in soak.metrics.steps()])
    for f in faults:
        at = [r["round"] for t, r in soak.metrics.steps() if t <= f.began and "round" in r][-1:]
        f.loss_gap = gap_around(mine, clean_rounds, at[0]) if at else None
    ends = [k for k in sorted(mine) if k in clean_rounds][-20:]
    slowest = {g: max(i for (gg, i) in runs if gg == g) for g, _ in runs}
    return {"steps_completed": len(runs), "steps_redone": sum(n - 1 for n in runs.values()), "groups_seen": len(slowest),
            "steps_skipped": sorted({e["step"] for e in soak.metrics.events("bad_step") if e.get("action") == "skip"}),
            "final_val_loss": final, "clean_val_loss": clean, "val_rel_diff": rel, "last_inner_step": max(slowest.values(), default=-1),
            "train_loss_gap_last_20_rounds": round(sum((mine[k] - clean_rounds[k]) / clean_rounds[k] for k in ends) / len(ends), 5) if ends else None,
            "passed": rc == 0 and abs(rel) <= 0.01}


def report(args: argparse.Namespace, spec: object, summary: dict, rows: list[dict], every: float, minutes: float) -> list[str]:
    s = summary
    table = [f"Cluster `{s['cluster']}` (random, seed {args.seed}; {len(spec.devices())} CPU workers), {args.mode} mode, {args.model}, "
             f"batch {args.batch_size} x {args.seq_len}, --dead-after {args.dead_after:g}; a fault every {every:.0f} s over {minutes:.0f} min.", ""]
    if args.mode == "hierarchical":
        table += [f"- three groups (0,1/2/3), {args.inner_steps} inner steps per round, q4 pseudo-gradients, blocking sync, a checkpoint every "
                  f"{4 * args.inner_steps} steps; {s['steps']} steps of the slowest group (coordinator exit {s['coordinator_exit']})",
                  f"- inner steps recorded: {s['steps_completed']}, run again: {s['steps_redone']}, groups seen: {s['groups_seen']}; "
                  f"skipped (bad tensors): {s['steps_skipped']}",
                  f"- final validation loss {s['final_val_loss']:.4f} against a clean run of the same seed {s['clean_val_loss']:.4f}: "
                  f"{100 * s['val_rel_diff']:+.2f}%; training loss over the last 20 rounds {100 * (s['train_loss_gap_last_20_rounds'] or 0):+.2f}% "
                  "(per fault, 'loss gap moved': the training loss's gap to the clean run over the 20 rounds after the fault less over the 20 before)"]
    else:
        worst = s["worst_tensors"]
        table += [f"- a checkpoint every step; steps: {s['steps_completed']} of {s['steps']} completed (coordinator exit {s['coordinator_exit']}); "
                  f"skipped (bad tensors): {s['steps_skipped']}; run again: {s['steps_redone']}",
                  f"- against one process that skipped the same steps: losses within {s['max_rel_loss_err']:.2g} (relative), final weights within "
                  f"{s['max_rel_weight_err']:.2g} (|a - b| / |b| per tensor; {s['weights_compared']} float tensors; largest: "
                  + ", ".join(f"{k} {v['rel_norm_err']:.2g}" for k, v in worst.items()) + ")"]
        if s.get("first_step_over"):
            table += ["- the losses drifted apart (first step over a relative difference of "
                      + ", ".join(f"{k}: {v}" for k, v in s["first_step_over"].items()) + "); per 1,000 steps, the largest difference "
                      "and the mean loss against the reference's: "
                      + "; ".join(f"{d['from_step']}: {d['max_rel_loss_err']:.1g}, {d['mean_loss']:.4f}/{d['mean_loss_reference']:.4f}" for d in s["drift"])]
    table += [f"- fault-free step: {s['fault_free_step_s']:.3f} s; wall {s['wall_s']:.0f} s", "",
              "| fault | at (s) | target | training lost (s) | steps redone | loss gap moved | events | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ev = ", ".join(e["event"] + (f"/{e.get('action')}" if e["event"] == "bad_step" else "") for e in r["events"] if e["event"] != "outer_check") or "-"
        gap = "-" if r.get("loss_gap") is None else f"{100 * r['loss_gap']:+.2f}%"
        table.append(f"| {r['kind']} | {r['at_s']:.0f} | {r['target']} | {r['training_lost_s']} | {r['steps_redone']} | {gap} | {ev} | "
                     f"{r['note'] or ('' if r['ok'] else 'FAILED')}{'' if r['ok'] or not r['note'] else ' (FAILED)'} |")
    by_kind: dict[str, list[dict]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    table += ["", "| fault kind | times | survived | training lost, max (s) | mean (s) | steps redone, max |", "|---|---|---|---|---|---|"]
    for k, rs in sorted(by_kind.items()):
        lost = [r["training_lost_s"] for r in rs if r["training_lost_s"] is not None]
        table.append(f"| {k} | {len(rs)} | {sum(r['ok'] for r in rs)} | {max(lost):.2f} | {statistics.mean(lost):.2f} | "
                     f"{max(r['steps_redone'] for r in rs)} |" if lost else f"| {k} | {len(rs)} | {sum(r['ok'] for r in rs)} | - | - | - |")
    return table
