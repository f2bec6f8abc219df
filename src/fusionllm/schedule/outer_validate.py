"""A static check of the outer step's programs (``schedule/outer_program.py``): do they run to the end?

The pipeline's programs are checked by ``schedule/validate.py`` before they are simulated or shipped;
the outer programs of a run of several groups get the same treatment here, with the same error
(``InvalidPlan`` naming the rule) and, on failure, the worker x action grid with the failing cell
marked (``format_grid``). The rules, in the order they are checked:

1. **rounds**: each round's ``INNER`` spans cover its group's inner steps 1..H once, in order; every
   worker sends (``OSEND``) and posts the receive (``ORECV``) of every fragment once per round, and
   reduces and applies each (fragment, round) at most once; every action names its worker's group;
2. **order**: in each program the receive of a (fragment, round) comes after its send, the reduce
   after the receive, the apply right after the reduce; a fragment's rounds are applied in order;
3. **messages**: every worker an ``OSEND`` names posts exactly one matching ``ORECV`` (same fragment
   and round) naming the sender, and every ``ORECV``'s sources send it exactly once;
4. **deadlock**: run without clocks (an ``OREDUCE`` goes once its sources have sent; ``INNER``,
   ``OSEND`` and ``OAPPLY`` are the coordinator's calls to every worker of the group, so they go when
   the whole group reached them), every program finishes. A cycle is printed as its chain of waits.
"""

from __future__ import annotations

from collections import Counter

from fusionllm.schedule.actions import OuterAction, format_grid
from fusionllm.schedule.hierarchy import HierPlan
from fusionllm.schedule.validate import InvalidPlan

Programs = dict[int, list[OuterAction]]
BARRIERS = ("INNER", "OSEND", "OAPPLY")  # the coordinator calls every worker of the group, and waits for all


def _fail(rule: str, text: str, progs: Programs, cell: tuple[int, int] | None) -> InvalidPlan:
    grid = format_grid({f"w{w}": p for w, p in progs.items()}, None if cell is None else (f"w{cell[0]}", cell[1]))
    where = f"worker {cell[0]} action {cell[1]} ({progs[cell[0]][cell[1]]}): " if cell is not None else ""
    return InvalidPlan(rule, f"{where}{text}\n{grid}")


def validate_outer(hier: HierPlan, progs: Programs) -> None:
    """Raise ``InvalidPlan`` naming the first broken rule (the module docstring), with the grid."""
    _check_rounds(hier, progs)
    _check_order(progs)
    _check_messages(progs)
    _check_deadlock(hier, progs)


def _index(prog: list[OuterAction]) -> dict[tuple[str, int, int], int]:
    """(kind, fragment, round) -> its first position in the program (INNER spans left out)."""
    out: dict[tuple[str, int, int], int] = {}
    for i, a in enumerate(prog):
        if a.kind != "INNER":
            out.setdefault((a.kind, a.index, a.round), i)
    return out


# ---- 1. rounds --------------------------------------------------------------------------------------
def _check_rounds(hier: HierPlan, progs: Programs) -> None:
    rounds = 1 + max((a.round for p in progs.values() for a in p), default=-1)
    for g in hier.groups:
        for w in g.workers:
            prog = progs.get(w)
            if prog is None:
                raise _fail("rounds", f"worker {w} of group {g.index} has no program", progs, None)
            for i, a in enumerate(prog):
                if a.group != g.index:
                    raise _fail("rounds", f"names group {a.group}, but worker {w} is in group {g.index}", progs, (w, i))
            step = {k: 0 for k in range(rounds)}
            for i, a in enumerate(prog):
                if a.kind != "INNER":
                    continue
                if a.first != step[a.round] + 1 or a.index > g.inner_steps or any(step[r] < g.inner_steps for r in range(a.round)):
                    raise _fail("rounds", f"runs inner steps {a.first}-{a.index} of round {a.round} after step {step[a.round]} of it "
                                f"(H is {g.inner_steps}: each round's steps once, in order)", progs, (w, i))
                step[a.round] = a.index
            short = [k for k in range(rounds) if step[k] != g.inner_steps]
            if short:
                raise _fail("rounds", f"worker {w} runs {step[short[0]]} of round {short[0]}'s {g.inner_steps} inner steps", progs, None)
            counts = Counter((a.kind, a.index, a.round) for a in prog if a.kind != "INNER")
            first = _index(prog)
            for i, a in enumerate(prog):
                if a.kind != "INNER" and counts[(a.kind, a.index, a.round)] > 1 and first[(a.kind, a.index, a.round)] < i:
                    raise _fail("rounds", f"{a.kind} of fragment {a.index} of round {a.round} a second time", progs, (w, i))
            for k in range(rounds):
                for f in range(len(hier.fragments)):
                    for kind in ("OSEND", "ORECV"):
                        if not counts[(kind, f, k)]:
                            raise _fail("rounds", f"worker {w} never runs {kind} of fragment {f} in round {k}: every worker "
                                        "sends every fragment once per round (a worker with nothing to send names no peer)", progs, None)
    extra = sorted(set(progs) - set(hier.workers))
    if extra:
        raise _fail("rounds", f"worker {extra[0]} has a program but is in no group", progs, None)


# ---- 2. order -----------------------------------------------------------------------------------------
def _check_order(progs: Programs) -> None:
    for w, prog in progs.items():
        at = _index(prog)
        applied: dict[int, int] = {}
        for i, a in enumerate(prog):
            need = {"ORECV": "OSEND", "OREDUCE": "ORECV", "OAPPLY": "OREDUCE"}.get(a.kind)
            if need is not None and at.get((need, a.index, a.round), len(prog)) > i:
                raise _fail("order", f"{a.kind} of fragment {a.index} of round {a.round} before its {need}", progs, (w, i))
            nxt = prog[i + 1] if i + 1 < len(prog) else None
            if a.kind == "OREDUCE" and (nxt is None or (nxt.kind, nxt.index, nxt.round) != ("OAPPLY", a.index, a.round)):
                raise _fail("order", f"OREDUCE of fragment {a.index} of round {a.round} is not followed by its OAPPLY", progs, (w, i))
            if a.kind == "OAPPLY":
                if applied.get(a.index, -1) >= a.round:
                    raise _fail("order", f"applies fragment {a.index}'s round {a.round} after its round {applied[a.index]}", progs, (w, i))
                applied[a.index] = a.round


# ---- 3. messages ------------------------------------------------------------------------------------
def _check_messages(progs: Programs) -> None:
    sends: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}  # (src, dst, fragment, round) -> where
    recvs: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for w, prog in progs.items():
        for i, a in enumerate(prog):
            for p in a.peers:
                if a.kind == "OSEND":
                    sends.setdefault((w, p, a.index, a.round), []).append((w, i))
                else:
                    recvs.setdefault((p, w, a.index, a.round), []).append((w, i))
    problems: list[tuple[tuple[int, int], str]] = []
    for (src, dst, f, k), ends in sends.items():
        if len(ends) > 1:
            problems.append((ends[1], f"sends fragment {f} of round {k} to worker {dst} a second time"))
        got = recvs.get((src, dst, f, k), [])
        if not got:
            problems.append((ends[0], f"sends fragment {f} of round {k} to worker {dst}, which never receives it from worker {src}"))
        elif len(got) > 1:
            problems.append((got[1], f"receives fragment {f} of round {k} from worker {src} a second time"))
    for (src, _dst, f, k), ends in recvs.items():
        if (src, _dst, f, k) not in sends:
            problems.append((ends[0], f"receives fragment {f} of round {k} from worker {src}, which never sends it here"))
    if problems:
        cell, text = min(problems, key=lambda p: (p[0][1], p[0][0]))
        raise _fail("messages", text, progs, cell)


# ---- 4. deadlock ------------------------------------------------------------------------------------
def _check_deadlock(hier: HierPlan, progs: Programs) -> None:
    members = {g.index: g.workers for g in hier.groups}
    at = {w: _index(p) for w, p in progs.items()}
    pos = dict.fromkeys(progs, 0)

    def blocker(w: int) -> tuple[int, str] | None:
        """What worker w's next action waits for: (worker, why), or None if it can go."""
        a = progs[w][pos[w]]
        if a.kind == "OREDUCE":
            for src in progs[w][at[w][("ORECV", a.index, a.round)]].peers:
                si = at[src][("OSEND", a.index, a.round)]
                if pos[src] <= si:
                    return src, f"{progs[src][si].name} on worker {src}"
        elif a.kind in BARRIERS:
            for m in members[a.group]:
                if pos[m] >= len(progs[m]) or progs[m][pos[m]].name != a.name:
                    return m, f"worker {m} to reach {a.name} (a call to the whole group)"
        return None

    progress = True
    while progress:
        progress = False
        for w in progs:
            while pos[w] < len(progs[w]):
                a = progs[w][pos[w]]
                if blocker(w) is not None:
                    break
                for m in members[a.group] if a.kind in BARRIERS else [w]:
                    pos[m] += 1
                progress = True
    stuck = [w for w in progs if pos[w] < len(progs[w])]
    if not stuck:
        return
    chain: list[str] = []
    seen: dict[int, int] = {}
    w: int | None = stuck[0]
    while w is not None and w not in seen and pos[w] < len(progs[w]):
        seen[w] = len(chain)
        got = blocker(w)
        if got is None:
            break
        chain.append(f"{progs[w][pos[w]].name} on worker {w} waits for {got[1]}")
        w = got[0]
    if w is not None and w in seen:
        chain = chain[seen[w]:]
    first = w if w is not None and w in seen else stuck[0]
    raise _fail("deadlock", f"the outer programs deadlock: {'; '.join(chain) or 'no progress'}", progs, (first, pos[first]))
