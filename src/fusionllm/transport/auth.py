"""The shared secret every call presents, and the check every server makes."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fusionllm.core.errors import ConfigError

TOKEN_KEY = "x-fusionllm-token"
PROTOCOL_KEY = "x-fusionllm-protocol"
INCARNATION_KEY = "x-fusionllm-incarnation"  # the calling coordinator process (RpcClient, RpcServer.fence)


def load_token(path: str | Path, *, create: bool = False) -> str:
    """Read the token file; with ``create``, write a new random one (mode 600) when absent."""
    path = Path(path)
    if not path.exists():
        if not create:
            raise ConfigError(f"token file {path} does not exist; copy the coordinator's token file here")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
    token = path.read_text().strip()
    if len(token) < 16:
        raise ConfigError(f"token file {path} holds fewer than 16 characters; use a long random secret")
    return token


def token_matches(presented: str | bytes | None, expected: str) -> bool:
    """Constant-time comparison."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode()
    return hmac.compare_digest(presented, expected.encode())
