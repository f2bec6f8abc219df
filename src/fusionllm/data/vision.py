"""Image classification batches: pick a dataset from a ``--data`` source, and draw seeded batches.

Training batch ``i`` is a function of ``(dataset, seed, i)`` alone, as in ``data/batching.py``:
its images come from a seeded per-epoch permutation and its augmentation (random crop with
4-pixel zero padding, horizontal flip) from a generator seeded by ``(seed, i)``, in pure NumPy,
so every worker rebuilds the same batch on its own. Validation batches come in fixed order,
without augmentation.

Imports only numpy, Pillow (through ``data/images.py``), the standard library and
``fusionllm.core``; torch is imported only inside ``get``/``iter_eval``, which return tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fusionllm.core.errors import ConfigError
from fusionllm.data.images import (
    CIFAR_CLASSES,
    Cifar10,
    ImageFolder,
    SyntheticImages,
    VisionDataset,
    check_image_size,
    cifar_dir,
)

if TYPE_CHECKING:
    import torch

SYNTHETIC = "synthetic"
SYNTHETIC_TRAIN_SIZE = 10_000  # an "epoch" of the endless synthetic set
SYNTHETIC_VAL_SIZE = 2_000
VAL_FRACTION = 0.1  # of a plain image folder, by a hash of each file's relative path
PAD = 4  # pixels of zero padding before the random crop
# Default normalisation: the usual CIFAR-10 training-set channel statistics, for every dataset.
# Constants rather than statistics of each set, so a train and a validation batcher built apart
# (on different machines, too) always normalise alike; pass `channel_stats(train)` for exact ones.
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
_PERM_KEY = 0x56504552  # "VPER": seeds the per-epoch permutations
_AUG_KEY = 0x56415547  # "VAUG": seeds each batch's augmentation, apart from the permutations

__all__ = [
    "CIFAR_CLASSES", "CIFAR_MEAN", "CIFAR_STD", "Cifar10", "ImageFolder", "SyntheticImages",
    "VisionBatcher", "VisionDataset", "channel_stats", "load_vision",
]


def load_vision(source: str | os.PathLike[str] | None, image_size: int, seed: int) -> tuple[VisionDataset, VisionDataset]:
    """``(train, val)`` datasets named by ``source``.

    ``None`` or ``"synthetic"``: ``SyntheticImages`` (train seed ``2*seed``, val ``2*seed + 1``,
    so they never share an image). A directory holding ``data_batch_1.bin`` or
    ``cifar-10-batches-bin/``: CIFAR-10. A directory with ``train/`` and ``val/``: an
    ``ImageFolder`` each, which must have the same classes. Any other directory: one
    ``ImageFolder`` split 90/10 by a hash of each file's relative path.
    """
    size = check_image_size(image_size)
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}; pass a non-negative integer")
    if source is None or str(source).strip().lower() == SYNTHETIC:
        return (SyntheticImages(image_size=size, n=SYNTHETIC_TRAIN_SIZE, seed=2 * seed),
                SyntheticImages(image_size=size, n=SYNTHETIC_VAL_SIZE, seed=2 * seed + 1))
    path = Path(os.path.expanduser(str(source)))
    if not path.exists():
        raise ConfigError(f"vision data {str(source)!r} does not exist; pass a CIFAR-10 binary directory, "
                          f"a folder of class sub-folders of images, or {SYNTHETIC!r}")
    if not path.is_dir():
        raise ConfigError(f"vision data {str(source)!r} is a file, not a directory; extract it (CIFAR-10: the binary "
                          f"version) and pass the directory, or pass {SYNTHETIC!r}")
    if cifar_dir(path) is not None:
        return Cifar10(path, split="train", image_size=size), Cifar10(path, split="val", image_size=size)
    if (path / "train").is_dir() and (path / "val").is_dir():
        train, val = ImageFolder(path / "train", size), ImageFolder(path / "val", size)
        if train.classes != val.classes:
            raise ConfigError(f"image folder {str(path)!r}: train/ has classes {train.classes[:5]}... but val/ has "
                              f"{val.classes[:5]}...; give both the same class sub-folders")
        return train, val
    return (ImageFolder(path, size, part="train", val_fraction=VAL_FRACTION),
            ImageFolder(path, size, part="val", val_fraction=VAL_FRACTION))


def channel_stats(dataset: VisionDataset, limit: int = 2000, chunk: int = 250) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (in [0, 1] units) over the first ``limit`` images of ``dataset``."""
    n = min(len(dataset), limit)
    total, sq = np.zeros(3), np.zeros(3)
    for start in range(0, n, chunk):
        x = dataset.images(np.arange(start, min(n, start + chunk))).astype(np.float64) / 255.0
        total += x.sum((0, 1, 2))
        sq += (x * x).sum((0, 1, 2))
    count = n * dataset.image_size**2
    mean = total / count
    std = np.sqrt(np.maximum(sq / count - mean**2, 1e-12))
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


class VisionBatcher:
    """Draw ``(images, labels)`` batches: float32 (B, 3, H, W) normalised per channel, int64 (B,).

    Mirrors ``Batcher``: ``offsets``/``arrays``/``get`` for training batch ``step`` and
    ``eval_starts``/``eval_arrays``/``iter_eval`` for validation batches.
    """

    def __init__(self, dataset: VisionDataset, batch_size: int, seed: int, *, augment: bool,
                 mean: Sequence[float] = CIFAR_MEAN, std: Sequence[float] = CIFAR_STD) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}; pass e.g. batch_size=64")
        if seed < 0:
            raise ConfigError(f"seed must be >= 0, got {seed}; pass a non-negative integer")
        if len(dataset) < 1:
            raise ConfigError("the image dataset is empty; pass a source with images in it")
        m, s = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
        if m.shape != (3,) or s.shape != (3,) or not np.all(s > 0):
            raise ConfigError(f"mean and std need 3 values each (R, G, B), std all positive; got {list(mean)} and {list(std)}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.augment = bool(augment)
        # (x / 255 - mean) / std as one multiply-add per pixel, broadcast over (B, 3, H, W).
        self._scale = (1.0 / (255.0 * s)).reshape(1, 3, 1, 1)
        self._shift = (-m / s).reshape(1, 3, 1, 1)
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Batches per epoch (the last one runs on into the next epoch's permutation)."""
        return -(-len(self.dataset) // self.batch_size)

    def digest(self) -> str:
        return self.dataset.digest()

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([_PERM_KEY, self.seed, epoch]).permutation(len(self.dataset))
            if len(self._perms) >= 2:  # steps move forward: this epoch and the next are enough
                self._perms.pop(min(self._perms), None)  # None: another thread may have dropped it
            self._perms[epoch] = perm
        return perm

    def offsets(self, step: int) -> np.ndarray:
        """Dataset indices of training batch ``step``, shape (B,): positions ``step*B ..`` of the
        endless sequence of per-epoch permutations (epoch = position // len)."""
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        n = len(self.dataset)
        pos = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        epochs = pos // n
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = self._perm(epoch)[pos[sel] % n]
        return out

    def arrays(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Training batch ``step`` as NumPy arrays, augmented when ``augment``."""
        idx = self.offsets(step)
        images = self.dataset.images(idx)
        if self.augment:
            images = self._augment(images, np.random.default_rng([_AUG_KEY, self.seed, step]))
        return self._normalise(images), self.dataset.labels[idx].astype(np.int64)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch ``step`` as torch tensors (imports torch)."""
        return _tensors(*self.arrays(step))

    def eval_starts(self, max_batches: int) -> list[np.ndarray]:
        """Dataset indices of the whole validation batches, in order: batch ``j`` is images
        ``j*B .. (j+1)*B - 1``, at most ``max_batches`` of them, a last partial batch left out."""
        whole = min(len(self.dataset) // self.batch_size, max_batches)
        return [np.arange(j * self.batch_size, (j + 1) * self.batch_size, dtype=np.int64) for j in range(whole)]

    def eval_arrays(self, index: int, max_batches: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole validation batch ``index`` (of ``eval_starts``), never augmented."""
        whole = min(len(self.dataset) // self.batch_size, max_batches)
        if not 0 <= index < whole:
            raise ConfigError(f"evaluation batch {index} does not exist: the validation split holds {whole} whole batches")
        idx = np.arange(index * self.batch_size, (index + 1) * self.batch_size, dtype=np.int64)
        return self._normalise(self.dataset.images(idx)), self.dataset.labels[idx].astype(np.int64)

    def iter_eval(self, max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Up to ``max_batches`` validation batches as tensors, the last one partial when the images run out."""
        if max_batches < 1:
            raise ConfigError(f"max_batches must be >= 1, got {max_batches}")
        n = min(len(self.dataset), max_batches * self.batch_size)
        for start in range(0, n, self.batch_size):
            idx = np.arange(start, min(n, start + self.batch_size), dtype=np.int64)
            yield _tensors(self._normalise(self.dataset.images(idx)), self.dataset.labels[idx].astype(np.int64))

    def _augment(self, images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Random crop of the image padded with ``PAD`` black pixels on each side, then a coin-flip
        horizontal flip: one fancy-indexing gather for the whole batch."""
        b, h, w, _ = images.shape
        padded = np.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
        dy = rng.integers(0, 2 * PAD + 1, size=b)
        dx = rng.integers(0, 2 * PAD + 1, size=b)
        flip = rng.random(b) < 0.5
        rows = dy[:, None] + np.arange(h)
        cols = dx[:, None] + np.arange(w)
        cols = np.where(flip[:, None], cols[:, ::-1], cols)
        return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]

    def _normalise(self, images: np.ndarray) -> np.ndarray:
        x = images.transpose(0, 3, 1, 2).astype(np.float32)
        return np.ascontiguousarray(x * self._scale + self._shift, dtype=np.float32)


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    import torch  # here only: NumPy-only workers never call this

    return torch.from_numpy(x), torch.from_numpy(y)
