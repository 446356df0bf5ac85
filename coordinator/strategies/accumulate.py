"""Streaming running sums, one set per compute bitwidth.

Memory is O(model size x distinct bitwidths), whatever the number of updates. The sums
are float32 by default (float64 on request). Each bitwidth group holds up to ``batch``
updates (default 4) by reference and folds them in the order of their ``key`` (the device
id), not of arrival, forming their sum in float64 before one rounding: a group of at most
``batch`` updates sums to the same bits whatever order they arrived in, and a round of N
updates rounds about N/4 times (relative error ~N/4 · 6e-8). Callers must not mutate an
update's arrays after handing them over.

Encoded updates (:meth:`GroupSums.add_encoded`: per layer an ``add(acc, ω)`` that decodes
a checked wire tensor into the sum) are held the same way (their payload bytes) and folded
in the same key order with ``edge_client.codecs.accumulate_many``: ``acc += ω·decode(t)``
per element, no decoded copy, ASYM / int 4- or 8-bit tensors four per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.strategies.kernels import add1, add2, add3, add4


@dataclass
class GroupSums:
    """Per bitwidth ``b``: ``sums[b][l] = Σ_k ω_k x_k[l]`` (flattened, ``acc_dtype``),
    ``total[b] = Σ_k ω_k``, ``count[b]`` updates, and ``delta_weight[b]`` = the part of
    ``total[b]`` that came from delta updates (their base is added at :meth:`flush_base`).
    """

    shapes: list[tuple[int, ...]]
    acc_dtype: type = np.float32
    batch: int = 4
    sums: dict[int, list[np.ndarray]] = field(default_factory=dict)
    total: dict[int, float] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    delta_weight: dict[int, float] = field(default_factory=dict)
    _pending: dict[int, list[tuple[str, Sequence[Any], float, bool]]] = field(default_factory=dict)

    def add(self, bits: int, flat_layers: list[np.ndarray], omega: float, is_delta: bool,
            key: str = "") -> None:
        """Add one validated update (1-D contiguous float32 layers) with weight ``omega``;
        ``key`` orders the held updates when they are folded in."""
        self._hold(bits, flat_layers, omega, is_delta, key, encoded=False)

    def add_encoded(self, bits: int, adders: Sequence[Callable[[np.ndarray, float], None]],
                    omega: float, is_delta: bool, key: str = "") -> None:
        """Add one update given, per layer, the ``add(acc, w)`` of its checked wire tensor
        (``edge_client.codecs.accumulator``: ``acc += w * decode(t)``, ``acc`` of the
        layer's shape; it must not fail), with weight ``omega``."""
        self._hold(bits, adders, omega, is_delta, key, encoded=True)

    def _group(self, bits: int) -> None:
        if bits not in self.sums:
            self.sums[bits] = [np.zeros(int(np.prod(s)), dtype=self.acc_dtype) for s in self.shapes]
            self.total[bits] = 0.0
            self.count[bits] = 0
            self.delta_weight[bits] = 0.0

    def _hold(self, bits: int, layers: Sequence[Any], omega: float, is_delta: bool, key: str,
              *, encoded: bool) -> None:
        self._group(bits)
        self.total[bits] += omega
        self.count[bits] += 1
        if is_delta:
            self.delta_weight[bits] += omega
        held = self._pending.setdefault(bits, [])
        held.append((key, layers, omega, encoded))
        if len(held) >= self.batch:
            self._fold(bits)

    def add_base(self, bits: int, omega: float) -> None:
        """Add the round's model (the base of delta updates) to group ``bits`` with weight
        ``omega`` (an update's bounded part: ``coordinator.defense.guard``; negative for a
        movement scaled beyond 1, a buffer's ``server_lr`` > 1); the group must have an
        update already."""
        if omega:
            self.total[bits] += omega
            self.delta_weight[bits] += omega

    def add_sum(self, bits: int, sums: list[np.ndarray], total: float, count: int, is_delta: bool) -> None:
        """Add a group already summed elsewhere (secure aggregation's, a private sum):
        ``sums[l] = Σ ω_k x_k[l]`` (flat), ``total = Σ ω_k`` over ``count`` updates."""
        self._group(bits)
        self.count[bits] += int(count)
        self.total[bits] += float(total)
        if is_delta:
            self.delta_weight[bits] += float(total)
        for a, s in zip(self.sums[bits], sums, strict=True):
            a += np.asarray(s, dtype=a.dtype).reshape(-1)

    def add_group(self, bits: int, sums: list[np.ndarray], total: float, count: int, delta_weight: float) -> None:
        """Add group ``bits`` of another instance (:meth:`groups`: an ingest worker's
        part of the round): its flattened sums, ``Σ ω``, its count and the delta part of
        ``Σ ω``. Exact where the sums are (integer devices' grid values: see
        docs/architecture.md#ingest-workers)."""
        self._group(bits)
        self.count[bits] += int(count)
        self.total[bits] += float(total)
        self.delta_weight[bits] += float(delta_weight)
        for a, s in zip(self.sums[bits], sums, strict=True):
            a += np.asarray(s, dtype=a.dtype).reshape(-1)

    def groups(self) -> dict[int, tuple[list[np.ndarray], float, int, float]]:
        """Every group, held updates folded in first: ``bits -> (sums, Σ ω, count, delta
        part of Σ ω)``, for another instance's :meth:`add_group`."""
        self.flush()
        return {b: (self.sums[b], self.total[b], self.count[b], self.delta_weight[b]) for b in self.bits}

    def flush(self) -> None:
        """Fold every group's held updates into its sums."""
        for bits in sorted(self._pending):
            self._fold(bits)

    def _fold(self, bits: int) -> None:
        """Fold group ``bits``'s held updates in key order: runs of decoded ones up to
        four per pass over the accumulator, runs of encoded ones through the codecs'
        ``accumulate_many`` (ASYM / int 4- or 8-bit: up to four per pass too)."""
        held = sorted(self._pending.pop(bits, []), key=lambda p: p[0])
        acc = self.sums[bits]
        i = 0
        while i < len(held):
            encoded = held[i][3]
            j = i
            while j < len(held) and held[j][3] == encoded:
                j += 1
            run = [(layers, w) for _, layers, w, _ in held[i:j]]
            (self._add_encoded if encoded else self._add_decoded)(acc, run)
            i = j

    def _add_encoded(self, acc: list[np.ndarray], items: list[tuple[Sequence[Any], float]]) -> None:
        from edge_client.codecs import accumulate_many

        weights = [w for _, w in items]
        for li, (a, shape) in enumerate(zip(acc, self.shapes, strict=True)):
            accumulate_many([adders[li] for adders, _ in items], a.reshape(shape), weights)

    @staticmethod
    def _add_decoded(acc: list[np.ndarray], items: list[tuple[Sequence[Any], float]]) -> None:
        for i in range(0, len(items), 4):
            chunk = items[i:i + 4]
            xs, ws = [x for x, _ in chunk], [w for _, w in chunk]
            for li, a in enumerate(acc):
                if len(chunk) == 4:
                    add4(a, xs[0][li], xs[1][li], xs[2][li], xs[3][li], *ws)
                elif len(chunk) == 3:
                    add3(a, xs[0][li], xs[1][li], xs[2][li], *ws)
                elif len(chunk) == 2:
                    add2(a, xs[0][li], xs[1][li], *ws)
                else:
                    add1(a, xs[0][li], ws[0])

    def flush_base(self, bases: dict[int, list[np.ndarray]]) -> None:
        """Turn delta sums into weight sums: ``sums[b] += delta_weight[b] * base[b]``.
        Call once, after the last :meth:`add`."""
        self.flush()
        for bits, dw in self.delta_weight.items():
            if dw:
                for a, base in zip(self.sums[bits], bases[bits], strict=True):
                    add1(a, np.ascontiguousarray(base, dtype=np.float32).reshape(-1), dw)
            self.delta_weight[bits] = 0.0

    @property
    def bits(self) -> list[int]:
        """Bitwidths seen this round, ascending."""
        return sorted(self.sums)

    def combined(self, bits: list[int]) -> tuple[list[np.ndarray] | None, float]:
        """Σ of the sums over ``bits`` (a new float64 list; None when no update) and Σ ω."""
        present = [b for b in bits if b in self.sums]
        if not present:
            return None, 0.0
        out = [a.astype(np.float64, copy=True) for a in self.sums[present[0]]]
        for b in present[1:]:
            for o, a in zip(out, self.sums[b], strict=True):
                o += a
        return out, float(sum(self.total[b] for b in present))
