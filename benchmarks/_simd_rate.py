"""Micro-benchmarks of this CPU's integer SIMD rate as Numba compiles it (the arithmetic
bound of ``benchmarks/layer_profile.py``). Every loop runs on L1-resident data:

- ``ternary_add``: eight int8 rows added into an int16 accumulator per pass (the inner
  loop of the conv forward and backward-data: a multiply by a ternary weight is an add);
- ``int8_dot``: int8 x int8 products summed in int32, one dot product (LLVM emits
  ``vpmaddwd`` / ``vpdpwssd`` for it), and two rows x four outputs per pass (the conv and
  linear gradients' form);
- ``vnni_dot``: where the CPU has AVX-512 VNNI (``edge_client.intnn.kernels.VNNI``), two
  rows x four rows of int8 dot products through ``vpdpbusd`` (the engine's
  ``kernels.vnni._dot_block``, as its conv and linear kernels use it): 64
  multiply-accumulates an instruction, the fastest int8 arithmetic of such a CPU;
- ``update``: one SplitMix64 draw, a compare and a clip per weight (the stochastic
  update's work per weight).

Rates are per second of the calling thread's CPU time, best of ``repeats``.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from edge_client.intnn.kernels import VNNI
from edge_client.intnn.kernels.vnni import _dot_block

ROW = 1024  # positions per row (int8: 8 rows + the int16 accumulator stay in L1)


@njit(cache=True, nogil=True)
def _ternary_add(acc, rows, reps):
    m = acc.shape[0]
    for _ in range(reps):
        r0 = rows[0]
        r1 = rows[1]
        r2 = rows[2]
        r3 = rows[3]
        r4 = rows[4]
        r5 = rows[5]
        r6 = rows[6]
        r7 = rows[7]
        for j in range(m):
            acc[j] = acc[j] + (((np.int16(r0[j]) + np.int16(r1[j])) + (np.int16(r2[j]) + np.int16(r3[j])))
                               + ((np.int16(r4[j]) + np.int16(r5[j])) + (np.int16(r6[j]) + np.int16(r7[j]))))
    return acc[0]


@njit(cache=True, nogil=True)
def _int8_dot(a, b, reps):
    tot = np.int32(0)
    for _ in range(reps):
        s = np.int32(0)
        for i in range(a.shape[0]):
            s = np.int32(s + np.int32(a[i]) * np.int32(b[i]))
        tot = np.int32(tot + s)
    return tot


@njit(cache=True, nogil=True)
def _int8_dots_2x4(x, e, reps):
    tot = np.int32(0)
    n = x.shape[1]
    for _ in range(reps):
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.int32(0)
        for p in range(n):
            u = np.int32(x[0, p])
            v = np.int32(x[1, p])
            e0 = np.int32(e[0, p])
            e1 = np.int32(e[1, p])
            e2 = np.int32(e[2, p])
            e3 = np.int32(e[3, p])
            a0 = np.int32(a0 + u * e0)
            a1 = np.int32(a1 + u * e1)
            a2 = np.int32(a2 + u * e2)
            a3 = np.int32(a3 + u * e3)
            b0 = np.int32(b0 + v * e0)
            b1 = np.int32(b1 + v * e1)
            b2 = np.int32(b2 + v * e2)
            b3 = np.int32(b3 + v * e3)
        tot = np.int32(tot + a0 + a1 + a2 + a3 + b0 + b1 + b2 + b3)
    return tot


@njit(cache=True, nogil=True)
def _vnni_dots_2x4(x, e, reps):
    tot = np.int32(0)
    n = x.shape[0] // 2
    for _ in range(reps):
        s = _dot_block(x, (0, n), e, (0, n, 2 * n, 3 * n), n // 64)
        tot = np.int32(tot + s[0] + s[7])
    return tot


_GOLDEN = np.int64(0x9E3779B97F4A7C15 - (1 << 64))
_MIX1 = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))
_MIX2 = np.int64(0x94D049BB133111EB - (1 << 64))


@njit(cache=True, nogil=True)
def _update(w, g, reps):
    for r in range(reps):
        z0 = np.int64(r) * _GOLDEN
        for j in range(w.shape[0]):
            z0 += _GOLDEN
            z = z0
            z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * _MIX1
            z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * _MIX2
            z = z ^ ((z >> 31) & 0x1FFFFFFFF)
            gv = np.int64(g[j])
            av = -gv if gv < 0 else gv
            fl = (av >> 6) + np.int64(((z >> 2) & 0x3F) < (av & 0x3F))
            v = np.int64(w[j]) - (-fl if gv < 0 else fl)
            v = 64 if v > 64 else v
            w[j] = -64 if v < -64 else v
    return w[0]


def _best_rate(fn, args, work: float, reps: int, repeats: int) -> float:
    fn(*args, 1)  # compile / load
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn(*args, reps)
        best = min(best, time.thread_time() - t0)
    return work * reps / max(best, 1e-9)


def measure(repeats: int = 5, scale: float = 1.0) -> dict[str, float]:
    """Rates of the primitives (operations per second): ``ternary_add``, ``int8_dot`` and
    (with VNNI) ``vnni_dot`` in multiply-accumulates (an add by a ternary weight counts as
    one), ``update`` in weights; ``int8_mac`` is the best of the MAC rates."""
    rng = np.random.default_rng(0)
    rows = rng.integers(-127, 128, (8, ROW)).astype(np.int8)
    acc = np.zeros(ROW, np.int16)
    a = rng.integers(-127, 128, 2048).astype(np.int8)
    b = rng.integers(-127, 128, 2048).astype(np.int8)
    x = rng.integers(-127, 128, (2, 2048)).astype(np.int8)
    e = rng.integers(-127, 128, (4, 2048)).astype(np.int8)
    w = rng.integers(-64, 65, 4096).astype(np.int8)
    g = rng.integers(-(1 << 12), 1 << 12, 4096).astype(np.int32)
    n = max(1, int(2000 * scale))
    out = {
        "ternary_add": _best_rate(_ternary_add, (acc, rows), 8 * ROW, n, repeats),
        "int8_dot": max(_best_rate(_int8_dot, (a, b), a.size, 10 * n, repeats),
                        _best_rate(_int8_dots_2x4, (x, e), 8 * x.shape[1], n, repeats)),
        "update": _best_rate(_update, (w, g), w.size, n, repeats),
    }
    if VNNI:
        xv = rng.integers(-128, 128, 2 * 2048).astype(np.int8)
        ev = rng.integers(-128, 128, 4 * 2048).astype(np.int8)
        # 4x the repeats: 512-bit VNNI throughput on a shared host varies more than the
        # other loops' (288-427 G/s best-of-25 over runs here); the peak is the bound
        out["vnni_dot"] = _best_rate(_vnni_dots_2x4, (xv, ev), 8 * 2048, n, 4 * repeats)
    out["int8_mac"] = max(out["ternary_add"], out["int8_dot"], out.get("vnni_dot", 0.0))
    return out
