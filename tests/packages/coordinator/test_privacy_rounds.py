"""Secure aggregation and DP through the round loop: real device runtimes over the
in-process fleet (and one job over a real mosquitto), the instrumented fold, the privacy
budget ending a job, and the [privacy] settings refusing strategies that need single updates."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ShiftTrainer

from coordinator.config import ServerConfig
from coordinator.fleet import InProcessFleet
from coordinator.job import load_job
from coordinator.privacy.config import PrivacyConfig
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from coordinator.strategies.accumulate import GroupSums
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared
from edge_client.protocol import encode_message, topic
from edge_client.protocol.secure import SecAggKeys, SecAggUnmask
from edge_client.runtime import DeviceConfig, DeviceRuntime
from firmware_models import get_spec
from tests.packages.coordinator.test_server import data

JOB = "p"
SPEC = get_spec("mlp")


def start(fleet, tmp: Path, dev: str, shift: float, n: int, **kw) -> tuple[DeviceRuntime, threading.Thread]:
    cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=tmp / dev, **kw)
    rt = DeviceRuntime(cfg, data(n), fleet.device_connector(dev),
                       trainer_factory=lambda spec, bits, seed: ShiftTrainer(shift))
    th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
    th.start()
    return rt, th


def coordinator(fleet, out: Path, privacy: PrivacyConfig, strategy: str = "fedavg", **kw) -> Coordinator:
    cfg = ServerConfig(job=JOB, model="mlp", privacy=privacy, **({
        "rounds": 2, "min_devices": 4, "round_timeout_s": 20, "presence_timeout_s": 20} | kw))
    return Coordinator(cfg, fleet, build_strategy(strategy), RunState(out), evaluator=None,
                       init_weights=init_shared(SPEC, 0))


@pytest.fixture
def no_single_updates(monkeypatch):
    """Every coordinator path that takes one device's update (decoded or on the wire)
    fails the test if it is reached."""
    seen = []

    def trap(name):
        def f(*a, **k):
            seen.append(name)
            raise AssertionError(f"{name}: the coordinator touched one device's update")
        return f

    import coordinator.strategies.base as base
    for name in ("fold", "accept", "_add_decoded"):
        monkeypatch.setattr(base.Strategy, name, trap(f"Strategy.{name}"))
    monkeypatch.setattr(base, "decode_update", trap("decode_update"))
    monkeypatch.setattr(GroupSums, "add", trap("GroupSums.add"))
    monkeypatch.setattr(GroupSums, "add_encoded", trap("GroupSums.add_encoded"))
    import coordinator.ingest as ingest
    monkeypatch.setattr(ingest.Ingest, "update", trap("Ingest.update"))
    return seen


def test_secure_round_sums_exactly_and_no_code_path_holds_one_update(tmp_path: Path, no_single_updates) -> None:
    fleet = InProcessFleet(JOB)
    shifts = {"a": 0.01, "b": -0.02, "c": 0.03, "d": 0.005}
    sizes = {"a": 30, "b": 10, "c": 20, "d": 40}
    devs = [start(fleet, tmp_path, d, shifts[d], sizes[d]) for d in shifts]
    co = coordinator(fleet, tmp_path / "out", PrivacyConfig(secure_aggregation=True, phase_timeout_s=10))
    evil = fleet.hub.client("evil")
    evil.connect()

    def attack() -> None:  # once round 1 is open: hostile secure-aggregation messages
        while co.collector.round is None:
            time.sleep(0.01)
        keys = SecAggKeys("a", 1, bytes(32), bytes(32), bytes(32), bytes(32), bytes(64))
        for dev, payload in [("a", b"\xc1 garbage"), ("b", encode_message(keys)),  # malformed, spoofed
                             ("a", encode_message(SecAggUnmask("a", 1, (), ())))]:  # the coordinator's kind
            evil.publish(topic(JOB, "secagg", dev), payload)

    threading.Thread(target=attack, daemon=True).start()
    w0 = [w.copy() for w in co.weights]
    hist = co.run()
    assert [h["accepted"] for h in hist] == [4, 4] and all(h["aggregated"] for h in hist)
    assert {k: hist[0]["counts"].get(k) for k in ("rejected_malformed", "rejected_spoofed", "rejected_wrong_kind")} \
        == {"rejected_malformed": 1, "rejected_spoofed": 1, "rejected_wrong_kind": 1}
    assert hist[0]["secagg_survivors"] == 4 and hist[0]["secagg_excluded"] == {}
    assert hist[0]["uplink_bytes"]["secagg-masked"] > 0 and not no_single_updates
    step = sum(shifts[d] * sizes[d] for d in shifts) / sum(sizes.values())
    for a, b in zip(co.weights, w0, strict=True):  # FedAvg by samples, on a grid of 2^-F
        np.testing.assert_allclose(a, b + 2 * step, atol=2e-4)
    for rt, th in devs:
        th.join(10)
        assert rt.rounds_done == [1, 2]


def test_a_device_dropping_after_its_keys_leaves_the_round_complete(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    shifts = {"a": 0.01, "b": 0.02, "c": 0.03, "d": 0.04, "e": 0.05}
    devs = {d: start(fleet, tmp_path, d, s, 10) for d, s in shifts.items()}
    devs["e"][0].secure.handle = lambda m: None  # "e" goes silent after advertising its keys
    co = coordinator(fleet, tmp_path / "out", PrivacyConfig(secure_aggregation=True, phase_timeout_s=1,
                                                            neighbours=4), rounds=1, min_devices=5)
    w0 = [w.copy() for w in co.weights]
    (rec,) = co.run()
    assert rec["secagg_keys"] == 5 and rec["secagg_shared"] == 4 and rec["accepted"] == 4
    for a, b in zip(co.weights, w0, strict=True):
        np.testing.assert_allclose(a, b + 0.025, atol=2e-4)


def test_central_dp_and_the_budget_end_the_job_cleanly(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    devs = [start(fleet, tmp_path, d, 0.01, 10) for d in "abcd"]
    priv = PrivacyConfig(mechanism="central", clip=0.1, noise_multiplier=2.0, target_epsilon=3.0,
                         adaptive_clip=True)
    co = coordinator(fleet, tmp_path / "out", priv, rounds=50)
    hist = co.run()
    assert 1 < len(hist) < 50 and hist[-1]["epsilon"] <= 3.0 and "target_epsilon" in co.privacy.stopped
    assert co.privacy.accountant.after(co.privacy.z, 1.0) > 3.0
    assert hist[0]["stats"]["dp_clip"] == pytest.approx(0.1) and hist[1]["stats"]["dp_clip"] != 0.1
    for _, th in devs:  # the devices saw "done" and left
        th.join(10)
        assert not th.is_alive()


@pytest.mark.parametrize(("strategy", "params", "privacy", "match"), [
    ("prowd", {}, {"secure_aggregation": True}, "selective weight aggregation"),
    ("fedavg", {"dequantize": "prowd"}, {"secure_aggregation": True}, "dequantizer"),
    ("fedavg", {"robust": "median"}, {"secure_aggregation": True}, "robust aggregation"),
    ("fedwsq", {}, {"secure_aggregation": True}, "σ_loc"),
    ("prowd", {}, {"mechanism": "central", "noise_multiplier": 1.0}, "selective weight aggregation"),
    ("grouped", {}, {"mechanism": "central", "noise_multiplier": 1.0}, "per-group models"),
    ("fedavg", {}, {"mechanism": "distributed", "noise_multiplier": 1.0}, "secure_aggregation = true"),
    ("fedavg", {}, {"mechanism": "central", "secure_aggregation": True, "noise_multiplier": 1.0}, "hides"),
    ("fedavg", {}, {"mechanism": "central"}, "noise_multiplier or target_epsilon"),
])
def test_conflicts_are_refused_at_config_load(strategy, params, privacy, match) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig(strategy=strategy, strategy_params=params, privacy=PrivacyConfig(**privacy)).validate()


@pytest.mark.parametrize("strategy", ["fedavg", "fedshift", "grouped", "grouped-asym", "fedpaq", "fedavgm"])
def test_strategies_that_aggregate_sums_are_accepted(strategy) -> None:
    ServerConfig(strategy=strategy, privacy=PrivacyConfig(secure_aggregation=True)).validate()


def test_the_privacy_section_and_flags(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('out = "o"\nmodel = "mlp"\n[privacy]\nsecure_aggregation = true\nmechanism = "distributed"\n'
                   'clip = 1\ntarget_epsilon = 8\ndelta = 1e-5\n')
    j = load_job(job)
    assert j.server.privacy == PrivacyConfig(secure_aggregation=True, mechanism="distributed", clip=1.0,
                                             target_epsilon=8.0)
    with pytest.raises(ConfigError, match=r"privacy.clipp: unknown key"):
        load_job(job, {"privacy.clipp": 1})
    import argparse

    from coordinator.job import add_job_options, job_from_args
    p = argparse.ArgumentParser()
    add_job_options(p)
    args = p.parse_args(["--config", str(job), "--dp", "distributed", "--noise-multiplier", "1.5", "--delta", "1e-6"])
    assert job_from_args(args).server.privacy.noise_multiplier == 1.5


def test_the_emulator_runs_secure_rounds_with_its_devices_dropping_in_every_phase(tmp_path: Path) -> None:
    """Int8 and Int16 devices (float ones: the tests above), and a profile that loses every
    round: its devices drop at a phase drawn per device and round (before their keys,
    after them, after their shares, after their masked input); the round completes."""
    from coordinator.emulation.config import from_dict
    from coordinator.emulation.emulator import Emulator
    from tests.packages.coordinator.test_emulator import config

    with pytest.raises(ConfigError, match=r"\[privacy\].*selective weight"):
        from_dict({"strategy": "prowd", "devices": {"raspberry-pi-4": 2}, "privacy": {"secure_aggregation": True}})
    lossy = tmp_path / "lossy.toml"
    lossy.write_text((Path(__file__).parents[3] / "hw_profiles" / "profiles" / "jetson-nano.toml").read_text()
                     .replace('name = "jetson-nano"', 'name = "lossy"').replace("loss_rate = 0.001", "loss_rate = 0.99"))
    cfg = config(rounds=1, devices={"raspberry-pi-4": 3, "jetson-nano": 1, str(lossy): 4},
                 round={"deadline_s": 0.0}, train={"epochs": 1}, privacy={"secure_aggregation": True,
                                                                          "phase_timeout_s": 5})
    (h,) = Emulator(cfg, 1, tmp_path / "run").run().history
    assert h["aggregated"] and h["accepted"] == h["secagg_survivors"] >= 4 and h["weight_change_l2"] > 0
    # seed 1: lossy-1 drops before its keys, lossy-2 after them, lossy-3 after its shares,
    # lossy-0 after its masked input (it still counts)
    assert (h["secagg_keys"], h["secagg_shared"], h["secagg_masked"], h["secagg_survivors"]) == (7, 6, 5, 5)


def test_epsilon_reaches_the_dashboard_metrics_and_the_summary() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from coordinator.emulation.report import _privacy_lines, privacy_summary
    from coordinator.ops.dashboard.metrics import MonitorCollector
    from coordinator.ops.dashboard.monitor import FleetMonitor
    from tests.packages.coordinator.test_dashboard import feed_round, round_end

    m = FleetMonitor({"job": "farm"}, rounds=3, title="farm")
    feed_round(m, 1, 0.5)
    m("round_end", {**round_end(2, 0.6), "epsilon": 1.25, "delta": 1e-5})
    assert m.snapshot()["rounds"][-1]["epsilon"] == 1.25
    reg = CollectorRegistry()
    reg.register(MonitorCollector(m))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    (s,) = fams["fedbit_privacy_epsilon"].samples
    assert s.value == 1.25 and s.labels["delta"] == "1e-05"
    recs = [{"epsilon": 0.5, "delta": 1e-5, "secagg_survivors": 3, "secagg_excluded": {}},
            {"epsilon": 0.9, "delta": 1e-5, "secagg_survivors": 3, "secagg_excluded": {"d7": "bad signature"}}]
    s = privacy_summary(recs)
    assert s == {"epsilon": 0.9, "delta": 1e-5, "secagg_excluded": ["d7"]}
    assert "ε = 0.900 at δ = 1e-05" in "\n".join(_privacy_lines(s))
