"""What every registered codec promises, checked for each entry of the codec table
(``edge_client.codecs.CODECS``), so that a new codec is covered without editing a test:
its declared attributes, round trips of odd-sized and empty tensors through it and through
the wire, decoding into a buffer and accumulating bit for bit in the documented form, the
``max_abs`` bound, encode-side errors (``CodecError``), and malformed or fuzzed received
tensors (``ProtocolError``, never anything else, with nothing added to a sum).

Each codec's inputs come from its own :meth:`Codec.examples`; what one codec does beyond
this (reference implementations, its own aux rules) is in ``test_codecs*.py``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.codecs import (
    CODECS,
    DeviceUpdate,
    available_codecs,
    decode,
    encode,
    get_codec,
    max_abs,
    unpack,
)
from edge_client.codecs.affine import AffineAccumulator
from edge_client.errors import CodecError, ProtocolError
from edge_client.protocol import (
    DTYPES,
    UPDATE_CONTENTS,
    EncodedTensor,
    Update,
    decode_message,
    encode_message,
)
from edge_client.protocol import packed_length as wire_length

#: widths with their own code paths somewhere (sub-byte, byte, past a byte, the ends)
WIDTHS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)
SHAPES = [(0,), (3, 0, 2), (1,), (7,), (13, 11), (4097,)]


def widths(name: str) -> list[int]:
    c = CODECS[name]
    lo, hi = c.bits_range
    return sorted({lo, hi, c.default_bits} | {b for b in WIDTHS if lo <= b <= hi})


CASES = [(name, bits) for name in CODECS for bits in widths(name)]
ACCUMULATING = [(name, bits) for name, bits in CASES if CODECS[name].accumulates]


def inputs(name: str, shape: tuple[int, ...], bits: int, seed: int = 0) -> list[np.ndarray]:
    return CODECS[name].examples(shape, bits, np.random.default_rng([seed, bits, math.prod(shape)]))


def good(name: str, shape: tuple[int, ...] = (9,)) -> list[EncodedTensor]:
    """One tensor per kind of input the codec takes, at its default width."""
    c = CODECS[name]
    return [c.encode(x, c.default_bits, name="w") for x in inputs(name, shape, c.default_bits)]


def reference_sum(t: EncodedTensor, acc: np.ndarray, weight: float) -> np.ndarray:
    """``acc + w * decode(t)`` as :meth:`Codec.decode_accumulate` documents it, in ``acc``'s
    dtype T: the affine form ``acc + (T(w lo) + q T(w step))`` for an affine code, else
    ``acc + T(w) * T(y)``."""
    T = acc.dtype.type
    add = get_codec(t.codec).accumulator(t)
    if isinstance(add, AffineAccumulator):
        q = unpack(t.data, add.n, add.bits).reshape(acc.shape).astype(T)
        return acc + (T(weight * add.lo) + q * T(weight * add.step))
    return acc + T(weight) * decode(t).astype(T)


# ---------------------------------------------------------------- the table


@pytest.mark.parametrize("name", sorted(CODECS))
def test_declared_attributes(name: str) -> None:
    c = CODECS[name]
    lo, hi = c.bits_range
    assert c.name == name and get_codec(name) is c and name in available_codecs()
    assert 1 <= lo <= c.default_bits <= hi <= 32
    assert all(isinstance(o, str) for o in c.options) and not {"bits", "name"} & c.options
    assert c.device_input in ("shared", "integers", "ternary_forward")
    assert c.default_content in UPDATE_CONTENTS
    assert c.integer_unit in ("grid_step", "ternary_weight")
    if c.wire_dtype:  # raw IEEE floats: one width, the dtype's
        assert lo == hi == np.dtype(c.wire_dtype).itemsize * 8
    assert available_codecs() == tuple(sorted(CODECS))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_example_travels_the_wire_unchanged(name: str) -> None:
    ts = tuple(dataclasses.replace(t, name=f"layer{i}") for i, t in enumerate(good(name, (5, 3)) + good(name, (0,))))
    u = Update("dev", 1, 3, 8, "weights", ts)
    assert decode_message(encode_message(u)) == u


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES[:-1])
@pytest.mark.parametrize(("name", "bits"), CASES)
def test_round_trip(name: str, bits: int, shape: tuple[int, ...]) -> None:
    c = CODECS[name]
    for x in inputs(name, shape, bits):
        t = c.encode(x, bits, name="layer0")
        assert (t.shape, t.dtype, t.codec, t.bits, t.name) == (shape, t.dtype, name, bits, "layer0")
        assert t.dtype in DTYPES and len(t.data) == t.nbytes == wire_length(math.prod(shape), bits)
        assert isinstance(t.aux, dict) and all(isinstance(k, str) for k in t.aux)
        y = c.decode(t)
        assert y.shape == shape and y.dtype == np.dtype(t.dtype) and y.flags.writeable
        assert np.isfinite(y.astype(np.float64)).all()
        if not c.is_lossy(t):
            assert y.dtype == x.dtype and np.array_equal(y, x)
        assert c.encode(x, bits, name="layer0") == t  # deterministic
        assert c.encode(np.asfortranarray(x), bits, name="layer0") == t  # any memory layout
        bound = max_abs(t)
        assert isinstance(bound, float) and bound >= (float(np.abs(y.astype(np.float64)).max()) if y.size else 0.0)
        if not y.size:
            assert bound == 0.0


@pytest.mark.parametrize("shape", [(1,), (7,), (4097,), (33, 65)])
@pytest.mark.parametrize(("name", "bits"), CASES)
def test_decode_into_a_buffer_is_bit_exact(name: str, bits: int, shape: tuple[int, ...]) -> None:
    for x in inputs(name, shape, bits, seed=1):
        t = encode(x, name, bits)
        ref = decode(t)
        buf = np.full(shape, 7, ref.dtype)
        assert decode(t, out=buf) is buf and np.array_equal(buf, ref)
        # a buffer 4 bytes off an 8-byte boundary (table paths read pairs)
        raw = np.zeros(ref.nbytes + 16, np.uint8)
        off = (4 - raw.ctypes.data) % 8
        view = raw[off:off + ref.nbytes].view(ref.dtype).reshape(shape)
        assert view.ctypes.data % 8 == 4 and np.array_equal(decode(t, out=view), ref)


@pytest.mark.parametrize("shape", [(0,), (1,), (9,), (4099,), (17, 31)])
@pytest.mark.parametrize(("name", "bits"), ACCUMULATING)
def test_accumulate_equals_decode_then_add(name: str, bits: int, shape: tuple[int, ...]) -> None:
    """Bit for bit in the documented form, for float32 and float64 sums and any weight."""
    for x in inputs(name, shape, bits, seed=2):
        t = encode(x, name, bits)
        y = decode(t).astype(np.float64)
        top = max_abs(t)  # an affine code's roundings are at the scale of its range, not of y
        for dtype in (np.float32, np.float64):
            acc = np.random.default_rng(5).normal(0, 1, shape).astype(dtype)
            for weight in (0.37, 1, -2.5e-3):
                before = acc.copy()
                want = reference_sum(t, acc, weight)
                get_codec(name).decode_accumulate(t, acc, weight)
                assert acc.dtype == dtype and np.array_equal(acc, want)
                # and within a few ulps of decode-then-add
                tol = (abs(weight) * float(np.spacing(np.float32(top)))
                       + 8 * float(np.spacing(dtype(abs(weight) * top + np.abs(before).max(initial=0)))))
                np.testing.assert_allclose(acc, before + weight * y, rtol=0, atol=tol)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_device_update_encodes_layer_by_layer(name: str) -> None:
    """``encode_update`` gives one tensor per layer, named and shaped as the model's, from
    an integer device (integers, ternary weights) and from a float device."""
    c = CODECS[name]
    rng = np.random.default_rng(3)
    shapes = [(4, 3), (0,), (5,)]
    shared = [rng.normal(0, 0.05, s).astype(np.float32) for s in shapes]
    ints = [rng.integers(-64, 64, s).astype(np.int8) for s in shapes]
    tern = [rng.integers(-1, 2, s).astype(np.int8) for s in shapes]
    for u in (DeviceUpdate(["a", "b", "c"], shared, 8, integers=ints, ternary=tern, ternary_weight=0.5),
              DeviceUpdate(["a", "b", "c"], shared, 32, delta=True, sigma_g=(0.1, 0.1, 0.1))):
        if c.integer_only and u.integers is None:
            continue
        ts = c.encode_update(u, c.default_bits)
        assert [t.name for t in ts] == ["a", "b", "c"]
        assert [decode(t).shape for t in ts] == shapes


@pytest.mark.parametrize("name", sorted(CODECS))
def test_bad_buffers_are_codec_errors_and_left_untouched(name: str) -> None:
    c = CODECS[name]
    for t in good(name, (6, 5)):
        y = decode(t)
        ro = np.zeros_like(y)
        ro.flags.writeable = False
        for bad in (np.empty((5, 6), y.dtype), np.empty(30, y.dtype), np.empty((6, 5), np.complex64),
                    np.empty((5, 6), y.dtype).T, [0.0] * 30, ro):
            with pytest.raises(CodecError):
                decode(t, out=bad)
        if not c.accumulates:
            with pytest.raises(CodecError, match="decode_accumulate"):
                c.decode_accumulate(t, np.zeros((6, 5), np.float32), 1.0)
            continue
        for acc in (np.zeros((5, 6)), np.zeros((6, 5), np.int32), np.zeros((6, 5), np.float16),
                    np.zeros((5, 6)).T, ro.astype(np.float32)):
            if acc.dtype == np.float32:
                acc.flags.writeable = False
            with pytest.raises(CodecError):
                c.decode_accumulate(t, acc, 1.0)
        acc = np.ones((6, 5), np.float32)
        for w in (float("nan"), float("inf"), True, "1", None):
            with pytest.raises(CodecError):
                c.decode_accumulate(t, acc, w)
        assert np.all(acc == 1.0)


# ---------------------------------------------------------------- encode-side errors


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encode_names_what_is_wrong(name: str) -> None:
    c = CODECS[name]
    lo, hi = c.bits_range
    x = inputs(name, (6,), c.default_bits)[0]
    for bits in (lo - 1, hi + 1, 0, 2.5, "4", True):
        with pytest.raises(CodecError, match="bits"):
            c.encode(x, bits)
    for bad in (np.zeros(4, np.float64), np.zeros(4, np.bool_), np.zeros(4, np.uint8), np.zeros(4, np.complex64)):
        with pytest.raises(CodecError, match="dtype"):
            c.encode(bad)
    with pytest.raises(CodecError, match="numpy array"):
        c.encode([0.0, 1.0])
    with pytest.raises(CodecError, match="unknown option"):
        c.encode(x, c.default_bits, no_such_option=1)
    for x in inputs(name, (10,), c.default_bits):
        if x.dtype.kind == "f":
            x[[2, 7]] = np.nan
            with pytest.raises(CodecError, match=rf"'{name}'.*2 non-finite"):
                c.encode(x, c.default_bits)


# ---------------------------------------------------------------- received tensors


def _all_reject(t: EncodedTensor, match: str, shape: tuple[int, ...] = (9,)) -> None:
    """decode, max_abs and (where the codec accumulates) accumulate into a sum of
    ``shape`` reject ``t`` naming ``match``, and the sum is left as it was."""
    c = CODECS[t.codec] if t.codec in CODECS else None
    for call in (decode, max_abs):
        with pytest.raises(ProtocolError, match=match):
            call(t)
    if c is not None and c.accumulates:
        acc = np.ones(shape, np.float32)
        with pytest.raises(ProtocolError, match=match):
            c.decode_accumulate(t, acc, 1.0)
        assert np.all(acc == 1.0)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_malformed_headers_are_protocol_errors(name: str) -> None:
    lo, hi = CODECS[name].bits_range
    other = next(n for n in sorted(CODECS) if n != name)
    for t in good(name):
        _all_reject(dataclasses.replace(t, data=t.data + b"\0"), "data")
        _all_reject(dataclasses.replace(t, data=t.data[:-1]), "data")
        for bits in (lo - 1, hi + 1, 99, True, "4", None):
            _all_reject(dataclasses.replace(t, bits=bits), "bits")
        for dtype in ("float64", "complex64", 7):
            _all_reject(dataclasses.replace(t, dtype=dtype), "dtype")
        for shape in ((-9,), (2.5,), "9", None):
            _all_reject(dataclasses.replace(t, shape=shape), "shape")
        _all_reject(dataclasses.replace(t, codec="no-such-codec"), "codec")
        with pytest.raises(ProtocolError, match="codec"):
            get_codec(other).decode(t)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_bad_aux_is_a_protocol_error_naming_the_field(name: str) -> None:
    for t in good(name):
        _all_reject(dataclasses.replace(t, aux={**t.aux, "extra": 1}), "aux.extra")
        _all_reject(dataclasses.replace(t, aux=[1.0]), "aux")
        for key, value in t.aux.items():
            rest = {k: v for k, v in t.aux.items() if k != key}
            _all_reject(dataclasses.replace(t, aux=rest), f"aux.{key}")
            for bad in ("x", None, float("nan"), float("inf"), [value, value] if not isinstance(value, list) else "x"):
                _all_reject(dataclasses.replace(t, aux={**t.aux, key: bad}), f"aux.{key}")


_F32_MAX = float(np.finfo(np.float32).max)
_NUMBERS = st.one_of(st.sampled_from([_F32_MAX, -_F32_MAX, 1e-45, 0.0, 1.0, -3.0e38, 2.0]),
                     st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**40, 2**40))
_AUX_VALUES = st.one_of(_NUMBERS, st.booleans(), st.text(max_size=3), st.none(), st.lists(_NUMBERS, max_size=4))


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fuzzed_tensors_decode_consistently_or_raise_protocol_errors(name: str, data: st.DataObject) -> None:
    """Random payloads, aux values, widths and dtypes on a valid tensor: a
    :class:`ProtocolError` and nothing added, or a decode whose values are finite where the
    codec promises it, bounded by ``max_abs``, and added to a sum in the documented form."""
    c = CODECS[name]
    base = data.draw(st.sampled_from(good(name, (data.draw(st.integers(0, 40)),))))
    lo, hi = c.bits_range
    bits = data.draw(st.one_of(st.just(base.bits), st.integers(lo, hi), st.integers(-1, 40)))
    n = base.size
    length = data.draw(st.one_of(st.just(wire_length(n, bits) if bits > 0 else 0), st.integers(0, 64)))
    aux = dict(base.aux)
    if aux and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(aux)))
        aux[key] = data.draw(_AUX_VALUES) if not isinstance(aux[key], list) else \
            data.draw(st.lists(_NUMBERS, min_size=len(aux[key]), max_size=len(aux[key])) | _AUX_VALUES)
    dtype = data.draw(st.one_of(st.just(base.dtype), st.sampled_from(sorted(DTYPES) + ["float64"])))
    t = EncodedTensor(base.shape, dtype, name, bits, data.draw(st.binary(min_size=length, max_size=length)), aux)
    acc0 = np.random.default_rng(n).normal(0, 1, n).astype(np.float32).reshape(base.shape)
    try:
        y = c.decode(t)
    except ProtocolError:
        if c.accumulates:
            acc = acc0.copy()
            with pytest.raises(ProtocolError):
                c.decode_accumulate(t, acc, 0.5)
            assert np.array_equal(acc, acc0)
        return
    assert y.shape == t.shape and y.dtype == np.dtype(t.dtype)
    y64 = y.astype(np.float64)
    if c.finite_output:
        assert np.isfinite(y64).all()
    if np.isfinite(y64).all():
        assert max_abs(t) >= (float(np.abs(y64).max()) if y.size else 0.0)
    if c.accumulates:
        acc = acc0.copy()
        want = reference_sum(t, acc, 0.5)
        with np.errstate(over="ignore", invalid="ignore"):
            c.decode_accumulate(t, acc, 0.5)
        assert np.array_equal(acc, want, equal_nan=True)
