"""AdaTopK's codec per tensor: the cheapest whose measured error stays within its role's budget.

The coordinator's policy (``policy.py``) sets a byte target per link from the step time it predicts;
this module turns the target into a codec on the sending worker, from the error each candidate
codec actually makes on the tensor being sent. For each link and role (``act``: activations,
``grad``: their gradients, ``reduce``: all-reduced weight gradients) the sender encodes and decodes
a sample of the tensor (``SAMPLE`` values in whole rows, spread over the tensor) with every
candidate and keeps, per candidate, the bytes it sent per value and its relative error
``||decode(encode(x)) - x|| / ||x||``. The sample is measured again every ``REMEASURE`` tensors of
the link and role (and whenever the shape changes); the choice is:

- among the candidates (``CANDIDATES``) within the role's budget (``BUDGET``) whose bytes meet the
  target, the most accurate;
- if none meets the target, the cheapest within the budget (the link sends more than asked: the
  budget is the floor, not the byte target);
- if none is within the budget, raw float32.

In the run's first sixteenth of steps (``budget_cap``, sent with each step as ``Step.budget_cap``) every
role's budget is at most ``EARLY_BUDGET``, which 6- or 8-bit meets: the links stay compressed (4-5x
instead of 10x) while the run's course is set, and the budgets below hold for the rest.

The budgets come from convergence runs of gpt-micro (docs/compression.md). Damage follows the
activations' error far more than the gradients': across 8 Mbit/s, 240 steps, ``eq:0.7`` both ways
(relative error 0.20) ended +1.9% above uncompressed (mean of four seeds), activations at
``eq:0.85`` (0.25) with gradients at ``eq:0.7`` +5.4% (two seeds), and these budgets (``eq:0.5``,
0.14, forward) -0.4% (four seeds; +3.3% on a random three-stage cluster); in one process, gradients
alone at ``eq:0.7`` moved the loss -0.2% and -0.7% (two seeds), activations alone +0.5% and +0.3%.
So activations get the tighter budget here, against the usual advice for top-k (Rudakov et al., arXiv 2401.07788:
gradients need milder compression). The measurement also catches what a fixed ladder cannot: a
float16 cast flushes a gradient of about 1e-8 per value to subnormals, and is then not chosen.
Top-k is never a candidate: at equal bytes quantisation is far more accurate (top-k at 10% of the
values leaves a relative error of 0.67-0.82 here).

For activations that have a basis (``subspace.py``) the chooser also measures ``kltr`` (``klt``:
``KLTR_CANDIDATES`` by default), on every tensor, since the basis changes with every tensor: on
gpt-mini's cut ``kltr:1`` errs 0.009-0.019 at 0.086-0.089 of the raw bytes, where ``eq:0.5`` errs
0.14 at 0.10. A tighter budget for activations that have a basis (0.05: finer codecs while the basis
is young) cut an 80-step deficit on ``random-1`` from 4.7% to 1.1% (four seeds) but not the
240-step one (+2.60% over twelve seeds against +2.55%), at 13% more bytes: not used
(docs/compression.md). ``klt`` (``KLT_CANDIDATES``) is not measured unless given: it drops the faint
directions, and on the testbed it ended gpt-mini's runs further above uncompressed than ``eq:0.5``
did. Neither codec's loss follows its error at four seeds: a float16 cast of the activations moved
single seeds by as much (docs/compression.md).

The activations' budget was set on 240-step runs, where ``kltr:2`` errs 0.02-0.07 and is chosen far
inside it. Late in a 1,200-step gpt-micro run its activations spread over more directions: every
candidate near 10x then errs 0.12-0.145, at the budget, and in one process that late error cost
about 1% within a group (activations at 6 bits late: +0.76%; ``kltr:2``: +1.52%); an error near 0.1
costs 8.6-8.9x instead of 10x (``experiments/codec_error.py``; docs/compression.md, "Why 1,200 steps
cost more than 240"). The budget is left as it is: the goal is 10x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusionllm.compress.codecs import CodecSpec, decode, encode, parse_codec
from fusionllm.compress.sparse import channel_major, row_len, scale_rows
from fusionllm.compress.subspace import fits

BUDGET = {"act": 0.15, "grad": 0.21, "reduce": 0.21}  # the most relative error a role may carry
# Not the rotated hq codecs: on the testbed they cost more than their error says (hq4, error 0.10:
# +3.2% and +4.1% over two seeds, where activations at eq:0.5, error 0.14, cost +1.0% and -2.6%)
CANDIDATES = tuple(parse_codec(c) for c in ("fp16", "q8", "q6", "q5", "eq:0.5", "eq:0.7", "eq:0.85"))
# finer steps for the budgets compressed cuts share (``scale`` < 1). Only there: with them on a single cut,
# the live slow-down test saw the coordinator's byte target go raw after an 80x slowdown (not yet understood)
SHARED_CANDIDATES = tuple(parse_codec(c) for c in ("eq:0.25", "eq:0.3", "eq:0.4")) + CANDIDATES
KLT_CANDIDATES = tuple(parse_codec(c) for c in ("klt:0.15", "klt:0.25", "klt:0.35"))
# Roles whose eq candidates are dithered (eqd). None: on random-1 (twelve seeds, 240 steps) gradients and
# all-reduces sent dithered, the pipeline's gradients without error feedback, ended +2.18% against
# uncompressed, +1.66% rounded to nearest with error feedback (docs/compression.md)
DITHER_ROLES: tuple[str, ...] = ()
# kltr's steps: with a basis of its leading directions (subspace.py) the residual can go coarsely, but not past
# step 2. Rounding a residual at 2.5 of its RMS sends most faint values as zero and shrinks the faint directions
# by 8% (by 2% at step 2; eq: none), an error that does not average out: in one process over sixteen seeds
# (240 steps, the activations coded from the first step) activations at kltr:2.5 ended +2.35% against uncompressed, at kltr:2 +1.08%, where the gradients'
# codecs alone ended +0.92%; on the testbed every random-11 seed ended above its eq twin (docs/compression.md,
# "Three cuts")
KLTR_CANDIDATES = tuple(parse_codec(c) for c in ("kltr:0.7", "kltr:1", "kltr:1.5", "kltr:2"))
# A run's first steps: every role within EARLY_BUDGET (6-bit where it errs 0.02-0.03, else 8-bit, which
# errs 0.005-0.015) for the first EARLY_SHARE of the schedule's steps. Where a run ends is decided early:
# gpt-micro's runs end in two groups about 0.2 apart in loss, set in their first 300 of 1,200 steps, and
# an error of 0.2 then moves seeds between the groups. In one process over sixteen seeds, q6 (0.02) or
# q8 for the first eighth then eq:0.7 ended within 0.3% of uncompressed at 240 and 1,200 steps, q5
# (0.045) +1.25%, q8 for the first sixteenth within 0.2%. An eighth sent 9.6-10.2x fewer bytes over a
# 240-step run on random-1's slow links, under the 10x goal on two of four; a sixteenth costs half as
# much (docs/compression.md, "The early budget")
EARLY_BUDGET = 0.03
EARLY_SHARE = 1 / 16
SAMPLE = 4096  # values measured per tensor (whole rows, spread evenly)
REMEASURE = 16  # tensors of a link and role between two measurements


@dataclass(frozen=True)
class Measured:
    spec: CodecSpec
    bytes_per_value: float  # encoded bytes / float32 bytes, on the sample
    error: float  # relative error on the sample


def sample_of(x: np.ndarray, size: int = SAMPLE, planes: bool = False) -> np.ndarray:
    """About ``size`` values of ``x`` in whole rows, taken at an even stride (the whole tensor where
    it is smaller); 2-D (rows, row length), so that per-row codecs see rows: the rows that share a
    scale in the quantisers (``scale_rows``: for a ResNet's small planes, one channel over the batch),
    or with ``planes`` the rows ``klt`` codes (a token's features, a channel plane)."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, row_len(x.shape)) if planes else scale_rows(x)
    d = max(rows.shape[1], 1)
    want = max(1, size // d)
    if rows.shape[0] <= want:
        return rows
    return np.ascontiguousarray(rows[:: rows.shape[0] // want][:want])


def measure(sample: np.ndarray, candidates: tuple[CodecSpec, ...] = CANDIDATES, basis: np.ndarray | None = None,
            whole: int = 0) -> list[Measured]:
    """Bytes per value and relative error of each candidate on ``sample`` (``klt``, ``kltr`` in ``basis``).
    ``whole``: the values of the tensor the sample came from. A message's fixed bytes (its headers, a
    basis) are paid once per tensor, not once per sample: the sample and its first half are both
    encoded, and the bytes are extrapolated, fixed part and per-row part, to the whole tensor."""
    norm = float(np.linalg.norm(sample))
    rows = sample.shape[0]
    half = sample[: rows // 2] if whole > sample.size and rows >= 2 else None
    out = []
    for spec in candidates:
        tag, payload = encode(sample, spec, basis=basis)
        back = decode(tag, payload, sample.shape)
        err = float(np.linalg.norm(back - sample)) / norm if norm > 0 else 0.0
        size = len(payload) / (4 * sample.size)
        if half is not None:
            per_row = (len(payload) - len(encode(half, spec, basis=basis)[1])) / (rows - half.shape[0])
            fixed = max(0.0, len(payload) - per_row * rows)
            size = (fixed + per_row * whole / sample.shape[1]) / (4 * whole)
        out.append(Measured(spec, size, err if np.isfinite(err) else float("inf")))
    return out


def budget_cap(step: int, steps: int) -> float:
    """The most relative error any role may carry at schedule step ``step`` of ``steps``: ``EARLY_BUDGET``
    in the run's first ``EARLY_SHARE`` of them, else no cap (1.0)."""
    return EARLY_BUDGET if step < EARLY_SHARE * steps else 1.0


def dithered(candidates: tuple[CodecSpec, ...]) -> tuple[CodecSpec, ...]:
    """``candidates`` with every ``eq:STEP`` as ``eqd:STEP``."""
    return tuple(CodecSpec("eqd", step=c.step) if c.kind == "eq" else c for c in candidates)


def pick(table: list[Measured], budget: float, byte_target: float) -> CodecSpec:
    """The rule in the module's docstring, over one measured table."""
    within = [m for m in table if m.error <= budget]
    if not within:
        return CodecSpec("none")
    fits = [m for m in within if m.bytes_per_value <= byte_target]
    if fits:
        return min(fits, key=lambda m: (m.error, m.bytes_per_value)).spec
    return min(within, key=lambda m: (m.bytes_per_value, m.error)).spec


@dataclass
class BudgetChooser:
    """One sender's choices: a measured table per (destination, role), refreshed every ``REMEASURE``."""

    budget: dict[str, float] = field(default_factory=lambda: dict(BUDGET))
    remeasure: int = REMEASURE
    scale: float = 1.0  # activations' and gradients' budgets times this: the run's compressed cuts share them
    cap: float = 1.0  # every role's budget at most this (``budget_cap``: a run's early steps)
    tables: dict[tuple[int, str], tuple[tuple[int, ...], int, list[Measured]]] = field(default_factory=dict)
    chosen: dict[tuple[int, str], str] = field(default_factory=dict)  # the codec each (destination, role) last sent
    klt: tuple[CodecSpec, ...] = KLTR_CANDIDATES  # candidates for activations in a learnt basis (klt: measured worse)
    dither: tuple[str, ...] = DITHER_ROLES  # roles whose eq candidates are eqd

    def choose(self, x: np.ndarray, dst: int, role: str, byte_target: float, basis: np.ndarray | None = None) -> CodecSpec:
        """The codec for ``x`` on its way to ``dst`` in ``role``, for a link whose target is ``byte_target``;
        ``basis``: the one ``klt`` would send ``x`` in (activations only)."""
        if byte_target >= 1.0 or x.size == 0:
            return CodecSpec("none")
        key = (dst, role)
        shape, age, table = self.tables.get(key, ((), self.remeasure, []))
        sample = None
        if shape != tuple(x.shape) or age >= self.remeasure:
            sample = sample_of(x)
            candidates = SHARED_CANDIDATES if self.scale < 1 else CANDIDATES
            shape, age, table = tuple(x.shape), 0, measure(sample, dithered(candidates) if role in self.dither else candidates, whole=x.size)
        self.tables[key] = (shape, age + 1, table)
        if self.klt and role == "act" and fits(x, basis):
            rows = sample if sample is not None and not channel_major(x.shape) else sample_of(x, planes=True)
            table = table + measure(rows, self.klt, basis, x.size)
        limit = min(self.cap, self.budget.get(role, min(self.budget.values())) * (self.scale if role in ("act", "grad") else 1.0))
        spec = pick(table, limit, byte_target)
        self.chosen[key] = str(spec)
        return spec

    def chosen_by_destination(self) -> dict[str, dict[str, str]]:
        """``chosen`` as a worker reports it: destination -> role -> codec."""
        out: dict[str, dict[str, str]] = {}
        for (dst, role), codec in self.chosen.items():
            out.setdefault(str(dst), {})[role] = codec
        return out

    def errors(self) -> dict[str, dict[str, float]]:
        """The last measured error of each candidate per link and role (``"w3 act"`` -> codec -> error)."""
        return {f"w{dst} {role}": {str(m.spec): round(m.error, 4) for m in table} for (dst, role), (_, _, table) in self.tables.items()}
