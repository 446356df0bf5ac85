"""The dequantize stage: maps a decoded update into the shared float domain more
faithfully than the codec's plain decode. ``none`` keeps the plain decode; the ProWD
progressive dequantizer registers here later without touching the other stages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coordinator.strategies.types import ClientUpdate
from edge_client.errors import ConfigError


class Dequantizer(Protocol):
    name: str

    def __call__(self, update: ClientUpdate) -> ClientUpdate:
        """Return the update with dequantized weights (same shapes, float32)."""
        ...


class NoDequantizer:
    """Plain codec decode: the update passes through unchanged."""

    name = "none"

    def __call__(self, update: ClientUpdate) -> ClientUpdate:
        return update


DEQUANTIZERS: dict[str, Callable[..., Dequantizer]] = {"none": NoDequantizer}


def build_dequantizer(name: str, **params: object) -> Dequantizer:
    try:
        factory = DEQUANTIZERS[name]
    except KeyError:
        raise ConfigError(f"unknown dequantizer {name!r}; valid: {sorted(DEQUANTIZERS)}") from None
    return factory(**params)
