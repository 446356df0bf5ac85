"""Data sets for emulated fleets and how they are split across devices.

Sources (``data.dataset``; nothing is downloaded, ever; ``edge_client.data`` reads them):

- ``digits``: scikit-learn's bundled 8x8 digits (1,437 train / 360 test, a fixed split);
- ``fashion-mnist``: Fashion-MNIST's IDX files (60,000 train / 10,000 test, 28x28), from
  Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) or
  ``data.path``;
- ``mnist``, ``idx``: a folder of IDX files (``data.path``; MNIST, EMNIST, a user's own);
- ``npz``: a user's ``.npz`` file with ``x_train``, ``y_train``, ``x_test``, ``y_test``;
- ``cifar10``: CIFAR-10 from a local folder in the standard python-batch layout
  (``data.path``), through torchvision's ``CIFAR10(download=False)`` when the ``vision``
  extra is installed, else the SDK's plain reader.

Images are held as the files store them (uint8 pixels: 60,000 28x28 images in 47 MB);
a missing file or folder is a ConfigError naming it and what provides it.

**Validation split** (``data.validation = f``): a fraction ``f`` of the training split,
stratified by class and drawn with ``data.seed`` (the same for every run seed), is taken
out before the devices' shards are cut; the coordinator scores every group's model on it
each round beside the test split. Choices (learning rates) are made on it; the test split
is only reported.

Partitioners return one ``int64`` index array per device into the training split (sorted,
so a device's shard is a reproducible subset). All draw from an explicit
``numpy.random.Generator``:

- ``iid``: a shuffled split into near-equal shares;
- ``shards``: FedAvg's non-IID split (sort by label, cut into ``n * k`` shards, give each
  device ``k``): ``k`` classes per device at most, usually exactly ``k``;
- ``dirichlet``: per class, proportions ``~ Dir(alpha)`` across devices (alpha 0.1 is
  very skewed, 100 nearly IID); every device gets at least one sample;
- ``parity``: FedShift's split (§5, Fig. 10): superior devices (float32 compute, lossless
  uplink) hold only even labels, inferior ones (integer or lossy) only odd labels, each
  device ``k`` shards within its group;
- ``sample``: ``per_device`` samples drawn independently for each device (overlapping
  when the fleet needs more than the data has: fleets of 10,000+ devices on digits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.data import DATASETS, Dataset, dataset_location, load_split
from edge_client.errors import ConfigError

PARTITIONS = ("iid", "shards", "dirichlet", "parity", "sample")
#: the data sets that have no bundled or packaged copy: ``data.path`` names theirs
NEEDS_PATH = ("mnist", "idx", "npz", "cifar10")
#: the seed of the validation split when ``data.seed`` is not given
VALIDATION_SEED = 0


@dataclass(frozen=True)
class DataSplit:
    """The train, validation (possibly empty) and test splits of a data set and its
    number of classes."""

    name: str
    train: Dataset
    test: Dataset
    num_classes: int
    validation: Dataset | None = None


def load_dataset(name: str, path: str | None = None, *, validation: float = 0.0,
                 seed: int = VALIDATION_SEED) -> DataSplit:
    """Data set ``name`` (:data:`DATASETS`; ``path``: its file or folder, where one is
    needed or to replace the packaged copy), with a fraction ``validation`` of the
    training split set aside (stratified, drawn with ``seed``). ConfigError naming the
    key (``data.dataset``, ``data.path``) and what provides a missing data set."""
    if name not in DATASETS:
        raise ConfigError(f"data.dataset: {name!r} is not one of {list(DATASETS)}")
    if not 0.0 <= validation < 1.0:
        raise ConfigError(f"data.validation: must be in [0, 1), got {validation}")
    try:
        location = dataset_location(name, path)
        if name == "cifar10":
            train, test = _cifar10(Path(location), "train"), _cifar10(Path(location), "test")
        else:
            train, test = load_split(name, path, "train"), load_split(name, path, "test")
    except ConfigError as exc:
        key = "data.path" if path or name in NEEDS_PATH else "data.dataset"
        raise ConfigError(f"{key}: {exc}") from None
    if train.x.shape[1:] != test.x.shape[1:]:
        raise ConfigError(f"data.path: {name}: train images {list(train.x.shape[1:])} but test "
                          f"images {list(test.x.shape[1:])}")
    num_classes = max(train.num_classes, test.num_classes)
    val = None
    if validation > 0:
        keep, held = validation_split(train.y, validation, np.random.default_rng(seed))
        if not len(held) or not len(keep):
            raise ConfigError(f"data.validation: {validation} of {len(train)} training samples "
                              f"leaves an empty split")
        train, val = train.subset(keep), train.subset(held)
    return DataSplit(name, train, test, num_classes, val)


def validation_split(labels: np.ndarray, fraction: float, rng: np.random.Generator
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held-out) sorted index arrays: per class, ``round(fraction x count)`` of its
    samples held out at random."""
    labels = np.asarray(labels)
    held = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        held.append(rng.choice(idx, int(round(fraction * len(idx))), replace=False))
    out = np.sort(np.concatenate(held)) if held else np.empty(0, np.int64)
    mask = np.ones(len(labels), bool)
    mask[out] = False
    return np.flatnonzero(mask), out


def _cifar10(folder: Path, split: str) -> Dataset:
    """torchvision's reader when it is installed (the ``vision`` extra), else the SDK's."""
    from edge_client.data import load_cifar10

    try:
        from torchvision.datasets import CIFAR10  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed, or broken beside this torch
        return load_cifar10(str(folder), split)
    root = folder.parent if folder.name == "cifar-10-batches-py" else folder
    try:
        ds = CIFAR10(str(root), train=split == "train", download=False)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise ConfigError(f"{str(folder)!r}: {exc}") from None
    x = np.asarray(ds.data, dtype=np.uint8).transpose(0, 3, 1, 2)
    return Dataset(np.ascontiguousarray(x), np.asarray(ds.targets, dtype=np.int64))


# --------------------------------------------------------------------------- partitioners


def partition(kind: str, labels: np.ndarray, n_devices: int, rng: np.random.Generator, *,
              k: int = 2, alpha: float = 0.5, inferior: Sequence[bool] | None = None,
              per_device: int = 32) -> list[np.ndarray]:
    """One sorted index array per device (see the module docstring for ``kind``).

    ``k``: shards per device (``shards``, ``parity``); ``alpha``: the Dirichlet
    concentration; ``inferior``: per device, whether it is in FedShift's inferior group
    (``parity``); ``per_device``: samples per device (``sample``).
    """
    labels = np.asarray(labels)
    n = len(labels)
    if n_devices < 1:
        raise ConfigError(f"partition: need at least one device, got {n_devices}")
    if kind == "sample":
        if per_device < 1:
            raise ConfigError(f"data.per_device: must be >= 1, got {per_device}")
        return [np.sort(rng.choice(n, size=min(per_device, n), replace=False)) for _ in range(n_devices)]
    if kind != "sample" and n_devices > n:
        raise ConfigError(f"partition {kind!r}: {n_devices} devices but only {n} training samples "
                          f"(use partition = \"sample\" for fleets larger than the data)")
    if kind == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(n), n_devices)]
    if kind == "shards":
        return _shards(np.arange(n), labels, n_devices, k, rng)
    if kind == "dirichlet":
        return _dirichlet(labels, n_devices, alpha, rng)
    if kind == "parity":
        if inferior is None or len(inferior) != n_devices:
            raise ConfigError("partition 'parity': needs each device's inferior flag")
        inf = np.asarray(inferior, dtype=bool)
        out: list[np.ndarray] = [np.empty(0, np.int64)] * n_devices
        for group, parity in ((np.flatnonzero(~inf), 0), (np.flatnonzero(inf), 1)):
            if not len(group):
                continue
            pool = np.flatnonzero(labels % 2 == parity)
            for dev, idx in zip(group, _shards(pool, labels[pool], len(group), k, rng), strict=True):
                out[dev] = idx
        return out
    raise ConfigError(f"data.partition: {kind!r} is not one of {list(PARTITIONS)}")


def _shards(pool: np.ndarray, labels: np.ndarray, n_devices: int, k: int,
            rng: np.random.Generator) -> list[np.ndarray]:
    """FedAvg's split of the indices ``pool`` (labels ``labels``): sorted by label, cut
    into ``n_devices * k`` shards, ``k`` random shards per device."""
    if k < 1:
        raise ConfigError(f"data.shards_per_device: must be >= 1, got {k}")
    if n_devices * k > len(pool):
        raise ConfigError(f"partition: {n_devices} devices x {k} shards exceed {len(pool)} samples")
    order = pool[np.argsort(labels, kind="stable")]
    shards = np.array_split(order, n_devices * k)
    pick = rng.permutation(n_devices * k)
    return [np.sort(np.concatenate([shards[s] for s in pick[d * k:(d + 1) * k]])) for d in range(n_devices)]


def _dirichlet(labels: np.ndarray, n_devices: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    if not alpha > 0:
        raise ConfigError(f"data.alpha: must be > 0, got {alpha}")
    parts: list[list[int]] = [[] for _ in range(n_devices)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        p = rng.dirichlet(np.full(n_devices, float(alpha)))
        cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
        for d, chunk in enumerate(np.split(idx, cuts)):
            parts[d].extend(chunk.tolist())
    # every device gets at least one sample: move one from the largest share
    for d in range(n_devices):
        if not parts[d]:
            big = max(range(n_devices), key=lambda j: len(parts[j]))
            parts[d].append(parts[big].pop(int(rng.integers(len(parts[big])))))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def class_counts(shards: Sequence[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``int64 [devices, classes]``: samples of each class on each device."""
    out = np.zeros((len(shards), num_classes), np.int64)
    for d, idx in enumerate(shards):
        out[d] = np.bincount(labels[idx], minlength=num_classes)[:num_classes]
    return out
