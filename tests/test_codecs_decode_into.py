"""Server-side decode: ``decode(t, out=buf)`` bit-exact against ``decode(t)``, and
``decode_accumulate(t, acc, w)`` bit-exact against numpy's ``acc += w * y.astype(acc.dtype)``
(the documented rounding: one multiply and one add in the accumulator's dtype, see
:mod:`edge_client.codecs.fused`), or for ASYM its affine form
``acc += T(w*lo) + q.astype(T) * T(w*step)``, for every float codec, width and odd/even
length."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from edge_client.codecs import (
    available_codecs,
    decode,
    decode_accumulate,
    encode,
    get_codec,
    unpack,
)
from edge_client.errors import CodecError, ProtocolError
from edge_client.protocol import EncodedTensor, packed_length

CASES = [
    *[("asym", b) for b in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)],
    *[("kmeans", b) for b in (1, 2, 3, 4, 6, 8)],
    *[("danuq", b) for b in (1, 2, 4, 8)],
    ("float32", 32),
    ("float16", 16),
]


def sample(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.01, 0.05, shape).astype(np.float32)
    x.flat[::97] *= 40  # some heavy tails
    return x


@pytest.mark.parametrize("codec,bits", CASES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (4096,), (4097,), (33, 65)])
def test_decode_into_out_is_bit_exact(codec, bits, shape):
    t = encode(sample(shape, bits), codec, bits)
    ref = decode(t)
    buf = np.full(shape, np.nan, np.float32)
    got = decode(t, out=buf)
    assert got is buf
    assert np.array_equal(buf, ref)
    assert get_codec(codec).decode(t, buf) is buf and np.array_equal(buf, ref)
    # a buffer 4 bytes off an 8-byte boundary (the 4-bit pair-table path needs 8)
    n = ref.size
    if n == 0:
        return
    odd = np.zeros(n + 2, np.float32)
    view = odd[1 : n + 1] if odd.ctypes.data % 8 == 0 else odd[:n]
    assert view.ctypes.data % 8 == 4
    assert np.array_equal(decode(t, out=view.reshape(shape)), ref)
    assert np.array_equal(decode(t), ref)


@pytest.mark.parametrize("codec,bits", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(0,), (1,), (9,), (4099,), (17, 31)])
def test_decode_accumulate_is_bit_exact(codec, bits, dtype, shape):
    t = encode(sample(shape, bits + 1), codec, bits)
    y = decode(t)
    acc = np.random.default_rng(5).normal(0, 1, shape).astype(dtype)
    for weight in (0.37, 1, -2.5e-3):
        ref = acc.copy()
        if codec == "asym":
            lo, hi = t.aux["min"], t.aux["max"]
            step = (hi - lo) / ((1 << bits) - 1)
            q = unpack(t.data, y.size, bits).reshape(shape)
            ref += dtype(weight * lo) + q.astype(dtype) * dtype(weight * step)
            # the affine form is within a few ulps of the decoded one (whose levels are
            # rounded to float32: one float32 ulp of the level, times |w|)
            top = max(abs(lo), abs(hi))
            tol = (abs(weight) * float(np.spacing(np.float32(top)))
                   + 8 * float(np.spacing(dtype(abs(weight) * top + np.abs(acc).max(initial=0)))))
            np.testing.assert_allclose(ref, acc + dtype(weight) * y.astype(dtype), rtol=0, atol=tol)
        else:
            ref += dtype(weight) * y.astype(dtype)
        decode_accumulate(t, acc, weight)
        assert acc.dtype == dtype
        np.testing.assert_array_equal(acc, ref)


def test_ternary_and_int_decode_into_their_dtype():
    x = sample((5, 7))
    t = encode(x, "ternary")
    buf = np.empty((5, 7), np.float32)
    assert np.array_equal(decode(t, out=buf), decode(t))
    ti = encode(np.array([[1, 0, -1]], np.int8), "ternary")
    bi = np.empty((1, 3), np.int8)
    assert decode(ti, out=bi).tolist() == [[1, 0, -1]]
    t16 = encode(np.arange(-300, 300, dtype=np.int16), "int", 11)
    b16 = np.empty(600, np.int16)
    assert np.array_equal(decode(t16, out=b16), np.arange(-300, 300))
    with pytest.raises(CodecError, match="decode_accumulate"):  # ternary does not accumulate
        decode_accumulate(t, np.zeros((5, 7), np.float32), 1.0)


@pytest.mark.parametrize("bits", [2, 4, 7, 8, 11, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int_accumulates_its_integers_exactly(bits, dtype):
    """``int`` adds ``w * q`` exactly (an affine code: lo = -2**(s-1), step 1), and an
    integer device's shared-domain values ``q / 2**(s-1)`` through ``scaled``."""
    from edge_client.codecs import accumulator

    rng = np.random.default_rng(bits)
    half = 1 << (bits - 1)
    x = rng.integers(-half, half, 4097).astype(np.int8 if bits <= 8 else np.int16)
    t = encode(x, "int", bits)
    acc = np.zeros(x.shape, dtype)
    decode_accumulate(t, acc, 3.0)
    assert np.array_equal(acc, 3.0 * x.astype(dtype))
    acc = rng.normal(0, 1, x.shape).astype(dtype)
    ref = acc + dtype(7.0) * (x.astype(dtype) * dtype(2.0 ** -(max(bits, 8) - 1)))
    accumulator(t).scaled(2.0 ** -(max(bits, 8) - 1))(acc, 7.0)
    np.testing.assert_array_equal(acc, ref)


@pytest.mark.parametrize("codec", ["asym", "kmeans", "danuq", "float32", "float16"])
def test_bad_buffers_are_rejected_and_left_untouched(codec):
    t = encode(sample((6, 5)), codec, None if codec.startswith("float") else 4)
    bad_outs = [
        np.empty((5, 6), np.float32),  # shape
        np.empty(30, np.float32),  # shape (flat)
        np.empty((6, 5), np.float64),  # dtype
        np.empty((5, 6), np.float32).T,  # not C-contiguous
        [0.0] * 30,  # not an array
    ]
    ro = np.empty((6, 5), np.float32)
    ro.flags.writeable = False
    for b in [*bad_outs, ro]:
        with pytest.raises(CodecError):
            decode(t, out=b)
    for acc in [np.zeros((5, 6)), np.zeros((6, 5), np.int32), np.zeros((6, 5), np.float16), np.zeros((5, 6)).T, ro]:
        with pytest.raises(CodecError):
            decode_accumulate(t, acc, 1.0)
    acc = np.ones((6, 5), np.float32)
    for w in (float("nan"), float("inf"), True, "1", None):
        with pytest.raises(CodecError):
            decode_accumulate(t, acc, w)
    # a malformed tensor is a ProtocolError and leaves acc as it was
    with pytest.raises(ProtocolError):
        decode_accumulate(replace(t, data=t.data[:-1]), acc, 1.0)
    assert np.all(acc == 1.0)


def test_nonfinite_float_payload_leaves_acc_untouched():
    for codec, wire in (("float32", "<f4"), ("float16", "<f2")):
        t = encode(np.ones(8, np.float32), codec)
        vals = np.frombuffer(t.data, wire).copy()
        vals[5] = np.inf
        bad = replace(t, data=vals.tobytes())
        acc = np.zeros(8, np.float64)
        with pytest.raises(ProtocolError, match="non-finite"):
            decode_accumulate(bad, acc, 2.0)
        assert not acc.any()
        with pytest.raises(ProtocolError, match="non-finite"):
            decode(bad, out=np.empty(8, np.float32))


def test_half_table_is_numpys_conversion():
    from edge_client.codecs.fused import HALF_TO_FLOAT

    pats = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ref = pats.view(np.float16).astype(np.float32)
    fin = np.isfinite(ref)
    assert np.array_equal(HALF_TO_FLOAT[fin].view(np.uint32), ref[fin].view(np.uint32))


# Codecs that promise finite output (the coordinator then skips the strategy's NaN pass):
# whatever bytes and finite aux a sender chooses, a decode that succeeds is finite.
_F32_MAX = float(np.finfo(np.float32).max)
_extreme = hst.sampled_from([_F32_MAX, -_F32_MAX, 1e-45, 0.0, 1.0, -3.0e38])


@pytest.mark.parametrize("name", [n for n in available_codecs() if get_codec(n).finite_output])
@settings(max_examples=150, deadline=None)
@given(data=hst.data())
def test_finite_output_codecs_never_decode_nan_or_inf(name, data):
    codec = get_codec(name)
    lo, hi = codec.bits_range
    bits = data.draw(hst.integers(lo, hi))
    n = data.draw(hst.integers(1, 40))
    raw = data.draw(hst.binary(min_size=packed_length(n, bits), max_size=packed_length(n, bits)))
    dtype = {"int": "int8" if bits <= 8 else "int16", "ternary": data.draw(hst.sampled_from(["int8", "float32"]))}.get(name, "float32")
    aux = {"codebook": data.draw(hst.lists(_extreme, min_size=1 << bits, max_size=1 << bits))} if name == "kmeans" else {}
    if name == "ternary" and dtype == "float32":
        aux = {"scale": data.draw(_extreme)}
    try:
        y = codec.decode(EncodedTensor((n,), dtype, name, bits, raw, aux))
    except ProtocolError:
        return
    assert np.all(np.isfinite(y.astype(np.float64)))


def test_half_table_is_numpys_conversion_bit_for_bit_with_nans_built_from_their_bits() -> None:
    from edge_client.codecs.fused import HALF_TO_FLOAT

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        ref = bits.view(np.float16).astype(np.float32)
    assert HALF_TO_FLOAT.dtype == np.float32
    assert np.array_equal(HALF_TO_FLOAT.view(np.uint32), ref.view(np.uint32))
    assert int(np.isnan(HALF_TO_FLOAT).sum()) == 2 * 1023  # both signs, every non-zero payload
