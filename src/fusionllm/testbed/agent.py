"""The probe agent: serves ``Sink`` and, when asked, measures its own link to another agent."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from fusionllm.transport.probe import PROBE_SERVICE, measure, sink
from fusionllm.transport.rpc import RpcClient, RpcServer


async def _serve(listen: str, token: str) -> None:
    async def measure_to(msg: dict[str, Any]) -> dict[str, Any]:
        client = RpcClient(str(msg["address"]), PROBE_SERVICE, token)
        try:
            return await measure(client, seconds=float(msg.get("seconds", 2.0)))
        finally:
            await client.close()

    async def ping(msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    server = RpcServer(PROBE_SERVICE, token, control={"MeasureTo": measure_to, "Ping": ping}, streams={"Sink": sink}, role="probe")
    await server.start(listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def run_agent(listen: str, token: str) -> None:
    asyncio.run(_serve(listen, token))
