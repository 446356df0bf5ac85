"""The mask stage: turns the round's per-bitwidth sums into the per-layer average the
combiner starts from.

- ``none``: the (sample-weighted) average of all updates.
- ``prowd-swa``: ProWD selective weight aggregation (eq. 8-9; docs/algorithms.md §4).
  Bitwidths below the mean of the round's distinct bitwidths are "low", the others "high";
  per layer, Δlow/Δhigh = the average low/high weights minus the round's global model, and
  the exact mask (``swa.swa_mask``, ``tau_mode`` "drop" or "keep") applies to every low-bit
  update. ``fill="exclude"`` (the default) leaves a masked element out of that element's
  average (denominator: the weight of the updates that kept it); ``fill="literal"`` is
  eq. 9 as printed. With no low or no high update in the round the mask is all ones.
  Stats: ``masked_fraction/<layer>`` (the low-bit elements left out; per group
  ``masked_fraction/<layer>/<variant>``, 0 for a high group), ``cos_before/<layer>``,
  ``cos_after/<layer>``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from coordinator.strategies.accumulate import GroupSums
from coordinator.strategies.swa import MODES, swa_mask
from edge_client.errors import ConfigError
from edge_client.protocol import model_variant

Stats = dict[str, float | int]


class MaskStage(Protocol):
    name: str

    def average(self, sums: GroupSums, global_flat: list[np.ndarray]) -> tuple[list[np.ndarray], Stats]:
        """Per-layer float64 flat averages (after masking) and stats."""
        ...


def plain_average(sums: GroupSums) -> list[np.ndarray]:
    """Σ ω x / Σ ω over every update (float64, flat), in place on a fresh sum."""
    total, w = sums.combined(sums.bits)
    assert total is not None
    for t in total:
        t /= w
    return total


class NoMask:
    name = "none"

    def average(self, sums: GroupSums, global_flat: list[np.ndarray]) -> tuple[list[np.ndarray], Stats]:
        return plain_average(sums), {}


def split_bits(bits: list[int]) -> tuple[list[int], list[int]]:
    """(low, high) split at the mean of the distinct bitwidths; equal to the mean = high."""
    distinct = sorted(set(bits))
    if not distinct:
        return [], []
    mean = sum(distinct) / len(distinct)
    return [b for b in distinct if b < mean], [b for b in distinct if b >= mean]


class ProwdSwaMask:
    name = "prowd-swa"

    def __init__(self, tau: float = 0.1, fill: str = "exclude", tau_mode: str = "drop") -> None:
        if not 0.0 <= float(tau) <= 1.0:
            raise ConfigError(f"prowd-swa: tau must be in [0, 1], got {tau}")
        if fill not in ("exclude", "literal"):
            raise ConfigError(f"prowd-swa: fill must be 'exclude' or 'literal', got {fill!r}")
        if tau_mode not in MODES:
            raise ConfigError(f"prowd-swa: tau_mode must be one of {list(MODES)}, got {tau_mode!r}")
        self.tau = float(tau)
        self.fill = fill
        self.tau_mode = tau_mode

    def average(self, sums: GroupSums, global_flat: list[np.ndarray]) -> tuple[list[np.ndarray], Stats]:
        low, high = split_bits(sums.bits)
        stats: Stats = {"swa_low_bits": len(low), "swa_high_bits": len(high)}
        if not low or not high:
            for i in range(len(global_flat)):
                stats[f"masked_fraction/{i}"] = 0.0
                for b in sums.bits:
                    stats[f"masked_fraction/{i}/{_variant(b)}"] = 0.0
            return plain_average(sums), stats
        s_low, w_low = sums.combined(low)
        s_high, w_high = sums.combined(high)
        assert s_low is not None and s_high is not None
        out: list[np.ndarray] = []
        for i, (sl, sh, g) in enumerate(zip(s_low, s_high, global_flat, strict=True)):
            d_low = sl / w_low - g
            d_high = sh / w_high - g
            r = swa_mask(d_low, d_high, self.tau, self.tau_mode)
            c = r.keep
            sh += np.where(c, sl, 0.0)  # reuse the high sum as the masked total
            if self.fill == "exclude":
                sh /= np.where(c, w_high + w_low, w_high)
            else:
                sh /= w_high + w_low
            out.append(sh)
            masked = float(1.0 - c.mean()) if c.size else 0.0
            stats[f"masked_fraction/{i}"] = masked
            for b in low:
                stats[f"masked_fraction/{i}/{_variant(b)}"] = masked
            for b in high:
                stats[f"masked_fraction/{i}/{_variant(b)}"] = 0.0
            stats[f"cos_before/{i}"] = r.cos_before
            stats[f"cos_after/{i}"] = r.cos_after
        return out, stats


def _variant(bits: int) -> str:
    """A group's variant name (``float32``, ``int<s>``)."""
    return model_variant(bits, "int")
