"""A fast 64-bit checksum for the inbox log's records (torn-write detection, not security).

A Fletcher-style pair of sums over the data's little-endian 32-bit words ``x_1..x_m`` (the
tail zero-padded to a word), with 64-bit wrap-around::

    s1 = seed + Σ x_i            s2 = Σ (m + 1 - i) · x_i         (mod 2^64)
    checksum = s1 XOR rotl(s2, 32) XOR 8 · len(data)

``s2`` is the running sum of the running sums, written so that it vectorizes (one
32x32->64 multiply-add per word, several times ``zlib.crc32``'s speed:
docs/performance.md#codecs-and-the-coordinators-update-path). A torn write (a zeroed or
stale block, a truncated tail, words moved) changes ``s1`` or ``s2`` except with
negligible probability. The numba kernel releases the GIL; :func:`checksum_reference` is
the same in plain Python, for the tests.
"""

from __future__ import annotations

import numba
import numpy as np

_MASK = (1 << 64) - 1


@numba.njit(cache=True, nogil=True)
def _sums(words: np.ndarray, tail: np.ndarray, seed: np.uint64) -> tuple[np.uint64, np.uint64]:
    m = words.size + (1 if tail.size else 0)
    s1 = seed
    s2 = np.uint64(0)
    for i in range(words.size):
        x = np.uint64(words[i])
        s1 += x
        s2 += np.uint64(m - i) * x
    if tail.size:
        x = np.uint64(0)
        for k in range(tail.size):
            x |= np.uint64(tail[k]) << np.uint64(8 * k)
        s1 += x
        s2 += x  # weight m + 1 - m = 1
    return s1, s2


def checksum(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """64-bit checksum of ``data`` (see the module docstring); ``seed`` chains a prefix
    (``checksum(b, checksum(a))`` covers ``a`` then ``b``)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    whole = buf.size // 4 * 4
    words = buf[:whole].view("<u4")
    s1, s2 = _sums(words, buf[whole:], np.uint64(seed & _MASK))
    s1, s2 = int(s1), int(s2)
    return (s1 ^ (((s2 << 32) | (s2 >> 32)) & _MASK) ^ (8 * len(buf))) & _MASK


def checksum_reference(data: bytes, seed: int = 0) -> int:
    """:func:`checksum` in plain Python (slow; for tests)."""
    padded = bytes(data) + b"\0" * (-len(data) % 4)
    xs = [int.from_bytes(padded[i:i + 4], "little") for i in range(0, len(padded), 4)]
    m = len(xs)
    s1 = (seed + sum(xs)) & _MASK
    s2 = sum((m - i) * x for i, x in enumerate(xs)) & _MASK
    return (s1 ^ (((s2 << 32) | (s2 >> 32)) & _MASK) ^ (8 * len(data))) & _MASK
