"""Tensors whose decoded values are affine in their packed indices, ``lo + q * step``
(ASYM; the ``int`` codec's integers), added into a running sum without a table:
:class:`AffineAccumulator` one at a time, :func:`accumulate_affine4` three or four per
pass over the sum (the rounding is in :mod:`edge_client.codecs.fused`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from edge_client.codecs.fused import (
    affine4_accumulate_f32,
    affine_accumulate,
    affine_accumulate_f32,
)
from edge_client.codecs.tensor import EncodedTensor
from edge_client.compat import zip_strict


@dataclass(frozen=True, eq=False)
class AffineAccumulator:
    """A checked tensor whose decoded values are ``lo + q * step`` (``q``: its ``bits``-bit
    indices), ready to be added into a sum: ASYM, and the ``int`` codec's integers
    (``lo = -2**(bits-1)``, ``step = 1``).

    ``buf``: the packed indices (uint8); ``n`` elements; ``lo``, ``step`` float64;
    ``check_acc``: the codec's check of an accumulator and weight.
    """

    tensor: EncodedTensor
    check_acc: Callable[[EncodedTensor, np.ndarray, float], tuple[np.ndarray, Any]]
    buf: np.ndarray
    n: int
    bits: int
    lo: float
    step: float

    def coefficients(self, weight: float, dtype: np.dtype) -> tuple[np.floating, np.floating]:
        """``(T(w * lo), T(w * step))``, T = ``dtype``."""
        w = float(weight)
        return dtype.type(w * self.lo), dtype.type(w * self.step)

    def scaled(self, factor: float) -> AffineAccumulator:
        """The same tensor with values ``factor * (lo + q * step)`` (e.g. an integer
        device's ``q / 2**(s-1)``: exact for a power-of-two ``factor``)."""
        return replace(self, lo=self.lo * factor, step=self.step * factor)

    def __call__(self, acc: np.ndarray, weight: float) -> None:
        flat, _ = self.check_acc(self.tensor, acc, weight)
        if self.n:
            a0, a1 = self.coefficients(weight, flat.dtype)
            kernel = affine_accumulate_f32 if flat.dtype == np.float32 else affine_accumulate
            kernel(self.buf, self.n, self.bits, a0, a1, flat)


#: bit widths that :func:`accumulate_affine4` takes four at a time
FUSED4_BITS = (4, 8)


def accumulate_affine4(adders: list[AffineAccumulator], acc: np.ndarray, weights: list[float]) -> None:
    """``acc += Σ_k w_k · decode(t_k)`` for 3 or 4 affine tensors of one width in
    :data:`FUSED4_BITS` in one pass over the float32 ``acc``
    (:func:`~edge_client.codecs.fused.affine4_accumulate_f32`; a missing fourth adds 0)."""
    k = len(adders)
    if not 3 <= k <= 4 or len({a.bits for a in adders}) != 1 or adders[0].bits not in FUSED4_BITS:
        raise ValueError("accumulate_affine4: 3 or 4 adders of one width in (4, 8)")
    flats = [a.check_acc(a.tensor, acc, w)[0] for a, w in zip_strict(adders, weights)]
    flat = flats[0]
    if flat.dtype != np.float32:
        raise ValueError("accumulate_affine4: float32 accumulators only")
    if not adders[0].n:
        return
    a0 = np.zeros(4, np.float32)
    a1 = np.zeros(4, np.float32)
    for i, (a, w) in enumerate(zip_strict(adders, weights)):
        a0[i], a1[i] = a.coefficients(w, flat.dtype)
    data = [a.buf for a in adders] + [adders[0].buf] * (4 - k)  # the padding's a0 = a1 = 0
    affine4_accumulate_f32(*data, adders[0].n, adders[0].bits, a0, a1, flat)
