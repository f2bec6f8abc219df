#!/usr/bin/env python
"""Real LLMs end to end on a local cluster: train with evaluation and checkpoints, then resume.

For each model (gpt2 by default, and gpt2-medium), ``fusionllm train --cluster local:3`` runs
``--steps A`` with evaluation and a checkpoint every ``--every`` steps, then a second run resumes from
the newest checkpoint and continues to ``--steps B``. Recorded per run: exit status, wall seconds,
losses, validation losses, the checkpoint's size and the largest message the run could make (the
plan's ``check_message_sizes``). Before issue 15 the first run of gpt2 died at its end with
``RESOURCE_EXHAUSTED ... Sent message larger than max (352034408 vs. 268435456)`` (evaluation pulled
a stage's weights in one gRPC message). Writes big_models.json and big_models.md.

    python experiments/big_models.py [--models gpt2 gpt2-medium] [--steps 4 6] [--every 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import read_metrics, results_dir, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float) -> tuple[int, float, str]:
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fusionllm", *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, time.perf_counter() - began, (proc.stderr or "")[-2000:]


def _records(path: Path) -> list[dict]:
    return read_metrics(path, missing_ok=True).steps


def one(model: str, steps: tuple[int, int], every: int, args: argparse.Namespace, tmp: Path) -> dict:
    ck = tmp / model / "ck"
    common = ["train", "--cluster", f"local:{args.workers}", "--model", model, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--eval-every", str(every), "--eval-batches", "1", "--checkpoint-every", str(every), "--checkpoint-dir", str(ck)]
    out: dict = {"model": model, "workers": args.workers, "batch_size": args.batch_size, "seq_len": args.seq_len}
    for phase, n, extra in (("first", steps[0], []), ("resumed", steps[1], ["--resume"])):
        metrics = tmp / model / f"{phase}.jsonl"
        rc, wall, err = _run([*common, "--steps", str(n), "--metrics", str(metrics), "--run-dir", str(tmp / model / phase), *extra], args.timeout)
        recs = _records(metrics)
        out[phase] = {"rc": rc, "wall_s": round(wall, 1), "steps": [r["step"] for r in recs], "losses": [round(r["loss"], 5) for r in recs],
                      "val_losses": [round(r["val_loss"], 5) for r in recs if "val_loss" in r], "error": err.strip().splitlines()[-1] if rc else ""}
        print(f"{model} {phase}: rc={rc} {wall:.0f} s steps={out[phase]['steps']} val={out[phase]['val_losses']}", flush=True)
    newest = sorted(ck.glob("step-*"))
    if newest:
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in newest[-1].iterdir())
        out["checkpoint"] = newest[-1].name
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"])
    ap.add_argument("--steps", nargs=2, type=int, default=[4, 6], metavar=("FIRST", "RESUMED"))
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=results_dir("big_models"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fusionllm-big-") as tmp:
        rows = [one(m, (args.steps[0], args.steps[1]), args.every, args, Path(tmp)) for m in args.models]
    lines = ["| model | workers | first run | resumed run | checkpoint | val losses |", "|---|---|---|---|---|---|"]
    for r in rows:
        f, s = r["first"], r["resumed"]
        status = lambda p: f"rc {p['rc']}, {p['wall_s']:.0f} s, steps {p['steps'][0] if p['steps'] else '-'}-{p['steps'][-1] if p['steps'] else '-'}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['workers']} | {status(f)} | {status(s)} | {r.get('checkpoint', '-')}, "
                     f"{r.get('checkpoint_bytes', 0) / 1e6:.0f} MB | {f['val_losses']} then {s['val_losses']} |")
    meta = {"argv": sys.argv[1:], "batch_size": args.batch_size, "seq_len": args.seq_len}
    write(args.out, "big_models", rows, lines, meta)


if __name__ == "__main__":
    main()
