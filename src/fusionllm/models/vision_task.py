"""The built-in ``vision`` task: a ResNet of ``--model`` classifying the images of ``--data``.

``--data`` is an image folder (one sub-folder per class), a CIFAR-10 binary directory, or nothing:
the embedded synthetic set (``data/images.py``, seeded, no download). Training batches are
augmented (random crop and flip, seeded per batch: the same wherever computed); validation batches
are not. Images up to 64 pixels get the CIFAR stem (a 3x3 convolution, no max-pool).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionllm.data.vision import VisionBatcher, load_vision
from fusionllm.models.resnet import VISION_MODELS, resnet
from fusionllm.models.task_record import Task

MAX_VAL_BATCHES = 1 << 30  # every whole validation batch there is
SMALL_INPUT = 64  # images at most this large get the CIFAR stem


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(dim=1) == labels).float().mean())


def vision_task(model: str = "resnet18", data: str | None = None, seed: int = 0, batch_size: int = 16, image_size: int = 32) -> Task:
    if model not in VISION_MODELS:  # resnet() says which names there are
        resnet(model)
    train, val = load_vision(data, image_size, seed)
    train_batches = VisionBatcher(train, batch_size, seed, augment=True)
    val_batches = VisionBatcher(val, batch_size, seed, augment=False)
    classes = train.num_classes
    return Task(
        model=lambda: resnet(model, classes, small_input=image_size <= SMALL_INPUT),
        train_batch=train_batches.arrays,
        val_batch=lambda j: val_batches.eval_arrays(j, MAX_VAL_BATCHES),
        loss=F.cross_entropy,
        val_batches=len(val_batches.eval_starts(MAX_VAL_BATCHES)),
        names=["images", "labels"],
        metric=accuracy,
        digest=f"{train.digest()}:{val.digest()}:{batch_size}:{seed}",
    )
