"""Ring all-reduce (sum) of a flat array among a group of workers, of any framework.

Reduce-scatter, then all-gather: each member sends about 2 (n-1)/n times the tensor's size per
call, not once per peer, and every member ends with bit-identical values (each chunk is summed by
one member and then copied), so replicas and tied copies stay in sync.

``send`` returns the value the receiver will decode (the chunk itself when the link is not
compressed). In the all-gather the member that completed a chunk keeps that value too, so that a
compressed chunk is identical everywhere.

It works on NumPy arrays (what travels, ``runtime/worker/peers.py``), so torch and NumPy workers reduce
together and get the same bits.

With ``row`` > 1 the chunks are whole rows of that many values (the array padded with zeros to a
whole row, the padding dropped at the end) and travel as 2-D arrays, so that a compressed link's
quantisers scale each row on its own (``row_width``: one parameter row, a tied embedding's token).
Sent flat, a chunk is one row with one scale: on gpt-micro's tied embedding, whose rows' RMS span
three orders of magnitude, ``eq:0.5`` then rounded 39-56% of the rows to zero at every step, while
its error over the whole chunk (0.10-0.13) looked within the budget.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

# send(dst, header, chunk, phase) -> what dst will hold after decoding
Send = Callable[[int, dict, np.ndarray, str], Awaitable[np.ndarray]]
Recv = Callable[[dict], Awaitable[np.ndarray | None]]


MIN_ROW, MAX_ROW, BLOCK = 32, 1024, 256  # a row of the flat gradient: its parameters' rows, else blocks of 256


def row_width(shapes: Sequence[Sequence[int]]) -> int:
    """How many values of a group's flat gradient share a scale: the largest width that every
    parameter's rows (a 2-D or larger parameter's values per entry of its first dimension, a 1-D
    parameter whole) are whole multiples of, so that every row of the flat array lies in one row of
    one parameter; halved while over ``MAX_ROW``; ``BLOCK`` where that leaves fewer than ``MIN_ROW``."""
    width = 0
    for shape in shapes:
        size = math.prod(int(d) for d in shape)
        width = math.gcd(width, size // int(shape[0]) if len(shape) >= 2 and int(shape[0]) else size)
    while width > MAX_ROW and width % 2 == 0:
        width //= 2
    return width if MIN_ROW <= width <= MAX_ROW else BLOCK


async def ring_allreduce(flat: np.ndarray, group: list[int], me: int, tag: dict, send: Send, recv: Recv, row: int = 1) -> np.ndarray:
    n = len(group)
    if n == 1:
        return flat
    rank = group.index(me)
    nxt, prev = group[(rank + 1) % n], group[(rank - 1) % n]
    size = flat.size
    if row > 1:  # whole rows (the last padded with zeros), each chunk a 2-D array of rows
        flat = np.concatenate([np.asarray(flat).reshape(-1), np.zeros(-size % row, dtype=flat.dtype)]).reshape(-1, row)
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
    return np.concatenate(chunks).reshape(-1)[:size]
