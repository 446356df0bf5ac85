"""The global model as each bitwidth group receives it (ProWD Alg. 2, line 5).

A variant is ``float32`` (the shared weights, for float devices) or ``int<s>`` (the
weights on an s-bit device's storage grid, ``from_shared(W, s)``, sent with the ``int``
codec); names come from ``edge_client.protocol.model_variant``. :func:`model_messages`
builds the encoded :class:`ModelMessage` of every variant a round needs, with what the
strategy sends devices (FedFOR's last global step, DANUQ's σ_g).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from edge_client.protocol import (
    FLOAT_VARIANT,
    EncodedTensor,
    Limits,
    ModelMessage,
    encode_message,
    float32_tensor,
    tensors_digest,
    variant_bits,
)


def model_tensors(weights: Sequence[np.ndarray], names: Sequence[str], variant: str) -> tuple[EncodedTensor, ...]:
    """The wire tensors of one model variant (float32, or the int codec on the grid)."""
    if variant == FLOAT_VARIANT:
        return tuple(float32_tensor(w, n) for w, n in zip(weights, names, strict=True))
    from edge_client.codecs import encode
    from edge_client.intnn import from_shared, storage_grid_bits

    bits = variant_bits(variant)
    ints = from_shared(list(weights), bits)
    return tuple(encode(q, codec="int", bits=storage_grid_bits(bits), name=n)
                 for q, n in zip(ints, names, strict=True))


def served_weights(weights: Sequence[np.ndarray], bits: int) -> list[np.ndarray]:
    """The shared-domain values (float32, the layers' shapes) of the model an s-bit group
    receives from ``weights``: the weights themselves for 32 bits, else their storage-grid
    integers ``from_shared(W, s)`` (rounded and clipped as :func:`model_tensors` sends
    them) mapped back exactly with ``to_shared``. What a device's update is measured from."""
    if bits >= 32:
        return [np.asarray(w, dtype=np.float32) for w in weights]
    from edge_client.intnn import from_shared, to_shared

    return to_shared(from_shared([np.asarray(w, dtype=np.float32) for w in weights], bits), bits)


def model_messages(round_id: int, model: str, names: Sequence[str], variants: Iterable[str], *,
                   weights: Sequence[np.ndarray], group_weights: Mapping[int, Sequence[np.ndarray]],
                   server_state: Mapping[str, Any], limits: Limits) -> dict[str, tuple[bytes, str]]:
    """``variant -> (encoded ModelMessage, digest of its tensors)`` for round ``round_id``.

    A grouped strategy's per-bitwidth model (``group_weights[bits]``) goes to its group;
    every other variant is built from the global ``weights``. ``server_state``: the
    strategy's ``server_state()`` (``last_global_step``, ``sigma_g``)."""
    lgs = server_state.get("last_global_step") or None
    sigma = tuple(float(s) for s in (server_state.get("sigma_g") or ()))
    step = tuple(float32_tensor(g, n) for g, n in zip(lgs, names, strict=True)) if lgs else ()
    out = {}
    for v in sorted(set(variants)):
        tensors = model_tensors(group_weights.get(variant_bits(v), weights), names, v)
        digest = tensors_digest(tensors)
        msg = ModelMessage(round_id=round_id, variant=v, model=model, tensors=tensors, digest=digest,
                           last_global_step=step, sigma_g=sigma)
        out[v] = (encode_message(msg, limits), digest)
    return out
