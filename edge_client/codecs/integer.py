"""``int``: the native s-bit signed integers of an integer device (ProWD), bits 2..16.

Input: an ``int8`` (bits <= 8) or ``int16`` (bits <= 16) array whose values fit in s-bit
two's complement, ``[-2**(s-1), 2**(s-1) - 1]``. Stored offset-binary (``v + 2**(s-1)``,
an unsigned s-bit field, little-endian bit order); decoded bit-exactly to the same dtype.
No aux. Lossless.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from edge_client.codecs.affine import AffineAccumulator
from edge_client.codecs.base import CHUNK, Codec
from edge_client.codecs.bitpack import _pack_into, _unpack_into, packed_nbytes
from edge_client.codecs.tensor import EncodedTensor, float32_tensor
from edge_client.codecs.uplink import DeviceUpdate
from edge_client.compat import zip_strict
from edge_client.errors import CodecError, ProtocolError

_WIDTH = {"int8": 8, "int16": 16}


@numba.njit(cache=True)
def offset_pack_kernel(x, offset, lo, hi, bits, out):
    """Pack ``x + offset`` for ``x`` in [lo, hi]; returns -1 or the first index out of range."""
    n = x.size
    for i in range(n):
        v = np.int64(x[i])
        if v < lo or v > hi:
            return i
    q = np.empty(CHUNK, dtype=np.uint16)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        for i in range(m):
            q[i] = np.uint16(np.int64(x[start + i]) + offset)
        _pack_into(q, m, bits, out, (start * bits) >> 3)
    return -1


@numba.njit(cache=True)
def offset_unpack_kernel(data, n, bits, offset, out):
    """``out[i] = field_i - offset`` (``out``: an integer array of the decoded dtype)."""
    q = np.empty(CHUNK, dtype=np.uint16)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _unpack_into(data, start, m, bits, q)
        for i in range(m):
            out[start + i] = np.int64(q[i]) - offset


class IntCodec(Codec):
    name = "int"
    bits_range = (2, 16)
    default_bits = 8
    lossy = False
    finite_output = True
    accumulates = True  # the integers, as the accumulator's float dtype
    device_input = "integers"

    def encode_update(self, u: DeviceUpdate, bits: int) -> tuple[EncodedTensor, ...]:
        """The device's own integers (``u.integers``) with ``bits`` bits, or its storage
        grid's width for a layer whose integers need more (an Int6 device keeps its
        weights on the 8-bit grid, docs/algorithms.md §1); a change (``u.delta``) in the
        fewest bits that hold it. Without integers (a change beyond 16 bits) the shared
        values go as float32."""
        if u.integers is None:
            return tuple(float32_tensor(w, n) for w, n in zip_strict(u.shared, u.names))
        from edge_client.intnn.quant import storage_grid_bits

        grid = storage_grid_bits(u.compute_bits)
        out = []
        for q, n in zip_strict(u.integers, u.names):
            need = int(np.abs(q.astype(np.int64)).max(initial=0)).bit_length() + 1
            if u.delta:
                out.append(self.encode(q, max(2, need), name=n))
                continue
            b = bits if need <= bits else max(bits, grid)
            try:
                out.append(self.encode(q, b, name=n))
            except CodecError:
                out.append(self.encode(q, grid, name=n))
        return tuple(out)

    def examples(self, shape: tuple[int, ...], bits: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Integers over the whole ``bits``-bit range: int8 (``bits`` <= 8) and int16."""
        half = 1 << (bits - 1)
        q = rng.integers(-half, half, shape).astype(np.int16)
        return [q.astype(np.int8), q] if bits <= 8 else [q]

    def bits_problem(self, bits: int, compute_bits: int) -> str | None:
        """An s-bit device sends its storage grid's width (docs/algorithms.md §1)."""
        if compute_bits >= 32:
            return "needs an integer device"
        from edge_client.intnn.quant import storage_grid_bits

        grid = storage_grid_bits(compute_bits)
        return None if bits == grid else f"must be the storage grid max(s, 8) = {grid} of a {compute_bits}-bit device"

    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        """``x``: int8/int16 array; ``bits=None`` means the dtype's width. No aux."""
        self._options(options)
        a = self._array(x, ("int8", "int16"))
        b = self._bits(_WIDTH[a.dtype.name] if bits is None else bits)
        if b > _WIDTH[a.dtype.name]:
            raise CodecError(f"codec {self.name!r}: {a.dtype.name} input takes bits <= {_WIDTH[a.dtype.name]}, got {b}")
        flat = a.reshape(-1)
        half = 1 << (b - 1)
        out = np.empty(packed_nbytes(flat.size, b), dtype=np.uint8)
        bad = offset_pack_kernel(flat, half, -half, half - 1, b, out) if flat.size else -1
        if bad >= 0:
            raise CodecError(
                f"codec {self.name!r}: value {flat[bad]} at flat index {bad} does not fit in "
                f"{b}-bit signed range [{-half}, {half - 1}]"
            )
        return self._tensor(a, b, out.tobytes(), {}, name)

    def _checked(self, t: EncodedTensor) -> tuple[int, np.ndarray]:
        n, buf = self._check_encoded(t, ("int8", "int16"))
        self._aux_keys(t, ())
        if t.bits > _WIDTH[t.dtype]:
            raise ProtocolError(f"bits: {t.bits} does not fit dtype {t.dtype}")
        return n, buf

    def max_abs(self, t: EncodedTensor) -> float:
        """From the header: ``2**(bits-1)``, the most negative ``bits``-bit integer."""
        n, _ = self._checked(t)
        return float(1 << (int(t.bits) - 1)) if n else 0.0

    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Decodes to ``t.dtype`` (int8/int16); ``out`` must have that dtype."""
        n, buf = self._checked(t)
        flat = self._out(t, n, out, t.dtype)
        if n:
            offset_unpack_kernel(buf, n, int(t.bits), 1 << (int(t.bits) - 1), flat)
        return flat.reshape(t.shape) if out is None else out

    def accumulator(self, t: EncodedTensor) -> AffineAccumulator:
        """``add(acc, weight)``: ``acc += weight * decode(t)``, the integers ``q - 2**(s-1)``
        as an affine code (``lo = -2**(s-1)``, ``step = 1``; exact while ``weight * 2**s``
        is representable). A coordinator maps an integer device's values to the shared
        domain with :meth:`AffineAccumulator.scaled` (see :meth:`Codec.accumulator`)."""
        n, buf = self._checked(t)
        b = int(t.bits)
        return AffineAccumulator(t, self._acc, buf, n, b, -float(1 << (b - 1)), 1.0)
