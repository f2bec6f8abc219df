"""The one metrics reader: plan, step and event records from the file the coordinator writes."""

from pathlib import Path

import pytest

from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import JsonlWriter, read_metrics


def _write(path: Path, records: list[dict]) -> None:
    with JsonlWriter(path) as w:
        for r in records:
            w.write(r)


def test_a_metrics_file_reads_back_split_into_plans_steps_and_events(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    plan, again = {"event": "plan", "epoch": 0}, {"event": "plan", "epoch": 1}
    steps = [{"step": 0, "loss": 2.5}, {"step": 1, "loss": 2.25}, {"step": 1, "loss": 2.0}]
    recovery, evaluation = {"event": "recovery", "lost": [2]}, {"event": "eval", "step": 2, "val_loss": 1.5}
    _write(tmp_path / "m.jsonl", [plan, steps[0], steps[1], recovery, again, steps[2], evaluation])
    m = read_metrics(path)
    assert m.plans == [plan, again] and m.plan == again  # the plan in force at the end
    assert m.steps == steps and m.losses() == [2.5, 2.25, 2.0]
    assert m.events == [recovery, evaluation] and m.of("eval") == [evaluation]  # an event with a step is an event
    assert m.records == [plan, steps[0], steps[1], recovery, again, steps[2], evaluation]


def test_a_line_still_being_written_is_left_out_and_a_bad_line_named(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')  # a writer mid-line
    assert read_metrics(path).losses() == [1.0]
    path.write_text('{"step": 0, "loss": 1.0}\nnot json\n{"step": 1, "loss": 0.5}\n')
    with pytest.raises(ConfigError, match="m.jsonl:2: not JSON"):
        read_metrics(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="m.jsonl:1: not a JSON object"):
        read_metrics(path)


def test_a_missing_file_is_an_error_unless_allowed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such metrics file"):
        read_metrics(tmp_path / "none.jsonl")
    empty = read_metrics(tmp_path / "none.jsonl", missing_ok=True)
    assert empty.records == [] and empty.plan is None
