"""ASYM: range-based asymmetric uniform quantization (FedShift eq. 3-4), bits 1..16.

``q = rint((x - min) / (max - min) * (2**b - 1))`` (half to even, float64 arithmetic as
``(x - min) * ((2**b - 1) / (max - min))``), decoded as ``float32(min + q * (max - min) /
(2**b - 1))``; aux ``{"min": float, "max": float}`` (the float32 extremes). A constant
tensor (``max == min``) encodes every element as 0 and decodes exactly. Error bound:
``|x - x_hat| <= (max - min) / (2**b - 1) / 2`` plus float32 rounding of the output.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from edge_client.codecs.affine import AffineAccumulator
from edge_client.codecs.base import CHUNK, Codec
from edge_client.codecs.bitpack import _pack_into, _unpack_into, packed_nbytes
from edge_client.codecs.fused import decode_lut
from edge_client.codecs.tensor import EncodedTensor
from edge_client.errors import CodecError, ProtocolError


@numba.njit(cache=True)
def asym_encode_kernel(x, bits, out):
    """One call: min/max (+ count of NaN/Inf) pass, then quantize + pack chunk by chunk.

    Returns (min, max, non-finite count); ``out`` is untouched when the count is > 0.
    """
    n = x.size
    lo = np.inf
    hi = -np.inf
    bad = 0
    for i in range(n):
        v = x[i]
        if not np.isfinite(v):
            bad += 1
        else:
            if v < lo:
                lo = v
            if v > hi:
                hi = v
    if bad or n == 0:
        return 0.0, 0.0, bad
    flo = np.float64(lo)
    fhi = np.float64(hi)
    levels = (1 << bits) - 1
    scale = levels / (fhi - flo) if fhi > flo else 0.0
    top = np.float64(levels)
    q = np.empty(CHUNK, dtype=np.uint16)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        for i in range(m):
            r = np.rint((np.float64(x[start + i]) - flo) * scale)
            if r > top:
                r = top
            q[i] = np.uint16(r)
        _pack_into(q, m, bits, out, (start * bits) >> 3)
    return flo, fhi, 0


@numba.njit(cache=True)
def asym_decode_kernel(data, n, bits, lo, hi, out):
    levels = (1 << bits) - 1
    step = (hi - lo) / levels
    q = np.empty(CHUNK, dtype=np.uint16)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _unpack_into(data, start, m, bits, q)
        for i in range(m):
            out[start + i] = np.float32(lo + q[i] * step)


class AsymCodec(Codec):
    name = "asym"
    bits_range = (1, 16)
    default_bits = 8
    lossy = True
    accumulates = True

    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        """``x``: float32 array of any shape. aux ``{"min", "max"}`` (0.0, 0.0 when empty)."""
        b = self._bits(bits)
        self._options(options)
        a = self._array(x, ("float32",))
        flat = a.reshape(-1)
        out = np.empty(packed_nbytes(flat.size, b), dtype=np.uint8)
        lo, hi, bad = asym_encode_kernel(flat, b, out)
        if bad:
            raise CodecError(f"codec {self.name!r}: input has {bad} non-finite (NaN/Inf) value(s)")
        return self._tensor(a, b, out.tobytes(), {"min": float(lo), "max": float(hi)}, name)

    def _checked(self, t: EncodedTensor) -> tuple[int, np.ndarray, float, float]:
        n, buf = self._check_encoded(t, ("float32",))
        self._aux_keys(t, ("min", "max"))
        lo = self._aux_float(t, "min")
        hi = self._aux_float(t, "max")
        if hi < lo:
            raise ProtocolError(f"aux.max: {hi!r} is below aux.min {lo!r}")
        return n, buf, lo, hi

    def max_abs(self, t: EncodedTensor) -> float:
        """From the header: every level lies in ``[min, max]`` (no pass over the data)."""
        n, _, lo, hi = self._checked(t)
        return max(abs(lo), abs(hi)) if n else 0.0

    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Levels ``float32(lo + q * step)``; bits <= 8 through a ``2**bits`` table."""
        n, buf, lo, hi = self._checked(t)
        flat = self._out(t, n, out)
        if n:
            b = int(t.bits)
            if b <= 8:
                decode_lut(buf, n, b, asym_levels(b, lo, hi), flat)
            else:
                asym_decode_kernel(buf, n, b, lo, hi, flat)
        return flat.reshape(t.shape) if out is None else out

    def accumulator(self, t: EncodedTensor) -> AffineAccumulator:
        """``add(acc, weight)``: ``acc += weight * decode(t)`` in ASYM's affine form
        ``acc[i] + (T(w·lo) + q_i · T(w·step))`` (T: ``acc``'s dtype; see
        :mod:`edge_client.codecs.fused`), so it may differ from ``acc + w * decode(t)`` in
        the last bits (see :meth:`Codec.accumulator`). Several of them can share one pass
        over the accumulator (:func:`edge_client.codecs.accumulate_many`)."""
        n, buf, lo, hi = self._checked(t)
        b = int(t.bits)
        return AffineAccumulator(t, self._acc, buf, n, b, lo, (hi - lo) / ((1 << b) - 1))


def asym_levels(bits: int, lo: float, hi: float) -> np.ndarray:
    """The ``2**bits`` float32 decoded values ``float32(lo + q * (hi - lo) / (2**bits - 1))``
    (the same float64 arithmetic as :func:`asym_decode_kernel`)."""
    levels = (1 << bits) - 1
    step = (hi - lo) / levels
    return (lo + np.arange(levels + 1, dtype=np.float64) * step).astype(np.float32)
