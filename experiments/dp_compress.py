#!/usr/bin/env python
"""Per-token efficiency of the error-fed compressor of data-parallel gradients (issue 58), in one process.

``R`` replicas share every step's batch (``batch / R`` sequences each), in ``S`` sites (``--sites``;
default: each replica a site of its own). Each site's leader takes the raw sum of its replicas'
gradients (flat, every trainable weight in name order, as ``schedule.plan.shared_groups`` lists a
group's), adds its residual and encodes it with the codec (``runtime/dist/site_reduce.leader_encode``,
in rows of ``row_width``); the decoded payloads are added in site order (``leaders_total``): exactly
the arithmetic ``SiteReduce`` runs between leaders. Then the global-norm clip and AdamW, as the stage does. ``none`` sums the replicas' gradients raw.

A variant is ``CODEC``, ``CODEC@raw=N`` (the first N steps raw, error feedback starting empty at
step N) and/or ``@freeze=K`` (AdamW's second moment frozen from step K on: ``frozen_adamw_step``;
``@floor=F``: its denominators at least F% of their tensor's mean). Per-token efficiency of a variant against ``none`` with the same seed (same weights at
step 0, same batches): the tokens ``none`` needs to reach the variant's final validation loss over
the tokens the variant used (where the variant ends lower: the variant's tokens to reach ``none``'s
final loss, inverted), on the validation curves interpolated linearly between evaluations.
"Fewer bytes": raw float32 bytes of what the leaders send over the payloads' bytes (raw steps
included).

    python experiments/dp_compress.py --model gpt-micro --steps 300 --batch 16 --seq 128 --replicas 4 \\
        --seeds 0 1 2 --variants none topkq2:0.02 topkq4:0.02@raw=20

Writes benchmarks/results/dp_compress/dp_compress-MODEL.json/.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import results_dir, write  # noqa: E402


def parse_variant(text: str) -> tuple[str, int, int, int]:
    """``CODEC[@raw=N][@freeze=K][@floor=F]``: the codec, the raw steps, the step from which AdamW's second moment
    is frozen (0: never), and the frozen denominator's floor in percent of its tensor's mean (0: none)."""
    codec, *rest = text.split("@")
    got = {"raw": 0, "freeze": 0, "floor": 0}
    for part in rest:
        key, _, value = part.partition("=")
        if key not in got or not value.isdigit():
            raise SystemExit(f"--variants {text}: write CODEC[@raw=STEPS][@freeze=STEP][@floor=PERCENT]")
        got[key] = int(value)
    return codec, got["raw"], got["freeze"], got["floor"]


def frozen_adamw_step(optimizer, floor: float = 0.0, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
    """AdamW's step with its second moment (and the second moment's bias correction) as they were when it froze:
    the update is then linear in the gradient, so an error-fed burst moves the weights as far as the steps it
    stood for (1-bit Adam, arXiv 2102.02888), instead of being normalised to one step."""
    import torch

    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                if "frozen_denom" not in state:
                    t = float(state["step"])
                    denom = (state["exp_avg_sq"] / (1 - betas[1] ** t)).sqrt_().add_(eps)
                    state["frozen_denom"] = denom.clamp_(min=float(denom.mean()) * floor) if floor else denom
                state["step"] += 1
                t = float(state["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - betas[0])
                p.addcdiv_(state["exp_avg"], state["frozen_denom"], value=-group["lr"] / (1 - betas[0] ** t))


def train(model_name: str, steps: int, batch: int, seq: int, replicas: int, sites: int, seed: int, eval_every: int, eval_batches: int,
          variant: str) -> dict:
    import torch

    from fusionllm.compress.codecs import decode, parse_codec
    from fusionllm.compress.feedback import ErrorFeedback
    from fusionllm.core.config import TrainConfig, lr_at
    from fusionllm.data import Batcher
    from fusionllm.data.lm_tokens import load_lm_tokens
    from fusionllm.models.loss import lm_loss
    from fusionllm.models.spec import build_lm, lm_tokenizer
    from fusionllm.runtime.dist.reduce import row_width
    from fusionllm.runtime.dist.site_reduce import leader_encode, leaders_total
    from fusionllm.runtime.reference.single import clip_grad_norm, evaluate
    from fusionllm.runtime.stage.optim import make_adamw

    torch.set_num_threads(1)
    codec_text, raw_steps, freeze_at, floor = parse_variant(variant)
    spec = parse_codec(codec_text)
    cfg = TrainConfig(model=model_name, steps=steps, batch_size=batch, seq_len=seq, seed=seed)
    tokens = load_lm_tokens(cfg.data, lm_tokenizer(cfg.tokenizer, cfg.init_from), 0.1)
    batches = Batcher(tokens.train, batch, seq, seed)
    val = Batcher(tokens.val, batch, seq, seed)
    model = build_lm(model_name, tokens.vocab_size, seed=seed)
    optimizer = make_adamw(model.named_parameters(), cfg.lr, cfg.weight_decay)
    named = dict(sorted(dict(model.named_parameters()).items()))  # a tied weight once
    params = list(named.values())
    row = row_width([tuple(p.shape) for p in params])
    feedback = ErrorFeedback()
    shares = np.array_split(np.arange(batch), replicas)
    raw_bytes = sent_bytes = 0
    curve: list[tuple[int, float]] = [(0, evaluate(model, val, eval_batches))]
    started = time.perf_counter()
    for step in range(steps):
        lr = lr_at(step, lr=cfg.lr, steps=steps, warmup=cfg.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)
        sums: list[np.ndarray] = [np.zeros(0, np.float32)] * sites
        for r, rows in enumerate(shares):  # each replica's gradient of its share (the step's mean loss, its part), summed in its site raw
            model.zero_grad(set_to_none=True)
            (lm_loss(model(x[rows]).float(), y[rows]) * (len(rows) / batch)).backward()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]).numpy().copy()
            site = r * sites // replicas
            sums[site] = flat if not sums[site].size else sums[site] + flat
        decoded = []
        for site, flat in enumerate(sums):  # each site's leader: its sum, error-fed, encoded
            raw_bytes += flat.nbytes
            if spec.lossless or step < raw_steps:
                decoded.append(flat)
                sent_bytes += flat.nbytes
            else:
                payload = leader_encode(flat, spec, feedback, site, row)
                sent_bytes += len(payload[1])
                decoded.append(decode(*payload, (-(-flat.size // row), row)))
        total = torch.from_numpy(leaders_total(decoded, decoded[0].size if spec.lossless else sum(p.numel() for p in params)))
        offset = 0
        for p in params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        clip_grad_norm(model, cfg.grad_clip)
        if freeze_at and step >= freeze_at:
            frozen_adamw_step(optimizer, floor / 100)
        else:
            optimizer.step()
        if (step + 1) % eval_every == 0 or step == steps - 1:
            curve.append((step + 1, evaluate(model, val, eval_batches)))
            print(f"{variant} seed {seed}: step {step + 1} validation {curve[-1][1]:.4f}", file=sys.stderr, flush=True)
    return {"variant": variant, "seed": seed, "curve": curve, "tokens_per_step": batch * seq, "fewer_bytes": raw_bytes / sent_bytes,
            "seconds": time.perf_counter() - started}


def tokens_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """Steps at which the curve first reaches ``target`` (linear between evaluations); None if never."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return None


def efficiency(base: list[tuple[int, float]], run: list[tuple[int, float]]) -> float:
    steps, final, base_final = run[-1][0], run[-1][1], base[-1][1]
    if final >= base_final:
        need = tokens_to(base, final)
        return (need if need is not None else steps) / steps
    need = tokens_to(run, base_final)
    return steps / need if need else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--sites", type=int, default=0, help="sites the replicas are grouped in (default: each replica a site)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=["none", "topkq2:0.02"])
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out-suffix", default="", help="appended to the result files' name (another setting of the same model)")
    a = ap.parse_args()
    variants = ["none", *[v for v in a.variants if v != "none"]]
    a.sites = a.sites or a.replicas
    jobs = [(a.model, a.steps, a.batch, a.seq, a.replicas, a.sites, s, a.eval_every, a.eval_batches, v) for v in variants for s in a.seeds]
    cache = results_dir("dp_compress", "runs")  # each run as it ends: a longer study resumes where it stopped
    cache.mkdir(parents=True, exist_ok=True)
    name = lambda j: "-".join(str(x) for x in (*j[:7], j[9])).replace(":", "_") + ".json"  # noqa: E731  (no eval settings)
    todo = [j for j in jobs if not (cache / name(j)).exists()]
    with ProcessPoolExecutor(max(1, a.jobs), mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(train, *j): j for j in todo}
        for done in as_completed(futures):
            (cache / name(futures[done])).write_text(json.dumps(done.result()))
    runs = [json.loads((cache / name(j)).read_text()) for j in jobs]
    by = {(r["variant"], r["seed"]): r for r in runs}
    table = [f"{a.model}, batch {a.batch} x {a.seq}, {a.steps} steps, {a.replicas} replicas in {a.sites} sites, seeds {a.seeds}; "
             "validation loss at the end; efficiency: tokens `none` needs for that loss / tokens used (paired by seed).", "",
             "| variant | fewer bytes | final loss (per seed) | mean | efficiency (per seed) | min efficiency |", "|---|---|---|---|---|---|"]
    summary = []
    for v in variants:
        finals = [by[(v, s)]["curve"][-1][1] for s in a.seeds]
        effs = [efficiency(by[("none", s)]["curve"], by[(v, s)]["curve"]) for s in a.seeds]
        fewer = by[(v, a.seeds[0])]["fewer_bytes"]
        summary.append({"variant": v, "fewer_bytes": fewer, "final_losses": finals, "efficiency": effs})
        table.append(f"| {v} | {fewer:.1f}x | {', '.join(f'{x:.4f}' for x in finals)} | {statistics.mean(finals):.4f} | "
                     f"{', '.join(f'{e:.3f}' for e in effs)} | {min(effs):.3f} |")
    write(results_dir("dp_compress"), f"dp_compress-{a.model}{a.out_suffix}", {"summary": summary, "runs": runs}, table,
          {"args": vars(a), "argv": shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
