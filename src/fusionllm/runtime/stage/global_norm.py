"""The global gradient norm, gathered from every worker, and the step's verdict with it.

``STEP`` clips by the norm of all the model's gradients, which no worker holds: each sends its
share (the squared norm of the parameters it owns, counted once over replicas and tied copies) to
every other over the data plane, and each sums all shares in worker order, so all get the same
total bit for bit. With the numeric guards on, a share is (squared norm, poisoned): this exchange,
which every step does anyway, is how every worker learns that one of them saw a bad tensor, and then
none of them applies the update. A share itself is checked like any received tensor.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np

from fusionllm.core.errors import FusionError
from fusionllm.runtime.stage.guards import NumericGuard
from fusionllm.runtime.stage.step import StepState
from fusionllm.runtime.worker.peers import Inbox, PeerNet


async def gather_norm_sq(
    st: StepState, sq: float, *, worker: int, workers: list[int], peers: PeerNet, inbox: Inbox, guard: NumericGuard | None, timeout: float,
) -> float:
    """The squared global gradient norm; sets ``st.skipped`` where a guard saw a bad tensor anywhere."""
    others = [w for w in workers if w != worker]
    header = {"kind": "norm", "step": st.step, "mb": 0, "edge": "sq", "src": worker}
    guarded = guard is not None
    share = np.array([sq, float(st.poisoned)] if guarded else [sq], dtype=np.float64)
    sends = [asyncio.create_task(peers.push(w, header, share, timeout, record=False)) for w in others]
    shares = {worker: float(sq)}
    poisoned = st.poisoned
    try:
        for w in others:
            got = await inbox.get(("norm", st.step, 0, "sq", w), timeout)
            if got is None or got.shape != share.shape:
                raise FusionError(f"worker {w} sent a malformed gradient-norm share")
            shares[w] = float(got[0])
            poisoned = poisoned or (guarded and bool(got[1] != 0))
        await asyncio.gather(*sends)
    finally:
        for t in sends:
            t.cancel()
    total = sum(shares[w] for w in sorted(shares))
    if guard is not None and not poisoned:  # every worker checks every share in the same order: the same verdict everywhere
        refused = [b for w in sorted(shares) if (b := guard.check_share(w, shares[w])) is not None]
        st.bad.extend(refused)
        poisoned = bool(refused)
    st.skipped = bool(guarded and (poisoned or not math.isfinite(total)))
    return total
