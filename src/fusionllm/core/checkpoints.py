"""Where checkpoints live: ``<dir>/step-<NNNNNN>/``, complete once ``state.json`` is in it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PREFIX = "step-"


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file())
    return done[-1] if done else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest complete checkpoints (incomplete ones are never touched
    here: a writer may be filling one); returns what was removed."""
    root = Path(root)
    if keep < 1 or not root.is_dir():
        return []
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file())
    gone = done[:-keep]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def begin_checkpoint(root: str | Path, step: int) -> tuple[Path, Path]:
    """(an empty temporary directory to write ``step``'s checkpoint into, its final path)."""
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp, root / f"{PREFIX}{step:06d}"


def finish_checkpoint(tmp: Path, final: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (``state.json`` last: a directory without it is incomplete), then rename the
    temporary directory into place and make the rename durable."""
    for name in sorted(files, key=lambda n: n == "state.json"):
        with open(tmp / name, "w") as fh:
            fh.write(files[name])
            fh.flush()
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final
