"""Secure aggregation on the device: SecAgg+ (Bell et al., CCS 2020) over ℤ/2^32, and the
distributed discrete Gaussian of DP under it. ``crypto`` (X25519, ChaCha20-Poly1305,
Ed25519, the mask PRG), ``shamir`` (t-out-of-n shares), ``graph`` (the k-regular graph),
``encode`` (the fixed-point grid, clipping, rounding, noise), ``client`` (a device's round
as a state machine). No coordinator import; Python 3.9. The names below are imported on
first use: a device that never runs a secure round does not load ``cryptography``'s
asymmetric bindings."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Grid", "SecAggClient", "load_identity", "secure_vector"]
_HOME = {"SecAggClient": "client", "load_identity": "client", "Grid": "encode", "secure_vector": "encode"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"edge_client.secagg.{_HOME[name]}"), name)
    raise AttributeError(f"module 'edge_client.secagg' has no attribute {name!r}")
