"""ProWD selective weight aggregation: the exact eq. 8 mask against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coordinator.strategies.swa as swa
from coordinator.strategies.swa import cosine, max_dropped, max_kept, swa_mask


def brute_force(a: np.ndarray, b: np.ndarray, tau: float) -> float:
    """Best cosine over every admissible mask (the module's rules: at most floor(τn)
    dropped, one nonzero Δlow element kept, all ones when nothing reaches cos > 0)."""
    a = a.ravel().astype(np.float64)
    b = b.ravel().astype(np.float64)
    nz = np.flatnonzero(a)
    k = min(max_dropped(a.size, tau), nz.size - 1)
    base = cosine(a, b)
    if k <= 0 or not b.any():
        return base
    best = base
    for r in range(1, k + 1):
        for drop in itertools.combinations(nz.tolist(), r):
            c = a.copy()
            c[list(drop)] = 0.0
            best = max(best, cosine(c, b))
    return best if best > 0 else base


# exact zeros and magnitudes in [1e-4, 10]: the walk is exact up to float rounding, which
# subnormal-scale inputs (|a|² ~ 1e-82 next to 1e-6) would swamp
finite = st.one_of(st.just(0.0), st.floats(1e-4, 10), st.floats(-10, -1e-4))


@st.composite
def layers(draw, max_n=14):
    n = draw(st.integers(1, max_n))
    a = np.array(draw(st.lists(finite, min_size=n, max_size=n)))
    b = np.array(draw(st.lists(finite, min_size=n, max_size=n)))
    scale = np.array(draw(st.lists(st.sampled_from([1e-3, 1.0, 30.0]), min_size=n, max_size=n)))
    return a * scale, b


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-start", "walk-only"])
@settings(max_examples=120, deadline=None)
@given(layer=layers(max_n=10), tau=st.sampled_from([0.1, 0.25, 0.5, 1.0]))
def test_mask_matches_brute_force(prefix, layer, tau):
    a, b = layer
    old = swa._PREFIX_MAX
    swa._PREFIX_MAX = old if prefix else 0
    try:
        r = swa_mask(a, b, tau)
    finally:
        swa._PREFIX_MAX = old
    assert (~r.keep).sum() <= max_dropped(a.size, tau)
    assert r.cos_after == pytest.approx(brute_force(a, b, tau), abs=1e-9)
    assert r.cos_after >= r.cos_before - 1e-12
    assert r.cos_after == pytest.approx(cosine(np.where(r.keep, a, 0.0), b), abs=1e-12)


def test_up_to_14_elements_seeded():
    rng = np.random.default_rng(7)
    for n in range(1, 15):
        for _ in range(4 if n < 12 else 1):
            a = rng.standard_normal(n) * rng.choice([1e-2, 1.0, 10.0], n)
            b = rng.standard_normal(n) + 0.5 * a
            for tau in (0.15, 0.3):
                r = swa_mask(a, b, tau)
                assert r.cos_after == pytest.approx(brute_force(a, b, tau), abs=1e-9), (n, tau)


def test_sorted_prefix_is_not_exact_when_budget_binds():
    # The old prefix rule (docs/algorithms.md §4) keeps (1,1),(10,-0.3) here (cos < 0);
    # dropping the big disagreeing element is optimal.
    a = np.array([1.0, 0.01, 10.0])
    b = np.array([1.0, -1.0, -0.3])
    r = swa_mask(a, b, 1 / 3)
    assert r.keep.tolist() == [True, True, False]
    assert r.cos_before < 0 < r.cos_after
    assert r.cos_after == pytest.approx(brute_force(a, b, 1 / 3))


def test_hand_computed_mask():
    # a = [1, 1, 1, -1], b = [1, 1, 1, 1]: dropping the -1 (budget 1 of 4) gives cos 3/sqrt(3)/2
    r = swa_mask(np.array([1.0, 1, 1, -1]), np.ones(4), 0.25)
    assert r.keep.tolist() == [True, True, True, False]
    assert r.cos_before == pytest.approx(0.5)
    assert r.cos_after == pytest.approx(np.sqrt(3) / 2)


def test_degenerate_layers_keep_everything():
    assert swa_mask(np.zeros(5), np.ones(5), 0.5).keep.all()          # Δlow = 0
    assert swa_mask(np.ones(5), np.zeros(5), 0.5).keep.all()          # Δhigh = 0
    assert swa_mask(np.array([1.0, -2.0]), np.ones(2), 0.0).keep.all()  # τ = 0
    r = swa_mask(np.array([1.0, 2.0, 3.0]), -np.ones(3), 0.34)        # never positive
    assert r.keep.all() and r.cos_after == r.cos_before


def test_shape_is_preserved_and_budget_respected_on_a_big_layer():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32, 5, 5)).astype(np.float32)
    b = (a + 2 * rng.standard_normal(a.shape)).astype(np.float32)
    r = swa_mask(a, b, 0.1)
    assert r.keep.shape == a.shape
    assert 0 < (~r.keep).sum() <= max_dropped(a.size, 0.1)
    assert r.cos_after > r.cos_before


def brute_force_keep(a: np.ndarray, b: np.ndarray, tau: float) -> float:
    """Best cosine over every mask with at most floor(τn) ones among the nonzero Δlow
    elements; 0 (nothing kept) when none reaches a positive cosine."""
    a = a.ravel().astype(np.float64)
    b = b.ravel().astype(np.float64)
    nz = np.flatnonzero(a)
    k = min(max_kept(a.size, tau), nz.size)
    best = 0.0
    if not b.any():
        return best
    for r in range(1, k + 1):
        for keep in itertools.combinations(nz.tolist(), r):
            c = np.zeros_like(a)
            c[list(keep)] = a[list(keep)]
            best = max(best, cosine(c, b))
    return best


@settings(max_examples=120, deadline=None)
@given(layer=layers(max_n=10), tau=st.sampled_from([0.1, 0.25, 0.5, 1.0]))
def test_keep_mode_matches_brute_force(layer, tau):
    """tau_mode = "keep" (eq. 8's |c| <= τ read as the fraction kept): the exact optimum
    over masks with at most floor(τn) ones."""
    a, b = layer
    r = swa_mask(a, b, tau, "keep")
    assert r.keep.sum() <= max_kept(a.size, tau)
    assert not (r.keep & (a == 0)).any()
    assert r.cos_after == pytest.approx(brute_force_keep(a, b, tau), abs=1e-9)
    assert r.cos_after == pytest.approx(cosine(np.where(r.keep, a, 0.0), b), abs=1e-12)


def test_keep_mode_on_a_big_layer_keeps_at_most_tau_and_aligns():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 16, 3, 3))
    b = a + 2 * rng.standard_normal(a.shape)
    drop, keep = swa_mask(a, b, 0.1, "drop"), swa_mask(a, b, 0.1, "keep")
    assert (~drop.keep).mean() <= 0.1 and keep.keep.mean() <= 0.1
    assert 0.05 < keep.keep.mean() and drop.cos_after > drop.cos_before
    # a tenth of the elements, chosen, align better than all of them
    assert keep.cos_after > keep.cos_before
    assert swa_mask(np.array([1.0, 2.0]), -np.ones(2), 0.5, "keep").keep.sum() == 0  # never positive
    with pytest.raises(ValueError, match="mode"):
        swa_mask(a, b, 0.1, "kept")
