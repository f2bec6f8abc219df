#!/usr/bin/env python
"""Every decoder that reads bytes from another process or a user's file, under mutation fuzzing.

Each target starts from valid inputs (made here by the matching encoder) and decodes seeded
mutations of them: bit flips, byte overwrites with boundary values, truncation, extension,
duplicated and deleted spans, splices of two seeds, and random bytes. A decoder may accept an input
or refuse it with a ``FusionError`` (the project's one-line errors); any other exception is a crash.
One input in ``--sample`` is decoded under ``tracemalloc``: its peak allocation must stay under the
target's budget (the limit the decoder is given, plus the input's own size, times a small slack).

Targets: tensor messages (``compress.wire.decode_array``), compressed payloads (``codecs.decode``
for raw, fp16, bf16, quant, hq, eq (dithered too), klt, kltr and topk), msgpack control messages (``messages.unpack`` then the
typed ``Message.from_wire`` of several messages), the data plane's stream after the handshake
(``DataServer._one`` reading messages into a worker's ``Inbox``: sizes, tensor headers, frames,
``read_tensor``, the inbox's checks), cluster files (``cluster.spec.parse_cluster``) and OpGraph
JSON (``OpGraph.from_json``).

Writes fuzz_decoders.json and fuzz_decoders.md (and a PNG of inputs per target).

    python experiments/fuzz_decoders.py --inputs 1000000 --seed 0
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.common import pyplot, results_dir, write  # noqa: E402

BOUNDARY = (0x00, 0x01, 0x7F, 0x80, 0xFF)
MAX_PAYLOAD = 1 << 20  # the limit handed to decoders that take one: a budget the allocation check can use


def mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.choice((1, 1, 1, 2, 4, 8))):
        op = rng.randrange(8)
        if op == 0 and data:  # flip a bit
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # a boundary byte
            data[rng.randrange(len(data))] = rng.choice(BOUNDARY)
        elif op == 2 and data:  # truncate
            del data[rng.randrange(len(data)) :]
        elif op == 3:  # extend
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif op == 4 and len(data) > 2:  # duplicate a span
            a = rng.randrange(len(data))
            b = min(len(data), a + rng.randrange(1, 32))
            data[a:a] = data[a:b]
        elif op == 5 and len(data) > 2:  # delete a span
            a = rng.randrange(len(data))
            del data[a : a + rng.randrange(1, 32)]
        elif op == 6:  # splice another seed
            other = rng.choice(seeds)
            cut = rng.randrange(len(data) + 1)
            data = data[:cut] + other[rng.randrange(len(other) + 1) :]
        elif op == 7 and data:  # a little-endian integer at a random place
            i = rng.randrange(len(data))
            value = rng.choice((0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1))
            data[i : i + 8] = value.to_bytes(8, "little")
    if rng.random() < 0.02:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    return bytes(data)


def targets() -> dict[str, tuple[list[bytes], Callable[[bytes], object], int]]:
    """name -> (valid seeds, decode, allocation budget in bytes beyond 16x the input)."""
    import numpy as np

    from fusionllm.cluster.spec import parse_cluster
    from fusionllm.compress.codecs import decode, encode, parse_codec
    from fusionllm.compress.wire import decode_array, encode_array
    from fusionllm.graph.ir import OpGraph
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.backends.model_graph import trace_lm
    from fusionllm.transport import control
    from fusionllm.transport.messages import pack, unpack

    rng = np.random.default_rng(0)
    out: dict[str, tuple[list[bytes], Callable[[bytes], object], int]] = {}

    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((4,), (3, 5), (2, 3, 4))] + [np.arange(6, dtype=np.int64).reshape(2, 3)]
    out["tensor message"] = ([encode_array(a) for a in arrays],
                             lambda b: decode_array(b, max_payload=MAX_PAYLOAD), MAX_PAYLOAD)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    from fusionllm.compress.subspace import Subspace

    sub = Subspace()
    sub.learn((rng.standard_normal((64, 3)) @ rng.standard_normal((3, 16))).astype(np.float32))  # klt's basis: 3 directions
    for codec in ("none", "fp16", "bf16", "q8", "q4", "hq4", "hq3-sr", "hq2", "eq:0.7", "eqd:0.7", "klt:0.25", "kltr:0.5", "topk:0.1"):
        tag, payload = encode(x, parse_codec(codec), basis=sub.basis)
        shape = x.shape

        def run(b: bytes, tag: str = tag, shape: tuple = shape) -> object:
            return decode(tag, b, shape)

        out[f"codec {codec}"] = ([payload], run, 64 * x.nbytes)
    cnn = rng.standard_normal((3, 5, 2, 2)).astype(np.float32)  # a CNN's small planes: scaled per channel over the batch
    for codec in ("q4", "eq:0.7"):
        tag, payload = encode(cnn, parse_codec(codec))

        def run_cnn(b: bytes, tag: str = tag) -> object:
            return decode(tag, b, cnn.shape)

        out[f"codec {codec} (N, C, 2, 2)"] = ([payload], run_cnn, 64 * cnn.nbytes)
    messages = [control.Heartbeat(worker=1, address="10.0.0.1:7000"), control.Step(step=3, lr=0.1, ratios={"1": 0.5}),
                control.StepDone(losses={"0": 1.5}, grad_norm=0.3, bytes_to={"1": 10}),
                control.Hyper(lr=0.01), control.Failure(worker=1, index=2, action="F0", error="x")]
    kinds = {type(m).__name__: type(m) for m in messages}

    def run_message(b: bytes) -> object:
        raw = unpack(b, max_bytes=MAX_PAYLOAD)
        for cls in kinds.values():
            try:
                cls.from_wire(raw)
            except Exception as exc:  # noqa: BLE001 (classified by the caller: a FusionError is a refusal)
                from fusionllm.core.errors import FusionError

                if not isinstance(exc, FusionError):
                    raise
        return raw

    out["control messages"] = ([pack(m.to_wire()) for m in messages], run_message, MAX_PAYLOAD)
    out["data-plane stream"] = data_plane_target(arrays)
    out["relay request"] = relay_target()
    cluster = (ROOT / "examples" / "clusters" / "three-sites.toml").read_text().encode()
    out["cluster file"] = ([cluster], lambda b: parse_cluster(b.decode("utf-8", errors="strict")), 1 << 20)
    graph = trace_lm(build_model("gpt-nano", device="meta"), 2, 8, spec="gpt-nano").to_json().encode()
    out["OpGraph JSON"] = ([graph], lambda b: OpGraph.from_json(b), 1 << 22)
    return out


class _Writer:
    """The server's side of a connection, write-only: statuses are counted, not sent."""

    def __init__(self) -> None:
        self.refused = False

    def write(self, data: bytes) -> None:
        self.refused = self.refused or data[:1] != b"\x00"  # a status: 0 filed, 1 refused (then the connection closes)

    async def drain(self) -> None:
        return None


class _Log:
    """A DataServer's logger: refusals are expected (quiet); ``exception`` means a handler crashed."""

    def __init__(self) -> None:
        self.crashed: str | None = None

    def warning(self, *_: object) -> None:
        return None

    def info(self, *_: object) -> None:
        return None

    def exception(self, msg: str, *args: object) -> None:
        import sys

        self.crashed = f"{msg % args if args else msg}: {sys.exc_info()[0].__name__}: {sys.exc_info()[1]}"


def data_plane_target(arrays: list) -> tuple[list[bytes], Callable[[bytes], object], int]:
    """What a worker's data port reads after the handshake: messages of a u32 header size, a msgpack
    tensor header and its payload, read by ``DataServer._one`` and filed by the worker's ``Inbox``
    (``frames.read_tensor`` inside). Every message of the input is read until the server would
    close the connection."""
    import asyncio
    import struct

    from fusionllm.runtime.worker.peers import Inbox
    from fusionllm.transport.frames import tensor_frames
    from fusionllm.transport.stream import DataServer

    def message(header: dict, a: object) -> bytes:
        import numpy as np

        arr = np.ascontiguousarray(a)
        frames = list(tensor_frames({**header, "dtype": arr.dtype.name, "shape": list(arr.shape), "codec": "raw", "epoch": 0}, arr.tobytes()))
        return struct.pack("<I", len(frames[0])) + b"".join(frames)

    seeds = []
    for i, a in enumerate(arrays):
        head = {"kind": ("act", "grad", "reduce", "norm")[i % 4], "step": i, "mb": 0, "edge": f"e{i}", "src": 1, "attempt": 0, "msg": f"{i:016x}"}
        seeds.append(message(head, a) + message({**head, "mb": 1}, a))
    loop = asyncio.new_event_loop()

    def run(b: bytes) -> object:
        async def go() -> int:
            inbox = Inbox(MAX_PAYLOAD)
            server = DataServer("fuzz", inbox.receive, max_payload=MAX_PAYLOAD)
            server.log = _Log()  # type: ignore[assignment]
            reader = asyncio.StreamReader()
            reader.feed_data(b)
            reader.feed_eof()
            n, writer = 0, _Writer()
            try:
                while await server._one(reader, writer, "fuzz"):  # noqa: SLF001 (the server's own message loop, minus the socket)
                    n += 1
            except asyncio.IncompleteReadError as exc:  # the connection ends inside a message: the server closes it
                from fusionllm.core.errors import WireError

                raise WireError(f"connection ended inside a message ({len(exc.partial)} bytes)") from None
            if server.log.crashed:
                raise RuntimeError(f"the tensor handler crashed: {server.log.crashed}")
            if writer.refused:
                from fusionllm.core.errors import WireError

                raise WireError("refused (the server answered status 1 and closed the connection)")
            return n

        return loop.run_until_complete(go())

    return seeds, run, 4 * MAX_PAYLOAD


def relay_target() -> tuple[list[bytes], Callable[[bytes], object], int]:
    """What a relay reads after the handshake: a u32 size and a msgpack request (``relay.read_msg``,
    ``relay.parse_request``)."""
    import asyncio
    import struct

    from fusionllm.transport.messages import pack
    from fusionllm.transport.relay import parse_request, read_msg

    seeds = [struct.pack("<I", len(b)) + b for b in (pack({"op": "host", "services": 2}), pack({"op": "join", "session": "ab" * 16}))]
    loop = asyncio.new_event_loop()

    def run(b: bytes) -> object:
        async def go() -> object:
            reader = asyncio.StreamReader()
            reader.feed_data(b)
            reader.feed_eof()
            try:
                return parse_request(await read_msg(reader))
            except asyncio.IncompleteReadError as exc:
                from fusionllm.core.errors import WireError

                raise WireError(f"connection ended inside a request ({len(exc.partial)} bytes)") from None

        return loop.run_until_complete(go())

    return seeds, run, 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=results_dir("fuzz_decoders"))
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs in total, shared by the targets by their speed budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=200, help="one input in this many is decoded under tracemalloc")
    args = ap.parse_args()
    from fusionllm.core.errors import FusionError

    tg = targets()
    per = args.inputs // len(tg)
    rows = []
    for name, (seeds, run, budget) in tg.items():
        rng = random.Random(f"{args.seed}:{name}")
        counts = {"accepted": 0, "refused": 0, "crashed": 0, "over_budget": 0}
        crashes: dict[str, str] = {}
        peak_max = 0
        started = time.perf_counter()
        for i in range(per):
            data = mutate(rng, seeds)
            traced = i % args.sample == 0
            if traced:
                tracemalloc.start()
            try:
                run(data)
                counts["accepted"] += 1
            except (FusionError, UnicodeDecodeError) as exc:  # a cluster file must be UTF-8: the CLI reads it as text first
                counts["refused"] += 1
                del exc
            except Exception as exc:  # noqa: BLE001 (a crash: recorded with its input)
                counts["crashed"] += 1
                key = f"{type(exc).__name__}: {str(exc)[:80]}"
                if key not in crashes:
                    crashes[key] = data[:200].hex() + " | " + traceback.format_exc(limit=3).splitlines()[-2].strip()
            finally:
                if traced:
                    _, peak = tracemalloc.get_traced_memory()
                    tracemalloc.stop()
                    peak_max = max(peak_max, peak)
                    if peak > budget + 16 * len(data) + (1 << 16):
                        counts["over_budget"] += 1
        seconds = time.perf_counter() - started
        rows.append({"target": name, "inputs": per, **counts, "seconds": seconds, "inputs_per_s": per / seconds, "peak_alloc": peak_max,
                     "budget": budget, "crashes": crashes})
        print(f"{name}: {per:,} inputs in {seconds:.0f} s, {counts}", flush=True)
    total = sum(r["inputs"] for r in rows)
    table = [f"{total:,} mutated inputs in all (seed {args.seed}); one in {args.sample} decoded under tracemalloc. Refused: a FusionError "
             "(one line); crashed: any other exception; over budget: a traced decode that allocated more than its limit plus 16x its "
             "input.", "",
             "| target | inputs | accepted | refused | crashed | over budget | inputs/s | largest traced allocation |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['target']} | {r['inputs']:,} | {r['accepted']:,} | {r['refused']:,} | {r['crashed']:,} | {r['over_budget']} | "
                     f"{r['inputs_per_s']:,.0f} | {r['peak_alloc'] / 1024:,.0f} KiB |")
    crashed = [(r["target"], k, v) for r in rows for k, v in r["crashes"].items()]
    if crashed:
        table += ["", "Crashes (first input of each kind, hex, and where):", ""] + [f"- {t}: `{k}` at {v.split(' | ')[1]}" for t, k, v in crashed]
    write(args.out, "fuzz_decoders", rows, table, {"args": {k: str(v) for k, v in vars(args).items()}})
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["target"] for r in rows], [r["refused"] for r in rows], label="refused")
    ax.barh([r["target"] for r in rows], [r["accepted"] for r in rows], left=[r["refused"] for r in rows], label="accepted")
    ax.set_xlabel("inputs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "fuzz_decoders.png", dpi=120)
    return 1 if crashed or any(r["over_budget"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
