"""Robust aggregation: norm clipping against the round's median norm, coordinate-wise
trimmed mean and median, as strategy parameters composing with masks and combiners; and
one authenticated device sending a poisoned update while the model stays within a stated
margin of the clean run."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from coordinator.defense.config import DefenseConfig
from coordinator.strategies import ClientUpdate, Strategy, build_strategy
from coordinator.strategies.robust import RobustStrategy, clip_scales, trimmed_mean
from coordinator.strategies.types import EncodedUpdate
from edge_client.codecs import encode
from edge_client.errors import ConfigError
from edge_client.protocol import float32_tensor

SHAPES = [(4, 3), (5,)]
G = [np.zeros(s, np.float32) for s in SHAPES]


def upd(dev: str, value, n: int = 10, bits: int = 32, kind: str = "weights") -> ClientUpdate:
    return ClientUpdate(dev, n, [np.full(s, value, np.float32) if np.isscalar(value) else value[i]
                                 for i, s in enumerate(SHAPES)], kind, bits)


def run(strategy: Strategy, updates: list[ClientUpdate], g=G) -> list[np.ndarray]:
    strategy.begin_round(1, g)
    for u in updates:
        strategy.accept(u)
    return strategy.finish().weights


def test_trimmed_mean_and_clip_scales_against_references() -> None:
    rng = np.random.default_rng(0)
    m = rng.normal(size=(9, 40)).astype(np.float32)
    for k in (0, 1, 3):
        ref = stats.trim_mean(m.astype(np.float64), k / 9, axis=0)
        np.testing.assert_allclose(trimmed_mean(m.copy(), k), ref, rtol=1e-6)
    with pytest.raises(ValueError):
        trimmed_mean(m.copy(), 5)
    s = clip_scales(np.array([1.0, 2.0, 3.0, 300.0, 0.0]), 1.0)
    np.testing.assert_allclose(s, [1.0, 1.0, 2 / 3, 2 / 300, 1.0])


def test_the_registry_builds_robust_strategies_only_when_asked() -> None:
    assert type(build_strategy("fedavg")) is Strategy                       # streaming, unchanged
    s = build_strategy("fedshift", robust="median", clip=2.0, weighted=False)
    assert isinstance(s, RobustStrategy) and s.clip == 2.0 and not s.weighted
    for bad in ({"robust": "krum"}, {"trim": 0.5}, {"clip": -1}, {"clip": float("inf")}, {"trim": True}):
        with pytest.raises(ConfigError):
            build_strategy("fedavg", **bad)


def test_order_statistics_over_all_updates() -> None:
    rng = np.random.default_rng(1)
    vals = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(7)]
    ups = [upd(f"d{i}", v, n=10 * (i + 1)) for i, v in enumerate(vals)]
    ups.append(upd("evil", 1e5, n=10**9))                                       # huge, and heavy
    for robust, ref in (("median", lambda a: np.median(a, axis=0)),
                        ("trimmed_mean", lambda a: stats.trim_mean(a, 1 / 8, axis=0))):
        w = run(build_strategy("fedavg", robust=robust, trim=0.125), ups)
        for li in range(len(SHAPES)):
            stack = np.stack([u.weights[li] for u in ups]).astype(np.float64)
            np.testing.assert_allclose(w[li], ref(stack), rtol=1e-5, atol=1e-6)
    # fedshift, fedpaq compose: fedpaq with server_lr 1 is the robust average itself
    a = run(build_strategy("fedpaq", robust="median"), ups)
    b = run(build_strategy("fedavg", robust="median"), ups)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_robust_options_that_remove_nothing_at_the_rounds_size_say_so(caplog) -> None:
    ups = [upd(f"d{i}", float(i)) for i in range(3)]
    for params, n, what in (({"robust": "trimmed_mean", "trim": 0.1}, 3, "trim 0.1 drops nothing from 3"),
                            ({"robust": "median"}, 2, "the median of 2 update(s) is their mean"),
                            ({"clip": 2.0}, 2, "clip 2 x the median norm cannot bound any of 2")):
        caplog.clear()
        s = build_strategy("fedavg", **params)
        for _ in range(2):  # (said once, not every round)
            s.begin_round(1, G)
            for u in ups[:n]:
                s.accept(u)
            assert s.finish().stats["robust_ineffective"] == 1
        assert [r.getMessage() for r in caplog.records if what in r.getMessage()] and len(caplog.records) == 1
    s = build_strategy("fedavg", robust="trimmed_mean", trim=0.34)         # drops one of each end of 3
    s.begin_round(1, G)
    for u in ups:
        s.accept(u)
    assert s.finish().stats["robust_ineffective"] == 0


def test_order_statistics_per_group_for_grouped_combiners() -> None:
    ups = [upd("a", 1.0, bits=8), upd("b", 2.0, bits=8), upd("c", 90.0, bits=8),
           upd("d", -1.0), upd("e", -3.0), upd("f", -2.0)]
    s = build_strategy("grouped", robust="median")
    s.begin_round(1, G)
    for u in ups:
        s.accept(u)
    res = s.finish()
    assert np.allclose(res.group_weights[8][0], 2.0) and np.allclose(res.group_weights[32][0], -2.0)


def test_norm_clipping_against_the_round_median() -> None:
    g = [np.ones(s, np.float32) for s in SHAPES]
    ups = [upd("a", 1.1), upd("b", 0.8), upd("c", 1.2), upd("d", 101.0)]     # Δ = 0.1, -0.2, 0.2, 100
    w = run(build_strategy("fedavg", clip=1.0), ups, g)
    p = sum(int(np.prod(s)) for s in SHAPES)
    norms = np.array([0.1, 0.2, 0.2, 100.0]) * np.sqrt(p)
    med = np.median(norms)
    deltas = np.array([0.1, -0.2, 0.2, 100.0 * med / norms[3]])              # d clipped to the median
    np.testing.assert_allclose(w[0], 1.0 + deltas.mean(), rtol=1e-5)
    stats_ = build_strategy("fedavg", clip=1.0)
    stats_.begin_round(1, g)
    for u in ups:
        stats_.accept(u)
    st = stats_.finish().stats
    assert st["robust_clipped"] == 1 and st["robust_max_norm"] == pytest.approx(norms[3], rel=1e-5)


def test_clipping_wire_updates_keeps_them_encoded_and_matches_the_decoded_path() -> None:
    rng = np.random.default_rng(2)
    ws = [[rng.normal(0, 0.1 * (i + 1), size=s).astype(np.float32) for s in SHAPES] for i in range(5)]
    ws[4] = [w * 50 for w in ws[4]]

    def wire(i: int) -> EncodedUpdate:
        codec = ("asym", 8) if i % 2 else ("float32", None)
        return EncodedUpdate(f"d{i}", 10, tuple(encode(w, *codec) if codec[1] else float32_tensor(w) for w in ws[i]),
                             "weights", 32, codec[0] != "float32")

    s = build_strategy("fedavg", clip=1.5)
    s.begin_round(1, G)
    for i in range(5):
        s.fold(wire(i))
    assert all(h.encoded is not None and h.layers is None for h in s._held)  # wire bytes only
    fused = s.finish().weights
    from coordinator.strategies.decode import decode_update

    decoded = run(build_strategy("fedavg", clip=1.5), [decode_update(wire(i)) for i in range(5)])
    for a, b in zip(fused, decoded, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_robust_wire_updates_with_int_tensors_and_deltas() -> None:
    from coordinator.strategies.checks import integer_scale

    q = [np.full(s, 64, np.int8) for s in SHAPES]
    eu = EncodedUpdate("q", 10, tuple(encode(x, "int", 8) for x in q), "weights", 8, True)
    d = upd("d", 0.25, kind="delta")
    s = build_strategy("fedavg", robust="median")
    g = [np.full(sh, 0.5, np.float32) for sh in SHAPES]
    s.begin_round(1, g)
    s.fold(eu)
    s.accept(d)
    s.accept(upd("w", 0.6))
    w = s.finish().weights
    # rows: 64 * 2^-7 = 0.5, 0.5 + 0.25 = 0.75, 0.6 -> median 0.6
    assert integer_scale(8) * 64 == 0.5
    np.testing.assert_allclose(w[0], 0.6, rtol=1e-6)


# --------------------------------------------------------------------------- poisoning


#: the round loop's poisoning defense off (coordinator.defense): the strategies alone
NO_DEFENSE = DefenseConfig(norm_bound=0, sample_bound=0, strikes=0)


def _federated_accuracy(tmp: Path, params: dict, attack: bool, rounds: int = 5, n: int = 5) -> float:
    """Accuracy (Int8 model, digits test split) after ``rounds`` of ``n`` Int8 devices on
    digits shards, FedAvg with ``params`` and without the round loop's defense (the
    strategies alone: tests/packages/coordinator/test_attack.py has the defense); ``attack``: one more,
    authenticated device answers every round with ``-4 × the global model`` claiming
    100,000 samples."""
    from coordinator.config import ServerConfig
    from coordinator.evaluate import make_evaluator
    from coordinator.fleet import InProcessFleet
    from coordinator.server import Coordinator
    from coordinator.state import RunState
    from edge_client.data import load_digits, load_source
    from edge_client.intnn import init_shared
    from edge_client.protocol import (
        Hello,
        Presence,
        RoundAnnouncement,
        Update,
        decode_message,
        encode_message,
        topic,
    )
    from edge_client.runtime import DeviceConfig, DeviceRuntime, model_to_shared
    from firmware_models import get_spec
    from hw_profiles import load_profile

    job = "rob"
    fleet = InProcessFleet(job)
    prof = load_profile("raspberry-pi-4")
    for i in range(n):
        cfg = DeviceConfig.from_profile(f"d{i}", prof, job=job, workdir=tmp / f"d{i}", seed=i)
        rt = DeviceRuntime(cfg, load_source(f"digits:{i + 1}/{n}"), fleet.device_connector(f"d{i}"))
        threading.Thread(target=rt.run, kwargs={"max_seconds": 120}, daemon=True).start()
    stop = threading.Event()
    if attack:
        evil = fleet.hub.client("evil", subscriptions=[topic(job, "round"), topic(job, "model", "float32")], birth=[
            (topic(job, "presence", "evil"), encode_message(Presence("evil", True)), True),
            (topic(job, "hello", "evil"), encode_message(Hello("evil", "desktop", 32, "torch", "float32", 32,
                                                               100_000, "x")), True)])
        evil.connect()

        def attacker() -> None:
            ann = model = None
            while not stop.is_set():
                m = evil.recv(0.1)
                if m is None or not m.payload:
                    continue
                msg = decode_message(m.payload)
                ann, model = (msg, model) if isinstance(msg, RoundAnnouncement) else (ann, msg)
                if ann is not None and model is not None and model.round_id == ann.round_id:
                    bad = tuple(float32_tensor(-4.0 * w) for w in model_to_shared(model))
                    evil.publish(topic(job, "update", "evil"),
                                 encode_message(Update("evil", ann.round_id, 100_000, 32, "weights", bad)))
                    ann = None

        threading.Thread(target=attacker, daemon=True).start()
    cfg = ServerConfig(job=job, model="mlp", rounds=rounds, min_devices=n + int(attack),
                       round_timeout_s=60, presence_timeout_s=60, hparams={"epochs": 2, "batch": 32},
                       defense=NO_DEFENSE)
    co = Coordinator(cfg, fleet, build_strategy("fedavg", **params), RunState(tmp / "run"), evaluator=None,
                     init_weights=init_shared(get_spec("mlp"), 0))
    try:
        hist = co.run()
    finally:
        stop.set()
        fleet.close()
    assert all(h["accepted"] == n + int(attack) for h in hist)               # the attacker was counted
    return make_evaluator("mlp", load_digits("test"))({"int8": co.weights})["int8"][1]


#: the stated margin: a robust run under attack ends within 0.05 accuracy of the clean run
MARGIN = 0.05


@pytest.mark.slow
def test_one_poisoned_device_cannot_drag_the_model(tmp_path: Path) -> None:
    clean = _federated_accuracy(tmp_path / "clean", {}, attack=False)
    assert clean > 0.8
    assert _federated_accuracy(tmp_path / "fedavg", {}, attack=True) < 0.3   # the attack bites FedAvg
    for name, params in (("trimmed", {"robust": "trimmed_mean", "trim": 0.2}), ("median", {"robust": "median"}),
                         ("clip", {"clip": 1.0, "weighted": False})):
        acc = _federated_accuracy(tmp_path / name, params, attack=True)
        assert acc >= clean - MARGIN, (name, acc, clean)
