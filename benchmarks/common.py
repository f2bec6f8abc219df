"""What every benchmark shares: where results go, what they record, processes, metrics and plots.

A benchmark's results are a report: ``write`` puts ``<name>.json`` and ``<name>.md`` in
``benchmarks/results/<script>/`` (``results_dir``; a variant, such as another task or cluster, in a
subfolder), and every JSON records what was measured and how (``provenance``): the commit (with
``-dirty`` when the tree had changes), the command line, the machine and the date.
``python benchmarks/index.py`` lists them all in ``benchmarks/results/README.md``.

Processes a benchmark starts are stopped by the handles it holds (``stop``); those of a local
cluster by the PIDs it wrote to its run directory (``cluster_pids``), never by name. Metrics files
are read with the project's one reader (``read_metrics``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fusionllm
from fusionllm.core.metrics import Metrics, read_metrics
from fusionllm.launch.local_cluster import ClusterPids, read_pids, stop_processes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["RESULTS", "ROOT", "ClusterPids", "Metrics", "cluster_pids", "commit", "exit_on_sigterm", "kept_provenance", "machine", "provenance",
           "pyplot", "read_metrics", "results_dir", "stop", "training_steps", "write"]
PROVENANCE = ("commit", "command", "machine", "date")


def results_dir(script: str, *variant: str) -> Path:
    """``benchmarks/results/<script>[/<variant>...]``: the default ``--out`` of a benchmark."""
    return RESULTS.joinpath(script, *variant)


# ---- what a result records ------------------------------------------------------------------------
def commit() -> str:
    """The checkout's commit, with ``-dirty`` if tracked files had changes; "unknown" outside git.
    ``$FUSIONLLM_COMMIT``, when set, wins, with "(copy)" after it: a copy of the tree on another machine
    (the GPU machine) may carry a stale ``.git`` that names an older commit."""
    copied = os.environ.get("FUSIONLLM_COMMIT", "").strip()
    if copied:
        return f"{copied} (copy)"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """Hostname, cores, memory, Python and torch of this machine."""
    memory = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
        memory = round(int(line.split()[1]) / (1 << 20), 1)
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"hostname": platform.node(), "cores": os.cpu_count(), "memory_gib": memory, "arch": platform.machine(),
            "python": platform.python_version(), "torch": torch_version}


def provenance() -> dict[str, Any]:
    """The commit, command line, machine and date (UTC) of the measurement running now."""
    script = Path(sys.argv[0]).resolve()
    argv = [script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]]
    doc = {"commit": commit(), "command": shlex.join(["python", *argv]), "machine": machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    imported = Path(fusionllm.__file__).resolve().parents[1]
    if imported != ROOT / "src":  # the commit above is this checkout's: say so when the code measured came from elsewhere
        doc["fusionllm_from"] = str(imported)
    return doc


def kept_provenance(doc: dict[str, Any]) -> dict[str, Any]:
    """The provenance of results measured earlier (a ``--report`` that only renders them again):
    what the old JSON recorded, "not recorded" where it predates these fields."""
    return {k: doc.get(k, "not recorded") for k in PROVENANCE}


def describe_machine(m: Any) -> str:
    """One line for a machine as a result recorded it (a dict now, a string in older results)."""
    if not isinstance(m, dict):
        return str(m or "not recorded")
    mem = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    torch_ = f", torch {m['torch']}" if m.get("torch") else ""
    return f"{m.get('hostname')} ({m.get('cores')} cores{mem}, Python {m.get('python')}{torch_})"


def write(out: Path, name: str, results: Any, table: list[str], meta: dict[str, Any] | None = None) -> None:
    """``out/<name>.json`` (provenance, ``meta``, results) and ``out/<name>.md`` (a header, ``table``).
    ``meta`` may carry the provenance of results measured earlier (``kept_provenance``)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, **provenance(), **(meta or {}), "results": results}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    header = [f"# {name}", "", f"{doc['date']}, commit {doc['commit']}, {describe_machine(doc['machine'])}", "",
              f"Command: `{doc['command']}`", ""]
    (out / f"{name}.md").write_text("\n".join(header + table) + "\n")
    print("\n".join(table))


# ---- processes -------------------------------------------------------------------------------------
def stop(procs: Iterable[subprocess.Popen | None], grace: float = 5.0, *, resume: bool = False) -> None:
    """Stop the processes this benchmark started, by handle: SIGTERM, ``grace`` seconds, SIGKILL,
    and wait for each. ``resume`` first continues any it had stopped (SIGSTOP), so SIGTERM lands."""
    stop_processes([p for p in procs if p is not None], grace, resume=resume)


def cluster_pids(run_dir: Path, timeout: float = 0.0) -> ClusterPids:
    """The PIDs a local cluster (``fusionllm train --cluster local:N --run-dir run_dir``) started, from
    its run directory; waits up to ``timeout`` seconds for the file."""
    deadline = time.monotonic() + timeout
    while (pids := read_pids(run_dir)) is None:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{run_dir}: no PIDs file (is it a local cluster's run directory?)")
        time.sleep(0.05)
    return pids


# ---- metrics and plots -----------------------------------------------------------------------------
def exit_on_sigterm() -> None:
    """SIGTERM unwinds like an error (``SystemExit``): a testbed's ``with`` takes its namespaces down
    and the ``finally`` blocks stop what the benchmark started. A benchmark started in the background
    (``nohup ... &``) ignores SIGINT, so SIGTERM is how it is stopped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def training_steps(records: list[dict]) -> list[dict]:
    """Step records without the steps right after an evaluation (those also carry the evaluation's
    forward passes in their ``bytes``)."""
    return [r for i, r in enumerate(records) if i == 0 or "val_loss" not in records[i - 1]]


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, imported when a benchmark plots (not before)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
