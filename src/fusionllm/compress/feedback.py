"""Error feedback: what compression dropped from a gradient is added to the next one sent on that link."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np


class ErrorFeedback:
    """Residuals per key (edge, destination, micro-batch slot), kept by the sender."""

    def __init__(self) -> None:
        self._residual: dict[Hashable, np.ndarray] = {}

    def apply(self, key: Hashable, grad: np.ndarray, compress: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Compress ``grad`` plus the residual; keep the new residual; return what the receiver gets."""
        total = grad + self._residual[key] if key in self._residual and self._residual[key].shape == grad.shape else grad
        sent = compress(total)
        self._residual[key] = total - sent
        return sent

    def residual(self, key: Hashable) -> np.ndarray | None:
        return self._residual.get(key)

    def put(self, key: Hashable, residual: np.ndarray | None) -> None:
        """Set ``key``'s residual as it was (``None``: none), e.g. before a step that runs again."""
        if residual is None:
            self._residual.pop(key, None)
        else:
            self._residual[key] = residual

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s residual (its sender stopped feeding it back)."""
        self._residual.pop(key, None)

    def snapshot(self) -> dict[Hashable, np.ndarray]:
        """The residuals as they are (``apply`` replaces them, never changes one in place)."""
        return dict(self._residual)

    def restore(self, saved: dict[Hashable, np.ndarray]) -> None:
        """Back to a ``snapshot``: a step that was not applied leaves no residual behind."""
        self._residual = dict(saved)

    def clear(self) -> None:
        self._residual.clear()
