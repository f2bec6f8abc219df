"""The commands' options, generated from their one declaration (``core/options.py``).

``option_type(name)`` is the typer annotation of a declared option (its flag, help, bounds and, for a
mode, its values); ``with_options(command)`` gives a command function every option the declaration
lists for that command, so `fusionllm train` and `fusionllm coordinator` declare none themselves.
Options of one command only (``plan``'s ``--plan-candidates``, the worker's) are declared here or
in the command, once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from fusionllm.core.options import Leaf, Options, command_leaves, leaves

F = TypeVar("F", bound=Callable[..., Any])


def option_type(name: str, root: type[Any] = Options) -> Any:
    """``Annotated[type, typer.Option(...)]`` of the declared option ``name``."""
    leaf = leaves(root)[name]
    return Annotated[leaf.kind, typer.Option(leaf.flag, help=leaf.help, min=leaf.meta("min"), max=leaf.meta("max"))]


def _param(leaf: Leaf, command: str, root: type[Any]) -> inspect.Parameter:
    default = inspect.Parameter.empty if leaf.meta("required") and command in leaf.commands else leaf.default
    return inspect.Parameter(leaf.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=option_type(leaf.name, root))


def with_options(command: str, root: type[Any] = Options) -> Callable[[F], F]:
    """The command function's signature: ``ctx``, every declared option of ``command`` (required
    ones first, as Python wants), then ``--config`` and ``--print-config``; the function takes them
    as ``**values``."""

    def wrap(fn: F) -> F:
        params = [_param(leaf, command, root) for leaf in command_leaves(command, root).values()]
        params.sort(key=lambda p: p.default is not inspect.Parameter.empty)
        ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        extra = [inspect.Parameter("config_file", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOpt),
                 inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=PrintConfigOpt)]
        fn.__signature__ = inspect.Signature([ctx, *params, *extra], return_annotation=None)  # type: ignore[attr-defined]
        return fn

    return wrap


ModelOpt = option_type("model")
TaskOpt = option_type("task")
ImageSizeOpt = option_type("image_size")
SeedOpt = option_type("seed")
DataOpt = option_type("data")
BatchOpt = option_type("batch_size")
SeqOpt = option_type("seq_len")
MicroOpt = option_type("micro_batches")
CompressOpt = option_type("compress")
CollectivesOpt = option_type("collectives")
ThreadsOpt = option_type("threads")
TlsCertOpt = option_type("tls_cert")
TlsKeyOpt = option_type("tls_key")
TlsCaOpt = option_type("tls_ca")
SyncOpt = option_type("sync")
InnerStepsOpt = option_type("inner_steps")
FragmentsOpt = option_type("fragments")
OuterCodecOpt = option_type("outer_codec")
OuterLrOpt = option_type("outer_lr")
OuterMomentumOpt = option_type("outer_momentum")
DEFAULT_OUTER_MOMENTUM = leaves()["outer_momentum"].default
DEFAULT_PLAN_CANDIDATES = 12  # fusionllm.planning.schedulers.DEFAULT_CANDIDATES (not imported: the CLI starts fast)
CandidatesOpt = Annotated[int, typer.Option("--plan-candidates", min=1, help="Plans OP-Fence simulates after ranking them all (the search is bounded by this, not by time: the same inputs give the same plan anywhere).")]
BackendOpt = Annotated[str, typer.Option(help="Framework that runs the stage: torch, or numpy (CPU, GPT op kinds, no torch imported).")]


def _read_config_file(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """``--config run.toml``: the file's options become the command's defaults, so flags override them
    (a coordinator's ``run.json``, written by `fusionllm train`, is read by the command itself)."""
    if value is None or value.suffix == ".json":
        return value
    from fusionllm.core.errors import FusionError
    from fusionllm.launch.config_file import read_config

    try:
        ctx.default_map = {**(ctx.default_map or {}), **read_config(value, (p.name for p in ctx.command.params if p.name))}
    except FusionError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


ConfigOpt = Annotated[Path | None, typer.Option("--config", is_eager=True, callback=_read_config_file, help="A config file (TOML: [train], [cluster], [sync], [compress], [reliability]; docs/config.md) whose options this run takes; flags given too override it. --print-config writes one.")]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print every option as resolved (the config file, then the flags) as a config file, and exit without running.")]


BEGIN, END = "<!-- options: generated from core/options.py by `python -m fusionllm.cli.options docs/config.md` -->", "<!-- options: end -->"


def reference(root: type[Any] = Options) -> str:
    """Every option as a markdown table per section: key, default, the commands that take it, help."""
    out: list[str] = []
    by_section: dict[str, list[Leaf]] = {}
    for leaf in leaves(root).values():
        by_section.setdefault(leaf.section, []).append(leaf)
    for section, group in by_section.items():
        doc = (inspect.getdoc(type(getattr(root(), section))) or "").split(": ", 1)[-1]
        out += [f"### [{section}]", "", doc[:1].upper() + doc[1:], "", "| key | default | commands | what it does |", "|---|---|---|---|"]
        for leaf in group:
            default = "required" if leaf.meta("required") else "not set" if leaf.default is None else f"`{_shown(leaf.default)}`"
            out.append(f"| `{leaf.name.replace('_', '-')}` | {default} | {', '.join(leaf.commands)} | {leaf.help.replace('|', '&#124;')} |")
        out.append("")
    return "\n".join(out)


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def write_reference(path: Path) -> bool:
    """Put ``reference()`` between the markers of ``path``; whether the file changed."""
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    new = f"{head}{BEGIN}\n{reference()}{END}{rest.split(END, 1)[1]}"
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    print("rewritten" if write_reference(Path(sys.argv[1])) else "already current")
