"""`fusionllm report` and the dashboard show a run of several groups as well as a run of one.

The metrics are built here from typed records, in the shapes the coordinator writes. The hierarchical
shapes were taken from a real run (and checked against it):

    fusionllm train --cluster local:4 --sync hierarchical --groups 0,1/2,3 --model gpt-micro --steps 30 \\
        --batch-size 8 --seq-len 64 --eval-every 10 --inner-steps 5 --metrics hier.jsonl

Before this test, such a run's report said "validation loss: not measured" and "balanced by parameters,
None, None micro-batches" over an empty table, and its dashboard said "step 592 of 400", "validation -",
"no plan yet", "?" for every link's bandwidth, and printed events as raw JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusionllm.control.dashboard import Dashboard
from fusionllm.control.status import RunStatus
from fusionllm.core.metrics import (
    EvalRecord,
    EventRecord,
    OuterRecord,
    PlanRecord,
    StepRecord,
    parse_record,
)
from fusionllm.report import write_report
from tests.test_dashboard import CHROMIUM, _chromium

LAYERS = (["wte", "wpe", "drop", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"])
PARAMS = (445_696, 429_568)


def _stages(workers: list[int]) -> list[dict[str, Any]]:
    return [{"stage": i, "workers": [w], "ops": 7, "params": PARAMS[i], "layers": LAYERS[i]} for i, w in enumerate(workers)]


def _hier_run(steps: int = 30, inner: int = 5) -> list[dict[str, Any]]:
    """Two groups (w0,w1 and w2,w3), ``inner`` steps per round, a validation every 2 rounds and at the end.
    Every record counts in the user's steps (``--steps``): each step has one record of each group."""
    groups = [[0, 1], [2, 3]]
    out: list[dict[str, Any]] = [{
        "event": "plan", "sync": "hierarchical", "epoch": 0, "rounds": steps // inner, "fragments": 1, "codec": "q4", "outer_lr": 1.0,
        "outer_momentum": 0.0, "overlap": True, "predicted": {},
        "groups": [{"group": g, "workers": ws, "inner_steps": inner, "stages": _stages(ws), "schedule": "1f1b", "micro_batches": 4,
                    "predicted_step_s": None} for g, ws in enumerate(groups)],
        "workers": {str(w): {"address": f"127.0.0.1:{4000 + w}", "backend": "torch", "device": "cpu", "in_plan": True} for w in range(4)},
    }]
    n = 0
    for r in range(steps // inner):
        for i in range(inner):
            for g, (a, b) in enumerate(groups):
                out.append(StepRecord(step=r * inner + i, loss=5.0 - 0.05 * n, tokens=512 * (n + 1), elapsed_s=0.25 * (n + 1), tokens_per_s=2000.0, lr=1e-3,
                                      grad_norm=1.0, step_s=0.4, bytes={f"w{a}->w{b}": 393_960, f"w{b}->w{a}": 393_964},
                                      cpu_s={str(a): 0.5, str(b): 0.5}, group=g, round=r, inner_step=r * inner + i, steps_total=steps).to_json())
                n += 1
        for g, (a, b) in enumerate(groups):
            c, d = groups[1 - g]
            out.append(OuterRecord(g, 0, r, True, {str(r - 1): {"0": 1.0, "1": 1.0}} if r else {},
                                   {f"w{a}->w{c}": 229_064, f"w{b}->w{d}": 203_836}, 0.23, 0.25 * n).to_json())
        out.append({"event": "outer_check", "fragment": 0, "round": r, "norms": {"0": 0.8, "1": 0.84}, "cosines": {}, "refused": {},
                    "sent_again": [], "scales": {}})  # routine: in the file, not among the events a user reads
        if r % 2 == 1 or r == steps // inner - 1:
            out.append(EvalRecord((r + 1) * inner, 4.0 - 0.02 * n, r + 1, 512 * n, 0.25 * n).to_json())
        if r == 2:
            out.append({"event": "left_out", "fragment": 0, "round": r, "groups": [1], "elapsed_s": 0.25 * n})
    out.append({"event": "outer_bytes", "bytes": {"w0->w2": 1}, "tokens": 512 * n})
    return out


def _sync_run(steps: int = 30) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{
        "event": "plan", "epoch": 0, "scheduler": None, "schedule": "1f1b", "micro_batches": 4, "predicted_step_s": None, "stages": _stages([0, 1]),
        "workers": {str(w): {"address": f"127.0.0.1:{4000 + w}", "backend": "torch", "device": "cpu", "software": {}, "site": None,
                             "in_plan": True, "relay": None} for w in range(2)},
        "bandwidth_bps": {}, "collectives": [], "carried": [],
    }]
    for n in range(steps):
        rec = StepRecord(step=n, loss=5.0 - 0.05 * n, tokens=512 * (n + 1), elapsed_s=0.25 * (n + 1), tokens_per_s=2000.0, lr=1e-3, grad_norm=1.0,
                         step_s=0.25, bytes={"w0->w1": 393_960, "w1->w0": 393_964}, cpu_s={"0": 0.2, "1": 0.2}, rss={"0": [1, 2], "1": [1, 2]})
        if n % 10 == 9:
            rec.val_loss = 4.0 - 0.02 * n
        out.append(rec.to_json())
        if n == 14:
            out.append({"event": "bad_step", "step": 14, "attempt": 0, "suspects": [1], "addresses": {"1": "127.0.0.1:4001"}, "strikes": {"1": 1},
                        "bad": [{"suspect": 1, "detector": 0, "kind": "nan", "edge": "grad w1->w0", "mb": 0, "why": "3 NaN"}], "action": "retry"})
    return out


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _status(lines: list[dict[str, Any]], steps: int) -> RunStatus:
    status = RunStatus("gpt-micro", steps)
    status.state = "running"
    for raw in lines:
        (status.event if "event" in raw else status.step)(raw)
    return status


def test_records_read_back_as_their_types_and_keep_keys_they_do_not_know() -> None:
    raw = {"step": 3, "loss": 2.5, "tokens": 10, "elapsed_s": 1.0, "tokens_per_s": 10.0, "lr": 0.1, "grad_norm": None, "step_s": 0.2, "bytes": {},
           "cpu_s": {}, "val_loss": 2.4, "val_accuracy": 0.5, "group": 1, "round": 0, "inner_step": 3, "steps_total": 8, "new_key": [1, 2]}
    rec = parse_record(raw)
    assert isinstance(rec, StepRecord) and rec.val_metrics == {"accuracy": 0.5} and rec.extra == {"new_key": [1, 2]} and rec.group == 1
    assert {k: v for k, v in rec.to_json().items()} == {k: v for k, v in raw.items() if v is not None}
    for line in _hier_run()[:80] + _sync_run()[:20]:
        typed = parse_record(line)
        assert typed.to_json() == line, line  # every record the coordinator writes survives its type
    assert isinstance(parse_record({"event": "eval", "step": 10, "val_loss": 3.0}), EvalRecord)
    assert isinstance(parse_record({"event": "outer", "oops": 1}), EventRecord)  # a malformed typed event still reads
    assert isinstance(parse_record(_hier_run()[0]), PlanRecord)


def test_the_report_of_a_hierarchical_run_shows_its_groups_outer_syncs_and_validation(tmp_path: Path) -> None:
    text = write_report(_write(tmp_path / "hier.jsonl", _hier_run()), tmp_path / "out").read_text()
    assert "| validation loss (outer weights) | 2.8000 at step 29 |" in text and "not measured" not in text
    assert "| steps | 30 (step 0 to 29, each trained by every group) |" in text and "checked" not in text
    assert "## Plan (2 groups, balanced by parameters, 5 inner steps per outer round, 6 rounds, outer codec q4, outer lr 1.0)" in text
    assert "None" not in text
    for g, (a, b) in enumerate([(0, 1), (2, 3)]):
        assert f"### Group {g}: workers w{a}, w{b}, 5 inner steps, 1f1b, 4 micro-batches" in text
        assert f"| 0 | w{a} | wte, wpe, drop, h.0, h.1 | 445,696 |" in text and f"| 1 | w{b} | h.2, h.3, ln_f, lm_head | 429,568 |" in text
    assert "| groups | group 0: 30 steps" in text and "| outer syncs | 12, " in text
    assert "## Outer syncs" in text and "| w0->w2 | 1.3 MiB |" in text  # 6 rounds of 229,064 bytes
    assert "- outer round 2 of fragment 0: group 1 left out (too late)" in text and '{"' not in text


def test_the_report_of_a_synchronous_run_reads_as_before(tmp_path: Path) -> None:
    text = write_report(_write(tmp_path / "sync.jsonl", _sync_run()), tmp_path / "out").read_text()
    assert "| steps | 30 (step 0 to 29) |" in text and "| validation loss | 3.4200 at step 29 |" in text
    assert "## Plan (balanced by parameters, 1f1b, 4 micro-batches)" in text and "| 0 | w0 | wte, wpe, drop, h.0, h.1 | 445,696 |" in text
    assert "- step 14: bad step (attempt 0), suspects w1, nan grad w1->w0 from worker 1: 3 NaN; retry" in text
    assert "outer" not in text and "Group" not in text and "None" not in text


def test_the_status_of_a_hierarchical_run_counts_the_users_steps_and_every_groups_outer_syncs() -> None:
    st = _status(_hier_run(), 30).to_json()
    assert st["steps"] == 30 and st["records"][-1]["step"] + 1 == 30  # not "step 60 of 30", nor "step 580 of 2000" for --steps 1000
    assert st["validation"][-1] == {"step": 30, "val_loss": pytest.approx(2.8), "metrics": {}}
    view = st["plan_view"]
    assert view["hierarchical"] and [g["workers"] for g in view["groups"]] == [[0, 1], [2, 3]]
    assert [g["progress"]["steps"] for g in view["groups"]] == [30, 30] and view["groups"][1]["progress"]["outer_syncs"] == 6
    assert st["links"]["w0->w2"]["outer_bytes"] == 6 * 229_064 and st["outer"]["syncs"] == 12
    assert [e["text"] for e in st["events"]] == ["step 10: validation loss 3.6000 (outer round 2)", "outer round 2 of fragment 0: group 1 left out (too late)",
                                                 "step 20: validation loss 3.2000 (outer round 4)", "step 30: validation loss 2.8000 (outer round 6)"]


@contextlib.contextmanager
def _serving(status: RunStatus) -> Iterator[str]:
    """The dashboard of ``status``, served from a thread of this process."""
    loop = asyncio.new_event_loop()
    dash = Dashboard(status)
    port = loop.run_until_complete(dash.start("127.0.0.1:0"))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        asyncio.run_coroutine_threadsafe(dash.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _text(dom: str) -> str:
    """What the page shows: its text without the markup, the script and the style."""
    shown = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", shown))


@pytest.mark.slow  # a browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian chromium package (apt-get install chromium)")
def test_the_dashboard_shows_a_hierarchical_run_as_groups(tmp_path: Path) -> None:
    with _serving(_status(_hier_run(), 30)) as url:
        dom = _chromium(url, tmp_path / "profile", "--dump-dom")
    (tmp_path / "hier.html").write_text(dom)
    text = _text(dom)
    assert "step 30 of 30" in text and "validation 2.800 after 30 steps" in text and "2 groups, 12 outer syncs" in text
    assert "no plan yet" not in text and "2 groups, balanced by parameters, 5 inner steps per outer round" in text
    assert "group 0: w0, w1, 5 inner steps, 4 micro-batches" in text and "group 1: w2, w3, 5 inner steps" in text
    assert "30 steps · outer round 6 of 6" in text and "6 outer syncs (" in text
    assert sorted(re.findall(r'<td class="worker">(w\d)</td>', dom)) == ["w0", "w1", "w2", "w3"]  # each group's stages
    assert re.search(r"w0-&gt;w2 - - - 1\.3 MiB", text), text  # the outer syncs' bytes on their link
    assert "bandwidth not probed" in text and "?" not in text
    assert "outer syncs: 12, 5.0 MiB in all; last: group 1: outer sync of round 5 (fragment 0), sent 422.8 KiB, applied round(s) 4" in text
    assert "group 1 left out (too late)" in text and "{&quot;" not in dom and '{"event"' not in dom
    for w in range(4):
        assert f'data-worker="{w}"' in dom


@pytest.mark.slow  # a browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian chromium package (apt-get install chromium)")
def test_the_dashboard_shows_a_synchronous_run_as_one_plan(tmp_path: Path) -> None:
    with _serving(_status(_sync_run(), 30)) as url:
        dom = _chromium(url, tmp_path / "profile", "--dump-dom")
    text = _text(dom)
    assert "step 30 of 30" in text and "validation 3.420 after 30 steps" in text and "groups" not in text.split("Plan")[0]
    assert "balanced by parameters, 1f1b, 4 micro-batches" in text and "group 0" not in text
    assert sorted(re.findall(r'<td class="worker">(w\d)</td>', dom)) == ["w0", "w1"]
    assert "w0-&gt;w1 - 385 KiB raw -" in text and "outer syncs:" not in text
    assert "step 14: bad step (attempt 0), suspects w1, nan grad w1-&gt;w0 from worker 1: 3 NaN; retry" in text and '{"event"' not in dom


def test_a_run_of_two_groups_counts_in_the_users_steps_on_every_view(tmp_path: Path) -> None:
    """Why it can fail: a run of groups that counts every group's inner steps as steps of its own
    (the dashboard said "step 580 of 2000" and the progress bar "400/400" for ``--steps 200`` with two
    groups), or that lists a routine outer check among the events a user reads."""
    from fusionllm.cli.common import progress_bar
    from fusionllm.core.config import TrainConfig
    from fusionllm.core.metrics import read_metrics
    from fusionllm.launch.inprocess import InProcessCluster, cluster_config

    steps = 8
    train = TrainConfig(model="gpt-nano", steps=steps, batch_size=4, seq_len=16, warmup=0, metrics=str(tmp_path / "m.jsonl"))
    cluster = cluster_config(2, sync="hierarchical", groups=[[0], [1]], inner_steps=2, fragments=1, micro_batches=1, eval_every=4, eval_batches=1)
    bar, on_step, _ = progress_bar(steps, "train")

    async def main() -> tuple[dict[str, Any], list[dict]]:
        async with InProcessCluster(train, cluster, on_step=on_step) as c:
            await c.run()
            assert c.coordinator is not None
            return c.coordinator.status.to_json(), c.steps

    status, records = asyncio.run(main())
    assert sorted(r["step"] for r in records) == sorted(list(range(steps)) * 2)  # one record of each group per user step
    assert {r["steps_total"] for r in records} == {steps} and status["steps"] == steps
    assert bar.tasks[0].completed == bar.tasks[0].total == steps
    m = read_metrics(tmp_path / "m.jsonl")
    assert [e["step"] for e in m.of("eval")] == [4, 8]
    assert m.of("outer_check") and not [e for e in status["events"] if e["event"] == "outer_check"]  # in the file, not an event
    assert all("{" not in e["text"] for e in status["events"]), status["events"]
