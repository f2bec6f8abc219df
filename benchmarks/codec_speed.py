#!/usr/bin/env python
"""Codec speed: encode + decode of float32 tensors on one core, MB/s of dense input, bytes and error.

For 1M to 64M elements: top-k at ratios 0.001 to 0.3 (exact below 1M elements, a sampled threshold
above: the table reports how far its k is from the exact k), per-token top-k, fp16, bf16, per-token
q8 / q4, the rotated tile quantisers hq4 / hq3 / hq2 with nearest and stochastic rounding, eq:0.7, eqd:0.7, and
klt:0.25 and kltr:1 on rows in 32 of their 768 directions (plus a little noise), in a basis learnt from
another such tensor; their time counts learning the next basis from the tensor too, as the sender does.
One core: BLAS and torch limited to one thread before NumPy loads. The goal line: every codec's
encode plus decode at least 125 MB/s of float32 input (a 1 Gbit/s link's rate: compressing never
costs more time than sending the raw tensor over such a link would). ``--layout cnn`` codes tensors
of (N, 512, 4, 4) instead (a ResNet's last stage, which the quantisers scale per channel over the
batch, through a transposed copy; no klt, kltr there). Writes codec_speed.json/.md/.png.

    python benchmarks/codec_speed.py [--quick] [--codecs eq:0.7 kltr:1 ...] [--layout cnn] [--out benchmarks/results/codec_speed]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # one core, set before NumPy loads its BLAS
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, results_dir, write  # noqa: E402

from fusionllm.compress.codecs import decode, encode, parse_codec  # noqa: E402
from fusionllm.compress.subspace import Subspace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINK_MB_S = 125.0  # 1 Gbit/s


def bench(x: np.ndarray, spec: str, reps: int, sub: Subspace | None = None) -> dict:
    """``sub``: klt's basis, learnt again from ``x`` after each encode (counted in the encode's time)."""
    codec = parse_codec(spec)
    enc, dec = [], []
    basis = None if sub is None else sub.basis
    for _ in range(reps):
        t0 = time.perf_counter()
        tag, payload = encode(x, codec, basis=basis)
        if sub is not None:
            Subspace(sub.keep, leading=sub.leading).learn(x)  # a fresh learner: the timed basis stays the one learnt before
        t1 = time.perf_counter()
        y = decode(tag, payload, x.shape)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    total = statistics.median(enc) + statistics.median(dec)
    kept = int(np.count_nonzero(y)) if codec.sparse else x.size
    exact_k = int(np.ceil(codec.ratio * x.size)) if codec.sparse else x.size
    err = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    return {"codec": spec, "elements": x.size, "encode_s": round(statistics.median(enc), 4), "decode_s": round(statistics.median(dec), 4),
            "mb_per_s": round(x.nbytes / total / 1e6, 1), "bytes_ratio": round(len(payload) / x.nbytes, 5),
            "k_vs_exact": round(kept / exact_k, 3), "rel_error": round(err, 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=results_dir("codec_speed"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--codecs", nargs="+", default=None, help="only these codecs (default: every one)")
    ap.add_argument("--layout", choices=("tokens", "cnn"), default="tokens",
                    help="tokens: rows of 768 (a model's tokens); cnn: (N, 512, 4, 4), a ResNet's last stage, "
                         "which the quantisers scale per channel over the batch (a transposed copy)")
    args = ap.parse_args()
    sizes = [1 << 20, 16 << 20] if args.quick else [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    specs = ["topk:0.001", "topk:0.01", "topk:0.1", "topk:0.3", "topk-token:0.01", "fp16", "bf16", "q8", "q4",
             "hq4", "hq3", "hq2", "hq4-sr", "hq3-sr", "hq2-sr", "eq:0.7", "eqd:0.7"]
    learnt = ["klt:0.25", "kltr:1", "kltr:2"]  # on rows in few directions, in a basis learnt from another such tensor
    if args.codecs:
        specs, learnt = [c for c in specs if c in args.codecs], [c for c in learnt if c in args.codecs]
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        if args.layout == "cnn":
            x = rng.standard_normal(n // 8192 * 8192).astype(np.float32).reshape(-1, 512, 4, 4)
        else:
            x = rng.standard_normal(n // 768 * 768).astype(np.float32).reshape(-1, 768)  # rows like a model's tokens
        for spec in specs:
            rows.append(bench(x, spec, 2 if n >= 64 << 20 else 3))
            print(rows[-1], flush=True)
        for spec in learnt if args.layout == "tokens" else ():
            sub = Subspace(leading=spec.startswith("kltr"))  # kltr: its leading directions, as its senders learn them
            sub.learn(low_rank(rng, x.shape[0]))
            rows.append(bench(low_rank(rng, x.shape[0]), spec, 2 if n >= 64 << 20 else 3, sub))
            print(rows[-1], flush=True)
    table = ["| codec | elements | MB/s (dense in, encode + decode) | encode (s) | decode (s) | bytes ratio | kept k / exact k | relative error |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['codec']} | {r['elements']:,} | {r['mb_per_s']} | {r['encode_s']} | {r['decode_s']} | {r['bytes_ratio']} | {r['k_vs_exact']} | {r['rel_error']} |" for r in rows]
    goal = min((r for r in rows if r["codec"] == "topk:0.01"), key=lambda r: abs(r["elements"] - (16 << 20)), default=None)
    if goal:
        table += ["", f"Goal (top-k at 0.01 on 16M elements >= 300 MB/s): {goal['mb_per_s']} MB/s, k within {abs(goal['k_vs_exact'] - 1):.1%} of exact."]
    slowest = {spec: min(r["mb_per_s"] for r in rows if r["codec"] == spec) for spec in dict.fromkeys(r["codec"] for r in rows)}
    below = {k: v for k, v in slowest.items() if v < LINK_MB_S}
    table += ["", f"Goal (every codec's encode + decode >= {LINK_MB_S} MB/s of float32 input on one core, a 1 Gbit/s link): "
              + ("met" if not below else "missed by " + ", ".join(f"{k} ({v} MB/s)" for k, v in below.items()))
              + "; slowest size per codec: " + ", ".join(f"{k} {v}" for k, v in slowest.items()) + " MB/s."]
    write(args.out, "codec_speed", rows, table)
    _plot(rows, args.out / "codec_speed.png")
    return 0


def low_rank(rng: np.random.Generator, n: int, cols: int = 768, rank: int = 32) -> np.ndarray:
    """``n`` rows in ``rank`` fixed directions of ``cols`` (the same for every call), plus noise 1e-3."""
    basis = np.linalg.qr(np.random.default_rng(7).standard_normal((cols, rank)))[0].astype(np.float32)
    coords = rng.standard_normal((n, rank), dtype=np.float32) * np.linspace(3.0, 0.2, rank, dtype=np.float32)
    return coords @ basis.T + np.float32(1e-3) * rng.standard_normal((n, cols), dtype=np.float32)


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == spec]
        ax.plot([r["elements"] for r in mine], [r["mb_per_s"] for r in mine], marker="o", label=spec)
    ax.set_xscale("log")
    ax.set_xlabel("float32 elements")
    ax.set_ylabel("MB/s of dense input (encode + decode)")
    ax.axhline(LINK_MB_S, color="0.6", ls="--", lw=0.8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
