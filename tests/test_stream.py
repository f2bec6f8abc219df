"""The tensor data plane: authenticated TCP, pipelined messages, hostile input refused, server kept up."""

from __future__ import annotations

import asyncio
import os
import random
import struct

import numpy as np
import pytest

from fusionllm.core.errors import AuthError, TransportError, WireError
from fusionllm.runtime.worker.peers import Inbox
from fusionllm.transport.frames import tensor_frames
from fusionllm.transport.messages import pack
from fusionllm.transport.stream import MAGIC, DataClient, DataServer


def _frames(key: int, array: np.ndarray) -> list[bytes]:
    header = {"kind": "act", "step": 0, "mb": key, "edge": "e", "src": 1, "dtype": "float32", "shape": list(array.shape), "codec": "raw"}
    return list(tensor_frames(header, memoryview(array).cast("B")))


async def _serve(token: str = "secret", max_payload: int = 1 << 26) -> tuple[DataServer, Inbox, str]:
    inbox = Inbox(max_payload)
    server = DataServer(token, inbox.receive, max_payload=max_payload)
    port = await server.start("127.0.0.1")
    return server, inbox, f"127.0.0.1:{port}"


def test_pipelined_pushes_arrive_intact_and_in_order() -> None:
    async def main() -> None:
        server, inbox, address = await _serve()
        client = DataClient(address, "secret")
        arrays = [np.random.default_rng(i).standard_normal((i + 1, 300_000 if i == 2 else 7)).astype(np.float32) for i in range(6)]
        await asyncio.gather(*(client.push(_frames(i, a), timeout=10) for i, a in enumerate(arrays)))
        for i, a in enumerate(arrays):
            got = await inbox.get(("act", 0, i, "e", 1), timeout=5)
            assert np.array_equal(got, a)
        await client.close()
        await server.stop()

    asyncio.run(main())


@pytest.mark.parametrize(("token", "protocol", "reason"), [("wrong", None, "wrong token"), ("secret", 999, "protocol 999")])
def test_wrong_token_or_protocol_is_refused_and_logged(token: str, protocol: int | None, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server, inbox, address = await _serve()
        client = DataClient(address, token, **({"protocol": protocol} if protocol else {}))
        with pytest.raises(AuthError, match=reason):
            await client.push(_frames(0, np.ones(3, np.float32)), timeout=5)
        assert server.refusals == 1
        good = DataClient(address, "secret")  # the server keeps serving
        await good.push(_frames(1, np.ones(3, np.float32)), timeout=5)
        await good.close()
        await server.stop()

    with caplog.at_level("WARNING"):
        asyncio.run(main())
    assert any("refused data connection" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_token_never_crosses_the_wire() -> None:
    async def main() -> None:
        seen = bytearray()

        async def spy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(MAGIC + struct.pack("<H", 1) + os.urandom(16))
            await writer.drain()
            seen.extend(await reader.read(1000))
            writer.close()

        srv = await asyncio.start_server(spy, "127.0.0.1", 0)
        client = DataClient(f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", "a-very-secret-token")
        with pytest.raises(TransportError):  # the spy hangs up on every try: the push tries again until its deadline
            await client.push(_frames(0, np.ones(2, np.float32)), timeout=1)
        srv.close()
        assert seen and b"a-very-secret-token" not in seen

    asyncio.run(main())


@pytest.mark.parametrize("garbage", [
    b"",
    random.Random(7).randbytes(7),  # seeded: every pytest process (xdist) collects the same tests
    random.Random(4096).randbytes(4096),
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
])
def test_garbage_connections_do_not_stop_the_server(garbage: bytes) -> None:
    async def main() -> None:
        server, inbox, address = await _serve()
        host, _, port = address.rpartition(":")
        _, w = await asyncio.open_connection(host, int(port))
        w.write(garbage)
        await w.drain()
        w.close()
        client = DataClient(address, "secret")
        await client.push(_frames(0, np.arange(5, dtype=np.float32)), timeout=5)
        assert np.array_equal(await inbox.get(("act", 0, 0, "e", 1), 5), np.arange(5, dtype=np.float32))
        await client.close()
        await server.stop()

    asyncio.run(main())


def test_hostile_messages_after_admission_are_refused_without_allocating() -> None:
    async def main() -> None:
        server, inbox, address = await _serve(max_payload=1 << 20)
        huge = pack({"v": 1, "kind": "act", "step": 0, "mb": 0, "edge": "e", "src": 1, "dtype": "float32", "shape": [1 << 38], "codec": "raw", "nbytes": 1 << 40})
        for head, body, match in [
            (huge, b"", "payload bytes"),
            (b"\x00" * 70_000, b"", "header of"),
            (pack({"v": 1, "kind": "act", "step": 0, "mb": 1, "edge": "e", "src": 1, "dtype": "nope", "shape": [2], "codec": "raw", "nbytes": 8}), b"\x00" * 8, "dtype"),
        ]:
            client = DataClient(address, "secret")
            with pytest.raises(WireError, match=match):
                await client.push([head, body] if body else [head], timeout=5)
            await client.close()
        client = DataClient(address, "secret")  # still serving, and nothing was filed
        await client.push(_frames(2, np.ones(4, np.float32)), timeout=5)
        assert (await inbox.get(("act", 0, 2, "e", 1), 5)).shape == (4,)
        await client.close()
        await server.stop()

    asyncio.run(main())


def test_unreachable_data_port_is_a_transport_error() -> None:
    async def main() -> None:
        server, _, address = await _serve()
        await server.stop()
        with pytest.raises(TransportError, match="cannot reach"):
            await DataClient(address, "secret").push(_frames(0, np.ones(1, np.float32)), timeout=2)

    asyncio.run(main())


@pytest.mark.parametrize("case", ["truncated header", "unhashable key"])
def test_what_the_fuzzer_found_is_refused_in_one_line(case: str) -> None:
    """Found by experiments/fuzz_decoders.py's data-plane target: a connection that ends inside a tensor
    header, and a header whose edge is a list (an unhashable inbox key), made the server log a
    traceback ("tensor handler failed") instead of refusing the message."""

    class Writer:
        statuses: list[int] = []

        def write(self, data: bytes) -> None:
            self.statuses.append(data[0])

        async def drain(self) -> None:
            return None

    async def main() -> tuple[list[int], list[str]]:
        inbox = Inbox(1 << 20)
        server = DataServer("t", inbox.receive, max_payload=1 << 20)
        crashed: list[str] = []
        server.log.exception = lambda msg, *a: crashed.append(msg)  # type: ignore[method-assign]
        a = np.arange(4, dtype=np.float32)
        edge: object = [1, 2] if case == "unhashable key" else "e"
        frames = list(tensor_frames({"kind": "act", "step": 0, "mb": 0, "edge": edge, "src": 1, "dtype": "float32", "shape": [4], "codec": "raw"},
                                    a.tobytes()))
        data = struct.pack("<I", len(frames[0])) + b"".join(frames)
        reader = asyncio.StreamReader()
        reader.feed_data(data[:10] if case == "truncated header" else data)
        reader.feed_eof()
        writer = Writer()
        assert not await server._one(reader, writer, "test")  # the connection is closed
        return writer.statuses, crashed

    statuses, crashed = asyncio.run(main())
    assert statuses == [1] and crashed == []
