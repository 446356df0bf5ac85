"""The codec interface and the checks every codec shares.

A codec turns one tensor into an :class:`~edge_client.codecs.tensor.EncodedTensor` (``encode``)
and back (``decode``). Encoding checks the caller's input and raises :class:`CodecError`;
decoding checks a *received* tensor and raises :class:`ProtocolError` naming the field.

Empty tensors (a zero in the shape) are supported by every codec: the payload is empty and
the aux carries neutral values (zeros), so one layer of size 0 never needs special cases.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numba
import numpy as np

from edge_client.codecs.bitpack import as_byte_array, check_bits
from edge_client.codecs.tensor import EncodedTensor
from edge_client.codecs.uplink import DeviceUpdate
from edge_client.compat import zip_strict
from edge_client.errors import CodecError, ProtocolError

#: Elements per chunk in the fused kernels (a multiple of 8, so chunk boundaries are byte
#: boundaries for every bit width; 4096 uint16 scratch values stay in L1).
CHUNK = 4096


class Codec(ABC):
    """One uplink/downlink codec. Instances are stateless and shared by the registry."""

    #: registry name, equal to ``EncodedTensor.codec``
    name: ClassVar[str]
    #: inclusive range of ``bits`` accepted by ``encode``
    bits_range: ClassVar[tuple[int, int]]
    #: ``bits`` used when ``encode`` is called with ``bits=None``
    default_bits: ClassVar[int]
    #: False when a decode gives back exactly what was encoded, for every accepted input
    lossy: ClassVar[bool] = True
    #: True when ``decode`` can only produce finite values: it verifies them while decoding
    #: (float32, float16) or draws them from a validated finite table (kmeans codebook,
    #: ternary scale) or they are integers. A receiver may then skip its own NaN/Inf pass.
    finite_output: ClassVar[bool] = False
    #: ``encode`` options accepted besides ``bits`` and ``name``
    options: ClassVar[frozenset[str]] = frozenset()
    #: True when :meth:`decode_accumulate` is supported (float32 or integer decoded values)
    accumulates: ClassVar[bool] = False
    #: the numpy dtype of a payload of raw IEEE floats (``"<f4"``), which the wire checks
    #: for NaN/Inf before it builds the tensor; empty for packed codes
    wire_dtype: ClassVar[str] = ""
    #: what :meth:`encode_update` encodes of a device's round: ``"shared"`` (its float32
    #: shared-domain weights), ``"integers"`` (an integer device's own grid integers: the
    #: codec is :attr:`integer_only`) or ``"ternary_forward"`` (an integer device's ternary
    #: forward weights, where it has them; else the shared ones)
    device_input: ClassVar[str] = "shared"
    #: what an update holds when the announcement does not say: ``"weights"`` or ``"delta"``
    default_content: ClassVar[str] = "weights"
    #: what one unit of an integer-dtype decode stands for in the shared domain:
    #: ``"grid_step"`` (one step of the sending device's storage grid, ``1/2^(max(s,8)-1)``)
    #: or ``"ternary_weight"`` (the weight ``t = +1`` computes with in the integer forward)
    integer_unit: ClassVar[str] = "grid_step"

    @property
    def integer_only(self) -> bool:
        """Whether only an integer device (trainer ``int``) can send this codec."""
        return self.device_input == "integers"

    def bits_problem(self, bits: int, compute_bits: int) -> str | None:
        """Why a device computing with ``compute_bits`` bits (32: a float device) may not
        name this codec with ``bits`` in its hardware profile, beyond :attr:`bits_range`
        (which the caller checks first); None when it may."""
        return None

    @abstractmethod
    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        """Encode ``x`` with ``bits`` bits per element (``None``: ``default_bits``)."""

    @abstractmethod
    def decode(self, t: EncodedTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Decode ``t`` to a new writable array of shape ``t.shape`` and dtype ``t.dtype``,
        or into ``out`` (a writable C-contiguous array of exactly that shape and dtype,
        :class:`CodecError` otherwise), which is returned. On a ProtocolError ``out``'s
        contents are unspecified."""

    def decode_accumulate(self, t: EncodedTensor, acc: np.ndarray, weight: float) -> None:
        """``acc += weight * decode(t)`` in one pass with no temporary array.

        ``acc``: writable C-contiguous float32 or float64 array of shape ``t.shape``;
        ``weight``: a finite number. Every element does ``acc[i] + w * y[i]`` with
        ``w = acc.dtype.type(weight)``, each operation rounded to ``acc``'s dtype (numpy's
        ``acc += w * y.astype(acc.dtype)``). ASYM and ``int`` add their affine form
        instead, ``acc[i] + (T(w·lo) + q_i·T(w·step))`` (exact for ``int``; see
        :mod:`edge_client.codecs.fused`). ``acc`` is untouched when ``t`` is rejected.
        Codecs without :attr:`accumulates` raise :class:`CodecError`.
        """
        self.accumulator(t)(acc, weight)

    def accumulator(self, t: EncodedTensor) -> Callable[[np.ndarray, float], None]:
        """Validate ``t`` now (the :class:`ProtocolError` :meth:`decode` would raise) and
        return ``add(acc, weight)``, which does :meth:`decode_accumulate` without checking
        ``t`` again (only ``acc`` and ``weight``: :class:`CodecError`). So an update of many
        tensors is checked whole before any of it is added. :class:`CodecError` when the
        codec does not support accumulation (:attr:`accumulates` is False)."""
        raise CodecError(f"codec {self.name!r}: decode_accumulate is not supported")

    def is_lossy(self, t: EncodedTensor) -> bool:
        """Whether this particular encoded tensor may differ from what was encoded."""
        return self.lossy

    def max_abs(self, t: EncodedTensor) -> float:
        """An upper bound of ``|v|`` over the values :meth:`decode` gives for ``t`` (0.0
        for an empty tensor), in the decoded dtype's units; :class:`ProtocolError` where
        ``decode`` would raise one. A receiver checks it against its magnitude limit
        before adding the tensor to anything. Codecs with a table or an affine code bound
        it from the header alone; this default decodes."""
        a = self.decode(t)
        return float(np.max(np.abs(a.astype(np.float64, copy=False)))) if a.size else 0.0

    def encode_update(self, u: DeviceUpdate, bits: int) -> tuple[EncodedTensor, ...]:
        """A device's round on the uplink, one tensor per layer named as ``u.names``: by
        default its float32 ``shared`` layers through :meth:`encode` with ``bits`` and
        :meth:`update_options`. A codec that sends something else of a device (its
        integers, its ternary weights: :attr:`device_input`) overrides it."""
        return tuple(self.encode(np.ascontiguousarray(w, dtype=np.float32), bits, name=n,
                                 **self.update_options(u, i))
                     for i, (w, n) in enumerate(zip_strict(u.shared, u.names)))

    def update_options(self, u: DeviceUpdate, layer: int) -> dict[str, Any]:
        """The :meth:`encode` options for layer ``layer`` of a device's round (none)."""
        return {}

    def examples(self, shape: tuple[int, ...], bits: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Valid :meth:`encode` inputs of ``shape`` at ``bits``, one per kind of input the
        codec takes (what conformance tests and benchmarks feed it): by default float32
        weights, N(0.01, 0.05) with every 97th value 40 times larger (heavy tails)."""
        x = rng.normal(0.01, 0.05, shape).astype(np.float32)
        x.reshape(-1)[::97] *= 40
        return [x]

    def __repr__(self) -> str:
        return f"<codec {self.name} bits {self.bits_range[0]}..{self.bits_range[1]}>"

    # ------------------------------------------------------------------ encode-side checks

    def _bits(self, bits: int | None) -> int:
        if bits is None:
            return self.default_bits
        return check_bits(bits, *self.bits_range, who=f"codec {self.name!r}")

    def _options(self, options: dict[str, Any]) -> None:
        unknown = sorted(set(options) - self.options)
        if unknown:
            allowed = ", ".join(sorted(self.options)) or "none"
            raise CodecError(f"codec {self.name!r}: unknown option(s) {unknown}; accepted: {allowed}")

    def _array(self, x: object, dtypes: tuple[str, ...]) -> np.ndarray:
        """``x`` as a C-contiguous array of one of ``dtypes`` (no copy when it already is)."""
        if not isinstance(x, np.ndarray):
            raise CodecError(f"codec {self.name!r}: expected a numpy array, got {type(x).__name__}")
        if x.dtype.name not in dtypes:
            raise CodecError(
                f"codec {self.name!r}: dtype {x.dtype.name} not accepted; expected {' or '.join(dtypes)}"
            )
        return np.ascontiguousarray(x)

    def _finite(self, x: np.ndarray) -> None:
        bad = count_nonfinite(x.reshape(-1)) if x.size else 0
        if bad:
            raise CodecError(f"codec {self.name!r}: input has {bad} non-finite (NaN/Inf) value(s)")

    def _tensor(self, x: np.ndarray, bits: int, data: bytes, aux: dict[str, Any], name: str) -> EncodedTensor:
        return EncodedTensor(
            shape=tuple(int(d) for d in x.shape),
            dtype=x.dtype.name,
            codec=self.name,
            bits=bits,
            data=data,
            aux=aux,
            name=name,
        )

    # ------------------------------------------------------------------ decode-side checks

    def _check_encoded(self, t: EncodedTensor, dtypes: tuple[str, ...]) -> tuple[int, np.ndarray]:
        """Validate the generic fields; return (element count, payload as a uint8 array)."""
        if not isinstance(t, EncodedTensor):
            raise ProtocolError(f"codec {self.name!r}: expected an EncodedTensor, got {type(t).__name__}")
        if t.codec != self.name:
            raise ProtocolError(f"codec: tensor says {t.codec!r}, decoder is {self.name!r}")
        lo, hi = self.bits_range
        if isinstance(t.bits, bool) or not isinstance(t.bits, (int, np.integer)) or not lo <= t.bits <= hi:
            raise ProtocolError(f"bits: {t.bits!r} out of range {lo}..{hi} for codec {self.name!r}")
        if t.dtype not in dtypes:
            raise ProtocolError(f"dtype: {t.dtype!r} not valid for codec {self.name!r}; expected {' or '.join(dtypes)}")
        n = shape_size(t.shape)
        buf = as_byte_array(t.data, n, int(t.bits))
        return n, buf

    def _out(self, t: EncodedTensor, n: int, out: np.ndarray | None, dtype: str = "float32") -> np.ndarray:
        """The flat array to decode into: a new one, or a 1-D view of the caller's ``out``
        after checking it (CodecError: not an ndarray, wrong shape/dtype, not writable or
        not C-contiguous)."""
        if out is None:
            return np.empty(n, dtype=dtype)
        self._check_buffer(t, out, "out", (dtype,))
        return out.reshape(-1)

    def _check_buffer(self, t: EncodedTensor, a: object, what: str, dtypes: tuple[str, ...]) -> np.ndarray:
        if not isinstance(a, np.ndarray):
            raise CodecError(f"codec {self.name!r}: {what} must be a numpy array, got {type(a).__name__}")
        if a.dtype.name not in dtypes:
            raise CodecError(f"codec {self.name!r}: {what} dtype {a.dtype.name}, expected {' or '.join(dtypes)}")
        if a.shape != tuple(int(d) for d in t.shape):
            raise CodecError(f"codec {self.name!r}: {what} shape {a.shape}, expected {tuple(t.shape)}")
        if not (a.flags.c_contiguous and a.flags.writeable and a.flags.aligned):
            raise CodecError(f"codec {self.name!r}: {what} must be writable, aligned and C-contiguous")
        return a.reshape(-1)

    def _acc(self, t: EncodedTensor, acc: object, weight: object) -> tuple[np.ndarray, np.floating]:
        """Checked ``(flat acc, weight as acc's dtype)`` for :meth:`decode_accumulate`."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
            raise CodecError(f"codec {self.name!r}: weight must be a number, got {weight!r}")
        if not math.isfinite(float(weight)):
            raise CodecError(f"codec {self.name!r}: weight must be finite, got {weight!r}")
        flat = self._check_buffer(t, acc, "acc", ("float32", "float64"))
        return flat, flat.dtype.type(weight)

    def _aux_keys(self, t: EncodedTensor, keys: tuple[str, ...]) -> None:
        if not isinstance(t.aux, dict):
            raise ProtocolError(f"aux: expected a map, got {type(t.aux).__name__}")
        missing = [k for k in keys if k not in t.aux]
        extra = sorted(set(t.aux) - set(keys))
        if missing:
            raise ProtocolError(f"aux.{missing[0]}: missing for codec {self.name!r}")
        if extra:
            raise ProtocolError(f"aux.{extra[0]}: not a field of codec {self.name!r}")

    def _aux_float(self, t: EncodedTensor, key: str, *, nonneg: bool = False) -> float:
        v = t.aux[key]
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ProtocolError(f"aux.{key}: expected a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f) or abs(f) > float(np.finfo(np.float32).max):
            raise ProtocolError(f"aux.{key}: {f!r} is not a finite float32", reason="nonfinite")
        if nonneg and f < 0:
            raise ProtocolError(f"aux.{key}: {f!r} must be >= 0")
        return f


def shape_size(shape: object) -> int:
    """Number of elements of a wire ``shape`` (ProtocolError when it is not a tuple of ints >= 0)."""
    if not isinstance(shape, (tuple, list)):
        raise ProtocolError(f"shape: expected a sequence of ints, got {type(shape).__name__}",
                            reason="wrong_shape")
    n = 1
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ProtocolError(f"shape: {shape!r} must contain ints >= 0", reason="wrong_shape")
        n *= int(d)
    return n


@numba.njit(cache=True)
def count_nonfinite(x):
    """Number of NaN/Inf values in a 1-D float array."""
    bad = 0
    for i in range(x.size):
        if not np.isfinite(x[i]):
            bad += 1
    return bad


@numba.njit(cache=True)
def scan_float(x):
    """One pass over a 1-D float32 array: (min, max, mean, count of NaN/Inf).

    min/max/mean are over the finite values (0.0 when there are none); float64.
    """
    lo = np.inf
    hi = -np.inf
    s = 0.0
    bad = 0
    for i in range(x.size):
        v = np.float64(x[i])
        if np.isfinite(v):
            if v < lo:
                lo = v
            if v > hi:
                hi = v
            s += v
        else:
            bad += 1
    good = x.size - bad
    if good == 0:
        return 0.0, 0.0, 0.0, bad
    return lo, hi, s / good, bad
