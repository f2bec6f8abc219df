#!/usr/bin/env python
"""A tied embedding's gradient in the ring all-reduce: one scale a chunk against one scale a row.

One process trains an LM (gpt-micro by default: batch 8 x 128, lr 3e-3, 4 micro-batches) and, at a
few steps, takes the tied embedding's gradient (the tensor that the first and the last stage sum
over the ring), cuts it in two as a ring of two does, and codes one half with ``eq:0.5`` and
``eq:0.7`` twice: flat (one row, so one scale: how the ring sent it before whole rows) and in the
embedding's rows (a scale per token, ``runtime/reduce.row_width``). For each it reports the bytes,
the error over the whole half (what the error budget measures), each row's own error (what Adam,
which scales every coordinate by its own history, sees), and the rows that arrive as zeros.

    python experiments/reduce_rows.py [--model gpt-micro] [--steps 240] [--at 0 10 40 120]

Writes reduce_rows.json/.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, results_dir, write  # noqa: E402
from experiments.one_process import OneProcessLM  # noqa: E402

CODECS = ("eq:0.5", "eq:0.7")


def coded(half: np.ndarray, width: int) -> list[dict]:
    """``half`` (rows of ``width``) coded flat and in rows by each codec."""
    from fusionllm.compress.codecs import decode, encode, parse_codec

    rows = half.reshape(-1, width)
    out = []
    for codec in CODECS:
        for layout, x in (("flat", half.reshape(-1)), ("rows", rows)):
            tag, payload = encode(x, parse_codec(codec))
            back = decode(tag, payload, x.shape).reshape(rows.shape)
            per_row = np.linalg.norm(back - rows, axis=1) / np.maximum(np.linalg.norm(rows, axis=1), 1e-30)
            out.append({"codec": codec, "layout": layout, "bytes_ratio": round(len(payload) / (4 * x.size), 4),
                        "rel_error": round(float(np.linalg.norm(back - rows) / np.linalg.norm(rows)), 4),
                        "row_error_p10_p50_p90": [round(float(v), 3) for v in np.quantile(per_row, [0.1, 0.5, 0.9])],
                        "rows_zeroed": round(float(np.mean(np.abs(back).sum(axis=1) == 0)), 3)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=240, help="the schedule's length (the learning rate's cosine)")
    ap.add_argument("--at", type=int, nargs="+", default=[0, 10, 40, 120])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results_dir("reduce_rows"))
    args = ap.parse_args()
    exit_on_sigterm()
    lm = OneProcessLM(args.model, args.steps, args.seed)
    tied = dict(lm.model.named_parameters()).get("wte.weight")
    if tied is None:
        raise SystemExit(f"{args.model} has no wte.weight: this benchmark needs a tied token embedding")
    rows = []
    for step in range(max(args.at) + 1):
        x, y = lm.start(step)
        lm.backward(x, y)
        if step in args.at:
            grad = tied.grad.numpy().astype(np.float32)
            rms = np.sqrt(np.mean(grad**2, axis=1))
            half = grad[: grad.shape[0] // 2]  # a ring of two: each member sends one half
            rows.append({"step": step, "vocab": grad.shape[0], "width": grad.shape[1],
                         "row_rms_max_over_median": round(float(rms.max() / np.median(rms)), 1),
                         "coded": coded(half, grad.shape[1])})
            print(rows[-1], flush=True)
        lm.finish()
    table = ["| step | loudest row / median row (RMS) | codec | scales | bytes | error, whole half | "
             "each row's error (10th, 50th, 90th percentile) | rows sent as zeros |", "|---" * 8 + "|"]
    for r in rows:
        for c in r["coded"]:
            p = c["row_error_p10_p50_p90"]
            table.append(f"| {r['step']} | {r['row_rms_max_over_median']}x | `{c['codec']}` | "
                         f"{'one a chunk' if c['layout'] == 'flat' else 'one a row'} | {c['bytes_ratio']:.3f} | {c['rel_error']:.3f} | "
                         f"{p[0]:.3f}, {p[1]:.3f}, {p[2]:.3f} | {c['rows_zeroed']:.0%} |")
    table += ["", f"{args.model}'s tied embedding (`wte.weight`, {rows[0]['vocab']} x {rows[0]['width']}), its gradient at the "
              f"steps listed of a one-process run (batch 8 x 128 in 4 micro-batches, lr 3e-3, seed {args.seed}); the first half "
              "of it, as one member of a ring of two sends it. Bytes: of the raw float32 bytes. Error: ||decoded - x|| / ||x||."]
    write(args.out, "reduce_rows", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
