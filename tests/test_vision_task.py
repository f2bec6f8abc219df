"""The built-in vision task: a ResNet in a pipeline against one process, BatchNorm's buffers
included, through replicas and a checkpoint resumed on another split (in one process: harness.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.runtime.reference.single import train_single

# ResNet-18 with the CIFAR stem on 16x16 synthetic images: every layer kind of the family, a few
# seconds a step on one core
BASE = dict(task="vision", model="resnet18", batch_size=8, image_size=16, warmup=0, lr=1e-3)


def _buffers_and_weights(workers: list, reference: dict, names: set[str], rtol: float = 2e-4, atol: float = 2e-6) -> set[str]:
    seen = set()
    for w in workers:
        for key, value in w.runtime.state_tensors().items():
            if not key.startswith("param/"):
                continue
            name = key.removeprefix("param/")
            seen.add(name)
            if name in names or not names:
                np.testing.assert_allclose(value.double().numpy(), reference[name].double().numpy(), rtol=rtol, atol=atol, err_msg=name)
    return seen


def test_resnet18_in_three_stages_equals_one_process_buffers_included() -> None:
    """Fails when a stage boundary inside a residual block loses a gradient, or a stage's BatchNorm
    normalises or updates its running statistics differently from one process."""
    train = TrainConfig(steps=3, eval_every=3, eval_batches=1, **BASE)
    single = train_single(train, micro_batches=2)
    dist, workers = run_in_process(train, cluster_config(3, micro_batches=2, eval_every=3, eval_batches=1))
    np.testing.assert_allclose(dist.losses, single.losses, rtol=1e-5)
    np.testing.assert_allclose([v for _, v in dist.val_losses], [v for _, v in single.val_losses], rtol=1e-5)
    reference = {k: v.detach() for k, v in single.model.state_dict().items()}
    seen = _buffers_and_weights(workers, reference, set())
    assert {"bn1.running_mean", "layer4.1.bn2.running_var", "bn1.num_batches_tracked", "fc.weight"} <= seen
    assert seen == set(reference)  # every parameter and buffer lives on some stage


def test_resnet18_with_a_replicated_stage_trains_as_one_process() -> None:
    """Replicas run their own micro-batches (BatchNorm normalises each with its own rows, as one
    process accumulating the same micro-batches does) and keep their own running statistics."""
    train = TrainConfig(steps=2, eval_every=0, **BASE)
    single = train_single(train, micro_batches=4)
    dist, workers = run_in_process(train, cluster_config(3, replicas=[1, 2], micro_batches=4))
    np.testing.assert_allclose(dist.losses, single.losses, rtol=1e-5)
    reference = {k: v.detach() for k, v in single.model.state_dict().items()}
    weights = {k for k in reference if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    # the weights agree (AdamW's first steps move a weight by about lr whatever its gradient's size, so a
    # near-zero gradient summed in another order may move it a little differently); the buffers are each replica's own
    _buffers_and_weights(workers, reference, weights, rtol=1e-3, atol=2e-5)
    replicas = [w for w in workers if w.runtime.stage.index == 1]
    assert len(replicas) == 2
    a, b = (w.runtime.state_tensors() for w in replicas)
    assert not np.allclose(a["param/layer4.1.bn2.running_mean"].numpy(), b["param/layer4.1.bn2.running_mean"].numpy())


def test_a_resumed_vision_run_continues_with_the_buffers_it_saved(tmp_path: Path) -> None:
    """The running statistics travel in the checkpoint: a run resumed on another split continues
    with the losses and validation loss of the uninterrupted run (eval mode uses the buffers)."""
    ck = tmp_path / "ck"
    warm = {**BASE, "warmup": 2}  # the first two steps' learning rates do not depend on the run's length
    run_in_process(TrainConfig(steps=2, **warm), cluster_config(3, micro_batches=2, checkpoint_dir=str(ck), checkpoint_every=2))
    records: list[dict] = []
    resumed, _ = run_in_process(TrainConfig(steps=4, eval_every=4, eval_batches=1, **warm),
                                cluster_config(2, micro_batches=2, checkpoint_dir=str(ck), resume=True, eval_every=4, eval_batches=1),
                                on_step=records.append)
    whole = train_single(TrainConfig(steps=4, eval_every=4, eval_batches=1, **warm), micro_batches=2)
    assert [r["step"] for r in records] == [2, 3]
    np.testing.assert_allclose([r["loss"] for r in records], whole.losses[2:], rtol=1e-5)
    np.testing.assert_allclose(resumed.val_losses[-1][1], whole.val_losses[-1][1], rtol=1e-5)


def test_vision_options_reach_the_task_and_bad_ones_fail_in_one_line() -> None:
    from fusionllm.core.errors import ConfigError, RegistryError
    from fusionllm.models.task import load_task

    task = load_task("vision", {"model": "resnet18", "seed": 1, "batch_size": 4, "image_size": 16, "data": None})
    images, labels = task.batch(0)
    assert images.shape == (4, 3, 16, 16) and images.dtype == np.float32 and labels.shape == (4,)
    np.testing.assert_array_equal(task.batch(0)[0], images)
    with pytest.raises(RegistryError, match="resnet"):
        load_task("vision", {"model": "resnet7", "seed": 0, "batch_size": 4, "image_size": 16})
    with pytest.raises(ConfigError, match="does not exist"):
        load_task("vision", {"model": "resnet18", "data": "/nonexistent/images", "seed": 0, "batch_size": 4, "image_size": 16})


def test_numpy_workers_are_refused_a_cnn_in_one_line() -> None:
    from fusionllm.core.errors import FusionError

    with pytest.raises(FusionError, match=r"no worker can run op kinds .*Conv2d.*start a torch worker"):
        run_in_process(TrainConfig(steps=1, **BASE), cluster_config(2, micro_batches=2), backends=["numpy", "numpy"])
