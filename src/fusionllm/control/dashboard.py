"""The live dashboard: a small read-only HTTP server for the page and its JSON, inside the coordinator.

``GET /`` is the page (``web/index.html``, no external scripts: machines may be offline); ``GET
/api/status`` is ``RunStatus.to_json()``. Nothing else is served; requests are read within 8 KiB and
only GET is answered. The page shows addresses and the plan, not weights or the token; bind it to
127.0.0.1 (the default) unless the people on that network may see the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from importlib import resources

from fusionllm.control.status import RunStatus
from fusionllm.core.errors import ConfigError
from fusionllm.core.logging import get_logger

MAX_REQUEST = 8 << 10
log = get_logger("control", "dashboard")


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--dashboard {text!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


class Dashboard:
    def __init__(self, status: RunStatus) -> None:
        self.status = status
        self.page = resources.files("fusionllm.control").joinpath("web/index.html").read_bytes()
        self._server: asyncio.Server | None = None

    async def start(self, address: str) -> int:
        host, port = parse_address(address)
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST)
        except OSError as exc:
            raise ConfigError(f"--dashboard {address}: cannot listen there ({exc.strerror})") from None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "GET":
                await self._reply(writer, 405, "text/plain", b"only GET")
            elif path == "/" or path.startswith("/?"):
                await self._reply(writer, 200, "text/html; charset=utf-8", self.page)
            elif path == "/api/status":
                await self._reply(writer, 200, "application/json", json.dumps(self.status.to_json()).encode())
            else:
                await self._reply(writer, 404, "text/plain", b"not found")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, code: int, kind: str, body: bytes) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[code]
        writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                     "Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
