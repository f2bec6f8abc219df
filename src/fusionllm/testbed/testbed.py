"""The testbed: one network namespace per worker on a bridge, tc htb rate limits, CPU quotas.

Layout (everything named ``fusion-*``):

- bridge ``fusion-br`` in the root namespace, address ``<subnet>.1`` (the coordinator listens there);
- worker i: namespace ``fusion-w<i>``, a veth pair ``fusion-v<i>`` (bridge side) / ``eth0`` (inside),
  address ``<subnet>.<10+i>``; CPU cgroup ``fusion-w<i>`` with the site's quota;
- on each worker's ``eth0``, an htb qdisc with one class per other worker (rate: the link between
  their sites, or the site's own bandwidth) selected by destination address, and an unlimited
  default class for the coordinator. Each direction is shaped by its sender.

A site with ``nat = true`` (NAT site k, k = 0, 1, ... in file order) sits behind a router:

- namespace ``fusion-r<k>``: an outside veth ``fusion-o<k>`` (bridge side) / ``wan`` at ``<subnet>.<240+k>``
  (worker addresses stop at ``<subnet>.239``: at most 230 workers, 10 NAT sites), and an inside bridge
  ``lan`` at ``<nat>.<k>.1/24`` (``<nat>`` is ``FUSIONLLM_TESTBED_NAT_SUBNET``, default ``10.214``);
- the site's workers: their veth's bridge side ``fusion-v<i>`` is moved into ``fusion-r<k>`` and joins
  ``lan``; ``eth0`` has the private address ``<nat>.<k>.<10+i>`` and a default route via ``<nat>.<k>.1``;
- the router forwards, masquerades what leaves through ``wan`` (nftables), and forwards from ``wan``
  only what belongs to a connection a worker opened. Nothing else has a route to ``<nat>.<k>.0/24``, so
  the root namespace and the other workers reach a NATed worker only through a connection it opened;
- shaping: the router's ``wan`` and ``lan`` each send at the site's ``uplink`` (coordinator traffic
  unlimited, as on the workers); a NATed worker's ``eth0`` has classes for its own site's workers
  (their private addresses) and for every reachable worker; a reachable worker's ``eth0`` has a class
  ``1:<50+k>`` for router k's outside address at the link between the two sites, so traffic a relay
  sends into the NAT site is shaped too. Workers of two different NAT sites cannot reach each other.

``up`` records each namespace (routers' too), link and cgroup it makes in a state file next to its lock file
(``/run/fusionllm-testbed.json``), as soon as it exists; ``down`` removes what that file lists and
nothing else, so it cleans up after a crashed run (the file outlives it) but leaves alone anything
named ``fusion-*`` that another program, or a person, made.

Latency (``latency`` on sites and links) is emulated by a delaying TCP forwarder in each worker's
namespace that has links with a latency (``delay.py``: an nftables rule redirects the connections the
worker opens to those peers; every chunk waits its link's one-way latency, each way). ``netem`` is not
in this kernel. Without ``nft`` the testbed warns once and latency is simulated only.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass

from fusionllm.cluster.spec import ClusterSpec
from fusionllm.core.logging import get_logger
from fusionllm.testbed import cgroups, delay
from fusionllm.testbed.records import (  # noqa: F401 (imported from here)
    KINDS,
    LOCK,
    STATE,
    _read_state,
    _write_state,
    down,
    leftovers,
    machine_lock,
)
from fusionllm.testbed.sh import PREFIX, TestbedError, can_emulate, can_nat, run

DEFAULT_SUBNET = os.environ.get("FUSIONLLM_TESTBED_SUBNET", "10.213.7")
DEFAULT_NAT_SUBNET = os.environ.get("FUSIONLLM_TESTBED_NAT_SUBNET", "10.214")  # NAT site k: <this>.<k>.0/24
BRIDGE = f"{PREFIX}-br"
UNLIMITED = "10gbit"
MAX_WORKERS = 230  # worker i at <subnet>.<10 + i>: .10 to .239
ROUTER_BASE = 240  # NAT site k's router at <subnet>.<240 + k>: .240 to .249
MAX_NAT_SITES = 10
ROUTER_CLASS = 50  # htb class 1:<50 + k> on a reachable worker's eth0: traffic to NAT site k's router
NFT_RULES = """table ip fusion_nat {
  chain masq { type nat hook postrouting priority srcnat; oifname "wan" masquerade; }
  chain inbound { type filter hook forward priority filter; iifname "wan" ct state established,related accept; iifname "wan" drop; }
}
"""  # in the router's own namespace (its own ruleset; it goes with the namespace)
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
    nat: bool = False  # behind its site's emulated NAT: ``address`` is private, reachable from its own site only
    public: str | None = None  # where its connections come from, seen from outside: the router's address if NATed, else ``address``

    def threads(self) -> int:
        return max(1, math.ceil(self.cpus)) if self.cpus else max(1, (os.cpu_count() or 1))

    def command_prefix(self) -> list[str]:
        """Run a command in this worker's namespace and CPU cgroup."""
        if self.netns is None:
            return []
        join = f'echo $$ > {cgroups.ROOT / self.cgroup / "cgroup.procs"} && exec "$@"' if self.cgroup else 'exec "$@"'
        return ["sh", "-c", join, "sh", "ip", "netns", "exec", self.netns]


@dataclass(frozen=True)
class Router:
    """NAT site ``index``'s router: namespace ``netns``, ``public`` on the bridge, ``<private>.1`` inside."""

    index: int
    site: str
    netns: str
    public: str  # its outside address, on the testbed subnet
    private: str  # the site's private /24, as "a.b.c"
    uplink_bps: int

    @property
    def gateway(self) -> str:
        return f"{self.private}.1"


class Testbed:
    """``with Testbed(spec) as tb:`` brings the emulated cluster up, and always down."""

    __test__ = False  # not a pytest test class

    def __init__(self, spec: ClusterSpec, *, subnet: str = DEFAULT_SUBNET, nat_subnet: str = DEFAULT_NAT_SUBNET,
                 emulate: bool | None = None) -> None:
        self.spec = spec
        self.subnet = subnet
        ok, why = can_emulate()
        self.emulated = ok if emulate is None else (emulate and ok)
        self.why_not = "" if self.emulated else (why or "disabled")
        self.slots: list[Slot] = []
        devices = spec.devices()
        if len(devices) > MAX_WORKERS:
            raise TestbedError(f"the testbed emulates at most {MAX_WORKERS} workers (one /24); {spec.name} has {len(devices)}: simulate it instead")
        self.nat_subnet = nat_subnet
        self.routers: dict[str, Router] = self._routers() if self.emulated else {}
        for d in devices:
            if self.emulated:
                r = self.routers.get(d.site)
                address = f"{r.private if r else subnet}.{10 + d.index}"
                self.slots.append(Slot(d.index, d.site, f"{PREFIX}-w{d.index}", address, d.cpus,
                                       f"{PREFIX}-w{d.index}" if cgroups.available() else None,
                                       nat=r is not None, public=r.public if r else address))
            else:
                self.slots.append(Slot(d.index, d.site, None, "127.0.0.1", None, None, public="127.0.0.1"))

    def _routers(self) -> dict[str, Router]:
        """One router per NAT site, if this machine can make them (a one-line error naming what is missing)."""
        names = self.spec.nat_sites()
        if not names:
            return {}
        ok, why = can_nat()
        if not ok:
            raise TestbedError(f"cluster {self.spec.name} has NAT sites ({', '.join(names)}) but {why}")
        if len(names) > MAX_NAT_SITES:
            raise TestbedError(f"the testbed emulates at most {MAX_NAT_SITES} NAT sites; {self.spec.name} has {len(names)}: simulate it instead")
        try:
            private = ipaddress.ip_network(f"{self.nat_subnet}.0.0/16")
        except ValueError:
            raise TestbedError(f"NAT subnet {self.nat_subnet!r} is not two numbers a.b; set FUSIONLLM_TESTBED_NAT_SUBNET to one such as 10.214") from None
        if private.overlaps(ipaddress.ip_network(f"{self.subnet}.0/24")):
            raise TestbedError(f"NAT subnet {private} holds the testbed subnet {self.subnet}.0/24; set FUSIONLLM_TESTBED_NAT_SUBNET to another a.b")
        return {name: Router(k, name, f"{PREFIX}-r{k}", f"{self.subnet}.{ROUTER_BASE + k}", f"{self.nat_subnet}.{k}", self.spec.uplink_bps(name))
                for k, name in enumerate(names)}

    def rate(self, i: int, j: int) -> int:
        """Bit/s the testbed lets worker i send to worker j: their link, capped by the uplink of a NAT site it crosses."""
        bps = self.spec.bandwidth(i, j)
        a, b = self.spec.site_of(i), self.spec.site_of(j)
        if a is not b:
            for site in (a, b):
                if site.nat:
                    bps = min(bps, self.spec.uplink_bps(site.name))
        return bps

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
        self._made: dict[str, list[str]] = {k: [] for k in (*KINDS, "routes")}
        try:
            self._check_subnet()
            down()  # leftovers of a crashed run (the lock says no live testbed owns them)
            self._check_free()
            run("ip", "link", "add", BRIDGE, "type", "bridge")
            self._record("links", BRIDGE)
            run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", BRIDGE)
            run("ip", "link", "set", BRIDGE, "up")
            for router in self.routers.values():
                self._add_router(router)
                # nothing outside routes to a NAT site's private addresses (as on the internet): refused at once
                # here, instead of leaving through this machine's default route
                run("ip", "route", "add", "unreachable", f"{router.private}.0/24")
                self._record("routes", f"{router.private}.0/24")
            for slot in self.slots:
                self._add_worker(slot)
            for router in self.routers.values():
                self._shape_router(router)
            for slot in self.slots:
                self._shape(slot)
                if slot.cgroup:
                    cgroups.create(slot.cgroup, slot.cpus or 1.0)
                    self._record("cgroups", slot.cgroup)
            # latency: a forwarder per namespace with delayed links, stopped by PID in down() (and killed with its namespace)
            self._delays = delay.start(self.spec, {s.index: s.netns for s in self.slots}, {s.index: s.address for s in self.slots})
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
        ours = {"netns": {s.netns for s in self.slots} | {r.netns for r in self.routers.values()},
                "links": {BRIDGE, *(f"{PREFIX}-v{s.index}" for s in self.slots), *(f"{PREFIX}-o{r.index}" for r in self.routers.values())},
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
        nets = {ipaddress.ip_network(f"{self.subnet}.0/24"): "FUSIONLLM_TESTBED_SUBNET to another x.y.z"}
        nets |= {ipaddress.ip_network(f"{r.private}.0/24"): "FUSIONLLM_TESTBED_NAT_SUBNET to another x.y" for r in self.routers.values()}
        for line in run("ip", "-4", "-o", "addr", "show").splitlines():
            parts = line.split()
            if "inet" in parts:
                addr = ipaddress.ip_interface(parts[parts.index("inet") + 1])
                for net, fix in nets.items():
                    if addr.ip in net and not parts[1].startswith(PREFIX):
                        raise TestbedError(f"subnet {net} is in use on {parts[1]}; set {fix}")

    def _add_router(self, r: Router) -> None:
        """NAT site ``r``'s router: ``wan`` on the bridge, ``lan`` (a bridge) for the site's workers, masquerade."""
        ns, host, peer = r.netns, f"{PREFIX}-o{r.index}", f"{PREFIX}-q{r.index}"
        ex = ("ip", "netns", "exec", ns)
        run("ip", "netns", "add", ns)
        self._record("netns", ns)
        run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        self._record("links", host)
        run("ip", "link", "set", peer, "netns", ns)
        run("ip", "link", "set", host, "master", BRIDGE)
        run("ip", "link", "set", host, "up")
        run(*ex, "ip", "link", "set", peer, "name", "wan")
        run(*ex, "ip", "addr", "add", f"{r.public}/24", "dev", "wan")
        run(*ex, "ip", "link", "set", "wan", "up")
        run(*ex, "ip", "link", "set", "lo", "up")
        run(*ex, "ip", "link", "add", "lan", "type", "bridge")
        run(*ex, "ip", "addr", "add", f"{r.gateway}/24", "dev", "lan")
        run(*ex, "ip", "link", "set", "lan", "up")
        run(*ex, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")  # this namespace's own switch
        run(*ex, "nft", "-f", "-", stdin=NFT_RULES)

    def _shape_router(self, r: Router) -> None:
        """Out through ``wan`` and in through ``lan``, at the uplink; the coordinator's traffic unlimited."""
        for dev, coordinator in (("wan", "dst"), ("lan", "src")):
            tc = ["ip", "netns", "exec", r.netns, "tc"]
            run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:9", "htb", "rate", UNLIMITED)
            run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", *_rate(r.uplink_bps))
            for cls in ("1:9", "1:10"):  # a bridge has no queue length for htb's default leaf to take
                run(*tc, "qdisc", "add", "dev", dev, "parent", cls, "pfifo", "limit", "1000")
            run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", coordinator, f"{self.subnet}.1/32", "flowid", "1:9")

    def _add_worker(self, slot: Slot) -> None:
        ns, host, peer = slot.netns, f"{PREFIX}-v{slot.index}", f"{PREFIX}-p{slot.index}"
        run("ip", "netns", "add", ns)
        self._record("netns", ns)
        run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        self._record("links", host)  # the peer goes with it (and with the namespace, once moved there)
        run("ip", "link", "set", peer, "netns", ns)
        router = self.routers.get(slot.site) if slot.nat else None
        if router is None:
            run("ip", "link", "set", host, "master", BRIDGE)
            run("ip", "link", "set", host, "up")
        else:  # on the router's inside bridge (it goes with the router's namespace, or the worker's)
            run("ip", "link", "set", host, "netns", router.netns)
            run("ip", "netns", "exec", router.netns, "ip", "link", "set", host, "master", "lan")
            run("ip", "netns", "exec", router.netns, "ip", "link", "set", host, "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", peer, "name", "eth0")
        run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{slot.address}/24", "dev", "eth0")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if router is not None:
            run("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", router.gateway)

    def _shape(self, slot: Slot) -> None:
        tc = ["ip", "netns", "exec", slot.netns, "tc"]
        run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "9")
        run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:9", "htb", "rate", UNLIMITED)
        for other in self.slots:
            if other.index == slot.index or (other.nat and other.site != slot.site):
                continue  # a NATed worker of another site has no address here: its router's class (below) takes that
            bps = self.spec.bandwidth(slot.index, other.index)
            burst = max(16_000, bps // 8 // 250)  # about 4 ms of traffic: exact at low rates, no stalls at high
            cls = f"1:{100 + other.index}"
            run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb",
                "rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", str(burst), "cburst", str(burst))
            run(*tc, "qdisc", "add", "dev", "eth0", "parent", cls, "pfifo", "limit", "1000")
            run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dst", f"{other.address}/32", "flowid", cls)
        for r in [] if slot.nat else self.routers.values():  # a NATed worker reaches no other NAT site
            cls = f"1:{ROUTER_CLASS + r.index}"  # what this worker sends into the NAT site over a connection opened from there
            run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb",
                *_rate(self.spec.link(slot.site, r.site).bandwidth_bps))
            run(*tc, "qdisc", "add", "dev", "eth0", "parent", cls, "pfifo", "limit", "1000")
            run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dst", f"{r.public}/32", "flowid", cls)

    def set_link_rate(self, i: int, j: int, bps: int) -> None:
        """Change the rate from worker i to worker j while running (a link that slows down)."""
        set_link_rate(i, j, bps)

    def down(self) -> None:
        lock = getattr(self, "_lockfile", None)
        if lock is None:
            return  # never up (or down already): what the state file lists is another testbed's
        try:
            delay.stop(getattr(self, "_delays", []))
            self._delays = []
            if self.emulated:
                down()
        finally:
            lock.close()  # releases the flock
            self._lockfile = None


def _rate(bps: int) -> list[str]:
    """htb arguments for ``bps``, with a burst of about 4 ms of traffic: exact at low rates, no stalls at high."""
    burst = str(max(16_000, bps // 8 // 250))
    return ["rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", burst, "cburst", burst]


def set_link_rate(i: int, j: int, bps: int) -> None:
    """Change the rate from worker i to worker j of the live testbed (whichever process brought it up)."""
    burst = max(16_000, bps // 8 // 250)
    run("ip", "netns", "exec", f"{PREFIX}-w{i}", "tc", "class", "change", "dev", "eth0", "parent", "1:",
        "classid", f"1:{100 + j}", "htb", "rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", str(burst), "cburst", str(burst))
