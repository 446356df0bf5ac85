"""Ingest workers (``coordinator.ingest_workers``) with real worker processes, a real
mosquitto and real device loops: the same updates give the same global model, bit for
bit, as one process folding them; a worker killed with QoS 1 updates in flight to it
loses none of them.

Mosquitto 2.0's shared subscriptions (Debian's 2.0.11) keep the in-flight messages of a
member whose persistent session outlives its connection for that member alone (issue
1747), and drop them when its session ends (issue 2662). So the worker is stopped
(SIGSTOP) before the round's updates arrive, the broker hands it its share, then it is
killed: in round 1 a new process under the same client id takes its session back and
the broker redelivers them; in round 2 (no replacement) the other worker's session is
ended, the messages are gone, and the round is announced again: the devices re-send from
their outbox. Every round must count every device once, with the model one process
folding the same updates makes, bit for bit.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import wait_for
from scenario import report, trials

from coordinator.config import ServerConfig
from coordinator.ingest import Ingest
from coordinator.ingest_workers import IngestWorkers
from coordinator.ops.broker import MosquittoBroker
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.intnn import init_shared, to_shared
from edge_client.protocol import Update
from edge_client.runtime import DeviceConfig, DeviceRuntime, encode_update_tensors
from edge_client.transport import MqttTransport
from firmware_models import get_spec

pytestmark = pytest.mark.mosquitto
MODEL, BITS, ROUNDS = "mlp", 8, 2
DEVICES = [(f"iw{k}", 20 + 7 * k) for k in range(6)]  # (id, samples)


def round_ints(k: int, r: int) -> list[np.ndarray]:
    """Device ``k``'s Int8 weights after round ``r`` (its 'training' ignores the model):
    fixed integers, so the round's sums are exact and known."""
    rng = np.random.default_rng(1000 * k + r)
    return [rng.integers(-100, 100, s, dtype=np.int8) for s in get_spec(MODEL).param_shapes()]


class FixedIntTrainer:
    spec, bits, lr, lr_shift = None, BITS, 1.0, 3  # the Trainer protocol (spec: unused)

    def __init__(self, k: int) -> None:
        self.k, self.r = k, 0

    def load_shared(self, _weights) -> None:
        pass

    def train(self, _data, **_kw):
        self.r += 1
        return SimpleNamespace(loss=0.1)

    def int_weights(self) -> list[np.ndarray]:
        return round_ints(self.k, self.r)

    def to_shared(self) -> list[np.ndarray]:
        return to_shared(self.int_weights(), BITS)

    def ternary_weights(self):
        return None

    def evaluate(self, _data, batch: int = 256):
        return 0.0, 0.0


def reference() -> list[list[np.ndarray]]:
    """The global model after each round, one process folding every update's exact bytes."""
    spec = get_spec(MODEL)
    names = spec.param_names()
    strategy = build_strategy("fedavg")
    ingest = Ingest(MODEL, [tuple(s) for s in spec.param_shapes()], ServerConfig().limits)
    w, out = init_shared(spec, 0), []
    for r in range(1, ROUNDS + 1):
        strategy.begin_round(r, w)
        for k, (dev, n) in enumerate(DEVICES):
            ints = round_ints(k, r)
            t = encode_update_tensors(to_shared(ints, BITS), names, "int", BITS, int_weights=ints, compute_bits=BITS)
            strategy.fold(ingest.encoded(Update(dev, r, n, BITS, "weights", t)))
        w = strategy.finish().weights
        out.append([np.asarray(x, dtype=np.float32) for x in w])
    return out


def start_device(url: str, tmp: Path, k: int) -> DeviceRuntime:
    dev, n = DEVICES[k]
    cfg = DeviceConfig(dev, BITS, "int", "int", BITS, job="iw", workdir=tmp / dev, publish_timeout_s=5.0,
                       connect_timeout_s=5.0, resend_interval_s=600.0)
    data = SimpleNamespace(x=np.zeros((1, 1, 8, 8), np.float32), y=np.zeros(n, np.int64))
    rt = DeviceRuntime(cfg, data, lambda **kw: MqttTransport(url, dev, backoff=(0.2, 0.5), **kw),
                       trainer_factory=lambda *_a: FixedIntTrainer(k))
    threading.Thread(target=rt.run, kwargs={"max_seconds": 120}, daemon=True).start()
    return rt


def test_workers_fold_bit_for_bit_and_lose_nothing_when_one_is_killed(mosquitto: MosquittoBroker,
                                                                      tmp_path: Path) -> None:
    want = reference()
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        try:
            got = one_trial(mosquitto, d)
        except BaseException:
            report("ingest worker kill -9 with QoS 1 in flight", trial, "FAILED")
            raise
        ck = RunState(d / "run").load_checkpoint()
        assert ck is not None and ck.completed_round == ROUNDS
        lines = RunState(d / "run").read_metrics()
        for m in lines:
            assert m["accepted_ids"] == sorted(dev for dev, _ in DEVICES), m  # each device once
        for r, (g, w) in enumerate(zip(got, want, strict=True), 1):
            assert all(np.array_equal(a, b) for a, b in zip(g, w, strict=True)), f"round {r}: not bit for bit"
        report("ingest worker kill -9 with QoS 1 in flight", trial,
               "every round counted each device once; the model bit for bit as one process",
               copies_dropped=sum(m["counts"].get("dropped_duplicate", 0) for m in lines))


def one_trial(broker: MosquittoBroker, d: Path) -> list[list[np.ndarray]]:
    """One run of ROUNDS rounds (see the module docstring); the model after each round."""
    run = d / "run"
    cfg = ServerConfig(job="iw", model=MODEL, rounds=ROUNDS, min_devices=len(DEVICES), max_devices=len(DEVICES),
                       round_timeout_s=60, presence_timeout_s=60, hparams={"epochs": 1, "batch": 8})
    conn = {"url": broker.url, "username": "fedbit-coordinator", "protocol": "5"}
    workers = IngestWorkers(2, cfg, conn, run, partial_timeout_s=30)
    fleet = workers.fleet_for(broker.url, "iw", username="fedbit-coordinator", protocol="5")
    state = {"stopped": None}
    real_begin = workers.begin

    def begin(r: int, weights, groups) -> None:
        real_begin(r, weights, groups)
        if r in (1, 2):  # stopped before the round's updates reach it: the broker hands it its share
            i = r - 1
            workers.respawn = r == 1
            pid = workers.pool.pid(i)
            os.kill(pid, signal.SIGSTOP)
            state["stopped"] = (r, i, pid)

    workers.begin = begin
    models: list[list[np.ndarray]] = []
    co = Coordinator(cfg, fleet, workers.wrap(build_strategy("fedavg")), RunState(run), evaluator=None,
                     init_weights=init_shared(get_spec(MODEL), 0),
                     on_event=lambda e, f: models.append([w.copy() for w in co.weights]) if e == "round_end" else None)
    workers.attach(co.collector, co.strategy)
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("history", co.run()), daemon=True)
    th.start()
    devices = [start_device(broker.url, d / "devices", k) for k in range(len(DEVICES))]
    try:
        for r in (1, 2):
            wait_for(lambda r=r: state["stopped"] is not None and state["stopped"][0] == r, 60, f"round {r}")
            wait_for(lambda r=r: all(rt.sent >= r for rt in devices), 30, f"round {r}'s updates")
            time.sleep(0.3)  # (the others' share claimed and folded meanwhile)
            rnd = co.collector.round
            assert rnd is not None and rnd.round_id == r and len(rnd.accepted) < len(DEVICES), \
                "no update was in flight to the stopped worker"
            os.kill(state["stopped"][2], signal.SIGKILL)
        th.join(timeout=90)
        assert not th.is_alive() and len(result.get("history", [])) == ROUNDS
    finally:
        for rt in devices:
            rt.stop()
        fleet.close()
    rep = co.history[-1]["ingest_workers"]
    assert rep["restarts"] == 1 and rep["retired"] == 1, rep
    # the poisoning guard ran in the workers (their shares' norms reached the round's medians)
    assert all(h["stats"]["guard_median_norm"] > 0 for h in co.history), [h["stats"] for h in co.history]
    assert sum(rt.resent for rt in devices) >= 1  # round 2: re-sent from the outbox
    return models
