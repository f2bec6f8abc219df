#!/usr/bin/env python
"""`fusionllm data prepare` throughput on a large corpus, and what a training step then reads.

Writes ``--gigabytes`` of text into a temporary directory (the embedded corpus, the Python standard
library's source, copied with each copy's lines shuffled by its seed, in 16 MB files), trains a
byte-level BPE on the first 64 MB (`fusionllm tokenizer train`'s function), then prepares the whole
corpus with the byte tokenizer and with the BPE (``data.prepare.prepare``: batch encoding on every
core, shards written as they fill). Reported: MB/s of text in, tokens out, shard bytes. Then the
cost of a training batch from the memory-mapped shards (``Batcher.arrays`` on the ``TokenStream``):
no tokenisation per step, only the windows' gather.

Writes data_prepare.json and data_prepare.md (and data_prepare.png).

    python experiments/data_prepare.py --gigabytes 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.common import pyplot, results_dir, write  # noqa: E402

FILE_BYTES = 16 << 20


def make_corpus(root: Path, total: int) -> int:
    from fusionllm.data.corpus import load_corpus

    lines = load_corpus(None).tokens.tobytes().split(b"\n")
    written, i = 0, 0
    while written < total:
        rng = random.Random(i)
        chunk, size = [], 0
        while size < FILE_BYTES:
            line = lines[rng.randrange(len(lines))]
            chunk.append(line)
            size += len(line) + 1
        data = b"\n".join(chunk)
        (root / f"part-{i:04d}.txt").write_bytes(data)
        written += len(data)
        i += 1
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=results_dir("data_prepare"))
    ap.add_argument("--gigabytes", type=float, default=1.0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    from fusionllm.data.batching import Batcher
    from fusionllm.data.bpe import train_bpe
    from fusionllm.data.prepare import prepare
    from fusionllm.data.shards import open_prepared

    rows = []
    with tempfile.TemporaryDirectory(prefix="fusionllm-prepare-") as d:
        tmp = Path(d)
        (tmp / "corpus").mkdir()
        t0 = time.perf_counter()
        nbytes = make_corpus(tmp / "corpus", int(args.gigabytes * 1e9))
        print(f"corpus: {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        files = sorted((tmp / "corpus").glob("*.txt"))
        tok = train_bpe((f.read_text(errors="replace") for f in files[:4]), args.vocab_size)
        tok.save(tmp / "tok.json")
        train_s = time.perf_counter() - t0
        print(f"BPE {tok.vocab_size} tokens trained on {4 * FILE_BYTES / 1e6:.0f} MB in {train_s:.1f} s", flush=True)
        for name, spec in (("bytes", None), (f"BPE {tok.vocab_size}", str(tmp / "tok.json"))):
            out = tmp / f"shards-{name.split()[0]}"
            t0 = time.perf_counter()
            m = prepare(spec, str(tmp / "corpus"), out,
                        progress=lambda p, name=name: p.get("done") or print(f"  {name}: {p['bytes'] / 1e6:,.0f} MB, {p['bytes'] / 1e6 / p['seconds']:.1f} MB/s", flush=True))
            seconds = time.perf_counter() - t0
            shard_bytes = sum((out / s["file"]).stat().st_size for s in m["shards"])
            train, _ = open_prepared(out).split()
            batcher = Batcher(train, args.batch_size, args.seq_len, 0)
            t1 = time.perf_counter()
            for step in range(200):
                batcher.arrays(step)
            batch_ms = (time.perf_counter() - t1) / 200 * 1e3
            rows.append({"tokenizer": name, "text_bytes": m["bytes"], "documents": m["documents"], "tokens": m["tokens"], "seconds": seconds,
                         "mb_per_s": m["bytes"] / 1e6 / seconds, "shards": len(m["shards"]), "shard_bytes": shard_bytes, "dtype": m["dtype"],
                         "batch_ms": batch_ms, "bpe_train_s": train_s if spec else None})
            print(f"{name}: {m['bytes'] / 1e6:,.0f} MB -> {m['tokens']:,} tokens in {seconds:.0f} s ({rows[-1]['mb_per_s']:.1f} MB/s); "
                  f"a {args.batch_size}x{args.seq_len} batch from the shards: {batch_ms:.2f} ms", flush=True)
    table = [f"{nbytes / 1e9:.2f} GB of text in {len(files)} files of 16 MB (the embedded corpus's lines, shuffled per file); "
             f"{os.cpu_count()} cores. The BPE was trained on the first 64 MB in {train_s:.1f} s. Batch: {args.batch_size} x {args.seq_len} "
             "tokens drawn from the memory-mapped training shards (mean of 200 steps).", "",
             "| tokenizer | text | tokens | bytes / token | seconds | MB/s | shards | shard bytes | a batch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['tokenizer']} | {r['text_bytes'] / 1e6:,.0f} MB | {r['tokens']:,} | {r['text_bytes'] / r['tokens']:.2f} | {r['seconds']:.0f} | "
                     f"{r['mb_per_s']:.1f} | {r['shards']} | {r['shard_bytes'] / 1e6:,.0f} MB ({r['dtype']}) | {r['batch_ms']:.2f} ms |")
    write(args.out, "data_prepare", rows, table, {"args": {k: str(v) for k, v in vars(args).items()}})
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([r["tokenizer"] for r in rows], [r["mb_per_s"] for r in rows])
    ax.set_ylabel("MB of text per second")
    ax.set_title(f"data prepare, {nbytes / 1e9:.1f} GB")
    fig.tight_layout()
    fig.savefig(args.out / "data_prepare.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
