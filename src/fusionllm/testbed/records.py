"""What a testbed made, kept in a state file next to the machine's lock, and how it is removed.

``Testbed.up`` records every namespace, link and cgroup as soon as it exists; ``down`` removes what
the file lists and nothing else (also after a crashed run: the file outlives it), killing only the
processes inside those namespaces. ``machine_lock`` keeps two testbeds from one machine at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from fusionllm.core.logging import get_logger
from fusionllm.testbed import cgroups
from fusionllm.testbed.sh import PREFIX, TestbedError, can_emulate, run

log = get_logger("testbed", "testbed")

LOCK = "/run/fusionllm-testbed.lock"
STATE = Path("/run/fusionllm-testbed.json")  # what up() made (and its pid): the only things down() removes
KINDS = ("netns", "links", "cgroups")


@contextlib.contextmanager
def machine_lock(wait: float) -> Iterator[bool]:
    """Hold the testbeds' lock (yields True), or not within ``wait`` seconds (False: another process's
    testbed is up, and the state file is its own: ``down()`` now would tear it down)."""
    import fcntl
    import time

    with open(LOCK, "a+") as f:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(1)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def down() -> dict[str, list[str]]:
    """Remove the namespaces, links and cgroups the state file lists (what an ``up`` made, also one
    that crashed), killing the processes inside those namespaces; never anything else named fusion-*.
    Returns what was removed; the state file stays, listing what could not be, until a later ``down``."""
    removed: dict[str, list[str]] = {k: [] for k in KINDS}
    ok, _ = can_emulate()
    state = _read_state() if ok else None
    if state is None:
        return removed
    present = leftovers()
    for name in state["netns"]:
        if name in present["netns"]:
            _kill_in_netns(name)
            run("ip", "netns", "delete", name, check=False)
            removed["netns"].append(name)
    present = leftovers()  # a veth goes away with its peer's namespace
    for name in state["links"]:
        if name in present["links"]:
            run("ip", "link", "delete", name, check=False)
            removed["links"].append(name)
    removed["cgroups"] = cgroups.remove(state["cgroups"])
    routes = [r for r in state.get("routes", []) if isinstance(r, str)]  # (a state file from before NAT sites has none)
    for net in routes:
        run("ip", "route", "del", "unreachable", net, check=False)
    kept = [r for r in routes if f"unreachable {r}" in run("ip", "route", "show", "type", "unreachable", check=False)]
    present = leftovers()
    left = {k: [n for n in state[k] if n in present[k]] for k in KINDS}
    if any(left.values()) or kept:
        _write_state({"owner": state["owner"], **left, "routes": kept})
        log.warning("testbed down: could not remove %s (still listed in %s)", left, STATE)
    else:
        STATE.unlink(missing_ok=True)
    return removed


def _read_state() -> dict | None:
    """The state file's contents, or None without one."""
    try:
        state = json.loads(STATE.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise TestbedError(f"cannot read the testbed state file {STATE} ({exc}); remove the fusion-* namespaces, links and cgroups "
                           f"it listed by hand (`ip netns list`, `ip link show`, {cgroups.ROOT}), then delete it") from None
    if not isinstance(state, dict) or not all(isinstance(state.get(k), list) for k in KINDS):
        raise TestbedError(f"the testbed state file {STATE} is not a testbed's (expected lists {', '.join(KINDS)}); "
                           f"remove what it names by hand, then delete it")
    return state


def _write_state(state: dict) -> None:
    tmp = STATE.with_name(f".{STATE.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, STATE)  # whole or not at all, even if we die here


def _kill_in_netns(name: str) -> None:
    pids = run("ip", "netns", "pids", name, check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), 9)


def leftovers() -> dict[str, list[str]]:
    """Every namespace, link and cgroup named fusion-* on this machine, whoever made it (for ``down`` and tests)."""
    out: dict[str, list[str]] = {"netns": [], "links": [], "cgroups": []}
    out["netns"] = [ln.split()[0] for ln in run("ip", "netns", "list", check=False).splitlines() if ln.strip().startswith(f"{PREFIX}-")]
    out["links"] = [ln.split(":")[1].strip().split("@")[0] for ln in run("ip", "-o", "link", "show", check=False).splitlines()
                    if ":" in ln and ln.split(":")[1].strip().startswith(f"{PREFIX}-")]
    out["cgroups"] = [p.name for p in cgroups.ROOT.glob(f"{PREFIX}-*")] if cgroups.ROOT.is_dir() else []
    return out
