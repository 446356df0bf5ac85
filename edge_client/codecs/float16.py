"""float16 (bits 16): float32 rounded to IEEE half precision (nearest even), no aux.

Relative error <= 2**-11 for |x| >= 2**-14 (absolute <= 2**-25 below); values beyond
float16's range (|x| > 65504) are an encode error, not silently made infinite.
"""

from __future__ import annotations

import numpy as np

from edge_client.codecs.base import Codec
from edge_client.codecs.float32 import Float32Codec, _count_bad
from edge_client.errors import CodecError


class Float16Codec(Float32Codec):
    name = "float16"
    bits_range = (16, 16)
    default_bits = 16
    lossy = True
    wire_dtype = "<f2"
    encode_update = Codec.encode_update  # checked: float16 overflow is an error

    def _check_wire(self, a: np.ndarray, wire: np.ndarray) -> None:
        bad = _count_bad(wire.reshape(-1))
        if bad:
            raise CodecError(f"codec {self.name!r}: {bad} value(s) beyond the float16 range (|x| > 65504)")
