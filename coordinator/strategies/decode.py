"""The decode stage: wire tensors -> a :class:`ClientUpdate` in the shared float domain.

``edge_client.codecs`` is imported lazily (inside the function) so this module and the
other stages import without it. Integer tensors (a device's own s-bit weights, codec
``int``) are mapped to the shared domain ``W = q / 2^(s_g - 1)``, s_g = max(s, 8)
(ALGORITHMS.md §2). Every codec but ``float32`` is lossy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator.strategies.types import FLOAT_BITS, ClientUpdate
from edge_client.errors import ProtocolError
from edge_client.protocol import EncodedTensor

LOSSLESS_CODECS = frozenset({"float32"})


def integer_scale(compute_bits: int) -> float:
    """The storage grid step of an s-bit device: 1 / 2^(max(s, 8) - 1)."""
    return 1.0 / float(2 ** (max(compute_bits, 8) - 1))


def decode_tensors(tensors: Sequence[EncodedTensor], compute_bits: int = FLOAT_BITS) -> list[np.ndarray]:
    """Decode every layer with its codec; float32 arrays in the shared domain."""
    from edge_client.codecs import decode  # lazy: the codecs land separately

    out: list[np.ndarray] = []
    for i, t in enumerate(tensors):
        arr = np.asarray(decode(t))
        if arr.shape != tuple(t.shape):
            raise ProtocolError(f"tensors[{i}]: decoded shape {arr.shape} != {tuple(t.shape)}")
        if np.issubdtype(arr.dtype, np.integer):
            arr = arr.astype(np.float32) * np.float32(integer_scale(compute_bits))
        out.append(np.asarray(arr, dtype=np.float32))
    return out


def is_lossy(tensors: Sequence[EncodedTensor]) -> bool:
    """Whether any layer came through a lossy codec (every codec but ``float32``)."""
    return any(t.codec not in LOSSLESS_CODECS for t in tensors)


def sigma_loc_of(tensors: Sequence[EncodedTensor]) -> list[float] | None:
    """Per-layer ``aux["sigma_loc"]`` (DANUQ) when every layer carries one, else None;
    ProtocolError when one is not a number."""
    sig = [t.aux.get("sigma_loc") for t in tensors]
    if not sig or any(s is None for s in sig):
        return None
    if not all(isinstance(s, int | float) and not isinstance(s, bool) for s in sig):
        raise ProtocolError("aux.sigma_loc: expected a number in every tensor")
    return [float(s) for s in sig]


def decode_update(device_id: str, num_samples: int, tensors: Sequence[EncodedTensor], *,
                  kind: str = "weights", compute_bits: int = FLOAT_BITS) -> ClientUpdate:
    """Build a :class:`ClientUpdate` from wire tensors. ``lossy`` is set when any layer
    used a lossy codec; ``sigma_loc`` is read from each layer's ``aux["sigma_loc"]`` when
    every layer carries one (DANUQ)."""
    weights = decode_tensors(tensors, compute_bits)
    return ClientUpdate(device_id, num_samples, weights, kind, compute_bits, is_lossy(tensors),
                        sigma_loc_of(tensors))
