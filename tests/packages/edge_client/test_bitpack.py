"""Bit packing against a plain-Python bit-by-bit reference (little-endian bit order)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.codecs.bitpack import pack, packed_nbytes, unpack
from edge_client.errors import CodecError, ProtocolError


def ref_pack(values: list[int], bits: int) -> bytes:
    """Element i at stream bits [i*b, (i+1)*b); stream bit j is bit j%8 of byte j//8."""
    out = bytearray((len(values) * bits + 7) // 8)
    for i, v in enumerate(values):
        for k in range(bits):
            if (v >> k) & 1:
                j = i * bits + k
                out[j // 8] |= 1 << (j % 8)
    return bytes(out)


def ref_unpack(data: bytes, n: int, bits: int) -> list[int]:
    return [sum(((data[(i * bits + k) // 8] >> ((i * bits + k) % 8)) & 1) << k for k in range(bits)) for i in range(n)]


@st.composite
def packable(draw):
    bits = draw(st.integers(1, 16))
    values = draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=70))
    dtype = draw(st.sampled_from([np.uint8, np.uint16, np.int32, np.int64, np.uint64] if bits <= 8 else [np.uint16, np.int32, np.int64]))
    return bits, values, dtype


@settings(max_examples=300, deadline=None)
@given(packable())
def test_pack_matches_reference_and_round_trips(case):
    bits, values, dtype = case
    arr = np.array(values, dtype=dtype)
    data = pack(arr, bits)
    assert data == ref_pack(values, bits)
    assert len(data) == packed_nbytes(len(values), bits) == -(-len(values) * bits // 8)
    back = unpack(data, len(values), bits)
    assert back.dtype == (np.uint8 if bits <= 8 else np.uint16)
    assert back.tolist() == values
    assert ref_unpack(data, len(values), bits) == values


def test_documented_bit_order_examples():
    assert pack(np.array([1, 2], np.uint8), 4) == bytes([0x21])
    assert pack(np.array([1, 0, 1], np.uint8), 1) == bytes([0b101])
    assert pack(np.array([0x1234], np.uint16), 16) == bytes([0x34, 0x12])
    assert pack(np.array([0x7FF, 1], np.uint16), 11) == bytes([0xFF, 0x0F, 0x00])


@pytest.mark.parametrize("bits", list(range(1, 17)))
def test_large_random_round_trip_and_reference(bits):
    rng = np.random.default_rng(bits)
    n = 10_007  # not a multiple of 8: exercises the partial last group
    v = rng.integers(0, 1 << bits, n).astype(np.uint16 if bits > 8 else np.uint8)
    data = pack(v, bits)
    assert len(data) == (n * bits + 7) // 8
    assert np.array_equal(unpack(data, n, bits), v)
    head = v[:200].tolist()
    assert data[: (200 * bits) // 8] == ref_pack(head, bits)[: (200 * bits) // 8]
    # an independent numpy reference: explode to bits, then pack little-endian
    bitmat = ((v.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    assert data == np.packbits(bitmat.ravel(), bitorder="little").tobytes()


def test_multidimensional_and_noncontiguous_input():
    v = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
    assert pack(v, 5) == ref_pack(v.ravel().tolist(), 5)


def test_memoryview_and_empty():
    assert pack(np.array([], np.uint8), 3) == b""
    assert unpack(b"", 0, 7).size == 0
    data = pack(np.array([5, 6, 7], np.uint8), 3)
    assert unpack(memoryview(data), 3, 3).tolist() == [5, 6, 7]


@pytest.mark.parametrize("bits", [0, 17, -1, 2.0, True, None])
def test_bits_out_of_range(bits):
    with pytest.raises(CodecError, match="bits"):
        pack(np.array([0], np.uint8), bits)
    with pytest.raises(CodecError, match="bits"):
        unpack(b"\x00", 1, bits)


@pytest.mark.parametrize("bits,value", [(1, 2), (4, 16), (8, 256), (12, 4096), (16, 65536), (3, -1)])
def test_value_out_of_range(bits, value):
    with pytest.raises(CodecError, match="index 1"):
        pack(np.array([0, value], np.int64), bits)


def test_wrong_dtype():
    with pytest.raises(CodecError, match="dtype"):
        pack(np.array([0.0, 1.0]), 4)
    with pytest.raises(CodecError, match="dtype"):
        pack(np.array([True]), 1)
    with pytest.raises(CodecError, match="numpy"):
        pack([1, 2], 4)


@pytest.mark.parametrize("n,bits,length", [(3, 4, 1), (3, 4, 3), (8, 1, 0), (1, 16, 1), (0, 5, 1)])
def test_wrong_length_is_protocol_error(n, bits, length):
    with pytest.raises(ProtocolError, match="expected exactly"):
        unpack(bytes(length), n, bits)


def test_nonzero_padding_is_protocol_error():
    with pytest.raises(ProtocolError, match="padding"):
        unpack(bytes([0xF0]), 1, 4)


def test_negative_count_is_protocol_error():
    with pytest.raises(ProtocolError):
        unpack(b"", -1, 4)
