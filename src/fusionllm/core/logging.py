"""One logger for the whole package; level from FUSIONLLM_LOGLEVEL, lines prefixed by role."""

from __future__ import annotations

import logging
import os

_ROOT = "fusionllm"
_configured = False


def get_logger(name: str, role: str = "") -> logging.LoggerAdapter:
    """Return a logger under `fusionllm.<name>` whose lines start with `[role]` when given."""
    global _configured
    if not _configured:
        root = logging.getLogger(_ROOT)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("FUSIONLLM_LOGLEVEL", "WARNING").upper())
        root.propagate = False
        _configured = True
    logger = logging.getLogger(f"{_ROOT}.{name}")
    return _Prefixed(logger, {"role": role})


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[override]
        role = self.extra.get("role") if self.extra else ""
        return (f"[{role}] {msg}" if role else msg), kwargs
