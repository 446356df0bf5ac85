"""numpy arrays <-> msgpack-able dicts (checkpoints)."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.errors import ProtocolError


def array_to_state(a: np.ndarray) -> dict[str, Any]:
    """``{"dtype": "float32", "shape": [...], "data": bytes}`` (little-endian)."""
    a = np.ascontiguousarray(a)
    dt = a.dtype.newbyteorder("<")
    return {"dtype": a.dtype.name, "shape": [int(d) for d in a.shape], "data": a.astype(dt).tobytes()}


def array_from_state(d: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`array_to_state`; ProtocolError when the byte length is wrong."""
    try:
        dt = np.dtype(str(d["dtype"])).newbyteorder("<")
        shape = tuple(int(x) for x in d["shape"])
        data = bytes(d["data"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"checkpoint array: {e}") from None
    if len(data) != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ProtocolError(f"checkpoint array: {len(data)} bytes for shape {list(shape)}")
    return np.frombuffer(data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="))


def arrays_to_state(arrays: list[np.ndarray] | None) -> list[dict[str, Any]] | None:
    return None if arrays is None else [array_to_state(a) for a in arrays]


def arrays_from_state(items: list[dict[str, Any]] | None) -> list[np.ndarray] | None:
    return None if items is None else [array_from_state(d) for d in items]
