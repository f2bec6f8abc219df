"""A coordinator that stops and starts again while the workers keep their stages.

Ctrl+C or SIGTERM: the step in flight ends, a final checkpoint is written (with
``--checkpoint-dir``), and the workers are told that the coordinator is stopping *to be restarted*:
they keep their stages and wait (``--coordinator-timeout``) instead of exiting. All of it within
``--stop-timeout`` seconds; a second signal stops at once. A run that ends (every step done, or a
fatal error) still tells the workers to exit.

Started again at the same address with ``--resume``, the coordinator re-admits the workers, which
report the stage they hold (``LiveState``). When every stage of one plan is present at the same
completed step, for the model and seed of this run, it gathers each stage's weights and AdamW state
(GetState pages) and hands them out as a re-plan does: no step is lost. Otherwise it continues from
the newest complete checkpoint. Either way a ``resume`` record in the metrics says which.

A hierarchical run resumes the same way (``resume_live`` with ``outer``): the workers report the
step of the outer weights and momentum every fragment of theirs applied, one group whose stages are
all present at one step is read, and every group starts from its outer state (``hier_setup.py``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fusionllm.core.checkpoints import PREFIX
from fusionllm.core.errors import FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.transport.control import WORKER_SERVICE, LiveState
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.shards import blob_keys

from .config import ClusterConfig, Run, Say
from .context import RunContext
from .setup import Setup
from .state import Checkpoints
from .workers import Liveness


class Stopped(FusionError):
    """The coordinator stopped on SIGINT or SIGTERM; the workers wait for it to be started again."""

    def __init__(self, signum: int, step: int | None, checkpoint: Path | None) -> None:
        where = f" at step {step}" if step is not None else ""
        saved = f"; final checkpoint {checkpoint}" if checkpoint is not None else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}{saved}; the workers wait (--coordinator-timeout) "
                         "for a coordinator started again at the same address with --resume")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.code = 128 + signum


class Interrupted(Exception):  # noqa: N818 - an internal signal between two steps, not an error
    """Raised between two steps once a stop was asked; ``done``: the steps completed."""

    def __init__(self, done: int) -> None:
        super().__init__(f"stop asked after step {done}")
        self.done = done


def live_states(members: Mapping[int, Any]) -> dict[int, LiveState]:
    """The members (``Member``s) that reported a stage when they registered, by id."""
    return {w: m.info.live for w, m in members.items() if m.info.live is not None}


def live_group(held: Mapping[int, LiveState]) -> tuple[int, dict[int, int]] | str:
    """(the step, one holder per stage) when every stage of one plan is held at one completed step
    (the newest such, over the plans reported); else why not, in words."""
    if not held:
        return "no worker holds a stage"
    plans: dict[tuple[str, int, int], dict[int, dict[int, int]]] = {}  # (plan, epoch, stages) -> stage -> step -> holder
    for w, s in sorted(held.items()):
        if s.step >= 0 and 0 <= s.stage < s.stages:
            plans.setdefault((s.plan, s.epoch, s.stages), {}).setdefault(s.stage, {}).setdefault(s.step, w)
    best: tuple[int, dict[int, int]] | None = None
    why = "no worker knows the step its stage is at"
    for (_, _, stages), by_stage in plans.items():
        missing = sorted(set(range(stages)) - set(by_stage))
        if missing:
            why = f"stage(s) {missing} of {stages} are held by no worker"
            continue
        common = set.intersection(*(set(steps) for steps in by_stage.values()))
        if not common:
            why = "the stages are at different steps (" + ", ".join(f"stage {k} at {sorted(v)}" for k, v in sorted(by_stage.items())) + ")"
            continue
        step = max(common)
        if best is None or step > best[0]:
            best = (step, {k: by_stage[k][step] for k in range(stages)})
    return best if best is not None else why


class Stopper:
    """SIGINT/SIGTERM: finish the step in flight, write a final checkpoint, leave the workers waiting."""

    def __init__(self, cluster: ClusterConfig, say: Say) -> None:
        self.cluster, self.say = cluster, say
        self.stopping = 0  # the signal that asked the run to stop (0: none)
        self.training = False  # inside the synchronous step loop: a stop waits for the step in flight
        self.main: asyncio.Task | None = None  # the coordinator's task: cancelled by a stop that cannot wait
        self._timer: asyncio.TimerHandle | None = None

    def watch_signals(self) -> Callable[[], None]:
        """SIGINT and SIGTERM ask for a stop (``request_stop``); returns what puts the handlers back."""
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self.request_stop, sig)

        def unwatch() -> None:
            for sig in sigs:
                loop.remove_signal_handler(sig)

        return unwatch

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop after the step in flight, write a final checkpoint and tell the workers to wait for a
        restart, within --stop-timeout; asked again, stop at once."""
        c = self.cluster
        name = signal.Signals(signum).name
        if self.stopping or not self.training:  # again, or nothing to finish (joining, planning, hierarchical mode)
            self.stopping = self.stopping or signum
            self.say(f"{name}: stopping now; the workers wait for a restart")
            self._cancel_main()
            return
        self.stopping = signum
        final = ", write a final checkpoint" if c.checkpoint_dir else ""
        self.say(f"{name}: stopping after the step in flight{final} and telling the workers to wait for a restart "
                 f"(at most {c.stop_timeout:.0f} s, --stop-timeout; {name} again stops at once)")
        self._timer = asyncio.get_running_loop().call_later(c.stop_timeout, self._overdue)

    def _overdue(self) -> None:
        self.say(f"the step in flight and the final checkpoint took longer than {self.cluster.stop_timeout:.0f} s (--stop-timeout): stopping without them")
        self._cancel_main()

    def _cancel_main(self) -> None:
        if self.main is not None and not self.main.done():
            self.main.cancel()

    def stop_if_asked(self, done: int) -> None:
        """Between two steps (``done`` completed): raise Interrupted once a stop was asked."""
        if self.stopping:
            raise Interrupted(done)

    def end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def final_checkpoint(stopping: int, checkpoints: Checkpoints, live: Liveness, run: Run, done: int, say: Say) -> Stopped:
    """The checkpoint of the step reached (unless it exists already), and the Stopped to raise."""
    c = checkpoints.cluster
    if not c.checkpoint_dir:
        return Stopped(stopping, done, None)
    path = Path(c.checkpoint_dir).resolve() / f"{PREFIX}{done:06d}"
    if not (path / "state.json").is_file():
        try:
            await live.guard(run, checkpoints.checkpoint(run, done))
        except FusionError as exc:
            say(f"the final checkpoint failed ({exc}); the newest complete one stays")
            return Stopped(stopping, done, None)
    return Stopped(stopping, done, path)


async def start_or_resume(ctx: RunContext, setup: Setup, checkpoints: Checkpoints, began: float) -> tuple[Run, dict[str, Any] | None]:
    """The first plan: from scratch; with --resume, from the workers' live state when every stage
    is present at one step, else from the newest checkpoint. Returns it and the ``resume`` record
    (its seconds counted from ``began``, the coordinator's start)."""
    t, c, members = ctx.train, ctx.cluster, ctx.membership.members
    held = live_states(members)
    if not c.resume:
        if held:
            ctx.say(f"{len(held)} worker(s) hold a stage from an earlier coordinator; without --resume the run starts from step 0")
        return await setup.setup(), None
    got = await resume_live(ctx, checkpoints, lambda _: asyncio.to_thread(ctx.task.trace, t.batch_size // c.micro_batches), outer=False)
    if isinstance(got, str):
        run = await setup.setup()  # --resume: the newest complete checkpoint
    else:
        states, step, graph = got
        run = await setup.setup(carry=(states, step), graph=graph)
        ctx.say(f"resuming from the workers' live state at step {step}: every stage present, no step lost")
    return run, resume_event(ctx, got, began)


def resume_event(ctx: RunContext, got: tuple | str, began: float) -> dict[str, Any]:
    """The ``resume`` record: from the workers' live state or (``got`` says why not) a checkpoint."""
    event: dict[str, Any] = {"event": "resume", "from": "checkpoint" if isinstance(got, str) else "live",
                             "resumed_from_step": ctx.clock.start_step,  # (no "step" key: readers of step records skip events)
                             "seconds": round(time.perf_counter() - began, 3), "live_workers": len(live_states(ctx.membership.members))}
    if isinstance(got, str):
        event["why_not_live"] = got
    return event


async def resume_live(ctx: RunContext, checkpoints: Checkpoints, trace: Callable[[str], Awaitable[OpGraph | None]], *,
                      outer: bool) -> tuple[list[bytes], int, OpGraph] | str:
    """Every stage's state from the workers that hold one plan's stages at one step (``outer``: one
    group's outer weights and momentum, hierarchical mode) and that step; the epoch follows theirs.
    Else why not, in words (said when any worker held a stage). ``trace(digest)``: this run's model
    traced as the workers' graph (``LiveState.graph``) may have been, or None."""
    every = live_states(ctx.membership.members)
    held = {w: s for w, s in every.items() if s.outer == outer}
    found: tuple[int, dict[int, int]] | str = live_group(held)
    if not held and every:
        found = "the workers ran " + ("synchronous mode (a group's outer weights are needed)" if outer else "hierarchical mode (--sync hierarchical)")
    why, states, step, graph = None, [], 0, None
    if isinstance(found, str):
        why = found
    else:
        step, holders = found
        some = held[next(iter(holders.values()))]
        graph = await trace(some.graph)
        if graph is None or some.graph != LiveState.graph_digest(graph.to_json()):
            why = "the workers run another model (or micro-batch size) than this run's"
        elif some.seed != ctx.train.seed:
            why = f"the workers ran --seed {some.seed}, this run has --seed {ctx.train.seed}"
        else:
            states, why = await gather_live(ctx, checkpoints, holders, graph, outer=outer)
    if why is not None or graph is None:
        if every:
            ctx.say(f"not resuming from the workers' live state: {why}")
        return why or "no graph"
    ctx.clock.follow(max(s.epoch for s in every.values()) + 1)  # no tensor of the old plan is taken for one of the new
    ctx.clock.start_at(step)
    return states, step, graph


async def gather_live(ctx: RunContext, checkpoints: Checkpoints, holders: dict[int, int], graph: Any, *,
                      outer: bool = False) -> tuple[list[bytes], str | None]:
    """Each stage's weights and AdamW state (``outer``: outer weights and momentum) from its holder;
    (states, None) or ([], why not)."""
    c, members = ctx.cluster, ctx.membership.members
    clients = {w: RpcClient(members[w].address, WORKER_SERVICE, c.token, tls=c.tls, incarnation=ctx.membership.incarnation)
               for w in set(holders.values())}
    try:
        states = [await checkpoints.read_pages(clients[w], w, outer=outer) for _, w in sorted(holders.items())]
    except FusionError as exc:
        return [], f"reading a stage's state failed: {exc}"
    finally:
        for client in clients.values():
            await client.close()
    have = {k for blob in states for k in blob_keys(blob)}
    missing = [p for p in graph.params if f"param/{p}" not in have]
    if missing:
        return [], f"the workers' stages lack {missing[:4]}"
    return states, None
