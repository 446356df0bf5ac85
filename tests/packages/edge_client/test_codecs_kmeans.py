"""K-means (fast and authors') and DANUQ: exact assignment against numpy, quality against
ASYM and scikit-learn, Lloyd-Max levels against the published constants."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.codecs import decode, encode
from edge_client.codecs import kmeans1d as k1
from edge_client.codecs.base import scan_float
from edge_client.codecs.kmeans import fit_codebook
from edge_client.codecs.lloydmax import normal_levels


def mse(x: np.ndarray, codec: str, bits: int, **opt) -> float:
    return float(np.mean((decode(encode(x, codec, bits, **opt)).astype(np.float64) - x) ** 2))


def gaussian(n=20_000, seed=0):
    return np.random.default_rng(seed).normal(0, 0.05, n).astype(np.float32)


def heavy(n=20_000, seed=0):
    rng = np.random.default_rng(seed)
    tail = rng.random(n) < 0.05
    return np.where(tail, rng.standard_t(2, n) * 0.2, rng.normal(0.01, 0.05, n)).astype(np.float32)


def reference_indices(x: np.ndarray, cb: np.ndarray) -> np.ndarray:
    mids = (cb[:-1].astype(np.float64) + cb[1:].astype(np.float64)) / 2
    return np.searchsorted(mids, x.astype(np.float64).ravel(), side="left")


@pytest.mark.parametrize("make", [gaussian, heavy])
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_fast_assignment_is_exact_nearest(make, bits):
    x = make(5000, seed=bits)
    x[:4] = [0.0, -0.0, x.max(), x.min()]
    cb = fit_codebook(x, bits)
    lo, hi, mu, _ = scan_float(x)
    a_floor, shift, nm = k1.grid(lo, hi, mu)
    out = np.empty((x.size * bits + 7) // 8, np.uint8)
    k1.assign_pack(x, cb, mu, a_floor, shift, nm, bits, out)
    out2 = np.empty_like(out)
    k1.assign_pack_bsearch(x, cb, bits, out2)
    from edge_client.codecs.bitpack import pack

    ref = pack(reference_indices(x, cb), bits)
    assert out.tobytes() == ref == out2.tobytes()
    # and the codebook shipped is what the midpoints used
    t = encode(x, "kmeans", bits)
    assert np.array_equal(np.array(t.aux["codebook"], np.float32), cb)
    assert np.array_equal(decode(t), cb[reference_indices(x, cb)])


def test_assignment_with_duplicate_codewords_and_ties():
    x = np.array([0.0, 0.5, 1.0, 0.25, 0.75, 1.0, 0.0], np.float32)
    cb = np.array([0.0, 0.0, 0.5, 1.0], np.float32)
    lo, hi, mu, _ = scan_float(x)
    out = np.empty(2, np.uint8)
    k1.assign_pack(x, cb, mu, *k1.grid(lo, hi, mu), 2, out)
    from edge_client.codecs.bitpack import unpack

    assert unpack(out.tobytes(), x.size, 2).tolist() == reference_indices(x, cb).tolist() == [0, 2, 3, 1, 2, 3, 0]


@pytest.mark.parametrize("make", [gaussian, heavy])
@pytest.mark.parametrize("bits", range(1, 9))
def test_kmeans_never_worse_than_asym(make, bits):
    x = make(20_000, seed=bits)
    assert mse(x, "kmeans", bits) <= mse(x, "asym", bits)


def test_kmeans_on_trained_digits_weights():
    from edge_client.data import load_digits
    from edge_client.trainers import IntTrainer

    tr = IntTrainer("digits_cnn", 16, seed=0)
    tr.train(load_digits("train"), steps=30)
    for w in tr.to_shared():
        for bits in (2, 4, 6, 8):
            assert mse(w, "kmeans", bits) <= mse(w, "asym", bits)


@pytest.mark.parametrize("make", [gaussian, heavy])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_kmeans_matches_sklearn(make, bits):
    """Within 1% of scikit-learn's KMeans(n_init=1) (measured 0.86-0.98x on these 8 k
    points since the DP start; benchmarks/codecs.py has the full-size comparison)."""
    from sklearn.cluster import KMeans

    x = make(8000, seed=11)
    km = KMeans(2**bits, n_init=1, random_state=0).fit(x.reshape(-1, 1).astype(np.float64))
    sk = float(np.mean((km.cluster_centers_.ravel()[km.labels_] - x) ** 2))
    assert mse(x, "kmeans", bits) <= 1.01 * sk


def _prefix(v):
    return np.concatenate([[0], np.cumsum(v)])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_dp_partition_is_the_exhaustive_optimum(k):
    """dp_partition against every way of cutting 9 atoms (of 1-2 bins) into k runs."""
    from itertools import combinations

    rng = np.random.default_rng(k)
    counts = rng.integers(0, 4, 14).astype(np.int64)
    centres = np.cumsum(rng.exponential(1.0, 14))
    sums = counts * centres
    sqs = counts * (centres**2 + 0.01)
    cc, ss, qq = _prefix(counts), _prefix(sums), _prefix(sqs)
    ab = np.array([0, 1, 3, 4, 6, 8, 9, 11, 12, 14], np.int64)

    def sse(a, b):
        n = cc[b] - cc[a]
        return 0.0 if n == 0 else max((qq[b] - qq[a]) - (ss[b] - ss[a]) ** 2 / n, 0.0)

    best = min(
        sum(sse(ab[p[i]], ab[p[i + 1]]) for i in range(k))
        for inner in combinations(range(0, ab.size), k - 1)
        for p in [(0, *sorted(inner), ab.size - 1)]
    )
    cuts = np.empty(k + 1, np.int64)
    got = k1.dp_partition(cc, ss, qq, ab, k, cuts)
    assert got == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert cuts[0] == 0 and cuts[-1] == 14 and np.all(np.diff(cuts) >= 0) and set(cuts) <= set(ab)
    assert sum(sse(cuts[i], cuts[i + 1]) for i in range(k)) == pytest.approx(got, rel=1e-12, abs=1e-12)


def test_dp_start_beats_companding_start_on_heavy_tails():
    """The issue's case: 4 bits, 5% Student-t(2) tails; the DP start finds a better optimum."""
    x = heavy(200_000, seed=3)
    lo, hi, mu, _ = scan_float(x)
    g = k1.grid(lo, hi, mu)
    counts, sums, sqs = k1.histogram(x, mu, *g)
    edges = k1.bin_edges(lo, hi, mu, *g)

    def err(c):
        cb = np.sort(c.astype(np.float32))
        return float(np.mean((cb[reference_indices(x, cb)].astype(np.float64) - x) ** 2))

    old, _ = k1.lloyd_histogram(counts, sums, sqs, edges, 16, mu, *g, 100_000, 64, 0)
    new, _ = k1.lloyd_histogram(counts, sums, sqs, edges, 16, mu, *g, 100_000, 64, 2048)
    assert err(new) <= err(old)
    ab = k1.atoms(counts, edges, 2048)
    assert ab[0] == 0 and ab[-1] == counts.size and np.all(np.diff(ab) > 0) and ab.size - 1 <= 4096


def test_fast_kmeans_is_deterministic_and_handles_degenerate_inputs():
    x = heavy(3000)
    assert encode(x, "kmeans", 5) == encode(x, "kmeans", 5, seed=123)
    const = np.full(50, 0.3, np.float32)
    assert np.array_equal(decode(encode(const, "kmeans", 4)), const)
    few = np.array([1.0, -2.0, 1.0, 7.5], np.float32)  # fewer distinct values than codewords
    assert np.array_equal(decode(encode(few, "kmeans", 3)), few)
    tiny = np.array([1.0, 1.0 + 2**-20, 1.0 + 2**-19], np.float32)
    assert np.array_equal(decode(encode(tiny, "kmeans", 2)), tiny)


def test_authors_method_reproduces_their_lloyd():
    x = gaussian(4000)
    t = encode(x, "kmeans", 4, method="authors", seed=7)
    assert t == encode(x, "kmeans", 4, method="authors", seed=7)
    cb = np.array(t.aux["codebook"], np.float32)
    # plain numpy Lloyd with the same init and rules
    rng = np.random.default_rng(7)
    c = np.sort(x[rng.integers(0, x.size, 16)].astype(np.float64))
    for _ in range(300):
        lab = np.searchsorted((c[:-1] + c[1:]) / 2, x.astype(np.float64), side="left")
        cnt = np.bincount(lab, minlength=16)
        new = np.where(cnt > 0, np.bincount(lab, x.astype(np.float64), 16) / np.maximum(cnt, 1), 0.0)
        shift = np.abs(new - c).sum()
        c = np.sort(new)
        if shift**2 < 1e-4:
            break
    assert np.allclose(cb, c.astype(np.float32), rtol=0, atol=1e-7)
    assert mse(x, "kmeans", 4) <= mse(x, "kmeans", 4, method="authors", seed=7) * 1.001


def test_authors_empty_clusters_become_zero():
    x = np.array([5.0] * 10 + [6.0] * 10, np.float32)  # 4 centroids, only 2 distinct values
    cb = encode(x, "kmeans", 2, method="authors", seed=0, max_iter=5).aux["codebook"]
    assert 0.0 in cb and {5.0, 6.0} <= set(cb)


# ---------------------------------------------------------------- DANUQ


def test_lloyd_max_levels_match_published_constants():
    assert normal_levels(1, False) == pytest.approx([-0.7979, 0.7979], abs=1e-4)
    assert normal_levels(2, True) == pytest.approx([-1.224, 0.0, 0.7646, 1.7242], abs=2e-4)
    assert normal_levels(2, False) == pytest.approx([-1.510, -0.4528, 0.4528, 1.510], abs=1e-3)
    max16 = [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326]  # Max (1960)
    assert normal_levels(4, False) == pytest.approx([-v for v in max16[::-1]] + max16, abs=2e-4)
    assert np.sqrt(2 / np.pi) == pytest.approx(normal_levels(1, False)[1], abs=1e-12)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("zero", [False, True])
def test_lloyd_max_levels_are_fixed_points(bits, zero):
    from edge_client.codecs.lloydmax import _centroid

    lv = normal_levels(bits, zero)
    assert lv.size == 2**bits and np.all(np.diff(lv) > 0)
    if zero:
        assert 0.0 in lv and (lv < 0).sum() == 2 ** (bits - 1) - 1
    else:
        assert np.allclose(lv, -lv[::-1], atol=1e-12)
    b = np.r_[-np.inf, (lv[1:] + lv[:-1]) / 2, np.inf]
    for i, v in enumerate(lv):
        if not (zero and v == 0.0):
            assert v == pytest.approx(_centroid(b[i], b[i + 1]), abs=1e-12)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_danuq_round_trip(bits):
    x = np.random.default_rng(bits).normal(0.001, 0.02, 3001).astype(np.float32)
    t = encode(x, "danuq", bits, sigma_g=0.025)
    assert t.aux["sigma_loc"] == pytest.approx(float(x.astype(np.float64).std()), rel=1e-6)
    assert t.aux["sigma_g"] == pytest.approx(0.025) and t.aux["zero_level"] == int(bits >= 2)
    cb = (normal_levels(bits, bits >= 2) * t.aux["sigma_g"]).astype(np.float32)
    y = decode(t)
    assert np.array_equal(y, cb[reference_indices(x, cb)])
    # default sigma_g is sigma_loc; zero level decodes zeros exactly
    t2 = encode(x, "danuq", bits)
    assert t2.aux["sigma_g"] == t2.aux["sigma_loc"]
    z = np.zeros(7, np.float32)
    assert np.array_equal(decode(encode(z, "danuq", bits, zero_level=True)), z)
    assert np.array_equal(decode(encode(z, "danuq", bits)), z)


def test_danuq_error_drops_with_bits():
    x = np.random.default_rng(0).normal(0, 0.02, 20_000).astype(np.float32)
    errs = [mse(x, "danuq", b) for b in range(1, 9)]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    # the 2-bit zero-pinned quantizer's distortion on N(0, 1), by quadrature
    z = np.linspace(-9, 9, 400_001)
    lv = normal_levels(2, True)
    qz = lv[np.searchsorted((lv[1:] + lv[:-1]) / 2, z)]
    dist = np.sum((z - qz) ** 2 * np.exp(-z * z / 2)) * (z[1] - z[0]) / np.sqrt(2 * np.pi)
    assert errs[1] / x.var() == pytest.approx(dist, rel=0.05)
