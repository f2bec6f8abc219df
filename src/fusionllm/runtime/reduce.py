"""Ring all-reduce (sum) of a flat tensor among a group of workers.

Reduce-scatter, then all-gather: each member sends about 2 (n-1)/n times the tensor's size per
call, not once per peer, and every member ends with bit-identical values (each chunk is summed by
one member and then copied), so replicas and tied copies stay in sync.

``send`` returns the value the receiver will decode (the chunk itself when the link is not
compressed). In the all-gather the member that completed a chunk keeps that value too, so that a
compressed chunk is identical everywhere.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

# send(dst, header, chunk, phase) -> what dst will hold after decoding
Send = Callable[[int, dict, torch.Tensor, str], Awaitable[torch.Tensor]]
Recv = Callable[[dict], Awaitable[torch.Tensor | None]]


async def ring_allreduce(flat: torch.Tensor, group: list[int], me: int, tag: dict, send: Send, recv: Recv) -> torch.Tensor:
    n = len(group)
    if n == 1:
        return flat
    rank = group.index(me)
    nxt, prev = group[(rank + 1) % n], group[(rank - 1) % n]
    chunks = list(torch.tensor_split(flat.clone(), n))
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
    return torch.cat(chunks)
