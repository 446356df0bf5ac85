"""Server-side decode, what particular codecs do beyond what every codec promises
(``decode(t, out=buf)`` and ``decode_accumulate`` bit for bit in the documented form, for
every codec and width, are in ``test_codec_conformance.py``): ternary and int decode into
their own dtype, int accumulates its integers exactly and scaled, float payloads with NaN
leave the sum untouched, the float16 table is numpy's conversion."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edge_client.codecs import (
    decode,
    decode_accumulate,
    encode,
)
from edge_client.errors import CodecError, ProtocolError


def test_ternary_and_int_decode_into_their_dtype():
    x = np.random.default_rng(0).normal(0.01, 0.05, (5, 7)).astype(np.float32)
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


def test_half_table_is_numpys_conversion_bit_for_bit_with_nans_built_from_their_bits() -> None:
    from edge_client.codecs.fused import HALF_TO_FLOAT

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        ref = bits.view(np.float16).astype(np.float32)
    assert HALF_TO_FLOAT.dtype == np.float32
    assert np.array_equal(HALF_TO_FLOAT.view(np.uint32), ref.view(np.uint32))
    assert int(np.isnan(HALF_TO_FLOAT).sum()) == 2 * 1023  # both signs, every non-zero payload
