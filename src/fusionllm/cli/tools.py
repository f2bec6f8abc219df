"""Around a run: `fusionllm token` (the shared secret), `report` (a metrics file as markdown), `bench`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import console, user_errors
from fusionllm.core.errors import FusionError


@user_errors
def token(path: Annotated[Path, typer.Argument(help="The token file to create (kept if it exists).")]) -> None:
    """Make the shared secret every process of a run presents (copy it to every machine, keep it private)."""
    from fusionllm.transport.auth import load_token

    existed = path.exists()
    load_token(path, create=True)
    console.print(f"{'kept the existing' if existed else 'wrote a new'} token in {path}", highlight=False)


@user_errors
def report(
    metrics: Annotated[Path, typer.Argument(help="A run's metrics file (--metrics), or a directory holding exactly one .jsonl file.")],
    out: Annotated[Path | None, typer.Option(help="Where to write report.md and its PNG plots (default: next to the metrics, in report/).")] = None,
) -> None:
    """A finished (or running) training as markdown with plots: loss, tokens/s, bytes and AdaTopK ratio per link, the plan."""
    from fusionllm.report import write_report

    target = out or (metrics if metrics.is_dir() else metrics.parent) / "report"
    path = write_report(metrics, target)
    console.print(f"wrote {path} and its plots", highlight=False)


@user_errors
def bench(ctx: typer.Context) -> None:
    """End to end against torch.distributed.pipelining on emulated clusters (benchmarks/e2e.py; root).

    Every option goes to the benchmark, e.g. `fusionllm bench --quick`; `python benchmarks/e2e.py --help` lists them."""
    import subprocess

    candidates = [Path(__file__).resolve().parents[3] / "benchmarks" / "e2e.py", Path.cwd() / "benchmarks" / "e2e.py"]
    script = next((p for p in candidates if p.is_file()), None)
    if script is None:
        raise FusionError("benchmarks/e2e.py not found: run `fusionllm bench` from a clone of the fusionllm repository")
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args]))
