"""Where checkpoints live: ``<dir>/step-<NNNNNN>/``, complete once ``state.json`` is in it."""

from __future__ import annotations

from pathlib import Path

PREFIX = "step-"


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file())
    return done[-1] if done else None
