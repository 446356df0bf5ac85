"""The rules an update obeys before it touches a strategy's sums, each written once.

The coordinator's ingest (``coordinator/ingest.py``) applies them to a wire update on its
way to :meth:`Strategy.fold`; :meth:`Strategy.accept` applies the same ones to an update a
caller built from arrays. Every failure is a :class:`ProtocolError` naming the device and
the field, with its ``reason`` (``wrong_shape``, ``out_of_range``, ``malformed``).

The shared domain (docs/algorithms.md §2): an integer device's integer tensors stand for
what their codec says one unit is (``Codec.integer_unit``): grid integers ``q`` (codec
``int``) for ``q / 2^(s_g - 1)``, ``s_g = max(s, 8)`` (:func:`integer_scale`, from
``edge_client.intnn``'s grid), ternary codes ``t`` for the ternary forward weights
``t * intnn.TERNARY_WEIGHT`` = ``t / 2`` (:func:`unit_value`). Lossiness is the codec's
(``Codec.is_lossy``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from coordinator.strategies.types import FLOAT_BITS, UPDATE_KINDS, EncodedUpdate
from edge_client.codecs import get_codec
from edge_client.errors import ProtocolError
from edge_client.protocol import EncodedTensor

INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "uint8", "uint16"})


def integer_scale(compute_bits: int) -> float:
    """The value of one integer step of an s-bit device in the shared domain:
    ``1 / 2^(max(s, 8) - 1)`` (``1 / intnn.grid_scale(s)``)."""
    from edge_client.intnn.quant import grid_scale

    return 1.0 / float(grid_scale(int(compute_bits)))


def unit_value(t: EncodedTensor, compute_bits: int) -> float:
    """The shared-domain value of one unit of an integer tensor ``t`` of an integer
    device: ``intnn.TERNARY_WEIGHT`` for ternary codes (what ``t = +1`` computes in the
    device's forward, docs/algorithms.md §1-2), ``integer_scale(s)`` for grid integers."""
    if get_codec(t.codec).integer_unit == "ternary_weight":
        from edge_client.intnn.quant import TERNARY_WEIGHT

        return TERNARY_WEIGHT
    return integer_scale(compute_bits)


def is_lossy(tensors: Sequence[EncodedTensor]) -> bool:
    """Whether any layer may differ from what its device encoded (``Codec.is_lossy``:
    float32, int and ternary codes are exact)."""
    return any(get_codec(t.codec).is_lossy(t) for t in tensors)


def check_shapes(who: str, shapes: Sequence[tuple[int, ...]], model: Sequence[tuple[int, ...]]) -> None:
    """The update's layer count and every layer's shape equal the model's."""
    if len(shapes) != len(model):
        raise ProtocolError(f"{who}: {len(shapes)} layers, the model has {len(model)}",
                            reason="wrong_shape")
    for i, (got, want) in enumerate(zip(shapes, model, strict=True)):
        if tuple(got) != tuple(want):
            raise ProtocolError(f"{who}: tensors[{i}].shape {list(got)} != {list(want)}",
                                reason="wrong_shape")


def check_integer_source(who: str, tensors: Sequence[EncodedTensor], compute_bits: int) -> None:
    """Integer tensors (a device's own grid values) come only from integer devices."""
    if compute_bits >= FLOAT_BITS:
        for i, t in enumerate(tensors):
            if t.dtype in INTEGER_DTYPES:
                raise ProtocolError(f"{who}: tensors[{i}]: integer tensor ({t.dtype}) from a float device")


def check_magnitude(who: str, tensors: Sequence[EncodedTensor], compute_bits: int, limit: float) -> None:
    """Every value, in the shared domain, is within ``|v| <= limit`` (``Limits.max_abs_value``).

    The bound comes from each codec's header (asym, kmeans, danuq, ternary, int) or one
    pass over the bit patterns (float32/float16): ``edge_client.codecs.max_abs``.
    """
    from edge_client.codecs import max_abs

    for i, t in enumerate(tensors):
        try:
            bound = max_abs(t)
        except ProtocolError as exc:
            raise ProtocolError(f"{who}: tensors[{i}]: {exc}", reason=exc.reason) from None
        except Exception as exc:  # noqa: BLE001 - a codec failing on received bytes
            raise ProtocolError(f"{who}: tensors[{i}]: cannot read ({type(exc).__name__}: {exc})") from None
        if t.dtype in INTEGER_DTYPES and compute_bits < FLOAT_BITS:
            bound *= unit_value(t, compute_bits)
        if not bound <= limit:
            raise ProtocolError(f"{who}: tensors[{i}]: values up to |v| = {bound:.4g} exceed the "
                                f"limit max_abs_value = {limit:.4g}", reason="out_of_range")


def check_encoded(update: EncodedUpdate, model: Sequence[tuple[int, ...]], max_abs_value: float) -> None:
    """Every rule a wire update obeys before :meth:`Strategy.fold` (the coordinator's
    ingest calls this once per update): layer shapes, integer tensors only from integer
    devices, ``|v| <= max_abs_value`` in the shared domain. The codecs check the rest of
    each tensor (header, aux, NaN/Inf of float payloads) when it is folded."""
    who = f"update from {update.device_id!r}"
    check_shapes(who, [t.shape for t in update.tensors], model)
    check_integer_source(who, update.tensors, update.compute_bits)
    check_magnitude(who, update.tensors, update.compute_bits, max_abs_value)


def sigma_loc_of(who: str, tensors: Sequence[EncodedTensor]) -> list[float] | None:
    """Per-layer ``aux["sigma_loc"]`` (DANUQ's local std) when every layer carries one, else
    None; :func:`check_sigma_loc` on the values."""
    sig = [t.aux.get("sigma_loc") for t in tensors]
    if not sig or any(s is None for s in sig):
        return None
    return check_sigma_loc(who, sig, len(tensors))


def check_sigma_loc(who: str, sigma: Sequence[Any], n_layers: int) -> list[float]:
    """``n_layers`` finite numbers ``>= 0``."""
    if len(sigma) != n_layers or not all(
            isinstance(s, int | float | np.floating) and not isinstance(s, bool)
            and math.isfinite(s) and s >= 0 for s in sigma):
        raise ProtocolError(f"{who}: sigma_loc must be {n_layers} finite numbers >= 0")
    return [float(s) for s in sigma]


def check_header(who: str, device_id: object, kind: object, num_samples: object, compute_bits: object
                 ) -> None:
    """The scalar fields of an update a caller built by hand (the wire protocol checks
    the same ranges when it parses an ``Update``)."""
    if not isinstance(device_id, str) or not device_id:
        raise ProtocolError(f"{who}: device_id must be a non-empty string")
    if kind not in UPDATE_KINDS:
        raise ProtocolError(f"{who}: kind {kind!r} not in {list(UPDATE_KINDS)}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) or num_samples <= 0:
        raise ProtocolError(f"{who}: num_samples must be a positive int, got {num_samples!r}")
    if isinstance(compute_bits, bool) or not isinstance(compute_bits, int | np.integer) \
            or not 1 <= compute_bits <= FLOAT_BITS:
        raise ProtocolError(f"{who}: compute_bits must be an int in 1..32, got {compute_bits!r}")
