"""SecAgg+'s communication graph (Bell et al., CCS 2020, §3): each device shares its
secrets with, and masks against, only its ``k`` neighbours on a random k-regular graph.

The graph is the Harary graph H(n, k) (a ring where each node links to the ``k/2``
nearest on either side) over a random permutation of the selected devices; the
permutation comes from the round's public session bytes, so the coordinator and every
device derive the same graph and none can choose its neighbours. ``k = O(log n)`` keeps
each device's work O(log n) instead of O(n), and ``t`` of a device's ``k`` neighbours
reconstruct its secrets.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np


def default_degree(n: int) -> int:
    """``k``: the smallest even number >= 2 log2(n) (at most n - 1; the complete graph
    below 8 devices)."""
    if n <= 8:
        return max(0, n - 1)
    k = 2 * math.ceil(math.log2(n))
    return min(k + (k % 2), n - 1)


def default_threshold(k: int, fraction: float = 0.5) -> int:
    """``t``: more than ``fraction`` of a device's ``k`` neighbours (a majority by default),
    at least 2 (1 when a device has a single neighbour)."""
    if k <= 1:
        return max(1, k)
    return min(k, max(2, math.floor(fraction * k) + 1))


def neighbours(ids: Sequence[str], k: int, session: bytes) -> dict[str, list[str]]:
    """``{device: sorted neighbours}`` of the Harary graph H(n, k) over ``ids`` permuted by
    ``session`` (``k >= n - 1``: every other device)."""
    ids = sorted(ids)
    n = len(ids)
    if k >= n - 1:
        return {d: [e for e in ids if e != d] for d in ids}
    seed = int.from_bytes(hashlib.sha256(b"fedbit-secagg-graph|" + session).digest()[:8], "big")
    order = [ids[i] for i in np.random.default_rng(seed).permutation(n)]
    out: dict[str, list[str]] = {d: [] for d in ids}
    half, odd = k // 2, k % 2
    for pos, d in enumerate(order):
        links = {order[(pos + j) % n] for j in range(1, half + 1)} | {order[(pos - j) % n] for j in range(1, half + 1)}
        if odd and n % 2 == 0:  # odd k: also the node opposite (n even keeps it regular)
            links.add(order[(pos + n // 2) % n])
        out[d] = sorted(links)
    return out


def x_coordinates(ids: Sequence[str]) -> dict[str, int]:
    """Each device's public Shamir x-coordinate: its position in the sorted ids, plus one."""
    return {d: i + 1 for i, d in enumerate(sorted(ids))}


def edges(graph: dict[str, list[str]]) -> list[tuple[str, str]]:
    """The graph's edges, each once (``u < v``)."""
    return sorted({(min(u, v), max(u, v)) for u, vs in graph.items() for v in vs})
