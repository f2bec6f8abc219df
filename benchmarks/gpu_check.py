#!/usr/bin/env python
"""Equivalence on a GPU: split = autograd on CUDA, and a local cluster with CUDA workers = one process.

Run on a machine with a CUDA device (the `device` tool), from the repository root:

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check] [--collectives | --only-collectives]

Writes gpu_check.json and gpu_check.md; exits non-zero when a check fails. ``--collectives`` adds
NCCL against the project's data plane on GPU tensors (all-reduce of 1, 16, 128 MB, point-to-point of
1 to 64 MB; with one GPU, the data plane against a device-to-device copy): raw torch.distributed
numbers, since no fusionllm helper uses NCCL yet (``benchmarks/collectives.py --device cuda``, which
writes collectives_gpu.json/.md/.png next to these; seconds). ``--only-collectives`` runs only that.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import read_metrics, results_dir, write  # noqa: E402

FUSION = [sys.executable, "-m", "fusionllm"]


def run(cmd: list[str], timeout: float = 300) -> tuple[int, str, float]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - started


def losses(path: Path) -> list[float]:
    return read_metrics(path).losses()


def collectives(out: Path) -> dict:
    """NCCL against the data plane on GPU tensors (``collectives.py --device cuda``), one result row."""
    import torch

    check = "collectives on GPU: NCCL (raw torch.distributed) vs the data plane"
    if not torch.cuda.is_available():
        return {"check": check, "ok": None, "detail": "skipped: no CUDA device (torch.cuda.is_available() is False)", "seconds": 0.0}
    try:
        rc, text, secs = run([sys.executable, str(HERE / "collectives.py"), "--device", "cuda", "--out", str(out)], timeout=400)
    except subprocess.TimeoutExpired:
        return {"check": check, "ok": False, "detail": "collectives.py --device cuda took over 400 s", "seconds": 400.0}
    if rc != 0:
        return {"check": check, "ok": False, "detail": text[-600:], "seconds": round(secs, 1)}
    doc = json.loads((out / "collectives_gpu.json").read_text())
    rows = doc["results"]["summary"]
    parts = []
    for op, world in dict.fromkeys((r["op"], r["world"]) for r in rows):
        mine = [r for r in rows if r["op"] == op and r["world"] == world]
        size = max(r["bytes"] for r in mine)
        rates = ", ".join(f"{r['method']} {r['gb_per_s']:.2f}" for r in mine if r["bytes"] == size)
        parts.append(f"{op} {size >> 20} MB x{world} GB/s: {rates}")
    if doc.get("nccl_skipped"):
        parts.append(f"NCCL skipped: {doc['nccl_skipped']}")
    return {"check": check, "ok": True, "detail": "; ".join(parts) + f" (table: {out / 'collectives_gpu.md'})", "seconds": round(secs, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description="Equivalence checks on a GPU (and, optionally, NCCL against the data plane).")
    ap.add_argument("--out", type=Path, default=results_dir("gpu_check"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--collectives", action="store_true", help="also time NCCL against the data plane on GPU tensors (seconds)")
    ap.add_argument("--only-collectives", action="store_true", help="only that timing, none of the equivalence checks")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    if args.collectives or args.only_collectives:
        results.append(collectives(args.out))
        print(f"{results[-1]['check']}: {results[-1]['detail']}", flush=True)
    if args.only_collectives:
        return _report(args.out, results)
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
    return _report(args.out, results)


def _report(out: Path, results: list[dict]) -> int:
    """Write gpu_check.json/.md; 1 when a check failed (a skipped one, ``ok`` None, is no failure)."""
    table = ["| check | ok | detail | seconds |", "|---|---|---|---|"]
    table += [f"| {r['check']} | {'skipped' if r['ok'] is None else 'yes' if r['ok'] else 'NO'} | {r['detail']} | {r['seconds']} |" for r in results]
    write(out, "gpu_check", results, table)
    return 0 if all(r["ok"] is not False for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
