"""``ternary`` (bits 2): values in {-1, 0, +1} as 2-bit codes ``v + 1`` (0, 1, 2; code 3 is
invalid), little-endian bit order.

Input either
- an ``int8`` ternary array (e.g. ProWD's Q_Int2(W) of an integer device): decoded to the
  same ``int8`` values exactly, no aux; with the ``scale`` option (the value ``t = +1``
  stands for), the codes are sent exactly in the float form below (dtype ``float32``,
  aux ``{"scale": s}``, decoded as ``scale * t``): an integer device's own ternary
  forward weights with their magnitude in the shared domain; or
- a ``float32`` array: ``t = sign(x)`` where ``|x| > threshold`` else 0 (``threshold``:
  absolute, default ``0.7 * mean|x|``, the TWN rule), decoded as ``scale * t`` with aux
  ``{"scale": s}``; ``scale`` defaults to ``mean(|x|)`` over the kept elements (the
  least-squares scale for that support; 0 when none is kept).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from edge_client.codecs.base import CHUNK, Codec, count_nonfinite
from edge_client.codecs.bitpack import _pack_into, _unpack_into, packed_nbytes
from edge_client.codecs.integer import offset_pack_kernel
from edge_client.codecs.tensor import EncodedTensor
from edge_client.codecs.uplink import DeviceUpdate
from edge_client.compat import zip_strict
from edge_client.errors import CodecError, ProtocolError


@numba.njit(cache=True)
def ternarize_pack_kernel(x, thr, out):
    """Pack ``sign(x) * (|x| > thr) + 1`` (2 bits); returns (sum |x| kept, count kept)."""
    n = x.size
    q = np.empty(CHUNK, dtype=np.uint16)
    s = 0.0
    kept = 0
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        for i in range(m):
            v = np.float64(x[start + i])
            if v > thr:
                q[i] = 2
                s += v
                kept += 1
            elif v < -thr:
                q[i] = 0
                s -= v
                kept += 1
            else:
                q[i] = 1
        _pack_into(q, m, 2, out, (start * 2) >> 3)
    return s, kept


@numba.njit(cache=True)
def mean_abs(x):
    s = 0.0
    for i in range(x.size):
        s += abs(np.float64(x[i]))
    return s / x.size if x.size else 0.0


@numba.njit(cache=True)
def ternary_decode_kernel(data, n, scale, out):
    """``out[i] = (code_i - 1) * scale``; returns the first element with code 3, or -1."""
    q = np.empty(CHUNK, dtype=np.uint16)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        _unpack_into(data, start, m, 2, q)
        for i in range(m):
            c = q[i]
            if c == 3:
                return start + i
            out[start + i] = (np.float64(c) - 1.0) * scale
    return -1


class TernaryCodec(Codec):
    name = "ternary"
    bits_range = (2, 2)
    default_bits = 2
    lossy = True  # float input is thresholded; int8 input is exact (see is_lossy)
    finite_output = True  # {-1, 0, 1} or scale * {-1, 0, 1} with a finite float32 scale
    options = frozenset({"threshold", "scale"})
    device_input = "ternary_forward"
    integer_unit = "ternary_weight"  # an int8 code t stands for the ternary weight t = +1

    def examples(self, shape: tuple[int, ...], bits: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Float32 weights (the TWN rule) and int8 ternary codes (sent exactly)."""
        return [*super().examples(shape, bits, rng), rng.integers(-1, 2, shape).astype(np.int8)]

    def encode_update(self, u: DeviceUpdate, bits: int) -> tuple[EncodedTensor, ...]:
        """An integer device's own ternary forward weights (``u.ternary``), sent exactly
        with ``aux.scale = u.ternary_weight``, so that the coordinator decodes them to the
        weights the device computes with; else the shared values by the TWN rule."""
        if u.ternary is None:
            return super().encode_update(u, bits)
        return tuple(self.encode(np.ascontiguousarray(t, dtype=np.int8), bits, name=n, scale=u.ternary_weight)
                     for t, n in zip_strict(u.ternary, u.names))

    def is_lossy(self, t: EncodedTensor) -> bool:
        return t.dtype != "int8"

    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        b = self._bits(bits)
        self._options(options)
        a = self._array(x, ("int8", "float32"))
        flat = a.reshape(-1)
        out = np.empty(packed_nbytes(flat.size, b), dtype=np.uint8)
        if a.dtype == np.int8:
            if set(options) - {"scale"}:
                raise CodecError(f"codec {self.name!r}: options {sorted(set(options) - {'scale'})} "
                                 f"apply to float32 input only")
            bad = offset_pack_kernel(flat, 1, -1, 1, 2, out) if flat.size else -1
            if bad >= 0:
                raise CodecError(f"codec {self.name!r}: value {flat[bad]} at flat index {bad} is not in {{-1, 0, 1}}")
            if "scale" not in options:
                return self._tensor(a, b, out.tobytes(), {}, name)
            # the same codes, sent in the float form: decoded as scale * t
            scale = float(np.float32(_nonneg(options["scale"], "scale")))
            return EncodedTensor(shape=tuple(int(d) for d in a.shape), dtype="float32", codec=self.name,
                                 bits=b, data=out.tobytes(), aux={"scale": scale}, name=name)
        bad = count_nonfinite(flat) if flat.size else 0
        if bad:
            raise CodecError(f"codec {self.name!r}: input has {bad} non-finite (NaN/Inf) value(s)")
        thr = options.get("threshold")
        thr = 0.7 * mean_abs(flat) if thr is None else _nonneg(thr, "threshold")
        s, kept = ternarize_pack_kernel(flat, thr, out) if flat.size else (0.0, 0)
        scale = options.get("scale")
        scale = (s / kept if kept else 0.0) if scale is None else _nonneg(scale, "scale")
        return self._tensor(a, b, out.tobytes(), {"scale": float(np.float32(scale))}, name)

    def max_abs(self, t: EncodedTensor) -> float:
        """From the header: 1 for int8 tensors, ``aux.scale`` for float ones (the codes
        themselves are checked by :meth:`decode`)."""
        n, _ = self._check_encoded(t, ("int8", "float32"))
        if t.dtype == "int8":
            self._aux_keys(t, ())
            return 1.0 if n else 0.0
        self._aux_keys(t, ("scale",))
        scale = self._aux_float(t, "scale", nonneg=True)
        return scale if n else 0.0

    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        """int8 tensors decode to int8 (``out``: int8), float ones to ``scale * t``."""
        n, buf = self._check_encoded(t, ("int8", "float32"))
        if t.dtype == "int8":
            self._aux_keys(t, ())
            scale = 1.0
        else:
            self._aux_keys(t, ("scale",))
            scale = self._aux_float(t, "scale", nonneg=True)
        flat = self._out(t, n, out, t.dtype)
        bad = ternary_decode_kernel(buf, n, scale, flat) if n else -1
        if bad >= 0:
            raise ProtocolError(f"data: code 3 at element {bad} is not a ternary value")
        return flat.reshape(t.shape) if out is None else out


def _nonneg(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise CodecError(f"codec 'ternary': {what} must be a number, got {v!r}")
    f = float(v)
    if not np.isfinite(f) or f < 0:
        raise CodecError(f"codec 'ternary': {what} must be finite and >= 0, got {f!r}")
    return f
