"""Fused decode kernels for the server side: unpack + lookup in one pass, written into a
caller's buffer (``decode(t, out=...)``) or added into a running sum
(``decode_accumulate(t, acc, weight)``: ``acc += weight * decode(t)`` with no temporary).

Every codec with at most 8 bits per element decodes through a table ``lut`` of its
``2**bits`` float32 values (the asym levels ``float32(lo + q * step)``, the K-means or DANUQ
codebook), so decoding is a lookup per element; 8-bit streams are read byte by byte and
4-bit streams a byte (two elements) at a time, other widths through the generic unpacker.

Accumulation rounding (what the tests check bit for bit): with ``w = acc.dtype.type(weight)``
every element does ``acc[i] = acc[i] + w * acc.dtype.type(y[i])`` where ``y = decode(t)``:
one multiply and one add, each rounded to the accumulator's dtype (no FMA, numba does not
contract without fastmath), i.e. numpy's ``acc += w * y.astype(acc.dtype)``. The products
``w * lut[q]`` are precomputed per table entry, which rounds identically.
"""

from __future__ import annotations

import numba
import numpy as np

from edge_client.codecs.base import CHUNK
from edge_client.codecs.bitpack import _unpack_into


@numba.njit(cache=True)
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


@numba.njit(cache=True)
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
    through :func:`pair_table` (one store per payload byte: ~0.43 vs ~0.59 ms on 2.1 M)."""
    if bits == 4 and n >= 64 and out.ctypes.data % 8 == 0:
        half = n >> 1
        pair_decode(data, half, pair_table(lut), out[: 2 * half].view(np.uint64))
        if n & 1:
            out[n - 1] = lut[data[half] & 15]
    else:
        lut_decode(data, n, bits, lut, out)


@numba.njit(cache=True)
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


@numba.njit(cache=True)
def affine_accumulate(data, n, bits, lo, step, w, acc):
    """ASYM with more than 8 bits: ``acc[i] += w * float32(lo + q_i * step)`` (``w``:
    a scalar of ``acc``'s dtype, so the product and sum round to it)."""
    q = np.empty(CHUNK, dtype=np.uint16)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _unpack_into(data, start, m, bits, q)
        for i in range(m):
            acc[start + i] += w * np.float32(lo + q[i] * step)


@numba.njit(cache=True)
def float_accumulate(vals, w, acc):
    """``acc[i] += w * vals[i]`` for float32 ``vals`` (already checked finite)."""
    for i in range(vals.size):
        acc[i] += w * vals[i]


@numba.njit(cache=True)
def half_bad(bits16):
    """How many of the float16 bit patterns are NaN/Inf (exponent all ones)."""
    bad = 0
    for i in range(bits16.size):
        if (bits16[i] & 0x7C00) == 0x7C00:
            bad += 1
    return bad


@numba.njit(cache=True)
def half_decode(bits16, lut, out):
    """``out[i] = float32(float16 with bit pattern bits16[i])`` through the 65536-entry table."""
    for i in range(bits16.size):
        out[i] = lut[bits16[i]]


@numba.njit(cache=True)
def half_accumulate(bits16, w, lut, acc):
    """``acc[i] += w * float32(float16 bits16[i])`` (``w``: scalar of ``acc``'s dtype)."""
    for i in range(bits16.size):
        acc[i] += w * lut[bits16[i]]


#: float32 value of every float16 bit pattern (exact: float16 -> float32 never rounds).
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def weighted_lut(lut: np.ndarray, acc: np.ndarray, weight: float) -> np.ndarray:
    """``acc.dtype.type(weight) * lut.astype(acc.dtype)``: the per-entry products that
    :func:`lut_accumulate` adds (rounded as numpy would round them per element)."""
    w = acc.dtype.type(weight)
    return w * lut.astype(acc.dtype)
