"""The testbed: one network namespace per worker on a bridge, tc htb rate limits, CPU quotas.

Layout (everything named ``fusion-*``):

- bridge ``fusion-br`` in the root namespace, address ``<subnet>.1`` (the coordinator listens there);
- worker i: namespace ``fusion-w<i>``, a veth pair ``fusion-v<i>`` (bridge side) / ``eth0`` (inside),
  address ``<subnet>.<10+i>``; CPU cgroup ``fusion-w<i>`` with the site's quota;
- on each worker's ``eth0``, an htb qdisc with one class per other worker (rate: the link between
  their sites, or the site's own bandwidth) selected by destination address, and an unlimited
  default class for the coordinator. Each direction is shaped by its sender.

``up`` records each namespace, link and cgroup it makes in a state file next to its lock file
(``/run/fusionllm-testbed.json``), as soon as it exists; ``down`` removes what that file lists and
nothing else, so it cleans up after a crashed run (the file outlives it) but leaves alone anything
named ``fusion-*`` that another program, or a person, made.

Latency is not emulated: ``netem`` is not available in this kernel, and delaying inside our own
transport would not delay TCP's acknowledgements, so it would not behave like a real long link.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from fusionllm.cluster.spec import ClusterSpec
from fusionllm.core.logging import get_logger
from fusionllm.testbed import cgroups
from fusionllm.testbed.sh import PREFIX, TestbedError, can_emulate, run

DEFAULT_SUBNET = os.environ.get("FUSIONLLM_TESTBED_SUBNET", "10.213.7")
BRIDGE = f"{PREFIX}-br"
UNLIMITED = "10gbit"
MAX_WORKERS = 240
LOCK = "/run/fusionllm-testbed.lock"
STATE = Path("/run/fusionllm-testbed.json")  # what up() made (and its pid): the only things down() removes
KINDS = ("netns", "links", "cgroups")
log = get_logger("testbed", "testbed")


@dataclass(frozen=True)
class Slot:
    """Where one worker runs."""

    index: int
    site: str
    netns: str | None
    address: str
    cpus: float | None
    cgroup: str | None

    def threads(self) -> int:
        return max(1, math.ceil(self.cpus)) if self.cpus else max(1, (os.cpu_count() or 1))

    def command_prefix(self) -> list[str]:
        """Run a command in this worker's namespace and CPU cgroup."""
        if self.netns is None:
            return []
        join = f'echo $$ > {cgroups.ROOT / self.cgroup / "cgroup.procs"} && exec "$@"' if self.cgroup else 'exec "$@"'
        return ["sh", "-c", join, "sh", "ip", "netns", "exec", self.netns]


class Testbed:
    """``with Testbed(spec) as tb:`` brings the emulated cluster up, and always down."""

    __test__ = False  # not a pytest test class

    def __init__(self, spec: ClusterSpec, *, subnet: str = DEFAULT_SUBNET, emulate: bool | None = None) -> None:
        self.spec = spec
        self.subnet = subnet
        ok, why = can_emulate()
        self.emulated = ok if emulate is None else (emulate and ok)
        self.why_not = "" if self.emulated else (why or "disabled")
        self.slots: list[Slot] = []
        devices = spec.devices()
        if len(devices) > MAX_WORKERS:
            raise TestbedError(f"the testbed emulates at most {MAX_WORKERS} workers (one /24); {spec.name} has {len(devices)}: simulate it instead")
        for d in devices:
            if self.emulated:
                self.slots.append(Slot(d.index, d.site, f"{PREFIX}-w{d.index}", f"{subnet}.{10 + d.index}", d.cpus,
                                       f"{PREFIX}-w{d.index}" if cgroups.available() else None))
            else:
                self.slots.append(Slot(d.index, d.site, None, "127.0.0.1", None, None))

    @property
    def coordinator_host(self) -> str:
        return f"{self.subnet}.1" if self.emulated else "127.0.0.1"

    def worker_launch(self, device: str = "cpu") -> tuple[list[list[str]], list[list[str]]]:
        """(extra `fusionllm worker` flags, command prefix) per worker, for ``run_local_cluster``."""
        args = [["--device", device, "--threads", str(s.threads()), *(["--listen", f"{s.address}:7100"] if self.emulated else [])]
                for s in self.slots]
        return args, [s.command_prefix() for s in self.slots]

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each worker has sent to each other worker so far, as counted by tc (packet headers included)."""
        out: dict[tuple[int, int], int] = {}
        if not self.emulated:
            return out
        for slot in self.slots:
            text = run("ip", "netns", "exec", slot.netns, "tc", "-s", "class", "show", "dev", "eth0")
            cls = None
            for line in text.splitlines():
                words = line.split()
                if words[:2] == ["class", "htb"]:
                    cls = int(words[2].split(":")[1])
                elif words[:1] == ["Sent"] and cls is not None and cls >= 100:
                    out[(slot.index, cls - 100)] = int(words[1])
                    cls = None
        return out

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- up --------------------------------------------------------------------------------------
    def up(self) -> None:
        if not self.emulated:
            log.warning("testbed not emulated (%s): workers run on loopback with no limits", self.why_not)
            return
        self._lock()
        self._made: dict[str, list[str]] = {k: [] for k in KINDS}
        try:
            self._check_subnet()
            down()  # leftovers of a crashed run (the lock says no live testbed owns them)
            self._check_free()
            run("ip", "link", "add", BRIDGE, "type", "bridge")
            self._record("links", BRIDGE)
            run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", BRIDGE)
            run("ip", "link", "set", BRIDGE, "up")
            for slot in self.slots:
                self._add_worker(slot)
            for slot in self.slots:
                self._shape(slot)
                if slot.cgroup:
                    cgroups.create(slot.cgroup, slot.cpus or 1.0)
                    self._record("cgroups", slot.cgroup)
        except BaseException:
            self.down()  # what it made so far, and the lock
            raise

    def _record(self, kind: str, name: str) -> None:
        """Note in the state file that ``name`` exists now (written at once: a crash must not lose it)."""
        self._made[kind].append(name)
        _write_state({"owner": os.getpid(), **self._made})

    def _check_free(self) -> None:
        """Refuse to take over a ``fusion-*`` name that no state file lists: someone else made it."""
        taken = leftovers()
        ours = {"netns": {s.netns for s in self.slots}, "links": {BRIDGE, *(f"{PREFIX}-v{s.index}" for s in self.slots)},
                "cgroups": {s.cgroup for s in self.slots if s.cgroup}}
        clash = {k: sorted(set(taken[k]) & ours[k]) for k in KINDS}
        if any(clash.values()):
            fix = [*(f"ip netns delete {n}" for n in clash["netns"]), *(f"ip link delete {n}" for n in clash["links"]),
                   *(f"rmdir {cgroups.ROOT / n}" for n in clash["cgroups"])]
            names = ", ".join(f"{n} ({k})" for k in KINDS for n in clash[k])
            raise TestbedError(f"{names} already exist and no testbed state file ({STATE}) lists them: another program made them, "
                               f"or a testbed from before state files crashed; if they are leftovers, remove them with: {'; '.join(fix)}")

    def _lock(self) -> None:
        """One testbed per machine: a second would tear down the first's namespaces."""
        import fcntl

        self._lockfile = open(LOCK, "a+")  # noqa: SIM115 - held until down()
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lockfile.seek(0)
            owner = self._lockfile.read().strip() or "?"
            self._lockfile.close()
            self._lockfile = None
            raise TestbedError(f"another testbed is running on this machine (process {owner}); wait for it, or stop it and run `fusionllm testbed down`") from None
        self._lockfile.seek(0)
        self._lockfile.truncate()
        self._lockfile.write(str(os.getpid()))
        self._lockfile.flush()

    def _check_subnet(self) -> None:
        net = ipaddress.ip_network(f"{self.subnet}.0/24")
        for line in run("ip", "-4", "-o", "addr", "show").splitlines():
            parts = line.split()
            if "inet" in parts:
                addr = ipaddress.ip_interface(parts[parts.index("inet") + 1])
                if addr.ip in net and not parts[1].startswith(PREFIX):
                    raise TestbedError(f"subnet {net} is in use on {parts[1]}; set FUSIONLLM_TESTBED_SUBNET to another x.y.z")

    def _add_worker(self, slot: Slot) -> None:
        ns, host, peer = slot.netns, f"{PREFIX}-v{slot.index}", f"{PREFIX}-p{slot.index}"
        run("ip", "netns", "add", ns)
        self._record("netns", ns)
        run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        self._record("links", host)  # the peer goes with it (and with the namespace, once moved there)
        run("ip", "link", "set", peer, "netns", ns)
        run("ip", "link", "set", host, "master", BRIDGE)
        run("ip", "link", "set", host, "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", peer, "name", "eth0")
        run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{slot.address}/24", "dev", "eth0")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def _shape(self, slot: Slot) -> None:
        tc = ["ip", "netns", "exec", slot.netns, "tc"]
        run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "9")
        run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:9", "htb", "rate", UNLIMITED)
        for other in self.slots:
            if other.index == slot.index:
                continue
            bps = self.spec.bandwidth(slot.index, other.index)
            burst = max(16_000, bps // 8 // 250)  # about 4 ms of traffic: exact at low rates, no stalls at high
            cls = f"1:{100 + other.index}"
            run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb",
                "rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", str(burst), "cburst", str(burst))
            run(*tc, "qdisc", "add", "dev", "eth0", "parent", cls, "pfifo", "limit", "1000")
            run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dst", f"{other.address}/32", "flowid", cls)

    def set_link_rate(self, i: int, j: int, bps: int) -> None:
        """Change the rate from worker i to worker j while running (a link that slows down)."""
        set_link_rate(i, j, bps)

    def down(self) -> None:
        lock = getattr(self, "_lockfile", None)
        if lock is None:
            return  # never up (or down already): what the state file lists is another testbed's
        try:
            if self.emulated:
                down()
        finally:
            lock.close()  # releases the flock
            self._lockfile = None


def set_link_rate(i: int, j: int, bps: int) -> None:
    """Change the rate from worker i to worker j of the live testbed (whichever process brought it up)."""
    burst = max(16_000, bps // 8 // 250)
    run("ip", "netns", "exec", f"{PREFIX}-w{i}", "tc", "class", "change", "dev", "eth0", "parent", "1:",
        "classid", f"1:{100 + j}", "htb", "rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", str(burst), "cburst", str(burst))


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
    present = leftovers()
    left = {k: [n for n in state[k] if n in present[k]] for k in KINDS}
    if any(left.values()):
        _write_state({"owner": state["owner"], **left})
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
