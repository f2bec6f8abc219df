#!/usr/bin/env python
"""What a pipeline gradient's rounding does to the weight gradients below the cut: nearest, dithered, stochastic.

One process trains an LM (gpt-micro by default: batch 8 x 128, lr 3e-3, 4 micro-batches). At a few
steps, for two micro-batches, it takes the gradient of the loss with respect to the output of block
``--cut`` (what the stage after a pipeline cut sends back), quantises it per token with a step of
STEP x the token's RMS (``eq``'s grid, without the entropy coder) in three ways, and backpropagates
each into the blocks up to the cut:

- ``nearest``: rounded to the nearest step (``eq:STEP``);
- ``dither``: a uniform offset added before rounding and taken off after (``eqd:STEP``);
- ``stochastic``: rounded up or down at random, unbiased (the offset not taken off).

It reports the relative error of the tensor sent and of the weight gradients it yields. The error
of the tensor is about the same for nearest and dithered; what differs is whether the errors of many
tokens add up in a weight gradient (nearest: a fixed function of each value) or average out.

    python experiments/dither_grads.py [--cut 1] [--steps 240] [--at 5 20 80 160]

Writes dither_grads.json/.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, results_dir, write  # noqa: E402
from experiments.one_process import OneProcessLM  # noqa: E402

MODES = ("nearest", "dither", "stochastic")
STEPS = (0.7, 1.0)


def quantise(g: np.ndarray, step: float, mode: str, rng: np.random.Generator) -> np.ndarray:
    s = step * np.sqrt(np.mean(g.astype(np.float64) ** 2, axis=-1, keepdims=True)).astype(np.float32)
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    if mode == "nearest":
        return np.rint(g / s) * s
    u = rng.random(g.shape, dtype=np.float32) - np.float32(0.5)
    if mode == "dither":
        return (np.rint(g / s + u) - u) * s
    return np.floor(g / s + u + 0.5) * s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--cut", type=int, default=1, help="the block whose output crosses the cut")
    ap.add_argument("--steps", type=int, default=240, help="the schedule's length (the learning rate's cosine)")
    ap.add_argument("--at", type=int, nargs="+", default=[5, 20, 80, 160])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results_dir("dither_grads"))
    args = ap.parse_args()
    exit_on_sigterm()
    import torch

    lm = OneProcessLM(args.model, args.steps, args.seed)
    model = lm.model
    blocks = getattr(model, "h", None)
    if blocks is None or not 0 <= args.cut < len(blocks) - 1:
        raise SystemExit(f"--cut {args.cut}: {args.model} has {0 if blocks is None else len(blocks)} blocks in .h; choose one before the last")
    below = [p for n, p in model.named_parameters() if n.startswith(tuple(f"h.{b}." for b in range(args.cut + 1)))]
    out: dict = {}
    blocks[args.cut].register_forward_hook(lambda _m, _i, o: out.__setitem__("o", o) and None)
    rng = np.random.default_rng(args.seed)
    rows = []
    for step in range(max(args.at) + 1):
        x, y = lm.start(step)
        if step in args.at:
            errs: dict[tuple[str, float], list[tuple[float, float]]] = {}
            for mb in range(2):
                loss = lm.micro_batch_loss(x, y, mb)
                g = torch.autograd.grad(loss, out["o"], retain_graph=True)[0]
                exact = torch.cat([t.reshape(-1) for t in torch.autograd.grad(out["o"], below, grad_outputs=g, retain_graph=True)])
                for mode in MODES:
                    for st in STEPS:
                        gq = torch.from_numpy(quantise(g.numpy(), st, mode, rng))
                        got = torch.cat([t.reshape(-1) for t in torch.autograd.grad(out["o"], below, grad_outputs=gq, retain_graph=True)])
                        errs.setdefault((mode, st), []).append((float((gq - g).norm() / g.norm()), float((got - exact).norm() / exact.norm())))
            for (mode, st), v in errs.items():
                rows.append({"step": step, "mode": mode, "step_size": st, "sent_error": round(float(np.mean([a for a, _ in v])), 4),
                             "weight_grad_error": round(float(np.mean([b for _, b in v])), 4)})
            print([r for r in rows if r["step"] == step], flush=True)
            lm.optimizer.zero_grad(set_to_none=True)
        lm.backward(x, y)
        lm.finish()
    table = ["| step | step size | " + " | ".join(f"{m}: sent, weight gradients" for m in MODES) + " |", "|---" * (2 + len(MODES)) + "|"]
    for step in args.at:
        for st in STEPS:
            cells = [next(f"{r['sent_error']:.3f}, {r['weight_grad_error']:.3f}" for r in rows
                          if r["step"] == step and r["mode"] == m and r["step_size"] == st) for m in MODES]
            table.append(f"| {step} | {st} | " + " | ".join(cells) + " |")
    table += ["", f"{args.model}, the gradient of the output of block {args.cut} of {len(blocks)} (two micro-batches of 2 x 128 tokens "
              f"each, mean), batch 8 x 128, lr 3e-3, seed {args.seed}. Sent: ||q(g) - g|| / ||g||; weight gradients: the same for "
              f"the gradients of blocks 0 to {args.cut} computed from q(g), against those from g."]
    write(args.out, "dither_grads", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
