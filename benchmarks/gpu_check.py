#!/usr/bin/env python
"""Equivalence on a GPU: split = autograd on CUDA, and a local cluster with CUDA workers = one process.

Run on a machine with a CUDA device (the `device` tool), from the repository root:

    python benchmarks/gpu_check.py --out results/gpu

Writes gpu_check.json and gpu_check.md; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FUSION = [sys.executable, "-m", "fusionllm"]


def run(cmd: list[str], timeout: float = 300) -> tuple[int, str, float]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - started


def losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "step" in r]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for model in ("gpt-mini", "tests.zoo:hf_gpt2"):
        rc, out, secs = run([*FUSION, "verify", "--model", model, "--parts", "4", "--seed", "0", "--device", args.device])
        err = out.strip().splitlines()[-1] if rc in (0, 1) else out[-400:]
        results.append({"check": f"verify {model} on {args.device}", "ok": rc == 0, "detail": err, "seconds": round(secs, 1)})
    common = ["--model", "gpt-micro", "--steps", "20", "--seed", "1"]
    a, b = args.out / "cluster.jsonl", args.out / "single.jsonl"
    rc1, out1, s1 = run([*FUSION, "train", "--cluster", "local:3", "--device", args.device, *common, "--metrics", str(a), "--run-dir", str(args.out / "run")])
    rc2, out2, s2 = run([*FUSION, "train", "--single-process", *common, "--eval-every", "0", "--metrics", str(b)])
    if rc1 == 0 and rc2 == 0:
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses(a), losses(b), strict=True))
        results.append({"check": f"local:3 on {args.device} vs single process (CPU), 20 steps", "ok": worst <= 1e-4, "detail": f"max relative loss difference {worst:.3e}", "seconds": round(s1, 1)})
    else:
        results.append({"check": "local:3 on GPU", "ok": False, "detail": (out1 if rc1 else out2)[-600:], "seconds": round(s1 + s2, 1)})
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    table = ["| check | ok | detail | seconds |", "|---|---|---|---|"]
    table += [f"| {r['check']} | {'yes' if r['ok'] else 'NO'} | {r['detail']} | {r['seconds']} |" for r in results]
    (args.out / "gpu_check.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
