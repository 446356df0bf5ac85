"""Streaming running sums, one set per compute bitwidth.

Memory is O(model size x distinct bitwidths), independent of the number of updates: the
sums are float32 by default (each flush forms its up-to-four-term sum in float64 and
rounds once, so a round of N updates rounds N/4 times: relative error ~N/4 * 6e-8) or
float64 on request; a few updates (``batch``, default 4) may be held by
reference until they are folded in together, which halves-to-quarters the accumulator
traffic. Callers must not mutate an update's arrays after handing them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.strategies.kernels import add1, add4


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
    _pending: list[tuple[int, list[np.ndarray], float]] = field(default_factory=list)

    def add(self, bits: int, flat_layers: list[np.ndarray], omega: float, is_delta: bool) -> None:
        """Add one validated update (1-D contiguous float32 layers) with weight ``omega``."""
        if bits not in self.sums:
            self.sums[bits] = [np.zeros(int(np.prod(s)), dtype=self.acc_dtype) for s in self.shapes]
            self.total[bits] = 0.0
            self.count[bits] = 0
            self.delta_weight[bits] = 0.0
        self.total[bits] += omega
        self.count[bits] += 1
        if is_delta:
            self.delta_weight[bits] += omega
        self._pending.append((bits, flat_layers, omega))
        if len(self._pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Fold the held updates into the sums (four at a time where they share a group)."""
        pending, self._pending = self._pending, []
        for bits in sorted({p[0] for p in pending}):
            items = [p for p in pending if p[0] == bits]
            acc = self.sums[bits]
            i = 0
            while len(items) - i >= 4:
                (_, x0, w0), (_, x1, w1), (_, x2, w2), (_, x3, w3) = items[i:i + 4]
                for li, a in enumerate(acc):
                    add4(a, x0[li], x1[li], x2[li], x3[li], w0, w1, w2, w3)
                i += 4
            for _, x, w in items[i:]:
                for li, a in enumerate(acc):
                    add1(a, x[li], w)

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
