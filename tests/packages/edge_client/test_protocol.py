"""Wire protocol: round trips, exact lengths, and only ProtocolError on bad input."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_client.compat import zip_strict
from edge_client.errors import ProtocolError
from edge_client.protocol import (
    CODEC_BITS,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    EncodedTensor,
    Hello,
    Limits,
    ModelMessage,
    Presence,
    RoundAnnouncement,
    Status,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    packed_length,
    parse_topic,
    tensors_digest,
    topic,
)

ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
short_text = st.text(max_size=30)


@st.composite
def tensors(draw) -> EncodedTensor:
    codec = draw(st.sampled_from(sorted(CODEC_BITS)))
    lo, hi = CODEC_BITS[codec]
    bits = draw(st.integers(lo, hi))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    n = math.prod(shape)
    if codec in ("float32", "float16"):
        dtype = "<f4" if codec == "float32" else "<f2"
        values = draw(st.lists(st.floats(-1e3, 1e3, width=16), min_size=n, max_size=n))
        data = np.asarray(values, dtype=dtype).tobytes()
    else:
        data = draw(st.binary(min_size=packed_length(n, bits), max_size=packed_length(n, bits)))
    aux = draw(st.dictionaries(st.sampled_from(["min", "max", "codebook", "sigma_loc"]),
                               st.one_of(finite, st.lists(finite, max_size=4), st.integers(-5, 5)),
                               max_size=3))
    name = draw(st.sampled_from(["", "conv1", "fc2"]))
    return EncodedTensor(shape, draw(st.sampled_from(["float32", "int8", "int16"])), codec, bits,
                         data, aux, name)


digests = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)

messages = st.one_of(
    st.builds(Hello, ids, ids, st.sampled_from([6, 8, 16, 32]), st.sampled_from(["int", "torch"]),
              st.sampled_from(sorted(CODEC_BITS)), st.integers(1, 32), st.integers(0, 10**6), short_text),
    st.builds(Presence, ids, st.booleans()),
    st.builds(RoundAnnouncement, ids, st.integers(0, 10**6), ids, st.lists(ids, max_size=5).map(tuple),
              st.floats(0, 2e9), st.dictionaries(ids, digests, max_size=3),
              st.dictionaries(ids, st.one_of(st.integers(-9, 9), finite, st.booleans(), short_text), max_size=4)),
    st.builds(ModelMessage, st.integers(0, 10**6), ids, ids, st.lists(tensors(), max_size=3).map(tuple),
              digests, st.lists(tensors(), max_size=2).map(tuple), st.lists(finite, max_size=3).map(tuple)),
    st.builds(Update, ids, st.integers(0, 10**6), st.integers(1, 10**6), st.sampled_from([6, 8, 32]),
              st.sampled_from(["weights", "delta"]), st.lists(tensors(), max_size=3).map(tuple),
              st.one_of(st.just(""), digests), finite, st.floats(0, 1e4)),
    st.builds(Status, st.sampled_from(["waiting", "round", "done", "error"]), st.integers(0, 10**6),
              short_text, st.dictionaries(ids, finite, max_size=3)),
)


def _normalize(msg):
    """Floats travel as float64 and aux lists as lists: compare on the wire form."""
    return msgpack.unpackb(encode_message(msg), raw=False)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_every_valid_message_round_trips(msg) -> None:
    payload = encode_message(msg)
    back = decode_message(payload)
    assert type(back) is type(msg)
    assert encode_message(back) == payload
    if not any(isinstance(v, float) for v in vars(msg).values()):
        assert back == msg or _normalize(back) == _normalize(msg)


def test_round_trip_keeps_tensor_bytes_exactly() -> None:
    w = np.random.default_rng(0).normal(size=(4, 3, 5, 5)).astype(np.float32)
    t = float32_tensor(w, "conv1")
    msg = Update("pi-1", 3, 120, 8, "weights", (t,), tensors_digest([t]), 0.25, 1.5)
    back = decode_message(encode_message(msg))
    assert back == msg
    np.testing.assert_array_equal(np.frombuffer(back.tensors[0].data, "<f4").reshape(w.shape), w)


@pytest.mark.parametrize("n,bits", [(0, 4), (1, 1), (7, 3), (10, 4), (2_105_000, 4), (5, 13)])
def test_packed_length_is_exact(n: int, bits: int) -> None:
    assert packed_length(n, bits) == math.ceil(n * bits / 8)


def test_payload_size_is_data_plus_small_framing() -> None:
    n, bits = 10_000, 4
    t = EncodedTensor((n,), "float32", "asym", bits, bytes(packed_length(n, bits)), {"min": -1.0, "max": 1.0}, "w")
    payload = encode_message(Update("d", 1, 1, 32, "weights", (t,)))
    assert packed_length(n, bits) < len(payload) < packed_length(n, bits) + 256


def _update_body(**tensor_overrides):
    t = {"name": "w", "shape": [2, 3], "dtype": "float32", "codec": "float32", "bits": 32,
         "data": np.zeros(6, "<f4").tobytes(), "aux": {}}
    t.update(tensor_overrides)
    return {"v": PROTOCOL_VERSION, "kind": "update", "device_id": "d1", "round_id": 1,
            "num_samples": 5, "compute_bits": 8, "content": "weights", "tensors": [t]}


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"shape": [2, -3]}, "tensors[0].shape[1]"),
        ({"shape": [2, 4]}, "tensors[0].data"),
        ({"bits": 8}, "tensors[0].bits"),
        ({"codec": "zip"}, "tensors[0].codec"),
        ({"dtype": "object"}, "tensors[0].dtype"),
        ({"data": "text"}, "tensors[0].data"),
        ({"data": np.array([0, 0, 0, 0, 0, np.nan], "<f4").tobytes()}, "tensors[0].data"),
        ({"aux": {"min": float("nan")}}, "tensors[0].aux.min"),
        ({"aux": {"codebook": [1.0, float("inf")]}}, "tensors[0].aux.codebook"),
        ({"shape": [1 << 20, 1 << 20]}, "tensors[0].shape"),
    ],
)
def test_bad_tensor_fields_are_named(overrides, field) -> None:
    payload = msgpack.packb(_update_body(**overrides), use_bin_type=True)
    with pytest.raises(ProtocolError) as err:
        decode_message(payload)
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"v": 99}, "v"),
        ({"kind": "hack"}, "kind"),
        ({"device_id": "a/b"}, "device_id"),
        ({"device_id": "+"}, "device_id"),
        ({"round_id": -1}, "round_id"),
        ({"round_id": 1.5}, "round_id"),
        ({"num_samples": 0}, "num_samples"),
        ({"content": "gradients"}, "content"),
        ({"tensors": {"a": 1}}, "tensors"),
        ({"train_loss": float("nan")}, "train_loss"),
        ({"model_digest": "xyz"}, "model_digest"),
    ],
)
def test_bad_message_fields_are_named(change, field) -> None:
    body = _update_body()
    body.update(change)
    with pytest.raises(ProtocolError) as err:
        decode_message(msgpack.packb(body, use_bin_type=True))
    assert str(err.value).startswith(field), str(err.value)


def test_missing_field_is_named() -> None:
    body = _update_body()
    del body["round_id"]
    with pytest.raises(ProtocolError, match="^round_id: missing"):
        decode_message(msgpack.packb(body, use_bin_type=True))


def test_oversized_payload_is_rejected_before_parsing() -> None:
    limits = Limits(max_payload_bytes=1000)
    with pytest.raises(ProtocolError, match="^payload: .*exceed"):
        decode_message(b"\x00" * 1001, limits)


def test_limits_on_layers_and_elements() -> None:
    body = _update_body()
    body["tensors"] = body["tensors"] * 3
    with pytest.raises(ProtocolError, match="^tensors: 3 items exceed"):
        decode_message(msgpack.packb(body, use_bin_type=True), Limits(max_layers=2))
    with pytest.raises(ProtocolError, match="^tensors: more than 10 elements"):
        decode_message(msgpack.packb(body, use_bin_type=True), Limits(max_total_elements=10))


def test_sender_cannot_emit_what_a_receiver_rejects() -> None:
    t = EncodedTensor((3,), "float32", "asym", 4, b"\x00", {}, "w")  # needs 2 bytes
    with pytest.raises(ProtocolError, match=r"tensors\[0\]\.data"):
        encode_message(Update("d", 1, 1, 8, "weights", (t,)))
    with pytest.raises(ProtocolError, match="^kind"):
        encode_message(object())  # type: ignore[arg-type]


# 7,000 random byte strings + 3,000 mutated valid maps = the 10,000 malformed inputs
# the protocol promises to survive with nothing but ProtocolError.
@settings(max_examples=7000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(payload: bytes) -> None:
    try:
        decode_message(payload)
    except ProtocolError:
        pass


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
valid_bodies = messages.map(lambda m: msgpack.unpackb(encode_message(m), raw=False))


@st.composite
def mutated_bodies(draw):
    """A valid message map with one field replaced, removed or added."""
    body = draw(valid_bodies)
    key = draw(st.sampled_from(sorted(body)))
    action = draw(st.sampled_from(["replace", "delete", "add", "tensor"]))
    if action == "replace":
        body[key] = draw(json_like)
    elif action == "delete":
        del body[key]
    elif action == "add":
        body[draw(st.text(max_size=6))] = draw(json_like)
    elif body.get("tensors"):
        t = body["tensors"][0]
        t[draw(st.sampled_from(sorted(t)))] = draw(json_like)
    return body


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(mutated_bodies())
def test_structurally_wrong_maps_raise_only_protocol_error(body) -> None:
    try:
        payload = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return  # not representable in msgpack: nothing to send
    try:
        decode_message(payload)
    except ProtocolError:
        pass


def test_deeply_nested_payload_is_a_protocol_error() -> None:
    # {"v": 1, "kind": "status", ..., "metrics": {"x": [[[...5000 deep...]]]}}, packed by hand
    # (msgpack's own packer refuses such depth, a hostile sender does not).
    head = msgpack.packb({"v": 1, "kind": "status", "state": "done", "round_id": 0})
    payload = bytes([head[0] + 1]) + head[1:] + msgpack.packb("metrics") + b"\x81\xa1x" + b"\x91" * 5000 + b"\x01"
    with pytest.raises(ProtocolError):
        decode_message(payload)


def test_topics_round_trip_and_reject_wildcards() -> None:
    assert topic("job1", "update", "pi-4") == "fedbit/job1/update/pi-4"
    assert parse_topic("fedbit/job1/update/pi-4") == ("job1", "update", "pi-4")
    assert parse_topic("fedbit/job1/round") == ("job1", "round", None)
    for bad in ["fedbit/job1/update/+", "fedbit/job1/update", "other/job1/round", "fedbit/#/round",
                "fedbit/job1/round/x", ""]:
        with pytest.raises(ProtocolError):
            parse_topic(bad)
    with pytest.raises(ProtocolError):
        topic("job1", "update", "a/b")


def test_digest_changes_with_any_byte() -> None:
    t = float32_tensor(np.arange(4, dtype=np.float32), "w")
    t2 = float32_tensor(np.array([0, 1, 2, 3.0000005], dtype=np.float32), "w")
    assert tensors_digest([t]) != tensors_digest([t2])
    assert tensors_digest([t]) == tensors_digest([float32_tensor(np.arange(4, dtype=np.float32), "w")])
    assert len(tensors_digest([])) == 64


def test_default_limits_fit_fedshift_cnn_in_float32() -> None:
    from firmware_models import fedshift_cnn

    spec = fedshift_cnn()
    ts = tuple(float32_tensor(np.zeros(s, np.float32), n) for n, s in zip_strict(spec.param_names(), spec.param_shapes()))
    msg = ModelMessage(1, "float32", spec.name, ts, tensors_digest(ts))
    payload = encode_message(msg)
    assert len(payload) < DEFAULT_LIMITS.max_payload_bytes
    assert decode_message(payload).tensors[2].shape == (512, 4096)
