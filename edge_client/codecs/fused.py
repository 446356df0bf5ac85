"""Fused decode kernels for the server side: unpack + lookup in one pass, written into a
caller's buffer (``decode(t, out=...)``) or added into a running sum
(``decode_accumulate(t, acc, weight)``: ``acc += weight * decode(t)`` with no temporary).

Every codec with at most 8 bits per element decodes through a table ``lut`` of its
``2**bits`` float32 values (the asym levels, the K-means or DANUQ codebook): a lookup per
element, 8-bit streams read a byte at a time, 4-bit streams two elements per byte, other
widths through the generic unpacker. The kernels release the GIL, so the coordinator's
committer thread checksums and writes the inbox while the loop decodes.

Rounding, checked bit for bit by the tests: a table codec's accumulate is numpy's
``acc += w * y.astype(acc.dtype)`` (one multiply and one add, each rounded to ``acc``'s
dtype, no FMA); ASYM and ``int`` accumulate their affine form ``acc + (a0 + q * a1)``,
which vectorizes and is exact for ``int`` (docs/algorithms.md §3 gives the bound for ASYM).
"""

from __future__ import annotations

import numba
import numpy as np

from edge_client.codecs.base import CHUNK
from edge_client.codecs.bitpack import _unpack_into


@numba.njit(cache=True, nogil=True)
def lut_decode(data, n, bits, lut, out):
    """``out[i] = lut[index i of the stream]`` for ``n`` elements of ``bits`` (1..8) bits.

    ``data``: the uint8 payload (length already checked); ``lut``: ``2**bits`` values of
    ``out``'s dtype (float32 or float64); ``out``: 1-D, at least ``n`` long.
    """
    if bits == 8:
        for i in range(n):
            out[i] = lut[data[i]]
    elif bits == 4:
        half = n >> 1
        for i in range(half):
            b = data[i]
            out[2 * i] = lut[b & 15]
            out[2 * i + 1] = lut[b >> 4]
        if n & 1:
            out[n - 1] = lut[data[half] & 15]
    else:
        q = np.empty(CHUNK, dtype=np.uint16)
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            _unpack_into(data, start, m, bits, q)
            for i in range(m):
                out[start + i] = lut[q[i]]


@numba.njit(cache=True, nogil=True)
def pair_decode(data, half, pair, out64):
    """4 bits: ``out64[i] = pair[data[i]]``, both float32 of a byte in one 8-byte store."""
    for i in range(half):
        out64[i] = pair[data[i]]


def pair_table(lut: np.ndarray) -> np.ndarray:
    """uint64 table over bytes: low half the float32 bits of ``lut[b & 15]`` (element
    ``2i``, first in little-endian memory), high half those of ``lut[b >> 4]``."""
    u = lut.view(np.uint32).astype(np.uint64)
    b = np.arange(256)
    return u[b & 15] | (u[b >> 4] << np.uint64(32))


def decode_lut(data: np.ndarray, n: int, bits: int, lut: np.ndarray, out: np.ndarray) -> None:
    """:func:`lut_decode` into the float32 ``out``; at 4 bits into an 8-byte aligned ``out``
    through :func:`pair_table` (one 8-byte store per payload byte instead of two 4-byte ones;
    docs/performance.md#codecs-and-the-coordinators-update-path)."""
    if bits == 4 and n >= 64 and out.ctypes.data % 8 == 0:
        half = n >> 1
        pair_decode(data, half, pair_table(lut), out[: 2 * half].view(np.uint64))
        if n & 1:
            out[n - 1] = lut[data[half] & 15]
    else:
        lut_decode(data, n, bits, lut, out)


@numba.njit(cache=True, nogil=True)
def lut_accumulate(data, n, bits, wlut, acc):
    """``acc[i] += wlut[index i]`` (``wlut = w * lut`` in ``acc``'s dtype), bits 1..8."""
    if bits == 8:
        for i in range(n):
            acc[i] += wlut[data[i]]
    elif bits == 4:
        half = n >> 1
        for i in range(half):
            b = data[i]
            acc[2 * i] += wlut[b & 15]
            acc[2 * i + 1] += wlut[b >> 4]
        if n & 1:
            acc[n - 1] += wlut[data[half] & 15]
    else:
        q = np.empty(CHUNK, dtype=np.uint16)
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            _unpack_into(data, start, m, bits, q)
            for i in range(m):
                acc[start + i] += wlut[q[i]]


@numba.njit(cache=True, nogil=True)
def affine_accumulate(data, n, bits, a0, a1, acc):
    """ASYM's fused accumulate: ``acc[i] = acc[i] + (a0 + q_i * a1)`` with ``a0 = w * lo``
    and ``a1 = w * step`` scalars of ``acc``'s dtype (each operation rounded to it), q_i
    the ``bits``-bit index, any width, any float ``acc``. (:func:`affine_accumulate_f32`
    is the fast path of a float32 ``acc``.)"""
    q = np.empty(CHUNK, dtype=np.uint16)
    qf = np.empty(CHUNK, dtype=acc.dtype)  # the index in acc's dtype (exact)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _unpack_into(data, start, m, bits, q)
        for i in range(m):
            qf[i] = q[i]
        for i in range(m):
            acc[start + i] += a0 + qf[i] * a1


@numba.njit(cache=True, nogil=True)
def affine_accumulate_f32(data, n, bits, a0, a1, acc):
    """:func:`affine_accumulate` for a float32 ``acc`` (``a0``, ``a1`` float32); 8- and
    4-bit streams without a table lookup, so they vectorize. The indices are converted with
    ``np.float32`` explicitly: numba widens integer arithmetic to int64, and int64 * float32
    would be float64."""
    if bits == 8:
        for i in range(n):
            acc[i] += a0 + np.float32(data[i]) * a1
    elif bits == 4:
        half = n >> 1
        for i in range(half):
            b = data[i]
            acc[2 * i] += a0 + np.float32(b & 15) * a1
            acc[2 * i + 1] += a0 + np.float32(b >> 4) * a1
        if n & 1:
            acc[n - 1] += a0 + np.float32(data[half] & 15) * a1
    else:
        affine_accumulate(data, n, bits, a0, a1, acc)


@numba.njit(cache=True, nogil=True)
def affine4_accumulate_f32(d0, d1, d2, d3, n, bits, a0, a1, acc):
    """Four ASYM streams of the same ``bits`` (4 or 8) and length ``n`` in one pass over a
    float32 ``acc``: ``acc[i] + (c + ((q0·s0 + q1·s1) + (q2·s2 + q3·s3)))`` with
    ``c = ((a0[0] + a0[1]) + a0[2]) + a0[3]``, ``s_k = a1[k]`` (float32 [4] each; see
    :func:`affine_accumulate_f32`), every operation rounded to float32: one read and write of
    ``acc`` per four updates instead of per update."""
    c = ((a0[0] + a0[1]) + a0[2]) + a0[3]
    s0, s1, s2, s3 = a1[0], a1[1], a1[2], a1[3]
    if bits == 8:
        for i in range(n):
            acc[i] += c + ((np.float32(d0[i]) * s0 + np.float32(d1[i]) * s1)
                           + (np.float32(d2[i]) * s2 + np.float32(d3[i]) * s3))
        return
    half = n >> 1
    for i in range(half):
        b0, b1, b2, b3 = d0[i], d1[i], d2[i], d3[i]
        acc[2 * i] += c + ((np.float32(b0 & 15) * s0 + np.float32(b1 & 15) * s1)
                           + (np.float32(b2 & 15) * s2 + np.float32(b3 & 15) * s3))
        acc[2 * i + 1] += c + ((np.float32(b0 >> 4) * s0 + np.float32(b1 >> 4) * s1)
                               + (np.float32(b2 >> 4) * s2 + np.float32(b3 >> 4) * s3))
    if n & 1:
        b0, b1, b2, b3 = d0[half], d1[half], d2[half], d3[half]
        acc[n - 1] += c + ((np.float32(b0 & 15) * s0 + np.float32(b1 & 15) * s1)
                           + (np.float32(b2 & 15) * s2 + np.float32(b3 & 15) * s3))


@numba.njit(cache=True, nogil=True)
def float_accumulate(vals, w, acc):
    """``acc[i] += w * vals[i]`` for float32 ``vals`` (already checked finite)."""
    for i in range(vals.size):
        acc[i] += w * vals[i]


@numba.njit(cache=True, nogil=True)
def abs_bits_max(bits, mask):
    """Largest ``bits[i] & mask`` of a 1-D unsigned array (int64): with the sign bit masked
    off, the bit pattern of the float of largest magnitude (float32: ``uint32`` and
    ``0x7FFFFFFF``; float16: ``uint16`` and ``0x7FFF``)."""
    m = 0
    for i in range(bits.size):
        v = bits[i] & mask
        if v > m:
            m = v
    return m


@numba.njit(cache=True, nogil=True)
def half_bad(bits16):
    """How many of the float16 bit patterns are NaN/Inf (exponent all ones)."""
    bad = 0
    for i in range(bits16.size):
        if (bits16[i] & 0x7C00) == 0x7C00:
            bad += 1
    return bad


@numba.njit(cache=True, nogil=True)
def half_decode(bits16, lut, out):
    """``out[i] = float32(float16 with bit pattern bits16[i])`` through the 65536-entry table."""
    for i in range(bits16.size):
        out[i] = lut[bits16[i]]


@numba.njit(cache=True, nogil=True)
def half_accumulate(bits16, w, lut, acc):
    """``acc[i] += w * float32(float16 bits16[i])`` (``w``: scalar of ``acc``'s dtype)."""
    for i in range(bits16.size):
        acc[i] += w * lut[bits16[i]]


def _half_to_float_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, float32 ``[65536]`` (exact: float16 ->
    float32 never rounds). The NaN patterns are built from their bits (sign, all-ones
    exponent, the payload shifted up 13, as numpy converts them) and never cast: on aarch64
    the hardware cast of a signalling NaN raises the invalid flag, and numpy would print
    ``RuntimeWarning: invalid value encountered in cast`` when the codecs are imported."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    nan = (bits & 0x7C00) == 0x7C00
    nan &= (bits & 0x03FF) != 0
    table = np.empty(1 << 16, dtype=np.float32)
    table[~nan] = bits[~nan].astype(np.uint16).view(np.float16).astype(np.float32)
    table.view(np.uint32)[nan] = ((bits[nan] & 0x8000) << 16) | 0x7F800000 | ((bits[nan] & 0x03FF) << 13)
    return table


#: float32 value of every float16 bit pattern (:func:`_half_to_float_table`).
HALF_TO_FLOAT = _half_to_float_table()


def weighted_lut(lut: np.ndarray, acc: np.ndarray, weight: float) -> np.ndarray:
    """``acc.dtype.type(weight) * lut.astype(acc.dtype)``: the per-entry products that
    :func:`lut_accumulate` adds (rounded as numpy would round them per element)."""
    w = acc.dtype.type(weight)
    return w * lut.astype(acc.dtype)
