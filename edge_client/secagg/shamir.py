"""Shamir's t-out-of-n secret sharing of 32-byte secrets over GF(2^521 - 1).

A secret (a self-mask seed or an X25519 private key, read as a 256-bit integer) is the
constant term of a random polynomial of degree ``t - 1``; the share of the party at
x-coordinate ``x >= 1`` is its value there. Any ``t`` shares give the secret back by
Lagrange interpolation at 0; fewer give no information about it (every secret fits them
equally well). x-coordinates are public: a device's position in the round's sorted list
of selected devices, plus one.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from edge_client.errors import ProtocolError

PRIME = (1 << 521) - 1
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


class BelowThreshold(ProtocolError):
    """Fewer shares than the threshold: the secret cannot be reconstructed."""


def split(secret: bytes, xs: Sequence[int], t: int) -> dict[int, bytes]:
    """Shares of ``secret`` (32 bytes) for the parties at ``xs`` (distinct, >= 1), any
    ``t`` of which reconstruct it: ``{x: share bytes}``."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret: {len(secret)} bytes, expected {SECRET_BYTES}")
    if not 1 <= t <= len(xs):
        raise ValueError(f"threshold {t} not in 1..{len(xs)}")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[int(x)] = y.to_bytes(SHARE_BYTES, "big")
    return out


def combine(shares: Sequence[tuple[int, bytes]], t: int) -> bytes:
    """The secret from ``(x, share)`` pairs (the first ``t`` are used);
    :class:`BelowThreshold` when there are fewer than ``t``, ProtocolError for a malformed
    share or a repeated x. A wrong share yields a wrong secret: callers check the result
    against its commitment."""
    pts: list[tuple[int, int]] = []
    seen = set()
    for x, s in shares:
        if len(s) != SHARE_BYTES:
            raise ProtocolError(f"share of x={x}: {len(s)} bytes, expected {SHARE_BYTES}")
        y = int.from_bytes(s, "big")
        if y >= PRIME or x < 1 or x in seen:
            raise ProtocolError(f"share of x={x}: out of the field or repeated")
        seen.add(x)
        pts.append((int(x), y))
    if len(pts) < t:
        raise BelowThreshold(f"{len(pts)} share(s) < threshold {t}")
    pts = pts[:t]
    secret = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, (xj, _) in enumerate(pts):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >> (8 * SECRET_BYTES):
        raise ProtocolError("shares do not interpolate to a 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")
