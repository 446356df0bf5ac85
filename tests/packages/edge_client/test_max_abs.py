"""``max_abs``: the magnitude bound a receiver checks before an update touches its sums.

For every codec at every scale, at least a plain numpy ``abs(decode(t)).max()``; exact for
float32/float16 (one pass over the bit patterns) and asym, the largest level for the table
codecs, ``scale`` for ternary, ``2**(bits-1)`` for int; float payloads fuzzed as received
bytes (every codec's fuzzed tensors: ``test_codec_conformance.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_client.codecs import CODECS, decode, encode, max_abs
from edge_client.codecs.fused import abs_bits_max
from edge_client.errors import ProtocolError
from edge_client.protocol import EncodedTensor

#: codecs whose bound is the largest decoded |value| itself (the others bound by a table
#: that may hold levels this tensor does not use)
EXACT = {"float32", "float16", "asym"}


def reference(t: EncodedTensor) -> float:
    a = decode(t).astype(np.float64)
    return float(np.abs(a).max()) if a.size else 0.0


def scaled_inputs(name: str, bits: int, scale: float) -> list[np.ndarray]:
    """The codec's own examples, float ones heavy-tailed at ``scale`` (within float16's range)."""
    rng = np.random.default_rng(bits)
    out = []
    for x in CODECS[name].examples((33, 7), bits, rng):
        if x.dtype.kind == "f":
            x = np.clip(rng.standard_t(3, x.shape) * scale, -6e4, 6e4).astype(x.dtype)
        out.append(x)
    return out


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("scale", [1e-3, 1.0, 3e4])
def test_the_bound_holds_at_every_scale(name: str, scale: float) -> None:
    c = CODECS[name]
    for bits in sorted({*c.bits_range, c.default_bits}):
        for x in scaled_inputs(name, bits, scale):
            t = c.encode(x, bits)
            bound = max_abs(t)
            assert isinstance(bound, float) and bound >= reference(t)


@pytest.mark.parametrize(("codec", "bits", "opts"), [
    ("float32", 32, {}), ("float16", 16, {}), ("asym", 3, {}), ("asym", 12, {}), ("kmeans", 4, {}),
    ("danuq", 3, {"sigma_g": 0.02}), ("ternary", 2, {}), ("int", 8, {}), ("int", 13, {})])
def test_the_bound_is_exact_where_documented(codec: str, bits: int, opts: dict) -> None:
    x = scaled_inputs(codec, bits, 1.0)[0]
    t = encode(x, codec=codec, bits=bits, **opts)
    bound = max_abs(t)
    if codec in EXACT:
        assert bound == reference(t)
    elif codec == "int":  # the most negative code, whether or not this tensor holds it
        assert bound == float(1 << (bits - 1))
    else:  # the table's largest |level|
        table = np.asarray(t.aux.get("codebook", [t.aux.get("scale", 0.0)]), np.float64)
        if codec == "danuq":
            table = np.abs(decode(encode(np.array([-1e9, 1e9], np.float32), codec="danuq", bits=bits, **opts)))
        assert bound == pytest.approx(float(np.abs(table).max()), rel=1e-6)


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
