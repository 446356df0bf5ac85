"""The wire format (DESIGN.md, "Wire protocol"): message dataclasses, msgpack, validation.

(Work in progress: the tensor type comes first; messages follow in the same module.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EncodedTensor:
    """One layer as it travels: ``len(data) == ceil(prod(shape) * bits / 8)`` exactly.

    - ``shape``: the decoded array's shape;
    - ``dtype``: the decoded array's dtype name (``"float32"``, ``"int8"``, ``"int16"``...);
    - ``codec``: a registered codec name (``"float32"``, ``"float16"``, ``"asym"``,
      ``"kmeans"``, ``"ternary"``, ``"int"``, ``"danuq"``);
    - ``bits``: bits per element in ``data`` (32 for float32, 16 for float16);
    - ``data``: the packed payload, little-endian bit order (see ``codecs.bitpack``);
    - ``aux``: codec side information, msgpack-able scalars, lists of floats, or bytes
      (``{"min": .., "max": ..}`` for asym, ``{"codebook": [..]}`` for kmeans...).
    """

    shape: tuple[int, ...]
    dtype: str
    codec: str
    bits: int
    data: bytes
    aux: dict[str, Any] = field(default_factory=dict)
    name: str = ""
