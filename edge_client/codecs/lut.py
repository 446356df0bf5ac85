"""Codecs whose payload is ``bits``-bit indices into a float32 table of ``2**bits`` values
(K-means codebooks, DANUQ levels): decoding is a table lookup, shared here."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import numpy as np

from edge_client.codecs.base import Codec
from edge_client.codecs.fused import decode_lut, lut_accumulate, weighted_lut
from edge_client.codecs.tensor import EncodedTensor
from edge_client.errors import ProtocolError


class TableCodec(Codec):
    """A :class:`Codec` that decodes ``table[index]``; subclasses say how a received
    tensor's table is validated and built (:meth:`_checked`)."""

    accumulates = True
    finite_output = True  # tables with a NaN/Inf entry are rejected (:meth:`_table`)

    @abstractmethod
    def _checked(self, t: EncodedTensor) -> tuple[int, np.ndarray, np.ndarray]:
        """Validate ``t``: (element count, packed uint8 payload, float32 table)."""

    def _table(self, t: EncodedTensor) -> tuple[int, np.ndarray, np.ndarray]:
        """:meth:`_checked` plus: every table entry finite (a huge ``sigma_g`` or codebook
        entry can overflow float32), so decoded values are always finite."""
        n, buf, table = self._checked(t)
        if not np.isfinite(table).all():
            raise ProtocolError(f"aux: codec {self.name!r} table has a non-finite entry (overflow)",
                                reason="nonfinite")
        return n, buf, table

    def max_abs(self, t: EncodedTensor) -> float:
        """From the header: the largest ``|entry|`` of the table (no pass over the data)."""
        n, _, table = self._table(t)
        return float(np.max(np.abs(table))) if n and table.size else 0.0

    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        """``table[index]`` per element, into ``out`` when given."""
        n, buf, table = self._table(t)
        flat = self._out(t, n, out)
        if n:
            decode_lut(buf, n, int(t.bits), table, flat)
        return flat.reshape(t.shape) if out is None else out

    def accumulator(self, t: EncodedTensor) -> Callable[[np.ndarray, float], None]:
        """``add(acc, weight)``: ``acc += weight * decode(t)`` (see :meth:`Codec.accumulator`)."""
        n, buf, table = self._table(t)
        b = int(t.bits)

        def add(acc: np.ndarray, weight: float) -> None:
            flat, _ = self._acc(t, acc, weight)
            if n:
                lut_accumulate(buf, n, b, weighted_lut(table, flat, weight), flat)

        return add
