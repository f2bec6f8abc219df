"""One RunConfig from a run's options (``core/options.py``), built once.

`fusionllm train` and `fusionllm coordinator` take the same options (one ``Options`` object) and turn
them into a run with these functions; `train --cluster` writes the run to ``run.json`` and the coordinator it starts reads
that file (``load_run``) and builds nothing again. Each option has one default, the command's; the
validation and evaluation settings are the TrainConfig's, and the coordinator's copy of them
(``ClusterConfig.eval_every``, ``eval_batches``) is taken from it, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from fusionllm.control.config import ClusterConfig, RunConfig
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.options import Options, SyncMode
from fusionllm.transport.tls import TlsFiles


def task_model(task: str, model: str) -> str:
    """``--model`` for ``--task``: the vision task's default model is resnet18 (not the LM default)."""
    return "resnet18" if task == "vision" and model == "gpt-micro" else model


def wire_codec(compress: str, precision: str) -> str:
    """``--precision bf16`` sends activations and gradients as bf16 unless ``--compress`` names a codec."""
    return "bf16" if precision == "bf16" and compress == "none" else compress


def parse_replicas(text: str | None) -> list[int] | None:
    """``--replicas 1,2``: workers per stage."""
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--replicas {text!r}: expected comma-separated worker counts such as 1,2") from None


def parse_groups(text: str | None) -> list[list[int]] | None:
    """``0,1/2/3`` -> [[0, 1], [2], [3]]."""
    if not text:
        return None
    try:
        return [[int(w) for w in part.split(",")] for part in text.split("/")]
    except ValueError:
        raise ConfigError(f"--groups {text!r}: worker ids with ',' inside a group and '/' between groups, e.g. 0,1/2/3") from None


def parse_regroup(texts: list[str] | None) -> list[tuple[int, list[list[int]]]] | None:
    """``["40:0/1/2", "80:0,1,2"]`` -> [(40, [[0], [1], [2]]), (80, [[0, 1, 2]])]."""
    if not texts:
        return None
    out = []
    usage = "STEP:GROUPS, e.g. 40:0/1/2 (three groups from step 40) or 80:0,1,2 (one synchronous group)"
    for text in texts:
        step, sep, groups = text.partition(":")
        try:
            out.append((int(step), parse_groups(groups) or []))
        except (ValueError, ConfigError):
            raise ConfigError(f"--regroup {text!r}: {usage}") from None
        if not sep or not out[-1][1]:
            raise ConfigError(f"--regroup {text!r}: {usage}")
    return out


def train_config(options: Options, *, task: str | None = None) -> TrainConfig:
    """The TrainConfig of a run's options: every TrainConfig field an option names, by that name
    (``task``: the task's import path where the options hold a Task object or factory)."""
    t = options.train
    given = {f.name: getattr(t, f.name) for f in fields(TrainConfig) if hasattr(t, f.name)}
    task = task or str(t.task)
    return TrainConfig(**{**given, "model": task_model(task, t.model), "task": task, "metrics": str(t.metrics) if t.metrics else None})


def default_sync(sync: str | None, *, scheduler: str | None, groups: str | None, replicas: str | None,
                 regroup: list[str] | None, resume: bool) -> SyncMode:
    """``train --cluster``'s ``--sync`` when none is given: ``auto`` (the planner picks one group or several
    by predicted time to a target loss) when a planner forms the plan and nothing is given by hand;
    ``synchronous`` otherwise (a resumed run keeps the mode it is given; ``--scheduler dp`` asks for
    one data-parallel plan)."""
    if sync is not None:
        return sync  # type: ignore[return-value]
    return "auto" if scheduler and scheduler != "dp" and not (groups or replicas or regroup or resume) else "synchronous"


def cluster_config(options: Options, train: TrainConfig, *, listen: str, token: str, workers: int, **resolved: Any) -> ClusterConfig:
    """The ClusterConfig of a run's options: every ClusterConfig field an option names, by that name, in the
    form the coordinator reads (lists parsed, paths as strings, the wire codec of ``--precision``);
    ``resolved``: options the launcher settled for this run (``sync``, ``scheduler``, ``hardware``)."""
    v = {**options.values(), **resolved}
    given = {f.name: v[f.name] for f in fields(ClusterConfig) if f.init and f.name in v}
    return ClusterConfig(**{
        **given, "listen": listen, "token": token, "workers": workers, "sync": v["sync"] or "synchronous",
        "replicas": parse_replicas(v["replicas"]), "groups": parse_groups(v["groups"]), "regroup": parse_regroup(v["regroup"]),
        "checkpoint_dir": str(v["checkpoint_dir"]) if v["checkpoint_dir"] else None, "hardware": str(v["hardware"]) if v["hardware"] else None,
        "compress": wire_codec(v["compress"], train.precision), "eval_every": train.eval_every, "eval_batches": train.eval_batches,
        "tls": TlsFiles.load(v["tls_cert"], v["tls_key"], v["tls_ca"]),
    })


def load_run(path: Path, *, listen: str, token: str, workers: int) -> RunConfig:
    """The run ``fusionllm train`` wrote (``run.json``), with what only the coordinator's command line says."""
    return RunConfig.from_json(path.read_text(), listen=listen, token=token, workers=workers)
