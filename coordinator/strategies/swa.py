"""ProWD selective weight aggregation, the mask of eq. 8, solved exactly.

Problem, per layer, with a = Δlow and b = Δhigh flattened (n elements):

    maximize  cos(c ⊙ a, b) = Σ c_i a_i b_i / (sqrt(Σ c_i a_i²) · ||b||)
    over      binary c with at most k = floor(τ·n) zeros.

Write p_i = a_i b_i, q_i = a_i² and, for a kept set S, v(S) = P(S) / sqrt(Q(S)).
Elements with a_i = 0 change neither sum: they are always kept.

docs/algorithms.md §4 (once) proposed "the best prefix of the elements sorted by b_i/a_i". That is
exact when the τ budget is not binding, but not in general: with a budget of one drop and
(a, b) = (1, 1), (0.01, -1), (10, -0.3), the best prefix keeps (1,1),(10,-0.3) (cosine < 0)
while dropping (10, -0.3) gives 0.99. The exact method used here:

* For any β > 0 and any S with P(S) > 0: v(S)² >= 4β(P(S) - βQ(S)), with equality at
  β = P(S)/(2Q(S)). Hence v*² = max_β 4β·Φ(β), Φ(β) = max_{|S| >= n-k} Σ_S (p_i - β q_i),
  and an optimal set is a maximizer of Φ at some β in (0, max_i(b_i/a_i)/2].
* Φ(β) is evaluated in O(n) (keep everything with positive score, then the best scores
  until n-k are kept: one ``argpartition``). Φ is convex and piecewise linear, one
  piece per set; its pieces are enumerated by splitting at the intersection of the two
  end sets' lines (Eisner-Severance), and an interval is pruned when the bound
  4β·chord(β) (valid because Φ is convex) cannot beat the best set found so far.
* On layers up to 65,536 elements the best ratio prefix is evaluated first as a warm
  start for the pruning.

If no admissible mask reaches a positive cosine (Δlow and Δhigh disagree everywhere), or
the layer has nothing to select (k = 0, Δlow = 0 or Δhigh = 0), the mask is all ones:
selection cannot align updates that point away from each other, and an all-ones mask
never lowers the cosine. The returned mask never has a lower cosine than all ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_MAX_EVALS = 400  # safety cap on Φ evaluations per layer (never reached in the tests)
_PREFIX_MAX = 1 << 16  # layers up to this size get the sorted-prefix warm start


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


def swa_mask(d_low: np.ndarray, d_high: np.ndarray, tau: float) -> SwaLayerResult:
    """Exact eq. 8 mask for one layer (see the module docstring). ``d_low``/``d_high``:
    the mean low-/high-bit updates, same shape; ``tau`` in [0, 1]."""
    if d_low.shape != d_high.shape:
        raise ValueError(f"swa_mask: shapes differ {d_low.shape} vs {d_high.shape}")
    a = d_low.reshape(-1).astype(np.float64)
    b = d_high.reshape(-1).astype(np.float64)
    keep = np.ones(a.size, dtype=bool)
    before = cosine(a, b)
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


def _best_drop(p: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray | None, int]:
    """Indices (into p, q) to drop, at most k, maximizing P/sqrt(Q) over the kept set;
    None when no admissible set has P > 0 (then nothing is dropped)."""
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
            continue  # one set on the whole interval: Φ is its line, already evaluated
        # bound: Φ <= chord on [b1, b2] (convexity); maximize 4β·chord(β)
        slope = (f2 - f1) / (b2 - b1)
        c0 = f1 - slope * b1
        beta_star = b2 if slope >= 0 else min(max(-c0 / (2 * slope), b1), b2)
        if 4 * beta_star * (c0 + slope * beta_star) <= best_v2 * (1 + 1e-9):
            continue
        if q1 == q2:
            continue  # parallel lines: the envelope is the higher one, both evaluated
        bx = (p1 - p2) / (q1 - q2)
        if not (b1 < bx < b2):
            bx = 0.5 * (b1 + b2)
        fx, px, qx = phi(bx)
        evals += 1
        if fx <= max(p1 - bx * q1, p2 - bx * q2) + tol:
            continue  # the two end lines are the envelope here
        stack.append((b1, bx, f1, fx, p1, q1, px, qx))
        stack.append((bx, b2, fx, f2, px, qx, p2, q2))
    return best_drop, evals


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
