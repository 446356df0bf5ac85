"""The dequantize stage: maps a decoded update into the shared float domain more
faithfully than the codec's plain decode. ``none`` keeps the plain decode; ``prowd`` is
ProWD's progressive weight dequantizer (``coordinator.strategies.prowd_dequantizer``).

A dequantizer is called on every decoded update (``__call__``) and sees the round through
hooks the strategy calls: ``begin_round(round_id, global_weights)``, ``observe(update)``
(every update, before ``__call__``), ``end_round() -> stats`` (merged into the round's
``AggregateResult.stats``), and ``state_dict`` / ``load_state_dict`` (the strategy's
checkpoint).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from coordinator.strategies.types import ClientUpdate
from edge_client.errors import ConfigError


class Dequantizer(Protocol):
    name: str

    def __call__(self, update: ClientUpdate) -> ClientUpdate:
        """Return the update with dequantized weights (same shapes, float32)."""
        ...

    def begin_round(self, round_id: int, global_weights: Sequence[np.ndarray]) -> None: ...

    def observe(self, update: ClientUpdate) -> None: ...

    def end_round(self) -> dict[str, float | int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoDequantizer:
    """Plain codec decode: the update passes through unchanged."""

    name = "none"

    def __call__(self, update: ClientUpdate) -> ClientUpdate:
        return update

    def begin_round(self, round_id: int, global_weights: Sequence[np.ndarray]) -> None:
        pass

    def observe(self, update: ClientUpdate) -> None:
        pass

    def end_round(self) -> dict[str, float | int]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _prowd(**params: Any) -> Dequantizer:
    from coordinator.strategies.prowd_dequantizer import ProwdDequantizer  # imports torch

    return ProwdDequantizer(**params)


#: name -> factory; ``takes_model``: names whose factory takes the model spec's name
DEQUANTIZERS: dict[str, Callable[..., Dequantizer]] = {"none": NoDequantizer, "prowd": _prowd}
TAKES_MODEL = frozenset({"prowd"})


def build_dequantizer(name: str, *, model: str | None = None, **params: object) -> Dequantizer:
    """Build the named dequantizer; ``model`` (the coordinator's model spec name) goes to
    those that use it (``prowd``: its distillation term) unless ``params`` names one."""
    try:
        factory = DEQUANTIZERS[name]
    except KeyError:
        raise ConfigError(f"unknown dequantizer {name!r}; valid: {sorted(DEQUANTIZERS)}") from None
    if name in TAKES_MODEL and model is not None:
        params.setdefault("model", model)
    if name not in TAKES_MODEL and params and not inspect.signature(factory).parameters:
        raise ConfigError(f"dequantizer {name!r} takes no parameters, got {sorted(params)}")
    return factory(**params)
