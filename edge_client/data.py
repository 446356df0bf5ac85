"""Local data sets of a device: scikit-learn's bundled digits and a CIFAR-10 folder.

A :class:`Dataset` holds float32 images ``x [N, C, H, W]`` in ``[0, 1]`` and int64
labels ``y [N]``. Integer devices turn the images into their s-bit activation integers
once, with :func:`quantize_images` (the only float arithmetic of the integer path is
here, in data loading). Nothing here imports torch; scikit-learn is imported lazily by
the digits loader only.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass

import numpy as np

from edge_client.errors import ConfigError

DIGITS_TEST_SIZE = 360  # of 1797 images; the split is fixed (seed DIGITS_SPLIT_SEED)
DIGITS_SPLIT_SEED = 20240611


@dataclass(frozen=True)
class Dataset:
    """Images ``x`` float32 ``[N, C, H, W]`` in [0, 1] and labels ``y`` int64 ``[N]``."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.ndim < 2 or self.y.ndim != 1 or len(self.x) != len(self.y):
            raise ConfigError(
                f"Dataset: x {list(self.x.shape)} and y {list(self.y.shape)} do not match")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: np.ndarray) -> Dataset:
        """The samples at the integer indices ``idx`` (copies)."""
        return Dataset(self.x[idx], self.y[idx])


def quantize_images(x: np.ndarray, bits: int) -> np.ndarray:
    """Images in [0, 1] -> s-bit activation integers ``round(x * (2^(s-1) - 1))``.

    Same shape as ``x``; int8 for s <= 8, int16 up to 16 bits.
    """
    if not 2 <= bits <= 16:
        raise ConfigError(f"quantize_images: bits must be in 2..16, got {bits}")
    amax = (1 << (bits - 1)) - 1
    q = np.rint(np.clip(x, 0.0, 1.0) * np.float32(amax))
    return q.astype(np.int8 if bits <= 8 else np.int16)


def _digits_file() -> str:
    """The digits CSV that scikit-learn bundles (found without importing scikit-learn,
    whose import alone costs a device ~80 MB of RSS)."""
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


def digits_shard(k: int, n: int, seed: int = 0) -> Dataset:
    """Shard ``k`` (1..n) of ``n`` IID shards of the digits train split (seeded shuffle)."""
    if n < 1 or not 1 <= k <= n:
        raise ConfigError(f"digits shard {k}/{n}: need 1 <= k <= n")
    train = load_digits("train")
    if n > len(train):
        raise ConfigError(f"digits shard {k}/{n}: only {len(train)} training images")
    perm = np.random.default_rng(seed).permutation(len(train))
    return train.subset(np.sort(np.array_split(perm, n)[k - 1]))


def _unpickle(path: str) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="bytes")


def load_cifar10(folder: str, split: str = "train") -> Dataset:
    """CIFAR-10 in the standard python-pickle layout (data_batch_1..5, test_batch).

    Accepts the folder itself or its parent holding ``cifar-10-batches-py``.
    x: float32 ``[N, 3, 32, 32]`` in [0, 1]; y: int64 ``[N]``. Never downloads.
    """
    if split not in ("train", "test"):
        raise ConfigError(f"cifar10 split must be 'train' or 'test', got {split!r}")
    root = folder
    nested = os.path.join(folder, "cifar-10-batches-py")
    if os.path.isdir(nested):
        root = nested
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    xs, ys = [], []
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{folder}: CIFAR-10 file {name} not found")
        try:
            batch = _unpickle(path)
            data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = np.asarray(batch[b"labels"], dtype=np.int64)
        except (KeyError, ValueError, pickle.UnpicklingError, EOFError) as exc:
            raise ConfigError(f"{path}: not a CIFAR-10 python batch ({exc})") from exc
        if len(labels) != len(data):
            raise ConfigError(f"{path}: {len(data)} images but {len(labels)} labels")
        xs.append(data)
        ys.append(labels)
    x = np.concatenate(xs).astype(np.float32) / np.float32(255.0)
    return Dataset(x, np.concatenate(ys))


_DIGITS_RE = re.compile(r"^digits:(\d+)/(\d+)$")


def load_source(src: str) -> Dataset:
    """``"digits:K/N"`` (shard K of N of the digits train split) or a CIFAR-10 folder."""
    m = _DIGITS_RE.match(src.strip()) if isinstance(src, str) else None
    if m:
        k, n = int(m.group(1)), int(m.group(2))
        try:
            return digits_shard(k, n)
        except ConfigError as exc:
            raise ConfigError(f"data source {src!r}: {exc}") from exc
    if isinstance(src, str) and src.startswith("digits"):
        raise ConfigError(f"data source {src!r}: expected 'digits:K/N' with 1 <= K <= N")
    if not isinstance(src, str) or not os.path.isdir(src):
        raise ConfigError(f"data source {src!r}: not 'digits:K/N' and not a folder")
    try:
        return load_cifar10(src, "train")
    except ConfigError as exc:
        raise ConfigError(f"data source {src!r}: {exc}") from exc
