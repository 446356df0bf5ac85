"""The Strategy: [decode ->] dequantize -> accumulate (streaming) -> mask -> combine.

One instance lives for the whole job: ``begin_round`` / ``fold``* (checked wire updates,
the coordinator's path) or ``accept``* (updates built from arrays) / ``finish`` per
round, ``server_state`` for what devices need, ``state_dict`` / ``load_state_dict`` for
checkpoints. Memory per round is O(model size x distinct bitwidths), whatever the number
of updates (see ``accumulate``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.strategies.accumulate import GroupSums
from coordinator.strategies.announce import announced_hparams
from coordinator.strategies.buffers import LayerBufferPool
from coordinator.strategies.checks import (
    INTEGER_DTYPES,
    check_header,
    check_shapes,
    check_sigma_loc,
    unit_value,
)
from coordinator.strategies.combine import Combiner, RoundSums
from coordinator.strategies.decode import decode_update
from coordinator.strategies.dequantize import Dequantizer, NoDequantizer
from coordinator.strategies.kernels import has_nonfinite
from coordinator.strategies.mask import MaskStage, NoMask
from coordinator.strategies.serialize import arrays_from_state, arrays_to_state
from coordinator.strategies.server_state import ServerState, global_step, sigma_ema
from coordinator.strategies.types import (
    AggregateResult,
    ClientUpdate,
    EncodedUpdate,
)
from edge_client.errors import ConfigError, ProtocolError
from edge_client.protocol import Hello

STATE_VERSION = 1


def _flat32(a: np.ndarray) -> np.ndarray:
    """1-D contiguous float32 view (a copy only when the input is not float32/contiguous)."""
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1)


class Strategy:
    """A named composition of stages (build one with ``build_strategy``).

    Params: ``weighted`` (FedAvg weights by ``num_samples``; False = unweighted, 1/N: the
    FedShift and ProWD papers' averaging, docs/algorithms.md §4),
    ``sigma_momentum`` (σ_g EMA, 0.9), ``acc_dtype`` ("float32" default | "float64"
    running sums; float32 halves the accumulator traffic:
    docs/performance.md#codecs-and-the-coordinators-update-path), ``batch`` (updates folded into the sums together, >= 1).
    """

    def __init__(self, name: str, combiner: Combiner, mask: MaskStage | None = None,
                 dequantizer: Dequantizer | None = None, *, weighted: bool = True,
                 sigma_momentum: float = 0.9, acc_dtype: str = "float32", batch: int = 4) -> None:
        if acc_dtype not in ("float64", "float32"):
            raise ConfigError(f"{name}: acc_dtype must be 'float64' or 'float32', got {acc_dtype!r}")
        if int(batch) < 1:
            raise ConfigError(f"{name}: batch must be >= 1, got {batch}")
        if not 0.0 <= float(sigma_momentum) < 1.0:
            raise ConfigError(f"{name}: sigma_momentum must be in [0, 1), got {sigma_momentum}")
        self.name = name
        self.combiner = combiner
        self.mask = mask or NoMask()
        self.dequantizer = dequantizer or NoDequantizer()
        self.weighted = bool(weighted)
        self.sigma_momentum = float(sigma_momentum)
        self.acc_dtype = np.dtype(acc_dtype).type
        self.batch = int(batch)
        self.state = ServerState()
        self.group_models: dict[int, list[np.ndarray]] = {}
        self.round_id: int | None = None
        self._global: list[np.ndarray] | None = None
        self._shapes: list[tuple[int, ...]] = []
        self._decode_buffers: LayerBufferPool | None = None
        self._sums: GroupSums | None = None
        self._n_inferior = 0
        self._sigma_sum: np.ndarray | None = None
        self._sigma_n = 0

    # ------------------------------------------------------------------ round
    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        """Open round ``round_id`` from the model every device received (float32 list)."""
        self.round_id = int(round_id)
        self._global = [np.asarray(w, dtype=np.float32) for w in global_weights]
        shapes = [tuple(w.shape) for w in self._global]
        if shapes != self._shapes or self._decode_buffers is None:
            #: decode targets of the updates that are decoded first, reused once folded
            self._decode_buffers = LayerBufferPool(shapes)
        self._shapes = shapes
        self._sums = GroupSums(self._shapes, self.acc_dtype, self.batch)
        self._n_inferior = 0
        self._sigma_sum = None
        self._sigma_n = 0
        self.dequantizer.begin_round(self.round_id, self._global)

    def fold(self, update: EncodedUpdate) -> None:
        """Fold one checked wire update into the running sums (the coordinator's path: its
        ingest applied ``checks`` first). Where every layer's codec can, each layer is
        decoded straight into the sums (``acc += ω·decode(t)``, one fused pass, no float32
        copy of the update ever made); otherwise (a ternary uplink, or a dequantizer that
        needs the values) the update is decoded into reused buffers first
        (:func:`~coordinator.strategies.decode.decode_update`), then dequantized and added.
        Every tensor is checked by its codec (header, aux, table, NaN/Inf of float
        payloads) before any of it is added: ProtocolError, with nothing added, when one is
        bad. The tensors are held by reference until folded."""
        from edge_client.codecs import accumulator

        self._require_round(update.device_id)
        if not self.takes_encoded(update):
            cu = decode_update(update, self._decode_buffers.take())
            self._add_decoded(cu, self._finite_layers(cu), update.bound)
            return
        who = f"update from {update.device_id!r}"
        adders = []
        for i, t in enumerate(update.tensors):
            try:
                add = accumulator(t)  # checks t, decodes nothing
            except ProtocolError as exc:
                raise ProtocolError(f"{who}: tensors[{i}]: {exc}", reason=exc.reason) from None
            # an integer device's own integers q: q / 2^(s_g - 1) in the shared domain
            adders.append(add.scaled(unit_value(t, update.compute_bits))
                          if t.dtype in INTEGER_DTYPES else add)
        omega = self._omega(update)
        f = update.bound * update.scale  # (the guard's bound, a buffer's staleness weight)
        self._sums.add_encoded(int(update.compute_bits), adders, omega * f, update.kind == "delta",
                               key=update.device_id)
        self._sums.add_base(int(update.compute_bits), omega * (1.0 - f))
        self._count(update)

    def accept(self, update: ClientUpdate) -> None:
        """Fold one update a caller built from arrays (tests, benchmarks, scripts): the
        same rules as the wire path (``checks``: fields, layer shapes, σ_loc), plus float
        dtypes and no NaN/Inf, before anything is added (ProtocolError naming the device
        and field). The arrays are read, not copied; do not modify them after the call.
        Refusing a device's second update in a round is the caller's job (the
        coordinator's ingest does it)."""
        who = f"update from {update.device_id!r}"
        self._require_round(update.device_id)
        check_header(who, update.device_id, update.kind, update.num_samples, update.compute_bits)
        if not isinstance(update.weights, list | tuple):
            raise ProtocolError(f"{who}: weights must be a list of arrays, got {type(update.weights).__name__}")
        for i, w in enumerate(update.weights):
            if not isinstance(w, np.ndarray):
                raise ProtocolError(f"{who}: weights[{i}] is {type(w).__name__}, not an ndarray")
            if not np.issubdtype(w.dtype, np.floating):
                raise ProtocolError(f"{who}: weights[{i}].dtype {w.dtype} is not a float (decode first)")
        check_shapes(who, [w.shape for w in update.weights], self._shapes)
        if update.sigma_loc is not None:
            check_sigma_loc(who, update.sigma_loc, len(self._shapes))
        self._add_decoded(update, self._finite_layers(update))

    def fold_sum(self, bits: int, sums: list[np.ndarray], total: float, count: int, *, inferior: int = 0,
                 is_delta: bool = True) -> None:
        """Fold a sum of ``count`` updates of group ``bits`` made elsewhere (secure
        aggregation, DP): ``sums`` per layer (``Σ ω·x``, any float dtype), ``total = Σ ω``,
        ``inferior`` of them FedShift-inferior. ProtocolError for shapes that do not fit,
        NaN or Inf."""
        self._require_round(f"a sum of {count}")
        flat = [np.asarray(s, dtype=np.float64).reshape(-1) for s in sums]
        if [f.size for f in flat] != [int(np.prod(s)) for s in self._shapes] or not all(
                np.isfinite(f).all() for f in flat):
            raise ProtocolError(f"a sum of {count} update(s): wrong sizes or not finite")
        self._sums.add_sum(int(bits), flat, float(total), int(count), is_delta)
        self._n_inferior += int(inferior)

    @property
    def folds_in_parts(self) -> bool:
        """Whether a round may be folded in parts by several instances whose
        :meth:`partial` sums one adds with :meth:`fold_partial` (ingest workers): the
        running sums are all it keeps of a round, unless a dequantizer reads every update."""
        return isinstance(self.dequantizer, NoDequantizer)

    def partial(self) -> dict[str, Any]:
        """This round's part so far (sums flushed), for another instance's
        :meth:`fold_partial`: ``groups`` (``GroupSums.groups``), ``inferior``, ``sigma_sum``
        (float64 per layer, or None) and ``sigma_n``."""
        self._require_round("a partial")
        return {"groups": self._sums.groups(), "inferior": self._n_inferior, "sigma_sum": self._sigma_sum,
                "sigma_n": self._sigma_n}

    def fold_partial(self, part: Mapping[str, Any]) -> None:
        """Add another instance's :meth:`partial` of the same round to this round's sums."""
        self._require_round("a partial")
        for bits, (sums, total, count, dw) in part["groups"].items():
            self._sums.add_group(int(bits), sums, total, count, dw)
        self._n_inferior += int(part["inferior"])
        if part["sigma_sum"] is not None:
            s = np.asarray(part["sigma_sum"], dtype=np.float64)
            self._sigma_sum = s.copy() if self._sigma_sum is None else self._sigma_sum + s
            self._sigma_n += int(part["sigma_n"])

    def takes_encoded(self, update: EncodedUpdate) -> bool:
        """Whether :meth:`fold` adds ``update`` without decoding it first: there is no
        dequantizer (it needs decoded values) and every layer's codec has a fused
        ``decode_accumulate`` (every codec but ``ternary``)."""
        from edge_client.codecs import can_accumulate

        return isinstance(self.dequantizer, NoDequantizer) and all(can_accumulate(t) for t in update.tensors)

    def _require_round(self, device_id: str) -> None:
        if self._sums is None or self._global is None:
            raise ProtocolError(f"update from {device_id!r}: no round is open")

    def _omega(self, update: ClientUpdate | EncodedUpdate) -> float:
        return float(update.num_samples) if self.weighted else 1.0

    def _finite_layers(self, update: ClientUpdate) -> list[np.ndarray]:
        """1-D float32 views of the layers, NaN/Inf rejected (skipped when the decode
        already proved every value finite)."""
        flat = []
        for i, w in enumerate(update.weights):
            f = _flat32(w)
            if not (update.finite and f.dtype == w.dtype) and has_nonfinite(f):
                raise ProtocolError(f"update from {update.device_id!r}: weights[{i}] holds NaN or Inf",
                                    reason="nonfinite")
            flat.append(f)
        return flat

    def _add_decoded(self, update: ClientUpdate, flat: list[np.ndarray], bound: float = 1.0) -> None:
        """Dequantize (when a dequantizer is set: it observes every update, then maps it)
        and add a checked decoded update (its movement scaled by ``bound``, as
        ``EncodedUpdate.bound``, and by its own ``scale``)."""
        assert self._sums is not None
        scale = update.scale
        if not isinstance(self.dequantizer, NoDequantizer):
            self.dequantizer.observe(update)
            mapped = self.dequantizer(update)
            if mapped is not update:
                update = mapped
                flat = self._finite_layers(update)
        omega = self._omega(update)
        f = bound * scale
        self._sums.add(int(update.compute_bits), flat, omega * f, update.kind == "delta", key=update.device_id)
        self._sums.add_base(int(update.compute_bits), omega * (1.0 - f))
        self._count(update)

    def _count(self, update: ClientUpdate | EncodedUpdate) -> None:
        self._n_inferior += int(update.inferior)
        if update.sigma_loc is not None:
            s = np.asarray(update.sigma_loc, dtype=np.float64)
            self._sigma_sum = s.copy() if self._sigma_sum is None else self._sigma_sum + s
            self._sigma_n += 1

    def finish(self) -> AggregateResult:
        """Close the round: mask + combine, update the server state (last global step,
        σ_g, group models). ProtocolError when no update was accepted."""
        if self._sums is None or self._global is None:
            raise ProtocolError("finish: no round is open")
        sums, glob = self._sums, self._global
        n = sum(sums.count.values())
        if n == 0:
            raise ProtocolError(f"round {self.round_id}: no update to aggregate")
        global_flat = [_flat32(g) for g in glob]
        group_flat = {b: [_flat32(w) for w in ws] for b, ws in self.group_models.items()}
        bases = {b: (group_flat.get(b, global_flat) if self.combiner.grouped else global_flat)
                 for b in sums.bits}
        sums.flush_base(bases)
        last = self.state.last_global_step
        rs = RoundSums(sums, global_flat, group_flat, n, self._n_inferior,
                       None if last is None else [_flat32(s) for s in last])
        flat, groups, stats = self.combiner.combine(rs, self.mask)
        new = [f.astype(np.float32).reshape(s) for f, s in zip(flat, self._shapes, strict=True)]
        group_weights = {b: [f.astype(np.float32).reshape(s) for f, s in zip(ws, self._shapes, strict=True)]
                         for b, ws in groups.items()}
        if self.combiner.grouped:
            self.group_models = group_weights
        self.state.last_global_step = global_step(glob, new)
        if self._sigma_sum is not None:
            mean = (self._sigma_sum / self._sigma_n).tolist()
            self.state.sigma_g = sigma_ema(self.state.sigma_g, mean, self.sigma_momentum)
        stats.update({"n_updates": n, "n_inferior": self._n_inferior,
                      "n_groups_present": len(sums.bits), "round_id": int(self.round_id or 0)})
        stats.update(self.dequantizer.end_round())
        self._sums = None
        self._global = None
        return AggregateResult(new, {b: [w.copy() for w in ws] for b, ws in group_weights.items()}, stats)

    # ------------------------------------------------------------------ devices
    def device_hparams(self, hparams: Mapping[str, Any], devices: Sequence[Hello] = ()) -> dict[str, Any]:
        """The hyper-parameters to announce for a round whose selected devices said
        ``devices``: ``hparams`` plus what the stages need from devices
        (``coordinator.strategies.announce``); ConfigError naming a key that is unknown, out
        of range, or contradicts the strategy."""
        need = getattr(self.combiner, "device_hparams", None)
        return announced_hparams(self.name, hparams, need(devices) if need else {})

    # ------------------------------------------------------------------ state
    def server_state(self) -> dict[str, Any]:
        """What devices need: ``{"last_global_step": list[np.ndarray] | None,
        "sigma_g": list[float] | None}``."""
        return self.state.for_devices()

    def state_dict(self) -> dict[str, Any]:
        """msgpack-able checkpoint (arrays as {dtype, shape, data bytes}); taken between
        rounds (an open round's sums are not saved: its updates are in the inbox)."""
        return {"version": STATE_VERSION, "name": self.name, "server": self.state.to_state(),
                "group_models": {str(b): arrays_to_state(ws) for b, ws in self.group_models.items()},
                "dequantizer": self.dequantizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ProtocolError(f"strategy checkpoint: version {state.get('version')!r} != {STATE_VERSION}")
        if state.get("name") != self.name:
            raise ConfigError(f"strategy checkpoint is for {state.get('name')!r}, not {self.name!r}")
        self.state = ServerState.from_state(state.get("server") or {})
        self.group_models = {int(b): arrays_from_state(ws) or []
                             for b, ws in (state.get("group_models") or {}).items()}
        if state.get("dequantizer"):
            self.dequantizer.load_state_dict(state["dequantizer"])
