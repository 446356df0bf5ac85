"""Robust aggregation: one device cannot drag the model where it likes.

A :class:`RobustStrategy` is a :class:`~coordinator.strategies.base.Strategy` with two
optional steps before the combiner, set as strategy parameters, composing with every mask
and combiner:

- ``clip = c`` (> 0): each update's movement ``Δ_k`` (all layers) is scaled by
  ``min(1, c · median_j ‖Δ_j‖ / ‖Δ_k‖)``: no update moves the model more than ``c`` times
  as far as the round's median update, whatever it claims;
- ``robust = "trimmed_mean" | "median"``: per element, the mean after dropping the
  ``floor(trim · N)`` largest and smallest values, or the median, each update counted once
  (``num_samples`` is what an attacker inflates); per bitwidth group for grouped combiners.

Both need the whole round: ``clip`` alone holds each update's wire bytes, ``robust`` holds
them decoded (float32, ``4 · P`` bytes each); docs/operations.md#robust-aggregation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from coordinator.strategies.accumulate import GroupSums
from coordinator.strategies.base import Strategy, _flat32
from coordinator.strategies.checks import INTEGER_DTYPES, integer_scale
from coordinator.strategies.decode import decode_update
from coordinator.strategies.dequantize import NoDequantizer
from coordinator.strategies.mask import NoMask
from coordinator.strategies.types import AggregateResult, ClientUpdate, EncodedUpdate
from edge_client.errors import ConfigError, ProtocolError

ROBUST = ("none", "trimmed_mean", "median")
log = logging.getLogger("fedbit.strategy")


@dataclass
class _Held:
    """One update of the round, held until its end: the wire update (``encoded``) or its
    decoded flat float32 layers (``layers``), its weight, and ``norm`` = ‖Δ‖."""

    key: str
    bits: int
    omega: float
    delta: bool
    norm: float
    encoded: EncodedUpdate | None = None
    layers: list[np.ndarray] | None = None
    scale: float = 1.0  # the update's own damping (``ClientUpdate.scale``)


@numba.njit(cache=True, nogil=True)
def sq_distance(x: np.ndarray, g: np.ndarray, delta: bool) -> float:
    """``Σ (x - g)²`` (``Σ x²`` when ``delta``) over two flat float32 arrays, accumulated in
    float64, in one pass (no temporaries)."""
    s = 0.0
    if delta:
        for i in range(x.size):
            v = np.float64(x[i])
            s += v * v
    else:
        for i in range(x.size):
            v = np.float64(x[i]) - np.float64(g[i])
            s += v * v
    return s


def trimmed_mean(m: np.ndarray, k: int) -> np.ndarray:
    """Per column of ``m`` ([N, n]), the mean of the values left after the ``k`` largest and
    ``k`` smallest are dropped (float64 [n]); sorts ``m`` in place."""
    n = m.shape[0]
    if not 0 <= 2 * k < n:
        raise ValueError(f"trimmed_mean: cannot drop 2*{k} of {n} values")
    m.sort(axis=0)
    return m[k:n - k].mean(axis=0, dtype=np.float64)


def clip_scales(norms: np.ndarray, c: float) -> np.ndarray:
    """``min(1, c · median(norms) / norm_k)`` per update (1 for a zero norm)."""
    med = float(np.median(norms))
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(norms > 0, np.minimum(1.0, c * med / norms), 1.0)
    return s.astype(np.float64)


class RobustStrategy(Strategy):
    """A :class:`Strategy` that holds the round's updates and clips and/or reduces them
    with order statistics before the mask and the combiner (see the module docstring).

    Params (beyond :class:`Strategy`'s): ``clip`` (c > 0, or 0: off), ``robust``
    (``none`` | ``trimmed_mean`` | ``median``), ``trim`` (fraction dropped at each end,
    [0, 0.5)). With neither ``clip`` nor ``robust``, ``build_strategy`` returns the plain
    streaming strategy instead.
    """

    #: the round's updates are held, not summed: no ingest workers
    folds_in_parts = False

    def __init__(self, name: str, combiner: Any, mask: Any = None, dequantizer: Any = None, *,
                 clip: float = 0.0, robust: str = "none", trim: float = 0.1, **kw: Any) -> None:
        super().__init__(name, combiner, mask, dequantizer, **kw)
        if robust not in ROBUST:
            raise ConfigError(f"{name}: robust must be one of {ROBUST}, got {robust!r}")
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not (clip == 0 or 0 < clip < math.inf):
            raise ConfigError(f"{name}: clip must be 0 (off) or > 0, got {clip!r}")
        if isinstance(trim, bool) or not isinstance(trim, int | float) or not 0.0 <= trim < 0.5:
            raise ConfigError(f"{name}: trim must be in [0, 0.5), got {trim!r}")
        self.clip = float(clip)
        self.robust = robust
        self.trim = float(trim)
        self._held: list[_Held] = []
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ round
    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        super().begin_round(round_id, global_weights)
        self._held = []
        self._global_flat = [_flat32(g) for g in self._global or []]

    def fold(self, update: EncodedUpdate) -> None:
        """Check and hold a wire update. With ``clip`` alone and a fused-path update, only
        its wire form is kept (its norm from one decode into a reused buffer)."""
        self._require_round(update.device_id)
        cu = decode_update(update, self._decode_buffers.take())  # every codec checks its tensor
        flat = self._finite_layers(cu)
        if self.robust != "none" or not self.takes_encoded(update):
            self._add_decoded(cu, flat)
            return
        self._held.append(_Held(update.device_id, int(update.compute_bits), self._omega(update),
                                update.kind == "delta", self._norm(flat, update.kind == "delta"), encoded=update,
                                scale=update.scale))
        self._count(update)

    def _add_decoded(self, update: ClientUpdate, flat: list[np.ndarray]) -> None:
        """Hold a checked decoded update (after the dequantizer, when there is one)."""
        if not isinstance(self.dequantizer, NoDequantizer):
            update = self.dequantizer(update)
            flat = self._finite_layers(update)
        layers = [np.array(f, dtype=np.float32, copy=True) for f in flat]  # buffers are reused
        self._held.append(_Held(update.device_id, int(update.compute_bits), self._omega(update),
                                update.kind == "delta", self._norm(layers, update.kind == "delta"), layers=layers,
                                scale=update.scale))
        self._count(update)

    def _norm(self, flat: list[np.ndarray], delta: bool) -> float:
        """‖Δ‖ over every layer (float64 accumulation)."""
        return math.sqrt(sum(sq_distance(f, g, delta) for f, g in zip(flat, self._global_flat, strict=True)))

    # ------------------------------------------------------------------ end of round
    def finish(self) -> AggregateResult:
        if self._sums is None or self._global is None:
            raise ProtocolError("finish: no round is open")
        held = sorted(self._held, key=lambda h: h.key)
        if not held:
            raise ProtocolError(f"round {self.round_id}: no update to aggregate")
        norms = np.array([h.norm for h in held])
        scales = clip_scales(norms, self.clip) if self.clip > 0 else np.ones(len(held))
        if self.robust == "none":
            self._sums = self._clipped_sums(held, scales)
            trimmed = 0
        else:
            self._sums, trimmed = self._order_statistic_sums(held, scales)
        self._held = []
        result = super().finish()
        result.stats["robust_ineffective"] = int(self._warn_ineffective(len(held), trimmed))
        result.stats.update({"robust_clipped": int(np.sum(scales < 1.0 - 1e-6)),
                             "robust_median_norm": float(np.median(norms)),
                             "robust_max_norm": float(norms.max()), "robust_trimmed_per_side": trimmed})
        return result

    def _warn_ineffective(self, n: int, trimmed: int) -> bool:
        """Log (once per kind of case) a robust parameter that removes nothing from a round
        of ``n`` updates: a ``trim`` that drops none, a median of two, a ``clip`` that cannot
        bite. True when one does not."""
        from coordinator.defense.normbound import bites

        why = []
        if self.robust == "trimmed_mean" and trimmed == 0:
            why.append(f"trimmed_mean with trim {self.trim:g} drops nothing from {n} update(s) per pool "
                       f"(it needs at least {math.ceil(1 / self.trim) if self.trim else 'any'} in one)")
        if self.robust == "median" and n <= 2:
            why.append(f"the median of {n} update(s) is their mean")
        if self.clip > 0 and not bites(n, self.clip):
            why.append(f"clip {self.clip:g} x the median norm cannot bound any of {n} update(s)")
        for text in why:
            if text not in self._warned:
                self._warned.add(text)
                log.warning("round %s: %s: it removes nothing at this round's size", self.round_id, text,
                            extra={"event": "robust_ineffective"})
        return bool(why)

    def _adders(self, u: EncodedUpdate) -> list[Any]:
        from edge_client.codecs import accumulator

        out = []
        for t in u.tensors:
            add = accumulator(t)  # (checked at fold time: does not fail)
            out.append(add.scaled(integer_scale(u.compute_bits)) if t.dtype in INTEGER_DTYPES else add)
        return out

    def _clipped_sums(self, held: list[_Held], scales: np.ndarray) -> GroupSums:
        """The usual running sums of ``g + s_k Δ_k`` with weights ω_k: ``x_k`` weighs
        ``ω_k s_k`` and the round's model ``ω_k (1 - s_k)`` (added as a delta base); an
        update's own ``scale`` multiplies ``s_k``."""
        sums = GroupSums(self._shapes, self.acc_dtype, self.batch)
        for h, s in zip(held, scales, strict=True):
            w = h.omega * s * h.scale
            if h.encoded is not None:
                sums.add_encoded(h.bits, self._adders(h.encoded), w, h.delta, key=h.key)
            else:
                sums.add(h.bits, h.layers, w, h.delta, key=h.key)  # type: ignore[arg-type]
            sums.add_base(h.bits, h.omega * (1.0 - s * h.scale))
        return sums

    def _row(self, h: _Held, s: float, li: int) -> np.ndarray:
        """Layer ``li`` of ``g + s Δ`` for a held decoded update (float32, flat)."""
        x, g = h.layers[li], self._global_flat[li]  # type: ignore[index]
        if h.delta:
            return g + np.float32(s) * x
        return x if s == 1.0 else g + np.float32(s) * (x - g)

    def _order_statistic_sums(self, held: list[_Held], scales: np.ndarray) -> tuple[GroupSums, int]:
        """Sums whose every group average is its pool's coordinate-wise trimmed mean /
        median: one pool per bitwidth for grouped combiners and masks, else one pool."""
        per_group = self.combiner.grouped or not isinstance(self.mask, NoMask)
        pools: dict[Any, list[int]] = {}
        for i, h in enumerate(held):
            pools.setdefault(h.bits if per_group else "all", []).append(i)
        sums = GroupSums(self._shapes, self.acc_dtype, self.batch)
        trimmed = 0
        for members in pools.values():
            k = int(math.floor(self.trim * len(members))) if self.robust == "trimmed_mean" else 0
            trimmed = max(trimmed, k)
            robust_layers = []
            for li, g in enumerate(self._global_flat):
                m = np.empty((len(members), g.size), dtype=np.float32)
                for r, i in enumerate(members):
                    m[r] = self._row(held[i], float(scales[i]), li)
                robust_layers.append(trimmed_mean(m, k) if self.robust == "trimmed_mean"
                                     else np.median(m, axis=0).astype(np.float64))
            for bits in sorted({held[i].bits for i in members}):
                omega = sum(held[i].omega for i in members if held[i].bits == bits)
                sums.sums[bits] = [(r * omega).astype(self.acc_dtype) for r in robust_layers]
                sums.total[bits] = omega
                sums.count[bits] = sum(1 for i in members if held[i].bits == bits)
                sums.delta_weight[bits] = 0.0
        return sums, trimmed
