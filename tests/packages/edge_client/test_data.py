"""Data loaders: bundled digits (fixed split, shards), CIFAR-10 folder, sources."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from edge_client.compat import zip_strict
from edge_client.data import (
    Dataset,
    digits_shard,
    float_images,
    load_cifar10,
    load_digits,
    load_source,
    quantize_images,
)
from edge_client.errors import ConfigError


def test_digits_split_is_fixed_and_disjoint():
    tr, te = load_digits("train"), load_digits("test")
    assert len(tr) == 1437 and len(te) == 360
    assert tr.x.shape == (1437, 1, 8, 8) and tr.x.dtype == np.float32
    assert tr.y.dtype == np.int64 and set(np.unique(tr.y)) == set(range(10))
    assert tr.x.min() >= 0.0 and tr.x.max() <= 1.0 and tr.x.max() == 1.0
    rows_tr = {r.tobytes() + bytes([int(c)]) for r, c in zip_strict(tr.x, tr.y)}
    rows_te = {r.tobytes() + bytes([int(c)]) for r, c in zip_strict(te.x, te.y)}
    assert len(rows_tr & rows_te) <= 5  # only genuine duplicate images of the data set
    again = load_digits("test")
    assert np.array_equal(again.x, te.x) and np.array_equal(again.y, te.y)
    with pytest.raises(ConfigError):
        load_digits("val")


def test_digits_shards_partition_the_train_split():
    n = 4
    shards = [digits_shard(k, n, seed=1) for k in range(1, n + 1)]
    assert sum(len(s) for s in shards) == 1437
    assert {len(s) for s in shards} <= {359, 360}
    allx = np.concatenate([s.x for s in shards])
    assert len({r.tobytes() for r in allx}) == len({r.tobytes() for r in load_digits().x})
    assert not np.array_equal(digits_shard(1, 4, seed=1).y, digits_shard(1, 4, seed=2).y)
    for bad in ((0, 4), (5, 4), (1, 0), (1, 5000)):
        with pytest.raises(ConfigError):
            digits_shard(*bad)


def test_quantize_images():
    x = np.array([0.0, 0.5, 1.0, 1 / 127, 1.5, -1.0], np.float32)
    q8 = quantize_images(x, 8)
    assert q8.dtype == np.int8 and q8.tolist() == [0, 64, 127, 1, 127, 0]
    q16 = quantize_images(x, 16)
    assert q16.dtype == np.int16 and q16[2] == 32767
    assert quantize_images(x, 6).tolist() == [0, 16, 31, 0, 31, 0]
    with pytest.raises(ConfigError):
        quantize_images(x, 17)


def _write_cifar(folder, n_per_batch=4):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n_per_batch).tolist()
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": data, b"labels": labels}, fh)


def test_cifar10_folder(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    _write_cifar(root)
    for folder in (root, tmp_path):
        tr = load_cifar10(str(folder), "train")
        assert tr.x.shape == (20, 3, 32, 32) and tr.x.dtype == np.uint8  # pixels, as stored
        assert tr.y.dtype == np.int64
    te = load_cifar10(str(root), "test")
    assert len(te) == 4
    with open(root / "test_batch", "rb") as fh:
        raw = pickle.load(fh)
    assert np.array_equal(te.x[0].ravel(), raw[b"data"][0])
    assert np.allclose(float_images(te.x)[0].ravel(), raw[b"data"][0] / 255.0)
    src = load_source(str(root))
    assert len(src) == 20
    (root / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match="data_batch_3"):
        load_cifar10(str(root))
    (root / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError):
        load_cifar10(str(root), "test")


def test_load_source():
    d = load_source("digits:2/5")
    assert isinstance(d, Dataset) and len(d) in (287, 288)
    assert np.array_equal(d.y, digits_shard(2, 5).y)
    assert len(load_source("digits")) == 1437 and len(load_source("digits:test")) == 360
    for bad in ("digits:0/5", "digits:6/5", "digits:x/5", "digit", "/nonexistent/folder", ""):
        with pytest.raises(ConfigError, match="data source"):
            load_source(bad)


def test_dataset_checks_shapes():
    with pytest.raises(ConfigError):
        Dataset(np.zeros((3, 1, 8, 8), np.float32), np.zeros(2, np.int64))


def test_digits_are_scikit_learns_without_importing_it():
    """The bundled CSV is read directly (a device saves the ~80 MB scikit-learn import);
    the images and labels are exactly ``sklearn.datasets.load_digits()``'s."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_load_digits

    from edge_client.data import _digits_all

    ref = sk_load_digits()
    mine = _digits_all()
    np.testing.assert_array_equal(mine.x[:, 0], ref.images.astype(np.float32) / np.float32(16.0))
    np.testing.assert_array_equal(mine.y, ref.target)
    code = ("import sys; from edge_client.data import load_digits; load_digits('train'); "
            "sys.exit(1 if 'sklearn' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
