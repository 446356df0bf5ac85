"""What a device sums under secure aggregation: its update on a fixed-point grid in
ℤ/2^32, with the distributed DP mechanism's noise when the round asks for it.

The vector has one *slot* per aggregation group the round sums apart: ``[ω·x (P values),
ω, 1]`` with ``x`` the update ``W - W_global`` in units of ``2^-F`` of the shared domain
and ``ω`` the device's weight (its sample count, or 1); a device fills its own slot and
leaves the others zero. An integer device's grid values ``q`` (units of ``2^-(s-1)``)
become ``q·2^(F-s+1)`` exactly when ``F >= s - 1``; a float device clips each coordinate
to ``bound``, scales and rounds stochastically (unbiased). Distributed DP (Kairouz, Liu,
Steinke, ICML 2021: the distributed discrete Gaussian) clips the update to L2 norm
``l2_clip``, scales it by ``2^F``, rounds at random until its norm is within the
conditional-rounding bound and adds discrete Gaussian noise of std ``noise_std`` grid
units (ω is then 1). The sum wraps modulo 2^32; the coordinator picks ``F`` so that it
does not in practice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from edge_client.errors import ProtocolError

RING_BITS = 32
RING_MASK = (1 << RING_BITS) - 1
#: the conditional rounding's β (Kairouz et al.: e^{-1/2})
ROUNDING_BETA = math.exp(-0.5)


@dataclass(frozen=True)
class Grid:
    """The encoding a secure round announces (in :class:`~edge_client.protocol.secure.SecAggRoster`).

    ``params``: P, values per slot; ``slots``: slots in the vector; ``slot``: the recipient
    device's; ``frac_bits``: F; ``bound``: the coordinate clip (shared units, without DP);
    ``weighted``: ω = samples (else 1); ``l2_clip`` > 0: distributed DP with that clip
    and ``noise_std`` (grid units) of discrete Gaussian noise per device.
    """

    params: int
    slots: int = 1
    slot: int = 0
    frac_bits: int = 16
    bound: float = 1.0
    weighted: bool = True
    l2_clip: float = 0.0
    noise_std: float = 0.0

    @property
    def length(self) -> int:
        """Words in the vector."""
        return self.slots * (self.params + 2)

    def to_map(self) -> dict:
        return asdict(self)

    @classmethod
    def from_map(cls, m: Mapping[str, Any], max_elements: int) -> Grid:
        """From a received roster's ``grid``; ProtocolError naming a bad field."""
        try:
            g = cls(**{k: m[k] for k in m if k in cls.__dataclass_fields__})
        except TypeError as exc:
            raise ProtocolError(f"grid: {exc}") from None
        ok = (isinstance(g.params, int) and 0 < g.params and isinstance(g.slots, int) and 1 <= g.slots <= 64
              and isinstance(g.slot, int) and 0 <= g.slot < g.slots and isinstance(g.frac_bits, int)
              and 0 <= g.frac_bits <= 30 and g.length <= max_elements and g.bound > 0
              and g.l2_clip >= 0 and g.noise_std >= 0 and math.isfinite(g.bound + g.l2_clip + g.noise_std))
        if not ok:
            raise ProtocolError(f"grid: {dict(m)!r} is not a valid encoding")
        return g


def stochastic_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased random rounding to integers: ``floor(x) + Bernoulli(frac(x))`` (int64)."""
    f = np.floor(x)
    return (f + (rng.random(x.shape) < (x - f))).astype(np.int64)


def rounding_bound(l2_clip: float, frac_bits: int, dim: int, beta: float = ROUNDING_BETA) -> float:
    """Kairouz et al.'s bound on the L2 norm of a clipped, scaled and randomly rounded
    vector (conditional rounding keeps to it): ``min(sqrt(c²γ² + d/4 + sqrt(2 ln 1/β)(cγ +
    sqrt(d)/2)), cγ + sqrt(d))``, γ = 2^F. It is the mechanism's L2 sensitivity."""
    cg = l2_clip * 2.0 ** frac_bits
    a = math.sqrt(cg * cg + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (cg + math.sqrt(dim) / 2))
    return min(a, cg + math.sqrt(dim))


def discrete_gaussian(std: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` samples of the discrete Gaussian N_Z(0, std²) (Canonne, Kamath, Steinke 2020:
    discrete Laplace proposals of scale ``floor(std) + 1`` accepted with probability
    ``exp(-(|y| - std²/t)² / (2 std²))``), int64. Floating-point acceptance, not the
    paper's exact arithmetic."""
    out = np.zeros(n, dtype=np.int64)
    if std <= 0 or n == 0:
        return out
    t = math.floor(std) + 1
    p = 1.0 - math.exp(-1.0 / t)
    todo = np.arange(n)
    while todo.size:
        m = todo.size
        y = rng.geometric(p, m).astype(np.int64) - rng.geometric(p, m).astype(np.int64)
        accept = rng.random(m) < np.exp(-((np.abs(y) - std * std / t) ** 2) / (2 * std * std))
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out


def grid_values(update: Sequence[np.ndarray], grid: Grid, rng: np.random.Generator, *,
                int_bits: int | None = None) -> np.ndarray:
    """The update on the grid (int64 [P]), before weighting and noise. ``update``: the
    layers of ``W - W_global``: float shared-domain values, or (``int_bits`` = s) an
    integer device's grid differences ``q`` in units of ``2^-(s-1)``."""
    parts = [np.asarray(a).reshape(-1) for a in update]
    if sum(p.size for p in parts) != grid.params:
        raise ProtocolError(f"update: {sum(p.size for p in parts)} values, the grid expects {grid.params}")
    F = grid.frac_bits
    if grid.l2_clip > 0:  # distributed DP: clip, scale, conditional random rounding
        x = np.concatenate([p.astype(np.float64) for p in parts])
        if int_bits is not None:
            x /= float(1 << (int_bits - 1))  # grid units -> shared domain
        norm = float(np.sqrt(np.dot(x, x)))
        if norm > grid.l2_clip:
            x *= grid.l2_clip / norm
        x *= 2.0 ** F
        bound = rounding_bound(grid.l2_clip, F, x.size)
        for _ in range(1000):
            v = stochastic_round(x, rng)
            if float(np.sqrt(np.dot(v.astype(np.float64), v))) <= bound:
                return v
        raise ProtocolError("conditional rounding: no rounding within the bound")  # probability < β^1000
    if int_bits is not None and F >= int_bits - 1:
        v = np.concatenate([p.astype(np.int64) for p in parts]) << (F - int_bits + 1)
        lim = int(grid.bound * 2.0 ** F)
        return np.clip(v, -lim, lim)
    x = np.concatenate([p.astype(np.float64) for p in parts])
    if int_bits is not None:
        x /= float(1 << (int_bits - 1))
    np.clip(x, -grid.bound, grid.bound, out=x)
    return stochastic_round(x * 2.0 ** F, rng)


def secure_vector(update: Sequence[np.ndarray], grid: Grid, weight: int, rng: np.random.Generator, *,
                  int_bits: int | None = None) -> np.ndarray:
    """The device's uint32 vector [grid.length]: its slot ``[ω·x, ω, 1]`` (plus its share
    of the noise under distributed DP), zeros elsewhere; everything modulo 2^32."""
    x = grid_values(update, grid, rng, int_bits=int_bits)
    w = int(weight) if grid.weighted and grid.l2_clip == 0 else 1
    slot = np.zeros(grid.params + 2, dtype=np.int64)
    slot[:grid.params] = x * w
    slot[grid.params] = w
    slot[grid.params + 1] = 1
    if grid.noise_std > 0:
        slot[:grid.params] += discrete_gaussian(grid.noise_std, grid.params, rng)
    out = np.zeros(grid.length, dtype=np.uint32)
    lo = grid.slot * (grid.params + 2)
    out[lo:lo + grid.params + 2] = (slot & RING_MASK).astype(np.uint32)
    return out


def centered(v: np.ndarray) -> np.ndarray:
    """uint32 ring elements as signed integers in [-2^31, 2^31) (int64)."""
    x = v.astype(np.int64)
    x[x >= 1 << (RING_BITS - 1)] -= 1 << RING_BITS
    return x


def split_slots(total: np.ndarray, grid: Grid) -> list[tuple]:
    """The summed vector's slots as ``(Σ ω·x (float64, shared units), Σ ω, count)``."""
    out = []
    for s in range(grid.slots):
        part = centered(total[s * (grid.params + 2):(s + 1) * (grid.params + 2)])
        out.append((np.ldexp(part[:grid.params].astype(np.float64), -grid.frac_bits),
                    int(part[grid.params]), int(part[grid.params + 1])))
    return out
