"""`fusionllm testbed up|down|probe`: an emulated cluster on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import console, user_errors
from fusionllm.core.errors import FusionError

testbed_app = typer.Typer(help="An emulated cluster on this machine: namespaces, tc rate limits, CPU quotas.", no_args_is_help=True)


@testbed_app.command("up")
@user_errors
def testbed_up(cluster: Annotated[Path, typer.Argument(help="Cluster file (TOML).")]) -> None:
    """Bring the testbed up and leave it up (until `fusionllm testbed down`)."""
    from fusionllm.cluster.spec import format_rate, load_cluster
    from fusionllm.testbed.testbed import Testbed

    tb = Testbed(load_cluster(cluster))
    if not tb.emulated:
        raise FusionError(f"cannot emulate here: {tb.why_not}")
    tb.up()
    for s in tb.slots:
        where = f"{s.address} behind NAT (public {s.public})" if s.nat else s.address
        print(f"device {s.index}: site {s.site}, netns {s.netns}, {where}, cpus {s.cpus}")
    for r in tb.routers.values():
        print(f"NAT site {r.site}: router netns {r.netns}, public {r.public}, private {r.private}.0/24, "
              f"uplink {format_rate(r.uplink_bps)}; its workers open connections out, none come in")
    print(f"coordinator address: {tb.coordinator_host}; take it down with: fusionllm testbed down")


@testbed_app.command("down")
@user_errors
def testbed_down() -> None:
    """Remove every namespace, link and cgroup a testbed made (also after a crash)."""
    from fusionllm.testbed.sh import TestbedError
    from fusionllm.testbed.testbed import LOCK, down, machine_lock

    with machine_lock(0) as free:
        if not free:  # a live process's testbed: its state file lists what it is using
            owner = Path(LOCK).read_text().strip() or "?"
            raise TestbedError(f"a running testbed (process {owner}) holds {LOCK}: not taking it down; stop that process (its testbed goes with it)")
        removed = down()
    print(" ".join(f"{k}={len(v)}" for k, v in removed.items()) + " removed")


@testbed_app.command("probe")
@user_errors
def testbed_probe(
    cluster: Annotated[Path, typer.Argument(help="Cluster file (TOML).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON list only.")] = False,
    seconds: Annotated[float, typer.Option(help="Seconds of streaming per link.")] = 2.0,
) -> None:
    """Bring the testbed up, measure every site pair and site through fusionllm's transport, take it down."""
    import json
    import tempfile

    from fusionllm.cluster.spec import format_rate, load_cluster
    from fusionllm.testbed.probe import probe
    from fusionllm.testbed.testbed import Testbed
    from fusionllm.transport.auth import load_token

    spec = load_cluster(cluster)
    with tempfile.TemporaryDirectory(prefix="fusion-probe-") as tmp, Testbed(spec) as tb:
        if not tb.emulated:
            console.print(f"[yellow]warning: the network is NOT emulated ({tb.why_not}); measuring loopback[/yellow]")
        token = Path(tmp) / "token"
        load_token(token, create=True)
        results = probe(tb, token, seconds=seconds)
    if as_json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        ratio = r["measured_bps"] / r["spec_bps"]
        via = "  through the relay" if r.get("relayed") else ""
        print(f"{r['src']:>6} -> {r['dst']:<6} spec {format_rate(r['spec_bps']):>9}  measured {r['measured_bps'] / 1e6:9.2f} Mbit/s  ({ratio:.1%}){via}")


@testbed_app.command("agent", hidden=True)
@user_errors
def testbed_agent(listen: Annotated[str, typer.Option()], token_file: Annotated[Path, typer.Option("--token-file")],
                  relay: Annotated[str | None, typer.Option(help="Behind NAT: be hosted by this relay.")] = None) -> None:
    """(internal) the probe agent run inside a namespace."""
    from fusionllm.testbed.agent import run_agent
    from fusionllm.transport.auth import load_token

    run_agent(listen, load_token(token_file), relay)
