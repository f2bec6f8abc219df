"""One RunConfig from the command line, built once.

`fusionllm train` and `fusionllm coordinator` take the same options and turn them into a run with
these functions; `train --cluster` writes the run to ``run.json`` and the coordinator it starts reads
that file (``load_run``) and builds nothing again. Each option has one default, the command's; the
validation and evaluation settings are the TrainConfig's, and the coordinator's copy of them
(``ClusterConfig.eval_every``, ``eval_batches``) is taken from it, so the two cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fusionllm.control.config import ClusterConfig, RunConfig
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
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


def train_config(*, model: str, task: str, metrics: Path | str | None, **fields: Any) -> TrainConfig:
    """The TrainConfig of a command's options (``fields``: TrainConfig's, by name)."""
    return TrainConfig(model=task_model(task, model), task=task, metrics=str(metrics) if metrics else None, **fields)


def default_sync(sync: str | None, *, scheduler: str | None, groups: str | None, replicas: str | None,
                 regroup: list[str] | None, resume: bool) -> str:
    """``train --cluster``'s ``--sync`` when none is given: ``auto`` (the planner picks one group or several
    by predicted time to a target loss) when a planner forms the plan and nothing is given by hand;
    ``synchronous`` otherwise (a resumed run keeps the mode it is given)."""
    if sync is not None:
        return sync
    return "auto" if scheduler and not (groups or replicas or regroup or resume) else "synchronous"


def cluster_config(train: TrainConfig, *, listen: str, token: str, workers: int, replicas: str | None,
                   checkpoint_dir: Path | str | None, compress: str, tls: tuple[Path | None, Path | None, Path | None],
                   dead_after: float, numeric_guard: str, hardware: Path | str | None, sync: str, groups: str | None,
                   blocking_sync: bool, regroup: list[str] | None = None, **fields: Any) -> ClusterConfig:
    """The ClusterConfig of a command's options; ``fields`` are ClusterConfig's, by name."""
    return ClusterConfig(
        listen=listen, token=token, workers=workers, replicas=parse_replicas(replicas),
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, compress=wire_codec(compress, train.precision),
        eval_every=train.eval_every, eval_batches=train.eval_batches, tls=TlsFiles.load(*tls), dead_after_s=dead_after,
        guard=numeric_guard, hardware=str(hardware) if hardware else None, sync=sync, groups=parse_groups(groups),
        overlap=not blocking_sync, regroup=parse_regroup(regroup), **fields,
    )


def load_run(path: Path, *, listen: str, token: str, workers: int) -> RunConfig:
    """The run ``fusionllm train`` wrote (``run.json``), with what only the coordinator's command line says."""
    return RunConfig.from_json(path.read_text(), listen=listen, token=token, workers=workers)
