"""Relays: a worker nobody can reach is served through connections it opened; tensors keep their MAC end to end."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from fusionllm.core.errors import AuthError, TransportError, WireError
from fusionllm.runtime.worker.peers import Inbox
from fusionllm.transport.frames import tensor_frames
from fusionllm.transport.relay import Relay, Tunnel
from fusionllm.transport.rpc import RpcClient, RpcServer
from fusionllm.transport.stream import DataClient, DataServer

TOKEN = "relay-test-token-0123456789"


def _frames(mb: int, array: np.ndarray) -> list[bytes]:
    header = {"kind": "act", "step": 0, "mb": mb, "edge": "e", "src": 1, "dtype": "float32", "shape": list(array.shape), "codec": "raw"}
    return list(tensor_frames(header, memoryview(array).cast("B")))


async def _hosted_data_server() -> tuple[DataServer, Inbox, Relay, Tunnel]:
    inbox = Inbox(1 << 26)
    server = DataServer(TOKEN, inbox.receive, max_payload=1 << 26)
    port = await server.start("127.0.0.1")
    relay = Relay(TOKEN)
    rport = await relay.start("127.0.0.1")
    tunnel = Tunnel(f"127.0.0.1:{rport}", TOKEN, [f"127.0.0.1:{port}"])
    await tunnel.open()
    return server, inbox, relay, tunnel


def test_tensors_reach_a_hosted_worker_through_the_relay_with_their_mac() -> None:
    async def main() -> None:
        server, inbox, relay, tunnel = await _hosted_data_server()
        client = DataClient(tunnel.addresses[0], TOKEN, mac=True)
        arrays = [np.random.default_rng(i).standard_normal((i + 1, 200_000 if i == 1 else 5)).astype(np.float32) for i in range(4)]
        await asyncio.gather(*(client.push(_frames(i, a), timeout=20) for i, a in enumerate(arrays)))
        for i, a in enumerate(arrays):
            assert np.array_equal(await inbox.get(("act", 0, i, "e", 1), timeout=5), a)
        assert relay.bytes_relayed() > sum(a.nbytes for a in arrays)  # it went through the relay
        assert tunnel.sessions == 1
        await client.close()
        await tunnel.close()
        await relay.stop()
        await server.stop()

    asyncio.run(main())


async def _tampering_proxy(target: str, flip_at: int) -> tuple[asyncio.Server, str]:
    """A man in the middle that flips one byte of what the client sends, ``flip_at`` bytes after the handshake."""
    host, _, port = target.rpartition(":")

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(host, int(port))

        async def up() -> None:
            seen = 0
            with contextlib.suppress(Exception):
                while data := await r.read(1 << 16):
                    buf = bytearray(data)
                    at = flip_at + 4 + 2 + 1 + 32 - seen  # after the client's handshake reply
                    if 0 <= at < len(buf):
                        buf[at] ^= 0x40
                    seen += len(data)
                    uw.write(bytes(buf))
                    await uw.drain()
            uw.close()

        async def down() -> None:
            with contextlib.suppress(Exception):
                while data := await ur.read(1 << 16):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(up(), down())

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("mac", [True, False])
def test_a_changed_tensor_is_refused_when_it_carries_a_mac(mac: bool) -> None:
    """With the MAC a flipped payload byte is refused before it is filed; without it (the control) the
    tampered tensor is filed as it arrived: the check is what catches it."""
    async def main() -> None:
        inbox = Inbox(1 << 26)
        server = DataServer(TOKEN, inbox.receive, max_payload=1 << 26)
        port = await server.start("127.0.0.1")
        proxy, address = await _tampering_proxy(f"127.0.0.1:{port}", flip_at=4000)
        array = np.arange(4096, dtype=np.float32)
        client = DataClient(address, TOKEN, mac=mac)
        if mac:
            with pytest.raises((WireError, TransportError), match="MAC"):
                await client.push(_frames(0, array), timeout=5)
            with pytest.raises(TimeoutError):  # nothing was filed
                await inbox.get(("act", 0, 0, "e", 1), timeout=0.5)
        else:
            await client.push(_frames(0, array), timeout=5)
            got = await inbox.get(("act", 0, 0, "e", 1), timeout=5)
            assert not np.array_equal(got, array)
        await client.close()
        proxy.close()
        await server.stop()

    asyncio.run(main())


def test_control_calls_reach_a_hosted_worker_and_a_wrong_token_is_refused() -> None:
    async def main() -> None:
        async def ping(msg: dict) -> dict:
            return {"pong": msg.get("n")}

        server = RpcServer("test.Svc", TOKEN, control={"Ping": ping})
        port = await server.start("127.0.0.1:0")
        relay = Relay(TOKEN)
        rport = await relay.start("127.0.0.1")
        tunnel = Tunnel(f"127.0.0.1:{rport}", TOKEN, [f"127.0.0.1:{port}"])
        await tunnel.open()
        client = RpcClient(tunnel.addresses[0], "test.Svc", TOKEN)
        assert (await client.call("Ping", {"n": 7}, timeout=10))["pong"] == 7
        with pytest.raises(AuthError, match="wrong token"):
            await Tunnel(f"127.0.0.1:{rport}", "another-token-0123456789", ["127.0.0.1:1"]).open()
        assert relay.refusals == 1
        await client.close()
        await tunnel.close()
        await relay.stop()
        await server.stop(0)

    asyncio.run(main())


def test_a_relay_that_dies_ends_the_tunnel_and_its_ports() -> None:
    async def main() -> None:
        server, _inbox, relay, tunnel = await _hosted_data_server()
        address = tunnel.addresses[0]
        await relay.stop()
        await asyncio.wait_for(tunnel.lost.wait(), 10)
        with pytest.raises(TransportError, match="refused"):
            await DataClient(address, TOKEN).push(_frames(0, np.ones(3, np.float32)), timeout=2)
        await tunnel.close()
        await server.stop()

    asyncio.run(main())


@pytest.mark.parametrize("kernel", [True, False])
def test_raw_bytes_cross_the_relay_whole_both_ways_with_half_close(kernel: bool) -> None:
    """Why it can fail: bytes the relay had buffered before the splice (the peer speaks first) lost
    or sent twice, a handshake byte left in a write buffer, an EOF not passed on (the other side
    waits forever), or one direction's end closing the other direction early."""
    from fusionllm.transport import zerocopy

    if kernel and not zerocopy.available():
        pytest.skip("os.splice is Linux only")
    rng = np.random.default_rng(7)
    request, reply = rng.bytes(3_000_001), rng.bytes(5_000_003)

    async def main() -> None:
        got: list[bytes] = []

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            got.append(await r.read())  # until the peer's EOF ...
            w.write(reply)  # ... and then the answer: the connection is half open meanwhile
            await w.drain()
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        relay = Relay(TOKEN, kernel_copy=kernel)  # off: the Python copy, as experiments/relay_copy.py compares
        tunnel = Tunnel(f"127.0.0.1:{await relay.start('127.0.0.1')}", TOKEN, [f"127.0.0.1:{server.sockets[0].getsockname()[1]}"], kernel_copy=kernel)
        await tunnel.open()
        before = zerocopy.bridged
        host, _, port = tunnel.addresses[0].rpartition(":")
        r, w = await asyncio.open_connection(host, int(port))
        w.write(request)  # at once: the relay holds these while the worker joins the session
        w.write_eof()
        back = await asyncio.wait_for(r.read(), 60)
        w.close()
        assert got == [request] and back == reply
        assert relay.bytes_relayed() >= len(request) + len(reply)
        assert zerocopy.bridged - before == (2 if kernel else 0)  # the relay's end and the worker's end
        await tunnel.close()
        await relay.stop()
        server.close()

    asyncio.run(main())
