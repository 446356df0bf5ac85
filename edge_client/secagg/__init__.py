"""Secure aggregation on the device: SecAgg+ (Bell et al., CCS 2020) over ℤ/2^32, and the
distributed discrete Gaussian of DP under it. ``crypto`` (X25519, ChaCha20-Poly1305,
Ed25519, the mask PRG), ``shamir`` (t-out-of-n shares), ``graph`` (the k-regular graph),
``encode`` (the fixed-point grid, clipping, rounding, noise), ``client`` (a device's round
as a state machine). No coordinator import; Python 3.9."""

from edge_client.secagg.client import SecAggClient, load_identity
from edge_client.secagg.encode import Grid, secure_vector

__all__ = ["Grid", "SecAggClient", "load_identity", "secure_vector"]
