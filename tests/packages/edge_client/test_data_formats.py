"""Real data sets from their files: IDX folders (Fashion-MNIST from Debian's package,
MNIST, a user's own), .npz files, the device sources, the validation split; every bad
file a ConfigError naming it."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edge_client.data as data_mod
from coordinator.emulation.datasets import load_dataset, validation_split
from edge_client.data import (
    float_images,
    load_source,
    load_split,
    quantize_images,
)
from edge_client.data_formats import read_idx
from edge_client.errors import ConfigError


def idx_bytes(a: np.ndarray) -> bytes:
    """``a`` (uint8) in IDX: magic 0, 0, 0x08, ndim; big-endian dims; the bytes."""
    return bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def write_idx_folder(folder: Path, n_train: int = 30, n_test: int = 10, side: int = 28, *,
                     gz: bool = True, classes: int = 10, prefix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """A small MNIST-layout folder of random images; returns (train images, train labels)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    out = None
    for stem, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
        y = (np.arange(n) % classes).astype(np.uint8)
        for kind, a, rank in (("images", x, 3), ("labels", y, 1)):
            name = f"{prefix}{stem}-{kind}-idx{rank}-ubyte" + (".gz" if gz else "")
            raw = idx_bytes(a)
            (folder / name).write_bytes(gzip.compress(raw) if gz else raw)
        if stem == "train":
            out = (x, y)
    assert out is not None
    return out


def test_quantizing_pixels_is_the_float_formula_bit_for_bit() -> None:
    """The integer table for uint8 pixels equals rint(float32(p / 255) * amax) for every
    pixel and every width: an integer device gets the same inputs from either storage."""
    p = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    f = float_images(p)
    assert f.dtype == np.float32 and f.min() == 0.0 and f.max() == 1.0
    np.testing.assert_array_equal(f, p.astype(np.float32) / np.float32(255.0))
    for bits in range(2, 17):
        q = quantize_images(p, bits)
        ref = quantize_images(f, bits)
        assert q.dtype == ref.dtype == (np.int8 if bits <= 8 else np.int16)
        np.testing.assert_array_equal(q, ref)


def test_an_idx_folder_reads_as_pixels_with_one_channel(tmp_path: Path) -> None:
    for gz, folder in ((True, tmp_path / "gz"), (False, tmp_path / "plain")):
        x, y = write_idx_folder(folder, gz=gz)
        train = load_split("idx", str(folder), "train")
        assert train.x.shape == (30, 1, 28, 28) and train.x.dtype == np.uint8
        np.testing.assert_array_equal(train.x[:, 0], x)
        np.testing.assert_array_equal(train.y, y.astype(np.int64))
        assert len(load_split("mnist", str(folder), "test")) == 10
    # EMNIST-style names (a prefix) and `test-` instead of `t10k-`
    write_idx_folder(tmp_path / "emnist", prefix="emnist-balanced-", classes=47, n_train=60)
    assert load_split("idx", str(tmp_path / "emnist")).num_classes == 47
    # a source: the folder, a shard of it, its test split
    src = str(tmp_path / "gz")
    assert len(load_source(src)) == 30 and len(load_source(src + ":test")) == 10
    shards = [load_source(f"{src}:{k}/3") for k in (1, 2, 3)]
    assert sorted(np.concatenate([s.y for s in shards]).tolist()) == sorted(y.tolist())


@pytest.mark.parametrize("damage, culprit", [
    (lambda f: (f / "train-labels-idx1-ubyte.gz").unlink(), "no train labels"),
    (lambda f: (f / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x01\x00\x08\x01")), "not an IDX file"),
    (lambda f: (f / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03\x00")),
     "header cut short"),
    (lambda f: (f / "train-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.zeros((30, 28, 28), np.uint8))[:-5])), "file holds"),
    (lambda f: (f / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all"), "cannot read"),
    (lambda f: (f / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.zeros(29, np.uint8)))), "30 train images but 29 labels"),
    (lambda f: (f / "old-train-images-idx3-ubyte").write_bytes(b""), "several train images"),
])
def test_a_broken_idx_folder_is_one_clear_error(tmp_path: Path, damage, culprit: str) -> None:
    folder = tmp_path / "mnist"
    write_idx_folder(folder)
    damage(folder)
    with pytest.raises(ConfigError, match=culprit) as e:
        load_dataset("mnist", str(folder))
    assert "data.path" in str(e.value) and str(folder) in str(e.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_arbitrary_bytes_are_an_idx_file_or_a_config_error(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(raw)
    try:
        a = read_idx(str(path))
    except ConfigError as exc:
        assert str(path) in str(exc)
    else:
        assert a.nbytes == len(raw) - 4 - 4 * raw[3]


def test_missing_data_names_the_package_or_the_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data_mod, "FASHION_MNIST_DIR", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist") as e:
        load_dataset("fashion-mnist")
    assert "data.dataset" in str(e.value) and "never downloads" in str(e.value)
    with pytest.raises(ConfigError, match="dataset-fashion-mnist"):
        load_source("fashion-mnist:1/4")
    for name in ("mnist", "idx", "npz", "cifar10"):
        with pytest.raises(ConfigError, match=f"{name}: needs a path"):
            load_dataset(name)
        with pytest.raises(ConfigError, match="data.path"):
            load_dataset(name, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="data.dataset"):
        load_dataset("imagenet")
    with pytest.raises(ConfigError, match="data source 'mnist:1/2'.*needs a path"):
        load_source("mnist:1/2")


def test_a_users_npz(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    xs = {"x_train": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
          "y_train": np.arange(12) % 3, "x_test": rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
          "y_test": np.arange(4) % 3}
    np.savez(tmp_path / "mine.npz", **xs)
    split = load_dataset("npz", str(tmp_path / "mine.npz"))
    assert split.train.x.shape == (12, 1, 28, 28) and split.train.x.dtype == np.uint8
    assert split.num_classes == 3 and len(split.test) == 4
    assert len(load_source(str(tmp_path / "mine.npz") + ":2/4")) == 3
    np.savez(tmp_path / "float.npz", **(xs | {"x_train": xs["x_train"] / 255.0, "x_test": xs["x_test"] / 255.0}))
    assert load_dataset("npz", str(tmp_path / "float.npz")).train.x.dtype == np.float32
    np.savez(tmp_path / "big.npz", **(xs | {"x_train": xs["x_train"] * 2.0}))
    with pytest.raises(ConfigError, match=r"outside \[0, 1\]"):
        load_dataset("npz", str(tmp_path / "big.npz"))
    np.savez(tmp_path / "short.npz", x_train=xs["x_train"], y_train=xs["y_train"])
    with pytest.raises(ConfigError, match="x_test"):
        load_dataset("npz", str(tmp_path / "short.npz"))
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(ConfigError, match="junk.npz"):
        load_dataset("npz", str(tmp_path / "junk.npz"))


def test_the_validation_split_is_stratified_disjoint_and_fixed() -> None:
    labels = np.repeat(np.arange(10), [100, 50, 30, 20, 10, 100, 100, 100, 100, 90])
    keep, held = validation_split(labels, 0.1, np.random.default_rng(0))
    assert len(np.intersect1d(keep, held)) == 0 and len(keep) + len(held) == len(labels)
    np.testing.assert_array_equal(np.bincount(labels[held]), [10, 5, 3, 2, 1, 10, 10, 10, 10, 9])
    again = validation_split(labels, 0.1, np.random.default_rng(0))[1]
    np.testing.assert_array_equal(held, again)
    d = load_dataset("digits", validation=0.2)
    assert d.validation is not None and len(d.validation) + len(d.train) == 1437
    with pytest.raises(ConfigError, match="data.validation"):
        load_dataset("digits", validation=1.0)


def test_fashion_mnist_from_debians_package_as_pixels(fashion_mnist: str) -> None:
    d = load_dataset("fashion-mnist", validation=0.1)
    assert d.train.x.shape == (54000, 1, 28, 28) and d.test.x.shape == (10000, 1, 28, 28)
    assert d.validation is not None and len(d.validation) == 6000
    assert d.train.x.dtype == np.uint8 and d.train.x.nbytes < 45e6  # not float64's 340 MB
    assert d.num_classes == 10
    np.testing.assert_array_equal(np.bincount(d.test.y), [1000] * 10)
    np.testing.assert_array_equal(np.bincount(d.validation.y), [600] * 10)
    dev = load_source("fashion-mnist:3/10")  # what `fedbit-edge run --data` trains on
    assert len(dev) == 6000 and dev.x.dtype == np.uint8
    assert len(load_source("fashion-mnist:test")) == 10000
