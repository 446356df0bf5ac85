"""Data sets and partitioners of the emulator: class counts, disjointness, coverage."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from coordinator.emulation.datasets import class_counts, load_dataset, partition
from edge_client.errors import ConfigError

LABELS = load_dataset("digits").train.y


def _check_disjoint_cover(shards: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(shards)
    assert len(allidx) == len(np.unique(allidx)) == n  # every sample once


def test_iid_is_balanced_and_covers_every_sample() -> None:
    shards = partition("iid", LABELS, 10, np.random.default_rng(0))
    _check_disjoint_cover(shards, len(LABELS))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    counts = class_counts(shards, LABELS, 10)
    assert (counts > 0).sum(axis=1).min() >= 8  # nearly every class everywhere


def test_shards_give_each_device_at_most_k_classes() -> None:
    shards = partition("shards", LABELS, 20, np.random.default_rng(1), k=2)
    _check_disjoint_cover(shards, len(LABELS))
    present = (class_counts(shards, LABELS, 10) > 0).sum(axis=1)
    # a shard can straddle a class boundary: at most 2 classes per shard
    assert present.max() <= 4 and np.median(present) <= 3


def test_dirichlet_skew_follows_alpha() -> None:
    def skew(alpha: float) -> float:
        shards = partition("dirichlet", LABELS, 20, np.random.default_rng(2), alpha=alpha)
        _check_disjoint_cover(shards, len(LABELS))
        assert min(map(len, shards)) >= 1
        c = class_counts(shards, LABELS, 10).astype(float)
        return float(np.mean(c.max(axis=1) / c.sum(axis=1)))  # share of the top class

    assert skew(0.1) > skew(1.0) > skew(100.0) + 0.1


def test_parity_gives_superior_devices_even_and_inferior_odd_labels() -> None:
    inferior = [i % 2 == 1 for i in range(10)]
    shards = partition("parity", LABELS, 10, np.random.default_rng(3), k=2, inferior=inferior)
    _check_disjoint_cover(shards, len(LABELS))
    for idx, inf in zip(shards, inferior, strict=True):
        assert len(idx) and set(np.unique(LABELS[idx] % 2)) == {1 if inf else 0}
    with pytest.raises(ConfigError, match="inferior"):
        partition("parity", LABELS, 10, np.random.default_rng(3))


def test_sample_serves_fleets_larger_than_the_data() -> None:
    shards = partition("sample", LABELS, 5000, np.random.default_rng(4), per_device=16)
    assert len(shards) == 5000 and all(len(s) == 16 and len(np.unique(s)) == 16 for s in shards)
    with pytest.raises(ConfigError, match="sample"):
        partition("iid", LABELS, 5000, np.random.default_rng(4))


def test_partitions_are_reproducible_from_the_seed() -> None:
    a = partition("dirichlet", LABELS, 8, np.random.default_rng(7), alpha=0.3)
    b = partition("dirichlet", LABELS, 8, np.random.default_rng(7), alpha=0.3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_bad_partition_arguments_name_the_key() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="partition"):
        partition("random", LABELS, 4, rng)
    with pytest.raises(ConfigError, match="alpha"):
        partition("dirichlet", LABELS, 4, rng, alpha=0.0)
    with pytest.raises(ConfigError, match="shards_per_device"):
        partition("shards", LABELS, 4, rng, k=0)


def test_cifar10_from_a_local_folder_or_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="never downloads"):
        load_dataset("cifar10", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="data.path"):
        load_dataset("cifar10", "")
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 4) for i in range(1, 6)), ("test_batch", 3)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": list(rng.integers(0, 10, n))}
        (root / name).write_bytes(pickle.dumps(batch))
    split = load_dataset("cifar10", str(tmp_path))
    assert split.train.x.shape == (20, 3, 32, 32) and split.test.x.shape == (3, 3, 32, 32)
    assert split.train.x.dtype == np.uint8 and split.test.x.dtype == np.uint8


def test_the_parity_groups_can_be_named_whatever_the_uplinks(tmp_path: Path) -> None:
    """FedShift's 32+32 control: the inferior group sends float32 yet keeps the odd labels."""
    from coordinator.emulation.config import from_dict
    from coordinator.emulation.fleet_plan import build_fleet

    raw = {"devices": {"desktop": 3, "jetson-orin-nano": 3}, "codecs": {"jetson-orin-nano": "float32"},
           "data": {"partition": "parity", "inferior": ["jetson-orin-nano"]}}
    split = load_dataset("digits")
    fleet = build_fleet(from_dict(raw), 0, split, tmp_path, "j")
    for dev in fleet:
        labels = set(split.train.y[dev.shard] % 2)
        assert labels == ({1} if dev.profile.name == "jetson-orin-nano" else {0}) and dev.config.codec == "float32"
    del raw["data"]["inferior"]  # by the uplinks: every device is superior, every label even
    assert all(set(split.train.y[d.shard] % 2) == {0} for d in build_fleet(from_dict(raw), 0, split, tmp_path, "j"))
