#!/usr/bin/env python
"""Two PyTorch versions in one pipeline: the middle worker runs the oldest torch that pyproject.toml allows.

Creates, once, a virtual environment outside the repository (``~/.cache/fusionllm/torch-VERSION``,
about 5 GB: the registry's torch wheel of that version is a CUDA build, which runs on the CPU) with
that torch and fusionllm installed from this working tree (editable, so it runs this code), then trains
twice on ``local:3``:

1. every worker on this environment's torch;
2. the same, with worker 1 started from the other environment (``fusionllm train --worker-python
   1=.../bin/python``): a three-stage pipeline whose middle stage runs the old torch, activations and
   gradients crossing versions on the data plane (workers of two versions share no torch.distributed
   group).

Both runs use the same model, data, seed and plan; the losses of every step are compared (goal: within
1e-5 relative). The torch versions reported are those the workers themselves sent when they joined
(the plan record's ``software``). Writes two_torch.json and two_torch.md.

    python experiments/two_torch.py                 # torch 2.4.1 in the middle, gpt-micro, 30 steps
    python experiments/two_torch.py --old 2.5.1 --steps 60
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import read_metrics, results_dir, write  # noqa: E402

GOAL = 1e-5
CACHE = Path.home() / ".cache" / "fusionllm"


def old_python(version: str) -> Path:
    """The other environment's interpreter, made on first use (minutes: a multi-GB download)."""
    venv = CACHE / f"torch-{version}"
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", f"import torch, fusionllm; assert torch.__version__.startswith('{version}')"],
                                        capture_output=True).returncode == 0
    if not ok:
        print(f"making {venv} (torch=={version} and fusionllm from {ROOT}; several GB, a few minutes) ...", flush=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={version}"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", str(ROOT)], check=True)
        print(f"made in {time.perf_counter() - started:.0f} s", flush=True)
    return py


def train(args: argparse.Namespace, tmp: Path, name: str, extra: list[str]) -> list[dict]:
    metrics = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:3", "--model", args.model, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", "2", "--seed", "0",
           "--eval-every", "0", "--metrics", str(metrics), "--run-dir", str(tmp / f"run-{name}"), *extra]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: training failed:\n{proc.stderr[-3000:]}")
    print("\n".join(line for line in proc.stderr.splitlines() if "worker" in line and "stage" in line), flush=True)
    return read_metrics(metrics).records


def versions(records: list[dict]) -> dict[str, str]:
    plan = next(r for r in records if r.get("event") == "plan")
    return {w: info.get("software", {}).get("torch", "?") for w, info in sorted(plan["workers"].items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="2.4.1", help="the torch of the middle worker (pyproject.toml allows >= 2.4)")
    p.add_argument("--model", default="gpt-micro")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=results_dir("two_torch"))
    args = p.parse_args()
    py = old_python(args.old)
    with tempfile.TemporaryDirectory(prefix="fusionllm-two-torch-") as tmp:
        same = train(args, Path(tmp), "same", [])
        mixed = train(args, Path(tmp), "mixed", ["--worker-python", f"1={py}"])
    a = [r["loss"] for r in same if "step" in r]
    b = [r["loss"] for r in mixed if "step" in r]
    if len(a) != len(b) or not a:
        raise SystemExit(f"step counts differ: {len(a)} and {len(b)}")
    errors = [abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)]
    vs, vm = versions(same), versions(mixed)
    row = {"model": args.model, "steps": len(a), "versions_same": vs, "versions_mixed": vm, "max_rel_loss_err": max(errors),
           "first_step_err": errors[0], "losses_same": a, "losses_mixed": b}
    table = [
        "| run | worker 0 | worker 1 | worker 2 | first loss | last loss |",
        "|---|---|---|---|---|---|",
        f"| one torch | {vs.get('0')} | {vs.get('1')} | {vs.get('2')} | {a[0]:.6f} | {a[-1]:.6f} |",
        f"| two torches | {vm.get('0')} | {vm.get('1')} | {vm.get('2')} | {b[0]:.6f} | {b[-1]:.6f} |",
        "",
        f"{args.model}, {len(a)} steps, local:3 (one stage per worker), batch {args.batch_size} x {args.seq_len}, 2 micro-batches, seed 0: "
        f"largest relative loss difference {max(errors):.2e} (goal {GOAL:g}: {'met' if max(errors) <= GOAL else 'missed'}), "
        f"first step {errors[0]:.2e}. Versions as each worker reported them when it joined.",
        "",
        f"Command: `python experiments/two_torch.py --old {args.old} --model {args.model} --steps {args.steps}`",
    ]
    write(args.out, "two_torch", row, table)
    return 0 if max(errors) <= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
