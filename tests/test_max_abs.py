"""``max_abs``: the magnitude bound a receiver checks before an update touches its sums.

Exact for float32/float16 (one pass over the bit patterns), the largest level for asym and
the table codecs, ``scale`` for ternary, ``2**(bits-1)`` for int; compared with a plain
numpy ``abs(decode(t)).max()`` on random tensors, and fuzzed on received bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_client.codecs import decode, encode, max_abs
from edge_client.codecs.fused import abs_bits_max
from edge_client.errors import ProtocolError
from edge_client.protocol import EncodedTensor

CASES = [("float32", 32, {}), ("float16", 16, {}), ("asym", 3, {}), ("asym", 12, {}), ("kmeans", 4, {}),
         ("danuq", 3, {"sigma_g": 0.02}), ("ternary", 2, {}), ("int", 8, {}), ("int", 13, {})]
EXACT = {"float32", "float16", "asym"}  # the others bound by their table, which may hold unused levels


def reference(t: EncodedTensor) -> float:
    a = decode(t).astype(np.float64)
    return float(np.abs(a).max()) if a.size else 0.0


@pytest.mark.parametrize(("codec", "bits", "opts"), CASES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 3e4])
def test_bound_holds_and_is_exact_where_documented(codec: str, bits: int, opts: dict, scale: float) -> None:
    rng = np.random.default_rng(bits)
    if codec == "int":
        x = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (33, 7)).astype(np.int16)
    else:
        x = np.clip(rng.standard_t(3, (33, 7)) * scale, -6e4, 6e4).astype(np.float32)  # float16's range
    t = encode(x, codec=codec, bits=bits, **opts)
    bound, ref = max_abs(t), reference(t)
    assert isinstance(bound, float)
    assert bound >= ref
    if codec in EXACT:
        assert bound == ref
    elif codec == "int":  # the most negative code, whether or not this tensor holds it
        assert bound == float(1 << (bits - 1))
    else:  # the table's largest |level|
        table = np.asarray(t.aux.get("codebook", [t.aux.get("scale", 0.0)]), np.float64)
        if codec == "danuq":
            table = np.abs(decode(encode(np.array([-1e9, 1e9], np.float32), codec="danuq", bits=bits, **opts)))
        assert bound == pytest.approx(float(np.abs(table).max()), rel=1e-6)


@pytest.mark.parametrize(("codec", "bits", "opts"), CASES)
def test_empty_tensor_bound_is_zero(codec: str, bits: int, opts: dict) -> None:
    x = np.zeros((0, 3), np.int16 if codec == "int" else np.float32)
    assert max_abs(encode(x, codec=codec, bits=bits, **opts)) == 0.0


@pytest.mark.parametrize("codec", ["float32", "float16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_wire_values_are_a_protocol_error(codec: str, bad: float) -> None:
    t = encode(np.ones(10, np.float32), codec=codec)
    wire = np.frombuffer(t.data, "<f4" if codec == "float32" else "<f2").copy()
    wire[7] = bad
    with pytest.raises(ProtocolError, match="non-finite"):
        max_abs(dataclasses.replace(t, data=wire.tobytes()))


@pytest.mark.parametrize("codec", ["float32", "float16"])
def test_unaligned_payload_gives_the_same_bound(codec: str) -> None:
    """A payload at an odd address (a slice of a received message) takes numpy's path."""
    t = encode(np.linspace(-5, 3, 101, dtype=np.float32), codec=codec)
    odd = dataclasses.replace(t, data=memoryview(b"_" + t.data)[1:])
    assert not np.frombuffer(odd.data, np.uint8).view("<u2").flags.aligned
    assert max_abs(odd) == max_abs(t) == 5.0


def test_bad_aux_is_a_protocol_error_naming_the_field() -> None:
    t = encode(np.arange(8, dtype=np.float32), codec="asym", bits=4)
    with pytest.raises(ProtocolError, match="aux.max"):
        max_abs(dataclasses.replace(t, aux={"min": 1.0, "max": 0.0}))
    with pytest.raises(ProtocolError, match="codec"):
        max_abs(dataclasses.replace(t, codec="zstd"))


def test_abs_bits_max_kernel_is_integer_only() -> None:
    u = np.array([0x3F800000, 0xC0400000, 0x00000001], np.uint32)  # 1.0, -3.0, denormal
    assert int(abs_bits_max(u, 0x7FFFFFFF)) == 0x40400000
    for sig in abs_bits_max.signatures:
        assert all("float" not in str(a) for a in sig), sig


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.uint8, st.integers(0, 64)), st.sampled_from(["float32", "float16"]))
def test_random_wire_bytes_give_the_exact_bound_or_a_protocol_error(raw: np.ndarray, codec: str) -> None:
    width = 4 if codec == "float32" else 2
    n = raw.size // width
    t = EncodedTensor((n,), "float32", codec, 32 if codec == "float32" else 16, raw[: n * width].tobytes(), {})
    try:
        bound = max_abs(t)
    except ProtocolError:
        vals = np.frombuffer(t.data, "<f4" if codec == "float32" else "<f2")
        assert not np.isfinite(vals).all()
        return
    assert bound == reference(t)
