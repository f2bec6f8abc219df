"""The benchmarks' shared scaffolding: what a result records, the index made from results, stopping by handle."""

import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import common, index


def test_a_result_records_its_commit_command_machine_and_date(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(common.ROOT)
    monkeypatch.setattr(sys, "argv", ["benchmarks/codec_speed.py", "--quick"])  # as typed at the repository's root
    common.write(tmp_path, "codec_speed", [{"codec": "fp16", "gb_s": 1.5}], ["| codec |", "|---|"], {"quick": True})
    doc = json.loads((tmp_path / "codec_speed.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", doc["commit"]), doc["commit"]
    assert doc["command"] == "python benchmarks/codec_speed.py --quick"
    assert {"hostname", "cores", "memory_gib", "python", "torch"} <= set(doc["machine"]) and doc["machine"]["cores"] >= 1
    assert doc["date"].endswith("UTC") and doc["quick"] is True and doc["results"] == [{"codec": "fp16", "gb_s": 1.5}]
    assert doc["commit"] in (tmp_path / "codec_speed.md").read_text()


def test_the_index_lists_every_result_and_says_what_older_ones_did_not_record(tmp_path: Path) -> None:
    (tmp_path / "e2e" / "quick").mkdir(parents=True)
    new = {"benchmark": "e2e", "commit": "a" * 40 + "-dirty", "command": "python benchmarks/e2e.py --quick", "date": "2026-12-02 19:00 UTC",
           "machine": {"hostname": "vm", "cores": 2, "memory_gib": 7.8, "python": "3.11.7", "torch": "2.5.1"}, "results": []}
    old = {"benchmark": "e2e", "date": "2026-11-30 10:20", "machine": "vm (2 cores, x86_64, Python 3.11.7)", "results": []}
    (tmp_path / "e2e" / "quick" / "e2e.json").write_text(json.dumps(new))
    (tmp_path / "e2e" / "quick" / "e2e.md").write_text("# e2e\n")
    (tmp_path / "e2e" / "e2e.json").write_text(json.dumps(old))
    (tmp_path / "e2e" / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))  # no result: left out
    text = index.render(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == 2
    assert rows[0].startswith("| [e2e/e2e.json](e2e/e2e.json) | 2026-11-30 10:20 | not recorded | not recorded | vm (2 cores")  # no report: the JSON
    assert "[e2e/quick/e2e.json](e2e/quick/e2e.md)" in rows[1] and "aaaaaaaaaaaa-dirty" in rows[1]
    assert "`python benchmarks/e2e.py --quick`" in rows[1] and "vm (2 cores, 7.8 GiB, Python 3.11.7, torch 2.5.1)" in rows[1]


def test_the_committed_index_is_the_one_the_results_give() -> None:
    results = common.RESULTS
    assert (results / "README.md").read_text() == index.render(results), "run: python benchmarks/index.py"
    assert index.DOCS.read_text() == index.render_docs(results), "run: python benchmarks/index.py"


def test_docs_benchmarks_shows_each_reports_first_table_under_its_provenance(tmp_path: Path) -> None:
    (tmp_path / "e2e").mkdir()
    doc = {"benchmark": "e2e", "results": [], "commit": "b" * 40, "command": "python benchmarks/e2e.py --quick", "date": "2026-12-03 10:00 UTC"}
    (tmp_path / "e2e" / "e2e.json").write_text(json.dumps(doc))
    (tmp_path / "e2e" / "e2e.md").write_text("# e2e\n\nintro\n\n| system | loss |\n|---|---|\n| opfence | 2.5 |\n\n| second | table |\n")
    text = index.render_docs(tmp_path)
    assert "#### [e2e/e2e.md](../benchmarks/results/e2e/e2e.md)" in text
    assert "commit bbbbbbbbbbbb, 2026-12-03 10:00 UTC; command: `python benchmarks/e2e.py --quick`" in text
    assert "| opfence | 2.5 |" in text and "| second | table |" not in text


def test_docs_benchmarks_lists_each_script_with_what_it_measures_and_how_to_run_it(tmp_path: Path) -> None:
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "speed.py").write_text('"""Speed of a thing: MB/s.\n\n    python benchmarks/speed.py [--quick]   # a minute\n"""\n')
    (scripts / "helper.py").write_text('"""What speed.py shares."""\n')
    (scripts / "other.py").write_text('"""Another: a second thing."""\nfrom helper import x\n')
    results = tmp_path / "results"
    for name in ("speed", "study"):
        (results / name).mkdir(parents=True)
        (results / name / f"{name}.json").write_text(json.dumps({"benchmark": name, "results": []}))
        (results / name / f"{name}.md").write_text(f"# {name}\n\n| a |\n|---|\n| {name}-row |\n")
    text = index.render_docs(results, scripts)
    assert "| [speed.py](../benchmarks/speed.py) | Speed of a thing: MB/s. | `python benchmarks/speed.py [--quick]` |" in text
    assert "| [helper.py](../benchmarks/helper.py) | What speed.py shares. | imported by `other.py` (no command of its own) |" in text
    assert "| [other.py](../benchmarks/other.py) | Another: a second thing. | no command |" in text
    assert "| speed-row |" in text  # a benchmark's result: its table
    assert "| study-row |" not in text and "- [study/study.md](../benchmarks/results/study/study.md)" in text  # a study's: a link


def test_benchmarks_holds_few_scripts_each_described_and_the_studies_are_listed() -> None:
    scripts = sorted(p for p in (common.ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert 0 < len(scripts) <= 16, [p.name for p in scripts]
    assert (common.ROOT / "benchmarks" / "gpu_check.py").is_file()  # other tooling runs it by this path
    table = index.render_docs(common.RESULTS).split("## Results", 1)[0]
    for path in scripts:
        row = next((line for line in table.splitlines() if line.startswith(f"| [{path.name}]")), None)
        assert row and "| no command |" not in row, f"{path.name}: no usage line (python benchmarks/{path.name} ...) in its docstring and no user"
    studies = sorted(p for p in (common.ROOT / "experiments").iterdir() if p.suffix in (".py", ".sh"))
    readme = (common.ROOT / "experiments" / "README.md").read_text()
    assert studies and all(f"[{p.name}]({p.name})" in readme for p in studies), [p.name for p in studies if f"[{p.name}]" not in readme]


def test_stop_ends_the_processes_it_is_given_and_waits_for_them() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    common.stop([*procs, None], grace=5)
    assert [p.returncode for p in procs] == [-15, -15]  # SIGTERM was enough; both waited for


def test_a_convergence_merge_replaces_only_the_seeds_it_runs_again() -> None:
    from benchmarks import convergence

    runs = [{"cluster": "slow-link", "codec": c, "seed": s, "commit": "a" * 40} for c in ("none", "adatopk") for s in (0, 1, 2, 3)]
    kept = [r for r in runs if not convergence.replaced(r, ["slow-link"], ["adatopk"], [2, 3])]
    assert [(r["codec"], r["seed"]) for r in kept] == [("none", 0), ("none", 1), ("none", 2), ("none", 3), ("adatopk", 0), ("adatopk", 1)]
    lines = convergence.kept_runs(kept, ["slow-link"], ["adatopk"], [2, 3])
    assert lines[-1] == "- commit aaaaaaaaaaaa: slow-link adatopk (seeds 0, 1), slow-link none (seeds 0, 1, 2, 3)", lines


def test_the_vision_goal_needs_accuracy_within_a_point_and_inside_the_seed_spread() -> None:
    import argparse

    from benchmarks import convergence

    args = argparse.Namespace(model="resnet18", task="vision", image_size=32, steps=480, batch_size=16, micro_batches=4, lr=1e-3,
                              warmup=10, accuracy_over=3, eval_every=60, eval_batches=32)

    def goal(none_acc: list[float], codec_acc: list[float]) -> str:
        runs = [{"cluster": "slow-link", "codec": c, "seed": s, "final_val_loss": 0.1, "final_val_accuracy": a, "bytes_per_step_slow": b,
                 "tokens_per_s": 20.0, "val_accuracy_curve": [[59, 50.0], [119, a]], "ratios": {}}
                for c, accs, b in (("none", none_acc, 1000.0), ("adatopk", codec_acc, 80.0)) for s, a in enumerate(accs)]
        rows = [{**runs[0], "final_val_accuracy": sum(none_acc) / 2}, {**runs[2], "final_val_accuracy": sum(codec_acc) / 2}]
        return next(line for line in convergence.vision_table(rows, runs, args) if line.startswith("- slow-link adatopk"))

    assert goal([90.0, 95.0], [89.5, 94.0]).endswith("goal met")  # -0.75 points, spread 5
    assert goal([92.0, 92.5], [91.0, 92.0]).endswith("goal not met")  # -0.75 points, outside a spread of 0.5
    assert goal([90.0, 95.0], [88.0, 94.0]).endswith("goal not met")  # -1.5 points


def test_codec_error_codes_one_cut_with_every_codec_at_the_steps_asked() -> None:
    from experiments import codec_error

    rows = codec_error.measure_run("gpt-micro", 4, [0, 3], ["q8", "eq:0.7", "kltr:2"], seed=0, cut=1, warmup=1)
    assert [(r["step"], r["codec"]) for r in rows] == [(s, c) for s in (0, 3) for c in ("q8", "eq:0.7", "kltr:2")]
    for r in rows:
        assert 0 < r["error"] < 1 and 0 < r["bytes"] < 1, r
    for s in (0, 3):
        mine = {r["codec"]: r for r in rows if r["step"] == s}
        assert mine["q8"]["error"] < mine["eq:0.7"]["error"] and mine["q8"]["bytes"] > mine["eq:0.7"]["bytes"]
