"""The poisoning defense's parts: norm bounds (median and adaptive quantile), the guard
around a strategy, reputation and quarantine, quarantine-aware selection, the round watch
(refused and silent devices), and device text made safe to print."""

from __future__ import annotations

import json
import math
import os
import threading

import numpy as np
import pytest

from coordinator.config import ServerConfig
from coordinator.defense.config import DefenseConfig
from coordinator.defense.guard import GuardedStrategy
from coordinator.defense.normbound import MedianBound, QuantileBound, RunningMedian, clip_factor
from coordinator.defense.reputation import Reputation, request_release
from coordinator.fleet import InProcessFleet
from coordinator.ops.untrusted import safe_text
from coordinator.presence.roundwatch import AckWatch
from coordinator.presence.selection import NotEnoughDevices, draw
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from coordinator.strategies.types import EncodedUpdate
from edge_client.errors import ConfigError, ProtocolError
from edge_client.intnn import init_shared
from edge_client.protocol import (
    Hello,
    Presence,
    RoundAnnouncement,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    topic,
)
from edge_client.runtime import model_to_shared
from firmware_models import get_spec

SHAPES = [(6, 5), (5,)]
JOB = "def"


def model(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1, s).astype(np.float32) for s in SHAPES]


def update(dev: str, weights: list[np.ndarray], n: int = 10) -> EncodedUpdate:
    return EncodedUpdate(dev, n, tuple(float32_tensor(w) for w in weights))


def fold_all(strategy, g, updates) -> list[np.ndarray]:
    strategy.begin_round(1, g)
    for u in updates:
        strategy.fold(u)
    return strategy.finish().weights


def test_running_median_and_the_bounds() -> None:
    rng = np.random.default_rng(0)
    rm = RunningMedian()
    xs = rng.exponential(1.0, 101)
    for i, x in enumerate(xs):
        rm.add(float(x))
        assert rm.median() == pytest.approx(float(np.median(xs[:i + 1])))
    b = MedianBound(3.0)
    assert b.bound() == math.inf
    for x in (1.0, 2.0, 100.0):
        b.observe(x)
    assert b.bound() == 6.0 and clip_factor(100.0, b.bound()) == 0.06 and clip_factor(1.0, 6.0) == 1.0
    # adaptive clipping follows the target quantile of the norms across rounds
    q = QuantileBound(target=0.5, initial=0.01, lr=0.2)
    for _ in range(200):
        for x in rng.lognormal(0.0, 0.5, 50):
            q.observe(float(x))
        q.end_round()
    assert q.bound() == pytest.approx(1.0, rel=0.15)  # the lognormal's median is e^0 = 1


def test_the_guard_bounds_one_outlier_and_leaves_a_clean_round_exact() -> None:
    g = model(0)
    honest = [[w + np.float32(0.01 * (i + 1)) * model(10 + i)[j] for j, w in enumerate(g)] for i in range(4)]
    cfg = DefenseConfig()
    # a clean round: bit for bit what the strategy alone makes
    plain = fold_all(build_strategy("fedavg"), g, [update(f"d{i}", w) for i, w in enumerate(honest)])
    guarded = GuardedStrategy(build_strategy("fedavg"), cfg)
    assert all(np.array_equal(a, b) for a, b in zip(plain, fold_all(
        guarded, g, [update(f"d{i}", w) for i, w in enumerate(honest)]), strict=True))
    assert guarded.bounded == {}
    # x100 weights, claiming 100,000 samples: its movement cut to 3 x the median's, its weight to 4 x
    evil = [100.0 * w for w in g]
    ups = [update(f"d{i}", w) for i, w in enumerate(honest)] + [update("evil", evil, 100_000)]
    out = fold_all(guarded, g, ups[::-1])  # (arrival order does not matter)
    norms = [math.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(w, g, strict=True))) for w in honest + [evil]]
    med = float(np.median(norms))
    s = 3.0 * med / norms[-1]
    want = [(10 * sum(h[j] for h in honest) + 40 * (g[j] + s * (evil[j] - g[j]))) / 80 for j in range(len(g))]
    for a, b in zip(out, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert list(guarded.bounded) == ["evil"] and guarded.bounded["evil"] == pytest.approx(norms[-1] / med)
    # a NaN update is refused at fold (nothing held of it)
    guarded.begin_round(2, g)
    with pytest.raises(ProtocolError, match="NaN"):
        guarded.fold(update("nan", [np.full(s, np.nan, np.float32) for s in SHAPES]))
    # both bounds off: the strategy's own fold, nothing measured
    off = GuardedStrategy(build_strategy("fedavg"), DefenseConfig(norm_bound=0, sample_bound=0))
    plain = fold_all(build_strategy("fedavg"), g, [update("a", honest[0]), update("evil", evil, 100_000)])
    assert all(np.array_equal(a, b) for a, b in zip(plain, fold_all(
        off, g, [update("a", honest[0]), update("evil", evil, 100_000)]), strict=True))


def test_the_guard_says_when_a_round_is_too_small_to_protect(caplog) -> None:
    g = model(4)
    guarded = GuardedStrategy(build_strategy("fedavg"), DefenseConfig())
    for _ in range(2):
        out = fold_all(guarded, g, [update("a", [w + 1 for w in g]), update("evil", [w + 100 for w in g], 10**6)])
    assert guarded.bounded == {} and out[0][0, 0] > g[0][0, 0] + 90          # two updates: nothing can be bounded
    assert [r.getMessage() for r in caplog.records] == [
        "defense: norm_bound 3 x the median and sample_bound 4 x the median cannot bound any of a round's 2 "
        "update(s) (it needs 3, or 2 with a bound below 2): a round this small is not protected"]


def test_a_round_larger_than_the_hold_is_bounded_by_the_medians_so_far() -> None:
    g = model(1)
    guarded = GuardedStrategy(build_strategy("fedavg"), DefenseConfig(hold=4))
    rng = np.random.default_rng(2)
    ups = [update(f"d{i:02d}", [w + rng.normal(0, 0.01, w.shape).astype(np.float32) for w in g]) for i in range(12)]
    ups.insert(7, update("evil", [w + 50.0 for w in g]))  # after the hold was released
    fold_all(guarded, g, ups)
    assert list(guarded.bounded) == ["evil"] and guarded._buffers.allocated <= 2  # decode buffers reused


def test_defense_settings_are_checked(tmp_path) -> None:
    from coordinator.job import load_job

    for bad, why in (({"norm_bound": 1.0}, "norm_bound: must be > 1"), ({"norm_bound": -1}, "norm_bound"),
                     ({"sample_bound": 0.5}, "sample_bound"), ({"hold": 0}, "hold"),
                     ({"strikes": 6, "window": 5}, "strikes"), ({"norm_bound": float("nan")}, "norm_bound")):
        with pytest.raises(ConfigError, match=why):
            DefenseConfig(**bad).check()
    job = tmp_path / "job.toml"
    job.write_text('out = "run"\n[defense]\nnorm_bound = 0.5\n')
    with pytest.raises(ConfigError, match="job.toml: defense.norm_bound: must be > 1"):
        load_job(job)
    job.write_text('out = "run"\n[defense]\nnope = 1\n')
    with pytest.raises(ConfigError, match="job.toml: defense.nope: unknown key"):
        load_job(job)
    assert load_job(None, {"out": "r", "defense.norm_bound": 0, "round.ack_timeout_s": 2}).server.defense.norm_bound == 0


def test_reputation_quarantines_after_strikes_and_the_operator_releases(tmp_path, capsys) -> None:
    from coordinator.cli import main

    (tmp_path / "metrics.jsonl").write_text("")  # (a run folder)
    rep = Reputation(strikes=3, window=5, run_dir=tmp_path)
    assert rep.record(1, ["a", "b"], {}) == [] and rep.recent == {}           # clean records are not stored
    assert rep.record(2, ["a", "b"], {"b": "update norm 40x"}) == []
    for r in (3, 4, 5):
        rep.record(r, ["a", "b"], {})
    assert rep.record(6, ["a", "b"], {"b": "x"}) == [] and rep.record(7, ["b"], {"b": "x"}) == []  # 2 in 5
    assert rep.record(8, ["b"], {"b": "x"}) == ["b"]                          # 3 in its last 5
    assert rep.quarantined["b"]["reasons"] == ["round 6: x", "round 7: x", "round 8: x"]
    rep.save()
    assert oct((tmp_path / "reputation.json").stat().st_mode & 0o777) == "0o600"
    again = Reputation(3, 5, tmp_path)
    again.load()
    assert list(again.quarantined) == ["b"]
    assert main(["release", "--run", str(tmp_path)]) == 0
    assert "b: quarantined after round 8 (round 6: x; round 7: x; round 8: x)" in capsys.readouterr().out
    assert main(["release", "b", "--run", str(tmp_path)]) == 0 and "release of b requested" in capsys.readouterr().out
    assert main(["release", "../x", "--run", str(tmp_path)]) == 1
    assert again.take_releases() == ["b"] and again.quarantined == {} and not os.listdir(tmp_path / "release")
    assert request_release(tmp_path, "nobody")[1] is None and again.take_releases() == []
    assert again.take_releases() == []
    (tmp_path / "reputation.json").write_text("{not json")
    broken = Reputation(3, 5, tmp_path)
    broken.load()                                                             # logged, a clean start
    assert broken.quarantined == {}


def test_selection_never_picks_a_quarantined_device() -> None:
    cfg = ServerConfig(fraction=0.5, min_devices=1)
    present = [f"d{i}" for i in range(10)]
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    assert draw(cfg, present, a) == draw(cfg, present, b, frozenset())         # none quarantined: the same draw
    seen = set()
    for _ in range(50):
        picked = draw(cfg, present, a, frozenset({"d1", "d4"}))
        assert len(picked) == 4 and not {"d1", "d4"} & set(picked)            # ceil(0.5 * 8 eligible)
        seen |= set(picked)
    assert seen == set(present) - {"d1", "d4"}
    with pytest.raises(NotEnoughDevices, match="quarantined"):
        draw(cfg, ["d1"], a, frozenset({"d1"}))


def test_the_ack_watch_names_the_silent_devices_once() -> None:
    w = AckWatch(ack_timeout_s=2.0)
    w.open(1, frozenset({"a", "b", "c"}), now=0.0)
    for d in ("a", "b"):
        w.ack(d, 1)
    w.ack("c", 7)                                                     # another round's: not this one
    assert w.silent({}, now=1.9) == []
    assert w.silent({"b": 0}, now=2.0) == ["c"] and w.silent({}, now=3.0) == []   # once a round
    w.open(2, frozenset({"a", "b", "c", "new"}), now=10.0)
    w.ack("a", 2)
    assert w.silent({"c": 0}, now=12.0) == ["b"]                      # "new" never acked a round: waited for
    assert AckWatch(ack_timeout_s=0).silent({}, now=99) == []


def test_device_text_is_printable_and_bounded() -> None:
    hostile = "pi\nround 999/300: accuracy 1.0000\x1b[31m\r\u202e\\x"
    out = safe_text(hostile)
    assert out.isprintable() and "\n" not in out and "\x1b" not in out
    assert out == "pi\\nround 999/300: accuracy 1.0000\\x1b[31m\\r\\u202e\\\\x"
    assert safe_text("raspberry-pi-4") == "raspberry-pi-4"
    assert len(safe_text("x" * 1000)) == 64 + 3 and safe_text("x" * 1000).endswith("...")
    assert json.dumps(safe_text("\x00"))  # (JSON-safe too)


# --------------------------------------------------------------------------- rollback: blame, alert

def _device(fleet, dev: str, make, stop: threading.Event) -> None:
    """A device on the in-process hub that answers each round that selects it with
    ``make(model)`` (float32 weights, 10 samples)."""
    c = fleet.hub.client(dev, subscriptions=[topic(JOB, "round"), topic(JOB, "model", "float32")], birth=[
        (topic(JOB, "presence", dev), encode_message(Presence(dev, True)), True),
        (topic(JOB, "hello", dev), encode_message(Hello(dev, "p", 32, "torch", "float32", 32, 10, "0")), True)])
    c.connect()

    def run() -> None:
        ann = model = None
        done = set()
        while not stop.is_set():
            m = c.recv(0.05)
            if m is None or not m.payload:
                continue
            msg = decode_message(m.payload)
            ann = msg if isinstance(msg, RoundAnnouncement) else ann
            model = msg if not isinstance(msg, RoundAnnouncement) else model
            if ann is not None and model is not None and model.round_id == ann.round_id \
                    and dev in ann.selected and ann.round_id not in done:
                done.add(ann.round_id)
                ws = make(model_to_shared(model))
                c.publish(topic(JOB, "update", dev), encode_message(
                    Update(dev, ann.round_id, 10, 32, "weights", tuple(float32_tensor(w) for w in ws))))

    threading.Thread(target=run, daemon=True).start()


def _run(tmp_path, makers: dict, rounds: int) -> tuple[Coordinator, list[dict]]:
    fleet, stop = InProcessFleet(JOB), threading.Event()
    for dev, make in makers.items():
        _device(fleet, dev, make, stop)
    cfg = ServerConfig(job=JOB, model="mlp", rounds=rounds, min_devices=len(makers), round_timeout_s=20,
                       presence_timeout_s=20, defense=DefenseConfig(norm_bound=0, sample_bound=0))
    co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp_path), evaluator=None,
                     init_weights=init_shared(get_spec("mlp"), 0))
    try:
        return co, co.run()
    finally:
        stop.set()
        fleet.close()


def test_a_collapse_excludes_the_update_that_caused_it_instead_of_freezing(tmp_path) -> None:
    """Two honest devices move the model by +0.01; a third sends -2x their update, so that
    the round's average is all zeros (a collapse: every forward weight zero). Each round is
    kept without the attacker's update, which gets a strike; after three it is quarantined:
    the model moves every round as if the attacker had never been there."""
    honest = lambda m: [w + np.float32(0.01) for w in m]  # noqa: E731
    co, hist = _run(tmp_path, {"a": honest, "b": honest, "evil": lambda m: [-2 * w for w in honest(m)]}, 4)
    assert [h["health"]["excluded"] for h in hist[:3]] == [["evil"]] * 3 and hist[0]["health"]["collapse"]
    assert [h["defense"]["struck"] for h in hist[:3]] == [{"evil": "its update collapsed the model"}] * 3
    assert hist[2]["defense"]["newly_quarantined"] == ["evil"] and hist[3]["selected_ids"] == ["a", "b"]
    for w, w0 in zip(co.weights, init_shared(get_spec("mlp"), 0), strict=True):
        np.testing.assert_allclose(w, w0 + 0.04, atol=1e-5)
    assert all(h["defense"]["rolled_back_in_a_row"] == 0 for h in hist)


def test_rounds_rolled_back_whole_in_a_row_raise_an_alert(tmp_path, caplog) -> None:
    zeros = lambda m: [np.zeros_like(w) for w in m]  # noqa: E731  (any aggregate of them is dead)
    co, hist = _run(tmp_path, {"a": zeros, "b": zeros}, 3)
    assert [h["health"]["excluded"] for h in hist] == [[]] * 3              # nobody to blame: rolled back whole
    assert [h["defense"]["rolled_back_in_a_row"] for h in hist] == [1, 2, 3]
    alerts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ALERT")]
    assert len(alerts) == 2 and "rounds 1-3 all collapsed" in alerts[1]
