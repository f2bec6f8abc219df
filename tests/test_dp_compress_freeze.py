"""``experiments/dp_compress.py``'s frozen second moment (issue 58): after the freeze AdamW's update is linear
in the gradient, so an error-fed burst of k steps' gradient moves a weight k times as far; a near-zero frozen
denominator is floored. Fails if the freeze keeps updating the second moment (the update of a doubled gradient
then stays about one step), or if the floor or the variant syntax is not applied."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "dp_compress.py"
_spec = importlib.util.spec_from_file_location("dp_compress", _PATH)
assert _spec is not None and _spec.loader is not None
dp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dp)


def _moved(scale: float, floor: float = 0.0) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([w], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    w.grad = torch.tensor([1.0, 1.0, 1.0, 0.0])
    opt.step()  # the second moment the freeze keeps: the last weight's is zero
    before = w.detach().clone()
    w.grad = torch.tensor([scale, scale, scale, 1e-3])
    dp.frozen_adamw_step(opt, floor)
    return w.detach() - before


def test_parse_variant() -> None:
    assert dp.parse_variant("lowrank:4@freeze=20@floor=50") == ("lowrank:4", 0, 20, 50)
    assert dp.parse_variant("lowrank:4@raw=3") == ("lowrank:4", 3, 0, 0)


def test_frozen_update_is_linear_and_floored() -> None:
    one, three = _moved(1.0), _moved(3.0)
    assert torch.allclose(three[:3] - one[:3], 2 * (one[:3] - _moved(0.0)[:3]))  # linear in the gradient
    assert abs(float(_moved(1.0)[3])) > 1.0  # unfloored: 1e-3 over a denominator near eps
    assert abs(float(_moved(1.0, 0.5)[3])) < 1e-3  # floored at half the tensor's mean
