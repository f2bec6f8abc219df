"""What every command shares: one-line errors with exit codes, the progress bar, the run summary."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from fusionllm.core.errors import FusionError

console = Console(stderr=True)
DEBUG = {"on": False}  # set by the global --debug option
F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """A FusionError becomes one line on stderr and exit status 2; nothing else is hidden."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FusionError as exc:
            if DEBUG["on"]:
                traceback.print_exc()
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug, or a condition nobody foresaw: one line, the traceback on request
            if DEBUG["on"]:
                raise
            print(f"error: {type(exc).__name__}: {exc}\n(unexpected: run again with `fusionllm --debug ...` for the traceback, "
                  "and please report it)", file=sys.stderr)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def progress_bar(total: int, label: str) -> tuple[Any, Callable[[dict], None], list[float]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    first: list[float] = []
    bar = Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False,
    )
    task = bar.add_task(label, total=total, info="")

    done = [0]  # the user's steps done: several groups write one record each per step, and a skipped step none

    def on_step(rec: dict) -> None:
        if not first:
            first.append(rec["loss"])
        done[0] = max(done[0], rec["step"] + 1)
        val = f" val {rec['val_loss']:.3f}" if "val_loss" in rec else ""
        bar.update(task, completed=done[0], info=f"loss {rec['loss']:.3f}{val}  {rec['tokens_per_s']:.0f} tok/s")

    return bar, on_step, first


def summary(model: str, result: Any, first: list[float], steps: int) -> None:
    if not result.losses:
        print(f"model={model} nothing to do (already at step {steps})")
        return
    last = sum(result.losses[-10:]) / len(result.losses[-10:])
    print(
        f"model={model} params={result.num_params} steps={steps} tokens={result.tokens} "
        f"elapsed_s={result.elapsed_s:.1f} tokens_per_s={result.tokens / max(result.elapsed_s, 1e-9):.0f} "
        f"first_loss={first[0]:.4f} final_loss={last:.4f}"
        + (f" val_loss={result.val_losses[-1][1]:.4f}" if result.val_losses else "")
        + (f" val_metric={result.val_metrics[-1][1]:.4f}" if getattr(result, "val_metrics", None) else "")
    )

