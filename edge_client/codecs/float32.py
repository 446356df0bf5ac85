"""float32 passthrough (bits 32): little-endian IEEE floats, lossless, no aux."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edge_client.codecs.base import Codec, count_nonfinite
from edge_client.codecs.fused import (
    HALF_TO_FLOAT,
    abs_bits_max,
    float_accumulate,
    half_accumulate,
    half_bad,
    half_decode,
)
from edge_client.codecs.tensor import EncodedTensor, float32_tensor
from edge_client.codecs.uplink import DeviceUpdate
from edge_client.compat import zip_strict
from edge_client.errors import ProtocolError


def _count_bad(vals: np.ndarray) -> int:
    """NaN/Inf count of a 1-D float array (numba for aligned float32, numpy otherwise)."""
    if vals.size == 0:
        return 0
    if vals.dtype == np.float32 and vals.flags.aligned:
        return int(count_nonfinite(vals))
    return int(vals.size - np.count_nonzero(np.isfinite(vals)))


class Float32Codec(Codec):
    name = "float32"
    bits_range = (32, 32)
    default_bits = 32
    lossy = False
    finite_output = True
    accumulates = True
    wire_dtype = "<f4"

    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        """``x``: float32 array (NaN/Inf rejected). Payload: ``x.size * bits/8`` bytes."""
        b = self._bits(bits)
        self._options(options)
        a = self._array(x, ("float32",))
        self._finite(a)
        with np.errstate(over="ignore"):  # float16 overflow is reported by _check_wire
            wire = a.astype(self.wire_dtype, copy=False)
        self._check_wire(a, wire)
        return self._tensor(a, b, wire.tobytes(), {}, name)

    def encode_update(self, u: DeviceUpdate, bits: int) -> tuple[EncodedTensor, ...]:
        """The shared layers as they are, not checked here: a device does not hold back a
        result that went non-finite; the coordinator's wire check rejects and counts it."""
        return tuple(float32_tensor(w, n) for w, n in zip_strict(u.shared, u.names))

    def _check_wire(self, a: np.ndarray, wire: np.ndarray) -> None:
        """Hook: raise when the wire representation lost range (float16 overflow)."""

    def _wire(self, t: EncodedTensor) -> tuple[int, np.ndarray]:
        """Element count and the checked wire values (float32, or float16 bit patterns)."""
        n, buf = self._check_encoded(t, ("float32",))
        self._aux_keys(t, ())
        if self.wire_dtype == "<f2":
            vals = buf.view("<u2")
            bad = half_bad(vals) if vals.size else 0
        else:
            vals = buf.view(self.wire_dtype)
            bad = _count_bad(vals)
        if bad:
            raise ProtocolError(f"data: {bad} non-finite (NaN/Inf) value(s) in a {self.name} tensor",
                                reason="nonfinite")
        return n, vals

    def max_abs(self, t: EncodedTensor) -> float:
        """Exact, by one pass over the wire values' bit patterns with the sign masked off
        (for IEEE floats their order is the order of ``|v|``; NaN and Inf patterns lie
        above every finite one, so they are found too: :class:`ProtocolError`)."""
        n, buf = self._check_encoded(t, ("float32",))
        self._aux_keys(t, ())
        if not n:
            return 0.0
        fdt, udt, mask, inf = ((np.float16, np.uint16, 0x7FFF, 0x7C00) if self.wire_dtype == "<f2"
                               else (np.float32, np.uint32, 0x7FFFFFFF, 0x7F800000))
        bits = buf.view(np.dtype(udt).newbyteorder("<"))
        m = int(abs_bits_max(bits, mask) if bits.flags.aligned else np.max(bits & udt(mask)))
        if m >= inf:
            bad = int(np.count_nonzero((bits & udt(mask)) >= inf))
            raise ProtocolError(f"data: {bad} non-finite (NaN/Inf) value(s) in a {self.name} tensor",
                                reason="nonfinite")
        return float(np.array(m, udt).view(fdt))

    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        n, vals = self._wire(t)
        flat = self._out(t, n, out)
        if n:
            if self.wire_dtype == "<f2":
                half_decode(vals, HALF_TO_FLOAT, flat)
            else:
                flat[:] = vals
        return flat.reshape(t.shape) if out is None else out

    def accumulator(self, t: EncodedTensor) -> Callable[[np.ndarray, float], None]:
        """``add(acc, weight)``: ``acc += weight * decode(t)`` (see :meth:`Codec.accumulator`)."""
        n, vals = self._wire(t)

        def add(acc: np.ndarray, weight: float) -> None:
            flat, w = self._acc(t, acc, weight)
            if not n:
                return
            if self.wire_dtype == "<f2":
                half_accumulate(vals, w, HALF_TO_FLOAT, flat)
            elif vals.flags.aligned:
                float_accumulate(vals, w, flat)
            else:  # a payload at an odd address: numpy, in chunks of at most 64 Ki elements
                for s in range(0, n, 1 << 16):
                    part = flat[s : s + (1 << 16)]
                    part += w * vals[s : s + (1 << 16)].astype(flat.dtype)

        return add
