"""NAT sites: the cluster file's `nat` / `uplink`, and the testbed's routers (root, nftables): a NATed
worker reaches out, nothing reaches in unless it opened the connection, and `down` leaves nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from fusionllm.cluster.spec import SiteSpec, parse_cluster
from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import read_metrics
from fusionllm.testbed.sh import TestbedError, can_emulate, can_nat, run
from fusionllm.testbed.testbed import LOCK, STATE, Slot, Testbed, down, leftovers, machine_lock

OK, WHY = can_nat()
needs_nat = pytest.mark.skipif(not OK, reason=f"NAT testbed needs root on Linux with iproute2 and nftables: {WHY}")
needs_root = pytest.mark.skipif(not can_emulate()[0], reason=f"testbed needs root on Linux with iproute2: {can_emulate()[1]}")
pytestmark = pytest.mark.testbed  # the machine's one testbed, its lock and its records

SPEC = """
[sites.pub]
devices = 1
cpus = 0.3
bandwidth = "1gbit"
[sites.home]
devices = 2
cpus = 0.3
bandwidth = "1gbit"
nat = true
uplink = "{uplink}"
[[links]]
sites = ["pub", "home"]
bandwidth = "{link}"
"""
PORT = 7311

# One connection: print "ready", then the address of the first peer (and read, or send, `size` bytes).
SERVER = """
import socket, sys
port, wait, size, send = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "send"
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen()
s.settimeout(wait)
print("ready", flush=True)
try:
    c, peer = s.accept()
except OSError:
    print("none", flush=True)
    sys.exit(1)
print(peer[0], flush=True)
if send:
    c.sendall(bytes(size))
else:
    while size > 0:
        size -= len(c.recv(1 << 16)) or size
c.close()
"""
# Connect, then send or receive `size` bytes; print "connected SECONDS", or the error.
CLIENT = """
import socket, sys, time
host, port, wait, size, send = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "send"
try:
    c = socket.create_connection((host, port), timeout=wait)
except OSError as exc:
    print(type(exc).__name__, exc)
    sys.exit(1)
c.settimeout(60)
t = time.monotonic()
if send:
    c.sendall(bytes(size))
    c.shutdown(socket.SHUT_WR)
while c.recv(1 << 16):  # until the server closes: it has read (or we have received) everything
    pass
print("connected", time.monotonic() - t)
"""


def _spec(uplink: str = "50mbit", link: str = "100mbit"):
    return parse_cluster(SPEC.format(uplink=uplink, link=link), source="nat.toml")


def _server(slot: Slot, *, wait: float = 20, size: int = 0, send: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([*slot.command_prefix(), sys.executable, "-c", SERVER, str(PORT), str(wait), str(size), "send" if send else "recv"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _connect(slot: Slot, host: str, *, wait: float = 5, size: int = 0, send: bool = False) -> tuple[bool, str]:
    proc = subprocess.run([*slot.command_prefix(), sys.executable, "-c", CLIENT, host, str(PORT), str(wait), str(size), "send" if send else "recv"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, proc.stdout.strip() + proc.stderr.strip()


def _first_peer(server: subprocess.Popen) -> str:
    out, err = server.communicate(timeout=60)
    return out.strip() or err


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture()
def clean() -> Iterator[None]:
    """No test leaves a fusion-* name behind; names that were there before (anyone's) are not ours to judge.
    The machine is shared: another process's testbed is waited for, and never taken down."""
    with machine_lock(300) as free:
        if not free:
            pytest.skip(f"another testbed held {LOCK} for 5 minutes")
        down()  # what a crashed earlier run recorded
        before = leftovers()
    yield
    with machine_lock(0) as free:
        if not free:
            return  # another testbed came up as ours went down: what exists now is not ours to judge
        left = {k: sorted(set(v) - set(before[k])) for k, v in leftovers().items()}
        down()
        assert left == {"netns": [], "links": [], "cgroups": []}, f"the testbed left {left}"
        assert not STATE.exists(), STATE.read_text()


# --- the cluster file -------------------------------------------------------------------


def test_nat_and_uplink_parse_and_default() -> None:
    spec = _spec(uplink="30mbit")
    assert spec.nat_sites() == ["home"]
    assert [spec.is_natted(i) for i in range(3)] == [False, True, True]
    assert spec.uplink_bps("home") == 30_000_000
    home = spec.to_dict()["sites"]["home"]
    assert (home["nat"], home["uplink"], spec.to_dict()["sites"]["pub"]["uplink"]) == (True, "30mbit", None)
    # no uplink: the fastest of its links; no links: its own bandwidth
    text = SPEC.replace('uplink = "{uplink}"\n', "").format(link="80mbit") + '[sites.far]\ndevices = 1\ncpus = 0.3\nbandwidth = "1gbit"\n'
    text += '[[links]]\nsites = ["home", "far"]\nbandwidth = "200mbit"\n[[links]]\nsites = ["pub", "far"]\nbandwidth = "5mbit"\n'
    assert parse_cluster(text).uplink_bps("home") == 200_000_000
    alone = parse_cluster('[sites.h]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\nnat = true\n')
    assert alone.uplink_bps("h") == 1_000_000_000


@pytest.mark.parametrize(("body", "message"), [
    ('nat = "yes"', "nat.toml: sites.h.nat: must be true or false, got 'yes'"),
    ('nat = 1', "nat.toml: sites.h.nat: must be true or false, got 1"),
    ('uplink = "50mbit"', "nat.toml: sites.h.uplink: only a NAT site has an uplink; add nat = true to site h, or remove uplink"),
    ('nat = true\nuplink = "fast"', "nat.toml: sites.h.uplink:"),
    ('nat = true\nuplink = 5', "nat.toml: sites.h.uplink:"),
])
def test_nat_and_uplink_errors(body: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster(f'[sites.h]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n{body}\n', source="nat.toml")
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="sites.h.uplink: must be a positive"):
        SiteSpec("h", 1, 0.5, 1_000_000, nat=True, uplink_bps=0)


def test_without_emulation_a_nat_site_runs_on_loopback() -> None:
    tb = Testbed(_spec(), emulate=False)
    assert [(s.nat, s.address, s.public) for s in tb.slots] == [(False, "127.0.0.1", "127.0.0.1")] * 3
    assert tb.routers == {} and tb.rate(0, 1) == 50_000_000  # the uplink caps the 100 Mbit/s link


@needs_root
def test_a_nat_site_without_nft_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import fusionllm.testbed.sh as sh

    which = sh.shutil.which
    monkeypatch.setattr(sh.shutil, "which", lambda tool: None if tool == "nft" else which(tool))
    with pytest.raises(TestbedError, match=r"cluster nat has NAT sites \(home\) but `nft` is not installed.*apt-get install nftables") as info:
        Testbed(_spec())
    assert "\n" not in str(info.value)


# --- the emulated routers ---------------------------------------------------------------


@pytest.mark.slow
@needs_nat
def test_nat_slots_reach_out_and_nothing_reaches_in(clean: None) -> None:
    with Testbed(_spec()) as tb:
        pub, h1, h2 = tb.slots
        router = tb.routers["home"]
        assert (pub.nat, pub.public) == (False, pub.address) and pub.address == f"{tb.subnet}.10"
        assert (h1.nat, h1.address, h1.public) == (True, f"{tb.nat_subnet}.0.11", f"{tb.subnet}.240") == (True, f"{router.private}.11", router.public)
        # out, to a reachable worker: the server sees the router's outside address
        server = _server(pub)
        try:
            ok, why = _connect(h1, pub.address)
            assert ok, why
            assert _first_peer(server) == router.public
        finally:
            _stop(server)
        # out, to the coordinator's address in the root namespace
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((tb.coordinator_host, PORT))
            s.listen()
            s.settimeout(10)
            client = subprocess.Popen([*h2.command_prefix(), sys.executable, "-c", CLIENT, tb.coordinator_host, str(PORT), "5", "0", "recv"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                conn, peer = s.accept()
                conn.close()
                assert peer[0] == router.public
                assert client.wait(10) == 0, client.stdout.read()
            finally:
                _stop(client)
        # in: neither a reachable worker nor the root namespace gets to a NATed worker's private address,
        # not even with a route to it through the router (its firewall drops what no worker opened)
        server = _server(h2, wait=60)
        try:
            ok, why = _connect(pub, h2.address, wait=2)
            assert not ok and "unreachable" in why.lower(), why  # no route at all
            # the root namespace has an unreachable route for the NAT site's subnet (nothing leaves by its default route)
            assert f"unreachable {router.private}.0/24" in run("ip", "route", "show", "type", "unreachable")
            with pytest.raises(OSError, match="No route to host"):
                socket.create_connection((h2.address, PORT), timeout=2).close()
            run("ip", "netns", "exec", pub.netns, "ip", "route", "add", f"{router.private}.0/24", "via", router.public)
            ok, why = _connect(pub, h2.address, wait=2)
            assert not ok and "timed out" in why, why  # dropped by the router's forward chain
            # two workers of the NAT site: directly, on their private addresses (and the first to get through)
            ok, why = _connect(h1, h2.address)
            assert ok, why
            assert _first_peer(server) == h1.address
        finally:
            _stop(server)


@pytest.mark.soak  # `make test-soak`: shaping is covered by test_testbed's probe; the NAT paths by the two tests kept in make test
@needs_nat
def test_the_uplink_is_shaped_both_ways(clean: None) -> None:
    """A loose lower bound: 2.5 MB through a 20 Mbit/s uplink take >= 0.7 s (1 s at the rate) where the
    1 Gbit/s link alone would take 0.02 s; load only makes it slower, so it cannot fail by being busy."""
    size = 2_500_000
    with Testbed(_spec(uplink="20mbit", link="1gbit")) as tb:
        pub, h1, _ = tb.slots
        router = tb.routers["home"]
        wan = run("ip", "netns", "exec", router.netns, "tc", "class", "show", "dev", "wan")
        assert "rate 20Mbit" in wan, wan
        assert "rate 1Gbit" in run("ip", "netns", "exec", pub.netns, "tc", "class", "show", "dev", "eth0", "classid", "1:50")
        for send in (True, False):  # out of the site (wan), then into it (lan), on a connection h1 opens
            server = _server(pub, size=size, send=not send)
            try:
                ok, out = _connect(h1, pub.address, size=size, send=send)
                assert ok, out
                assert float(out.split()[1]) >= 0.7, (send, out)
            finally:
                _stop(server)
        assert sum(v for (i, _), v in tb.link_bytes().items() if i == h1.index) >= size  # tc counted h1's upload


@pytest.mark.soak  # `make test-soak`: test_testbed's down tests cover the state file in make test
@needs_nat
def test_down_removes_the_routers_after_a_crash(clean: None) -> None:
    tb = Testbed(_spec())
    tb.up()  # and never taken down, as if the process had died
    state = json.loads(STATE.read_text())
    assert {"fusion-r0", "fusion-w1"} <= set(state["netns"]) and "fusion-o0" in state["links"], state
    assert {"fusion-r0", "fusion-w0", "fusion-w1", "fusion-w2"} <= set(leftovers()["netns"])
    tb._lockfile.close()  # the lock a dead process would have dropped
    tb._lockfile = None
    proc = subprocess.run([sys.executable, "-m", "fusionllm", "testbed", "down"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "netns=4" in proc.stdout, proc.stdout + proc.stderr
    left = leftovers()
    assert not any(set(state[k]) & set(left[k]) for k in ("netns", "links", "cgroups")), left
    assert state["routes"] == ["10.214.0.0/24"] and "10.214.0.0/24" not in run("ip", "route", "show", "type", "unreachable")


@pytest.mark.soak  # `make test-soak`: test_testbed's refusal test covers the rule in make test
@needs_nat
def test_up_refuses_a_router_name_it_did_not_make(clean: None) -> None:
    try:
        run("ip", "netns", "add", "fusion-r0")
        with pytest.raises(TestbedError, match=r"fusion-r0 \(netns\) already exist.*ip netns delete fusion-r0"):
            Testbed(_spec()).up()
        assert "fusion-r0" in leftovers()["netns"]
    finally:
        run("ip", "netns", "delete", "fusion-r0", check=False)


TRAIN_SPEC = """
name = "nat-train"
[sites.pub]
devices = 1
cpus = 0.5
bandwidth = "1gbit"
[sites.h1]
devices = 1
cpus = 0.5
bandwidth = "1gbit"
nat = true
[sites.h2]
devices = 1
cpus = 0.5
bandwidth = "1gbit"
nat = true
[[links]]
sites = ["pub", "h1"]
bandwidth = "100mbit"
[[links]]
sites = ["pub", "h2"]
bandwidth = "100mbit"
[[links]]
sites = ["h1", "h2"]
bandwidth = "100mbit"
"""


@pytest.mark.slow
@needs_nat
def test_workers_behind_two_nats_train_like_one_process(clean: None, tmp_path) -> None:
    """`fusionllm train` on a cluster with two NAT sites: the coordinator finds it cannot reach their
    workers, hosts them through its relay, and a pipeline through all three devices (h1 -> h2 through
    the relay) gives the losses of one process."""
    cluster = tmp_path / "nat-train.toml"
    cluster.write_text(TRAIN_SPEC)
    a, b = tmp_path / "tb.jsonl", tmp_path / "single.jsonl"
    common = ["--model", "gpt-nano", "--steps", "4", "--batch-size", "8", "--seq-len", "16", "--seed", "2"]
    base = [sys.executable, "-m", "fusionllm"]
    # the one-process reference beside the testbed run: its workers have half a core each
    single = subprocess.Popen([*base, "train", "--single-process", *common, "--eval-every", "0", "--metrics", str(b)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc = subprocess.run([*base, "train", "--cluster", str(cluster), "--scheduler", "params", "--sync", "synchronous", *common, "--metrics", str(a),
                               "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
        _, err = single.communicate(timeout=300)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "worker 1 is behind NAT: reached through relay the coordinator" in text, text[-3000:]
    assert "worker 2 is behind NAT" in text
    assert single.returncode == 0, err[-3000:]
    la, lb = read_metrics(a).losses(), read_metrics(b).losses()
    assert len(la) == len(lb) == 4
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(la, lb, strict=True)), (la, lb)
    plan = read_metrics(a).plans[0]
    assert [plan["workers"][w]["relay"] is not None for w in ("0", "1", "2")] == [False, True, True]
