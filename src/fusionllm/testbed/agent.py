"""The probe agent: serves ``Sink`` and, when asked, measures its own link to another agent.

Behind an emulated NAT (``relay``) it is hosted by the probe's relay, as a worker is by a run's
(``transport/relay.py``), and prints its public address on stdout."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from fusionllm.transport.probe import PROBE_SERVICE, measure, sink
from fusionllm.transport.relay import Tunnel
from fusionllm.transport.rpc import RpcClient, RpcServer


async def _serve(listen: str, token: str, relay: str | None = None) -> None:
    async def measure_to(msg: dict[str, Any]) -> dict[str, Any]:
        client = RpcClient(str(msg["address"]), PROBE_SERVICE, token)
        try:
            return await measure(client, seconds=float(msg.get("seconds", 2.0)))
        finally:
            await client.close()

    async def ping(msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    server = RpcServer(PROBE_SERVICE, token, control={"MeasureTo": measure_to, "Ping": ping}, streams={"Sink": sink}, role="probe")
    port = await server.start(listen)
    tunnel = None
    if relay:
        host = listen.rpartition(":")[0]
        tunnel = Tunnel(relay, token, [f"{host}:{port}"], source=host)
        print((await tunnel.open())[0], flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if tunnel is not None:
        await tunnel.close()
    await server.stop(0)


def run_agent(listen: str, token: str, relay: str | None = None) -> None:
    asyncio.run(_serve(listen, token, relay))
