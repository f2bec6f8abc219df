#!/usr/bin/env python
"""What a quantiser's scales cost on a ResNet's small planes: a scale per channel plane against one per channel over the batch.

One process trains ResNet-18 (CIFAR stem, the seeded synthetic 32 x 32 images, batch 16 in 4
micro-batches of 4, AdamW lr 1e-3 with weight decay 0.1 on matrices, warmup 10, cosine to a tenth) and, at a few steps, takes the output of
``--layer`` (``layer4.0``: 512 channels of 4 x 4, the tensor the two-stage ResNet-18 pipeline of
``benchmarks/convergence.py --task vision`` sends across its cut) and its gradient, for the first
micro-batch. Each codec encodes them twice: with a bfloat16 scale per 4 x 4 plane (how the
quantisers scaled every 4-D tensor before) and per channel over the micro-batch (how they scale
planes under ``sparse.SMALL_PLANE`` values now). Reported: bytes over the raw float32 bytes and the
relative error ``||decode(encode(x)) - x|| / ||x||``.

    python experiments/cnn_scales.py [--steps 60] [--at 0 30 59] [--layer layer4.0]

Writes cnn_scales.json/.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, results_dir, write  # noqa: E402

CODECS = ("q8", "q5", "eq:0.5", "eq:0.7", "eq:0.85")


def costs(x: np.ndarray) -> dict:
    """Bytes ratio and relative error of each codec on ``x``, a scale per plane and per channel."""
    from fusionllm.compress import sparse
    from fusionllm.compress.codecs import decode, encode, parse_codec

    out: dict = {}
    small = sparse.SMALL_PLANE
    try:
        for layout, threshold in (("plane", 0), ("channel", small)):
            sparse.SMALL_PLANE = threshold  # 0: no plane is small, every 4-D tensor is scaled per plane
            for codec in CODECS:
                tag, payload = encode(x, parse_codec(codec))
                back = decode(tag, payload, x.shape)
                out[f"{codec} {layout}"] = {"bytes_ratio": len(payload) / x.nbytes,
                                            "rel_error": float(np.linalg.norm(back - x) / np.linalg.norm(x))}
    finally:
        sparse.SMALL_PLANE = small
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, nargs="+", default=[0, 30, 59])
    ap.add_argument("--layer", default="layer4.0", help="the module whose output crosses the cut")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results_dir("cnn_scales"))
    args = ap.parse_args()
    exit_on_sigterm()
    import torch

    from fusionllm.core.config import lr_at
    from fusionllm.models.vision_task import vision_task
    from fusionllm.runtime.stage.optim import make_adamw

    torch.set_num_threads(1)
    task = vision_task("resnet18", seed=args.seed, batch_size=16)
    torch.manual_seed(args.seed)
    model = task.model()
    modules = dict(model.named_modules())
    if args.layer not in modules:
        raise SystemExit(f"--layer {args.layer}: not a module of resnet18; e.g. layer3, layer4.0, layer4.1")
    seen: list[torch.Tensor] = []
    modules[args.layer].register_forward_hook(lambda _m, _i, out: (out.retain_grad(), seen.append(out))[-1] and None)
    optimizer = make_adamw(model.named_parameters(), 1e-3)
    rows = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=1e-3, steps=args.steps, warmup=10)
        images, labels = (torch.from_numpy(np.asarray(a)) for a in task.batch(step))
        optimizer.zero_grad(set_to_none=True)
        seen.clear()
        for mb in range(4):
            part = slice(mb * 4, mb * 4 + 4)
            (task.loss(model(images[part]), labels[part]) / 4).backward()
        if step in args.at:
            for role, t in (("activations", seen[0].detach()), ("gradients", seen[0].grad)):
                x = t.numpy().astype(np.float32)
                rows.append({"step": step, "role": role, "shape": list(x.shape), **costs(x)})
                print(rows[-1], flush=True)
        optimizer.step()
    table = ["| step | tensor | shape | " + " | ".join(f"{c}: per plane | {c}: per channel" for c in CODECS) + " |",
             "|---" * (3 + 2 * len(CODECS)) + "|"]
    for r in rows:
        cells = [f"{r[f'{c} {lay}']['bytes_ratio']:.4f}, {r[f'{c} {lay}']['rel_error']:.3f}" for c in CODECS for lay in ("plane", "channel")]
        table.append(f"| {r['step']} | {r['role']} | {' x '.join(map(str, r['shape']))} | " + " | ".join(cells) + " |")
    table += ["", f"resnet18 (CIFAR stem), the output of {args.layer} and its gradient, the first micro-batch of 4 images, seed {args.seed}; "
              "each cell: bytes over the raw float32 bytes, relative error. Per plane: a bfloat16 scale per channel's H x W plane; "
              "per channel: one per channel over the micro-batch."]
    write(args.out, "cnn_scales", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
