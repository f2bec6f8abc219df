"""`fusionllm report`: a metrics file becomes markdown and PNG plots; bad input is one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusionllm.core.errors import ConfigError
from fusionllm.report import write_report


def _metrics(path: Path) -> Path:
    lines = [{"event": "plan", "scheduler": "opfence", "schedule": "1f1b", "micro_batches": 4,
              "stages": [{"stage": 0, "workers": [0], "layers": ["wte", "h.0"], "params": 1000}, {"stage": 1, "workers": [1], "layers": ["h.1", "lm_head"], "params": 2000}]}]
    for step in range(30):
        rec = {"step": step, "loss": 5.0 - step * 0.05, "elapsed_s": 0.2 * (step + 1), "tokens_per_s": 5000.0, "step_s": 0.2, "predicted_step_s": 0.19,
               "bytes": {"w0->w1": 100_000, "w1->w0": 90_000}, "ratios": {"w0->w1": 0.1, "w1->w0": 1.0}, "compress": "adatopk"}
        if step:
            rec["noise_scale"] = 2.0 * step
        if step % 10 == 9:
            rec["val_loss"] = 4.0 - step * 0.03
        lines.append(rec)
        if step == 14:
            lines.append({"event": "recovery", "lost": [2], "workers": 2, "resumed_from_step": 10, "seconds": 0.1, "why": "test"})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_report_writes_markdown_and_plots(tmp_path: Path) -> None:
    report = write_report(_metrics(tmp_path / "m.jsonl"), tmp_path / "out")
    text = report.read_text()
    assert "| steps | 30 (step 0 to 29) |" in text and "3.1300 at step 29" in text and "median step 0.200 s" in text
    assert "| gradient noise scale | 58 rows at step 29 (16 at step 8) |" in text
    assert "| 1 | w1 | h.1, lm_head | 2,000 |" in text and "- lost worker 2 (test): recovered with 2 workers from step 10 in 0.1 s" in text
    for name in ("loss.png", "tokens.png", "bytes.png", "ratios.png"):
        assert (tmp_path / "out" / name).stat().st_size > 5000 and f"]({name})" in text


@pytest.mark.slow  # the `fusionllm` command
def test_report_cli_and_bad_input(tmp_path: Path) -> None:
    metrics = _metrics(tmp_path / "run" / "m.jsonl")
    proc = subprocess.run([sys.executable, "-m", "fusionllm", "report", str(metrics.parent)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "report" / "report.md").exists()
    (tmp_path / "bad.jsonl").write_text("{}\nnot json\n")
    with pytest.raises(ConfigError, match="bad.jsonl:2: not JSON"):
        write_report(tmp_path / "bad.jsonl", tmp_path / "x")
    with pytest.raises(ConfigError, match="no such metrics file"):
        write_report(tmp_path / "absent.jsonl", tmp_path / "x")
    bad = subprocess.run([sys.executable, "-m", "fusionllm", "report", str(tmp_path / "absent.jsonl")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no such metrics file" in bad.stderr and "Traceback" not in bad.stderr


def test_a_tasks_metric_is_reported_next_to_the_loss(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    rows = [{"step": i, "loss": 2.3 - 0.01 * i, "tokens": 16 * (i + 1), "elapsed_s": 0.5 * (i + 1), "tokens_per_s": 32.0} for i in range(6)]
    rows[2] |= {"val_loss": 2.2, "val_accuracy": 0.25}
    rows[5] |= {"val_loss": 2.1, "val_accuracy": 0.375}
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(metrics, tmp_path / "out").read_text()
    assert "| validation accuracy | 0.3750 at step 5 |" in text and "| validation loss | 2.1000 at step 5 |" in text
