"""Image data sets in their files: IDX (MNIST, Fashion-MNIST, EMNIST), ``.npz``, CIFAR-10.

Every reader returns ``(x, y)`` (``edge_client.data`` wraps them into a ``Dataset``): images
``[N, C, H, W]`` as **uint8 pixels** (value / 255 the intensity) when the file holds bytes,
so that 70,000 28x28 images take 55 MB and not float32's 220 MB; float images as float32
in [0, 1]; labels int64 ``[N]``. Nothing here downloads anything or imports torch; every
error is a :class:`ConfigError` naming the file.

- **IDX** (plain or ``.gz``): a folder with ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``
  (``test-`` for ``t10k-``, ``.`` for the last ``-`` and a prefix such as ``emnist-balanced-``
  accepted); images ``[N, H, W]`` get one channel.
- **npz**: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (Keras's ``mnist.npz`` layout);
  images ``[N, H, W]`` or ``[N, C, H, W]``, uint8 pixels or floats in [0, 1].
- **CIFAR-10**: the python-pickle batches (``data_batch_1..5``, ``test_batch``).
"""

from __future__ import annotations

import gzip
import os
import pickle
import re
import zipfile

import numpy as np

from edge_client.errors import ConfigError

SPLITS = ("train", "test")

#: IDX element types (the third byte of the magic number) -> numpy dtype (big-endian)
_IDX_TYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
              0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_NAME = re.compile(r"(?:^|[-_.])(train|t10k|test)-(images|labels)[-.]idx([13])-ubyte(\.gz)?$")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split must be 'train' or 'test', got {split!r}")


# ----------------------------------------------------------------------------- IDX


def read_idx(path: str) -> np.ndarray:
    """The array in one IDX file (``.gz`` read through gzip): its shape and element type
    as the header says; ConfigError naming the file when the header and the size disagree."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:  # missing, unreadable, a broken .gz
        raise ConfigError(f"{path}: cannot read the IDX file ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or raw[3] < 1:
        raise ConfigError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'none'})")
    ndim = raw[3]
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise ConfigError(f"{path}: IDX header cut short")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    dtype = _IDX_TYPES[raw[2]]
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - head != want:
        raise ConfigError(f"{path}: the header says {list(shape)} {dtype.name} ({want:,} bytes) "
                          f"but the file holds {len(raw) - head:,}")
    return np.frombuffer(raw, dtype, offset=head).reshape(shape)


def find_idx_files(folder: str, split: str) -> tuple[str, str]:
    """(images file, labels file) of ``split`` in ``folder``; ConfigError naming the folder
    when either is missing or several match."""
    _check_split(split)
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot list the IDX folder ({exc})") from None
    found: dict[str, list[str]] = {"images": [], "labels": []}
    for name in names:
        m = _IDX_NAME.search(name)
        if m and (m.group(1) == "train") == (split == "train"):
            kind, rank = m.group(2), m.group(3)
            if (kind == "images") == (rank == "3"):
                found[kind].append(name)
    out = []
    for kind in ("images", "labels"):
        hits = found[kind]
        stem = "train" if split == "train" else "t10k"
        rank = 3 if kind == "images" else 1
        if not hits:
            raise ConfigError(f"{folder}: no {split} {kind} (expected {stem}-{kind}-idx{rank}-ubyte[.gz])")
        if len(hits) > 1:
            raise ConfigError(f"{folder}: several {split} {kind} files {hits}: keep one set per folder")
        out.append(os.path.join(folder, hits[0]))
    return out[0], out[1]


def read_idx_folder(folder: str, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """A split of an IDX folder (MNIST, Fashion-MNIST, EMNIST layout; see the module
    docstring): uint8 pixels ``[N, 1, H, W]`` (or ``[N, C, H, W]`` for a 4-D file),
    int64 labels."""
    images, labels = find_idx_files(folder, split)
    x = read_idx(images)
    y = read_idx(labels)
    if x.dtype != np.uint8 or x.ndim not in (3, 4):
        raise ConfigError(f"{images}: expected uint8 images [N, H, W], got {x.dtype.name} {list(x.shape)}")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ConfigError(f"{labels}: expected integer labels [N], got {y.dtype.name} {list(y.shape)}")
    if len(y) != len(x):
        raise ConfigError(f"{folder}: {len(x)} {split} images but {len(y)} labels")
    if x.ndim == 3:
        x = x[:, None]
    return np.ascontiguousarray(x), y.astype(np.int64)


def is_idx_folder(folder: str) -> bool:
    """Whether ``folder`` holds IDX training files."""
    try:
        return any(_IDX_NAME.search(n) for n in os.listdir(folder))
    except OSError:
        return False


# ----------------------------------------------------------------------------- npz


def read_npz(path: str, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """A split of an ``.npz`` file with ``x_train``, ``y_train``, ``x_test``, ``y_test``
    (see the module docstring). Pickled objects are refused."""
    _check_split(split)
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            kx, ky = f"x_{split}", f"y_{split}"
            if kx not in keys or ky not in keys:
                raise ConfigError(f"{path}: needs arrays {kx!r} and {ky!r} (has {sorted(keys)})")
            x, y = z[kx], z[ky]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read the .npz file ({exc})") from None
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or len(x) != len(y) or y.ndim != 1:
        raise ConfigError(f"{path}: {kx} {list(x.shape)} and {ky} {list(y.shape)}: expected images "
                          f"[N, H, W] or [N, C, H, W] and N labels")
    if y.dtype.kind not in "iu" or (len(y) and int(y.min()) < 0):
        raise ConfigError(f"{path}: {ky} must hold integer labels >= 0, got {y.dtype.name}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x), y.astype(np.int64)
    if x.dtype.kind != "f":
        raise ConfigError(f"{path}: {kx} must be uint8 pixels or floats in [0, 1], got {x.dtype.name}")
    if not np.all(np.isfinite(x)) or (x.size and (float(x.min()) < 0.0 or float(x.max()) > 1.0)):
        raise ConfigError(f"{path}: {kx} holds values outside [0, 1] (or NaN): floats must be "
                          f"intensities in [0, 1]; store pixels as uint8")
    return np.ascontiguousarray(x, dtype=np.float32), y.astype(np.int64)


# ----------------------------------------------------------------------------- CIFAR-10


def _unpickle(path: str) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="bytes")


def cifar10_root(folder: str) -> str:
    """The folder holding the batches: ``folder`` or its ``cifar-10-batches-py``."""
    nested = os.path.join(folder, "cifar-10-batches-py")
    return nested if os.path.isdir(nested) else folder


def is_cifar10_folder(folder: str) -> bool:
    """Whether ``folder`` (or its ``cifar-10-batches-py``) holds CIFAR-10 batches."""
    return os.path.isfile(os.path.join(cifar10_root(folder), "test_batch")) or \
        os.path.isfile(os.path.join(cifar10_root(folder), "data_batch_1"))


def read_cifar10(folder: str, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 in the standard python-pickle layout (data_batch_1..5, test_batch).

    Accepts the folder itself or its parent holding ``cifar-10-batches-py``.
    x: uint8 pixels ``[N, 3, 32, 32]``; y: int64 ``[N]``. Never downloads.
    """
    _check_split(split)
    root = cifar10_root(folder)
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
        except (KeyError, ValueError, TypeError, pickle.UnpicklingError, EOFError) as exc:
            raise ConfigError(f"{path}: not a CIFAR-10 python batch ({exc})") from exc
        if len(labels) != len(data):
            raise ConfigError(f"{path}: {len(data)} images but {len(labels)} labels")
        xs.append(data)
        ys.append(labels)
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)
