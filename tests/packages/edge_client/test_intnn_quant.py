"""Shared float domain <-> device integers, initialisation (paper eq. 10-11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.compat import zip_strict
from edge_client.errors import ConfigError, TrainingError
from edge_client.intnn import (
    alpha_shifts,
    from_shared,
    grid_scale,
    init_shared,
    storage_grid_bits,
    to_shared,
    weight_max,
)
from firmware_models import get_spec


def test_storage_grid_bits_and_dtypes():
    assert [storage_grid_bits(b) for b in (2, 4, 6, 8, 12, 16)] == [8, 8, 8, 8, 12, 16]
    w = [np.array([[0.5, -0.5, 0.25, 0.0]], np.float32)]
    assert from_shared(w, 6)[0].dtype == np.int8
    assert from_shared(w, 8)[0].dtype == np.int8
    assert from_shared(w, 12)[0].dtype == np.int16
    assert from_shared(w, 16)[0].dtype == np.int16
    assert from_shared(w, 8)[0].tolist() == [[64, -64, 32, 0]]
    assert from_shared(w, 16)[0].tolist() == [[16384, -16384, 8192, 0]]
    for bad in (1, 17, 32, 8.0, True):
        with pytest.raises(ConfigError):
            storage_grid_bits(bad)


def test_from_shared_rounds_and_clips():
    w = [np.array([0.7, -3.0, 1 / 256, 3 / 256, -1 / 256], np.float32)]
    q = from_shared(w, 8)[0]
    assert q.tolist() == [64, -64, 0, 2, 0]  # clip to 0.5; round half to even
    with pytest.raises(TrainingError):
        from_shared([np.array([np.nan], np.float32)], 8)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 6, 8, 12, 16]), seed=st.integers(0, 2**31))
def test_round_trip_is_exact_on_the_grid(bits, seed):
    rng = np.random.default_rng(seed)
    wmax = weight_max(bits)
    q = [rng.integers(-wmax, wmax + 1, size=s).astype(np.int16) for s in [(3, 4), (7,)]]
    w = to_shared(q, bits)
    assert all(x.dtype == np.float32 for x in w)
    assert all(np.all(np.abs(x) <= 0.5) for x in w)
    # exact: the float is q / 2^(s_g - 1)
    for a, b in zip_strict(w, q):
        assert np.array_equal(a.astype(np.float64) * grid_scale(bits), b)
    back = from_shared(w, bits)
    assert all(np.array_equal(a, b) for a, b in zip_strict(back, q))


def test_alpha_shifts_follow_eq_11():
    # digits_cnn fan-ins 9, 144, 128, 64; fedshift_cnn 75, 800, 4096, 512
    assert alpha_shifts(get_spec("digits_cnn")) == [0, 2, 2, 2]
    assert alpha_shifts(get_spec("fedshift_cnn")) == [2, 4, 5, 3]
    for f in (1, 3, 9, 27, 100, 1000, 10000):
        expect = round(math.log2(0.75 / math.sqrt(3 / f)))
        assert alpha_shifts.__globals__["alpha_log2"](f) == max(0, expect)


def test_init_shared_distribution():
    import dataclasses

    spec = dataclasses.replace(get_spec("fedshift_cnn"), init="wage")  # (its own: the paper's He init)
    w = init_shared(spec, seed=3)
    assert [x.shape for x in w] == spec.param_shapes()
    assert all(x.dtype == np.float32 for x in w)
    big = w[2]  # fc1, fan-in 4096: L = 0.75, so about 1/3 of the weights clip at +-0.5
    assert np.abs(big).max() == np.float32(0.5)
    assert 0.30 < np.mean(np.abs(big) == 0.5) < 0.37
    inner = big[np.abs(big) < 0.5]
    assert abs(inner.mean()) < 0.01 and abs(inner.std() - 1 / math.sqrt(3) * 0.5) < 0.01
    again = init_shared(spec, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip_strict(w, again))
    other = init_shared(spec, seed=4)
    assert not np.array_equal(w[0], other[0])
