"""Pack and unpack b-bit unsigned integers (b in 1..16) into a byte stream.

Bit order (little-endian, the wire format of every codec):

- element ``i`` occupies stream bits ``[i*b, (i+1)*b)``, its least significant bit first;
- stream bit ``j`` is bit ``j % 8`` (value ``1 << (j % 8)``) of byte ``j // 8``;
- the stream is exactly ``ceil(n*b/8)`` bytes; the unused high bits of the last byte are 0
  (``unpack`` rejects a payload whose padding bits are set: one payload, one encoding).

So with b = 8 the bytes are the values, with b = 16 they are little-endian ``uint16``, and
with b = 4 element 0 is the low nibble of byte 0.

The ``_pack_into``/``_unpack_into`` helpers are inlined into the codecs' fused kernels,
which quantize (or dequantize) a chunk that stays in L1 and pack (or unpack) it in the same
call: one pass over the tensor, no index array of its size.
"""

from __future__ import annotations

import numba
import numpy as np

from edge_client.errors import CodecError, ProtocolError

MIN_BITS = 1
MAX_BITS = 16

__all__ = ["MAX_BITS", "MIN_BITS", "pack", "packed_nbytes", "unpack"]


def packed_nbytes(n: int, bits: int) -> int:
    """Exact payload length in bytes of ``n`` elements of ``bits`` bits: ``ceil(n*bits/8)``."""
    return (n * bits + 7) // 8


def check_bits(bits: object, lo: int = MIN_BITS, hi: int = MAX_BITS, who: str = "bitpack") -> int:
    """Return ``bits`` as an int, or raise :class:`CodecError` when it is not an int in [lo, hi]."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise CodecError(f"{who}: bits must be an int in {lo}..{hi}, got {bits!r}")
    b = int(bits)
    if not lo <= b <= hi:
        raise CodecError(f"{who}: bits must be in {lo}..{hi}, got {b}")
    return b


# --------------------------------------------------------------------------- kernels


@numba.njit(inline="always")
def _pack_into(q, m, bits, out, off):
    """Pack ``q[0:m]`` into ``out`` from byte ``off`` on; values must already fit in ``bits``.

    Whole groups of 8 elements fill exactly ``bits`` bytes (independent 128-bit words, no
    loop-carried state); a final partial group is zero-padded. A caller that packs a long
    stream in chunks passes chunk lengths that are multiples of 8, except for the last one.
    """
    ng = m // 8
    if bits <= 8:
        for g in range(ng):
            acc = np.uint64(0)
            for k in range(8):
                acc |= np.uint64(q[g * 8 + k]) << np.uint64(k * bits)
            base = off + g * bits
            for k in range(bits):
                out[base + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))
        ng_wide = 0
    else:
        ng_wide = ng
    for g in range(ng_wide):
        lo = np.uint64(0)
        hi = np.uint64(0)
        for k in range(8):
            v = np.uint64(q[g * 8 + k])
            o = k * bits
            if o < 64:
                lo |= v << np.uint64(o)
                if o + bits > 64:
                    hi |= v >> np.uint64(64 - o)
            else:
                hi |= v << np.uint64(o - 64)
        base = off + g * bits
        for k in range(bits):
            if k < 8:
                out[base + k] = np.uint8((lo >> np.uint64(8 * k)) & np.uint64(0xFF))
            else:
                out[base + k] = np.uint8((hi >> np.uint64(8 * (k - 8))) & np.uint64(0xFF))
    rest = m - ng * 8
    if rest:
        lo = np.uint64(0)
        hi = np.uint64(0)
        for k in range(rest):
            v = np.uint64(q[ng * 8 + k])
            o = k * bits
            if o < 64:
                lo |= v << np.uint64(o)
                if o + bits > 64:
                    hi |= v >> np.uint64(64 - o)
            else:
                hi |= v << np.uint64(o - 64)
        base = off + ng * bits
        for k in range((rest * bits + 7) // 8):
            if k < 8:
                out[base + k] = np.uint8((lo >> np.uint64(8 * k)) & np.uint64(0xFF))
            else:
                out[base + k] = np.uint8((hi >> np.uint64(8 * (k - 8))) & np.uint64(0xFF))


@numba.njit(inline="always")
def _unpack_into(data, start, m, bits, out):
    """Unpack elements ``[start, start+m)`` (``start % 8 == 0``) into ``out[0:m]``."""
    mask = np.uint64((1 << bits) - 1)
    nb = data.size
    g0 = start // 8
    ng = (m + 7) // 8
    for g in range(ng):
        base = (g0 + g) * bits
        nbytes = bits
        if base + nbytes > nb:
            nbytes = nb - base
        lo = np.uint64(0)
        hi = np.uint64(0)
        for k in range(nbytes):
            if k < 8:
                lo |= np.uint64(data[base + k]) << np.uint64(8 * k)
            else:
                hi |= np.uint64(data[base + k]) << np.uint64(8 * (k - 8))
        cnt = m - g * 8
        if cnt > 8:
            cnt = 8
        for k in range(cnt):
            o = k * bits
            if o < 64:
                v = lo >> np.uint64(o)
                if o + bits > 64:
                    v |= hi << np.uint64(64 - o)
            else:
                v = hi >> np.uint64(o - 64)
            out[g * 8 + k] = v & mask


@numba.njit(cache=True)
def _pack_kernel(vals, bits, out):
    """Pack ``vals`` into ``out``; return -1, or the index of the first value out of range."""
    maxv = (1 << bits) - 1
    for i in range(vals.size):
        v = np.int64(vals[i])
        if v < 0 or v > maxv:
            return i
    _pack_into(vals, vals.size, bits, out, 0)
    return -1


@numba.njit(cache=True)
def _unpack_kernel(data, n, bits, out):
    _unpack_into(data, 0, n, bits, out)


@numba.njit(cache=True)
def _check_range(vals, maxv):
    """Index of the first value outside [0, maxv], or -1."""
    for i in range(vals.size):
        v = np.int64(vals[i])
        if v < 0 or v > maxv:
            return i
    return -1


# --------------------------------------------------------------------------- public API


def pack(indices: np.ndarray, bits: int) -> bytes:
    """Pack unsigned integers into ``ceil(n*bits/8)`` bytes (little-endian bit order).

    ``indices``: an integer array of any shape (flattened in C order), every value in
    ``[0, 2**bits)``; ``bits``: 1..16. Raises :class:`CodecError` on a non-integer dtype, a
    value out of range (naming its flat index) or ``bits`` out of range.
    """
    b = check_bits(bits)
    if not isinstance(indices, np.ndarray):
        raise CodecError(f"bitpack: indices must be a numpy array, got {type(indices).__name__}")
    if indices.dtype.kind not in "ui" or indices.dtype == np.bool_:
        raise CodecError(f"bitpack: indices must have an integer dtype, got {indices.dtype}")
    vals = np.ravel(indices)  # a view when C-contiguous
    n = vals.size
    nbytes = packed_nbytes(n, b)
    if b == 8 and vals.dtype == np.uint8:
        return vals.tobytes()
    if b in (8, 16):
        bad = _check_range(vals, (1 << b) - 1) if n else -1
        if bad >= 0:
            raise CodecError(f"bitpack: value {vals[bad]} at index {bad} does not fit in {b} bits")
        return vals.astype("<u1" if b == 8 else "<u2", copy=False).tobytes()
    out = np.empty(nbytes, dtype=np.uint8)
    bad = _pack_kernel(vals, b, out) if n else -1
    if bad >= 0:
        raise CodecError(f"bitpack: value {vals[bad]} at index {bad} does not fit in {b} bits")
    return out.tobytes()


def as_byte_array(data: bytes | bytearray | memoryview, n: int, bits: int, field: str = "data") -> np.ndarray:
    """``data`` as a read-only uint8 array, after checking its exact length (ProtocolError)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{field}: expected bytes, got {type(data).__name__}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ProtocolError(f"{field}: element count must be a non-negative int, got {n!r}")
    buf = np.frombuffer(data, dtype=np.uint8)
    want = packed_nbytes(int(n), bits)
    if buf.size != want:
        raise ProtocolError(
            f"{field}: {buf.size} bytes for {n} elements of {bits} bits, expected exactly {want}"
        )
    used = (int(n) * bits) & 7
    if used and buf[-1] >> used:
        raise ProtocolError(f"{field}: padding bits of the last byte are not zero")
    return buf


def unpack(data: bytes | bytearray | memoryview, n: int, bits: int) -> np.ndarray:
    """Unpack ``n`` elements of ``bits`` bits (see the module doc for the bit order).

    Returns a new writable 1-D array: ``uint8`` for bits <= 8, ``uint16`` for bits <= 16.
    Raises :class:`ProtocolError` when ``len(data) != ceil(n*bits/8)`` or padding bits are
    set, :class:`CodecError` when ``bits`` is out of 1..16.
    """
    b = check_bits(bits)
    buf = as_byte_array(data, n, b)
    n = int(n)
    if b == 8:
        return buf.copy()
    if b == 16:
        return buf.view("<u2").astype(np.uint16)
    out = np.empty(n, dtype=np.uint8 if b <= 8 else np.uint16)
    if n:
        _unpack_kernel(buf, n, b, out)
    return out
