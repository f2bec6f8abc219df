"""Every option is declared once (core/options.py) and the CLI, the TOML file, the API and the docs come from it.

Why these checks can fail: a flag added to a command by hand, a TOML key or an API keyword that no
declaration holds, a default or help text that differs between two of them, a mode whose values are
listed again somewhere else, a ClusterConfig field renamed on the way to the coordinator, or a
`--print-config` output that does not read back to the options it printed.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperOption
from typer.testing import CliRunner

from fusionllm.cli.main import app
from fusionllm.cli.options import BEGIN, END, reference, with_options
from fusionllm.control.config import ClusterConfig
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.options import (
    COMMANDS,
    SYNC_MODES,
    Options,
    ReliabilityOptions,
    SyncOptions,
    TrainOptions,
    choices,
    command_leaves,
    leaves,
    option,
)
from fusionllm.launch.api import TRAIN_DEFAULTS, resolve_options
from fusionllm.launch.config_file import NOT_IN_FILES, SECTION_OF, dump_config, read_config

ROOT = Path(__file__).resolve().parent.parent
RUNNER = CliRunner()


def _flags(command: str) -> dict[str, TyperOption]:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {p.name: p for p in cmd.params if isinstance(p, TyperOption) and p.name and p.name not in NOT_IN_FILES}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_commands_flags_are_the_declared_options_with_their_defaults_help_and_values(command: str) -> None:
    declared = command_leaves(command)
    flags = _flags(command)
    assert len(declared) > 50 and set(flags) == set(declared)
    assert sum(choices(leaf.kind) is not None for leaf in declared.values()) >= 6  # the modes are Literals
    for name, leaf in declared.items():
        flag = flags[name]
        assert flag.opts == [leaf.flag], name  # one name: the flag is the option's name with dashes
        assert flag.help == leaf.help, name
        if leaf.meta("required"):
            assert flag.required, name
        else:
            assert flag.default == leaf.default or (flag.default is None and leaf.default is None), name
        assert (flag.min, flag.max) == (leaf.meta("min"), leaf.meta("max")), name
        assert choices(flag.type_descriptor.annotation) == choices(leaf.kind), name  # a mode's values (a Literal), as declared


def test_the_toml_keys_and_the_api_keywords_are_the_declared_options() -> None:
    assert SECTION_OF == {n: leaf.section for n, leaf in leaves().items()} and len(SECTION_OF) == len(leaves())
    assert TRAIN_DEFAULTS == {n: leaf.default for n, leaf in command_leaves("train").items()}
    for command in COMMANDS:
        text = dump_config(Options(), command=command)
        keys = set(re.findall(r"^#? ?([a-z-]+) = ", text, re.M))
        assert keys == {n.replace("_", "-") for n in command_leaves(command)}, command


def test_every_mode_lists_its_values_once() -> None:
    """A mode's values are a Literal in core/options.py; no other source file spells the tuple again."""
    assert SYNC_MODES == ("synchronous", "hierarchical", "auto")
    spelled = re.compile(r"\(\s*\"synchronous\",\s*\"hierarchical\",\s*\"auto\"\s*\)|\(\s*\"retry\",\s*\"stop\",\s*\"off\"\s*\)"
                         r"|\(\s*\"fp32\",\s*\"bf16\"\s*\)|\(\s*\"mean\",\s*\"clipped\",\s*\"trimmed\"\s*\)"
                         r"|\(\s*\"auto\",\s*\"off\"\s*\)|\(\s*\"opfence\",\s*\"uniform\",\s*\"params\",\s*\"compute\"\s*\)")
    files = sorted((ROOT / "src" / "fusionllm").rglob("*.py"))
    assert len(files) > 100
    again = [str(f.relative_to(ROOT)) for f in files if f.name != "options.py" and spelled.search(f.read_text())]
    assert not again, f"a mode's values listed outside core/options.py: {again}"


def test_cluster_and_train_config_take_the_options_names_and_defaults() -> None:
    """The coordinator's ClusterConfig and the TrainConfig are views of the options: no field renamed on
    the way (dead_after, not dead_after_s), and the declaration's default where it has one."""
    known = leaves()
    names = {f.name for f in fields(ClusterConfig)}
    assert names - set(known) == {"token", "tls", "step_timeout", "max_replans"}  # what only the coordinator's process knows
    resolved = {"sync", "eval_every"}  # sync is settled before the coordinator starts; eval_every comes from the TrainConfig
    for f in fields(ClusterConfig):
        if f.name in known and f.name not in resolved and f.default is not MISSING:
            assert f.default == known[f.name].default, f.name
    train = {f.name: f.default for f in fields(TrainConfig)}
    assert set(train) - set(known) == {"weight_decay", "grad_clip"}
    assert {n: d for n, d in train.items() if n in known and n != "metrics"} == {n: known[n].default for n in train if n in known and n != "metrics"}


def test_sections_check_their_values_when_built() -> None:
    """The validation of the declaration, without any process: types, modes and bounds, each one line naming the option."""
    with pytest.raises(ConfigError, match=r"^steps='10': expected int$"):
        TrainOptions(steps="10")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"numeric_guard='sometimes': choose retry, stop or off"):
        ReliabilityOptions(numeric_guard="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"outer_momentum=1.5: must be in \[0.0, 0.999\]"):
        SyncOptions(outer_momentum=1.5)
    with pytest.raises(ConfigError, match=r"resume=1: expected bool"):
        ReliabilityOptions(resume=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown option 'dead_after_s': did you mean dead_after"):
        Options.from_values({"dead_after_s": 3.0})
    got = Options.from_values({"metrics": "m.jsonl", "lr": 1, "regroup": ("5:0/1",)})
    assert got.train.metrics == Path("m.jsonl") and isinstance(got.train.lr, float) and got.sync.regroup == ["5:0/1"]


@pytest.mark.parametrize("command", COMMANDS)
def test_print_config_reads_back_to_the_same_options(tmp_path: Path, command: str) -> None:
    args = ["--steps", "9", "--sync", "hierarchical", "--groups", "0/1", "--regroup", "5:0/1", "--numeric-guard", "stop",
            "--dead-after", "4", "--blocking-sync", "--metrics", str(tmp_path / "m.jsonl"), "--outer-aggregate", "trimmed"]
    if command == "coordinator":
        args += ["--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "token"), "--workers", "2"]
    got = RUNNER.invoke(app, [command, *args, "--print-config"])
    assert got.exit_code == 0, got.output
    path = tmp_path / "printed.toml"
    path.write_text(got.output)
    back = Options.from_values(read_config(path, command_leaves(command)))
    expect = {"steps": 9, "sync": "hierarchical", "groups": "0/1", "regroup": ["5:0/1"], "numeric_guard": "stop", "dead_after": 4.0,
              "blocking_sync": True, "metrics": tmp_path / "m.jsonl", "outer_aggregate": "trimmed"}
    if command == "coordinator":
        expect |= {"listen": "127.0.0.1:0", "token_file": tmp_path / "token", "workers": 2}
    assert back == Options.from_values(expect)


def test_a_mode_outside_its_values_is_refused_by_the_command(tmp_path: Path) -> None:
    got = RUNNER.invoke(app, ["train", "--numeric-guard", "sometimes", "--print-config"])
    assert got.exit_code == 2 and "sometimes" in got.output and "retry" in got.output


# A field added to a test-only declaration: the CLI, the TOML file and the API all take it, with no other change.
@dataclass(frozen=True, kw_only=True)
class ExtraTrain(TrainOptions):
    """[train]: the built-in options and one more."""

    new_knob: int = option(7, "A knob only this test declares.", min=0)


@dataclass(frozen=True, kw_only=True)
class ExtraOptions(Options):
    train: ExtraTrain = field(default_factory=ExtraTrain)


def test_a_field_added_to_a_declaration_appears_as_a_flag_a_toml_key_and_a_keyword(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    @with_options("train", ExtraOptions)
    def cmd(ctx: typer.Context, **values: Any) -> None:
        seen.update(values)

    extra = typer.Typer()
    extra.command()(cmd)
    extra.command("other")(lambda: None)  # two commands: typer keeps the command's name
    got = RUNNER.invoke(extra, ["cmd", "--new-knob", "9"])
    assert got.exit_code == 0, got.output
    assert seen["new_knob"] == 9 and seen["steps"] == 200
    assert "--new-knob" in RUNNER.invoke(extra, ["cmd", "--help"]).output
    assert RUNNER.invoke(extra, ["cmd", "--new-knob", "-1"]).exit_code == 2  # its bound, declared with it

    options = Options.from_values({"new_knob": 9}, root=ExtraOptions)
    path = tmp_path / "run.toml"
    path.write_text(dump_config(options))
    assert "new-knob = 9" in path.read_text().split("[cluster]")[0]
    assert read_config(path, command_leaves("train", ExtraOptions), root=ExtraOptions)["new_knob"] == 9

    assert resolve_options(path, {"steps": 3}, root=ExtraOptions).train.new_knob == 9
    assert resolve_options(None, {"new_knob": 4}, root=ExtraOptions).train.new_knob == 4
    with pytest.raises(ConfigError, match="unknown option 'new_knbo': did you mean new_knob"):
        resolve_options(None, {"new_knbo": 4}, root=ExtraOptions)
    assert "| `new-knob` | `7` | train, coordinator | A knob only this test declares. |" in reference(ExtraOptions)


def test_docs_config_md_lists_every_option_as_declared() -> None:
    """The reference in docs/config.md is the generated one (`python -m fusionllm.cli.options docs/config.md`)."""
    text = (ROOT / "docs" / "config.md").read_text()
    listed = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert listed.strip() == reference().strip(), "docs/config.md is stale: python -m fusionllm.cli.options docs/config.md"
    assert all(f"`{n.replace('_', '-')}`" in listed for n in leaves())
