"""Typed control messages and checkpoint shards: every field checked on decode, sizes before allocation."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionllm.core.errors import ConfigError, WireError
from fusionllm.transport.control import (
    VERSION,
    Assign,
    DataSpec,
    Evaluated,
    Failure,
    Hyper,
    LiveState,
    Register,
    Step,
    StepDone,
)
from fusionllm.transport.messages import pack, unpack
from fusionllm.transport.shards import read_selected, shard_keys, stage_keep, write_shard
from fusionllm.transport.worker_info import DeviceInfo, WorkerInfo


def test_messages_round_trip_through_msgpack() -> None:
    msgs = [
        Step(3, 1e-3, None, {"2": 0.2}),
        StepDone(losses={"0": 1.5}, grad_norm=0.3, link_stats={"1": [10.0, 0.1, 2.0]}, failed=Failure(0, 2, "0F1", "boom")),
        Evaluated(losses={"0": {"1": 2.0}}),
        Assign(worker=1, graph="{}", plan="{}", addresses={"0": "h:1"}, hyper=Hyper(lr=0.1), nbytes=0,
               data=DataSpec(source=None, seed=0, batch_size=8, seq_len=16, val_fraction=0.1, digest="ab", eval_batches=2)),
    ]
    for m in msgs:
        assert type(m).from_wire(unpack(pack(m.to_wire()))) == m


@pytest.mark.parametrize(("raw", "why"), [
    ({"step": 1}, "field 'lr' is missing"),
    ({"step": "1", "lr": 0.1}, "Step.step: expected an integer"),
    ({"step": True, "lr": 0.1}, "Step.step: expected an integer"),
    ({"step": 1, "lr": 0.1, "ratios": {"1": "x"}}, "Step.ratios"),
    ({"step": 1, "lr": 0.1, "ratios": [1]}, "Step.ratios"),
    ({"step": 1, "lr": 0.1, "v": VERSION + 1}, "message version"),
    ([1, 2], "expected a map"),
])
def test_a_malformed_message_names_its_field(raw: object, why: str) -> None:
    with pytest.raises(WireError, match=why.replace("(", r"\(").replace(")", r"\)")):
        Step.from_wire(raw)


def test_nested_messages_are_checked_too() -> None:
    good = StepDone(failed=Failure(0, 1, "0F0", "x")).to_wire()
    good["failed"]["index"] = "one"
    with pytest.raises(WireError, match="Failure.index"):
        StepDone.from_wire(good)


def test_register_keeps_a_device_map_of_plain_values() -> None:
    raw = Register(version="1", protocol=1, address="h:1", backend="torch", device={"kind": "cpu", "cores": 2}).to_wire()
    assert Register.from_wire(raw).device == {"kind": "cpu", "cores": 2}
    raw["device"] = {"kind": {"nested": 1}}
    with pytest.raises(WireError, match="Register.device"):
        Register.from_wire(raw)


def test_the_coordinator_keeps_a_typed_worker_info_from_register() -> None:
    live = LiveState(step=7, stage=1, stages=2, epoch=0, plan="p", graph="g", seed=3)
    sent = Register(version="1", protocol=1, address="h:1", data_address="h:2", backend="numpy", kinds=["linear", "relu"],
                    device={"kind": "cuda", "name": "H200", "memory_bytes": 2**30}, software={"numpy": "2.1", "torch": "2.4"},
                    hostname="box", pid=42, probe={"matmul_flops": 1e12}, live=live, relay="r:9", relay_offer="")
    info = WorkerInfo.from_register(Register.from_wire(pack_round_trip(sent.to_wire())))
    assert (info.address, info.data_address, info.hostname, info.pid, info.matmul_flops) == ("h:1", "h:2", "box", 42, 1e12)
    assert info.device == DeviceInfo("cuda", "H200", 2**30, None) and info.kinds == ("linear", "relu") and not info.runs_all_kinds
    assert info.live == live and info.relayed and info.torch_version == "2.4" and info.describe() == "cuda, numpy 2.1"
    moved = info.moved("r2:1", "r2:2", "r2:9")
    assert (moved.address, moved.relay, info.address) == ("r2:1", "r2:9", "h:1")  # a new record; the old one is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.relay = ""  # type: ignore[misc]
    assert WorkerInfo.from_register(Register(version="1", protocol=1, address="h:1")).runs_all_kinds  # Register's default "*"


def pack_round_trip(raw: dict) -> dict:
    return unpack(pack(raw))


def _shard(tmp: Path, stage: int, tensors: dict[str, torch.Tensor]) -> Path:
    path, digest = write_shard(tmp, stage, st_save(tensors))
    assert len(digest) == 64 and not list(tmp.glob(".*.part"))
    return path


def test_a_stage_reads_only_its_tensors_from_every_shard(tmp_path: Path) -> None:
    a = {"param/w": torch.arange(6.0).reshape(2, 3), "adam/exp_avg/w": torch.ones(2, 3), "param/tied": torch.full((2,), 7.0)}
    b = {"param/v": torch.arange(4, dtype=torch.bfloat16), "param/tied": torch.full((2,), 7.0), "adam/exp_avg/v": torch.zeros(4)}
    paths = [_shard(tmp_path, 0, a), _shard(tmp_path, 1, b)]
    assert sorted(shard_keys(paths[1])) == sorted(b)
    got = st_load(read_selected(paths, stage_keep({"w", "tied", "v"})))
    assert set(got) == set(a) | set(b)  # the tied tensor once
    for k, v in {**a, **b}.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype
    only = st_load(read_selected(paths, stage_keep({"v"})))
    assert set(only) == {"param/v", "adam/exp_avg/v"}


def test_a_damaged_shard_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    path = _shard(tmp_path, 0, {"param/w": torch.ones(1000)})
    data = path.read_bytes()
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 60) + data[8:])
    with pytest.raises(ConfigError, match="declares a header"):
        read_selected([huge], lambda _: True)
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8 : 8 + n])
    head["param/w"]["data_offsets"] = [0, 1 << 40]
    text = json.dumps(head).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    with pytest.raises(ConfigError, match="outside the file"):
        read_selected([bad], lambda _: True)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:4])
    with pytest.raises(ConfigError, match="truncated"):
        read_selected([cut], lambda _: True)
    assert np.isfinite(1.0)


def test_no_message_field_is_untyped() -> None:
    import dataclasses
    import typing

    from fusionllm.transport import control

    kinds = [c for c in vars(control).values() if isinstance(c, type) and issubclass(c, control.Message) and c is not control.Message]
    assert len(kinds) >= 20
    for cls in kinds:
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            assert "Any" not in str(hint), f"{cls.__name__}.{f.name}: {hint}"
