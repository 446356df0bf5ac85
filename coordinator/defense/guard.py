"""The poisoning guard around a strategy that folds single updates (:class:`GuardedStrategy`).

Each checked wire update is decoded once into reused buffers to measure its movement
``‖Δ‖`` from the model its device started from (the round's global model, or its group's
for a grouped combiner); before the strategy folds it, it is **norm-bounded** (scaled by
``min(1, k · median ‖Δ‖ / ‖Δ_k‖)``: :class:`~coordinator.defense.normbound.MedianBound`,
``EncodedUpdate.bound``) and **weight-bounded** (``num_samples`` cut to ``m ×`` the median).
The medians are the round's: the first ``hold`` updates are held (their wire bytes) and
folded once all are in, so a round of at most ``hold`` updates is bounded by its exact
medians, a larger round's later updates by the medians so far. Devices bounded this round
are in :attr:`GuardedStrategy.bounded` (the reputation's strikes), the figures in the
round's stats (``guard_*``). A strategy that is robust or clips already is not
norm-bounded twice: the guard then only measures and bounds weights
(docs/security.md#poisoning).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.defense.config import DefenseConfig
from coordinator.defense.normbound import (
    MedianBound,
    RunningMedian,
    bites,
    clip_factor,
    sq_distance,
    update_norm,
)
from coordinator.strategies.base import _flat32
from coordinator.strategies.buffers import LayerBufferPool
from coordinator.strategies.checks import INTEGER_DTYPES, unit_value
from coordinator.strategies.decode import decode_update
from coordinator.strategies.kernels import has_nonfinite
from coordinator.strategies.round import RoundStrategy
from coordinator.strategies.types import AggregateResult, EncodedUpdate
from edge_client.errors import ProtocolError
from edge_client.protocol import Hello

log = logging.getLogger("fedbit.defense")


def bounds_norms_itself(strategy: RoundStrategy) -> bool:
    """Whether ``strategy`` aggregates with order statistics or clips updates itself
    (:class:`~coordinator.strategies.robust.RobustStrategy` with ``robust`` or ``clip``)."""
    return getattr(strategy, "robust", "none") != "none" or getattr(strategy, "clip", 0.0) > 0


class GuardedStrategy:
    """A :class:`~coordinator.strategies.round.RoundStrategy` around ``inner`` (see the
    module docstring); everything but the round's folding is ``inner``'s."""

    def __init__(self, inner: RoundStrategy, cfg: DefenseConfig) -> None:
        self.inner = inner
        self.name = inner.name
        self.cfg = cfg
        self.clips = cfg.norm_bound > 0 and not bounds_norms_itself(inner)
        #: device -> ``‖Δ‖ / median`` of this round's norm-bounded (or, when the strategy
        #: bounds norms itself, over-the-bound) updates
        self.bounded: dict[str, float] = {}
        #: device -> ``‖Δ‖`` of this round's updates (measured when the norm bound is on)
        self.norms: dict[str, float] = {}
        self._norms = MedianBound(cfg.norm_bound or 1.0)
        self._samples = RunningMedian()
        self._held: list[tuple[EncodedUpdate, float]] = []
        self._holding = True
        self._global: list[np.ndarray] = []
        self._refs: dict[int, list[np.ndarray]] = {}
        self._buffers: LayerBufferPool | None = None
        self._stats: dict[str, float] = {}
        self._warned: set[int] = set()

    def __getattr__(self, name: str) -> Any:  # (the inner strategy's own attributes)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ round
    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        self.inner.begin_round(round_id, global_weights)
        self._global = [_flat32(w) for w in global_weights]
        shapes = [tuple(w.shape) for w in global_weights]
        if self._buffers is None or self._buffers.shapes != shapes:
            self._buffers = LayerBufferPool(shapes, max_sets=2)
        self._refs, self._held, self._holding = {}, [], True
        self._norms.end_round()
        self._samples = RunningMedian()
        self.bounded, self.norms = {}, {}
        self._stats = {"guard_norm_bounded": 0, "guard_weight_bounded": 0}

    def _reference(self, bits: int) -> list[np.ndarray]:
        """The flat model an update of a ``bits`` device started from."""
        if bits not in self._refs:
            groups = getattr(self.inner, "group_models", {}) if getattr(
                getattr(self.inner, "combiner", None), "grouped", False) else {}
            self._refs[bits] = [_flat32(w) for w in groups[bits]] if bits in groups else self._global
        return self._refs[bits]

    def fold(self, update: EncodedUpdate) -> None:
        """Check (every codec decodes its tensor; NaN/Inf refused: ProtocolError, nothing
        kept) and measure the update, then hold or fold it bounded (with both bounds off:
        the strategy's own fold, nothing measured)."""
        assert self._buffers is not None, "begin_round first"
        if not self.cfg.norm_bound and not self.cfg.sample_bound:
            self.inner.fold(update)
            return
        norm = self._measure(update) if self.cfg.norm_bound else 0.0
        self._samples.add(float(update.num_samples))
        if self._holding and self.cfg.norm_bound:  # (held ones were checked by their decode)
            self._held.append((update, norm))
            if len(self._held) >= self.cfg.hold:
                self._release()
            return
        self._fold_bounded(update, norm)

    def _measure(self, update: EncodedUpdate) -> float:
        """‖Δ‖ of a checked update: each layer decoded into a reused buffer (the codec's
        fused ``decode_accumulate`` into zeros where it has one: its checks, no fresh
        array; else a plain decode), then one pass against the reference."""
        from edge_client.codecs import accumulator, can_accumulate

        assert self._buffers is not None
        who = f"update from {update.device_id!r}"
        ref = self._reference(int(update.compute_bits))
        delta = update.kind == "delta"
        bufs = self._buffers.take()
        if not all(can_accumulate(t) for t in update.tensors):
            cu = decode_update(update, bufs)
            for i, w in enumerate(cu.weights):
                if not cu.finite and has_nonfinite(_flat32(w)):
                    raise ProtocolError(f"{who}: weights[{i}] holds NaN or Inf", reason="nonfinite")
            norm = update_norm([_flat32(w) for w in cu.weights], ref, delta)
        else:
            total = 0.0
            for i, (t, buf, g) in enumerate(zip(update.tensors, bufs, ref, strict=True)):
                try:
                    add = accumulator(t)  # checks t (NaN/Inf of a float payload included)
                except ProtocolError as exc:
                    raise ProtocolError(f"{who}: tensors[{i}]: {exc}", reason=exc.reason) from None
                if t.dtype in INTEGER_DTYPES:
                    add = add.scaled(unit_value(t, update.compute_bits))
                buf.fill(0.0)
                add(buf, 1.0)
                total += sq_distance(buf.reshape(-1), g, delta)
            norm = math.sqrt(total)
        self._norms.observe(norm)
        self.norms[update.device_id] = norm
        return norm

    def _release(self) -> None:
        """Fold the held updates (by device id: the order does not depend on arrival). Each
        was checked when it came (every codec decoded it), so the strategy's own checks
        pass; one that fails all the same is logged and left out, never blamed on the
        update being folded now."""
        held, self._held, self._holding = sorted(self._held, key=lambda h: h[0].device_id), [], False
        for update, norm in held:
            try:
                self._fold_bounded(update, norm)
            except ProtocolError as exc:
                log.error("the held update of %r was refused when folded: %s", update.device_id, exc,
                          extra={"event": "guard_fold_failed", "device": update.device_id})
                self._stats["guard_fold_failed"] = self._stats.get("guard_fold_failed", 0) + 1

    def _fold_bounded(self, update: EncodedUpdate, norm: float) -> None:
        median = self._norms.median()
        if self.cfg.norm_bound > 0 and norm > self.cfg.norm_bound * median:
            self.bounded[update.device_id] = norm / median
            if self.clips:
                update.bound = clip_factor(norm, self._norms.bound())
                self._stats["guard_norm_bounded"] += 1
        cap = self.cfg.sample_bound * self._samples.median()
        if self.cfg.sample_bound > 0 and update.num_samples > cap:
            update.num_samples = max(1, int(cap))
            self._stats["guard_weight_bounded"] += 1
        self.inner.fold(update)

    def finish(self) -> AggregateResult:
        self._release()
        result = self.inner.finish()
        result.stats.update(self._stats)
        result.stats["guard_median_norm"] = self._norms.median()
        n = len(self._samples)
        idle = [f"{name} {k:g} x the median" for name, k in (("norm_bound", self.cfg.norm_bound),
                                                             ("sample_bound", self.cfg.sample_bound)) if k and not bites(n, k)]
        if idle and n not in self._warned:  # (once per round size)
            self._warned.add(n)
            log.warning("defense: %s cannot bound any of a round's %d update(s) (it needs 3, or 2 with a bound "
                        "below 2): a round this small is not protected", " and ".join(idle), n,
                        extra={"event": "defense_ineffective"})
        result.stats["guard_ineffective"] = int(bool(idle))
        return result

    # ------------------------------------------------------------------ a round in parts
    def partial(self) -> dict[str, Any]:
        """An ingest worker's part of the round: its held updates folded, the inner
        strategy's partial sums, and what this guard measured (``guard``: the bounded
        devices, the norms, the sample counts, the counts of bounded updates)."""
        self._release()
        return {**self.inner.partial(), "guard": {"bounded": dict(self.bounded), "norms": dict(self.norms),
                                                  "samples": self._samples.values(), "stats": dict(self._stats)}}

    def fold_partial(self, part: Mapping[str, Any]) -> None:
        """Add a worker's :meth:`partial`: its sums to the inner strategy's, what its guard
        measured to this guard's (the strikes, the round's medians and counts)."""
        g = part.get("guard") or {}
        self.bounded.update(g.get("bounded", {}))
        self.norms.update(g.get("norms", {}))
        for norm in g.get("norms", {}).values():
            self._norms.observe(norm)
        for n in g.get("samples", []):
            self._samples.add(float(n))
        for k, v in g.get("stats", {}).items():
            self._stats[k] = self._stats.get(k, 0) + v
        self.inner.fold_partial(part)

    # ------------------------------------------------------------------ the rest is the strategy's
    def device_hparams(self, hparams: Mapping[str, Any], devices: Sequence[Hello] = ()) -> dict[str, Any]:
        return self.inner.device_hparams(hparams, devices)

    def server_state(self) -> dict[str, Any]:
        return self.inner.server_state()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
