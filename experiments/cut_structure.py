#!/usr/bin/env python
"""What crosses a pipeline cut: how many directions an LM's activations fill, and what each codec costs on them.

One process trains an LM (gpt-mini by default: 6 blocks, 192 wide; batch 8 x 128, lr 3e-3, 4
micro-batches) and records, at a few steps, the activations after block ``--cut`` (the residual
stream a two-stage pipeline sends across its cut) and their gradients, for the first two
micro-batches. For the second micro-batch it reports:

- the share of each row's energy in its largest channel and in its four largest;
- the share of the energy inside the leading 1, 4 and 16 directions of the *first* micro-batch (what
  a sender knows before it sends the second);
- for ``eq:0.5``, ``klt`` at several steps and ``kltr:1`` (the basis learnt from the first
  micro-batch, as the sender learns it): bytes per value and the relative error, over the whole
  tensor, and the error in the faint directions (past the 16th of the tensor's own) against the
  signal there.

    python experiments/cut_structure.py [--model gpt-mini] [--cut 2] [--steps 240] [--at 60 200 239]

Writes cut_structure.json/.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, results_dir, write  # noqa: E402
from experiments.one_process import OneProcessLM  # noqa: E402

CODECS = ("eq:0.5", "eq:0.25", "klt:0.35", "klt:0.25", "klt:0.15", "kltr:1")


def structure(x: np.ndarray, before: np.ndarray, role: str) -> dict:
    """The measurements above for ``x`` (rows, width), knowing ``before`` (rows sent earlier)."""
    from fusionllm.compress.codecs import decode, encode, parse_codec
    from fusionllm.compress.subspace import Subspace

    energy = x.astype(np.float64) ** 2
    ordered = np.sort(energy, axis=1)
    out: dict = {"role": role, "width": x.shape[1], "top1_channel": float(ordered[:, -1].sum() / energy.sum()),
                 "top4_channels": float(ordered[:, -4:].sum() / energy.sum())}
    _, _, vt = np.linalg.svd(before.astype(np.float64), full_matrices=False)
    for r in (1, 4, 16):
        inside = x @ vt[:r].T
        out[f"energy_in_{r}_directions"] = float(np.sum(inside**2) / energy.sum())
    own = np.linalg.svd(x.astype(np.float64), full_matrices=False)[2]
    sub = Subspace()
    sub.learn(before)
    out["klt_directions"] = None if sub.basis is None else int(sub.basis.shape[1])
    for codec in CODECS:
        tag, payload = encode(x, parse_codec(codec), basis=sub.basis)
        back = decode(tag, payload, x.shape)
        faint = own[16:].T
        out[codec] = {"sent_as": tag, "bytes_ratio": round(len(payload) / (4 * x.size), 4),
                      "rel_error": round(float(np.linalg.norm(back - x) / np.linalg.norm(x)), 4),
                      "faint_error": round(float(np.linalg.norm((back - x) @ faint) / max(np.linalg.norm(x @ faint), 1e-30)), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--cut", type=int, default=2, help="the block whose output crosses the cut")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--at", type=int, nargs="+", default=[60, 200, 239])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results_dir("cut_structure"))
    args = ap.parse_args()
    exit_on_sigterm()
    import torch

    lm = OneProcessLM(args.model, args.steps, args.seed)
    blocks = getattr(lm.model, "h", None)
    if blocks is None or not 0 <= args.cut < len(blocks):
        raise SystemExit(f"--cut {args.cut}: {args.model} has {0 if blocks is None else len(blocks)} blocks in .h; choose one of them")
    seen: list[torch.Tensor] = []
    blocks[args.cut].register_forward_hook(lambda _m, _i, out: (out.retain_grad(), seen.append(out))[-1] and None)
    rows = []
    for step in range(args.steps):
        x, y = lm.start(step)
        seen.clear()
        lm.backward(x, y)
        if step in args.at:
            act = [t.detach().reshape(-1, t.shape[-1]).numpy().astype(np.float32) for t in seen[:2]]
            grad = [t.grad.reshape(-1, t.shape[-1]).numpy().astype(np.float32) for t in seen[:2]]
            for role, (first, second) in (("activations", act), ("gradients", grad)):
                rows.append({"step": step, **structure(second, first, role)})
                print(rows[-1], flush=True)
        lm.finish()
    table = ["| step | tensor | largest channel | 4 largest | in 1 / 4 / 16 directions of the micro-batch before | klt's directions | "
             + " | ".join(f"{c}: bytes, error" for c in CODECS) + " | faint directions' error / signal: eq:0.5, kltr:1 |", "|---" * (7 + len(CODECS)) + "|"]
    for r in rows:
        cells = [f"{r[c]['bytes_ratio']:.3f}, {r[c]['rel_error']:.3f}" + ("" if r[c]["sent_as"] == c.split(":")[0] else f" (as {r[c]['sent_as']})")
                 for c in CODECS]
        table.append(f"| {r['step']} | {r['role']} | {r['top1_channel']:.1%} | {r['top4_channels']:.1%} | "
                     f"{r['energy_in_1_directions']:.1%} / {r['energy_in_4_directions']:.1%} / {r['energy_in_16_directions']:.2%} | "
                     f"{r['klt_directions']} | " + " | ".join(cells) + f" | {r['eq:0.5']['faint_error']}, {r['kltr:1']['faint_error']} |")
    table += ["", f"{args.model}, the output of block {args.cut} of {len(blocks)}, batch 8 x 128 in 4 micro-batches, seed {args.seed}, "
              "lr 3e-3 (warmup 10, cosine); the second micro-batch of the step, klt's basis learnt from the first. "
              "Faint directions: past the 16th of the tensor's own (singular vectors); the error there over the signal there (norms)."]
    write(args.out, "cut_structure", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
