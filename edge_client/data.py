"""Local data sets of a device and the sources they are named by.

A :class:`Dataset` holds images ``x [N, C, H, W]`` and int64 labels ``y [N]``: **uint8
pixels** (intensity = value / 255: IDX, CIFAR-10 and uint8 ``.npz`` files, held as stored,
a quarter of float32's memory) or float32 intensities in [0, 1] (the digits, float
``.npz`` files). :func:`float_images` gives a float device its float32 view; integer
devices turn either into their s-bit activation integers once (:func:`quantize_images`: a
table lookup for pixels). Nothing here imports torch or scikit-learn.

**Sources** (``fedbit-edge run --data SRC``, ``fedbit serve --eval-data SRC``;
docs/experiments.md#data-sets)::

    SRC  := BASE[:PART]
    BASE := digits | fashion-mnist | mnist | DIR | FILE.npz   (nothing is ever downloaded)
    PART := K/N | train | test       (shard K of N of the training split, IID and seeded; a split)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from edge_client.data_formats import (
    is_cifar10_folder,
    is_idx_folder,
    read_cifar10,
    read_idx_folder,
    read_npz,
)
from edge_client.errors import ConfigError

DIGITS_TEST_SIZE = 360  # of 1797 images; the split is fixed (seed DIGITS_SPLIT_SEED)
DIGITS_SPLIT_SEED = 20240611
#: where Debian's package ``dataset-fashion-mnist`` installs the IDX files
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
#: data sets named by the sources and experiment configs (``digits``: bundled; ``cifar10``,
#: ``mnist``, ``idx``, ``npz``: a path is needed)
DATASETS = ("digits", "fashion-mnist", "mnist", "cifar10", "idx", "npz")

_PIXEL_TO_FLOAT = np.arange(256, dtype=np.float32) / np.float32(255.0)


@dataclass(frozen=True)
class Dataset:
    """Images ``x`` ``[N, C, H, W]`` (uint8 pixels, or float32 in [0, 1]) and labels ``y``
    int64 ``[N]``."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.ndim < 2 or self.y.ndim != 1 or len(self.x) != len(self.y):
            raise ConfigError(
                f"Dataset: x {list(self.x.shape)} and y {list(self.y.shape)} do not match")
        if self.x.dtype != np.uint8 and self.x.dtype.kind != "f":
            raise ConfigError(f"Dataset: x must be uint8 pixels or float intensities, got {self.x.dtype}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: np.ndarray) -> Dataset:
        """The samples at the integer indices ``idx`` (copies)."""
        return Dataset(self.x[idx], self.y[idx])

    @property
    def num_classes(self) -> int:
        """The largest label + 1 (0 for an empty or unlabelled set)."""
        return int(self.y.max()) + 1 if len(self.y) and int(self.y.max()) >= 0 else 0


def float_images(x: np.ndarray) -> np.ndarray:
    """float32 intensities in [0, 1], same shape: uint8 pixels / 255 (exactly
    ``float32(p) / float32(255)``), float images as float32 (no copy when they are)."""
    if x.dtype == np.uint8:
        return _PIXEL_TO_FLOAT[x]
    return np.ascontiguousarray(x, dtype=np.float32)


def quantize_images(x: np.ndarray, bits: int) -> np.ndarray:
    """Images -> s-bit activation integers ``round(x * (2^(s-1) - 1))``, x in [0, 1].

    Same shape as ``x``; int8 for s <= 8, int16 up to 16 bits. uint8 pixels go through a
    256-entry integer table, ``(2 p amax + 255) // 510`` (= round(p amax / 255), never a
    tie), equal to the float formula on ``float_images(x)`` for every pixel and width.
    """
    if not 2 <= bits <= 16:
        raise ConfigError(f"quantize_images: bits must be in 2..16, got {bits}")
    amax = (1 << (bits - 1)) - 1
    dtype = np.int8 if bits <= 8 else np.int16
    if x.dtype == np.uint8:
        table = ((np.arange(256, dtype=np.int64) * (2 * amax) + 255) // 510).astype(dtype)
        return table[x]
    q = np.rint(np.clip(x, 0.0, 1.0) * np.float32(amax))
    return q.astype(dtype)


def _digits_file() -> str:
    """The digits CSV that scikit-learn bundles (found without importing scikit-learn,
    whose import alone costs a device tens of MB of RSS: docs/performance.md#memory)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    raise ConfigError("the digits data set needs scikit-learn's bundled copy (pip install 'fedbit[data]')")


def _digits_all() -> Dataset:
    """All 1797 digits: scikit-learn's ``load_digits()`` images / 16 and targets, read
    from its bundled CSV (64 pixel columns 0..16, then the label)."""
    import gzip

    with gzip.open(_digits_file(), "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    x = (table[:, :-1] / np.float32(16.0)).reshape(-1, 1, 8, 8)
    return Dataset(np.ascontiguousarray(x), table[:, -1].astype(np.int64))


def load_digits(split: str = "train") -> Dataset:
    """scikit-learn's bundled 8x8 digits, fixed seeded split: 1437 train / 360 test.

    x: float32 ``[N, 1, 8, 8]`` in [0, 1] (pixel / 16); y: int64 ``[N]`` in 0..9.
    """
    if split not in ("train", "test"):
        raise ConfigError(f"digits split must be 'train' or 'test', got {split!r}")
    data = _digits_all()
    perm = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(data))
    idx = perm[:DIGITS_TEST_SIZE] if split == "test" else perm[DIGITS_TEST_SIZE:]
    return data.subset(np.sort(idx))


def shard(data: Dataset, k: int, n: int, seed: int = 0, what: str = "data") -> Dataset:
    """Shard ``k`` (1..n) of ``n`` IID shards of ``data`` (a seeded shuffle: the same
    shards on every device and machine)."""
    if n < 1 or not 1 <= k <= n:
        raise ConfigError(f"{what} shard {k}/{n}: need 1 <= k <= n")
    if n > len(data):
        raise ConfigError(f"{what} shard {k}/{n}: only {len(data)} training images")
    perm = np.random.default_rng(seed).permutation(len(data))
    return data.subset(np.sort(np.array_split(perm, n)[k - 1]))


def digits_shard(k: int, n: int, seed: int = 0) -> Dataset:
    """Shard ``k`` (1..n) of ``n`` IID shards of the digits train split (seeded shuffle)."""
    return shard(load_digits("train"), k, n, seed, "digits")


def dataset_location(name: str, path: str | None = None) -> str:
    """The file or folder data set ``name`` is read from: ``path``, or the packaged
    location (``fashion-mnist``); ConfigError saying which package or path provides it."""
    if name not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    if name == "digits":
        if path:
            raise ConfigError("digits: scikit-learn's bundled copy is used; a path is not")
        return ""
    never = "fedbit never downloads data"
    if name == "fashion-mnist":
        folder = os.path.expanduser(path or FASHION_MNIST_DIR)
        if not os.path.isdir(folder):
            how = (f"install Debian's package {FASHION_MNIST_PACKAGE} (apt-get install "
                   f"{FASHION_MNIST_PACKAGE}) or give the folder of its IDX files" if not path
                   else "give the folder of Fashion-MNIST's IDX files")
            raise ConfigError(f"fashion-mnist: {folder} is missing: {how}; {never}")
        return folder
    what = {"mnist": "the folder of MNIST's IDX files (train-images-idx3-ubyte[.gz], ...)",
            "idx": "a folder of IDX files (train-images-idx3-ubyte[.gz], ...)",
            "cifar10": "the CIFAR-10 folder (python batches: data_batch_1..5, test_batch)",
            "npz": "a .npz file with x_train, y_train, x_test, y_test"}[name]
    if not path:
        raise ConfigError(f"{name}: needs a path: {what}; {never}")
    location = os.path.expanduser(path)
    ok = os.path.isfile(location) if name == "npz" else os.path.isdir(location)
    if not ok:
        raise ConfigError(f"{name}: {location!r} is not {'a file' if name == 'npz' else 'a folder'}: "
                          f"expected {what}; {never}")
    return location


def load_split(name: str, path: str | None = None, split: str = "train") -> Dataset:
    """Split ``train`` or ``test`` of data set ``name`` (:data:`DATASETS`) read from
    ``path`` or its packaged location (:func:`dataset_location`)."""
    if split not in ("train", "test"):
        raise ConfigError(f"{name}: split must be 'train' or 'test', got {split!r}")
    location = dataset_location(name, path)
    if name == "digits":
        return load_digits(split)
    if name == "npz":
        return Dataset(*read_npz(location, split))
    if name == "cifar10":
        return load_cifar10(location, split)
    return Dataset(*read_idx_folder(location, split))


def load_cifar10(folder: str, split: str = "train") -> Dataset:
    """CIFAR-10 in the standard python-pickle layout (data_batch_1..5, test_batch), the
    folder itself or its parent holding ``cifar-10-batches-py``: uint8 pixels
    ``[N, 3, 32, 32]``, int64 labels. Never downloads."""
    return Dataset(*read_cifar10(folder, split))


_PART_RE = re.compile(r"^(.+):(?:(\d+)/(\d+)|(train|test))$")


def parse_source(src: str, default_part: str = "train") -> tuple[str, str | tuple[int, int]]:
    """``(base, part)``: part is ``"train"``, ``"test"`` or ``(k, n)`` (see the module
    docstring); ConfigError naming the source."""
    if not isinstance(src, str) or not src.strip():
        raise ConfigError(f"data source {src!r}: empty")
    src = src.strip()
    m = _PART_RE.match(src)
    if not m:
        return src, default_part
    if m.group(4):
        return m.group(1), m.group(4)
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def load_source(src: str, default_part: str = "train") -> Dataset:
    """The data a source names (see the module docstring): ``"fashion-mnist:3/10"``,
    ``"digits:test"``, ``"/data/mnist:1/4"``, ``"/data/cifar-10-batches-py"``, ...
    ``default_part`` is the part of a source that names none."""
    base, part = parse_source(src, default_part)
    try:
        if base in ("digits", "fashion-mnist", "mnist"):
            name, path = base, None
        elif base.endswith(".npz") and os.path.isfile(os.path.expanduser(base)):
            name, path = "npz", base
        elif os.path.isdir(os.path.expanduser(base)):
            folder = os.path.expanduser(base)
            if is_idx_folder(folder):
                name, path = "idx", folder
            elif is_cifar10_folder(folder):
                name, path = "cifar10", folder
            else:
                raise ConfigError("a folder without IDX files or CIFAR-10 batches")
        else:
            raise ConfigError(f"not one of {', '.join(('digits', 'fashion-mnist', 'mnist'))}, "
                              f"a folder or a .npz file (expected BASE[:K/N|:train|:test])")
        if isinstance(part, tuple):
            return shard(load_split(name, path, "train"), part[0], part[1], 0, base)
        return load_split(name, path, part)
    except ConfigError as exc:
        raise ConfigError(f"data source {src!r}: {exc}") from None
