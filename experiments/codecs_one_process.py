#!/usr/bin/env python
"""AdaTopK's codecs on gpt-micro in one process: many seeds of the convergence runs at a fraction of their cost.

``convergence.py`` trains over the testbed, four minutes a 1,200-step run. This trains the same model
with the same data, schedule and evaluation in one plain PyTorch process (one thread per run, runs
in parallel) and sends what a two-stage pipeline would send through the real codecs
(``fusionllm.compress.codecs``):

- ``grad``: the gradient of block ``--cut``'s output (what the second stage sends back), per token
  row, with error feedback per micro-batch slot (as ``link_sender`` keys it);
- ``reduce``: the tied embedding's gradient, all-reduced by a ring of two (the embedding's part on
  one member, the LM head's on the other): each member's half of the rows coded on its way
  (reduce-scatter), the sums coded back (all-gather), both with error feedback, every member using
  the decoded sums;
- ``act``: block ``--cut``'s output on its way forward; ``kltr`` in a basis of its leading
  directions learnt, as its senders learn it, from the micro-batch sent before (``Subspace``).

A variant names its codecs, ``grad=eq:0.7,reduce=eq:0.7``, and optionally the steps they run in,
``from=300`` and ``until=300`` (the first step coded, the first not; error feedback starts empty);
phases with other codecs follow after ``/`` (``grad=q8,until=300/grad=eq:0.7,from=300``: a step
takes the first phase whose steps hold it, and is raw where none does). ``act=jitter:EPS`` is no
codec but a control: each value times ``1 + EPS u`` (``u`` seeded uniform in [-1, 1], RMS
relative error ``EPS/sqrt(3)``), the bytes counted raw; at ``jitter:1e-6`` it changes only the
last bits of a float32 and shows how far a run moves from a difference that carries no error worth
the name, and at ``jitter:1e-2`` it is an unstructured noise of about q8's error. ``none`` sends nothing
through a codec and is the plain model. Each run's validation loss is the system's (``Batcher.eval_arrays``: the
same 16 batches the testbed runs use), so a ``none`` run reproduces ``convergence.py``'s loss of
the same seed up to float rounding order. "Fewer bytes": the raw bytes of the coded roles over
the whole run (raw steps included) over what was sent.

    python experiments/codecs_one_process.py --steps 1200 --seeds 0 1 2 3 4 5 6 7 \\
        --variants none grad=eq:0.7,reduce=eq:0.7 [--jobs 2]

Writes codecs_one_process.json/.md/.png: per variant the mean final loss, the paired difference
against ``none`` (mean, standard deviation, standard error), and each seed's loss.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, pyplot, results_dir, write  # noqa: E402
from experiments.one_process import MICRO_BATCHES, OneProcessLM  # noqa: E402

ROLES = ("act", "grad", "reduce")
WINDOW = ("from", "until")  # the steps the codecs run in
EVAL_BATCHES = 16


def _jitter_ok(value: str) -> bool:
    """``jitter:EPS`` (0 < EPS < 1) or a codec's name (checked when the run builds it)."""
    if not value.startswith("jitter:"):
        return True
    try:
        return 0 < float(value.partition(":")[2]) < 1
    except ValueError:
        return False


def parse_variant(text: str) -> list[dict[str, str]]:
    """``grad=eq:0.7,until=300/grad=eq:0.7,reduce=eq:0.7,from=300`` -> one dict a phase
    ({"grad": "eq:0.7", "until": "300"}, ...); ``none`` -> []."""
    if text == "none":
        return []
    phases = []
    for phase in text.split("/"):
        out = {}
        for part in phase.split(","):
            key, _, value = part.partition("=")
            if (key in WINDOW and value.isdigit()) or (key in ROLES and value and _jitter_ok(value)):
                out[key] = value
            else:
                raise SystemExit(f"--variants {text}: each part is ROLE=CODEC (ROLE: {', '.join(ROLES)}) or from=STEP / until=STEP")
        phases.append(out)
    return phases


def train(model_name: str, steps: int, seed: int, eval_every: int, cut: int, warmup: int, variant: list[dict[str, str]]) -> dict:
    """One run; returns its validation curve [(step, loss)]."""
    import torch

    from fusionllm.compress.codecs import decode, encode, parse_codec
    from fusionllm.compress.feedback import ErrorFeedback
    from fusionllm.compress.subspace import Subspace
    from fusionllm.data import Batcher
    from fusionllm.runtime.reference.single import evaluate

    def codec(phase: dict[str, str], role: str):  # noqa: ANN202
        if phase.get(role, "").startswith("jitter:"):
            return jitter(float(phase[role].partition(":")[2]))
        spec = parse_codec(phase.get(role, "none"))
        if spec.kind == "none":
            return None
        sub = Subspace(leading=True) if spec.kind == "kltr" else None  # a link's first tensor goes as eq

        def roundtrip(x: np.ndarray) -> np.ndarray:
            x = np.ascontiguousarray(x, dtype=np.float32)
            tag, payload = encode(x, spec, basis=None if sub is None else sub.basis)
            if sub is not None:
                sub.learn(x)  # for the next tensor, after this one is encoded
            sent[0] += len(payload) - 4 * x.size  # counted raw below, the difference here
            return decode(tag, payload, x.shape)
        return roundtrip

    def jitter(eps: float):  # noqa: ANN202
        """Not a codec: each value times (1 + eps u), u seeded uniform in [-1, 1]; counted as raw bytes."""
        rng = np.random.default_rng([seed, 7919])

        def nudge(x: np.ndarray) -> np.ndarray:
            x = np.ascontiguousarray(x, dtype=np.float32)
            return (x * (1 + eps * rng.uniform(-1, 1, x.shape))).astype(np.float32)
        return nudge

    sent, raw_bytes = [0], [0]  # bytes over the run: as sent, and as float32
    phases = [(int(p.get("from", 0)), int(p.get("until", steps)), {r: codec(p, r) for r in ROLES}) for p in variant]
    raw = dict.fromkeys(ROLES)
    coded = {r for _, _, c in phases for r in ROLES if c[r] is not None}  # the roles whose bytes are counted
    now = dict(raw)  # this step's codec per role (None: raw)
    lm = OneProcessLM(model_name, steps, seed, warmup=warmup)
    model, ef, slot = lm.model, ErrorFeedback(), [0]

    class Cut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            act = now["act"]
            raw_bytes[0] += 4 * x.numel() if "act" in coded else 0
            return x.clone() if act is None else torch.from_numpy(act(x.detach().numpy().reshape(-1, x.shape[-1])).reshape(x.shape))

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            grad = now["grad"]
            raw_bytes[0] += 4 * g.numel() if "grad" in coded else 0
            if grad is None:
                return g
            rows = g.detach().numpy().reshape(-1, g.shape[-1])
            return torch.from_numpy(np.ascontiguousarray(ef.apply(("grad", slot[0]), rows, grad)).reshape(g.shape))

    block = model.h[cut]
    forward = block.forward
    block.forward = lambda x: Cut.apply(forward(x))
    untied = any(c["reduce"] is not None for _, _, c in phases)
    if untied:  # the LM head gets its own copy of the tied weight: its gradient is the second member's part
        tied = model.wte.weight
        head = torch.nn.Parameter(tied.detach().clone())
        model.lm_head.weight = head

    def ring(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        red = now["reduce"]
        raw_bytes[0] += 2 * a.nbytes  # four messages of half the rows: two out, two back
        if red is None:
            return a + b
        n = a.shape[0] // 2
        s0 = a[:n] + ef.apply(("rs", 1), b[:n], red)
        s1 = b[n:] + ef.apply(("rs", 0), a[n:], red)
        return np.concatenate([ef.apply(("ag", 0), s0, red), ef.apply(("ag", 1), s1, red)])

    val = Batcher(lm.tokens.val, MICRO_BATCHES * 2, 128, seed)

    curve = []
    for step in range(steps):
        x, y = lm.start(step)
        now.update(next((c for lo, hi, c in phases if lo <= step < hi), raw))
        for mb in range(MICRO_BATCHES):
            slot[0] = mb
            (lm.micro_batch_loss(x, y, mb) / MICRO_BATCHES).backward()
        if untied:
            tied.grad = torch.from_numpy(ring(tied.grad.numpy(), head.grad.numpy()))
            head.grad = None
        lm.finish()
        if untied:
            with torch.no_grad():
                head.copy_(tied)
        if (step + 1) % eval_every == 0 or step == steps - 1:
            curve.append((step, round(evaluate(model, val, EVAL_BATCHES), 5)))  # the system's own evaluation
    sent_bytes = raw_bytes[0] + sent[0]
    return {"seed": seed, "curve": curve, "final_val_loss": curve[-1][1], "fewer_bytes": raw_bytes[0] / sent_bytes if sent_bytes else 1.0}


def _job(args: tuple) -> tuple[str, dict]:
    name, rest = args[0], args[1:]
    return name, train(*rest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--eval-every", type=int, default=120)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--variants", nargs="+", default=["none", "grad=eq:0.7,reduce=eq:0.7"])
    ap.add_argument("--cut", type=int, default=1, help="the block whose output crosses the cut (slow-link's plan: 1)")
    ap.add_argument("--warmup", type=int, default=20, help="LR warm-up steps (convergence.py's default)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    ap.add_argument("--keep", type=Path, nargs="+", help="earlier codecs_one_process.json files of the same setting: their runs are reused")
    ap.add_argument("--out", type=Path, default=results_dir("codecs_one_process"))
    args = ap.parse_args()
    exit_on_sigterm()
    variants = {v: parse_variant(v) for v in args.variants}
    if "none" not in variants:
        raise SystemExit("--variants must include none (the paired reference)")
    setting = {k: getattr(args, k) for k in ("model", "steps", "eval_every", "cut", "warmup")}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    meta: dict = {"setting": setting}
    kept = []
    for path in args.keep or []:  # runs of the same setting measured before: not run again
        doc = json.loads(path.read_text())
        if "setting" not in doc:  # a file from before the setting was recorded: read it from its command
            then = ap.parse_args(shlex.split(doc["command"])[2:])
            doc["setting"] = {k: getattr(then, k) for k in setting}
        if doc.get("setting") != setting:
            raise SystemExit(f"--keep {path}: measured with {doc.get('setting')}, not {setting}; run it with that setting or without --keep")
        reused = set()
        for row in doc["results"]:
            if row["variant"] not in runs:
                continue
            have = {r["seed"] for r in runs[row["variant"]]}
            new = [r for r in row["runs"] if r["seed"] in args.seeds and r["seed"] not in have]
            runs[row["variant"]].extend(new)
            if new:
                reused.add(row["variant"])
        kept.append({"file": str(path), "commit": doc.get("commit"), "command": doc.get("command"), "variants": sorted(reused)})
    if kept:
        meta["kept"] = kept
    done = {(name, r["seed"]) for name, rs in runs.items() for r in rs}
    todo = [(name, args.model, args.steps, s, args.eval_every, args.cut, args.warmup, v)
            for s in args.seeds for name, v in variants.items() if (name, s) not in done]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        for name, run in pool.map(_job, todo):
            runs[name].append(run)
            print(json.dumps({"variant": name, "seed": run["seed"], "final_val_loss": run["final_val_loss"]}), flush=True)
    base = {r["seed"]: r["final_val_loss"] for r in runs["none"]}
    rows, table = [], ["| variant | final val loss, mean | paired vs none | standard error | fewer bytes | per seed |", "|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        rs.sort(key=lambda r: r["seed"])
        d = [100 * (r["final_val_loss"] / base[r["seed"]] - 1) for r in rs]
        sd = statistics.stdev(d) if len(d) > 1 else 0.0
        row = {"variant": name, "codecs": variants[name], "mean_final_val_loss": statistics.mean(r["final_val_loss"] for r in rs),
               "paired_pct": statistics.mean(d), "paired_sd_pct": sd, "paired_se_pct": sd / len(d) ** 0.5, "runs": rs}
        rows.append(row)
        fewer = [r["fewer_bytes"] for r in rs if "fewer_bytes" in r]
        row["fewer_bytes"] = statistics.mean(fewer) if fewer else None
        table.append(f"| {name} | {row['mean_final_val_loss']:.4f} | {row['paired_pct']:+.2f}% ± {sd:.2f}% | {row['paired_se_pct']:.2f}% | "
                     + (f"{row['fewer_bytes']:.1f}x | " if fewer else "- | ")
                     + ", ".join(f"{r['final_val_loss']:.4f}" for r in rs) + " |")
    table += ["", f"{args.model}, {args.steps} steps, batch 8 x 128 in {MICRO_BATCHES} micro-batches, lr 3e-3, {args.warmup} warm-up steps then "
              f"a cosine; seeds {', '.join(map(str, args.seeds))}; cut after block {args.cut}. Validation: the {EVAL_BATCHES} batches "
              "the testbed runs evaluate. Paired: each seed's loss against `none`'s of the same seed (mean ± standard deviation)."]
    for k in kept:
        table.append(f"Runs kept from {k['file']} (commit {k['commit']}): {', '.join(k['variants']) or 'none of them'}.")
    write(args.out, "codecs_one_process", rows, table, meta)
    plot(rows, args.out / "codecs_one_process.png", args)
    return 0


def plot(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, row in enumerate(rows):
        for j, r in enumerate(row["runs"]):
            steps, losses = zip(*r["curve"], strict=True)
            ax.plot(steps, losses, color=f"C{i}", alpha=0.6, lw=1, label=row["variant"] if j == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{args.model} in one process, {len(args.seeds)} seeds a variant")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
