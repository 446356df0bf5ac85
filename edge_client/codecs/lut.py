"""Codecs whose payload is ``bits``-bit indices into a float32 table of ``2**bits`` values
(K-means codebooks, DANUQ levels): decoding is a table lookup, shared here."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from edge_client.codecs.base import Codec
from edge_client.codecs.fused import decode_lut, lut_accumulate, weighted_lut
from edge_client.protocol import EncodedTensor


class TableCodec(Codec):
    """A :class:`Codec` that decodes ``table[index]``; subclasses say how a received
    tensor's table is validated and built (:meth:`_checked`)."""

    @abstractmethod
    def _checked(self, t: EncodedTensor) -> tuple[int, np.ndarray, np.ndarray]:
        """Validate ``t``: (element count, packed uint8 payload, float32 table)."""

    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        """``table[index]`` per element, into ``out`` when given."""
        n, buf, table = self._checked(t)
        flat = self._out(t, n, out)
        if n:
            decode_lut(buf, n, int(t.bits), table, flat)
        return flat.reshape(t.shape) if out is None else out

    def decode_accumulate(self, t: EncodedTensor, acc: np.ndarray, weight: float) -> None:
        """``acc += weight * decode(t)`` (see :meth:`Codec.decode_accumulate`)."""
        n, buf, table = self._checked(t)
        flat, _ = self._acc(t, acc, weight)
        if n:
            lut_accumulate(buf, n, int(t.bits), weighted_lut(table, flat, weight), flat)
