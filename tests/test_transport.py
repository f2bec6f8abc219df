"""Transport: token and protocol checks, version mismatch, framed tensors with size limits."""

import asyncio

import numpy as np
import pytest

from fusionllm.control.membership import Membership
from fusionllm.core.errors import AuthError, FusionError, WireError
from fusionllm.transport import PROTOCOL_VERSION
from fusionllm.transport.auth import load_token, token_matches
from fusionllm.transport.frames import CHUNK, read_tensor, tensor_frames
from fusionllm.transport.messages import pack, unpack
from fusionllm.transport.rpc import RpcClient, RpcServer

TOKEN = "t" * 40


async def _aiter(items):
    for x in items:
        yield x


def test_frames_round_trip_large_tensor_in_chunks() -> None:
    a = np.arange(CHUNK // 4 + 5, dtype=np.float32)  # one chunk and 20 bytes
    frames = list(tensor_frames({"kind": "act", "edge": "n1.0", "dtype": "float32", "shape": [a.size]}, memoryview(a).cast("B")))
    assert len(frames) == 3 and max(len(f) for f in frames[1:]) <= CHUNK
    header, got = asyncio.run(read_tensor(_aiter(frames)))
    assert header["edge"] == "n1.0" and np.array_equal(got, a)


@pytest.mark.parametrize(
    ("header", "chunks", "match"),
    [
        ({"dtype": "float32", "shape": [1 << 40]}, [], "over the limit"),
        ({"dtype": "float32", "shape": [4], "nbytes": 16}, [b"x" * 8], "truncated"),
        ({"dtype": "float32", "shape": [1], "nbytes": 4}, [b"x" * 8], "longer"),
        ({"dtype": "float128", "shape": [1], "nbytes": 16}, [], "unknown dtype"),
        ({"dtype": "float32", "shape": [2], "nbytes": 4}, [], "needs 8"),
        ({"dtype": "float32", "shape": [1], "nbytes": 4, "codec": "zip"}, [], "unknown codec"),
    ],
)
def test_frames_refuse_bad_streams(header: dict, chunks: list[bytes], match: str) -> None:
    frames = [pack({"v": 1, "kind": "act", **header}), *chunks]
    with pytest.raises(WireError, match=match):
        asyncio.run(read_tensor(_aiter(frames), max_payload=1 << 30))


def test_messages_refuse_garbage() -> None:
    with pytest.raises(WireError):
        unpack(b"\xc1\xff\x00")
    with pytest.raises(WireError, match="map"):
        unpack(pack([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="limit"):
        unpack(b"x" * 100, max_bytes=10)


def test_token_file(tmp_path) -> None:
    path = tmp_path / "tok"
    with pytest.raises(FusionError, match="does not exist"):
        load_token(path)
    token = load_token(path, create=True)
    assert len(token) == 64 and (path.stat().st_mode & 0o777) == 0o600 and load_token(path) == token
    assert token_matches(token, token) and not token_matches("x" + token[1:], token) and not token_matches(None, token)
    (tmp_path / "short").write_text("abc")
    with pytest.raises(FusionError, match="fewer than 16"):
        load_token(tmp_path / "short")


def test_rpc_refuses_wrong_token_and_protocol() -> None:
    async def main() -> None:
        async def echo(msg: dict) -> dict:
            return {"echo": msg["x"]}

        server = RpcServer("test.Svc", TOKEN, control={"Echo": echo})
        port = await server.start("127.0.0.1:0")
        try:
            good = RpcClient(f"127.0.0.1:{port}", "test.Svc", TOKEN)
            assert (await good.call("Echo", {"x": 5}))["echo"] == 5
            with pytest.raises(AuthError, match="wrong token"):
                await RpcClient(f"127.0.0.1:{port}", "test.Svc", "u" * 40).call("Echo", {"x": 1})
            with pytest.raises(AuthError, match=f"protocol 99, this side speaks {PROTOCOL_VERSION}"):
                await RpcClient(f"127.0.0.1:{port}", "test.Svc", TOKEN, protocol=99).call("Echo", {"x": 1})
            assert server.refusals == 2
            await good.close()
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_version_mismatch_names_both_versions() -> None:
    import fusionllm

    async def main() -> None:
        m = Membership(1)
        with pytest.raises(AuthError) as info:
            await m.register({"version": "0.0.9", "protocol": 1, "address": "127.0.0.1:1"})
        assert "worker runs fusionllm 0.0.9" in str(info.value) and f"coordinator runs fusionllm {fusionllm.__version__}" in str(info.value)
        assert (await m.register({"version": fusionllm.__version__, "protocol": PROTOCOL_VERSION, "address": "127.0.0.1:1"}))["worker"] == 0
        with pytest.raises(FusionError, match="already has its 1 workers"):
            await m.register({"version": fusionllm.__version__, "protocol": PROTOCOL_VERSION, "address": "127.0.0.1:2"})

    asyncio.run(main())


def test_a_worker_refuses_the_coordinator_process_it_left_for_a_newer_one() -> None:
    """A coordinator cut off (not dead) while a restarted one took its workers over must not drive
    them: every coordinator call carries its process's incarnation, and a worker refuses one it left.
    Why it can fail: the incarnation not sent, the fence not consulted, or a worker that refuses the
    new coordinator's calls made before its registration's answer is back (an incarnation not seen yet)."""
    from fusionllm.transport.control import Registered
    from tests.test_worker_components import a_link

    link, _ = a_link()
    link._joined(Registered(0, "aaaa"))
    assert link.fence("aaaa") is None and link.fence("bbbb") is None  # the one it follows; one it is registering with
    link._joined(Registered(0, "bbbb"))  # the coordinator restarted: it registered with the new process

    async def main() -> None:
        async def echo(msg: dict) -> dict:
            return {"echo": msg["x"]}

        server = RpcServer("test.Svc", TOKEN, control={"Echo": echo}, fence=link.fence)
        port = await server.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        try:
            with pytest.raises(AuthError, match="left coordinator process aaaa for a newer one"):
                await RpcClient(address, "test.Svc", TOKEN, incarnation="aaaa").call("Echo", {"x": 1})
            for incarnation in ("bbbb", "cccc", ""):  # the newest, one not seen yet, a peer worker (no incarnation)
                assert (await RpcClient(address, "test.Svc", TOKEN, incarnation=incarnation).call("Echo", {"x": 2}))["echo"] == 2
            assert server.refusals == 1
        finally:
            await server.stop(0)

    asyncio.run(main())
