"""Differential privacy's math (coordinator.privacy.dp, accountant; edge_client.secagg.encode):
the noise's empirical variance matches theory, the accountant's ε matches dp-accounting and
a published reference value, the distributed grid keeps the sum inside ℤ/2^32, adaptive
clipping moves to the quantile."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from coordinator.privacy import dp
from coordinator.privacy.accountant import Accountant, noise_for_epsilon, rdp_epsilon
from edge_client.secagg.encode import (
    Grid,
    discrete_gaussian,
    grid_values,
    rounding_bound,
    secure_vector,
)


def _var_ci(x: np.ndarray, alpha: float = 1e-4) -> tuple[float, float]:
    """A (1 - alpha) confidence interval of the variance of a normal-ish sample."""
    n, s2 = x.size, float(np.var(x, ddof=1))
    return (n - 1) * s2 / stats.chi2.ppf(1 - alpha / 2, n - 1), (n - 1) * s2 / stats.chi2.ppf(alpha / 2, n - 1)


@pytest.mark.parametrize("std", [0.8, 3.0, 25.0])
def test_discrete_gaussian_variance_matches_theory(std: float) -> None:
    rng = np.random.default_rng(1)
    x = discrete_gaussian(std, 200_000, rng)
    assert x.dtype == np.int64 and abs(x.mean()) < 5 * std / math.sqrt(x.size)
    # the discrete Gaussian's variance: Σ k² e^{-k²/2σ²} / Σ e^{-k²/2σ²} (≈ σ² once σ >= 1)
    k = np.arange(-int(40 * std) - 5, int(40 * std) + 6, dtype=np.float64)
    p = np.exp(-k * k / (2 * std * std))
    theory = float((k * k * p).sum() / p.sum())
    lo, hi = _var_ci(x.astype(np.float64))
    assert lo <= theory <= hi
    # and its pmf (a chi-square goodness of fit over the central values)
    support = np.arange(-int(2 * std) - 1, int(2 * std) + 2)
    observed = np.array([(x == v).sum() for v in support])
    expected = np.exp(-support.astype(float) ** 2 / (2 * std * std)) / p.sum() * x.size
    assert stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-4


def test_distributed_noise_of_the_sum_matches_its_target() -> None:
    """n devices each add N_Z(0, σ_dev²): the sum's noise has variance n σ_dev² = (z Δ₂)²
    for the n_min devices the grid was sized for."""
    g = dp.distributed_grid(clip=1.0, dim=64, n_devices=20, n_min=16, z=1.2)
    rng = np.random.default_rng(2)
    grid = Grid(params=64, frac_bits=g.frac_bits, weighted=False, l2_clip=1.0, noise_std=g.device_std)
    zero = [np.zeros(64)]
    total = sum(secure_vector(zero, grid, 1, rng).astype(np.int64) - 0 for _ in range(16))
    noise = ((total[:64] + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.float64)  # centred
    sums = np.concatenate([noise] + [sum(discrete_gaussian(g.device_std, 64, rng) for _ in range(16))
                                     for _ in range(300)]).astype(np.float64)
    lo, hi = _var_ci(sums)
    assert lo <= g.sum_std ** 2 <= hi
    assert g.noise_multiplier(16) == pytest.approx(1.2)
    assert total[64] == 16 and total[65] == 16  # the weight slot (1 each) and the count


def test_the_grid_keeps_the_sum_inside_the_ring() -> None:
    g = dp.distributed_grid(clip=0.5, dim=1000, n_devices=1000, n_min=800, z=1.0)
    peak = 1000 * (0.5 * 2 ** g.frac_bits + 1)
    assert g.frac_bits < 24 and peak + 12 * g.sum_std * math.sqrt(1000 / 800) < 2 ** 31 and g.headroom > 12
    # and one grid finer would not fit
    sens = rounding_bound(0.5, g.frac_bits + 1, 1000)
    assert 1000 * (0.5 * 2 ** (g.frac_bits + 1) + 1) + 12 * sens * math.sqrt(1000 / 800) >= 2 ** 31 - 1
    assert dp.secure_frac_bits(1.0, 60_000) == 15  # Σω · bound · 2^F < 2^31


def test_clipping_and_rounding_bound_the_sensitivity() -> None:
    rng = np.random.default_rng(3)
    grid = Grid(params=500, frac_bits=10, weighted=False, l2_clip=0.25)
    big = [rng.normal(0, 1.0, 500)]
    v = grid_values(big, grid, rng)
    assert np.linalg.norm(v) <= rounding_bound(0.25, 10, 500)
    assert np.linalg.norm(v) == pytest.approx(0.25 * 2 ** 10, rel=0.05)
    # an integer device's grid values without DP: exact shifts onto the grid
    q = rng.integers(-127, 128, 500).astype(np.int8)
    exact = grid_values([q], Grid(params=500, frac_bits=12), rng, int_bits=8)
    assert np.array_equal(exact, q.astype(np.int64) << 5)
    assert dp.clip_factor(2.0, 0.5) == 0.25 and dp.clip_factor(0.1, 0.5) == 1.0


def test_accountant_matches_dp_accounting_and_the_published_reference() -> None:
    import dp_accounting
    from dp_accounting import rdp

    acc = Accountant(1e-5)
    for _ in range(3):
        acc.add(1.1, 0.01)
    ref = rdp.RdpAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 3)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    assert acc.events == [(1.1, 0.01, 3)]
    # Abadi et al., CCS 2016, §3.1: q = 0.01, σ = 4, δ = 1e-5, T = 10,000 steps gives
    # ε ≈ 1.26 with the moments accountant (log moments λ = 1..32, ε = min (Tα(λ) + log 1/δ)/λ);
    # the same RDP curve with that conversion reproduces it, and dp-accounting's tighter
    # conversion (Balle et al. 2020) gives less
    orders = list(range(2, 34))
    moments = rdp.RdpAccountant(orders)
    moments.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(4.0)), 10_000)
    abadi = min(r + math.log(1e5) / (o - 1) for r, o in zip(moments._rdp, orders, strict=True))
    assert round(abadi, 2) == 1.26
    ours = rdp_epsilon([(4.0, 0.01, 10_000)], 1e-5)
    assert 0.9 < ours < abadi
    # without sampling: T Gaussian mechanisms compose as one with σ/sqrt(T) (zCDP), same ε
    assert rdp_epsilon([(2.0, 1.0, 4)], 1e-5) == pytest.approx(rdp_epsilon([(1.0, 1.0, 1)], 1e-5), rel=1e-6)


def test_noise_for_a_target_epsilon_meets_it() -> None:
    z = noise_for_epsilon(2.0, 1e-5, rounds=50, q=1.0)  # every device every round
    assert rdp_epsilon([(z, 1.0, 50)], 1e-5) <= 2.0 < rdp_epsilon([(z * 0.99, 1.0, 50)], 1e-5)
    acc = Accountant(1e-5)
    for _ in range(50):
        acc.add(z, 1.0)
    assert acc.epsilon() <= 2.0 < acc.after(z, 1.0)
    assert Accountant.from_state(acc.state(), 1e-5).epsilon() == acc.epsilon()


def test_adaptive_clipping_moves_to_the_quantile() -> None:
    rng = np.random.default_rng(4)
    clip = 10.0
    for _ in range(200):
        norms = rng.lognormal(0.0, 0.5, 100)  # median 1
        below = float((norms <= clip).sum()) + rng.normal(0, 100 / 20)
        clip = dp.adapt_clip(clip, below, 100, quantile=0.5, lr=0.2)
    assert 0.8 < clip < 1.25
    z = dp.split_noise(1.0, 5.0)
    assert z == pytest.approx((1 - 1 / 100) ** -0.5) and z > 1.0
    with pytest.raises(ValueError):
        dp.split_noise(1.0, 0.4)


def _central(clip: float, selected: int = 1):
    from coordinator.privacy.central import CentralDP
    from coordinator.privacy.config import PrivacyConfig
    from coordinator.strategies import build_strategy

    return CentralDP(build_strategy("fedavg"), PrivacyConfig(mechanism="central", clip=clip), 0.0,
                     lambda: selected, rng=np.random.default_rng(0))


def test_central_dp_measures_an_integer_update_from_the_model_it_was_served() -> None:
    """An Int8 device sends back exactly the Int8 model it was served (off-grid and
    saturating global weights included): its update is zero, nothing is clipped and the
    global model does not move; one grid step on one weight moves it by that step. A float
    device's update is measured from the float global model."""
    from coordinator.strategies.types import EncodedUpdate
    from coordinator.variants import model_tensors, served_weights
    from edge_client.intnn import from_shared
    from edge_client.protocol import float32_tensor

    rng = np.random.default_rng(1)
    glob = [rng.normal(0, 0.3, (6, 5)).astype(np.float32), rng.normal(0, 0.3, 5).astype(np.float32)]
    glob[1][0] = 3.0  # beyond the Int8 grid's range: served saturated
    names = ["w", "b"]
    served = model_tensors(glob, names, "int8")
    assert dp.l2_norm([s - g for s, g in zip(served_weights(glob, 8), glob, strict=True)]) > 0.5

    cdp = _central(clip=0.2)
    cdp.begin_round(1, [g.copy() for g in glob])
    cdp.fold(EncodedUpdate("i8", 10, served, compute_bits=8))
    res = cdp.finish()
    assert res.stats["dp_clipped_fraction"] == 0.0
    for a, g in zip(res.weights, glob, strict=True):
        np.testing.assert_array_equal(a, g)

    q = from_shared(glob, 8)
    q[0][2, 3] += 1  # one step of the grid, 2^-7 in the shared domain
    from edge_client.codecs import encode
    moved = tuple(encode(x, codec="int", bits=8, name=n) for x, n in zip(q, names, strict=True))
    cdp.begin_round(2, [g.copy() for g in glob])
    cdp.fold(EncodedUpdate("i8", 10, moved, compute_bits=8))
    res = cdp.finish()
    want = [g.copy() for g in glob]
    want[0][2, 3] += np.float32(2.0 ** -7)
    for a, w in zip(res.weights, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=0, atol=1e-7)

    step = [np.full_like(g, 0.01) for g in glob]  # a float device: from the float model
    cdp = _central(clip=10.0)
    cdp.begin_round(3, [g.copy() for g in glob])
    cdp.fold(EncodedUpdate("f32", 10, tuple(float32_tensor(g + s, n) for g, s, n in zip(glob, step, names,
                                                                                        strict=True))))
    res = cdp.finish()
    for a, g, s in zip(res.weights, glob, step, strict=True):
        np.testing.assert_allclose(a, g + s, rtol=0, atol=1e-6)
