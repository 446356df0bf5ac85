"""Buffered asynchronous aggregation (``round.mode = "buffered"``): the staleness weights,
which strategies refuse the mode, the buffer's admission rules and refusals (logged by the
device), the exact model a buffer makes, and a real-MQTT run where devices join and
leave while the model keeps advancing. (The kill -9 resume is in tests/system/faults.)"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ShiftTrainer

from coordinator.buffered import BufferedSettings, staleness_function
from coordinator.buffered.window import BufferWindow, Requests
from coordinator.config import ServerConfig
from coordinator.fleet import InProcessFleet, MqttFleet
from coordinator.ingest import Rejected
from coordinator.job import coordinator_for, load_job
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.assignment import never_counts, still_counts, work_number
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared
from edge_client.protocol import (
    RoundAnnouncement,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
)
from edge_client.runtime import DeviceConfig, DeviceRuntime
from edge_client.transport import MqttTransport
from firmware_models import get_spec

JOB = "buf"
SPEC = get_spec("mlp")




def device(dev: str, shift: float, n: int, connect, workdir: Path, delay: float = 0.0) -> DeviceRuntime:
    cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=workdir / dev, train_delay_s=delay,
                       publish_timeout_s=5.0, connect_timeout_s=5.0)
    data = SimpleNamespace(x=np.zeros((1, 1, 8, 8), np.float32), y=np.zeros(n, np.int64))
    return DeviceRuntime(cfg, data, connect, trainer_factory=lambda spec, bits, seed: ShiftTrainer(shift))


def buffered_cfg(**kw) -> ServerConfig:
    buf = BufferedSettings(**{"buffer_size": 2, "concurrency": 2, "max_staleness": 3} | kw.pop("buffered", {}))
    return ServerConfig(**{"job": JOB, "model": "mlp", "rounds": 4, "mode": "buffered", "round_timeout_s": 10,
                           "presence_timeout_s": 20, "buffered": buf} | kw)


def expected_model(history: list[dict], shifts: dict[str, tuple[float, int]], server_lr: float = 1.0) -> float:
    """The total movement of every weight: per version, η Σ n s(τ) shift / Σ n over its updates."""
    total = 0.0
    for rec in history:
        num = sum(shifts[u["device"]][1] * u["weight"] * shifts[u["device"]][0] for u in rec["updates"])
        assert all(math.isclose(u["weight"], server_lr / math.sqrt(1 + u["staleness"])) for u in rec["updates"])
        total += num / sum(shifts[u["device"]][1] for u in rec["updates"])
    return total


# --------------------------------------------------------------------------- settings


def test_staleness_weights() -> None:
    sqrt, const = staleness_function("sqrt"), staleness_function("constant")
    assert [sqrt(t) for t in (0, 3, 8)] == [1.0, 0.5, 1 / 3]
    assert const(40) == 1.0
    assert staleness_function("polynomial-1")(4) == pytest.approx(0.2)
    assert staleness_function("polynomial-0.5")(3) == sqrt(3)
    hinge = staleness_function("hinge-10-4")
    assert [hinge(t) for t in (0, 4, 5, 6)] == [1.0, 1.0, 1 / 11, 1 / 21]
    assert BufferedSettings(server_lr=0.5).weight(3) == 0.25
    for bad in ("cubic", "polynomial", "polynomial--1", "hinge-0-1", "hinge-1", "sqrt-2", "poly-x"):
        with pytest.raises(ConfigError, match="staleness"):
            staleness_function(bad)
    for key, over in (("buffer_size", {"buffer_size": 0}), ("concurrency", {"concurrency": 0}),
                      ("server_lr", {"server_lr": 0.0}), ("max_staleness", {"max_staleness": -1})):
        with pytest.raises(ConfigError, match=f"round.{key}"):
            BufferedSettings(**over).validate()


def test_strategies_that_need_a_synchronous_cohort_refuse_buffered_mode(tmp_path: Path) -> None:
    for strategy, params, why in (("prowd", {}, "selective aggregation"),
                                  ("prowd-swa+fedshift", {}, "selective aggregation"),
                                  ("fedavg", {"dequantize": "prowd"}, "dequantizer"),
                                  ("fedavg", {"robust": "median"}, "order statistics"),
                                  ("grouped", {"robust": "trimmed_mean"}, "order statistics")):
        with pytest.raises(ConfigError, match=why):
            buffered_cfg(strategy=strategy, strategy_params=params).validate()
    for strategy, params in (("fedavg", {}), ("fedavg", {"clip": 2.0}), ("fedpaq", {}), ("fedwsq", {}),
                             ("grouped", {}), ("fedshift", {}), ("fedavgm", {})):
        buffered_cfg(strategy=strategy, strategy_params=params).validate()
        ServerConfig(strategy="prowd").validate()  # rounds take every strategy
    with pytest.raises(ConfigError, match="train.content"):
        buffered_cfg(hparams={"epochs": 1, "content": "weights"}).validate()
    from coordinator.privacy.config import PrivacyConfig

    with pytest.raises(ConfigError, match=r"\[privacy\]"):
        buffered_cfg(privacy=PrivacyConfig(secure_aggregation=True)).validate()
    job = tmp_path / "job.toml"
    job.write_text('out = "x"\nstrategy = "prowd"\n[round]\nmode = "buffered"\n')
    with pytest.raises(ConfigError, match=r"job\.toml.*prowd.*buffered"):
        load_job(job)
    job.write_text('out = "x"\n[round]\nmode = "async"\n')
    with pytest.raises(ConfigError, match=r"job\.toml.*round\.mode"):
        load_job(job)
    job.write_text('out = "x"\n[round]\nmode = "buffered"\nbuffer_size = 3\nconcurrency = 7\nstaleness = "hinge-10-4"\n')
    cfg = load_job(job).server
    assert (cfg.mode, cfg.buffered.buffer_size, cfg.buffered.concurrency, cfg.buffered.staleness) == \
        ("buffered", 3, 7, "hinge-10-4")
    job.write_text('out = "x"\n[round]\nmode = "buffered"\n[ingest]\nworkers = 2\n')
    with pytest.raises(ConfigError, match=r"ingest\.workers.*buffered"):
        load_job(job)
    from coordinator.emulation.config import from_dict

    with pytest.raises(ConfigError, match=r"round\.engine.*buffered"):
        from_dict({"name": "fb", "model": "mlp", "rounds": 2, "devices": {"raspberry-pi-4": 2},
                   "round": {"mode": "buffered", "engine": "cuda"}}, "test")


# --------------------------------------------------------------------------- admission


def _update(dev: str, base: int, ticket: int, content: str = "delta") -> Update:
    return Update(dev, base, 10, 32, content, (float32_tensor(np.zeros(4, np.float32)),), ticket=ticket)


def test_the_buffer_admits_open_requests_and_refuses_stale_ones_with_a_reason() -> None:
    req = Requests()
    a, b, c = req.issue("a", 0.0), req.issue("b", 0.0), req.issue("c", 0.0)
    w = BufferWindow(6, frozenset(), version=5, settings=BufferedSettings(max_staleness=2), requests=req)
    w.admit(_update("a", 4, a), 0)  # staleness 1: admitted, its request closed, its slot free
    assert w.take("a").staleness == 1 and "a" not in req.tickets and "a" not in req.slots
    with pytest.raises(Rejected) as e:  # answered already: a copy (QoS 1 redelivery)
        w.admit(_update("a", 4, a), 0)
    assert (e.value.metric, e.value.dropped) == ("dropped_closed", True)
    with pytest.raises(Rejected) as e:  # never issued
        w.admit(_update("b", 5, 99), 0)
    assert e.value.metric == "rejected_not_selected" and "b" in req.tickets
    with pytest.raises(Rejected) as e:
        w.admit(_update("b", 2, b), 0)  # staleness 3 > 2
    assert e.value.metric == "rejected_stale" and "staleness 3 > max_staleness 2" in e.value.detail
    assert req.refusal_list() == (("b", b, f"stale: {e.value.detail}"),) and "b" not in req.slots
    with pytest.raises(Rejected) as e:
        w.admit(_update("c", 6, c), 0)  # a version not published yet
    assert e.value.metric == "rejected_wrong_round"
    d = req.issue("d", 0.0)
    with pytest.raises(Rejected) as e:
        w.admit(_update("d", 5, d, content="weights"), 0)
    assert e.value.metric == "rejected_wrong_content"
    assert [t for _, t, _ in req.refusal_list()] == [b, c, d] and req.refused
    e = req.issue("b", 1.0)  # asked again: its old refusal stays listed until it has another
    with pytest.raises(Rejected):
        w.admit(_update("b", 0, e), 0)
    assert [(dev, t) for dev, t, _ in req.refusal_list()] == [("c", c), ("d", d), ("b", e)]


def test_the_device_logs_the_coordinators_refusal_once(tmp_path: Path, caplog) -> None:
    rt = device("d1", 0.1, 5, connect=None, workdir=tmp_path)
    rt.last_done = 7
    ann = RoundAnnouncement(JOB, 9, "mlp", ("x",), time.time() + 60, {}, {"run": "r"}, mode="buffered",
                            tickets=(8,), max_staleness=2,
                            refusals=(("d1", 7, "stale: staleness 3 > max_staleness 2"), ("d2", 7, "other")))
    payload = encode_message(ann)
    assert decode_message(payload) == ann
    with caplog.at_level(logging.WARNING, logger="fedbit.device"):
        for _ in range(2):
            rt._handle(SimpleNamespace(topic=f"fedbit/{JOB}/round", payload=payload))
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines == ["update for request 7 refused by the coordinator: stale: staleness 3 > max_staleness 2"]
    assert still_counts(ann, 7) and not still_counts(ann, 6) and never_counts(ann, 6)
    assert work_number(ann, "x") == 8 and work_number(ann, "d1") == 0


# --------------------------------------------------------------------------- the loop


class GatedTrainer(ShiftTrainer):
    """A ShiftTrainer whose first training waits for ``gate`` (the model moves on meanwhile)."""

    def __init__(self, shift: float, gate: threading.Event) -> None:
        super().__init__(shift)
        self.gate = gate

    def train(self, data, **kw):
        self.gate.wait(30)
        return super().train(data, **kw)


def test_a_buffer_applies_the_staleness_weighted_updates_exactly(tmp_path: Path, caplog) -> None:
    """Three devices, buffers of 2, max_staleness 1: ``c``'s first training waits until two
    versions are applied, so its update (trained on version 0) is refused as stale and the
    device logs why; every other update counts once with weight 1/√(1+τ) and the model is
    exactly the sum of the buffers' steps. The dashboard's picture and ``/metrics`` show
    the version, the buffer and the staleness histogram."""
    from prometheus_client import generate_latest

    from coordinator.ops.dashboard.metrics import registry_for
    from coordinator.ops.dashboard.monitor import FleetMonitor

    shifts = {"a": (0.01, 10), "b": (-0.02, 30), "c": (0.04, 20)}
    fleet = InProcessFleet(JOB)
    monitor = FleetMonitor({"job": JOB}, rounds=5)
    co = coordinator_for(buffered_cfg(rounds=5, buffered={"buffer_size": 2, "concurrency": 3, "max_staleness": 1}),
                         fleet, build_strategy("fedavg"), RunState(tmp_path / "out"), evaluator=None,
                         init_weights=init_shared(SPEC, 0), on_event=monitor)
    gate = threading.Event()
    rts = [device(d, s, n, fleet.device_connector(d), tmp_path, delay=0.01 * i)
           for i, (d, (s, n)) in enumerate(shifts.items())]
    rts[2]._trainer_factory = lambda spec, bits, seed: GatedTrainer(shifts["c"][0], gate)
    threads = [threading.Thread(target=rt.run, kwargs={"max_seconds": 30}, daemon=True) for rt in rts]
    for t in threads:
        t.start()
    out: dict[str, list] = {}
    coord = threading.Thread(target=lambda: out.setdefault("history", co.run()), daemon=True)
    with caplog.at_level(logging.INFO, logger="fedbit"):
        coord.start()
        deadline = time.monotonic() + 30
        while len(co.history) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        gate.set()
        coord.join(30)
        for t in threads:
            t.join(10)
    history = out["history"]
    assert [h["round"] for h in history] == [1, 2, 3, 4, 5] and all(h["accepted"] == 2 for h in history)
    tickets = [(u["device"], u["ticket"]) for h in history for u in h["updates"]]
    assert len(set(tickets)) == len(tickets) == 10  # every answer counted once
    assert all(0 <= u["base"] < h["round"] and u["staleness"] == h["round"] - 1 - u["base"] <= 1
               for h in history for u in h["updates"])
    stale = sum(h["counts"].get("rejected_stale", 0) for h in history)  # (a, b too, on a loaded machine)
    refused = [r.getMessage() for r in caplog.records if "refused by the coordinator" in r.getMessage()]
    assert stale >= 1 and 1 <= len(refused) <= stale  # (one announced after the last version is not seen)
    assert any("stale: staleness" in m and "trained on version 0" in m for m in refused)  # c's first
    move = expected_model(history, shifts)
    for w, w0 in zip(co.weights, init_shared(SPEC, 0), strict=True):
        np.testing.assert_allclose(w, w0 + move, atol=2e-6, rtol=0)
    assert RunState(tmp_path / "out").read_metrics() == history
    assert not any(rt.failure for rt in rts) and all(rt.sent >= 1 for rt in rts)
    snap = monitor.snapshot()
    taus = [u["staleness"] for h in history for u in h["updates"]]
    assert snap["staleness"] == {str(t): taus.count(t) for t in sorted(set(taus))}
    assert snap["current"]["mode"] == "buffered" and snap["totals"]["refused"]["rejected_stale"] == stale
    text = generate_latest(registry_for(monitor)).decode()
    assert 'fedbit_model_version{job="buf"} 5.0' in text
    assert f'fedbit_staleness_refusals_total{{job="buf"}} {float(stale)}' in text
    assert f'fedbit_update_staleness_bucket{{job="buf",le="0"}} {float(taus.count(0))}' in text
    assert f'fedbit_update_staleness_count{{job="buf"}} {float(len(taus))}' in text


def test_the_poisoning_defense_bounds_and_quarantines_per_update_in_buffered_mode(tmp_path: Path) -> None:
    """Three honest devices (step 0.01, 10 samples) and ``x`` (step 1.0, claiming 1,000
    samples), buffers of 3: each update of ``x`` is norm-bounded to 3x its buffer's median
    movement and weighed at most 4x its median sample count, so no version moves a weight
    more than 0.03 (``x`` unbounded: 0.99 per buffer); two struck buffers quarantine ``x``,
    which is asked no more (an answer to a request it held still counts, bounded)."""
    from coordinator.defense.config import DefenseConfig

    shifts = {"a": (0.01, 10), "b": (0.01, 10), "c": (0.01, 10), "x": (1.0, 1000)}
    fleet = InProcessFleet(JOB)
    co = coordinator_for(buffered_cfg(rounds=8, defense=DefenseConfig(strikes=2, window=5),
                                      buffered={"buffer_size": 3, "concurrency": 4, "max_staleness": 8}),
                         fleet, build_strategy("fedavg"), RunState(tmp_path / "out"), evaluator=None,
                         init_weights=init_shared(SPEC, 0))
    rts = [device(d, s, n, fleet.device_connector(d), tmp_path) for d, (s, n) in shifts.items()]
    threads = [threading.Thread(target=rt.run, kwargs={"max_seconds": 30}, daemon=True) for rt in rts]
    for t in threads:
        t.start()
    history = co.run()
    fleet.close()
    for t in threads:
        t.join(10)
    assert [h["round"] for h in history] == list(range(1, 9))
    with_x = [h for h in history if any(u["device"] == "x" for u in h["updates"])]
    assert with_x and all(h["stats"]["guard_norm_bounded"] >= 1 and h["stats"]["guard_weight_bounded"] >= 1
                          and "x" in h["defense"]["struck"] for h in with_x)
    n_params = sum(int(np.prod(s)) for s in SPEC.param_shapes())
    steps = [h["weight_change_l2"] / math.sqrt(n_params) for h in history]  # (every weight moves alike)
    assert all(0 < step <= 0.03 + 1e-6 for step in steps), steps
    quarantined_at = next(h["round"] for h in history if "x" in h["defense"]["newly_quarantined"])
    asked_later = [u for h in history if h["round"] > quarantined_at for u in h["updates"] if u["device"] == "x"]
    assert len(asked_later) <= 1 and all(h["defense"]["quarantined_ids"] == ["x"] for h in history
                                         if h["round"] >= quarantined_at)


@pytest.mark.mosquitto
def test_devices_join_and_leave_over_mqtt_while_the_model_advances(mosquitto, tmp_path: Path) -> None:
    """Over a real mosquitto: ``a`` and ``b`` train from the start; after version 2 ``a``
    leaves (its session ends, presence offline) and ``c`` joins; the versions go on to 8,
    with ``c``'s updates and none of ``a``'s requested after it left."""
    shifts = {"a": (0.01, 10), "b": (-0.02, 30), "c": (0.04, 20)}
    fleet = MqttFleet(mosquitto.url, JOB, username="fedbit-coordinator")
    co = coordinator_for(buffered_cfg(rounds=8, buffered={"buffer_size": 2, "concurrency": 2}), fleet,
                         build_strategy("fedavg"), RunState(tmp_path / "out"), evaluator=None,
                         init_weights=init_shared(SPEC, 0))

    def start(dev: str) -> tuple[DeviceRuntime, threading.Thread]:
        s, n = shifts[dev]
        rt = device(dev, s, n, lambda **kw: MqttTransport(mosquitto.url, dev, backoff=(0.2, 0.5), **kw),
                    tmp_path, delay=0.05)
        th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
        th.start()
        return rt, th

    out: dict[str, list] = {}
    coord = threading.Thread(target=lambda: out.setdefault("history", co.run()), daemon=True)
    a, b = start("a"), start("b")
    coord.start()
    deadline = time.monotonic() + 30
    while len(co.history) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(co.history) >= 2, "the first versions were not applied"
    a[0].stop()
    a[1].join(10)
    left_at = max(co.requests.last_ticket, 0)
    c = start("c")
    coord.join(60)
    assert not coord.is_alive(), "the coordinator did not finish"
    history = out["history"]
    fleet.close()
    for _, th in (b, c):
        th.join(10)
    assert [h["round"] for h in history] == list(range(1, 9))
    late = [u for h in history[2:] for u in h["updates"]]
    assert any(u["device"] == "c" for u in late)
    assert not any(u["device"] == "a" and u["ticket"] > left_at for u in late)
    assert all(h["weight_change_l2"] > 0 for h in history)
    move = expected_model(history, shifts)
    np.testing.assert_allclose(co.weights[0], init_shared(SPEC, 0)[0] + move, atol=2e-6, rtol=0)


# --------------------------------------------------------------------------- the emulator

#: record fields measured in wall time (differ between runs by nature)
WALL = {"time", "run", "round_seconds", "aggregate_seconds", "eval_seconds", "health_seconds",
        "device_train_seconds", "device_wall_seconds"}


def test_a_buffered_emulation_with_availability_gives_the_same_result_for_the_same_seed(tmp_path: Path) -> None:
    """A mixed fleet in buffered mode on the simulated clock: a slow Pi Zero 2 W, Pi 4s and
    desktops that lose half their requests and come and go (sessions of 0.05 simulated s).
    Two runs of one seed give the same records; requests time out, updates are stale,
    refused past max_staleness, or lost with a device that went offline."""
    from coordinator.emulation.config import from_dict
    from coordinator.emulation.emulator import Emulator

    lossy = tmp_path / "lossy.toml"
    lossy.write_text((Path(__file__).parents[3] / "hw_profiles" / "profiles" / "desktop.toml").read_text()
                     .replace('name = "desktop"', 'name = "lossy"').replace("loss_rate = 0.0", "loss_rate = 0.5"))
    cfg = from_dict({"name": "fb", "model": "mlp", "rounds": 8, "transport": "inproc", "strategy": "fedavg",
                     "devices": {"raspberry-pi-zero-2w": 1, "raspberry-pi-4": 2, str(lossy): 3},
                     "data": {"partition": "iid"}, "train": {"steps": 2, "batch": 16},
                     "round": {"workers": 1, "mode": "buffered", "buffer_size": 2, "concurrency": 4,
                               "deadline_s": 0.05, "max_staleness": 2},
                     "availability": {"model": "diurnal",
                                      "profiles": {"lossy": {"availability": 0.6, "mean_session_s": 0.05}}},
                     "clock": {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5, "int6": 5e-4}}}, "test")
    runs = [Emulator(cfg, 3, tmp_path / name).run() for name in ("a", "b")]
    a, b = ([{k: v for k, v in r.items() if k not in WALL} for r in res.history] for res in runs)
    assert a == b and [r["round"] for r in a] == list(range(1, 9))
    sim = [r["sim_time"] for r in a]
    assert all(y > x for x, y in zip(sim, sim[1:], strict=False))
    assert runs[0].info["sim_seconds"] >= sim[-1]
    assert sum(r["stragglers"] for r in a) > 0 and sum(r["sim_lost"] for r in a) > 0
    assert max(u["staleness"] for r in a for u in r["updates"]) >= 1
    assert all(u["staleness"] <= 2 for r in a for u in r["updates"])
    assert len(runs[0].info["availability"]["online"]["lossy"]) == 200
