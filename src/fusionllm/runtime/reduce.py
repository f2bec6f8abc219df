"""Ring all-reduce (sum) of a flat array among a group of workers, of any framework.

Reduce-scatter, then all-gather: each member sends about 2 (n-1)/n times the tensor's size per
call, not once per peer, and every member ends with bit-identical values (each chunk is summed by
one member and then copied), so replicas and tied copies stay in sync.

``send`` returns the value the receiver will decode (the chunk itself when the link is not
compressed). In the all-gather the member that completed a chunk keeps that value too, so that a
compressed chunk is identical everywhere.

It works on NumPy arrays (what travels, ``runtime/peers.py``), so torch and NumPy workers reduce
together and get the same bits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

# send(dst, header, chunk, phase) -> what dst will hold after decoding
Send = Callable[[int, dict, np.ndarray, str], Awaitable[np.ndarray]]
Recv = Callable[[dict], Awaitable[np.ndarray | None]]


async def ring_allreduce(flat: np.ndarray, group: list[int], me: int, tag: dict, send: Send, recv: Recv) -> np.ndarray:
    n = len(group)
    if n == 1:
        return flat
    rank = group.index(me)
    nxt, prev = group[(rank + 1) % n], group[(rank - 1) % n]
    chunks = list(np.array_split(np.array(flat), n))  # the sizes torch.tensor_split gives
    for r in range(n - 1):  # reduce-scatter: after it, chunk (rank + 1) % n is complete here
        send_i, recv_i = (rank - r) % n, (rank - r - 1) % n
        await send(nxt, {**tag, "mb": r, "edge": f"{tag['edge']}:rs{send_i}"}, chunks[send_i], "rs")
        got = await recv({**tag, "mb": r, "edge": f"{tag['edge']}:rs{recv_i}", "src": prev})
        chunks[recv_i] = chunks[recv_i] + got
    for r in range(n - 1):  # all-gather
        send_i, recv_i = (rank + 1 - r) % n, (rank - r) % n
        seen = await send(nxt, {**tag, "mb": r, "edge": f"{tag['edge']}:ag{send_i}"}, chunks[send_i], "ag" if r == 0 else "forward")
        if r == 0:
            chunks[send_i] = seen  # the completed chunk, as every member will hold it
        chunks[recv_i] = await recv({**tag, "mb": r, "edge": f"{tag['edge']}:ag{recv_i}", "src": prev})
    return np.concatenate(chunks)
