"""Mutual TLS on the control plane (gRPC) and the data plane (TCP): right CA in, anyone else out."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fusionllm.core.errors import ConfigError, TransportError
from fusionllm.core.metrics import read_metrics
from fusionllm.runtime.worker.peers import Inbox
from fusionllm.transport.frames import tensor_frames
from fusionllm.transport.rpc import RpcClient, RpcServer
from fusionllm.transport.stream import DataClient, DataServer
from fusionllm.transport.tls import TLS_NAME, TlsFiles

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make test certificates")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _cert(d: Path, name: str, ca: str) -> TlsFiles:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / "san.ext").write_text(f"subjectAltName=DNS:{TLS_NAME}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial", "-days", "2",
             "-extfile", "san.ext", "-out", f"{name}.pem", cwd=d)
    files = TlsFiles.load(d / f"{name}.pem", d / f"{name}.key", d / f"{ca}.pem")
    assert files is not None
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    return {"server": _cert(d, "server", "ca"), "client": _cert(d, "client", "ca"), "rogue": _cert(d, "rogue", "rogue-ca"), "dir": d}  # type: ignore[dict-item]


def test_grpc_with_mutual_tls(pki: dict) -> None:
    async def main() -> None:
        async def ping(msg: dict) -> dict:
            return {"pong": msg["x"]}

        server = RpcServer("svc", "tok", control={"Ping": ping}, tls=pki["server"])
        port = await server.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        good = RpcClient(address, "svc", "tok", tls=pki["client"])
        assert (await good.call("Ping", {"x": 3}, timeout=10))["pong"] == 3
        for bad in (RpcClient(address, "svc", "tok"), RpcClient(address, "svc", "tok", tls=pki["rogue"])):  # plain text; another CA
            with pytest.raises(TransportError):
                await bad.call("Ping", {"x": 1}, timeout=5)
            await bad.close()
        await good.close()
        await server.stop(0)

    asyncio.run(main())


@pytest.mark.slow  # about 15 s: the make test tier
def test_data_plane_with_mutual_tls(pki: dict) -> None:
    async def main() -> None:
        inbox = Inbox(1 << 20)
        server = DataServer("tok", inbox.receive, max_payload=1 << 20, tls=pki["server"])
        address = f"127.0.0.1:{await server.start('127.0.0.1')}"
        x = np.arange(6, dtype=np.float32)
        header = {"kind": "act", "step": 0, "mb": 0, "edge": "e", "src": 1, "dtype": "float32", "shape": [6], "codec": "raw"}
        good = DataClient(address, "tok", tls=pki["client"])
        await good.push(list(tensor_frames(header, memoryview(x).cast("B"))), timeout=10)
        assert np.array_equal(np.asarray(await inbox.get(("act", 0, 0, "e", 1), 5)), x)
        for bad in (DataClient(address, "tok"), DataClient(address, "tok", tls=pki["rogue"])):
            with pytest.raises(TransportError):
                await bad.push(list(tensor_frames({**header, "mb": 1}, memoryview(x).cast("B"))), timeout=5)
            await bad.close()
        await good.close()
        await server.stop()

    asyncio.run(main())


def test_tls_files_are_checked_up_front(pki: dict, tmp_path: Path) -> None:
    d: Path = pki["dir"]
    with pytest.raises(ConfigError, match="missing --tls-ca"):
        TlsFiles.load(d / "server.pem", d / "server.key", None)
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(ConfigError, match="not a PEM file"):
        TlsFiles.load(tmp_path / "junk.pem", d / "server.key", d / "ca.pem")
    with pytest.raises(ConfigError, match="cannot read"):
        TlsFiles.load(tmp_path / "absent.pem", d / "server.key", d / "ca.pem")
    with pytest.raises(ConfigError, match="--tls-cert / --tls-key"):
        TlsFiles.load(d / "server.pem", d / "client.key", d / "ca.pem")  # a key of another certificate
    assert TlsFiles.load(None, None, None) is None


@pytest.mark.slow  # real processes
def test_a_local_cluster_trains_over_mutual_tls(pki: dict, tmp_path: Path) -> None:
    import sys

    d: Path = pki["dir"]
    out = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:2", "--model", "gpt-nano", "--steps", "3", "--batch-size", "4",
         "--seq-len", "16", "--eval-every", "0", "--metrics", str(out), "--run-dir", str(tmp_path / "run"),
         "--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"), "--tls-ca", str(d / "ca.pem")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(1 for x in out.read_text().splitlines() if '"step"' in x) == 3
    bad = subprocess.run(
        [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:2", "--model", "gpt-nano", "--steps", "1",
         "--tls-cert", str(d / "server.pem"), "--run-dir", str(tmp_path / "run2")],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode != 0 and "missing --tls-key, --tls-ca" in bad.stderr
    assert read_metrics(out).steps  # the run wrote its steps


def test_workers_behind_nat_keep_tls_end_to_end_through_the_relay(pki: dict) -> None:
    """The relay copies bytes: TLS runs between the endpoints, and the run trains as over direct links."""
    from fusionllm.core.config import TrainConfig
    from fusionllm.launch.inprocess import InProcessCluster, cluster_config
    from fusionllm.runtime.reference.single import train_single
    from fusionllm.runtime.reference.verify import TOLERANCE

    train = TrainConfig(model="gpt-nano", steps=2, batch_size=8, seq_len=16, lr=3e-3, warmup=1, eval_every=0, seed=0)
    tls = pki["server"]
    options = [{"listen": "127.0.0.1:0", "tls": tls}, {"listen": "127.0.0.2:0", "tls": tls, "behind_nat": True},
               {"listen": "127.0.0.3:0", "tls": tls, "behind_nat": True}]
    relayed: dict = {}

    async def main() -> list[float]:
        async with InProcessCluster(train, cluster_config(3, tls=tls), worker_options=options) as c:
            result = await c.run()
            relayed["bytes"] = c.coordinator.reach.relay.bytes_relayed()
            relayed["tunnels"] = [w.nat.tunnel is not None for w in c.workers]
        return result.losses

    losses = asyncio.run(main())
    reference = train_single(train).losses
    assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(losses, reference, strict=True)), (losses, reference)
    assert relayed["tunnels"] == [False, True, True] and relayed["bytes"] > 0
