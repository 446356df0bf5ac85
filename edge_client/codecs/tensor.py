""":class:`EncodedTensor`, what every codec produces and the wire carries, with
:func:`packed_length`, its exact payload size, and :func:`float32_tensor`, the lossless
one (all three re-exported by :mod:`edge_client.protocol`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class EncodedTensor:
    """One layer as it travels: ``len(data) == ceil(prod(shape) * bits / 8)`` exactly.

    - ``shape``: the decoded array's shape;
    - ``dtype``: the decoded array's dtype name (``"float32"``, ``"int8"``, ``"int16"``...);
    - ``codec``: the name of a registered codec (``edge_client.codecs.available_codecs()``);
    - ``bits``: bits per element in ``data`` (32 for float32, 16 for float16);
    - ``data``: the packed payload, little-endian bit order (see ``codecs.bitpack``);
    - ``aux``: codec side information: finite floats, ints, strings, bytes, or lists of
      finite numbers (``{"min": .., "max": ..}`` for asym, ``{"codebook": [..]}`` ...);
    - ``name``: the layer name from the model spec (may be empty).
    """

    shape: tuple[int, ...]
    dtype: str
    codec: str
    bits: int
    data: bytes
    aux: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact payload length in bytes: ``ceil(size * bits / 8)``."""
        return packed_length(self.size, self.bits)


def float32_tensor(array: np.ndarray, name: str = "") -> EncodedTensor:
    """Lossless float32 tensor (the passthrough codec, used for models and tests)."""
    a = np.ascontiguousarray(array, dtype="<f4")
    return EncodedTensor(tuple(int(d) for d in a.shape), "float32", "float32", 32, a.tobytes(), {}, name)


def packed_length(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits occupy when bit-packed: ``ceil(n*bits/8)``."""
    return (n * bits + 7) // 8
