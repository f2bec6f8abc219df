"""The world's all-reduce overlapped with the backward (runtime/stage/overlap.py): buckets launched from
autograd's hooks in a fixed order, in process with a stand-in world; and (slow) two gloo processes
whose overlapped sums equal the plain ``World.all_reduce``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fusionllm.core.metrics import read_metrics
from fusionllm.runtime.dist.collective import buckets_of
from fusionllm.runtime.stage.overlap import OverlappedReduce, finish
from tests.conftest import Started


class _Work:
    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat

    def wait(self) -> None:
        self.flat.mul_(2)  # as if a second member held the same gradients


class _World:
    """Records what ``OverlappedReduce`` launches; "sums" over two identical members."""

    def __init__(self) -> None:
        self.launched: list[int] = []  # sizes of the buckets, in launch order
        self.in_flight = 0

    def start(self, group: tuple[int, ...], flat: torch.Tensor) -> _Work:
        self.launched.append(flat.numel())
        self.in_flight += 1
        return _Work(flat)

    def settled(self, works: int) -> None:
        self.in_flight -= works


def _mlp() -> tuple[nn.Sequential, nn.Parameter]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)), nn.Parameter(torch.ones(3))


def test_buckets_split_by_size_and_dtype() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64), torch.zeros(1)]
    assert buckets_of(ts, limit=80) == [[0, 1], [2], [3], [4]]  # 40+40 bytes; 120 alone; a new dtype; back to float32


def test_buckets_start_during_the_last_backward_in_order_and_the_rest_at_reduce() -> None:
    """Why it can fail: a hook that launches a bucket as soon as it is full (not after the earlier
    ones: members would pair different buckets), a parameter without gradient never reduced, or
    sums written back to the wrong parameters."""
    model, unused = _mlp()
    params = [*reversed(list(model.parameters())), unused]  # the order the backward makes them; `unused` gets no gradient
    x = torch.randn(5, 8)
    model(x).square().sum().backward()  # an earlier micro-batch: not watched
    world = _World()
    r = OverlappedReduce(world, (0, 1), params, bucket_bytes=300)  # a bucket or two per layer
    assert len(r.buckets) >= 4
    r.arm()
    model(x + 1).square().sum().backward()  # the last micro-batch
    expected = [2 * (p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
    early = r.in_backward
    assert early == len(r.buckets) - 1 and len(world.launched) == early  # all but the bucket of `unused`, before REDUCE
    assert world.launched == [sum(params[i].numel() for i in b) for b in r.buckets[:early]]  # in bucket order
    finish([r])
    assert len(world.launched) == len(r.buckets) and world.in_flight == 0
    for p, want in zip(params, expected, strict=True):
        assert p.grad is not None and torch.equal(p.grad, want)
    model(x).sum().backward()  # after REDUCE the hooks are gone
    assert len(world.launched) == len(r.buckets)


def test_a_bucket_waits_for_the_earlier_ones() -> None:
    """The backward finishes the second bucket first: nothing is launched until the first is final."""
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    world = _World()
    r = OverlappedReduce(world, (0, 1), [a, b], bucket_bytes=16)
    r.arm()
    (b * 3).sum().backward()
    assert world.launched == [] and r.in_backward == 0
    (a * 5).sum().backward()
    assert world.launched == [4, 4] and r.in_backward == 2
    finish([r])
    assert torch.equal(a.grad, torch.full((4,), 10.0)) and torch.equal(b.grad, torch.full((4,), 6.0))


TWO_RANKS = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    from fusionllm.runtime.dist.collective import World
    from fusionllm.runtime.stage.overlap import OverlappedReduce, finish
    from fusionllm.transport.control import Collective

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    world = World(Collective(f"127.0.0.1:{port}", "p", [0, 1], "gloo", 0, [[0, 1]]), rank, join_host="127.0.0.1", own_host="127.0.0.1", timeout=60)
    world.form()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    unused = nn.Parameter(torch.ones(5))
    params = [*reversed(list(model.parameters())), unused]
    g = torch.Generator().manual_seed(rank)  # each member its own data: different gradients
    xs = [torch.randn(16, 32, generator=g) for _ in range(2)]
    model(xs[0]).square().sum().backward()
    r = OverlappedReduce(world, (0, 1), params, bucket_bytes=4096)
    r.arm()
    model(xs[1]).square().sum().backward()
    early = r.in_backward
    plain = [nn.Parameter(p.detach().clone()) for p in params]
    for q, p in zip(plain, params):
        q.grad = None if p.grad is None else p.grad.clone()
    finish([r])
    world.all_reduce((0, 1), plain)
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(params, plain))
    print(json.dumps({"early": early, "buckets": len(r.buckets), "same": same, "in_flight": world._in_flight,
                      "sum": [float(p.grad.double().sum()) for p in params]}))
    world.leave()
""")


@pytest.mark.slow
def test_overlapped_sums_over_gloo_equal_the_plain_all_reduce(tmp_path: Path) -> None:
    """Why it can fail: buckets launched in another order on the two members (gloo pairs the wrong
    tensors or hangs), a bucket copied before its gradient was final, or sums written back shifted."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store.port)], stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    res = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    for r in res:
        assert r["same"] and r["in_flight"] == 0
        assert r["buckets"] >= 3 and r["early"] == r["buckets"] - 1  # all but the unused parameter's bucket during the backward
    assert res[0]["sum"] == res[1]["sum"]  # both members end with the same sums


RUN = ["--model", "gpt-nano", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--seed", "3", "--steps", "4"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("single") / "single.jsonl"
    subprocess.run([sys.executable, "-m", "fusionllm", "train", "--single-process", *RUN, "--metrics", str(out)], check=True, capture_output=True, timeout=300)
    return read_metrics(out).losses()


@pytest.mark.soak  # (make test-soak) the same runs as test_collectives_process's, which overlap by default; this one also reads the logs
@pytest.mark.parametrize("cluster", [["--cluster", "local:4", "--replicas", "2,2"], ["--cluster", "local:2"]], ids=["replicas", "tied"])
def test_training_with_overlapped_buckets_matches_one_process(tmp_path: Path, cluster: list[str], single: list[float], started: Started) -> None:
    """Why it can fail: a bucket copied before its last micro-batch's gradient was accumulated, or
    summed on one member and not another; the log line proves the buckets did start in the backward."""
    out, run_dir = tmp_path / "m.jsonl", tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fusionllm", "train", *cluster, *RUN, "--metrics", str(out), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "FUSIONLLM_LOGLEVEL": "INFO"})
    left = started.stop(tmp_path)
    assert proc.returncode == 0 and not left, (proc.stdout + proc.stderr)[-3000:]
    losses = read_metrics(out).losses()
    assert len(losses) == len(single) == 4
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, single, strict=True)), (losses, single)
    logs = "".join(p.read_text() for p in sorted(run_dir.glob("worker-*.log")))
    told = [line for line in logs.splitlines() if "overlapped with the backward" in line]
    assert len(told) == int(cluster[1].split(":")[1]), logs[-3000:]
    assert all(" 0 of " not in line for line in told), told  # some bucket started before REDUCE on every worker
