"""The decode stage: a checked :class:`EncodedUpdate` -> a :class:`ClientUpdate` of float32
arrays in the shared domain, for the updates a strategy cannot fold straight from the
wire (a ternary uplink, or a dequantizer that needs the values).

Float tensors decode into caller-given buffers (``out``, reused by the strategy); integer
tensors are mapped exactly to the shared domain (docs/algorithms.md §1-2, ``checks.unit_value``):
a device's own grid values as ``q * integer_scale(s)``, ternary codes as the ternary forward
weights they are, ``t * intnn.TERNARY_WEIGHT`` (``t / 2``, whatever the bitwidth).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator.strategies.checks import unit_value
from coordinator.strategies.types import ClientUpdate, EncodedUpdate
from edge_client.errors import ProtocolError


def decode_update(update: EncodedUpdate, out: Sequence[np.ndarray] | None = None) -> ClientUpdate:
    """Decode every layer with its codec (ProtocolError, naming the layer, when a codec
    fails on the received bytes). ``out``: one writable float32 buffer per layer, of the
    layer's shape, that float tensors are decoded into (None: fresh arrays).

    ``finite`` is set on the result when every codec proved its values finite while
    decoding, so the strategy does not scan them again."""
    from edge_client.codecs import decode, get_codec

    who = f"update from {update.device_id!r}"
    weights = []
    for i, t in enumerate(update.tensors):
        try:
            a = decode(t, out=out[i] if out is not None and t.dtype == "float32" else None)
        except ProtocolError as exc:
            raise ProtocolError(f"{who}: tensors[{i}]: {exc}", reason=exc.reason) from None
        except Exception as exc:  # noqa: BLE001 - a codec failing on received bytes
            raise ProtocolError(f"{who}: tensors[{i}]: cannot decode ({type(exc).__name__}: {exc})") from None
        if a.dtype.kind in "iu":
            a = a.astype(np.float32) * np.float32(unit_value(t, update.compute_bits))
        weights.append(np.asarray(a, dtype=np.float32))
    finite = all(get_codec(t.codec).finite_output for t in update.tensors)
    return ClientUpdate(update.device_id, update.num_samples, weights, update.kind, update.compute_bits,
                        update.lossy, update.sigma_loc, finite=finite, scale=update.scale)
