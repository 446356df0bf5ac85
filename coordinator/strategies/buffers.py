"""Reusable per-layer float32 buffers for decoding received updates.

Decoding an update into fresh arrays allocates the model's size in float32 (8.6 MB for
``fedshift_cnn``) per update, and the kernel then pays the page faults of that fresh
memory. :class:`LayerBufferPool` hands out sets of preallocated arrays (one per layer) to
decode into, with ``codecs.decode(t, out=)``.

A strategy may keep the arrays of up to ``batch`` accepted updates (or views of them) per
bitwidth group until it folds them into its sums (``coordinator/strategies/base.py``), so
a set is handed out again only when nothing outside the pool references any of its
arrays: CPython's reference count of each array is back to what it was when the pool made
it (a numpy view keeps a reference to its base array, so views count too). Otherwise a
new set is made, up to ``max_sets`` pooled sets; past that, unpooled arrays.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np


class LayerBufferPool:
    """Sets of float32 arrays of ``shapes`` (one per layer), reused once unreferenced.

    Args:
        shapes: the layer shapes of the model.
        max_sets: most sets kept in the pool (each ``sum(prod(shapes)) * 4`` bytes).
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], *, max_sets: int = 16) -> None:
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.max_sets = int(max_sets)
        self._sets: list[list[np.ndarray]] = []
        self._baseline: int | None = None
        #: sets made (pooled or not), for tests and benchmarks
        self.allocated = 0

    def _new(self) -> list[np.ndarray]:
        self.allocated += 1
        return [np.empty(s, dtype=np.float32) for s in self.shapes]

    def _free(self, bufs: list[np.ndarray]) -> bool:
        # held by the set's list, the loop variable and getrefcount's argument only
        return all(sys.getrefcount(a) <= self._baseline for a in bufs)  # type: ignore[operator]

    def take(self) -> list[np.ndarray]:
        """A set of writable C-contiguous float32 arrays, one per layer (contents
        unspecified). The caller may hand them to anyone; the pool reuses a set only once
        every reference to its arrays is gone."""
        for bufs in self._sets:
            if self._free(bufs):
                return list(bufs)
        bufs = self._new()
        if len(self._sets) < self.max_sets:
            self._sets.append(bufs)
            if self._baseline is None:
                for a in bufs:  # the count of an array that only the pool holds
                    self._baseline = sys.getrefcount(a)
                    break
            return list(bufs)
        return bufs
