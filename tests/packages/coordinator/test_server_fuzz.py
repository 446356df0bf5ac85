"""Fuzzing the coordinator's update path: mutated bytes, tampered aux, non-finite and huge
values go through ``handle_batch`` of an open round. Nothing escapes, each message is
either accepted or counted under one rejection reason, and the sums stay finite."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.config import ServerConfig
from coordinator.fleet import Inbound, InProcessFleet
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.codecs import decode, encode
from edge_client.intnn import init_shared
from edge_client.protocol import Limits, Update, decode_message, encode_message, topic
from edge_client.transport import Received
from firmware_models import get_spec

JOB = "fz"
SPEC = get_spec("mlp")
LIMIT = 1e3
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def payload(tensors, cbits: int = 32, **patch) -> bytes:
    """A valid update's bytes, then every tensor's ``patch`` fields (data, aux) replaced
    as a device could send them (bypassing the sender's validation)."""
    good = encode_message(Update("d", 1, 7, cbits, "weights", tuple(tensors)))
    if not patch:
        return good
    body = msgpack.unpackb(good, raw=False)
    for t in body["tensors"]:
        t.update({k: (v(t) if callable(v) else v) for k, v in patch.items()})
    return msgpack.packb(body, use_bin_type=True)


@st.composite
def mutated(draw) -> bytes:
    base = init_shared(SPEC, 0)
    kind = draw(st.sampled_from(["flip", "truncate", "values", "asym_aux", "codebook", "int"]))
    if kind == "values":
        v = np.float32(draw(f32))
        return payload([encode(w, "float32") for w in base],
                       data=lambda t: np.full(len(t["data"]) // 4, v, "<f4").tobytes())
    if kind == "asym_aux":
        lo, hi = draw(f32), draw(f32)
        return payload([encode(w, "asym", 4) for w in base], aux={"min": lo, "max": hi})
    if kind == "codebook":
        book = draw(st.lists(f32, min_size=8, max_size=8))
        return payload([encode(w, "kmeans", 3) for w in base], aux={"codebook": book})
    if kind == "int":
        bits, cbits = draw(st.integers(2, 16)), draw(st.sampled_from([6, 8, 16, 32]))
        return payload((encode(np.zeros(w.shape, np.int16), "int", bits) for w in base), cbits)
    good = bytearray(payload(encode(w, draw(st.sampled_from(["asym", "kmeans", "float16"])),
                                    None) for w in base))
    if kind == "truncate":
        return bytes(good[: draw(st.integers(0, len(good) - 1))])
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(good) - 1))
        good[i] = draw(st.integers(0, 255))
    return bytes(good)


def test_fuzzed_updates_never_escape_and_never_poison_the_sums(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    fleet.start()
    cfg = ServerConfig(job=JOB, model="mlp", rounds=1, limits=Limits(max_abs_value=LIMIT))
    co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp_path / "run"), evaluator=None,
                     init_weights=init_shared(SPEC, 0))
    col = co.collector
    seen = {"accepted": 0}

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated())
    def one(p: bytes) -> None:
        before = sum(col.counts.values())
        rnd = co.open_round(1, ["d"])                         # a fresh round for each message
        t = topic(JOB, "update", "d")
        col.handle_batch([Inbound("update", "d", p, time.monotonic(), t, Received(t, p, 1))])
        assert sum(col.counts.values()) + len(rnd.accepted) == before + 1  # accepted, or one reason
        if rnd.accepted:
            seen["accepted"] += 1
            for t in decode_message(p).tensors:
                if t.dtype == "float32":
                    a = decode(t).astype(np.float64)
                    assert np.isfinite(a).all() and np.abs(a).max() <= LIMIT
            for w in co.strategy.finish().weights:
                assert np.isfinite(w).all()

    try:
        one()
        assert seen["accepted"] > 0                          # the valid ones got through
        assert col.counts["rejected_out_of_range"] > 0 and col.counts["rejected_nonfinite"] > 0
    finally:
        fleet.close()
