"""Second peer baseline: data-parallel training of a fusionllm GPT with hivemind (``hivemind.Optimizer``).

One process per device; every process holds the whole model. Run with the interpreter of the
hivemind virtual environment (``benchmarks/.hivemind-venv``, made by ``python benchmarks/e2e.py
--make-hivemind-venv``; hivemind 1.1.12 needs numpy < 2.4, which the project's ``.venv`` does not
pin)::

    benchmarks/.hivemind-venv/bin/python benchmarks/peer_hivemind.py --rank R --world W \
        --address 127.0.0.1 --peers-file /tmp/hm.peers --run-id RUN --model gpt-micro --steps 30 \
        --batch-size 16 --seq-len 128 --lr 3e-3 --seed 0 --warmup 20 --metrics hm.jsonl \
        [--average-every 8] [--compression fp16|uint8|none] [--eval-every K --eval-batches E]

Rank 0 starts the DHT (its p2pd listens on ``/ip4/ADDRESS/tcp/0``) and writes its visible multiaddrs
to ``--peers-file``; the other ranks wait for that file and join. All ranks then meet in the DHT
(every rank stores a key; each waits until it sees all ``W``) before the clock starts.

Fairness against ``peer_pipelining.py`` and fusionllm (same model, data, batch, schedule):

* Same model and weights: ``build_model(name, vocab, seed=seed)`` on every rank.
* Same data and the same batch per step: global step ``s`` uses ``Batcher(train, B, T, seed).get(s)``,
  the batch every other system trains on at step ``s``, split row-wise into ``W`` near-equal shards
  (``torch.tensor_split``); rank ``r`` trains on shard ``r``. So one step of the whole swarm consumes
  exactly the tokens one step of the pipeline consumes, and tokens/s are comparable (the other fair
  choice, each peer a whole batch of ``B``, would give the swarm ``W`` times the tokens per step).
* Optimizer: ``make_adamw`` (AdamW, weight decay 0.1 on matrices), the lr of ``lr_at(step, ...)``
  set on the inner optimizer before every local step, gradient clipping at 1.0 on the local
  gradient. ``hivemind.Optimizer(use_local_updates=True)``: every ``step`` applies the local AdamW
  update at once (no gradient averaging), and when the swarm has processed ``target_batch_size``
  samples, which is ``--average-every`` global steps (``average_every * B``), the peers average
  their parameters (delta rule, in the background: ``delay_state_averaging=True``), compressed with
  ``--compression`` (``Float16Compression`` / ``Uniform8BitQuantization``). AdamW's moments stay
  local (``average_opt_statistics=()``). A peer that falls an epoch behind downloads the state of
  another (hivemind's own resynchronisation) and that step's local update is dropped; counted as
  ``resyncs``.
* Loss: ``lm_loss`` on the peer's shard. The merged record (``merge``) gives the row-weighted
  mean over peers, which for one set of weights is the full batch's per-token mean.
* Validation: at the same steps, every peer evaluates its own (local) model on the same ``E``
  held-out batches as the other systems (``Batcher(val, B, T, seed).iter_eval(E)``); the merged
  ``val_loss`` is the mean over peers (``val_loss_peers`` lists each). Evaluation time is excluded
  from each peer's clock.
* Timing: each peer's ``elapsed_s`` starts when all ``W`` peers are in the DHT (after the model,
  DHT and optimizer are built). The merged step ``s`` is done when the last peer has done its step
  ``s``: ``elapsed_s`` is the maximum over peers.
* Threads: ``torch.set_num_threads(--threads)``. hivemind's own processes (p2pd, the DHT and
  averager processes) run in the same namespace and CPU cgroup as the trainer.

Output: every rank writes one JSON line per step to ``METRICS.rankR`` (``step``, ``loss``,
``rows``, ``tokens``, ``elapsed_s``, ``lr``, ``grad_norm``, ``epoch``, ``val_loss`` at eval steps) and a last
line ``{"event": "done", ...}`` with the counts of averaging rounds (``averaged``: "Averaged
parameters with N peers" per round, ``failed``) and resyncs. ``merge(metrics, world)`` (also
``--merge``: no hivemind needed) writes ``METRICS`` in the shape ``peer_pipelining.py`` writes.

Measured (2-core VM, hivemind 1.1.12, numpy 2.3.5, torch 2.13.0+cpu; the venv takes about 100 s to
make): ``python benchmarks/e2e.py --clusters three-sites --systems peer hivemind`` (gpt-micro,
16 x 128, 120 steps): peer 3063 tokens/s (median step; 2849 from the mean step), final val 2.475;
hivemind (average every 8 steps, fp16) 8762 tokens/s from the median step but 2742 from the mean:
every averaging round stalls the peers 2-5 s (matchmaking and the all-reduce on 0.4-0.6 cores, the
slow site C behind 8 Mbit/s), final val 2.473, time to target 87 s against the peer's 86 s, 204 MB
sent against the peer's 1209 MB. With ``--compression uint8``: 1527 tokens/s (mean step; the
quantisation costs CPU), 139 MB; averaging every 16 steps: one round found no group and stalled
about ``--averaging-timeout`` (60 s), val 2.563. The median hides the stalls; compare the mean.
Startup (imports, p2pd, DHT, barrier) takes 10-30 s and is not on the clock.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path


class PeerError(Exception):
    """A configuration or runtime problem reported as one line on stderr."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--address", default="127.0.0.1", help="this peer's IPv4 address (p2pd listens there)")
    p.add_argument("--peers-file", default=None, help="rank 0 writes its multiaddrs here; the others read them")
    p.add_argument("--run-id", default="fusionllm-hivemind")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other peers")
    p.add_argument("--model", default="gpt-micro")
    p.add_argument("--data", default=None, help="corpus spec (default: the stdlib corpus)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch, split over the peers")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=1, help="ignored (accepted for a common command line)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--average-every", type=int, default=8, help="global steps between parameter averaging rounds")
    p.add_argument("--compression", default="fp16", choices=("none", "fp16", "uint8"), help="for state averaging")
    p.add_argument("--matchmaking-time", type=float, default=3.0)
    p.add_argument("--averaging-timeout", type=float, default=60.0)
    p.add_argument("--metrics", default=None, help="each rank writes METRICS.rankR")
    p.add_argument("--merge", action="store_true", help="only merge METRICS.rank0..W-1 into METRICS")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    if a.world < 1 or not 0 <= a.rank < a.world:
        raise PeerError(f"need 0 <= --rank < --world, got rank {a.rank}, world {a.world}")
    for name in ("steps", "batch_size", "seq_len", "threads", "eval_batches", "average_every"):
        if getattr(a, name) < 1:
            raise PeerError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.batch_size < a.world:
        raise PeerError(f"--batch-size {a.batch_size} gives some of the {a.world} peers no rows")
    if a.world > 1 and not a.peers_file:
        raise PeerError("--peers-file is needed with more than one peer")


def compression(name: str):
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    return {"none": NoCompression, "fp16": Float16Compression, "uint8": Uniform8BitQuantization}[name]()


class _Counter(logging.Handler):
    """Counts hivemind's own reports of state-averaging rounds (its ``verbose`` INFO lines)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.averaged: list[int] = []
        self.failed = 0
        self.resyncs = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if m := re.match(r"Averaged parameters with (\d+) peers", msg):
            self.averaged.append(int(m.group(1)))
        elif msg.startswith("Averaging failed"):
            self.failed += 1
        elif msg.startswith("Peer is out of sync"):
            self.resyncs += 1


def _note(a: argparse.Namespace, what: str) -> None:
    print(f"peer_hivemind: rank {a.rank}: {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def start_dht(a: argparse.Namespace):
    import hivemind

    host = [f"/ip4/{a.address}/tcp/0"]
    if a.rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=host)
        if a.peers_file:
            tmp = Path(f"{a.peers_file}.tmp")
            tmp.write_text("\n".join(str(m) for m in dht.get_visible_maddrs()))
            os.replace(tmp, a.peers_file)
        return dht
    deadline = time.monotonic() + a.timeout
    while not Path(a.peers_file).exists():
        if time.monotonic() > deadline:
            raise PeerError(f"rank 0 wrote no multiaddrs to {a.peers_file} within {a.timeout:.0f} s")
        time.sleep(0.1)
    initial = Path(a.peers_file).read_text().split()
    return hivemind.DHT(start=True, host_maddrs=host, initial_peers=initial)


def dht_barrier(dht, key: str, rank: int, world: int, timeout: float) -> None:
    """Store ``rank`` under ``key`` and wait until all ``world`` ranks have."""
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + timeout
    stored = False
    while True:
        if not stored:
            stored = bool(dht.store(key, True, get_dht_time() + 3600, subkey=rank))
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if stored and seen >= world:
            return
        if time.monotonic() > deadline:
            raise PeerError(f"only {seen} of {world} peers reached {key!r} within {timeout:.0f} s")
        time.sleep(0.2)


def run(a: argparse.Namespace) -> None:
    import hivemind
    import torch

    from fusionllm.core.metrics import JsonlWriter
    from fusionllm.data import Batcher, ByteTokenizer, load_corpus
    from fusionllm.models.loss import lm_loss
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.stage.optim import lr_at, make_adamw

    torch.set_num_threads(a.threads)
    counter = _Counter()
    logging.getLogger("hivemind.optim.optimizer").addHandler(counter)
    logging.getLogger("hivemind.optim.state_averager").addHandler(counter)

    tokenizer = ByteTokenizer()
    train_tokens, val_tokens = load_corpus(a.data).split(0.1)
    train_batches = Batcher(train_tokens, a.batch_size, a.seq_len, a.seed)
    val_batches = Batcher(val_tokens, a.batch_size, a.seq_len, a.seed)
    if a.eval_every and (len(val_tokens) - 1) // a.seq_len < a.eval_batches * a.batch_size:
        raise PeerError("validation split too small for --eval-batches full batches; lower it")
    model = build_model(a.model, tokenizer.vocab_size, seed=a.seed)
    rows = len(torch.tensor_split(torch.arange(a.batch_size), a.world)[a.rank])

    dht = start_dht(a)
    inner = make_adamw(model.named_parameters(), a.lr, a.weight_decay)
    opt = hivemind.Optimizer(
        dht=dht, run_id=a.run_id, optimizer=inner, use_local_updates=True,
        target_batch_size=a.average_every * a.batch_size, batch_size_per_step=rows,
        state_averaging_compression=compression(a.compression), load_state_compression=compression(a.compression),
        matchmaking_time=a.matchmaking_time, averaging_timeout=a.averaging_timeout, average_state_every=1,
        verbose=True,
    )
    if opt.state_averager.optimizer is not inner:
        raise PeerError("hivemind wrapped a copy of the AdamW optimizer; the lr schedule would not reach it")

    def evaluate() -> float:
        model.eval()
        values = []
        with torch.no_grad():
            for x, y in val_batches.iter_eval(a.eval_batches):
                values.append(float(lm_loss(model(x), y)))
        model.train()
        return sum(values) / len(values)

    metrics_path = f"{a.metrics}.rank{a.rank}" if a.metrics else None
    _note(a, "DHT and optimizer up")
    dht_barrier(dht, f"{a.run_id}_start", a.rank, a.world, a.timeout)
    paused = 0.0
    started = time.perf_counter()
    with JsonlWriter(metrics_path) as metrics:
        for step in range(a.steps):
            model.train()
            lr = lr_at(step, lr=a.lr, steps=a.steps, warmup=a.warmup)
            for group in inner.param_groups:
                group["lr"] = lr
            x, y = train_batches.get(step)
            x, y = torch.tensor_split(x, a.world)[a.rank], torch.tensor_split(y, a.world)[a.rank]
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip if a.grad_clip > 0 else float("inf")))
            opt.step()
            elapsed = time.perf_counter() - started - paused
            record = {"step": step, "loss": float(loss.detach()), "rows": rows, "tokens": x.numel(), "elapsed_s": round(elapsed, 4),
                      "lr": lr, "grad_norm": norm, "epoch": opt.local_epoch}
            if a.eval_every and ((step + 1) % a.eval_every == 0 or step == a.steps - 1):
                t0 = time.perf_counter()
                record["val_loss"] = evaluate()
                paused += time.perf_counter() - t0
            metrics.write(record)
            if a.verbose:
                print(f"rank {a.rank}: {record}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - started - paused
        epoch = opt.local_epoch
        # Leave the swarm at once (a finished peer no longer steps, so it could not join another averaging round:
        # the others would wait averaging_timeout for it), but keep the DHT up until every peer is done.
        opt.shutdown()
        metrics.write({"event": "done", "rank": a.rank, "wall_s": round(wall, 4), "averaged": counter.averaged,
                       "failed": counter.failed, "resyncs": counter.resyncs, "epoch": epoch})
        dht_barrier(dht, f"{a.run_id}_done", a.rank, a.world, max(a.timeout, 900.0))
    _note(a, "all peers done")
    dht.shutdown()
    _note(a, "DHT shut down")


def merge(metrics: str | Path, world: int) -> list[dict]:
    """Merge ``METRICS.rank0..`` into ``METRICS`` in ``peer_pipelining.py``'s shape (one line per global step)."""
    per = []
    for r in range(world):
        lines = [json.loads(x) for x in Path(f"{metrics}.rank{r}").read_text().splitlines() if x.strip()]
        per.append(lines)
    steps = [[x for x in lines if "step" in x] for lines in per]
    done = [next((x for x in lines if x.get("event") == "done"), None) for lines in per]
    n = min(len(s) for s in steps)
    out, tokens = [], 0
    for i in range(n):
        recs = [s[i] for s in steps]
        rows = sum(x["rows"] for x in recs)
        elapsed = max(x["elapsed_s"] for x in recs)
        tokens += sum(x["tokens"] for x in recs)
        rec = {"step": i, "loss": sum(x["loss"] * x["rows"] for x in recs) / rows, "elapsed_s": elapsed, "tokens": tokens,
               "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1), "lr": recs[0]["lr"], "grad_norm": max(x["grad_norm"] for x in recs), "epochs": [x["epoch"] for x in recs],
               "elapsed_peers": [x["elapsed_s"] for x in recs]}
        if all("val_loss" in x for x in recs):
            rec["val_loss"] = sum(x["val_loss"] for x in recs) / len(recs)
            rec["val_loss_peers"] = [round(x["val_loss"], 4) for x in recs]
        out.append(rec)
    summary = {"event": "hivemind", "world": world, "peers": [d for d in done if d is not None]}
    with Path(metrics).open("w") as f:
        f.write(json.dumps(summary) + "\n")
        for rec in out:
            f.write(json.dumps(rec) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        merge(a.metrics, a.world)
        return 0
    try:
        check_args(a)
        _note(a, "started")
        run(a)
    except (Exception, KeyboardInterrupt) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"peer_hivemind: rank {a.rank}: {type(exc).__name__}: {msg[:500]}", file=sys.stderr)
        return 1
    _note(a, "exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
