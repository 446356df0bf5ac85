"""Lloyd-Max quantization levels of the standard normal N(0, 1), computed once per
(bits, zero_level) in plain float64 Python (math.erfc), no scipy.

- ``zero_level=False``: the classic symmetric Lloyd-Max quantizer with ``2**bits`` levels
  (1 bit: ±sqrt(2/pi) = ±0.7979; 2 bits: ±0.4528, ±1.5104; 4 bits: Max's 16 levels).
- ``zero_level=True``: one level pinned at 0, ``2**(bits-1) - 1`` negative and
  ``2**(bits-1)`` positive levels, the other levels Lloyd-optimal given the pin
  (2 bits: -1.224, 0, 0.7646, 1.7242 as in the FedWSQ code). 1 bit gives {0, 1.5958}.

Solved from the Panter-Dite start (quantiles of N(0, 3)) to the Lloyd fixed point (every
level the conditional mean of N(0, 1) on its cell, ``(phi(a) - phi(b)) / (Phi(b) -
Phi(a))``, tail-safe Phi differences) with residual <= 1e-14, by Newton's method.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from edge_client.compat import zip_strict

_SQRT2 = math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _phi(x: float) -> float:
    return 0.0 if math.isinf(x) else _INV_SQRT2PI * math.exp(-0.5 * x * x)


def _mass(a: float, b: float) -> float:
    """P(a < Z < b) without cancellation in either tail."""
    if a >= 0.0:
        return 0.5 * (math.erfc(a / _SQRT2) - math.erfc(b / _SQRT2))
    if b <= 0.0:
        return 0.5 * (math.erfc(-b / _SQRT2) - math.erfc(-a / _SQRT2))
    return 1.0 - 0.5 * (math.erfc(-a / _SQRT2) + math.erfc(b / _SQRT2))


def _centroid(a: float, b: float) -> float:
    return (_phi(a) - _phi(b)) / _mass(a, b)


def _residual(levels: list[float], pinned: int | None) -> tuple[list[float], np.ndarray]:
    """``G_i = l_i - centroid_i`` (0 for the pinned level) and its tridiagonal Jacobian."""
    k = len(levels)
    bounds = [-math.inf] + [0.5 * (levels[i] + levels[i + 1]) for i in range(k - 1)] + [math.inf]
    g = [0.0] * k
    jac = np.zeros((k, k))
    for i in range(k):
        jac[i, i] = 1.0
        if i == pinned:
            g[i] = levels[i]
            continue
        a, b = bounds[i], bounds[i + 1]
        mass = _mass(a, b)
        m = (_phi(a) - _phi(b)) / mass
        g[i] = levels[i] - m
        dm_da = 0.0 if math.isinf(a) else _phi(a) * (m - a) / mass
        dm_db = 0.0 if math.isinf(b) else _phi(b) * (b - m) / mass
        jac[i, i] -= 0.5 * (dm_da + dm_db)
        if i > 0:
            jac[i, i - 1] = -0.5 * dm_da
        if i < k - 1:
            jac[i, i + 1] = -0.5 * dm_db
    return g, jac


def _solve_tridiagonal(jac: np.ndarray, rhs: list[float]) -> list[float]:
    """Thomas algorithm for the tridiagonal ``jac`` (diagonally dominant here)."""
    k = len(rhs)
    c = [0.0] * k
    d = [0.0] * k
    for i in range(k):
        lower = jac[i, i - 1] if i else 0.0
        den = jac[i, i] - lower * (c[i - 1] if i else 0.0)
        c[i] = (jac[i, i + 1] if i < k - 1 else 0.0) / den
        d[i] = (rhs[i] - lower * (d[i - 1] if i else 0.0)) / den
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        x[i] = d[i] - (c[i] * x[i + 1] if i < k - 1 else 0.0)
    return x


def _lloyd(levels: list[float], pinned: int | None, tol: float = 1e-14) -> list[float]:
    """Solve ``level = centroid of its cell`` (Lloyd's fixed point): a few plain Lloyd
    steps, then Newton with a tridiagonal Jacobian and step halving (quadratic, so 256
    levels take milliseconds instead of the ~10**5 slow Lloyd steps)."""
    k = len(levels)
    for _ in range(20):
        g, _jac = _residual(levels, pinned)
        levels = [v - d for v, d in zip_strict(levels, g)]
    for _ in range(100):
        g, jac = _residual(levels, pinned)
        err = max(abs(v) for v in g)
        if err <= tol:
            break
        step = _solve_tridiagonal(jac, g)
        t = 1.0
        while t > 1e-6:
            cand = [v - t * d for v, d in zip_strict(levels, step)]
            ok = all(cand[i] < cand[i + 1] for i in range(k - 1))
            if ok and max(abs(v) for v in _residual(cand, pinned)[0]) < err:
                break
            t *= 0.5
        else:
            break
        levels = cand
    return levels


@lru_cache(maxsize=32)
def _levels(bits: int, zero_level: bool) -> tuple[float, ...]:
    k = 1 << bits
    start = NormalDist(0.0, math.sqrt(3.0))
    if not zero_level:
        init = [start.inv_cdf((i + 0.5) / k) for i in range(k)]
        return tuple(_lloyd(init, None))
    neg = k // 2 - 1
    pos = k // 2
    init = [start.inv_cdf((i + 0.5) / (2 * neg + 1)) for i in range(neg)] if neg else []
    init += [0.0]
    init += [start.inv_cdf(0.5 + 0.5 * (i + 0.5) / pos) + 0.0 for i in range(pos)]
    init[neg + 1 :] = [max(v, 1e-3 * (i + 1)) for i, v in enumerate(init[neg + 1 :])]
    return tuple(_lloyd(sorted(init), neg))


def normal_levels(bits: int, zero_level: bool) -> np.ndarray:
    """Sorted float64 Lloyd-Max levels of N(0, 1) (``2**bits`` of them, bits 1..8); a copy."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    return np.array(_levels(int(bits), bool(zero_level)), dtype=np.float64)
