"""What several groups learn per token against one synchronous group: the planner's efficiency model.

Time to a target loss is tokens to the target over tokens/s. The round simulator predicts tokens/s;
this module predicts the other factor, relative to one synchronous group at the same global batch:
the *per-token efficiency* ``e`` of a plan (1: every token counts as much as in one synchronous group;
0.5: the plan needs twice the tokens to reach the same loss). The planner ranks candidates by
*goodput*, tokens/s times ``e``: the one with the most reaches the target first.

The model, fitted to ``experiments/hier_efficiency.py`` (docs/scheduler.md, "Time to target", has the
table and the commands)::

    tokens multiplier  1 / e = (1 + s(N) * GROUP_PENALTY * (M - 1) ** GROUPS_EXPONENT * H ** H_EXPONENT) * batch_factor

``M`` groups, each syncing every ``H`` inner steps (the token-weighted mean over groups where faster
groups do more), with outer learning rate 1 and no momentum (the defaults the sweep chose); the
global batch is ``M`` times the rows of one group's inner step. Where the global batch is the run's
``--batch-size`` (the default: each group's inner step is ``batch_size / M`` rows), ``batch_factor``
is 1; where it is ``k`` times larger (``--group-batch`` by hand), ``batch_factor`` is ``k **
BATCH_EXPONENT``: early in training a larger batch buys almost no progress per step (measured: four
times the batch cost more than four times the tokens, ``BATCH_EXPONENT`` > 1), and the planner does
not choose it.

``s(N) = (N / FIT_PARAMS) ** SIZE_EXPONENT`` scales the penalty with the model's parameters ``N``:
the loss of several groups per token falls as models grow. The exponent is not measured here: the
sweep's two models (gpt-micro and gpt-mini, 3.3x apart) do not resolve it (gpt-mini's seeds differ
by 5%, and at the sweep's learning rate its synchronous run trained worse than at half of it). It
is read off the published DiLoCo scaling runs (+2.0% at 35M parameters and +0.3% at 2.4B for four
replicas at H = 30, arXiv 2503.09799) and gpt-micro's +20% there: the gap falls about as N^-0.5.
Beyond the sweep's sizes, and for any H above its 30, the model extrapolates.

What the model leaves out, and how it errs: the sweep's runs are short (491,520 tokens), where groups
lose the most; groups lose less after a warm start (the sweep's warm-start rows), which the planner
does not plan yet; the delay of applying averages (the sweep syncs blocking). The model is therefore
pessimistic: it prefers one synchronous group unless several are clearly faster.

**Outer codecs.** The model above is for pseudo-gradients exchanged at 4 bits or better. A sparser
outer codec (top-k with error feedback, ``runtime/stage/outer.py``) multiplies the efficiency by its
measured factor ``OUTER_CODEC_EFFICIENCY`` (``codec_efficiency``): what groups learn per token with
it over what the same groups learn with q4 at the same H. The planner chooses the codec and H
together (``planning/inner_steps.py``, ``planning/hierarchy.py``): among the codecs whose bytes hide
behind the round, the one with the best factor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# fitted to gpt-micro's sweep, per-token efficiency read off the synchronous run's curve
# (benchmarks/results/hier_efficiency/gpt-micro: 22 runs, rms error of log(1/e) 0.10)
GROUP_PENALTY = 0.026
GROUPS_EXPONENT = 1.34
H_EXPONENT = 0.94
BATCH_EXPONENT = 1.04  # M=4, H=8: 16 rows a group against 4
FIT_PARAMS = 842_496  # gpt-micro's parameters (byte vocabulary): the size the constants above were fitted at
SIZE_EXPONENT = -0.5  # the penalty against the model's size: from published runs, not measured here (module docstring)

# Per-token efficiency of groups with an outer codec over the same groups with q4 (1: as good), with
# error feedback, by the slowest group's H (the entry of the largest H at most it), measured on
# gpt-micro at M = 2 and 4 groups and H = 1, 2, 4, three seeds, 120 steps of 16 x 64 tokens
# (benchmarks/results/outer_compress/gpt-micro/hier_efficiency.json; geometric mean over groups and
# seeds of the sweep's "budgets" efficiency against q4's, each capped at 1). Measured: at H >= 2
# error-fed top-k reached a 0-5% lower validation loss than q4 at the same tokens (also lower than
# one synchronous group), at H = 1 up to 4% higher; the planner never counts a codec better than
# exact. q4 and better are taken as exact (Streaming DiLoCo's 4 bits lose nothing measurable). A
# codec missing here is not chosen by the planner (``outer_codec_candidates``) until a run of that
# sweep measures it: the seam for topk:0.03 and the 2- and 4-bit top-k codecs (``topkq*``).
OUTER_CODEC_EFFICIENCY: dict[str, dict[int, float]] = {
    "none": {1: 1.0}, "fp16": {1: 1.0}, "q8": {1: 1.0}, "q4": {1: 1.0},
    "topk:0.1": {1: 0.77, 2: 0.99, 4: 1.0},
    "topk:0.01": {1: 0.81, 2: 1.0},
}
UNMEASURED_CODEC_EFFICIENCY = 0.5  # a codec set by hand (``--outer-codec``) that the sweep never measured


def mean_inner_steps(inner_steps: Sequence[int], tokens_per_s: Sequence[float] | None = None) -> float:
    """The groups' H, weighted by the tokens each contributes (all equal without ``tokens_per_s``)."""
    weights = list(tokens_per_s) if tokens_per_s is not None else [1.0] * len(inner_steps)
    total = sum(weights)
    if not inner_steps or total <= 0:
        return 1.0
    return sum(h * w for h, w in zip(inner_steps, weights, strict=True)) / total


def group_efficiency(groups: int, inner_steps: float, *, batch_factor: float = 1.0, params: int | None = None) -> float:
    """Per-token efficiency (0, 1] of ``groups`` groups syncing every ``inner_steps`` steps, whose
    global batch is ``batch_factor`` times the run's ``--batch-size``, for a model of ``params``
    parameters (default: the size the constants were fitted at; module docstring)."""
    if groups < 1 or inner_steps < 1 or batch_factor <= 0:
        raise ValueError(f"groups {groups}, inner steps {inner_steps} and batch factor {batch_factor} must be positive")
    size = (max(params, 1) / FIT_PARAMS) ** SIZE_EXPONENT if params else 1.0
    multiplier = 1.0 if groups == 1 else 1.0 + size * GROUP_PENALTY * (groups - 1) ** GROUPS_EXPONENT * inner_steps**H_EXPONENT
    return 1.0 / (multiplier * max(1.0, batch_factor) ** BATCH_EXPONENT)


def codec_efficiency(codec: str, inner_steps: float = 1.0) -> float:
    """The per-token efficiency factor (0, 1] of ``codec`` on the pseudo-gradients of groups syncing
    every ``inner_steps`` steps (module docstring): its measured ``OUTER_CODEC_EFFICIENCY`` at the
    largest H measured at most ``inner_steps`` (the smallest H measured below it), else
    ``UNMEASURED_CODEC_EFFICIENCY``."""
    by_h = OUTER_CODEC_EFFICIENCY.get(codec)
    if not by_h:
        return UNMEASURED_CODEC_EFFICIENCY
    below = [h for h in by_h if h <= inner_steps]
    return by_h[max(below) if below else min(by_h)]


def outer_codec_candidates(byte_ratio: Callable[[str], float], inner_steps: float = 1.0) -> tuple[str, ...]:
    """The outer codecs the planner chooses among at ``inner_steps``, the one it prefers first: the
    best measured efficiency, then (equal efficiency) the least lossy, the most bytes
    (``byte_ratio``: encoded over float32 bytes)."""
    return tuple(sorted(OUTER_CODEC_EFFICIENCY, key=lambda c: (-codec_efficiency(c, inner_steps), -byte_ratio(c))))


# Per-token efficiency of the replicas' gradients through an error-fed codec between sites against raw
# ones, as measured (benchmarks/results/dp_compress/README.md: gpt-micro, 4 replicas each its own site,
# 300 steps, AdamW; the mean over the seeds run, capped at 1). A codec not listed is never chosen for
# the leaders' exchange (``planning/reduce_codec.py``): its efficiency is unknown.
REDUCE_EFFICIENCY = {
    "lowrank:16": 1.0,  # 12.8x fewer bytes; 1.20 on seed 0 (one seed)
    "lowrank:4": 0.42,  # 51x; 0.35, 0.38, 0.54 on seeds 0-2
    "lowrank:3": 0.28,  # 68x; seed 0
    "topkq2:0.03": 0.15,  # 60x; seed 0: AdamW takes the residual's bursts as full steps
}
UNMEASURED_REDUCE_EFFICIENCY = 0.1  # a lossy codec given by hand that was never measured
