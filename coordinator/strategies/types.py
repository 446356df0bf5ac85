"""The data that flows through the aggregation stages."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

UPDATE_KINDS = ("weights", "delta")
FLOAT_BITS = 32


@dataclass
class ClientUpdate:
    """One device's decoded update for one round.

    - ``weights``: one float32 array per model layer, in ``spec.param_shapes()`` order, in
      the shared parameter domain (docs/algorithms.md §2). Full weights, or, when ``kind`` is
      ``"delta"``, ``W_local - W_global`` (the model the device started from).
    - ``num_samples``: local training samples (> 0), the FedAvg weight.
    - ``compute_bits``: the device's compute bitwidth (32 = float device); groups and the
      ProWD high/low split use it.
    - ``lossy``: arrived through a lossy codec. It and ``compute_bits < 32`` make the
      update "inferior" in FedShift's sense.
    - ``sigma_loc``: per-layer standard deviation of the device's update (DANUQ devices).
    - ``finite``: the producer already proved every value finite (the coordinator sets it
      when each tensor came through a codec with ``finite_output``, whose decode verified
      it); the strategy then skips its own NaN/Inf pass instead of reading the update
      twice. Left False, the strategy checks.
    - ``scale``: how much of its movement from the round's model counts: it weighs
      ``ω·scale`` and the round's model the rest, ``ω·(1 - scale)``, so it contributes the
      model plus ``scale`` times its step (buffered mode: the staleness weight times the
      server learning rate; 1: the update as it is).
    """

    device_id: str
    num_samples: int
    weights: list[np.ndarray]
    kind: str = "weights"
    compute_bits: int = FLOAT_BITS
    lossy: bool = False
    sigma_loc: list[float] | None = None
    finite: bool = False
    scale: float = 1.0

    @property
    def inferior(self) -> bool:
        """FedShift's inferior set: lossy uplink or integer device."""
        return self.lossy or self.compute_bits < FLOAT_BITS


@dataclass
class EncodedUpdate:
    """One device's update for one round as it came off the wire, not yet decoded.

    The fields mean what they mean in :class:`ClientUpdate`; ``tensors`` holds one
    ``EncodedTensor`` per model layer (the protocol already checked their byte lengths,
    ``coordinator.ingest`` their shapes, sources and magnitudes); ``not_applied`` the
    announced hyper-parameters the device reports it did not apply (key -> reason). :meth:`Strategy.fold`
    adds it to the sums with the codecs' fused ``decode_accumulate`` where it can (no
    float32 copy of the update is ever made), or decodes it first. ``bound`` in (0, 1]: the
    update's movement ``x - g`` is folded scaled by it (``g + bound·(x - g)``: ``x`` weighs
    ``bound·ω``, the round's model ``(1 - bound)·ω``; :mod:`coordinator.defense.guard`).
    ``scale`` multiplies it as in :class:`ClientUpdate` (a buffer's staleness weight): the
    movement counts ``bound·scale``.
    """

    device_id: str
    num_samples: int
    tensors: tuple
    kind: str = "weights"
    compute_bits: int = FLOAT_BITS
    lossy: bool = False
    sigma_loc: list[float] | None = None
    not_applied: dict[str, str] = field(default_factory=dict)
    bound: float = 1.0
    scale: float = 1.0

    @property
    def inferior(self) -> bool:
        return self.lossy or self.compute_bits < FLOAT_BITS


@dataclass
class AggregateResult:
    """What one round's aggregation produced.

    - ``weights``: the new global model (float32, one array per layer).
    - ``group_weights``: bitwidth -> model, for the grouped combiners (else empty).
    - ``stats``: counters and per-layer figures (``n_updates``, ``n_inferior``,
      ``masked_fraction/<layer>``, ``cos_before/<layer>``, ``cos_after/<layer>``...).
    """

    weights: list[np.ndarray]
    group_weights: dict[int, list[np.ndarray]] = field(default_factory=dict)
    stats: dict[str, float | int] = field(default_factory=dict)
