"""Training health (issue 27): live units read from the weights, the coordinator's
health record, collapse detection and rollback.

The liveness rule is checked against the integer engine itself: a unit the rule calls
dead outputs 0 (or, an output unit, a constant 0) on every input tried, inputs at the
largest value included; the ternary threshold is exact at |W| = 0.25 (dead) and one LSB
above it (live)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.config import ServerConfig
from coordinator.fleet import InProcessFleet
from coordinator.health import HealthWatch
from coordinator.job import load_job
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.errors import ConfigError
from edge_client.intnn import IntModel, init_shared
from edge_client.intnn.liveness import liveness, ternary_codes
from edge_client.runtime import DeviceConfig, DeviceRuntime
from firmware_models import get_spec

DIGITS = get_spec("digits_cnn")


def engine_outputs(spec, bits: int, weights, x: np.ndarray) -> list[np.ndarray]:
    """Each parameter layer's output activations [N, ..., units] in the integer engine."""
    m = IntModel(spec, bits)
    m.load_shared(weights)
    ws = m.eval_workspace(len(x))
    ws.x[:len(x)] = m.prepare_inputs(x)
    m.forward(ws, len(x))
    return [ws.acts[m.ops.index(op)][:len(x)].reshape(len(x), -1, ws.acts[m.ops.index(op)].shape[-1])
            for op in m.param_ops]


def negative_heavy(spec, seed: int, bias: float) -> list[np.ndarray]:
    """Weights in [-0.5, 0.5] shifted down by ``bias``: many units lose their positive taps."""
    rng = np.random.default_rng(seed)
    return [np.clip(rng.uniform(-0.5, 0.5, s) - bias, -0.5, 0.5).astype(np.float32) for s in spec.param_shapes()]


@pytest.mark.parametrize("model,bits", [("digits_cnn", 8), ("digits_cnn", 6), ("mlp", 6)])
def test_a_unit_called_dead_never_fires_in_the_integer_engine(model, bits):
    spec = get_spec(model)
    rng = np.random.default_rng(1)
    x = np.concatenate([np.ones((1, *spec.input_shape), np.float32),
                        rng.random((40, *spec.input_shape), dtype=np.float32),
                        (rng.random((20, *spec.input_shape)) > 0.5).astype(np.float32)])
    seen_dead = seen_live_firing = 0
    for seed, bias in ((0, 0.12), (1, 0.18), (2, 0.05)):
        w = negative_heavy(spec, seed, bias)
        for lv, out in zip(liveness(spec, w, bits), engine_outputs(spec, bits, w, x), strict=True):
            fired = np.abs(out).reshape(-1, out.shape[-1]).max(axis=0) > 0  # per unit, any sample
            assert lv.units == out.shape[-1]
            dead = np.flatnonzero(~fired)
            # soundness: never a unit that fires on some input among those called dead
            assert lv.live >= int(fired.sum()), (lv.name, lv.live, int(fired.sum()))
            seen_dead += len(dead)
            seen_live_firing += int(fired.sum())
    assert seen_dead > 0 and seen_live_firing > 0  # both kinds occurred


def test_the_ternary_threshold_and_dead_inputs_decide_liveness():
    spec = DIGITS
    w = [np.full(s, -0.5, np.float32) for s in spec.param_shapes()]
    w[1][:] = 0.5   # conv2: every tap positive, fc1 and fc2 too
    w[2][:] = 0.5
    w[3][:] = 0.5
    w[0][0, 0, 1, 1] = 0.25          # on the threshold: ternary 0 (round(32) is not > 32)
    w[0][1, 0, 0, 0] = 33 / 128      # one LSB above it: +1
    w[0][2, 0, 2, 2] = 0.1           # positive, below the threshold
    assert ternary_codes(w[0][:3], 8)[:, 0].reshape(3, -1).max(axis=1).tolist() == [0, 1, 0]
    conv1, conv2, fc1, fc2 = liveness(spec, w, 8)
    assert (conv1.live, conv2.live, fc1.live, fc2.live) == (1, 32, 64, 10)
    assert [lv.live for lv in liveness(spec, w, 32)] == [3, 32, 64, 10]  # the float forward: W > 0
    # conv2's positive taps only on dead conv1 channels (1 is the live one): every filter dies
    w[1][:] = -0.5
    w[1][:, 0] = 0.5
    w[1][:, 2:] = 0.5
    lv = liveness(spec, w, 8)
    assert [x.live for x in lv] == [1, 0, 0, 0]
    assert round(lv[1].zero_frac, 3) == 0.0 and lv[0].nonfinite == 0
    w[3][:] = 0.0  # fc2 all zero: every forward weight zero
    w[0][5, 0, 0, 0] = np.nan
    lv = liveness(spec, w, 8)
    assert lv[3].zero_frac == 1.0 and lv[0].nonfinite == 1


def test_int6_needs_more_than_one_tap_where_the_shift_is_large():
    """fedshift_cnn's fc1 (fan-in 4096) shifts by 6: one Int6 input at 31 rounds to 0."""
    spec = get_spec("fedshift_cnn")
    w = [np.full(s, 0.5, np.float32) for s in spec.param_shapes()]
    w[2][:] = -0.5
    w[2][:, 0] = 0.5  # one positive tap per fc1 unit
    assert liveness(spec, w, 8)[2].live == 512
    assert liveness(spec, w, 6)[2].live == 0
    w[2][:, 1] = 0.5
    assert liveness(spec, w, 6)[2].live == 512


# --------------------------------------------------------------------------- the watch


def watch_check(hw: HealthWatch, r: int, w, old, acc: float, history=()):
    """``acc``: the validation accuracy (the test accuracy, 0.9, is never read)."""
    scores = {v: (0.5, 0.9, {"val_accuracy": acc}) for v in ("float32", "int8")}
    return hw.check(r, (w, {}), (old, {}), scores, list(history))


def test_the_watch_records_every_group_and_names_a_dead_layer(caplog):
    from edge_client.data import load_digits

    probe = load_digits("test").x[:32]
    hw = HealthWatch(DIGITS, "log", probe=probe, float_forward="int8")
    w0 = init_shared(DIGITS, 0)
    v = watch_check(hw, 1, w0, w0, 0.6)
    rec = v.record
    assert not v.collapse and not v.rolled_back and set(rec["groups"]) == {"float32", "int8"}
    h = rec["groups"]["int8"]["conv1"]
    assert h["units"] == 16 and 0 < h["live"] <= 16 and 0 < h["zero"] < 1 and h["act"] > 0 and h["update"] == 0
    assert rec["groups"]["float32"] == rec["groups"]["int8"]  # the same weights in the same forward
    dead = [w.copy() for w in w0]
    dead[0] = np.minimum(dead[0], 0.2)  # no conv1 filter keeps a positive tap
    with caplog.at_level(logging.WARNING, logger="fedbit.health"):
        v = watch_check(hw, 7, dead, w0, 0.1, [{"round": 6, **{"health": rec}, "groups": {"int8": {"accuracy": 0.1, "val_accuracy": 0.8}}}])
    assert not v.rolled_back  # on_collapse = log
    text = " | ".join(v.collapse)
    assert "round 7" in text and "conv1: no live unit (0 of 16" in text and "at chance" in text
    assert any("live units" in w and "conv1" in w for w in v.record["warnings"])
    assert any(r.levelno == logging.ERROR and "collapse" in r.getMessage() for r in caplog.records)
    # a constant output: every probe sample the same image
    same = HealthWatch(DIGITS, "log", probe=np.repeat(probe[:1], 8, axis=0))
    assert any("constant" in c for c in watch_check(same, 2, w0, w0, 0.5).collapse)


def test_collapse_settings_are_validated_where_they_are_read(tmp_path):
    with pytest.raises(ConfigError, match="on_collapse"):
        HealthWatch(DIGITS, "ignore")
    with pytest.raises(ConfigError, match="on_collapse"):
        ServerConfig(on_collapse="stop").validate()
    assert load_job(None, {"out": str(tmp_path)}).server.on_collapse == "rollback"
    assert load_job(None, {"out": str(tmp_path), "on_collapse": "log"}).server.on_collapse == "log"
    with pytest.raises(ConfigError, match="on_collapse"):
        load_job(None, {"out": str(tmp_path), "on_collapse": "maybe"})
    from coordinator.emulation.config import load_config

    assert load_config().on_collapse == "rollback"
    with pytest.raises(ConfigError, match="on_collapse"):
        load_config(None, {"on_collapse": 3})


# --------------------------------------------------------------------------- the round loop

JOB = "h"
MLP = get_spec("mlp")


class RoundTrainer:
    """Adds 0.01 to every weight each round (one trainer per device for the whole run, one
    ``train`` per round), except in round ``kill_round``: fc1 loses every positive tap."""

    spec, bits, lr, lr_shift = MLP, 32, 1.0, 3  # the Trainer protocol

    def __init__(self, kill_round: int) -> None:
        self.kill_round = kill_round
        self.calls = 0
        self.w: list[np.ndarray] = []

    def load_shared(self, weights):
        self.w = [np.array(w, dtype=np.float32) for w in weights]

    def train(self, data, **_kw):
        self.calls += 1
        self.w = [w + np.float32(0.01) for w in self.w]
        if self.calls == self.kill_round:
            self.w[0] = np.full_like(self.w[0], -0.5)
        return SimpleNamespace(loss=0.5, steps=1, samples=len(data.y), seconds=0.0)

    def to_shared(self):
        return [w.copy() for w in self.w]

    def int_weights(self):
        return None

    def ternary_weights(self):
        return None

    def evaluate(self, data, batch=256):
        return 0.0, 0.0


def run_fleet(tmp: Path, policy: str, kill_round: int = 2, rounds: int = 3) -> Coordinator:
    fleet = InProcessFleet(JOB)
    data = SimpleNamespace(x=np.zeros((20, 1, 8, 8), np.float32), y=np.zeros(20, np.int64))
    for dev in ("a", "b"):
        cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=tmp / dev)
        rt = DeviceRuntime(cfg, data, fleet.device_connector(dev),
                           trainer_factory=lambda spec, bits, seed: RoundTrainer(kill_round))
        threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True).start()
    cfg = ServerConfig(job=JOB, model="mlp", rounds=rounds, min_devices=2, round_timeout_s=10,
                       presence_timeout_s=20, on_collapse=policy)
    co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp / "out"), evaluator=None,
                     init_weights=init_shared(MLP, 0))
    co.run()
    return co


def test_a_collapsed_round_is_rolled_back_and_the_run_carries_on(tmp_path):
    co = run_fleet(tmp_path, "rollback")
    lines = RunState(tmp_path / "out").read_metrics()
    assert [m["round"] for m in lines] == [1, 2, 3]
    h2 = lines[1]["health"]
    assert h2["rolled_back"] and any("round 2" in c and "fc1: no live unit" in c for c in h2["collapse"])
    assert lines[1]["weight_change_l2"] == 0.0  # round 2's model is round 1's
    assert not lines[2]["health"]["collapse"] and lines[2]["weight_change_l2"] > 0
    assert liveness(MLP, co.weights, 8)[0].live > 0
    # round 3 started from round 1's model: two rounds of +0.01 from the start
    np.testing.assert_allclose(co.weights[1], init_shared(MLP, 0)[1] + 0.02, atol=1e-5)


def test_with_on_collapse_log_the_collapsed_model_is_kept(tmp_path):
    co = run_fleet(tmp_path, "log", rounds=2)
    lines = RunState(tmp_path / "out").read_metrics()
    assert lines[1]["health"]["collapse"] and not lines[1]["health"]["rolled_back"]
    assert liveness(MLP, co.weights, 8)[0].live == 0
