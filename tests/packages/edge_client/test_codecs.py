"""Each codec's own promises: its registry attributes, round trips within its bound,
plain-numpy references for asym, int and ternary, its option and aux rules. What every
codec promises (sizes, empty tensors, encode errors, malformed and fuzzed tensors) is in
``test_codec_conformance.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_client.codecs import available_codecs, decode, encode, get_codec
from edge_client.codecs.bitpack import pack
from edge_client.errors import CodecError, ProtocolError
from edge_client.protocol import EncodedTensor


def sample(codec: str, shape=(17, 5), seed=0) -> np.ndarray:
    c = get_codec(codec)
    return c.examples(shape, c.default_bits, np.random.default_rng(seed))[0]


finite_f32 = st.floats(-1e3, 1e3, allow_nan=False, width=32)
arrays = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9), elements=finite_f32)


# ---------------------------------------------------------------- registry


def test_registry_names_and_attributes():
    assert {"asym", "danuq", "float16", "float32", "int", "kmeans", "ternary"} <= set(available_codecs())
    assert get_codec("float32").lossy is False and get_codec("int").lossy is False
    assert all(get_codec(n).lossy for n in ("float16", "asym", "kmeans", "danuq"))
    assert get_codec("asym").bits_range == (1, 16) and get_codec("kmeans").bits_range == (1, 8)
    assert get_codec("int").bits_range == (2, 16) and get_codec("ternary").bits_range == (2, 2)


def test_unknown_codec():
    with pytest.raises(CodecError, match=f"available: {', '.join(available_codecs())}"):
        get_codec("zip")
    t = EncodedTensor((1,), "float32", "zip", 8, b"\x00")
    with pytest.raises(ProtocolError, match="codec"):
        decode(t)


def test_ternary_lossiness_depends_on_input():
    c = get_codec("ternary")
    assert not c.is_lossy(encode(np.array([1, 0, -1], np.int8), "ternary"))
    assert c.is_lossy(encode(np.array([0.3, 0.0], np.float32), "ternary"))


# ---------------------------------------------------------------- sizes and aux


@pytest.mark.parametrize(("codec", "keys"), [
    ("float32", set()), ("float16", set()), ("asym", {"min", "max"}), ("kmeans", {"codebook"}),
    ("danuq", {"sigma_loc", "sigma_g", "zero_level"}), ("ternary", {"scale"}), ("int", set()),
])
def test_aux_fields(codec, keys):
    c = get_codec(codec)
    for shape in [(0,), (13, 11)]:
        assert set(c.encode(sample(codec, shape)).aux) == keys
    assert len(get_codec("kmeans").encode(sample("kmeans"), 5).aux["codebook"]) == 32


# ---------------------------------------------------------------- round trips


@settings(max_examples=60, deadline=None)
@given(arrays, st.integers(1, 16))
def test_asym_round_trip_bound_and_reference(x, bits):
    t = encode(x, "asym", bits)
    y = decode(t)
    if x.size == 0:
        return
    lo, hi = float(x.min()), float(x.max())
    assert (t.aux["min"], t.aux["max"]) == (lo, hi)
    levels = 2**bits - 1
    step = (hi - lo) / levels
    assert np.all(np.abs(y.astype(np.float64) - x) <= step / 2 * (1 + 1e-9) + 1e-6 * max(abs(lo), abs(hi)))
    # plain numpy reference, bit for bit
    scale = levels / (hi - lo) if hi > lo else 0.0
    q = np.clip(np.rint((x.astype(np.float64).ravel() - lo) * scale), 0, levels).astype(np.int64)
    assert t.data == pack(q, bits)
    assert np.array_equal(y.ravel(), (lo + q * step).astype(np.float32))


def test_asym_constant_tensor_is_exact():
    x = np.full((4, 5), -0.125, np.float32)
    for bits in (1, 4, 16):
        t = encode(x, "asym", bits)
        assert t.aux == {"min": -0.125, "max": -0.125}
        assert np.array_equal(decode(t), x)


@settings(max_examples=40, deadline=None)
@given(arrays, st.integers(1, 8))
def test_kmeans_round_trip_nearest_codeword(x, bits):
    t = encode(x, "kmeans", bits)
    y = decode(t)
    cb = np.array(t.aux["codebook"], np.float32)
    assert len(cb) == 2**bits and np.all(np.diff(cb) >= 0)
    if x.size == 0:
        return
    # every element decodes to its nearest codeword (ties: either)
    d = np.abs(x.ravel()[:, None].astype(np.float64) - cb[None, :].astype(np.float64))
    got = np.abs(y.ravel().astype(np.float64) - x.ravel())
    assert np.all(got <= d.min(axis=1) + 1e-12)
    # an element's cluster mean lies in the data's range, so its nearest codeword is within
    # the range of it (not within half of it: K-means may settle with an extreme value in a
    # cluster of others, e.g. {-964, 0 x 67} / {439, 935} at 1 bit, a fixed point of Lloyd's
    # iteration)
    assert np.all(got <= float(x.max()) - float(x.min()) + 1e-9)


def test_kmeans_may_leave_an_extreme_value_in_a_cluster_of_others():
    """The example hypothesis found: every element still decodes to its nearest codeword."""
    x = np.zeros((2, 5, 7), np.float32)
    x[0, 0, :3] = [-964, 439, 935]
    t = encode(x, "kmeans", 1)
    y = decode(t)
    cb = np.array(t.aux["codebook"], np.float64)
    assert np.array_equal(y.ravel(), cb[np.abs(x.ravel()[:, None] - cb[None, :]).argmin(1)]
                          .astype(np.float32))


@settings(max_examples=40, deadline=None)
@given(arrays)
def test_float_passthrough(x):
    assert np.array_equal(decode(encode(x, "float32")), x)
    y = decode(encode(x, "float16"))
    assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) * 2.0**-11, 2.0**-25))


def test_float16_overflow_is_an_error():
    with pytest.raises(CodecError, match="float16 range"):
        encode(np.array([1.0, 7e4], np.float32), "float16")


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 16), st.data())
def test_int_round_trip_is_exact(bits, data):
    dtype = np.int8 if bits <= 8 and data.draw(st.booleans()) else np.int16
    half = 2 ** (bits - 1)
    x = data.draw(hnp.arrays(dtype, st.integers(0, 40), elements=st.integers(-half, half - 1)))
    t = encode(x, "int", bits)
    y = decode(t)
    assert y.dtype == dtype and np.array_equal(y, x)
    assert t.data == pack(x.astype(np.int64) + half, bits)  # offset binary


def test_int_default_bits_and_range_errors():
    assert encode(np.array([-128, 127], np.int8), "int").bits == 8
    with pytest.raises(CodecError, match="index 1"):
        encode(np.array([0, 32], np.int8), "int", 6)
    with pytest.raises(CodecError, match="bits <= 8"):
        encode(np.array([0], np.int8), "int", 9)
    with pytest.raises(CodecError, match="dtype"):
        encode(np.array([0], np.int32), "int", 8)


def test_ternary_int8_exact_and_float_reference():
    rng = np.random.default_rng(3)
    v = rng.integers(-1, 2, 101).astype(np.int8)
    t = encode(v, "ternary")
    assert t.aux == {} and np.array_equal(decode(t), v)
    assert t.data == pack(v.astype(np.int64) + 1, 2)
    with pytest.raises(CodecError, match="not in"):
        encode(np.array([0, 2], np.int8), "ternary")
    x = rng.normal(0, 0.1, 1000).astype(np.float32)
    t = encode(x, "ternary", threshold=0.05)
    tern = np.where(x > 0.05, 1, np.where(x < -0.05, -1, 0))
    scale = np.abs(x[tern != 0].astype(np.float64)).mean()
    assert t.aux["scale"] == pytest.approx(scale, rel=1e-6)
    assert np.allclose(decode(t), np.float32(t.aux["scale"]) * tern)
    td = encode(x, "ternary")  # TWN default threshold 0.7 * mean|x|
    thr = 0.7 * np.abs(x.astype(np.float64)).mean()
    assert np.array_equal(np.sign(decode(td)), np.where(np.abs(x) > thr, np.sign(x), 0))
    assert encode(x, "ternary", threshold=0.05, scale=0.25).aux["scale"] == 0.25


# ---------------------------------------------------------------- options


def test_unknown_option():
    with pytest.raises(CodecError, match="unknown option"):
        encode(np.zeros(3, np.float32), "asym", 4, seed=1)
    with pytest.raises(CodecError, match="method"):
        encode(np.zeros(3, np.float32), "kmeans", 4, method="sklearn")


# ---------------------------------------------------------------- decode-side validation


def good(codec: str) -> EncodedTensor:
    lo, hi = get_codec(codec).bits_range
    return encode(sample(codec, (9,)), codec, 4 if lo <= 4 <= hi else None)


@pytest.mark.parametrize(
    "codec,field,value",
    [
        ("asym", "min", float("nan")), ("asym", "max", float("inf")), ("asym", "max", -1.0),
        ("asym", "min", "0"), ("asym", "max", 1e300),
        ("kmeans", "codebook", [0.0] * 15), ("kmeans", "codebook", [0.0] * 15 + [float("nan")]),
        ("kmeans", "codebook", "abc"), ("kmeans", "codebook", [0.0] * 15 + ["x"]),
        ("kmeans", "codebook", [0.0] * 15 + [True]), ("kmeans", "codebook", [-1e39] + [0.0] * 15),
        ("kmeans", "codebook", [0.0] * 15 + [float("-inf")]), ("kmeans", "codebook", [0.0] * 15 + [None]),
        ("danuq", "sigma_g", -1.0), ("danuq", "sigma_loc", float("nan")), ("danuq", "zero_level", 2),
        ("ternary", "scale", -0.5),
    ],
)
def test_decode_rejects_bad_aux_naming_the_field(codec, field, value):
    t = good(codec)
    with pytest.raises(ProtocolError, match=f"aux.{field}"):
        decode(dataclasses.replace(t, aux={**t.aux, field: value}))
    aux = dict(t.aux)
    del aux[field]
    with pytest.raises(ProtocolError, match=f"aux.{field}"):
        decode(dataclasses.replace(t, aux=aux))


def test_decode_rejects_nonfinite_floats_and_bad_ternary_code():
    t = encode(np.zeros(3, np.float32), "float32")
    with pytest.raises(ProtocolError, match="non-finite"):
        decode(dataclasses.replace(t, data=np.array([0, np.nan, 1], "<f4").tobytes()))
    t = encode(np.zeros(3, np.float32), "float16")
    with pytest.raises(ProtocolError, match="non-finite"):
        decode(dataclasses.replace(t, data=np.array([0, np.inf, 1], "<f2").tobytes()))
    t = encode(np.zeros(3, np.int8), "ternary")
    with pytest.raises(ProtocolError, match="code 3 at element 1"):
        decode(dataclasses.replace(t, data=bytes([0b001101])))
