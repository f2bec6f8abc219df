"""AdaTopK's link policy: it compresses only when the predicted step is shorter, never below a codec
whose damage was measured, and its measurements do not feed back into a spiral."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fusionllm.compress.policy import FLOOR, LADDER, SLOW_BPS, LinkLoad, LinkPolicy

RAW = 262_144.0  # raw bytes per step on the link: four micro-batches of 64 KiB
MESSAGES = 4


def _policy(bps: float, *, compute: float = 0.066, encode_bps: float = 1.75e8, slow_bps: float = 0.0) -> LinkPolicy:
    """A policy for link 1 -> 2; by default without the slow-link rule (``slow_bps``), so that the
    time rule and the bottleneck by compute are what is tested."""
    link = (1, 2)
    policy = LinkPolicy(
        compute_s={0: 0.045, 1: compute, 2: 0.058},
        loads={link: LinkLoad(step_bytes=RAW, first_bytes=RAW / MESSAGES, messages=MESSAGES)},
        bps={link: bps}, encode_bps={1: encode_bps, 2: encode_bps}, decode_bps={1: 5.6e8, 2: 5.6e8}, micro_batches=4,
        slow_bps=slow_bps,
    )
    policy.decide_all()
    return policy


def _run(policy: LinkPolicy, *, bps: float, fixed_s: float, steps: int) -> list[float]:
    """Train ``steps`` steps over a link whose every message costs ``fixed_s`` on top of its bytes
    (the ack queued behind the other direction's traffic): what the workers would report."""
    link = (1, 2)
    targets = []
    for _ in range(steps):
        t = policy.byte_target(link)
        wire = max(t, FLOOR) * RAW
        policy.observe(link, wire, MESSAGES * fixed_s + wire * 8 / bps, MESSAGES)
        targets.append(policy.byte_target(link))
    return targets


def test_fixed_message_costs_do_not_spiral_to_the_floor() -> None:
    """Why it can fail: judging the link by bytes / busy time counts the fixed 20 ms per message as a
    slow link; each compression step makes the messages smaller, the fixed part larger in proportion,
    the link slower-looking and the target lower again, down to the floor (the first policy went to
    top-k 1% this way). The fitted policy must settle where the link's real rate puts it."""
    truth = _policy(100e6)  # what the policy decides knowing the real rate
    expected = truth.byte_target((1, 2))
    assert expected > FLOOR  # the real link needs little or no compression
    policy = _policy(100e6)
    targets = _run(policy, bps=100e6, fixed_s=0.020, steps=80)
    assert targets[-1] == expected
    assert len(set(targets[-40:])) == 1  # settled, not oscillating
    assert policy.bps[(1, 2)] == pytest.approx(100e6, rel=0.05)


def test_the_first_policy_would_have_spiralled() -> None:
    """The same link judged by bytes / busy time (the first policy's estimate) runs to the floor:
    this is the loop the fit breaks."""
    policy = _policy(100e6)
    link = (1, 2)
    for _ in range(40):
        wire = max(policy.byte_target(link), FLOOR) * RAW
        busy = MESSAGES * 0.020 + wire * 8 / 100e6
        policy.bps[link] = wire * 8 / busy
        policy.targets[link] = policy.choose(link)
    assert policy.byte_target(link) == FLOOR


def test_slow_link_converges_and_follows_a_slowdown() -> None:
    policy = _policy(8e6)
    first = policy.byte_target((1, 2))
    assert FLOOR <= first < 0.5
    targets = _run(policy, bps=8e6, fixed_s=0.020, steps=40)
    assert len(set(targets[-20:])) == 1
    slower = _policy(8e6)
    slower_targets = _run(slower, bps=2e6, fixed_s=0.020, steps=40)
    assert slower_targets[-1] <= targets[-1] and len(set(slower_targets[-20:])) == 1


def test_keeps_none_when_compression_does_not_pay() -> None:
    assert _policy(1e9).byte_target((1, 2)) == 1.0  # a fast link: nothing to gain
    # 50 Mbit/s: the link keeps up with the compute; compressing would save a few ms of the first
    # micro-batch, less than what a slow encoder (a small CPU share) spends on the whole step
    assert _policy(50e6, encode_bps=2e7).byte_target((1, 2)) == 1.0
    # the same link with a fast encoder: the saving now pays
    assert _policy(50e6, encode_bps=1e9).byte_target((1, 2)) < 1.0


def test_every_choice_predicts_a_step_no_longer_than_none() -> None:
    for bps in (8e6, 20e6, 50e6, 100e6, 1e9):
        for enc in (1e7, 1e8, 1e9):
            p = _policy(bps, encode_bps=enc)
            t = p.byte_target((1, 2))
            assert p.predicted_step((1, 2), t) <= p.predicted_step((1, 2), 1.0)
            if not p.bottleneck((1, 2)):  # elsewhere compression must clearly pay
                assert t == 1.0 or p.predicted_step((1, 2), t) <= (1 - p.gain) * p.predicted_step((1, 2), 1.0)


def test_never_below_the_lowest_target() -> None:
    p = _policy(1e5)  # 100 kbit/s: hopeless; the target stops at the ladder's floor
    assert p.byte_target((1, 2)) == FLOOR == min(LADDER)
    _run(p, bps=1e4, fixed_s=0.5, steps=20)
    assert p.byte_target((1, 2)) >= FLOOR


def test_a_bottleneck_link_stays_compressed_once_the_step_is_compute_bound() -> None:
    """20 Mbit/s carries the step's raw bytes in 0.1 s, longer than the slowest device computes
    (0.066 s): the link is the bottleneck. At hq4's bytes the step is already compute-bound, so a
    rule on time alone would stop there; the link gets the lowest target (the error budget then picks
    the codec), and the step predicted is no longer than uncompressed."""
    p = _policy(20e6)
    link = (1, 2)
    assert p.bottleneck(link)
    assert p.predicted_step(link, 0.13) == pytest.approx(p.predicted_step(link, FLOOR), rel=0.05)  # compute-bound already
    assert p.byte_target(link) == FLOOR
    assert p.predicted_step(link, FLOOR) <= p.predicted_step(link, 1.0)
    assert not _policy(1e9).bottleneck(link)


def test_a_link_below_the_slow_rate_is_compressed_as_far_as_the_budget_allows_unless_slower() -> None:
    """100 Mbit/s keeps up with this CPU's compute (the time rule leaves it nearly raw), but with GPUs
    it is what the step waits for: under ``SLOW_BPS`` it gets the lowest target, unless the codec's
    CPU time would make the step longer (a slow encoder: raw)."""
    assert not _policy(100e6).bottleneck((1, 2)) and _policy(100e6).byte_target((1, 2)) > FLOOR
    assert _policy(100e6, slow_bps=SLOW_BPS).byte_target((1, 2)) == FLOOR
    slow_encoder = _policy(100e6, slow_bps=SLOW_BPS, encode_bps=2e6)
    assert slow_encoder.byte_target((1, 2)) == 1.0
    assert LinkPolicy(compute_s={}).slow_bps == SLOW_BPS  # the default


CLUSTER = """
name = "two-and-one"
[sites.home]
devices = 2
cpus = 0.7
bandwidth = "1gbit"
[sites.far]
devices = 1
cpus = 0.6
bandwidth = "1gbit"
[[links]]
sites = ["home", "far"]
bandwidth = "{rate}"
"""


@pytest.mark.parametrize("rate", ["8mbit", "10gbit"])
def test_plan_policy_covers_every_link_and_direction(rate: str, tmp_path: Path) -> None:
    """A three-stage pipeline across the slow link, tied embeddings all-reduced between the first and
    last stage: both directions and the all-reduce are decided; fast links stay raw."""
    from fusionllm.launch.offline import offline
    from fusionllm.planning.adatopk import adatopk_policy
    from fusionllm.planning.predict import predict
    from fusionllm.schedule.plan import Request

    path = tmp_path / "c.toml"
    path.write_text(CLUSTER.replace("{rate}", rate))
    req = Request(8, 64, 4)
    _, _, cost, plan = offline("gpt-micro", str(path), "params", req)
    policy, judged = adatopk_policy(plan, cost, req)
    assert {(0, 1), (1, 0), (1, 2), (2, 1), (0, 2), (2, 0)} <= set(policy.loads)
    assert policy.loads[(0, 2)].reduce_bytes > 0 and policy.loads[(2, 1)].step_bytes == policy.loads[(1, 2)].step_bytes
    ratios = policy.ratios()
    assert ratios[(0, 1)] == ratios[(1, 0)] == 1.0
    if rate == "8mbit":
        assert all(FLOOR <= ratios[link] < 1.0 for link in [(1, 2), (2, 1), (0, 2), (2, 0)])
        assert predict(plan, judged, req) < predict(plan, cost, req)
    else:
        assert all(r == 1.0 for r in ratios.values()) and judged is cost
    assert all(math.isfinite(v) for v in policy.compute_s.values())


def test_a_shaper_burst_does_not_send_a_slowed_link_back_to_a_light_codec() -> None:
    """Why it can fail: a token-bucket shaper passes messages smaller than its bucket at line rate
    while it refills between them. Judged by those, a link slowed to 2 Mbit/s looked fast again under
    a hard codec, the policy went back to the light one, whose larger messages then crawled: the codec
    went back and forth every few steps (CI, 2026-12-01). A lighter codec must be judged by the rate
    its own message size showed."""
    link = (1, 2)
    policy = _policy(20e6)
    bucket, slow = 8_000.0, 2e6

    def busy(wire: float) -> float:  # per message: free up to the bucket, the rest at the slow rate
        per = wire / MESSAGES
        return MESSAGES * (2e-4 + max(0.0, per - bucket) * 8 / slow + min(per, bucket) * 8 / 1e9)

    targets = []
    for _ in range(60):
        wire = max(policy.byte_target(link), FLOOR) * RAW
        policy.observe(link, wire, busy(wire), MESSAGES)
        targets.append(policy.byte_target(link))
    assert targets[-1] < 0.5
    assert len(set(targets[-30:])) == 1, targets  # settled, not oscillating


def test_host_delays_on_a_busy_machine_do_not_compress_a_fast_link() -> None:
    """Why it can fail: on a loaded machine most steps' sends wait for a core; judged by a typical step
    rather than the fastest, a 1 Gbit/s link inside a site looked slow and was compressed (a policy that
    took the upper quartile of recent rates did so in the testbed under load)."""
    link = (1, 2)
    policy = _policy(1e9)
    assert policy.byte_target(link) == 1.0
    for step in range(60):
        wire = policy.byte_target(link) * RAW
        delay = 0.0 if step % 8 == 0 else 0.2  # seven steps of eight wait 200 ms for a busy core
        policy.observe(link, wire, MESSAGES * 2e-4 + wire * 8 / 1e9 + delay, MESSAGES)
    assert policy.byte_target(link) == 1.0


def _reduce_only(encode_bps: float) -> LinkPolicy:
    """Link 1 -> 0 carries only a tied weight's all-reduce (131,072 raw bytes, after the backward pass)
    from the slowest device (0.09 s a step) at 226 Mbit/s, as the last stage's return link on random-11."""
    link = (1, 0)
    policy = LinkPolicy(compute_s={0: 0.02, 1: 0.09}, loads={link: LinkLoad(reduce_bytes=131_072.0, messages=2)}, bps={link: 226e6},
                        encode_bps={1: encode_bps}, decode_bps={0: 8.7e8}, overhead_s=0.0)
    policy.decide_all()
    return policy


def test_an_all_reduce_from_the_slowest_device_pays_its_codec_time_once():
    # coded after the backward pass: the step is the slowest device's compute, then encode, send, decode
    # (its encoding used to be counted in that device's compute as well, and such a link stayed raw)
    policy = _reduce_only(6e7)
    raw, send = 0.09 + 131_072 * 8 / 226e6, 131_072 * 8 / 226e6
    assert policy.predicted_step((1, 0), 1.0) == pytest.approx(raw)
    assert policy.predicted_step((1, 0), FLOOR) == pytest.approx(0.09 + FLOOR * send + 131_072 / 6e7 + 131_072 / 8.7e8)
    assert policy.byte_target((1, 0)) == FLOOR
    # a sender that encodes slower than the link sends keeps it raw
    assert _reduce_only(1e7).byte_target((1, 0)) == 1.0
