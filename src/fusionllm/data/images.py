"""Image classification datasets: a folder of images, CIFAR-10 binaries, and a seeded synthetic set.

Every dataset offers the same small interface (``VisionDataset``): ``len``, ``num_classes``,
``image_size``, ``classes``, ``labels`` (int64), ``images(indices)`` (uint8, (N, H, W, 3), RGB) and
``digest()``, a sha256 hex string that two machines compare to know they hold the same data.

Imports only numpy, Pillow, the standard library and ``fusionllm.core``: NumPy-only workers, which
have no torch, read their batches from here too.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from fusionllm.core.errors import ConfigError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})  # compared lower-cased: .JPG counts too
DEFAULT_CACHE_BYTES = 256 << 20  # decoded images an ImageFolder keeps: ~85k at 32 px, ~1.7k at 224 px
CIFAR_DIRNAME = "cifar-10-batches-bin"
CIFAR_TRAIN_FILES = tuple(f"data_batch_{k}.bin" for k in range(1, 6))
CIFAR_VAL_FILES = ("test_batch.bin",)
CIFAR_RECORD = 1 + 3 * 32 * 32  # one label byte, then the 32x32 image as R, G, B planes
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_BAD_IMAGE = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


class VisionDataset(Protocol):
    """What ``VisionBatcher`` needs from a dataset."""

    num_classes: int
    image_size: int
    classes: list[str]

    def __len__(self) -> int: ...

    @property
    def labels(self) -> np.ndarray: ...

    def images(self, indices: Sequence[int] | np.ndarray) -> np.ndarray: ...

    def digest(self) -> str: ...


def check_image_size(image_size: int) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 1:
        raise ConfigError(f"image size must be a positive whole number of pixels, got {image_size!r}; pass e.g. 32")
    return int(image_size)


def _index_array(indices: Sequence[int] | np.ndarray, n: int, what: str) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ConfigError(f"{what}: image index out of range 0..{n - 1} in {idx.tolist()[:8]}")
    return idx


def _resize_square(img: Image.Image, size: int) -> np.ndarray:
    """Shorter side to ``size`` (bilinear), then the centre ``size`` x ``size`` square, as uint8 RGB."""
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.uint8)


# --- a folder of images ------------------------------------------------------------------------


class ImageFolder:
    """Images under ``root/<class name>/...`` (any depth), classes numbered by sorted folder name.

    Files ending .png/.jpg/.jpeg (any case; hidden files skipped) are decoded lazily, per batch,
    to RGB, resized so the shorter side is ``image_size`` and centre-cropped to a square; up to
    ``cache_bytes`` of decoded images stay cached (least recently used go first).

    ``part`` keeps all files (``"all"``) or one side of a deterministic split by a hash of each
    file's path relative to ``root``: ``"val"`` about ``val_fraction`` of them, ``"train"`` the
    rest. Both sides number classes from the same folder list.
    """

    def __init__(self, root: str | os.PathLike[str], image_size: int, *, part: str = "all",
                 val_fraction: float = 0.1, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.root = Path(root)
        self.image_size = check_image_size(image_size)
        if part not in ("all", "train", "val"):
            raise ConfigError(f"image folder part must be 'all', 'train' or 'val', got {part!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be strictly between 0 and 1, got {val_fraction!r}; pass e.g. 0.1")
        if not self.root.is_dir():
            raise ConfigError(f"image folder {str(self.root)!r} is not a directory; pass a folder with one sub-folder of images per class")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise ConfigError(f"image folder {str(self.root)!r} has no class sub-folders; put each class's images in root/<class name>/")
        self.num_classes = len(self.classes)
        files: list[tuple[str, int]] = []  # (path relative to root, posix; class index)
        for label, name in enumerate(self.classes):
            found = _image_files(self.root / name)
            if not found:
                raise ConfigError(f"class folder {str(self.root / name)!r} holds no .png/.jpg/.jpeg image; add images or remove the folder")
            files.extend((f"{name}/{rel}", label) for rel in found)
        if part != "all":
            in_val = [_hash_fraction(rel) < val_fraction for rel, _ in files]
            files = [f for f, v in zip(files, in_val, strict=True) if v == (part == "val")]
            if not files:
                raise ConfigError(f"image folder {str(self.root)!r}: no image falls in the {part} part of a {val_fraction:.0%} split; "
                                  "add images, or make train/ and val/ sub-folders")
        self.part = part
        self.files = [rel for rel, _ in files]
        self._labels = np.array([label for _, label in files], dtype=np.int64)
        self._labels.setflags(write=False)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_limit = max(0, int(cache_bytes)) // (3 * self.image_size**2)
        self._lock = threading.Lock()  # a worker may read train and eval batches from two threads
        self._digest: str | None = None

    def __len__(self) -> int:
        return len(self.files)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def images(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = _index_array(indices, len(self), f"image folder {str(self.root)!r}")
        out = np.empty((idx.size, self.image_size, self.image_size, 3), dtype=np.uint8)
        for row, i in enumerate(idx.tolist()):
            with self._lock:
                hit = self._cache.get(i)
                if hit is not None:
                    self._cache.move_to_end(i)
            if hit is None:
                hit = self._decode(i)
                with self._lock:
                    self._cache[i] = hit
                    while len(self._cache) > self._cache_limit:
                        self._cache.popitem(last=False)
            out[row] = hit
        return out

    def _decode(self, i: int) -> np.ndarray:
        path = self.root / self.files[i]
        try:
            with Image.open(path) as img:
                img.draft("RGB", (self.image_size, self.image_size))  # JPEG: decode at a reduced scale, much faster
                return _resize_square(img.convert("RGB"), self.image_size)
        except _BAD_IMAGE as exc:
            raise ConfigError(f"image file {str(path)!r} cannot be decoded by Pillow ({type(exc).__name__}: {exc}); "
                              "replace or delete it") from None

    def digest(self) -> str:
        """sha256 over the size, class names and each file's relative path, byte size and label."""
        if self._digest is None:
            h = hashlib.sha256(f"imagefolder/{self.image_size}/{self.classes!r}\n".encode())
            for rel, label in zip(self.files, self._labels.tolist(), strict=True):
                h.update(f"{rel}\0{(self.root / rel).stat().st_size}\0{label}\n".encode())
            self._digest = h.hexdigest()
        return self._digest


def _image_files(folder: Path) -> list[str]:
    """Image files below ``folder`` as sorted posix paths relative to it, hidden ones skipped."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES:
                found.append(Path(os.path.relpath(os.path.join(dirpath, name), folder)).as_posix())
    return sorted(found)


def _hash_fraction(rel: str) -> float:
    """A number in [0, 1) fixed by the path alone, so every machine splits a folder the same way."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2.0**64


# --- CIFAR-10 ----------------------------------------------------------------------------------


def cifar_dir(path: str | os.PathLike[str]) -> Path | None:
    """The CIFAR-10 binary directory at or just inside ``path``, or None when neither holds one."""
    p = Path(path)
    if (p / CIFAR_TRAIN_FILES[0]).is_file():
        return p
    if (p / CIFAR_DIRNAME).is_dir():
        return p / CIFAR_DIRNAME
    return None


class Cifar10:
    """CIFAR-10's binary version: ``split="train"`` reads data_batch_1..5.bin, ``"val"`` test_batch.bin.

    ``path`` is that directory or the one holding ``cifar-10-batches-bin/``. Records stay in one
    (N, 3073) uint8 array; ``images`` transposes the planes to (H, W, 3) per batch, and resizes
    with Pillow (bilinear) only when ``image_size`` is not 32.
    """

    def __init__(self, path: str | os.PathLike[str], *, split: str = "train", image_size: int = 32) -> None:
        if split not in ("train", "val"):
            raise ConfigError(f"cifar-10 split must be 'train' or 'val', got {split!r}")
        self.image_size = check_image_size(image_size)
        base = cifar_dir(path) or Path(path)
        names = CIFAR_TRAIN_FILES if split == "train" else CIFAR_VAL_FILES
        sizes: list[int] = []
        for name in names:  # check every file before allocating anything
            file = base / name
            if not file.is_file():
                raise ConfigError(f"cifar-10 file {str(file)!r} is missing; download and extract the binary version "
                                  "(cifar-10-binary.tar.gz) or pass another --data")
            size = file.stat().st_size
            if size == 0 or size % CIFAR_RECORD:
                raise ConfigError(f"cifar-10 file {str(file)!r}: {size} bytes is not a whole number of {CIFAR_RECORD}-byte records; "
                                  "re-download or pass another --data")
            sizes.append(size)
        self.split = split
        self.files = [str(base / name) for name in names]
        self._records = np.empty((sum(sizes) // CIFAR_RECORD, CIFAR_RECORD), dtype=np.uint8)
        flat = memoryview(self._records.reshape(-1))
        start = 0
        for file, size in zip(self.files, sizes, strict=True):
            with open(file, "rb") as f:
                got = f.readinto(flat[start : start + size])
            if got != size:
                raise ConfigError(f"cifar-10 file {file!r} changed while being read ({got} of {size} bytes); re-download it")
            labels = self._records[start // CIFAR_RECORD : (start + size) // CIFAR_RECORD, 0]
            bad = np.flatnonzero(labels > 9)
            if bad.size:
                raise ConfigError(f"cifar-10 file {file!r}: record {int(bad[0])} has label {int(labels[bad[0]])}, above 9; "
                                  "this is not the CIFAR-10 binary version (CIFAR-100?); re-download or pass another --data")
            start += size
        self._records.setflags(write=False)
        self._labels = self._records[:, 0].astype(np.int64)
        self._labels.setflags(write=False)
        self.classes = list(CIFAR_CLASSES)
        self.num_classes = len(CIFAR_CLASSES)
        self._digest: str | None = None

    def __len__(self) -> int:
        return int(self._records.shape[0])

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def images(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = _index_array(indices, len(self), f"cifar-10 {self.split}")
        planes = self._records[idx, 1:].reshape(-1, 3, 32, 32)
        out = np.ascontiguousarray(planes.transpose(0, 2, 3, 1))
        if self.image_size == 32:
            return out
        resized = np.empty((len(out), self.image_size, self.image_size, 3), dtype=np.uint8)
        for row, im in enumerate(out):
            resized[row] = _resize_square(Image.fromarray(im), self.image_size)
        return resized

    def digest(self) -> str:
        """sha256 over the image size and the raw records (~150 MB for train: a fraction of a second)."""
        if self._digest is None:
            h = hashlib.sha256(f"cifar10/{self.image_size}\n".encode())
            h.update(memoryview(self._records.reshape(-1)))
            self._digest = h.hexdigest()
        return self._digest


# --- synthetic ---------------------------------------------------------------------------------

SYNTHETIC_VERSION = 1  # bump when the generator changes: it is part of the digest
_SYNTH_KEY = 0x53594E31  # "SYN1": keeps these streams apart from other seeded generators
# A class is a (colour, orientation, frequency) triple: class c takes colour c % 3, orientation
# c % 4 and frequency c % 5, distinct for c < 60 (3, 4, 5 coprime) while no one attribute alone
# names the class, so a classifier must combine colour with the stripes' spectrum.
_PALETTE = np.array([[0.95, 0.30, 0.20], [0.20, 0.85, 0.30], [0.30, 0.40, 0.95]], dtype=np.float32)
_ORIENT = (np.pi * np.arange(4) / 4).astype(np.float32) # 0, 45, 90, 135 degrees
_FREQ = np.array([2.0, 3.0, 4.5, 6.5, 9.0], dtype=np.float32)  # cycles across the image, so any image_size looks alike
MAX_SYNTHETIC_CLASSES = 60


class SyntheticImages:
    """A seeded, learnable image classification set made on the fly: nothing to download.

    Image ``i`` is a function of ``(seed, i)`` alone; its label is ``i % num_classes``. It shows
    the class's colour in stripes of the class's orientation and frequency (each jittered),
    at a random phase, inside a soft blob at a random place and size, over a random tinted
    background, with faint stripes of a random orientation and frequency and pixel noise on top.
    """

    def __init__(self, num_classes: int = 10, image_size: int = 32, n: int = 10_000, seed: int = 0) -> None:
        if not 2 <= num_classes <= MAX_SYNTHETIC_CLASSES:
            raise ConfigError(f"synthetic images support 2..{MAX_SYNTHETIC_CLASSES} classes, got {num_classes}")
        if n < 1 or seed < 0:
            raise ConfigError(f"synthetic images need n >= 1 and seed >= 0, got n={n}, seed={seed}")
        self.num_classes = int(num_classes)
        self.image_size = check_image_size(image_size)
        self.n = int(n)
        self.seed = int(seed)
        self.classes = [f"class_{c}" for c in range(self.num_classes)]
        self._labels = np.arange(self.n, dtype=np.int64) % self.num_classes
        self._labels.setflags(write=False)

    def __len__(self) -> int:
        return self.n

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def images(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = _index_array(indices, self.n, "synthetic images")
        out = np.empty((idx.size, self.image_size, self.image_size, 3), dtype=np.uint8)
        step = max(1, (1 << 18) // self.image_size**2)  # ~1 MB per float plane: stays in cache, many times faster
        for start in range(0, idx.size, step):
            out[start : start + step] = self._render(idx[start : start + step])
        return out

    def _render(self, idx: np.ndarray) -> np.ndarray:
        s, b = self.image_size, idx.size
        params = np.empty((b, 16), dtype=np.float32)  # float32 throughout: half the memory traffic
        noise = np.empty((b, s, s, 3), dtype=np.float32)
        for row, i in enumerate(idx.tolist()):  # one generator per image: image i never depends on its batch
            rng = np.random.default_rng([_SYNTH_KEY, self.seed, i])
            params[row] = rng.random(16, dtype=np.float32)
            noise[row] = rng.standard_normal((s, s, 3), dtype=np.float32)
        p = params.T
        c = idx % self.num_classes
        theta = _ORIENT[c % 4] + (p[0] - 0.5) * 0.5           # +-14 degrees
        freq = _FREQ[c % 5] * (0.85 + 0.3 * p[1])            # +-15 %
        phase = 2 * np.pi * p[2]
        cx, cy = 0.25 + 0.5 * p[3], 0.25 + 0.5 * p[4]
        radius = 0.22 + 0.18 * p[5]
        amp = 0.35 + 0.3 * p[6]
        colour = np.clip(_PALETTE[c % 3] + (p[7:10].T - 0.5) * 0.5, 0.0, 1.0)
        background = 0.15 + 0.45 * p[10][:, None] + (p[11:14].T - 0.5) * 0.3
        d_theta, d_freq, d_amp = np.pi * p[14], 1.5 + 8.0 * p[15], 0.06

        g = ((np.arange(s) + 0.5) / s).astype(np.float32)
        x, y = g[None, None, :], g[None, :, None]

        def stripes(angle: np.ndarray, f: np.ndarray, ph: np.ndarray | float) -> np.ndarray:
            proj = (x - 0.5) * np.cos(angle)[:, None, None] + (y - 0.5) * np.sin(angle)[:, None, None]
            return np.sin(2 * np.pi * f[:, None, None] * proj + ph)

        blob = np.exp(-((x - cx[:, None, None]) ** 2 + (y - cy[:, None, None]) ** 2) / (2 * radius[:, None, None] ** 2))
        fg = (amp[:, None, None] * blob * 0.5 * (1.0 + stripes(theta, freq, phase[:, None, None])))[..., None]
        img = background[:, None, None, :] * (1.0 - fg) + fg * colour[:, None, None, :]
        img = img + (d_amp * stripes(d_theta, d_freq, 0.0))[..., None] + 0.06 * noise
        return np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8)

    def digest(self) -> str:
        """The set is a pure function of its arguments and the generator version: hash those."""
        key = f"synthetic/v{SYNTHETIC_VERSION}/{self.num_classes}/{self.image_size}/{self.n}/{self.seed}"
        return hashlib.sha256(key.encode()).hexdigest()
