"""`fusionllm`: the app, its global options, and every command, one module per command group.

The command modules import only typer, rich and `fusionllm.core` at load time (the worker
of the numpy backend must start without torch); each imports what it runs inside the command.
"""

from __future__ import annotations

from typing import Annotated

import typer

from fusionllm.cli.common import DEBUG
from fusionllm.cli.graph import models, trace_cmd, verify
from fusionllm.cli.llm import data_app, export, tokenizer_app
from fusionllm.cli.options import DEFAULT_PLAN_CANDIDATES  # noqa: F401  (read from here by tests/test_cli.py)
from fusionllm.cli.plan import plan_cmd, simulate
from fusionllm.cli.run import coordinator, worker
from fusionllm.cli.testbed import testbed_app
from fusionllm.cli.tools import bench, report, token
from fusionllm.cli.train import train
from fusionllm.core.version import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train language models over slow, uneven networks.")


def _version(value: bool) -> None:
    if value:
        print(f"fusionllm {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an error, not just its one line.")] = False,
) -> None:
    """fusionllm: the OP-DAG of any PyTorch model, trained across machines with remote autodiff."""
    DEBUG["on"] = debug


# in the order `fusionllm --help` lists them
app.command()(train)
app.command()(coordinator)
app.command()(worker)
app.command()(verify)
app.command("trace")(trace_cmd)
app.command()(models)
app.command("plan")(plan_cmd)
app.command()(simulate)
app.add_typer(testbed_app, name="testbed")
app.add_typer(tokenizer_app, name="tokenizer")
app.add_typer(data_app, name="data")
app.command()(export)
app.command()(token)
app.command()(report)
# every option, known or not, goes on to benchmarks/e2e.py
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(bench)


def main() -> None:
    import signal

    # SIGTERM (a service manager, `timeout`, a batch system) ends the run like Ctrl+C does: the
    # `finally` blocks run, so child processes stop and a testbed comes down
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        app()
    except SystemExit as done:
        exit_now(done.code)


def exit_now(code: object) -> None:
    """End the process once a command returned: its ``finally`` blocks have run (children stopped,
    files closed), so what is left is the interpreter's teardown, which with torch loaded took 1.3 to
    2.6 s of C destructors per process (measured on a 2-step ``local:2`` run: every coordinator and
    worker sat that long between its last line and its exit). Output is flushed and logging shut down
    first; ``os._exit`` skips the rest."""
    import contextlib
    import logging
    import os
    import sys

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): what Python prints, and status 1
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more to write to it
            stream.flush()
    os._exit(status)
