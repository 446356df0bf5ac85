"""Codecs by name. The table is built once from the codec classes and never mutated."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np

from edge_client.codecs.asym import AsymCodec
from edge_client.codecs.base import Codec
from edge_client.codecs.danuq import DanuqCodec
from edge_client.codecs.float16 import Float16Codec
from edge_client.codecs.float32 import Float32Codec
from edge_client.codecs.integer import IntCodec
from edge_client.codecs.kmeans import KMeansCodec
from edge_client.codecs.ternary import TernaryCodec
from edge_client.errors import CodecError, ProtocolError
from edge_client.protocol import EncodedTensor

_CODECS: MappingProxyType[str, Codec] = MappingProxyType(
    {
        c.name: c
        for c in (
            Float32Codec(),
            Float16Codec(),
            AsymCodec(),
            KMeansCodec(),
            TernaryCodec(),
            IntCodec(),
            DanuqCodec(),
        )
    }
)


def available_codecs() -> tuple[str, ...]:
    """Registered codec names, sorted."""
    return tuple(sorted(_CODECS))


def get_codec(name: str) -> Codec:
    """The codec called ``name``; :class:`CodecError` listing the valid names otherwise."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}") from None


def encode(x: np.ndarray, codec: str = "float32", bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
    """``get_codec(codec).encode(x, bits, name=name, **options)``."""
    return get_codec(codec).encode(x, bits, name=name, **options)


def _codec_of(t: EncodedTensor) -> Codec:
    codec = getattr(t, "codec", None)
    if not isinstance(codec, str) or codec not in _CODECS:
        raise ProtocolError(f"codec: unknown codec {codec!r}; available: {', '.join(available_codecs())}")
    return _CODECS[codec]


def decode(t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a received tensor with the codec it names (:class:`ProtocolError` when unknown).

    ``out``: optional preallocated array of shape ``t.shape`` and dtype ``t.dtype``
    (C-contiguous, writable; :class:`CodecError` otherwise) decoded into and returned, so
    a server can reuse one buffer per layer.
    """
    return _codec_of(t).decode(t, out)


def decode_accumulate(t: EncodedTensor, acc: np.ndarray, weight: float) -> None:
    """``acc += weight * decode(t)`` fused, no temporary (float32/float64 ``acc`` of shape
    ``t.shape``); codecs asym, kmeans, danuq, float32, float16. Rounding: see
    :meth:`Codec.decode_accumulate`."""
    _codec_of(t).decode_accumulate(t, acc, weight)
