"""ProWD selective weight aggregation: the mask of eq. 8, solved exactly.

Per layer, with a = Δlow and b = Δhigh flattened (n elements), :func:`swa_mask` finds

    maximize  cos(c ⊙ a, b)
    over      binary c with at most k = floor(τ·n) zeros            (mode "drop")
          or  binary c with at most k = floor(τ·n) ones             (mode "keep")

and returns the keep-mask (bool, the layer's shape) with the cosine before and after.
The method is a parametric search over β of Φ(β) = max Σ_S (a_i b_i - β a_i²), whose
convex pieces are enumerated and pruned by a bound (derivation, the two readings of τ and
why the sorted-ratio prefix is not exact: docs/algorithms.md §4). With nothing to select
(k = 0, Δlow = 0 or Δhigh = 0) or no mask reaching a positive cosine the mask is all ones:
the returned mask never has a lower cosine than all ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_MAX_EVALS = 400  # safety cap on Φ evaluations per layer (never reached in the tests)
_PREFIX_MAX = 1 << 16  # layers up to this size get the sorted-prefix warm start


MODES = ("drop", "keep")


@dataclass
class SwaLayerResult:
    """Keep-mask (bool, the layer's shape; True = aggregate the low-bit element) and the
    cosine between Δlow and Δhigh before and after masking (0.0 where undefined)."""

    keep: np.ndarray
    cos_before: float
    cos_after: float
    evals: int


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b) in float64; 0.0 when either vector is zero."""
    a = a.reshape(-1).astype(np.float64, copy=False)
    b = b.reshape(-1).astype(np.float64, copy=False)
    na, nb = math.sqrt(float(a @ a)), math.sqrt(float(b @ b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a @ b) / (na * nb)


def max_dropped(n: int, tau: float) -> int:
    """The τ budget: at most floor(τ·n) elements of an n-element layer are dropped."""
    return int(math.floor(tau * n + 1e-9))


def max_kept(n: int, tau: float) -> int:
    """The τ budget of mode "keep": at most floor(τ·n) elements of an n-element layer kept."""
    return max_dropped(n, tau)


def swa_mask(d_low: np.ndarray, d_high: np.ndarray, tau: float, mode: str = "drop") -> SwaLayerResult:
    """Exact eq. 8 mask for one layer (see the module docstring). ``d_low``/``d_high``:
    the mean low-/high-bit updates, same shape; ``tau`` in [0, 1]; ``mode``: "drop" (τ
    bounds the fraction left out) or "keep" (τ bounds the fraction kept)."""
    if d_low.shape != d_high.shape:
        raise ValueError(f"swa_mask: shapes differ {d_low.shape} vs {d_high.shape}")
    if mode not in MODES:
        raise ValueError(f"swa_mask: mode must be one of {MODES}, got {mode!r}")
    a = d_low.reshape(-1).astype(np.float64)
    b = d_high.reshape(-1).astype(np.float64)
    before = cosine(a, b)
    if mode == "keep":
        return _keep_mask(a, b, tau, before, d_low.shape)
    keep = np.ones(a.size, dtype=bool)
    nz = np.flatnonzero(a)
    k = min(max_dropped(a.size, tau), nz.size - 1)  # keep at least one nonzero element
    if k <= 0 or not np.any(b):
        return SwaLayerResult(keep.reshape(d_low.shape), before, before, 0)
    p = a[nz] * b[nz]
    q = a[nz] * a[nz]
    drop, evals = _best_drop(p, q, k)
    if drop is not None and drop.size:
        keep[nz[drop]] = False
    after = cosine(np.where(keep, a, 0.0), b)
    if after < before:  # only float noise can get here; all ones is admissible
        keep[:] = True
        after = before
    return SwaLayerResult(keep.reshape(d_low.shape), before, after, evals)


def _keep_mask(a: np.ndarray, b: np.ndarray, tau: float, before: float, shape) -> SwaLayerResult:
    """Mode "keep": at most floor(τ·n) ones, chosen among the nonzero elements of a."""
    keep = np.zeros(a.size, dtype=bool)
    nz = np.flatnonzero(a)
    k = min(max_kept(a.size, tau), nz.size)
    if k <= 0 or not np.any(b):
        return SwaLayerResult(keep.reshape(shape), before, 0.0, 0)
    p = a[nz] * b[nz]
    q = a[nz] * a[nz]
    n_drop = nz.size - k  # dropping at least this many of the nonzero elements
    drop, evals = _best_drop(p, q, n_drop, at_least=True)
    if drop is not None:
        kept = np.ones(nz.size, dtype=bool)
        kept[drop] = False
        keep[nz[kept]] = True
    after = cosine(np.where(keep, a, 0.0), b)
    return SwaLayerResult(keep.reshape(shape), before, after, evals)


def _best_drop(p: np.ndarray, q: np.ndarray, k: int, at_least: bool = False) -> tuple[np.ndarray | None, int]:
    """Indices (into p, q) to drop, at most k (``at_least``: at least k), maximizing
    P/sqrt(Q) over the kept set; None when no admissible set has P > 0 (then nothing is
    dropped; in "at least" mode the caller keeps nothing)."""
    if at_least:
        return _best_drop_at_least(p, q, k)
    n = p.size
    p_tot, q_tot = float(p.sum()), float(q.sum())
    scale = float(np.abs(p).sum()) + 1e-300

    best_v2 = p_tot * p_tot / q_tot if p_tot > 0 else 0.0
    best_drop: np.ndarray | None = np.empty(0, dtype=np.intp) if p_tot > 0 else None

    def consider(drop: np.ndarray) -> tuple[float, float]:
        nonlocal best_v2, best_drop
        ps = p_tot - float(p[drop].sum())
        qs = q_tot - float(q[drop].sum())
        if drop.size and (qs <= 1e-6 * q_tot or abs(ps) <= 1e-6 * scale):
            kept = np.ones(n, dtype=bool)  # the differences cancelled: sum the kept set
            kept[drop] = False
            ps, qs = float(p[kept].sum()), float(q[kept].sum())
        if ps > 0 and qs > 0 and ps * ps / qs > best_v2 * (1 + 1e-12):
            best_v2, best_drop = ps * ps / qs, drop
        return ps, qs

    # 1. best ratio prefix (descending b/a), at least n-k kept; a cheap warm start for
    #    the pruning below (skipped on big layers, where the sort costs more than it saves)
    ratio = p / q
    if n <= _PREFIX_MAX:
        _prefix_start(p, q, k, ratio, consider)

    # 2. Eisner-Severance walk over the pieces of Φ on [0, max ratio / 2]
    r_max = float(ratio.max())
    if r_max <= 0:
        return best_drop, 0
    s = np.empty(n)
    scratch = np.empty(n)

    def phi(beta: float) -> tuple[float, float, float]:
        np.multiply(q, -beta, out=s)
        np.add(s, p, out=s)
        np.copyto(scratch, s)
        kth = np.partition(scratch, k - 1)[k - 1]  # the k-th lowest score
        cut = min(kth, 0.0)
        drop = np.flatnonzero(s < cut)
        if cut < 0 and drop.size < k:  # ties at the k-th score: drop some of them too
            ties = np.flatnonzero(s == cut)[: k - drop.size]
            drop = np.concatenate([drop, ties])
        ps, qs = consider(drop)
        return ps - beta * qs, ps, qs

    evals = _walk(phi, r_max, best_v2_of=lambda: best_v2, scale=scale)  # updates best_drop
    return best_drop, evals


def _best_drop_at_least(p: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray | None, int]:
    """At least k of the n elements dropped (at most n - k kept), maximizing P/sqrt(Q)
    over the kept set; the same parametric walk as :func:`_best_drop` with
    Φ(β) = the sum of the (at most n - k) largest positive scores p_i - β q_i."""
    n = p.size
    m = n - k  # the most elements kept
    scale = float(np.abs(p).sum()) + 1e-300
    best_v2 = 0.0
    best_drop: np.ndarray | None = None
    all_idx = np.arange(n)

    def consider(kept: np.ndarray) -> tuple[float, float]:
        nonlocal best_v2, best_drop
        ps, qs = float(p[kept].sum()), float(q[kept].sum())
        if kept.size and ps > 0 and qs > 0 and ps * ps / qs > best_v2 * (1 + 1e-12):
            best_v2 = ps * ps / qs
            mask = np.ones(n, dtype=bool)
            mask[kept] = False
            best_drop = all_idx[mask]
        return ps, qs

    ratio = p / q
    r_max = float(ratio.max())
    if m <= 0 or r_max <= 0:
        return None, 0
    if n <= _PREFIX_MAX:  # warm start: the best prefix by descending ratio, at most m long
        order = np.argsort(-ratio, kind="stable")
        pc, qc = np.cumsum(p[order])[:m], np.cumsum(q[order])[:m]
        with np.errstate(divide="ignore", invalid="ignore"):
            v2 = np.where(pc > 0, pc * pc / qc, -1.0)
        j = int(np.argmax(v2))
        if v2[j] > 0:
            consider(order[:j + 1])
    s = np.empty(n)

    def phi(beta: float) -> tuple[float, float, float]:
        np.multiply(q, -beta, out=s)
        np.add(s, p, out=s)
        pos = np.flatnonzero(s > 0)
        if pos.size > m:
            pos = pos[np.argpartition(-s[pos], m - 1)[:m]]
        ps, qs = consider(pos)
        return ps - beta * qs, ps, qs

    evals = _walk(phi, r_max, best_v2_of=lambda: best_v2, scale=scale)  # updates best_drop
    return best_drop, evals


def _walk(phi, r_max: float, best_v2_of, scale: float) -> int:
    """The Eisner-Severance walk of :func:`_best_drop` over Φ's pieces on [0, r_max/2];
    ``phi(β) -> (Φ(β), P, Q)`` records its sets itself; returns the evaluations."""
    evals = 0
    lo, hi = 0.0, r_max / 2
    f_lo, p_lo, q_lo = phi(lo)
    f_hi, p_hi, q_hi = phi(hi)
    evals += 2
    stack = [(lo, hi, f_lo, f_hi, p_lo, q_lo, p_hi, q_hi)]
    tol = 1e-12 * scale
    while stack and evals < _MAX_EVALS:
        b1, b2, f1, f2, p1, q1, p2, q2 = stack.pop()
        if abs(p1 - p2) <= tol and abs(q1 - q2) <= 1e-12 * (q1 + q2 + 1e-300):
            continue
        slope = (f2 - f1) / (b2 - b1)
        c0 = f1 - slope * b1
        beta_star = b2 if slope >= 0 else min(max(-c0 / (2 * slope), b1), b2)
        if 4 * beta_star * (c0 + slope * beta_star) <= best_v2_of() * (1 + 1e-9):
            continue
        if q1 == q2:
            continue
        bx = (p1 - p2) / (q1 - q2)
        if not (b1 < bx < b2):
            bx = 0.5 * (b1 + b2)
        fx, px, qx = phi(bx)
        evals += 1
        if fx <= max(p1 - bx * q1, p2 - bx * q2) + tol:
            continue
        stack.append((b1, bx, f1, fx, p1, q1, px, qx))
        stack.append((bx, b2, fx, f2, px, qx, p2, q2))
    return evals


def _prefix_start(p: np.ndarray, q: np.ndarray, k: int, ratio: np.ndarray, consider) -> None:
    """Evaluate the best prefix of the elements sorted by descending ratio, >= n-k kept."""
    n = p.size
    order = np.argsort(-ratio, kind="stable")
    pc = np.cumsum(p[order])
    qc = np.cumsum(q[order])
    sizes = np.arange(n - k, n + 1)
    ps, qs = pc[sizes - 1], qc[sizes - 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        v2 = np.where(ps > 0, ps * ps / qs, -1.0)
    j = int(np.argmax(v2))
    if v2[j] > 0:
        consider(order[sizes[j]:])
