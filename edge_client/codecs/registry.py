"""Codecs by name: :data:`CODECS`, the one codec table, built once from the codec classes
(each says its name, bits range, lossiness, options, whether it accumulates...) and never
mutated. The wire (:mod:`edge_client.protocol`), the hardware profiles, the announced
hyper-parameters and the coordinator read it; nothing else lists codecs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from edge_client.codecs.affine import FUSED4_BITS, AffineAccumulator, accumulate_affine4
from edge_client.codecs.asym import AsymCodec
from edge_client.codecs.base import Codec
from edge_client.codecs.danuq import DanuqCodec
from edge_client.codecs.float16 import Float16Codec
from edge_client.codecs.float32 import Float32Codec
from edge_client.codecs.integer import IntCodec
from edge_client.codecs.kmeans import KMeansCodec
from edge_client.codecs.tensor import EncodedTensor
from edge_client.codecs.ternary import TernaryCodec
from edge_client.compat import zip_strict
from edge_client.errors import CodecError, ProtocolError

#: name -> the codec (a shared, stateless instance), in a fixed order
CODECS: MappingProxyType[str, Codec] = MappingProxyType(
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
    return tuple(sorted(CODECS))


def get_codec(name: str) -> Codec:
    """The codec called ``name``; :class:`CodecError` listing the valid names otherwise."""
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}") from None


def encode(x: np.ndarray, codec: str = "float32", bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
    """``get_codec(codec).encode(x, bits, name=name, **options)``."""
    return get_codec(codec).encode(x, bits, name=name, **options)


def _codec_of(t: EncodedTensor) -> Codec:
    codec = getattr(t, "codec", None)
    if not isinstance(codec, str) or codec not in CODECS:
        raise ProtocolError(f"codec: unknown codec {codec!r}; available: {', '.join(available_codecs())}")
    return CODECS[codec]


def decode(t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a received tensor with the codec it names (:class:`ProtocolError` when unknown).

    ``out``: optional preallocated array of shape ``t.shape`` and dtype ``t.dtype``
    (C-contiguous, writable; :class:`CodecError` otherwise) decoded into and returned, so
    a server can reuse one buffer per layer.
    """
    return _codec_of(t).decode(t, out)


def max_abs(t: EncodedTensor) -> float:
    """An upper bound of ``|v|`` over ``decode(t)`` (see :meth:`Codec.max_abs`): from the
    header where the codec's table or affine code allows, else one pass."""
    return _codec_of(t).max_abs(t)


def decode_accumulate(t: EncodedTensor, acc: np.ndarray, weight: float) -> None:
    """``acc += weight * decode(t)`` fused, no temporary (float32/float64 ``acc`` of shape
    ``t.shape``), for the codecs that :attr:`~Codec.accumulates`. Rounding: see
    :meth:`Codec.decode_accumulate`."""
    _codec_of(t).decode_accumulate(t, acc, weight)


def accumulator(t: EncodedTensor) -> Callable[[np.ndarray, float], None]:
    """Validate ``t`` (:class:`ProtocolError` naming the field) and return ``add(acc, w)``
    doing ``acc += w * decode(t)`` fused, without checking ``t`` again
    (:meth:`Codec.accumulator`); :class:`CodecError` for codecs that cannot."""
    return _codec_of(t).accumulator(t)


def accumulate_many(adders: Sequence[Callable[[np.ndarray, float], None]], acc: np.ndarray,
                    weights: Sequence[float]) -> None:
    """``acc += Σ_k weights[k] · decode(t_k)`` for adders made by :func:`accumulator`.
    With a float32 ``acc``, affine tensors (ASYM, ``int``) of 4 or 8 bits go three or four
    at a time through one pass over ``acc``
    (:func:`~edge_client.codecs.affine.accumulate_affine4`), the others one at a time
    after them, in order; so the sum rounds differently from one at a time (within float32
    rounding), and the same way for the same adders in the same order."""
    if len(adders) != len(weights):
        raise ValueError(f"accumulate_many: {len(adders)} adders, {len(weights)} weights")
    if acc.dtype == np.float32:
        by_bits: dict[int, list[int]] = {}
        for i, a in enumerate(adders):
            if isinstance(a, AffineAccumulator) and a.bits in FUSED4_BITS:
                by_bits.setdefault(a.bits, []).append(i)
        fused: set[int] = set()
        for idx in by_bits.values():
            for s in range(0, len(idx) - 2, 4):
                chunk = idx[s:s + 4]
                if len(chunk) >= 3 and len({adders[i].n for i in chunk}) == 1:  # type: ignore[attr-defined]
                    accumulate_affine4([adders[i] for i in chunk], acc,  # type: ignore[misc]
                                       [weights[i] for i in chunk])
                    fused.update(chunk)
        for i, a in enumerate(adders):
            if i not in fused:
                a(acc, weights[i])
        return
    for a, w in zip_strict(adders, weights):
        a(acc, w)


def can_accumulate(t: EncodedTensor) -> bool:
    """Whether :func:`decode_accumulate` supports ``t``'s codec (its
    :attr:`~Codec.accumulates`; False for unknown codecs)."""
    name = getattr(t, "codec", None)
    codec = CODECS.get(name) if isinstance(name, str) else None
    return bool(codec is not None and codec.accumulates)
