"""Config files (launch/config_file.py, `--config` and `--print-config` of train and coordinator).

Why these checks can fail: an option that no section holds cannot be set from a file; a typo in a
key silently ignored runs something other than what the user wrote; a flag that does not override
the file, or a written file that does not read back to the same options, breaks "the file starts
the same run again".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fusionllm.cli.main import app
from fusionllm.core.errors import ConfigError
from fusionllm.core.options import Options
from fusionllm.launch.config_file import NOT_IN_FILES, SECTION_OF, dump_config, read_config

RUNNER = CliRunner()


def _params(command: str) -> set[str]:
    group = typer.main.get_command(app)
    return {p.name for p in group.commands[command].params if p.name}  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", ["train", "coordinator"])
def test_every_option_of_the_command_has_a_section(command: str) -> None:
    missing = _params(command) - set(SECTION_OF) - NOT_IN_FILES
    assert not missing, f"options of `fusionllm {command}` no section of a config file holds: {sorted(missing)}"


def test_a_file_reads_back_as_the_options_it_was_written_from(tmp_path: Path) -> None:
    values = {"model": "gpt-nano", "steps": 7, "lr": 1e-3, "recompute": True, "regroup": ["40:0/1", "80:0,1"], "metrics": tmp_path / "m.jsonl",
              "compress": "eq:0.5", "guard_factor": float("inf"), "data": 'a "quoted" path, é', "threads": None, "sync": "hierarchical"}
    options = Options.from_values(values)
    path = tmp_path / "run.toml"
    path.write_text(dump_config(options, "a header\nof two lines"))
    got = read_config(path, SECTION_OF)
    assert Options.from_values(got) == options
    assert got["metrics"] == str(tmp_path / "m.jsonl") and "threads" not in got
    assert "# threads = (not set)" in path.read_text()


def test_the_file_a_run_keeps_has_its_paths_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.toml"
    path.write_text(dump_config(Options.from_values({"metrics": "m.jsonl", "run_dir": "runs/x"}), absolute=True))
    got = read_config(path, SECTION_OF)
    assert got["metrics"] == str(tmp_path / "m.jsonl") and got["run_dir"] == str(tmp_path / "runs" / "x")


@pytest.mark.parametrize(("text", "says"), [
    ("[train]\nstepz = 3\n", "[train] has no key 'stepz'"),
    ("[training]\nsteps = 3\n", "unknown section [training]"),
    ("[sync]\nlr = 0.1\n", "key 'lr' belongs in [train], not [sync]"),
    ("steps = 3\n", "key 'steps' is outside every section: put it under [train]"),
    ("[train]\nsteps = \n", "not valid TOML"),
    ("[train]\nbatch-size = 4\nbatch_size = 8\n", "sets 'batch_size' twice"),
])
def test_a_bad_file_is_one_line_naming_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        read_config(path, SECTION_OF)
    assert says in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_key_of_another_command_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[cluster]\nlisten = "0.0.0.0:7000"\n')  # the coordinator's, not train's
    with pytest.raises(ConfigError, match="has no key 'listen'"):
        read_config(path, _params("train"))


def test_flags_override_the_file_and_print_config_shows_the_result(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nmodel = "gpt-nano"\nsteps = 5\nlr = 0.01\n[compress]\ncompress = "q8"\n')
    got = RUNNER.invoke(app, ["train", "--config", str(path), "--steps", "9", "--print-config"])
    assert got.exit_code == 0, got.output
    assert 'model = "gpt-nano"' in got.output and "steps = 9" in got.output and "lr = 0.01" in got.output and 'compress = "q8"' in got.output
    again = tmp_path / "again.toml"
    again.write_text(got.output)  # what it printed starts the same run
    assert RUNNER.invoke(app, ["train", "--config", str(again), "--print-config"]).output == got.output


def test_an_unknown_key_stops_the_command_before_it_runs(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[reliability]\ndead-afer = 5\n")
    got = RUNNER.invoke(app, ["train", "--config", str(path), "--single-process"])
    assert got.exit_code == 2 and "dead-afer" in got.output and "[reliability]" in got.output


def test_the_coordinator_takes_its_required_options_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "coord.toml"
    path.write_text(f'[cluster]\nlisten = "127.0.0.1:0"\ntoken-file = "{tmp_path / "token"}"\nworkers = 3\n[sync]\nsync = "hierarchical"\n')
    got = RUNNER.invoke(app, ["coordinator", "--config", str(path), "--print-config"])
    assert got.exit_code == 0, got.output
    assert "workers = 3" in got.output and 'sync = "hierarchical"' in got.output


def _doc_example(tmp_path: Path) -> Path:
    """The first TOML block of docs/config.md."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    path = tmp_path / "run.toml"
    path.write_text(doc.split("```toml\n", 1)[1].split("```", 1)[0])
    return path


def test_the_example_of_docs_config_md_reads(tmp_path: Path) -> None:
    got = RUNNER.invoke(app, ["train", "--config", str(_doc_example(tmp_path)), "--print-config"])
    assert got.exit_code == 0, got.output
    assert 'compress = "adatopk"' in got.output and 'cluster = "local:3"' in got.output


@pytest.mark.slow
def test_the_example_runs_and_its_run_keeps_the_file_that_starts_it_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ["--steps", "2", "--eval-every", "0", "--run-dir", str(run_dir), "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    done = subprocess.run([sys.executable, "-m", "fusionllm", "train", "--config", str(_doc_example(tmp_path)), *flags],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    kept = run_dir / "config.toml"
    assert 'compress = "adatopk"' in kept.read_text() and "steps = 2" in kept.read_text()
    assert json.loads((run_dir / "run.json").read_text())["cluster"]["compress"] == "adatopk"
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) >= 2
    again = RUNNER.invoke(app, ["train", "--config", str(kept), "--print-config"])
    printed = tmp_path / "printed.toml"
    printed.write_text(again.output)
    assert again.exit_code == 0 and read_config(printed, SECTION_OF) == read_config(kept, SECTION_OF)
