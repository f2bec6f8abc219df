#!/usr/bin/env python
"""Codec error over a run: each codec's relative error and bytes on the activations of one cut, from
the first step of an uncompressed run to its last.

One process trains the model uncompressed (``one_process.OneProcessLM``: the system's own model,
data, optimiser and schedule) and, at the steps given, codes the output of block ``--cut`` with each
codec, as AdaTopK's sender would: ``kltr`` in the basis learnt from the tensors sent before it
(``Subspace(leading=True)``, learning from every micro-batch's activations after coding it), the
quantisers on their own. The error is ``||decode(encode(x)) - x|| / ||x||`` over the whole tensor
(the budget's measure), the bytes are the payload's over float32's. It shows how far the error of
one codec moves over a run while the activations change: what a budget set on short runs allows
late in a long one. Writes codec_error.json/.md/.png.

    python experiments/codec_error.py [--model gpt-micro] [--steps 1200] [--at 75 300 1199] [--codecs q6 eq:0.5 kltr:2 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import pyplot, results_dir, write  # noqa: E402
from experiments.one_process import MICRO_BATCHES, OneProcessLM  # noqa: E402

CODECS = ("q8", "q6", "eq:0.5", "eq:0.7", "kltr:0.7", "kltr:1", "kltr:1.5", "kltr:2")
MEASURED = 2  # the micro-batch coded at a measured step (two learnt before it in that step)


def measure_run(model: str, steps: int, at: list[int], codecs: list[str], seed: int, cut: int, warmup: int) -> list[dict]:
    from fusionllm.compress.codecs import decode, encode, parse_codec
    from fusionllm.compress.subspace import Subspace

    lm = OneProcessLM(model, steps, seed, warmup=warmup)
    acts: list[np.ndarray] = []
    block = lm.model.h[cut]
    forward = block.forward

    def keep(x):  # noqa: ANN001, ANN202
        y = forward(x)
        acts.append(y.detach().numpy().reshape(-1, y.shape[-1]).copy())
        return y

    block.forward = keep
    track, specs, rows = Subspace(leading=True), [parse_codec(c) for c in codecs], []
    for step in range(max(at) + 1):
        acts.clear()
        x, y = lm.start(step)
        for mb in range(MICRO_BATCHES):
            (lm.micro_batch_loss(x, y, mb) / MICRO_BATCHES).backward()
        lm.finish()
        for k, a in enumerate(acts):
            if step in at and k == MEASURED:
                norm = float(np.linalg.norm(a))
                for spec in specs:
                    tag, payload = encode(a, spec, basis=track.basis)
                    back = decode(tag, payload, a.shape)
                    rows.append({"step": step, "codec": str(spec), "error": round(float(np.linalg.norm(back - a)) / norm, 4),
                                 "bytes": round(len(payload) / (4 * a.size), 4)})
            track.learn(a)
        if step in at:
            print(f"step {step}: " + ", ".join(f"{r['codec']} {r['error']:.3f}" for r in rows if r["step"] == step), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=1200, help="the run's length (its learning-rate schedule)")
    ap.add_argument("--at", type=int, nargs="+", default=[0, 20, 75, 150, 300, 450, 600, 900, 1199], help="steps measured")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cut", type=int, default=1, help="the block whose output is coded")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=results_dir("codec_error"))
    args = ap.parse_args()
    if any(s < 0 or s >= args.steps for s in args.at):
        raise SystemExit(f"--at {args.at}: every step must be in 0..{args.steps - 1} (the run has --steps {args.steps})")
    rows = measure_run(args.model, args.steps, sorted(set(args.at)), args.codecs, args.seed, args.cut, args.warmup)
    steps = sorted({r["step"] for r in rows})
    table = [f"{args.model}, block {args.cut}'s output, seed {args.seed}, an uncompressed {args.steps}-step run; "
             "relative error (bytes over float32's) per codec at each step:", "",
             "| step | " + " | ".join(args.codecs) + " |", "|---|" + "---|" * len(args.codecs)]
    for s in steps:
        cells = {r["codec"]: f"{r['error']:.3f} ({r['bytes']:.3f})" for r in rows if r["step"] == s}
        table.append(f"| {s} | " + " | ".join(cells[c] for c in args.codecs) + " |")
    write(args.out, "codec_error", rows, table, meta={"setting": {k: getattr(args, k) for k in ("model", "steps", "seed", "cut", "warmup")}})
    _plot(rows, args.codecs, args.out / "codec_error.png")


def _plot(rows: list[dict], codecs: list[str], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in codecs:
        mine = [r for r in rows if r["codec"] == c]
        ax.plot([r["step"] for r in mine], [r["error"] for r in mine], marker="o", label=c)
    ax.set_xlabel("step")
    ax.set_ylabel("relative error")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
