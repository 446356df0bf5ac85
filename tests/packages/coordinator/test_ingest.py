"""The coordinator's ingest: every per-update rule, applied once, with its reason; and
each rule written in one place in the source tree."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from coordinator.ingest import Ingest, OpenRound, Rejected
from edge_client.codecs import encode
from edge_client.errors import ProtocolError
from edge_client.protocol import (
    Hello,
    Limits,
    Presence,
    Status,
    Update,
    encode_message,
    float32_tensor,
    model_variant,
    variant_bits,
)
from firmware_models import get_spec

ROOT = Path(__file__).resolve().parents[3]
SPEC = get_spec("mlp")
SHAPES = [tuple(s) for s in SPEC.param_shapes()]


def ingest(**limits) -> Ingest:
    return Ingest("mlp", SHAPES, Limits(**({"max_payload_bytes": 200_000} | limits)))


def payload(dev="a", r=1, *, n=5, bits=32, value=0.0, shapes=None, codec="float32", sigma=None) -> bytes:
    ts = []
    for s in shapes or SHAPES:
        if codec == "int":
            t = encode(np.full(s, int(value), np.int8), "int", 8)
        else:
            t = float32_tensor(np.full(s, value, np.float32))
        if sigma is not None:
            t = type(t)(t.shape, t.dtype, t.codec, t.bits, t.data, {**t.aux, "sigma_loc": sigma}, t.name)
        ts.append(t)
    return encode_message(Update(dev, r, n, bits, "weights", tuple(ts)))


def reason(fn) -> str:
    with pytest.raises(Rejected) as e:
        fn()
    return e.value.metric


def test_a_good_update_comes_out_checked_and_undecoded() -> None:
    rnd = OpenRound(1, frozenset({"a"}))
    eu = ingest().update("a", payload(bits=8, codec="int", value=-64), rnd, 0)
    assert eu.device_id == "a" and eu.compute_bits == 8 and not eu.lossy and eu.inferior  # exact integers
    assert [t.shape for t in eu.tensors] == SHAPES and eu.tensors[0].codec == "int"
    f = ingest().update("a", payload(bits=32), rnd, 0)
    assert f.compute_bits == 32 and not f.lossy and not f.inferior


def test_every_rule_has_its_reason() -> None:
    ing = ingest(max_abs_value=10.0)
    rnd = OpenRound(3, frozenset({"a", "b"}), accepted={"b": 0.0})
    nan = msgpack.unpackb(payload(), raw=False)
    nan["tensors"][0]["data"] = np.full(len(nan["tensors"][0]["data"]) // 4, np.nan, "<f4").tobytes()
    cases = {
        "rejected_oversized": lambda: ing.update("a", b"\0" * 200_001, rnd, 2),
        "rejected_malformed": lambda: ing.update("a", b"\x93 not msgpack", rnd, 2),
        "rejected_nonfinite": lambda: ing.update("a", msgpack.packb(nan, use_bin_type=True), rnd, 2),
        "rejected_wrong_kind": lambda: ing.update("a", encode_message(Presence("a", True)), rnd, 2),
        "rejected_spoofed": lambda: ing.update("a", payload("b", 3), rnd, 2),
        "dropped_late": lambda: ing.update("a", payload("a", 2), rnd, 2),
        "rejected_wrong_round": lambda: ing.update("a", payload("a", 4), rnd, 2),
        "rejected_not_selected": lambda: ing.update("c", payload("c", 3), rnd, 2),
        "dropped_duplicate": lambda: ing.update("b", payload("b", 3), rnd, 2),
        "rejected_wrong_shape": lambda: ing.update("a", payload("a", 3, shapes=SHAPES[:-1]), rnd, 2),
        "rejected_out_of_range": lambda: ing.update("a", payload("a", 3, value=10.5), rnd, 2),
    }
    for metric, fn in cases.items():
        assert reason(fn) == metric
    # between rounds: an update of the last closed round is late, a later one wrong
    assert reason(lambda: ing.update("a", payload("a", 3), None, 3)) == "dropped_late"
    assert reason(lambda: ing.update("a", payload("a", 4), None, 3)) == "rejected_wrong_round"
    # at the limit: accepted; an Int8 device's -64 is -0.5 in the shared domain
    ing.update("a", payload("a", 3, value=10.0), rnd, 2)
    small = ingest(max_abs_value=0.49)
    assert reason(lambda: small.update("a", payload("a", 3, bits=8, codec="int", value=-64), rnd, 2)) \
        == "rejected_out_of_range"


def test_tensor_rules_name_the_layer() -> None:
    ing = ingest()
    rnd = OpenRound(1, frozenset({"a"}))
    with pytest.raises(Rejected, match=r"tensors\[0\].*integer tensor"):
        ing.update("a", payload(bits=32, codec="int"), rnd, 0)
    with pytest.raises(Rejected, match=r"tensors\[1\].shape"):
        ing.update("a", payload(shapes=[SHAPES[0], (3, 3), *SHAPES[2:]]), rnd, 0)
    for bad in (-1.0, True):
        with pytest.raises(Rejected, match="sigma_loc"):
            ing.update("a", payload(sigma=bad), rnd, 0)


def test_hello_and_presence() -> None:
    ing = ingest()
    h = Hello("d", "p", 8, "int", "int", 8, 10, "0")
    assert ing.device("hello", "d", encode_message(h)) == h
    assert ing.device("presence", "d", b"") is None  # a cleared retained message
    assert ing.device("presence", "d", encode_message(Presence("d", False))) == Presence("d", False)
    assert reason(lambda: ing.device("hello", "x", encode_message(h))) == "rejected_spoofed"
    assert reason(lambda: ing.device("presence", "d", encode_message(h))) == "rejected_wrong_kind"
    assert reason(lambda: ing.device("hello", "d", encode_message(Status("done", 1)))) == "rejected_wrong_kind"
    for bits, trainer in ((5, "int"), (32, "int")):
        bad = Hello("d", "p", bits, trainer, "int", 8, 10, "0")
        assert reason(lambda bad=bad: ing.device("hello", "d", encode_message(bad))) == "rejected_malformed"


def test_variant_names_round_trip() -> None:
    assert model_variant(8, "int") == "int8" and model_variant(32, "torch") == "float32"
    assert model_variant(16, "torch") == "float32"
    for bits in (2, 4, 6, 8, 12, 16):
        assert variant_bits(model_variant(bits, "int")) == bits
    assert variant_bits("float32") == 32
    for bad in ("int", "int1", "int17", "float16", "int8x"):
        with pytest.raises(ProtocolError, match="variant"):
            variant_bits(bad)


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in ("coordinator", "edge_client")
            for p in (ROOT / pkg).rglob("*.py")}


@pytest.mark.parametrize("rule, pattern", [
    ("layer shapes", r"the model has \{"),
    ("integer tensor from a float device", r"integer tensor \("),
    ("duplicate update", r"already counted"),
    ("magnitude limit", r"exceed the \"\s*\n?\s*f?\"?limit max_abs_value|limit max_abs_value ="),
    ("spoofed id", r"!= payload id"),
    ("storage grid s_g = max(s, 8)", r"max\((?:check_bits\()?(?:compute_)?bits\)?, 8\)|2\.0 \*\* -"),
    ("variant naming", r"f\"int\{"),
])
def test_each_rule_is_written_once(rule: str, pattern: str) -> None:
    """docs/architecture.md#the-update-path: every per-update rule has one definition
    (issue 9: they were written twice, in the server and the strategy)."""
    hits = [(f, len(re.findall(pattern, s))) for f, s in _sources().items() if re.search(pattern, s)]
    assert len(hits) == 1 and hits[0][1] == 1, (rule, hits)
