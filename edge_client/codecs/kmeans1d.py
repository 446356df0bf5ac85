"""Fast 1-D K-means (Lloyd) on a fine log-linear histogram, and exact nearest assignment.

Sorting a layer costs more than a whole encode may (docs/performance.md#codecs-and-the-coordinators-update-path),
so every value goes to one bin of a fixed log-linear grid around the mean ``mu`` (an HDR
histogram's): ``2**MANT_BITS`` bins per octave of ``|x - mu|``, both signs, for the
``OCTAVES`` octaves below the largest; closer values share the centre bin. No bin is wider
than 2**-MANT_BITS of the half range and the dense middle gets much finer bins, so heavy
tails do not starve the bulk of resolution as on a uniform grid. Lloyd runs on per-bin
counts and sums through prefix sums (a centroid's cell is a run of whole bins): O(k) per
iteration, until the partition is a fixed point or ``max_iter``.

The final assignment is exact, not binned: ``x`` gets the number of float64 midpoints of
the float32 codebook below it (``np.searchsorted(m, x, side="left")``: the nearest codeword,
ties to the lower), found with a per-bin table plus a step or two. The authors' behaviour
(FedShift's code: random init, Lloyd on all points, 300 iterations) is :func:`lloyd_authors`.
"""

from __future__ import annotations

import numba
import numpy as np

from edge_client.codecs.bitpack import _pack_into, _unpack_into

MANT_BITS = 10
OCTAVES = 24
_CHUNK = 4096


# --------------------------------------------------------------------------- the grid


@numba.njit(inline="always")
def _bucket(v, mu, a_floor, shift, nm, scratch, scratch_u):
    """Bin of the float64 value ``v`` on the grid (monotone non-decreasing in ``v``)."""
    scratch[0] = np.float32(v - mu)
    u = scratch_u[0]
    a = np.int64(u & np.uint32(0x7FFFFFFF))
    if a < a_floor:
        m = 0
    else:
        m = ((a - a_floor) >> shift) + 1
        if m > nm - 1:
            m = nm - 1
    if u >> np.uint32(31):
        return nm - 1 - m
    return nm - 1 + m


def grid(lo: float, hi: float, mu: float) -> tuple[int, int, int]:
    """Grid parameters ``(a_floor, shift, nm)`` for data in ``[lo, hi]`` with mean ``mu``.

    ``a_floor`` is the float32 bit pattern (as an int) below which ``|y|`` falls in the
    centre bin; ``nm`` is the number of magnitude buckets; the grid has ``2*nm - 1`` bins.
    """
    dev = max(abs(np.float32(hi - mu)), abs(np.float32(lo - mu)))
    a_max = int(np.array([dev], dtype=np.float32).view(np.uint32)[0])
    e_top = a_max >> 23
    e_floor = max(e_top - OCTAVES, 0)
    a_floor = e_floor << 23
    shift = 23 - MANT_BITS
    nm = 1 if a_max < a_floor else ((a_max - a_floor) >> shift) + 2
    return a_floor, shift, nm


@numba.njit(cache=True)
def histogram(x, mu, a_floor, shift, nm):
    """Per-bin counts (int64), sums of ``x - mu`` and of ``(x - mu)**2`` (float64) of a
    1-D float32 array (centred on ``mu`` so that cell variances do not cancel out)."""
    nb = 2 * nm - 1
    counts = np.zeros(nb, dtype=np.int64)
    sums = np.zeros(nb, dtype=np.float64)
    sqs = np.zeros(nb, dtype=np.float64)
    scratch = np.empty(1, dtype=np.float32)
    scratch_u = scratch.view(np.uint32)
    for i in range(x.size):
        v = np.float64(x[i])
        b = _bucket(v, mu, a_floor, shift, nm, scratch, scratch_u)
        counts[b] += 1
        d = v - mu
        sums[b] += d
        sqs[b] += d * d
    return counts, sums, sqs


# --------------------------------------------------------------------------- Lloyd on the grid


@numba.njit(cache=True)
def bin_edges(lo, hi, mu, a_floor, shift, nm):
    """float64 edges (``2*nm`` of them) of the grid's bins in x units, clipped to [lo, hi]."""
    nb = 2 * nm - 1
    edges = np.empty(nb + 1, dtype=np.float64)
    scratch_u = np.empty(1, dtype=np.uint32)
    scratch = scratch_u.view(np.float32)
    # magnitude boundary g[M] = |y| where bucket M+1 starts; g[0] = the centre bin's half width
    g = np.empty(nm, dtype=np.float64)
    for m in range(nm):
        a = a_floor + (m << shift)
        if a > 0x7F7FFFFF:
            a = 0x7F7FFFFF
        scratch_u[0] = np.uint32(a)
        g[m] = np.float64(scratch[0])
    # bin nm-1+M (M >= 1) is [g[M-1], g[M]) in y; bin nm-1-M is (-g[M], -g[M-1]]
    edges[0] = lo
    for b in range(nb - 1):
        m = b - (nm - 1)
        up = mu + g[m] if m >= 0 else mu - g[-m - 1]
        edges[b + 1] = min(max(up, lo), hi)
    edges[nb] = hi
    return edges


@numba.njit(cache=True)
def _init_companding(counts, edges, c):
    """Initial centroids at the quantiles ``(j + 1/2)/k`` of the cube root of the density.

    That is the asymptotically optimal density of a k-level quantizer (Panter-Dite), so
    Lloyd starts near its optimum instead of crawling there from mass quantiles (which
    at 256 levels needs thousands of iterations and stalls on the grid). Bin weight:
    ``count**(1/3) * width**(2/3)``; a centroid falls at its quantile's position inside its
    bin (linear interpolation).
    """
    nb = counts.size
    k = c.size
    w = np.empty(nb, dtype=np.float64)
    tot = 0.0
    for b in range(nb):
        width = edges[b + 1] - edges[b]
        if counts[b] > 0:
            w[b] = np.cbrt(np.float64(counts[b])) * np.cbrt(width * width) if width > 0 else 1e-300
        else:
            w[b] = 0.0
        tot += w[b]
    b = 0
    acc = 0.0
    for j in range(k):
        target = (j + 0.5) * tot / k
        while b < nb - 1 and acc + w[b] <= target:
            acc += w[b]
            b += 1
        frac = (target - acc) / w[b] if w[b] > 0 else 0.5
        frac = min(max(frac, 0.0), 1.0)
        c[j] = edges[b] + frac * (edges[b + 1] - edges[b])


@numba.njit(inline="always")
def _sse(cc, ss, qq, lo, hi):
    """Sum of squared deviations from their mean of the points in bins [lo, hi)."""
    cnt = cc[hi] - cc[lo]
    if cnt == 0:
        return 0.0
    s = ss[hi] - ss[lo]
    v = (qq[hi] - qq[lo]) - s * s / cnt
    return v if v > 0.0 else 0.0


@numba.njit(cache=True)
def atoms(counts, edges, m_target):
    """Fine-bin boundaries (int64, ``ab[0] = 0 .. ab[-1] = nb``) of at most ``2*m_target``
    runs of consecutive bins ("atoms") for the exact DP start.

    A run closes once it holds ``1/m_target`` of the mass *or* of the Panter-Dite weight
    ``count**(1/3) * width**(2/3)`` (:func:`_init_companding`): fine where the mass is
    and where an optimal quantizer puts its cells (sparse heavy tails included).
    """
    nb = counts.size
    n = 0
    tot = 0.0
    for b in range(nb):
        n += counts[b]
        width = edges[b + 1] - edges[b]
        if counts[b] > 0 and width > 0:
            tot += np.cbrt(np.float64(counts[b])) * np.cbrt(width * width)
    ab = np.empty(nb + 1, dtype=np.int64)
    ab[0] = 0
    na = 0
    acc_w = 0.0
    acc_n = 0
    step_w = tot / m_target
    step_n = n / m_target
    for b in range(nb - 1):
        width = edges[b + 1] - edges[b]
        if counts[b] > 0 and width > 0:
            acc_w += np.cbrt(np.float64(counts[b])) * np.cbrt(width * width)
        acc_n += counts[b]
        if acc_w >= step_w or acc_n >= step_n:
            na += 1
            ab[na] = b + 1
            acc_w = 0.0
            acc_n = 0
    na += 1
    ab[na] = nb
    return ab[: na + 1]


@numba.njit(cache=True)
def dp_partition(cc, ss, qq, ab, k, cuts):
    """Optimal (least squared error) partition of the atoms ``ab`` into ``k`` runs.

    ``cc, ss, qq``: prefix sums (length ``nb + 1``) of the fine bins' counts, sums and
    sums of squares. Writes the fine-bin cuts (``k + 1``) into ``cuts`` and returns the
    partition's squared error. Exact 1-D k-means DP over the atoms; the optimal split
    point is monotone in the right end (the interval cost is Monge), so each of the
    ``k - 1`` layers is a divide and conquer over ``m`` atoms: O(k m log m) cost terms.
    """
    m = ab.size - 1
    prev = np.empty(m + 1, dtype=np.float64)
    cur = np.empty(m + 1, dtype=np.float64)
    arg = np.zeros((k, m + 1), dtype=np.int32)
    for i in range(m + 1):
        prev[i] = _sse(cc, ss, qq, 0, ab[i])
    stack = np.empty((2 * m + 64, 4), dtype=np.int64)
    for j in range(1, k):
        stack[0, 0] = 0
        stack[0, 1] = m
        stack[0, 2] = 0
        stack[0, 3] = m
        sp = 1
        while sp > 0:
            sp -= 1
            lo = stack[sp, 0]
            hi = stack[sp, 1]
            olo = stack[sp, 2]
            ohi = stack[sp, 3]
            if lo > hi:
                continue
            mid = (lo + hi) >> 1
            best = np.inf
            bt = olo
            b_mid = ab[mid]
            for t in range(olo, min(ohi, mid) + 1):
                v = prev[t] + _sse(cc, ss, qq, ab[t], b_mid)
                if v < best:
                    best = v
                    bt = t
            cur[mid] = best
            arg[j, mid] = bt
            stack[sp, 0] = lo
            stack[sp, 1] = mid - 1
            stack[sp, 2] = olo
            stack[sp, 3] = bt
            stack[sp + 1, 0] = mid + 1
            stack[sp + 1, 1] = hi
            stack[sp + 1, 2] = bt
            stack[sp + 1, 3] = ohi
            sp += 2
        prev[:] = cur
    cuts[0] = 0
    cuts[k] = ab[m]
    i = m
    for j in range(k - 1, 0, -1):
        i = arg[j, i]
        cuts[j] = ab[i]
    return prev[m]


@numba.njit(cache=True)
def _lloyd_cells(c, cuts, counts, sums, cc, ss, mu, a_floor, shift, nm, max_iter, scratch, scratch_u):
    """Lloyd on the grid from centroids ``c`` (x units, sorted) until the partition into
    bin runs ``cuts`` stops changing; returns the iterations done."""
    k = c.size
    it = 0
    while it < max_iter:
        changed = False
        prev = 0
        for j in range(k - 1):
            t = 0.5 * (c[j] + c[j + 1])
            bt = _bucket(t, mu, a_floor, shift, nm, scratch, scratch_u)
            cut = bt + 1
            if counts[bt] > 0 and mu + sums[bt] / counts[bt] > t:
                cut = bt
            if cut < prev:
                cut = prev
            prev = cut
            if cut != cuts[j + 1]:
                cuts[j + 1] = cut
                changed = True
        if not changed:
            break
        it += 1
        for j in range(k):
            lo = cuts[j]
            hi = cuts[j + 1]
            cnt = cc[hi] - cc[lo]
            if cnt > 0:
                c[j] = mu + (ss[hi] - ss[lo]) / cnt
        # an empty cell keeps its centroid, which may then be out of order: re-sort
        for j in range(1, k):
            v = c[j]
            i = j - 1
            while i >= 0 and c[i] > v:
                c[i + 1] = c[i]
                i -= 1
            c[i + 1] = v
    return it


@numba.njit(cache=True)
def lloyd_histogram(counts, sums, sqs, edges, k, mu, a_floor, shift, nm, max_iter, max_rounds, dp_atoms=0):
    """K-means with ``k`` centroids on a histogram; returns (sorted float64 centroids, iterations).

    1. Initial centroids: :func:`_init_companding` (``edges``: :func:`bin_edges`), or with
       ``dp_atoms > 0`` the means of the optimal partition of about ``dp_atoms`` atoms
       (:func:`atoms`, :func:`dp_partition`): the global optimum at atom resolution, which
       Lloyd alone (a local search) misses on heavy tails.
    2. Lloyd until the partition is a fixed point.
    3. Up to ``max_rounds`` rounds of split/merge moves, each followed by Lloyd again:
       split the cells whose best 2-split gains most, merge the adjacent pairs that cost
       least, while a gain exceeds a cost. Lloyd alone cannot move a codeword from the
       dense bulk to a few far outliers (heavy tails), which dominate the error there;
       these moves do, and they never increase the error.
    """
    nb = counts.size
    cc = np.zeros(nb + 1, dtype=np.int64)
    ss = np.zeros(nb + 1, dtype=np.float64)
    qq = np.zeros(nb + 1, dtype=np.float64)
    for b in range(nb):
        cc[b + 1] = cc[b] + counts[b]
        ss[b + 1] = ss[b] + sums[b]
        qq[b + 1] = qq[b] + sqs[b]
    n = cc[nb]
    c = np.zeros(k, dtype=np.float64)
    if n == 0:
        return c, 0
    cuts = np.full(k + 1, -1, dtype=np.int64)
    if dp_atoms > 0:
        dp_partition(cc, ss, qq, atoms(counts, edges, dp_atoms), k, cuts)
        for j in range(k):
            lo = cuts[j]
            hi = cuts[j + 1]
            c[j] = mu + (ss[hi] - ss[lo]) / (cc[hi] - cc[lo]) if cc[hi] > cc[lo] else 0.0
        # empty runs (fewer occupied atoms than k) take the previous centroid's value
        for j in range(1, k):
            if cc[cuts[j + 1]] == cc[cuts[j]]:
                c[j] = c[j - 1]
        if cc[cuts[1]] == 0:
            c[0] = c[1]
        c[:] = np.sort(c)
        cuts[1:k] = -1
    else:
        _init_companding(counts, edges, c)
    cuts[0] = 0
    cuts[k] = nb
    scratch = np.empty(1, dtype=np.float32)
    scratch_u = scratch.view(np.uint32)
    it = _lloyd_cells(c, cuts, counts, sums, cc, ss, mu, a_floor, shift, nm, max_iter, scratch, scratch_u)
    gain = np.empty(k, dtype=np.float64)
    at = np.empty(k, dtype=np.int64)
    cost = np.empty(k, dtype=np.float64)
    used = np.zeros(k, dtype=np.bool_)
    newc = np.empty(k, dtype=np.float64)
    for _ in range(max_rounds):
        # best split of every cell
        for j in range(k):
            lo = cuts[j]
            hi = cuts[j + 1]
            whole = _sse(cc, ss, qq, lo, hi)
            best = 0.0
            bp = -1
            if whole > 0.0:
                for p in range(lo + 1, hi):
                    if counts[p - 1] == 0:
                        continue
                    g = whole - _sse(cc, ss, qq, lo, p) - _sse(cc, ss, qq, p, hi)
                    if g > best:
                        best = g
                        bp = p
            gain[j] = best
            at[j] = bp
        # cost of merging cell j with cell j+1
        for j in range(k - 1):
            lo = cuts[j]
            mid = cuts[j + 1]
            hi = cuts[j + 2]
            cost[j] = _sse(cc, ss, qq, lo, hi) - _sse(cc, ss, qq, lo, mid) - _sse(cc, ss, qq, mid, hi)
        cost[k - 1] = np.inf
        split_order = np.argsort(-gain)
        merge_order = np.argsort(cost)
        used[:] = False
        moves = 0
        mi = 0
        for si in range(k):
            j = split_order[si]
            if gain[j] <= 0.0 or at[j] < 0:
                break
            if used[j]:
                continue
            while mi < k - 1:
                r = merge_order[mi]
                if used[r] or used[r + 1] or r == j or r + 1 == j:
                    mi += 1
                    continue
                break
            if mi >= k - 1:
                break
            r = merge_order[mi]
            if not cost[r] < gain[j] * (1.0 - 1e-9):
                break
            mi += 1
            used[j] = True
            used[r] = True
            used[r + 1] = True
            moves += 1
            # the pair's codewords become one (their union's mean) and the split cell's
            # codeword becomes two (its halves' means): new centroids written in place
            lo = cuts[r]
            hi = cuts[r + 2]
            c[r] = mu + (ss[hi] - ss[lo]) / (cc[hi] - cc[lo]) if cc[hi] > cc[lo] else c[r]
            lo = cuts[j]
            hi = cuts[j + 1]
            p = at[j]
            c[r + 1] = mu + (ss[p] - ss[lo]) / (cc[p] - cc[lo])
            c[j] = mu + (ss[hi] - ss[p]) / (cc[hi] - cc[p])
        if moves == 0:
            break
        newc[:] = np.sort(c)
        c[:] = newc
        cuts[1:k] = -1
        it += _lloyd_cells(c, cuts, counts, sums, cc, ss, mu, a_floor, shift, nm, max_iter, scratch, scratch_u)
    return c, it


# --------------------------------------------------------------------------- the authors' Lloyd


@numba.njit(inline="always")
def _count_below(mids, v):
    """``np.searchsorted(mids, v, side="left")`` by binary search."""
    lo = 0
    hi = mids.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if mids[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(cache=True)
def lloyd_authors(x, init, max_iter, tol):
    """Lloyd on every point (FedShift's code): empty clusters are set to 0; stops when
    ``(sum_j |c_j - c_j_prev|)**2 < tol`` or after ``max_iter`` iterations.

    ``init``: float64 initial centroids (random points of ``x``, with replacement).
    Returns (sorted float64 centroids, iterations).
    """
    k = init.size
    c = np.sort(init)
    sums = np.zeros(k, dtype=np.float64)
    cnts = np.zeros(k, dtype=np.int64)
    mids = np.empty(k - 1, dtype=np.float64)
    it = 0
    while it < max_iter:
        it += 1
        for j in range(k - 1):
            mids[j] = 0.5 * (c[j] + c[j + 1])
        sums[:] = 0.0
        cnts[:] = 0
        for i in range(x.size):
            v = np.float64(x[i])
            j = _count_below(mids, v)
            sums[j] += v
            cnts[j] += 1
        shift = 0.0
        for j in range(k):
            nc = sums[j] / cnts[j] if cnts[j] > 0 else 0.0
            shift += abs(nc - c[j])
            c[j] = nc
        c = np.sort(c)
        if shift * shift < tol:
            break
    return c, it


# --------------------------------------------------------------------------- assignment


@numba.njit(cache=True)
def midpoints(codebook):
    """float64 midpoints of a sorted float32 codebook (``-0.0`` made ``+0.0``)."""
    k = codebook.size
    mids = np.empty(k - 1, dtype=np.float64)
    for j in range(k - 1):
        mids[j] = 0.5 * (np.float64(codebook[j]) + np.float64(codebook[j + 1])) + 0.0
    return mids


@numba.njit(cache=True)
def assign_pack(x, codebook, mu, a_floor, shift, nm, bits, out):
    """Nearest codeword index of every element of ``x`` (ties to the lower), packed into ``out``.

    ``codebook``: sorted float32, ``2**bits`` entries. Equal to
    ``np.searchsorted(midpoints(codebook), x, side="left")`` element for element.
    """
    mids = midpoints(codebook)
    km = mids.size
    nb = 2 * nm - 1
    scratch = np.empty(1, dtype=np.float32)
    scratch_u = scratch.view(np.uint32)
    # first[b]: how many midpoints lie in bins < b (all of them are < any x in bin b)
    first = np.empty(nb, dtype=np.int32)
    p = 0
    bm = np.empty(km, dtype=np.int64)
    for j in range(km):
        bm[j] = _bucket(mids[j], mu, a_floor, shift, nm, scratch, scratch_u)
    for b in range(nb):
        while p < km and bm[p] < b:
            p += 1
        first[b] = p
    q = np.empty(_CHUNK, dtype=np.uint16)
    n = x.size
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        for i in range(m):
            v = np.float64(x[start + i])
            j = first[_bucket(v, mu, a_floor, shift, nm, scratch, scratch_u)]
            while j < km and mids[j] < v:
                j += 1
            q[i] = j
        _pack_into(q, m, bits, out, (start * bits) >> 3)


@numba.njit(cache=True)
def assign_pack_bsearch(x, codebook, bits, out):
    """Same result as :func:`assign_pack`, by binary search (the reference fast kernel)."""
    mids = midpoints(codebook)
    q = np.empty(_CHUNK, dtype=np.uint16)
    n = x.size
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        for i in range(m):
            q[i] = _count_below(mids, np.float64(x[start + i]))
        _pack_into(q, m, bits, out, (start * bits) >> 3)


@numba.njit(cache=True)
def lookup_decode(data, n, bits, codebook, out):
    """``out[i] = codebook[index i of the stream]``; returns the first bad index or -1
    (an index >= codebook.size, impossible when the codebook has ``2**bits`` entries)."""
    q = np.empty(_CHUNK, dtype=np.uint16)
    k = codebook.size
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        _unpack_into(data, start, m, bits, q)
        for i in range(m):
            j = q[i]
            if j >= k:
                return start + i
            out[start + i] = codebook[j]
    return -1
