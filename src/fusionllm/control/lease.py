"""One coordinator per checkpoint directory at a time.

A coordinator started with ``--checkpoint-dir`` holds an exclusive lock on
``<checkpoint-dir>/coordinator.lock`` (``flock``) for as long as it runs, with its PID and address
in the file. A second coordinator for the same directory (an old one that was not dead after all,
or the same command started twice) is refused with one line naming the first, before it listens or
touches a checkpoint. The operating system drops the lock when the process ends however it ends, so
a killed coordinator is replaced as before. The lock is local to one machine's file system (a
directory shared over the network may not honour it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from fusionllm.core.errors import ConfigError

LOCK_NAME = "coordinator.lock"


class Lease:
    def __init__(self, directory: str | Path, *, address: str = "") -> None:
        self.path = Path(directory) / LOCK_NAME
        self.address = address
        self._fd: int | None = None

    def take(self) -> Lease:
        """Hold the directory, or raise ``ConfigError`` naming the coordinator that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"another coordinator ({holder}) is running with --checkpoint-dir {self.path.parent}: stop it first "
                              "(a coordinator that was killed frees the directory by itself), or give this run another --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"PID {os.getpid()}{' on ' + self.address if self.address else ''}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
