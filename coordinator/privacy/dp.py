"""Differential privacy's math at the coordinator: pure functions.

- central DP (DP-FedAvg, McMahan et al., ICLR 2018): each update ``Δ = W - W_served``
  (from the model its device was served) is clipped to L2 norm ``C``
  (:func:`clip_factor`), the clipped updates are summed unweighted and Gaussian noise
  of std ``z·C`` is added to the sum (:func:`gaussian`);
- adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021):
  :func:`adapt_clip` moves ``C`` geometrically towards the ``γ`` quantile of the update
  norms, from a noisy count of the updates within ``C``; :func:`split_noise` gives the
  noise multiplier left for the sum once the count has its share;
- distributed DP (the distributed discrete Gaussian, Kairouz, Liu, Steinke, ICML 2021):
  :func:`distributed_grid` picks the fixed-point grid and each device's noise so that the
  sum of ``n_min`` devices carries std ``z·Δ₂`` (Δ₂ the rounding-inflated sensitivity) and
  stays within ℤ/2^32 (no modular wrap-around) with overwhelming probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edge_client.secagg.encode import RING_BITS, rounding_bound


def l2_norm(layers: list[np.ndarray]) -> float:
    """The L2 norm of an update given as layers (float64 accumulation)."""
    return float(math.sqrt(sum(float(np.dot(a.reshape(-1).astype(np.float64), a.reshape(-1).astype(np.float64)))
                               for a in layers)))


def clip_factor(norm: float, clip: float) -> float:
    """``min(1, C / ‖Δ‖)``: the factor that clips an update of norm ``norm`` to ``clip``."""
    return 1.0 if norm <= clip or norm == 0 else clip / norm


def gaussian(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """float64 N(0, std²) of ``shape``."""
    return rng.normal(0.0, std, size=shape)


def split_noise(z: float, count_std: float) -> float:
    """Andrew et al. eq. (4): with the clipped-count's noise of std ``count_std`` (σ_b) taking
    part of the privacy budget, the sum's noise multiplier that keeps the total at ``z``:
    ``(z^-2 - (2σ_b)^-2)^-1/2``; ValueError when σ_b is too small to leave any (``2σ_b <= z``)."""
    if count_std <= 0:
        return z
    rest = z ** -2 - (2 * count_std) ** -2
    if rest <= 0:
        raise ValueError(f"count noise {count_std} too small for noise multiplier {z}")
    return rest ** -0.5


def adapt_clip(clip: float, below: float, n: int, *, quantile: float = 0.5, lr: float = 0.2) -> float:
    """Andrew et al.'s geometric update: ``C·exp(-η (b̃ - γ))`` with ``b̃ = below / n`` the
    (noisy) fraction of updates whose norm was within ``C``."""
    frac = below / max(n, 1)
    return clip * math.exp(-lr * (frac - quantile))


@dataclass(frozen=True)
class DistributedGrid:
    """``frac_bits`` F (grid 2^-F), ``sensitivity`` Δ₂ (grid units), ``device_std`` each
    device's discrete Gaussian std (grid units), ``sum_std`` the std of the sum of
    ``n_min`` devices' noise (grid units), ``headroom`` how many sum stds lie between the
    largest possible clipped sum and the ring's edge."""

    frac_bits: int
    sensitivity: float
    device_std: float
    sum_std: float
    headroom: float

    def noise_multiplier(self, n_devices: int) -> float:
        """The noise multiplier the sum of ``n_devices`` devices' noise gives."""
        return self.device_std * math.sqrt(n_devices) / self.sensitivity


def distributed_grid(clip: float, dim: int, n_devices: int, n_min: int, z: float, *,
                     max_frac_bits: int = 24, sigmas: float = 12.0) -> DistributedGrid:
    """The finest grid (largest F) on which the sum of ``n_devices`` clipped, rounded
    updates (each coordinate at most ``C·2^F + 1``) plus ``sigmas`` standard deviations of
    the noise stays below ``2^31``, and the per-device noise std that gives the sum of
    ``n_min`` devices std ``z·Δ₂(F)``. ValueError when no grid fits."""
    for F in range(max_frac_bits, 0, -1):
        sens = rounding_bound(clip, F, dim)
        sum_std = z * sens
        peak = n_devices * (clip * 2.0 ** F + 1)
        edge = 2.0 ** (RING_BITS - 1) - 1
        if peak + sigmas * sum_std * math.sqrt(n_devices / max(n_min, 1)) < edge:
            return DistributedGrid(F, sens, sum_std / math.sqrt(n_min), sum_std, (edge - peak) / sum_std)
    raise ValueError(f"no fixed-point grid holds {n_devices} updates of L2 norm {clip} with noise "
                     f"multiplier {z} in Z/2^{RING_BITS}")


def secure_frac_bits(bound: float, total_weight: float, max_frac_bits: int = 24) -> int:
    """SecAgg without DP: the largest F with ``Σω · bound · 2^F < 2^31`` (every coordinate
    of the weighted sum fits the ring), at least 0."""
    room = (2.0 ** (RING_BITS - 1) - 1) / max(total_weight * bound, 1e-300)
    return int(max(0, min(max_frac_bits, math.floor(math.log2(room)) if room >= 1 else 0)))
