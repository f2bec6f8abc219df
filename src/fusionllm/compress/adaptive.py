"""The codec each tensor leaves with: the run's fixed codec, or AdaTopK's choice, decided here alone.

AdaTopK is a policy over codecs, in two halves that meet in this module's ``LinkCodecs``:

- the coordinator's ``LinkPolicy`` (``policy.py``, built by ``planning/adatopk.py``) gives each
  directed link a **byte target** from the step time it predicts, and each step a share of the
  error budgets (``scale``: compressed cuts share them) and an early cap (``budget.budget_cap``);
- the sender turns the target into a codec per tensor and role: the most accurate candidate whose
  error, measured on the tensor, stays within its role's budget (``budget.BudgetChooser``).

A run with a fixed codec (``--compress eq:0.5``) takes the same path with one candidate. The send
path (``runtime/stage/link_sender.py``) asks only ``compresses`` and ``codec_for``, and keeps the per-link
state a codec asks for (``link_state``: a learnt basis for ``klt``); it never reads codec names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fusionllm.compress.base import CodecSpec, LinkState
from fusionllm.compress.budget import BudgetChooser


@dataclass
class LinkCodecs:
    """One sender's codec decisions: ``spec`` is the run's ``--compress``."""

    spec: CodecSpec
    targets: dict[int, float] = field(default_factory=dict)  # adaptive: byte target per destination, set each step
    chooser: BudgetChooser = field(default_factory=BudgetChooser)  # adaptive: the codec per tensor within its role's budget

    def set_step(self, targets: Mapping[int, float] | None, scale: float = 1.0, cap: float = 1.0) -> None:
        """What the coordinator's Step says: byte targets per destination, the budgets' share and cap."""
        if targets is not None:
            self.targets = dict(targets)
        self.chooser.scale, self.chooser.cap = scale, cap

    def byte_target(self, dst: int) -> float | None:
        """The link's byte target (adaptive: 1.0 until the coordinator sets one), else None."""
        return self.targets.get(dst, 1.0) if self.spec.adaptive else None

    def compresses(self, dst: int, dtype: str = "float32") -> bool:
        """Whether a tensor of ``dtype`` to ``dst`` is encoded at all (else it goes as it is)."""
        if dtype != "float32" or self.spec.lossless:
            return False
        target = self.byte_target(dst)
        return target is None or target < 1.0

    def codec_for(self, x: np.ndarray, dst: int, role: str, basis: np.ndarray | None = None) -> CodecSpec:
        """The codec ``x`` leaves with for ``dst`` in ``role`` (act, grad, reduce); ``basis``: the
        link's learnt one, where it keeps one."""
        target = self.byte_target(dst)
        if target is None:
            return self.spec
        return self.chooser.choose(x, dst, role, target, basis)

    def link_state(self, role: str) -> LinkState | None:
        """A fresh per-link state for ``role``'s tensors, where the codec (or AdaTopK's candidates in a
        basis) keeps one: activations only, since a gradient's basis would mix samples."""
        if role != "act":
            return None
        if not self.spec.adaptive:
            return self.spec.codec.link_state(self.spec)
        states = [c.codec.link_state(c) for c in self.chooser.klt]
        # one basis for every candidate: the energy-keeping one unless all keep the leading directions (kltr)
        return next((s for s in states if s is not None and not getattr(s, "leading", False)), states[0] if states else None)

    def chosen(self) -> dict[str, dict[str, str]]:
        """The codec each destination and role last sent with (what a step reports)."""
        return self.chooser.chosen_by_destination()
