""":class:`DeviceUpdate`: what a device hands its uplink codec after a round, and the one
argument of :meth:`Codec.encode_update` (the codec picks what it encodes of it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DeviceUpdate:
    """One device's round, per layer in the model's order.

    - ``names``: the layer names (``spec.param_names()``);
    - ``shared``: float32 shared-domain weights (``content = "weights"``) or their change
      from the received model (``delta``), each of its layer's shape;
    - ``compute_bits``: the device's bitwidth, 32 for a float device;
    - ``integers``: an integer device's own grid integers (int8 for s <= 8, int16 above),
      or their change ``q - q_global`` with ``delta``; None when the device has none or a
      change does not fit 16 bits;
    - ``ternary``: int8 ``t`` in {-1, 0, 1}, the weights an integer forward computes with,
      ``t = +1`` standing for ``ternary_weight`` (> 0) in the shared domain; None with
      ``delta`` or on a device without them;
    - ``sigma_g``: the coordinator's per-layer σ_g the model carried (empty: none);
    - ``kmeans_method`` and ``seed`` (device seed, round id): the K-means uplink's method
      and its random init's seed.
    """

    names: Sequence[str]
    shared: Sequence[np.ndarray]
    compute_bits: int = 32
    delta: bool = False
    integers: Sequence[np.ndarray] | None = None
    ternary: Sequence[np.ndarray] | None = None
    ternary_weight: float = 0.0
    sigma_g: Sequence[float] = ()
    kmeans_method: str = "fast"
    seed: tuple[int, int] = (0, 0)
