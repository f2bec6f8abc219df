"""Running the kernel's own tools (ip, tc) with errors that say what failed."""

from __future__ import annotations

import os
import shutil
import subprocess

from fusionllm.core.errors import FusionError

PREFIX = "fusion"


class TestbedError(FusionError):
    """The testbed could not be set up or taken down."""

    __test__ = False


def run(*cmd: str, check: bool = True, stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, input=stdin)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def can_emulate() -> tuple[bool, str]:
    """Whether this process can build a testbed, and if not, why."""
    if os.environ.get("FUSIONLLM_TESTBED", "").lower() == "off":
        return False, "FUSIONLLM_TESTBED=off"
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not root (network namespaces and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed (Debian: apt-get install iproute2)"
    return True, ""


def can_nat() -> tuple[bool, str]:
    """Whether this process can emulate NAT sites (a testbed, plus nftables for the routers' masquerade)."""
    ok, why = can_emulate()
    if not ok:
        return ok, why
    if shutil.which("nft") is None:
        return False, "`nft` is not installed: NAT sites need nftables (Debian: apt-get install nftables; `make test` installs it as root)"
    return True, ""
