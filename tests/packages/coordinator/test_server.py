"""The round loop over the in-process fleet: exact aggregation, rejections, stragglers,
late and duplicate updates, crash and resume. Devices are real ``DeviceRuntime`` loops
with a small numpy trainer (the real trainers are exercised in test_system.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
from conftest import ShiftTrainer

from coordinator.config import ServerConfig
from coordinator.defense.config import DefenseConfig
from coordinator.fleet import InProcessFleet
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared
from edge_client.protocol import (
    Hello,
    Limits,
    Presence,
    RoundAnnouncement,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    topic,
)
from edge_client.runtime import DeviceConfig, DeviceRuntime
from firmware_models import get_spec

JOB = "t"
SPEC = get_spec("mlp")




def data(n: int) -> SimpleNamespace:
    return SimpleNamespace(x=np.zeros((n, 1, 8, 8), np.float32), y=np.zeros(n, np.int64))


def start_device(fleet: InProcessFleet, tmp: Path, dev: str, shift: float, n: int,
                 delay: float = 0.0) -> tuple[DeviceRuntime, threading.Thread]:
    cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=tmp / dev,
                       train_delay_s=delay)
    rt = DeviceRuntime(cfg, data(n), fleet.device_connector(dev),
                       trainer_factory=lambda spec, bits, seed: ShiftTrainer(shift))
    th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
    th.start()
    return rt, th


def coordinator(fleet, out: Path, **kw) -> Coordinator:
    cfg = ServerConfig(job=JOB, model="mlp", **({"rounds": 2, "min_devices": 2, "round_timeout_s": 10,
                                                 "presence_timeout_s": 20} | kw))
    return Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(out), evaluator=None,
                       init_weights=init_shared(SPEC, 0))


def next_payload(client, timeout: float = 10.0) -> bytes | None:
    """The next non-empty message (a cleared retained topic arrives as an empty one)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = client.recv(0.2)
        if m is not None and m.payload:
            return m.payload
    return None


def counts(history: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for rec in history:
        for k, v in rec["counts"].items():
            total[k] = total.get(k, 0) + v
    return total


def test_rounds_aggregate_exactly_and_devices_exit(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    devs = [start_device(fleet, tmp_path, "a", 0.01, 30), start_device(fleet, tmp_path, "b", -0.03, 10)]
    co = coordinator(fleet, tmp_path / "out", rounds=3)
    w0 = [w.copy() for w in co.weights]
    hist = co.run()
    assert [h["round"] for h in hist] == [1, 2, 3]
    assert all(h["accepted"] == 2 and h["aggregated"] for h in hist)
    # FedAvg by sample count: (30 * 0.01 - 10 * 0.03) / 40 = 0, so the model is unchanged
    for a, b in zip(co.weights, w0, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for rt, th in devs:
        th.join(10)
        assert not th.is_alive() and rt.rounds_done == [1, 2, 3]
    lines = RunState(tmp_path / "out").read_metrics()
    assert [m["round"] for m in lines] == [1, 2, 3]


def test_weighted_average_moves_the_model(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    start_device(fleet, tmp_path, "a", 0.02, 30)
    start_device(fleet, tmp_path, "b", 0.06, 10)
    co = coordinator(fleet, tmp_path / "out", rounds=2)
    w0 = [w.copy() for w in co.weights]
    co.run()
    step = np.float32((30 * 0.02 + 10 * 0.06) / 40)  # 0.03 per round
    for a, b in zip(co.weights, w0, strict=True):
        np.testing.assert_allclose(a, b + 2 * step, atol=1e-5)


def _nan_update(dev: str, r: int) -> bytes:
    ws = [np.zeros(s, np.float32) for s in SPEC.param_shapes()]
    good = encode_message(Update(dev, r, 5, 32, "weights",
                                 tuple(float32_tensor(w) for w in ws)))
    body = msgpack.unpackb(good, raw=False)
    data = bytearray(body["tensors"][0]["data"])
    data[0:4] = np.float32(np.nan).tobytes()
    body["tensors"][0]["data"] = bytes(data)
    return msgpack.packb(body, use_bin_type=True)


def _update(dev: str, r: int, shapes=None) -> bytes:
    ws = [np.zeros(s, np.float32) for s in (shapes or SPEC.param_shapes())]
    return encode_message(Update(dev, r, 5, 32, "weights", tuple(float32_tensor(w) for w in ws)))


def test_bad_updates_are_rejected_counted_and_the_loop_goes_on(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    # slow devices so the bad messages land inside round 1
    start_device(fleet, tmp_path, "a", 0.01, 20, delay=0.6)
    start_device(fleet, tmp_path, "b", 0.01, 20, delay=0.6)
    co = coordinator(fleet, tmp_path / "out", rounds=2,
                     limits=Limits(max_payload_bytes=100_000))
    evil = fleet.hub.client("evil", subscriptions=[topic(JOB, "round")])
    evil.connect()
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("h", co.run()), daemon=True)
    th.start()
    p = next_payload(evil)
    assert p is not None
    ann = decode_message(p)
    assert isinstance(ann, RoundAnnouncement) and ann.round_id == 1
    up = lambda d: topic(JOB, "update", d)  # noqa: E731
    evil.publish(up("a"), b"\x93not msgpack at all")                       # malformed
    evil.publish(up("a"), _update("b", 1))                                  # spoofed
    evil.publish(up("a"), _update("a", 7))                                  # wrong round
    evil.publish(up("a"), b"\x00" * 150_000)                                # oversized
    evil.publish(up("a"), _nan_update("a", 1))                              # NaN
    evil.publish(up("a"), _update("a", 1, shapes=[(3, 3)] * 2))             # wrong shape
    evil.publish(up("zz"), _update("zz", 1))                                # not selected
    evil.publish(topic(JOB, "hello", "x1"), encode_message(
        Hello("x2", "p", 8, "int", "int", 8, 10, "0")))                      # spoofed hello
    evil.publish(topic(JOB, "presence", "x1"), encode_message(Presence("x1", True)))  # no hello
    th.join(30)
    hist = result["h"]
    assert [h["round"] for h in hist] == [1, 2]
    assert all(h["accepted"] == 2 for h in hist)       # the good updates all counted
    c = counts(hist)
    for reason, n in [("rejected_malformed", 1), ("rejected_spoofed", 2), ("rejected_wrong_round", 1),
                      ("rejected_oversized", 1), ("rejected_nonfinite", 1),
                      ("rejected_wrong_shape", 1), ("rejected_not_selected", 1)]:
        assert c.get(reason) == n, (reason, c)
    present = co.collector.devices.present()
    assert "x1" not in present and "x2" not in present


def test_straggler_excluded_at_deadline_and_late_update_dropped(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    start_device(fleet, tmp_path, "a", 0.01, 20)
    silent = fleet.hub.client("quiet", subscriptions=[topic(JOB, "round")], birth=[
        (topic(JOB, "presence", "quiet"), encode_message(Presence("quiet", True)), True),
        (topic(JOB, "hello", "quiet"), encode_message(Hello("quiet", "p", 32, "torch", "float32", 32, 9, "0")), True),
    ])
    silent.connect()
    co = coordinator(fleet, tmp_path / "out", rounds=2, round_timeout_s=3.0)
    t0 = time.monotonic()
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("h", co.run()), daemon=True)
    th.start()
    # the silent device never trains; in round 2 it sends a round-1 update (late)
    sent = set()
    while th.is_alive() and time.monotonic() - t0 < 20:
        m = silent.recv(0.2)
        if m is None or not m.payload:
            continue
        ann = decode_message(m.payload)
        if ann.round_id == 2 and 2 not in sent:
            sent.add(2)
            silent.publish(topic(JOB, "update", "quiet"), _update("quiet", 1))   # late
    th.join(20)
    hist = result["h"]
    assert len(hist) == 2
    for h in hist:
        assert h["accepted"] == 1 and h["accepted_ids"] == ["a"]
        assert h["stragglers"] == 1 and h["straggler_ids"] == ["quiet"]
        assert h["round_seconds"] < 8                   # closed at the 3 s deadline
    assert counts(hist).get("dropped_late") == 1


def _scripted(fleet: InProcessFleet, dev: str):
    c = fleet.hub.client(dev, subscriptions=[topic(JOB, "round")], birth=[
        (topic(JOB, "presence", dev), encode_message(Presence(dev, True)), True),
        (topic(JOB, "hello", dev), encode_message(Hello(dev, "p", 32, "torch", "float32", 32, 9, "0")), True),
    ])
    c.connect()
    return c


def test_duplicate_update_counted_once(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    co = coordinator(fleet, tmp_path / "out", rounds=1, min_devices=2, round_timeout_s=5)
    d, e = _scripted(fleet, "d"), _scripted(fleet, "e")
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("h", co.run()), daemon=True)
    th.start()
    assert next_payload(d) is not None
    d.publish(topic(JOB, "update", "d"), _update("d", 1))
    d.publish(topic(JOB, "update", "d"), _update("d", 1))   # e.g. paho retry + outbox re-send
    e.publish(topic(JOB, "update", "e"), _update("e", 1))
    th.join(10)
    h = result["h"][0]
    assert h["accepted"] == 2 and h["accepted_ids"] == ["d", "e"]
    assert h["counts"].get("dropped_duplicate") == 1


def _filled(dev: str, value: float, *, codec: str = "float32", bits: int = 32, cbits: int = 32) -> bytes:
    from edge_client.codecs import encode

    ts = []
    for s in SPEC.param_shapes():
        if codec == "int":
            ts.append(encode(np.full(s, value, np.int16), codec="int", bits=bits))
        else:
            ts.append(float32_tensor(np.full(s, value, np.float32)))
    return encode_message(Update(dev, 1, 5, cbits, "weights", tuple(ts)))


def test_huge_finite_update_is_rejected_before_the_sums(tmp_path: Path) -> None:
    """|v| beyond Limits.max_abs_value (here 100) is rejected as out_of_range, whatever the
    codec, before it can overflow the sums; at the limit it is accepted; an integer
    device's values count in the shared domain (q / 2^(s-1))."""
    fleet = InProcessFleet(JOB)
    co = coordinator(fleet, tmp_path / "out", rounds=1, min_devices=3, round_timeout_s=5,
                     limits=Limits(max_abs_value=100.0), defense=DefenseConfig(norm_bound=0))  # (d's 100 is exact)
    d, e, f = _scripted(fleet, "d"), _scripted(fleet, "e"), _scripted(fleet, "f")
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("h", co.run()), daemon=True)
    th.start()
    assert next_payload(d) is not None
    up = lambda dev: topic(JOB, "update", dev)  # noqa: E731
    d.publish(up("d"), _filled("d", 3e38))                                   # would overflow
    d.publish(up("d"), _filled("d", 100.5))                                  # just over
    f.publish(up("f"), _filled("f", -1, codec="int", bits=16, cbits=8))      # int16 grid: 256
    d.publish(up("d"), _filled("d", 100.0))                                  # at the limit
    f.publish(up("f"), _filled("f", -64, codec="int", bits=8, cbits=8))      # int8 grid: -0.5
    e.publish(up("e"), _filled("e", -2.0))   # (last: a refused update frees its device's slot, and
    #                                          the round closes once every selected device answered)
    th.join(10)
    h = result["h"][0]
    assert h["accepted_ids"] == ["d", "e", "f"]
    assert h["counts"].get("rejected_out_of_range") == 3
    for w in co.weights:
        np.testing.assert_allclose(w, (100.0 - 2.0 - 0.5) / 3, rtol=1e-6)


def test_max_abs_value_is_validated() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e30):
        with pytest.raises(ConfigError, match="max_abs_value"):
            ServerConfig(limits=Limits(max_abs_value=bad)).validate()
    ServerConfig(limits=Limits(max_abs_value=1e21)).validate()


class Crash(BaseException):
    pass


def test_crash_mid_round_then_resume_counts_each_update_once(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    start_device(fleet, tmp_path, "a", 0.01, 20)
    start_device(fleet, tmp_path, "b", 0.03, 20, delay=1.0)
    out = tmp_path / "out"
    co = coordinator(fleet, out, rounds=3, round_timeout_s=20)
    real_ack = fleet.ack

    def crashing_ack(msg):
        rnd = co.collector.round
        if rnd is not None and rnd.round_id == 2 and msg.kind == "update" and rnd.accepted:
            raise Crash("killed after persisting, before the ack")
        real_ack(msg)

    fleet.ack = crashing_ack  # type: ignore[method-assign]
    with pytest.raises(Crash):
        co.run()
    st = RunState(out)
    assert st.load_checkpoint().completed_round == 1
    persisted = [d for d, _ in RunState(out).inbox_items(2)]
    assert persisted == ["a"]
    # a fresh coordinator on the same directory (and broker): --resume
    fleet.ack = real_ack  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="resume"):
        coordinator(fleet, out, rounds=3).run()
    co2 = coordinator(fleet, out, rounds=3, round_timeout_s=20)
    hist = co2.run(resume=True)
    assert [h["round"] for h in hist] == [1, 2, 3]
    r2 = hist[1]
    assert r2["resumed"] and r2["replayed"] == 1
    assert r2["accepted_ids"] == ["a", "b"] and r2["accepted"] == 2
    assert [m["round"] for m in st.read_metrics()] == [1, 2, 3]


def test_update_read_but_not_persisted_before_a_crash_comes_back(tmp_path: Path) -> None:
    """The coordinator crashes after reading round 2's updates but before any is in its
    inbox: the in-process hub, like a broker's persistent session, redelivers them (they
    were never acked), so the resumed round counts both, none replayed from disk."""
    fleet = InProcessFleet(JOB)
    start_device(fleet, tmp_path, "a", 0.01, 20)
    start_device(fleet, tmp_path, "b", 0.03, 20)
    out = tmp_path / "out"
    co = coordinator(fleet, out, rounds=3, round_timeout_s=20)
    real_append = co.state.inbox_append

    def crashing_append(round_id, device_id, payload):
        if round_id == 2:
            raise Crash("killed while persisting")
        real_append(round_id, device_id, payload)

    co.state.inbox_append = crashing_append  # type: ignore[method-assign]
    with pytest.raises(Crash):
        co.run()
    assert fleet.hub.unacked("coordinator") >= 1
    assert [d for d, _ in RunState(out).inbox_items(2)] == []
    hist = coordinator(fleet, out, rounds=3, round_timeout_s=20).run(resume=True)
    assert [h["round"] for h in hist] == [1, 2, 3]
    r2 = hist[1]
    assert r2["resumed"] and r2["replayed"] == 0
    assert r2["accepted_ids"] == ["a", "b"] and r2["stragglers"] == 0
    assert fleet.hub.unacked("coordinator") == 0


def test_resumed_run_selects_like_an_uninterrupted_one(tmp_path: Path) -> None:
    """fraction C = 0.5 of 4 devices: the seeded selection of every round is the same
    whether or not the coordinator crashed (and resumed) in the middle of round 2."""

    def fleet_with_devices(tag: str) -> InProcessFleet:
        fleet = InProcessFleet(JOB)
        for i, dev in enumerate("abcd"):
            start_device(fleet, tmp_path / tag, dev, 0.01 * (i + 1), 10 + i)
        return fleet

    kw = {"rounds": 4, "fraction": 0.5, "min_devices": 2, "min_present": 4, "round_timeout_s": 10}
    straight = coordinator(fleet_with_devices("A"), tmp_path / "A" / "out", **kw).run()

    fleet = fleet_with_devices("B")
    co = coordinator(fleet, tmp_path / "B" / "out", **kw)
    real_ack = fleet.ack

    def crashing_ack(msg):
        rnd = co.collector.round
        if rnd is not None and rnd.round_id == 2 and msg.kind == "update" and rnd.accepted:
            raise Crash("killed mid-round")
        real_ack(msg)

    fleet.ack = crashing_ack  # type: ignore[method-assign]
    with pytest.raises(Crash):
        co.run()
    fleet.ack = real_ack  # type: ignore[method-assign]
    resumed = coordinator(fleet, tmp_path / "B" / "out", **kw).run(resume=True)
    assert [h["selected_ids"] for h in resumed] == [h["selected_ids"] for h in straight]
    assert all(h["selected"] == 2 for h in straight)
    for a, b in zip(straight, resumed, strict=True):
        assert a["weight_change_l2"] == pytest.approx(b["weight_change_l2"], rel=1e-6)


def test_updates_are_folded_without_a_decoded_copy(tmp_path: Path) -> None:
    """ASYM, K-means and an integer device's ``int`` updates go from the payload straight
    into the sums (no decode buffer is ever taken); a ternary one is decoded; all are
    persisted before the ack and the aggregate equals decoding every update first."""
    from coordinator.fleet import Inbound
    from coordinator.strategies import EncodedUpdate
    from coordinator.strategies.checks import is_lossy
    from coordinator.strategies.decode import decode_update
    from edge_client.codecs import encode
    from edge_client.transport import Received

    fleet = InProcessFleet(JOB)
    fleet.start()
    # (the defense's norm bound decodes each update once to measure it: off here, where the
    # strategy's own path is under test)
    co = coordinator(fleet, tmp_path / "run", defense=DefenseConfig(norm_bound=0, sample_bound=0))
    base = init_shared(SPEC, 0)
    rng = np.random.default_rng(1)
    plans = [("a", "asym", 4, 32), ("b", "kmeans", 3, 32), ("c", "asym", 8, 32), ("d", "asym", 4, 32),
             ("e", "int", 8, 8), ("f", "ternary", 2, 8)]
    payloads, ref = {}, build_strategy("fedavg")
    ref.begin_round(1, base)
    for dev, codec, bits, cbits in plans:
        if codec == "int":
            ts = tuple(encode(np.clip(np.round(w * 127), -127, 127).astype(np.int8), "int", 8) for w in base)
        elif codec == "ternary":
            ts = tuple(encode(np.sign(w).astype(np.int8), "ternary") for w in base)
        else:
            ts = tuple(encode(w + rng.normal(0, 0.01, w.shape).astype(np.float32), codec, bits) for w in base)
        payloads[dev] = encode_message(Update(dev, 1, 50, cbits, "weights", ts))
        ref.accept(decode_update(EncodedUpdate(dev, 50, ts, "weights", cbits, is_lossy(ts))))
    rnd = co.open_round(1, list(payloads))
    batch = [Inbound("update", dev, p, time.monotonic(), topic(JOB, "update", dev),
                     Received(topic(JOB, "update", dev), p, 1)) for dev, p in payloads.items()]
    co.collector.handle_batch(batch[:5])
    assert co.strategy._decode_buffers.allocated == 0  # float codecs and int: nothing decoded
    co.collector.handle_batch(batch[5:])
    assert co.strategy._decode_buffers.allocated == 1  # the ternary one
    assert sorted(rnd.accepted) == sorted(payloads)
    assert [d for d, _ in co.state.inbox_items(1)] == list(payloads)  # persisted, in order
    got, want = co.strategy.finish().weights, ref.finish().weights
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    fleet.close()
