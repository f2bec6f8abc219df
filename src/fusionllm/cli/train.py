"""`fusionllm train`: the single-process reference, or a local cluster (loopback or an emulated testbed).

Its options are declared once, in ``core/options.py``; ``with_options`` gives them to this function."""

from __future__ import annotations

from typing import Any

import typer

from fusionllm.cli.common import progress_bar, summary, user_errors
from fusionllm.cli.options import with_options
from fusionllm.core.errors import FusionError


@with_options("train")
@user_errors
def train(ctx: typer.Context, **values: Any) -> None:
    """Train a model: `--single-process` (the plain PyTorch reference) or `--cluster local:N|FILE.toml`."""
    from fusionllm.core.options import Options
    from fusionllm.launch.config_file import dump_config

    config_file, print_config = values.pop("config_file"), values.pop("print_config")
    del config_file  # read by its callback, as the flags' defaults
    options = Options.from_values(values)
    if print_config:
        print(dump_config(options, command="train"), end="")
        raise typer.Exit(0)
    from fusionllm.launch.api import RunFailed, run_train

    if values["single_process"] == bool(values["cluster"]):
        raise FusionError("choose one: --single-process, or --cluster local:N (other machines: fusionllm coordinator / worker)")
    if values["cluster"]:  # the coordinator prints the run's progress and summary
        try:
            run_train(options)
        except RunFailed as exc:
            raise typer.Exit(exc.status) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        return
    steps = options.train.steps
    bar, on_step, first = progress_bar(steps, "train")
    with bar:
        run = run_train(options, on_step=on_step)
    summary(run.model, run, first, steps)
