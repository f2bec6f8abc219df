"""The outer step as programs: the action text, the lowering from a HierPlan (golden programs), the
validator's rules, and the round simulator that replays the programs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fusionllm.core.errors import FusionError
from fusionllm.models.spec import build_model
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.stage.outer import HANDLERS, OuterCall, OuterState
from fusionllm.schedule.actions import OuterAction
from fusionllm.schedule.hierarchy import exchange, make_hier_plan
from fusionllm.schedule.outer_program import (
    outer_programs,
    outer_routes,
    parse_program_text,
    program_text,
)
from fusionllm.schedule.outer_validate import validate_outer
from fusionllm.schedule.validate import InvalidPlan
from fusionllm.sim.outer_replay import OuterCosts, replay_rounds
from fusionllm.sim.rounds import round_programs, round_traffic
from fusionllm.sim.simulator import Deadlock

TWO_OVERLAP = """\
w0: 0INNER1-2.0 0OSEND0.0>w1 0ORECV0.0<w1 0INNER3-4.0 0OSEND1.0>w1 0ORECV1.0<w1 0INNER1-2.1 0OSEND0.1>w1 0ORECV0.1<w1 0OREDUCE0.0 0OAPPLY0.0 0INNER3-4.1 0OSEND1.1>w1 0ORECV1.1<w1 0OREDUCE1.0 0OAPPLY1.0
w1: 1INNER1-2.0 1OSEND0.0>w0 1ORECV0.0<w0 1INNER3-4.0 1OSEND1.0>w0 1ORECV1.0<w0 1INNER1-2.1 1OSEND0.1>w0 1ORECV0.1<w0 1OREDUCE0.0 1OAPPLY0.0 1INNER3-4.1 1OSEND1.1>w0 1ORECV1.1<w0 1OREDUCE1.0 1OAPPLY1.0
"""
TWO_BLOCKING = """\
w0: 0INNER1-2.0 0OSEND0.0>w1 0ORECV0.0<w1 0OREDUCE0.0 0OAPPLY0.0 0INNER3-4.0 0OSEND1.0>w1 0ORECV1.0<w1 0OREDUCE1.0 0OAPPLY1.0 0INNER1-2.1 0OSEND0.1>w1 0ORECV0.1<w1 0OREDUCE0.1 0OAPPLY0.1 0INNER3-4.1 0OSEND1.1>w1 0ORECV1.1<w1 0OREDUCE1.1 0OAPPLY1.1
w1: 1INNER1-2.0 1OSEND0.0>w0 1ORECV0.0<w0 1OREDUCE0.0 1OAPPLY0.0 1INNER3-4.0 1OSEND1.0>w0 1ORECV1.0<w0 1OREDUCE1.0 1OAPPLY1.0 1INNER1-2.1 1OSEND0.1>w0 1ORECV0.1<w0 1OREDUCE0.1 1OAPPLY0.1 1INNER3-4.1 1OSEND1.1>w0 1ORECV1.1<w0 1OREDUCE1.1 1OAPPLY1.1
"""
THREE_OVERLAP = """\
w0: 0INNER1-2.0 0OSEND0.0>w2,w3 0ORECV0.0<w2,w3 0INNER3-4.0 0OSEND1.0>w2,w3 0ORECV1.0<w2,w3 0INNER1-2.1 0OSEND0.1>w2,w3 0ORECV0.1<w2,w3 0OREDUCE0.0 0OAPPLY0.0 0INNER3-4.1 0OSEND1.1>w2,w3 0ORECV1.1<w2,w3 0OREDUCE1.0 0OAPPLY1.0
w1: 0INNER1-2.0 0OSEND0.0 0ORECV0.0<w2,w3 0INNER3-4.0 0OSEND1.0>w2,w3 0ORECV1.0<w2,w3 0INNER1-2.1 0OSEND0.1 0ORECV0.1<w2,w3 0OREDUCE0.0 0OAPPLY0.0 0INNER3-4.1 0OSEND1.1>w2,w3 0ORECV1.1<w2,w3 0OREDUCE1.0 0OAPPLY1.0
w2: 1INNER1-2.0 1OSEND0.0>w0,w1,w3 1ORECV0.0<w0,w3 1INNER3-4.0 1OSEND1.0>w0,w1,w3 1ORECV1.0<w0,w1,w3 1INNER1-2.1 1OSEND0.1>w0,w1,w3 1ORECV0.1<w0,w3 1OREDUCE0.0 1OAPPLY0.0 1INNER3-4.1 1OSEND1.1>w0,w1,w3 1ORECV1.1<w0,w1,w3 1OREDUCE1.0 1OAPPLY1.0
w3: 2INNER1-2.0 2OSEND0.0>w0,w1,w2 2ORECV0.0<w0,w2 2INNER3-4.0 2OSEND1.0>w0,w1,w2 2ORECV1.0<w0,w1,w2 2INNER1-2.1 2OSEND0.1>w0,w1,w2 2ORECV0.1<w0,w2 2OREDUCE0.0 2OAPPLY0.0 2INNER3-4.1 2OSEND1.1>w0,w1,w2 2ORECV1.1<w0,w1,w2 2OREDUCE1.0 2OAPPLY1.0
"""
THREE_BLOCKING = """\
w0: 0INNER1-2.0 0OSEND0.0>w2,w3 0ORECV0.0<w2,w3 0OREDUCE0.0 0OAPPLY0.0 0INNER3-4.0 0OSEND1.0>w2,w3 0ORECV1.0<w2,w3 0OREDUCE1.0 0OAPPLY1.0 0INNER1-2.1 0OSEND0.1>w2,w3 0ORECV0.1<w2,w3 0OREDUCE0.1 0OAPPLY0.1 0INNER3-4.1 0OSEND1.1>w2,w3 0ORECV1.1<w2,w3 0OREDUCE1.1 0OAPPLY1.1
w1: 0INNER1-2.0 0OSEND0.0 0ORECV0.0<w2,w3 0OREDUCE0.0 0OAPPLY0.0 0INNER3-4.0 0OSEND1.0>w2,w3 0ORECV1.0<w2,w3 0OREDUCE1.0 0OAPPLY1.0 0INNER1-2.1 0OSEND0.1 0ORECV0.1<w2,w3 0OREDUCE0.1 0OAPPLY0.1 0INNER3-4.1 0OSEND1.1>w2,w3 0ORECV1.1<w2,w3 0OREDUCE1.1 0OAPPLY1.1
w2: 1INNER1-2.0 1OSEND0.0>w0,w1,w3 1ORECV0.0<w0,w3 1OREDUCE0.0 1OAPPLY0.0 1INNER3-4.0 1OSEND1.0>w0,w1,w3 1ORECV1.0<w0,w1,w3 1OREDUCE1.0 1OAPPLY1.0 1INNER1-2.1 1OSEND0.1>w0,w1,w3 1ORECV0.1<w0,w3 1OREDUCE0.1 1OAPPLY0.1 1INNER3-4.1 1OSEND1.1>w0,w1,w3 1ORECV1.1<w0,w1,w3 1OREDUCE1.1 1OAPPLY1.1
w3: 2INNER1-2.0 2OSEND0.0>w0,w1,w2 2ORECV0.0<w0,w2 2OREDUCE0.0 2OAPPLY0.0 2INNER3-4.0 2OSEND1.0>w0,w1,w2 2ORECV1.0<w0,w1,w2 2OREDUCE1.0 2OAPPLY1.0 2INNER1-2.1 2OSEND0.1>w0,w1,w2 2ORECV0.1<w0,w2 2OREDUCE0.1 2OAPPLY0.1 2INNER3-4.1 2OSEND1.1>w0,w1,w2 2ORECV1.1<w0,w1,w2 2OREDUCE1.1 2OAPPLY1.1
"""


@pytest.fixture(scope="module")
def graph():  # noqa: ANN201
    return trace_lm(build_model("gpt-micro", 256, device="meta"), 4, 64, spec="gpt-micro")


@pytest.mark.parametrize("text", ["0INNER1-3.2", "0OSEND1.2>w3,w5", "1ORECV1.2<w0", "0OREDUCE1.2", "0OAPPLY1.2", "0OSEND0.0", "12INNER7-7.30"])
def test_an_outer_action_prints_as_it_parses(text: str) -> None:
    a = OuterAction.parse(text)
    assert str(a) == text and OuterAction.parse(str(a)) == a


@pytest.mark.parametrize("text", ["0OSEND1.2<w3", "0ORECV1.2>w3", "0INNER3.2", "0OAPPLY1-2.2", "0OREDUCE1.2>w1", "0INNER3-2.0", "0INNER0-2.0", "0OSEND1>w3", "0F1.2"])
def test_a_malformed_outer_action_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        OuterAction.parse(text)


@pytest.mark.parametrize(("groups", "overlap", "golden"), [
    ([[0], [1]], True, TWO_OVERLAP),
    ([[0], [1]], False, TWO_BLOCKING),
    ([[0, 1], [2], [3]], True, THREE_OVERLAP),
    ([[0, 1], [2], [3]], False, THREE_BLOCKING),
])
def test_a_hier_plan_lowers_to_the_golden_round_programs(graph, groups: list[list[int]], overlap: bool, golden: str) -> None:  # noqa: ANN001
    """H=4, two fragments (synced after inner steps 2 and 4), two rounds. With overlap a fragment's
    average of round 0 is reduced and applied at its sync point of round 1, after that round's send;
    without, right after its own send. Group 0 of the three is a two-stage pipeline: worker 1 holds the
    tied embedding of fragment 0 but does not lead it (worker 0 sends it), and still receives it."""
    hier = make_hier_plan(graph, groups, inner_steps=4, fragments=2, overlap=overlap)
    assert program_text(outer_programs(hier, outer_routes(graph, hier), rounds=2)) == golden.strip()


def test_a_delay_shorter_than_a_round_applies_that_many_inner_steps_after_the_send(graph) -> None:  # noqa: ANN001
    """Uneven H (4 and 8) and a delay of 3 inner steps: group 0's fragment 0, sent after step 2,
    is applied after step 1 of the next round; the coordinator's loop does the same."""
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=[4, 8], fragments=2, delay_steps=3)
    progs = outer_programs(hier, outer_routes(graph, hier), rounds=2)
    assert " ".join(map(str, progs[0])) == ("0INNER1-2.0 0OSEND0.0>w1 0ORECV0.0<w1 0INNER3-4.0 0OSEND1.0>w1 0ORECV1.0<w1 "
                                            "0INNER1-1.1 0OREDUCE0.0 0OAPPLY0.0 0INNER2-2.1 0OSEND0.1>w1 0ORECV0.1<w1 "
                                            "0INNER3-3.1 0OREDUCE1.0 0OAPPLY1.0 0INNER4-4.1 0OSEND1.1>w1 0ORECV1.1<w1")
    assert " ".join(map(str, progs[1])) == ("1INNER1-4.0 1OSEND0.0>w0 1ORECV0.0<w0 1INNER5-7.0 1OREDUCE0.0 1OAPPLY0.0 "
                                            "1INNER8-8.0 1OSEND1.0>w0 1ORECV1.0<w0 1INNER1-3.1 1OREDUCE1.0 1OAPPLY1.0 "
                                            "1INNER4-4.1 1OSEND0.1>w0 1ORECV0.1<w0 1INNER5-7.1 1OREDUCE0.1 1OAPPLY0.1 "
                                            "1INNER8-8.1 1OSEND1.1>w0 1ORECV1.1<w0")


def test_program_text_parses_back(graph) -> None:  # noqa: ANN001
    assert program_text(parse_program_text(THREE_OVERLAP)) == THREE_OVERLAP.strip()


@pytest.mark.parametrize(("groups", "overlap", "golden"), [([[0], [1]], False, TWO_BLOCKING), ([[0, 1], [2], [3]], True, THREE_OVERLAP)])
def test_the_golden_programs_are_valid(graph, groups: list[list[int]], overlap: bool, golden: str) -> None:  # noqa: ANN001
    validate_outer(make_hier_plan(graph, groups, inner_steps=4, fragments=2, overlap=overlap), parse_program_text(golden))


BROKEN = [  # (which golden, what is replaced, by what, the rule, the marked cell or None, words of the message)
    ("two", "w0: 0INNER1-2.0 0OSEND0.0>w1 ", "w0: 0INNER1-2.0 ", "rounds", None, "never runs OSEND of fragment 0 in round 0"),
    ("two", "0INNER3-4.0", "0INNER4-4.0", "rounds", "0INNER4-4.0", "inner steps 4-4 of round 0 after step 2"),
    ("two", "0INNER3-4.1", "0INNER3-3.1", "rounds", None, "runs 3 of round 1's 4 inner steps"),
    ("two", "0OSEND1.0>w1 ", "0OSEND1.0>w1 0OSEND1.0 ", "rounds", "0OSEND1.0", "a second time"),
    ("two", "1OSEND0.0>w0", "0OSEND0.0>w0", "rounds", "0OSEND0.0>w0", "names group 0, but worker 1 is in group 1"),
    ("two", "0OREDUCE0.0 0OAPPLY0.0", "0OAPPLY0.0 0OREDUCE0.0", "order", "0OAPPLY0.0", "before its OREDUCE"),
    ("two", "0OREDUCE1.1 0OAPPLY1.1", "0OREDUCE1.1", "order", "0OREDUCE1.1", "not followed by its OAPPLY"),
    ("two", "1ORECV0.0<w0", "1ORECV0.0", "messages", "0OSEND0.0>w1", "worker 1, which never receives it"),
    ("three", "1ORECV0.0<w0,w3", "1ORECV0.0<w0,w1,w3", "messages", "1ORECV0.0<w0,w1,w3", "from worker 1, which never sends it"),
    ("two", "1INNER1-2.0 1OSEND0.0>w0 1ORECV0.0<w0 1OREDUCE0.0 1OAPPLY0.0 1INNER3-4.0 1OSEND1.0>w0 1ORECV1.0<w0 1OREDUCE1.0 1OAPPLY1.0",
     "1INNER1-2.0 1OSEND1.0>w0 1ORECV1.0<w0 1OREDUCE1.0 1OAPPLY1.0 1INNER3-4.0 1OSEND0.0>w0 1ORECV0.0<w0 1OREDUCE0.0 1OAPPLY0.0",
     "deadlock", "0OREDUCE0.0", "0OREDUCE0.0 on worker 0 waits for 1OSEND0.0 on worker 1; 1OREDUCE1.0 on worker 1 waits for 0OSEND1.0 on worker 0"),
    ("three", "w1: 0INNER1-2.0 0OSEND0.0 0ORECV0.0<w2,w3 0INNER3-4.0 0OSEND1.0>w2,w3 0ORECV1.0<w2,w3 0INNER1-2.1 0OSEND0.1 0ORECV0.1<w2,w3 0OREDUCE0.0 0OAPPLY0.0",
     "w1: 0INNER1-2.0 0OSEND0.0 0ORECV0.0<w2,w3 0INNER3-4.0 0OSEND1.0>w2,w3 0ORECV1.0<w2,w3 0INNER1-2.1 0OREDUCE0.0 0OAPPLY0.0 0OSEND0.1 0ORECV0.1<w2,w3",
     "deadlock", "0OSEND0.1>w2,w3", "0OSEND0.1 on worker 0 waits for worker 1 to reach 0OSEND0.1 (a call to the whole group)"),
]


@pytest.mark.parametrize(("which", "old", "new", "rule", "cell", "words"), BROKEN)
def test_each_rule_of_the_outer_validator_fails_on_a_program_that_breaks_it(graph, which: str, old: str, new: str, rule: str,  # noqa: ANN001
                                                                            cell: str | None, words: str) -> None:
    """The golden programs with one change each; the error names the rule, says what is wrong and
    prints the grid with the failing cell marked."""
    golden, groups, overlap = (TWO_BLOCKING, [[0], [1]], False) if which == "two" else (THREE_OVERLAP, [[0, 1], [2], [3]], True)
    assert golden.count(old) == 1
    hier = make_hier_plan(graph, groups, inner_steps=4, fragments=2, overlap=overlap)
    with pytest.raises(InvalidPlan) as err:
        validate_outer(hier, parse_program_text(golden.replace(old, new)))
    assert err.value.rule == rule and words in str(err.value), str(err.value)
    grid = str(err.value).split("\n", 1)[1]
    assert grid.count("!") == (0 if cell is None else 2) and (cell is None or f"!{cell}!" in grid), grid


def test_the_simulator_lowers_the_same_programs_from_its_traffic_as_from_the_exchange_rule(graph) -> None:  # noqa: ANN001
    """The round simulator finds its worker pairs from parameter sizes (``round_traffic``), the runtime
    from parameter names (``exchange``): the two must give the same programs, or the simulator
    replays a program no worker runs."""
    for groups, h, frags, delay in (([[0, 1], [2], [3]], [4, 4, 4], 2, 0), ([[0, 1, 2], [3, 4], [5]], [3, 5, 8], 3, 2),
                                    ([[0], [1, 2, 3, 4]], [2, 6], 4, 0)):
        hier = make_hier_plan(graph, groups, inner_steps=h, fragments=frags, delay_steps=delay)
        assert round_programs(hier, round_traffic(graph, hier), 3) == outer_programs(hier, outer_routes(graph, hier), rounds=3)


def _costs(link_s: float, latency: float = 0.0) -> OuterCosts:
    """Two one-device groups, 1 s inner steps, fragments of two messages each way taking ``link_s`` on the link."""
    messages = {(f, s, d): (link_s, latency, 0.0) for f in range(2) for s, d in ((0, 1), (1, 0))}
    return OuterCosts(messages, {}, {}, 0.0, [1.0, 1.0], [False, False])


@pytest.mark.parametrize(("golden", "ends", "waits"), [
    (TWO_BLOCKING, [10.0, 20.0, 30.0, 40.0], [6.0, 6.0, 6.0, 6.0]),  # each fragment waits for its own 3 s message
    (TWO_OVERLAP, [4.0, 8.0, 14.0, 20.0], [0.0, 0.0, 2.0, 2.0]),  # the link paces it: two 3 s messages a round, 4 s of steps
])
def test_the_replay_of_two_groups_programs_keeps_the_clock_worked_out_by_hand(graph, golden: str, ends: list[float], waits: list[float]) -> None:  # noqa: ANN001
    """H=4, fragments sent after steps 2 and 4, each message 3 s on its link (FIFO). Blocking: a round
    is 4 s of steps and two 3 s waits. Overlapped: round 1's messages queue behind round 0's (f1 of
    round 0 waits for f0's link until 5 s), so from round 2 on each average arrives late and the round
    is the link's 6 s."""
    overlap = golden is TWO_OVERLAP
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=4, fragments=2, overlap=overlap)
    progs = outer_programs(hier, outer_routes(graph, hier), rounds=4)
    r = replay_rounds(hier, progs, _costs(3.0), 4)
    assert r.ends == [ends, ends] and r.waits == [waits, waits]


def test_a_replay_of_programs_that_deadlock_stops_with_the_stuck_actions(graph) -> None:  # noqa: ANN001
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=4, fragments=2, overlap=False)
    old, new = BROKEN[9][1], BROKEN[9][2]
    with pytest.raises(Deadlock, match="1OREDUCE1.0"):
        replay_rounds(hier, parse_program_text(TWO_BLOCKING.replace(old, new)), _costs(1.0), 2)


def test_fragments_that_sync_after_the_same_inner_step_are_all_sent_before_any_is_applied(graph) -> None:  # noqa: ANN001
    """H=1 with two fragments: both sync after step 1. The coordinator's loop sends every fragment
    of an inner step, then applies the averages due, so a blocking plan's two messages cross the
    link together, not one exchange after the other."""
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=1, fragments=2, overlap=False)
    progs = outer_programs(hier, outer_routes(graph, hier), rounds=1)
    assert " ".join(map(str, progs[0])) == "0INNER1-1.0 0OSEND0.0>w1 0ORECV0.0<w1 0OSEND1.0>w1 0ORECV1.0<w1 0OREDUCE0.0 0OAPPLY0.0 0OREDUCE1.0 0OAPPLY1.0"
    r = replay_rounds(hier, progs, _costs(3.0, latency=1.0), 1)
    assert r.ends == [[1.0 + 3.0 + 3.0 + 1.0], [8.0]]  # back to back on the link, one latency: not 1 + 2 x (3 + 1)


def test_a_worker_runs_the_outer_actions_its_program_names(graph) -> None:  # noqa: ANN001
    """What an ``OuterSync`` makes a worker run (``OuterState.actions``, dispatched by ``HANDLERS``)
    is, action for action, what its lowered program says at that sync point: the runtime and the
    simulator run one program."""
    hier = make_hier_plan(graph, [[0, 1], [2], [3]], inner_steps=4, fragments=2)
    for w, prog in outer_programs(hier, outer_routes(graph, hier), rounds=2).items():
        exchanges = [exchange(graph, hier, w, f) for f in range(len(hier.fragments))]
        state = OuterState(hier, exchanges, hier.group_of(w).index, {n: np.zeros(1, np.float32) for e in exchanges for n in e.mine})
        assert [a for a in prog if a.kind in ("OSEND", "ORECV")] == [
            x for a in prog if a.kind == "OSEND" for x in state.actions(a.index, a.round, send=True, apply=[])]
        assert [a for a in prog if a.kind in ("OREDUCE", "OAPPLY")] == [
            x for a in prog if a.kind == "OREDUCE" for x in state.actions(a.index, a.round, send=False, apply=[a.round])]
        assert set(HANDLERS) == {"OSEND", "ORECV", "OREDUCE", "OAPPLY"}


def test_a_worker_refuses_an_inner_step_or_another_fragment_in_one_outer_call(graph) -> None:  # noqa: ANN001
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=4, fragments=2)
    exchanges = [exchange(graph, hier, 0, f) for f in range(2)]
    state = OuterState(hier, exchanges, 0, {n: np.zeros(1, np.float32) for e in exchanges for n in e.mine})
    call = OuterCall(lambda names: {}, lambda weights: None, _no_push, _no_get, 0, 1.0)
    for bad in ("0INNER1-2.0", "0OSEND1.0>w1"):
        with pytest.raises(FusionError, match="of fragment 0 only"):
            asyncio.run(state.run(0, [OuterAction.parse(bad)], call))


async def _no_push(*args: object, **kwargs: object) -> None:
    raise AssertionError("nothing is pushed")


async def _no_get(key: tuple, timeout: float) -> None:
    raise AssertionError("nothing is read")
