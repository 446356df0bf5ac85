"""float32 passthrough (bits 32): little-endian IEEE floats, lossless, no aux."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.codecs.base import Codec, count_nonfinite
from edge_client.errors import ProtocolError
from edge_client.protocol import EncodedTensor


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

    def _check_wire(self, a: np.ndarray, wire: np.ndarray) -> None:
        """Hook: raise when the wire representation lost range (float16 overflow)."""

    def decode(self, t: EncodedTensor) -> np.ndarray:
        n, buf = self._check_encoded(t, ("float32",))
        self._aux_keys(t, ())
        vals = buf.view(self.wire_dtype)
        bad = _count_bad(vals)
        if bad:
            raise ProtocolError(f"data: {bad} non-finite (NaN/Inf) value(s) in a {self.name} tensor")
        return vals.astype(np.float32).reshape(t.shape)
