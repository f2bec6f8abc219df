"""`--log-to tensorboard[:DIR]`: a run's records as TensorBoard scalars and text, beside the JSON lines.

Each step record becomes scalars at its step (tags grouped as TensorBoard shows them):

- ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/step_s``;
- ``val/loss`` and ``val/<metric>`` (a task's accuracy) where the step evaluated;
- ``bytes/<link>``: bytes sent on each link that step; ``codec_ratio/<link>``: AdaTopK's byte target;
- ``busy/<worker>``: the worker's CPU seconds over the step's seconds.

A hierarchical run's records carry their group: ``group<g>/train/loss`` and so on. Events (the plan,
a recovery, a re-plan, a bad step, a regrouping) are text under ``events`` at the last step written,
as their JSON line. ``metrics_writer`` opens the JSON-lines file and, when asked, the event file: one
``write``, one ``close``.

TensorBoard is an optional dependency (``pip install fusionllm[tensorboard]``); torch's
``SummaryWriter`` writes the files, imported only when a run asks for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import JsonlWriter

KINDS = ("tensorboard",)
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_s")


def parse_log_to(text: str | None, metrics: str | None) -> Path | None:
    """``tensorboard`` or ``tensorboard:DIR`` -> the event directory (default: ``tensorboard/`` beside
    the metrics file, else ``runs/tensorboard``); None: no TensorBoard."""
    if not text:
        return None
    kind, sep, where = text.partition(":")
    if kind not in KINDS or (sep and not where):
        raise ConfigError(f"--log-to {text!r}: expected tensorboard or tensorboard:DIR")
    if where:
        return Path(where)
    return Path(metrics).parent / "tensorboard" if metrics else Path("runs") / "tensorboard"


class TensorBoardWriter:
    """Step records and events into a TensorBoard event file in ``directory``."""

    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--log-to tensorboard needs the tensorboard package: pip install fusionllm[tensorboard]") from None
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory))
        self._step = 0

    def write(self, record: dict[str, Any]) -> None:
        if "event" in record:
            self._writer.add_text("events", f"{record['event']}: {json.dumps(record, separators=(',', ':'), default=str)}", self._step)
            return
        if "step" not in record or "loss" not in record:
            return
        step = self._step = int(record["step"])
        prefix = f"group{record['group']}/" if record.get("group") is not None else ""
        scalars = {f"train/{k}": record[k] for k in TRAIN_KEYS if isinstance(record.get(k), (int, float))}
        scalars.update({f"val/{k[4:]}": v for k, v in record.items() if k.startswith("val_") and isinstance(v, (int, float))})
        scalars.update({f"bytes/{link}": v for link, v in (record.get("bytes") or {}).items()})
        scalars.update({f"codec_ratio/{link}": v for link, v in (record.get("ratios") or {}).items()})
        step_s = record.get("step_s") or 0.0
        if step_s > 0:
            scalars.update({f"busy/{w}": cpu / step_s for w, cpu in (record.get("cpu_s") or {}).items()})
        for tag, value in scalars.items():
            self._writer.add_scalar(prefix + tag, float(value), step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class MetricsWriter:
    """The JSON-lines file and, with ``--log-to tensorboard``, the event file: written together."""

    def __init__(self, metrics: str | None, log_to: str | None = None) -> None:
        self.jsonl = JsonlWriter(metrics)
        where = parse_log_to(log_to, metrics)
        self.tensorboard = TensorBoardWriter(where) if where is not None else None

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
