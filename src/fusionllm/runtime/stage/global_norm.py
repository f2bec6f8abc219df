"""The global gradient norm, gathered from every worker, and the step's verdict with it.

``STEP`` clips by the norm of all the model's gradients, which no worker holds: each sends its
share (a flag, then the squared norm of each parameter it owns, counted once over replicas and tied
copies, in float64) to every other over the data plane, and each adds all of them up exactly
(``math.fsum``: the correctly rounded sum, whatever the order), so every worker gets the same total
bit for bit, and the same as one process that sums the squares of all its gradients the same way
(``runtime/reference/single.py``): however the plan splits the model, the clipping coefficient is the same
float, and the run stays bitwise equal to one process. The flag says whether the worker saw a bad
tensor (the numeric guards): this exchange, which every step does anyway, is how every worker learns
that one of them did, and then none of them applies the update. A share itself is checked like any
received tensor.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable

import numpy as np

from fusionllm.core.errors import FusionError
from fusionllm.runtime.stage.guards import NumericGuard
from fusionllm.runtime.stage.step import StepState
from fusionllm.runtime.worker.peers import Inbox, PeerNet


def total_sq(squares: Iterable[float]) -> float:
    """The sum of per-tensor squared norms, correctly rounded: independent of how they are grouped and
    ordered (infinite where it overflows float64, as a plain sum would be)."""
    try:
        return math.fsum(squares)
    except OverflowError:
        return math.inf


async def gather_norm_sq(
    st: StepState, squares: list[float], *, worker: int, workers: list[int], peers: PeerNet, inbox: Inbox, guard: NumericGuard | None, timeout: float,
) -> float:
    """The squared global gradient norm from this worker's per-tensor ``squares`` and every other
    worker's; sets ``st.skipped`` where a guard saw a bad tensor anywhere."""
    others = [w for w in workers if w != worker]
    header = {"kind": "norm", "step": st.step, "mb": 0, "edge": "sq", "src": worker}
    guarded = guard is not None
    share = np.array([float(st.poisoned), *squares], dtype=np.float64)
    sends = [asyncio.create_task(peers.push(w, header, share, timeout, record=False)) for w in others]
    every = {worker: list(squares)}
    poisoned = st.poisoned
    try:
        for w in others:
            got = await inbox.get(("norm", st.step, 0, "sq", w), timeout)
            if got is None or got.ndim != 1 or got.size < 1 or got.dtype != np.float64:
                raise FusionError(f"worker {w} sent a malformed gradient-norm share")
            every[w] = [float(x) for x in got[1:]]
            poisoned = poisoned or (guarded and bool(got[0] != 0))
        await asyncio.gather(*sends)
    finally:
        for t in sends:
            t.cancel()
    shares = {w: total_sq(every[w]) for w in every}
    total = total_sq(x for w in sorted(every) for x in every[w])
    if guard is not None and not poisoned:  # every worker checks every share in the same order: the same verdict everywhere
        refused = [b for w in sorted(shares) if (b := guard.check_share(w, shares[w])) is not None]
        st.bad.extend(refused)
        poisoned = bool(refused)
    st.skipped = bool(guarded and (poisoned or not math.isfinite(total)))
    return total
