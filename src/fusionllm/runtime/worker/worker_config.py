"""What a worker is started with (``WorkerConfig``) and who it is while it runs (``Identity``).

Both are read by every part of the worker (the coordinator link, NAT, worlds, the handlers), so
they live here, below all of them: the parts import this module, never each other's.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from fusionllm.core.logging import get_logger
from fusionllm.runtime.stage.faults import Fault
from fusionllm.transport.tls import TlsFiles


@dataclass(frozen=True)
class WorkerConfig:
    join: str
    token: str
    device: str = "cpu"
    threads: int | None = None
    listen: str = "127.0.0.1:0"
    data_port: int = 0  # the TCP port of the tensor data plane (0: any free port)
    advertise: str | None = None
    coordinator_timeout: float = 120.0  # seconds to wait, holding the stage, for a coordinator that went away (restarted) to answer again
    join_timeout: float = 120.0
    heartbeat_s: float = 2.0
    max_payload: int = 8 << 30
    rank: int | None = None
    probe_seconds: float = 1.0  # the device probe (achieved matmul FLOP/s) when joining
    backend: str = "torch"  # torch | numpy: the framework that runs the stage
    tls: TlsFiles | None = None  # mutual TLS on every connection (transport/tls.py)
    handle_signals: bool = True  # SIGINT/SIGTERM stop the worker; False where it shares a process (harness.py)
    faults: tuple[Fault, ...] = ()  # tests only: tensors this worker corrupts on purpose (--inject-fault, runtime/stage/faults.py)
    behind_nat: bool = False  # nobody can connect to it: be hosted by a relay without trying (runtime/worker/nat_link.py)
    relay: bool = False  # a reachable worker that relays for workers behind NAT
    relay_port: int = 0
    reduce_overlap: bool = True  # the world's all-reduce overlapped with the backward (False: the plain path, experiments/reduce_overlap.py)


def listen_host(config: WorkerConfig) -> str:
    """The host of ``--listen`` ("" when it listens on all hosts)."""
    host = config.listen.rpartition(":")[0].strip("[]")
    return "" if host in ("0.0.0.0", "::") else host


def advertise_host(config: WorkerConfig) -> str:
    """The host other processes reach this worker at: ``--advertise``, the ``--listen`` host, or the
    address this machine uses towards the coordinator (a UDP connect sends nothing)."""
    if config.advertise:
        return config.advertise
    host = listen_host(config)
    if host:
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((config.join.rpartition(":")[0], 1))
        return s.getsockname()[0]


@dataclass
class Identity:
    """Who this worker is: its id from the coordinator (None before it registered) and the addresses it
    is reached at (behind NAT: its relay's ports). Its log lines carry the id."""

    address: str = ""
    data_address: str = ""
    id: int | None = None
    log: logging.LoggerAdapter = field(default_factory=lambda: get_logger("worker", "worker"))

    def named(self, worker: int) -> None:
        """The coordinator gave this worker the id ``worker``."""
        self.id = worker
        self.log = get_logger("worker", f"worker {worker}")
