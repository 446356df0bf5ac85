"""When a round closes: a selected device whose last will arrives is a straggler at once,
the round closes when every remaining selected device answered or left, and the devices
still outstanding are named live (log, dashboard snapshot, ``fedbit status``)."""

from __future__ import annotations

import io
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from rich.console import Console

from coordinator.cli.status import outstanding_lines, render
from coordinator.config import ServerConfig
from coordinator.fleet import InProcessFleet
from coordinator.ingest import OpenRound
from coordinator.ops.dashboard.monitor import FleetMonitor
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.intnn import init_shared
from edge_client.protocol import Hello, Presence, decode_message, encode_message, topic
from edge_client.runtime import DeviceConfig, DeviceRuntime
from firmware_models import get_spec

JOB = "t"


class AddTrainer:
    """Local 'training' that adds a constant (no kernels: the test is about the round)."""

    spec, bits, lr, lr_shift = get_spec("mlp"), 32, 1.0, 3  # the Trainer protocol

    def load_shared(self, weights):
        self.w = [np.array(w, dtype=np.float32) for w in weights]

    def train(self, data, **_kw):
        self.w = [w + np.float32(0.01) for w in self.w]
        return SimpleNamespace(loss=0.5, steps=1, samples=len(data.y), seconds=0.0)

    def to_shared(self):
        return [w.copy() for w in self.w]

    def int_weights(self):
        return None

    def ternary_weights(self):
        return None

    def evaluate(self, data, batch=256):
        return 0.0, 0.0


def start_device(fleet: InProcessFleet, tmp: Path, dev: str, delay: float = 0.0) -> None:
    cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=tmp / dev, train_delay_s=delay)
    data = SimpleNamespace(x=np.zeros((20, 1, 8, 8), np.float32), y=np.zeros(20, np.int64))
    rt = DeviceRuntime(cfg, data, fleet.device_connector(dev), trainer_factory=lambda *_a: AddTrainer())
    threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True).start()


def coordinator(fleet: InProcessFleet, out: Path, round_timeout_s: float) -> Coordinator:
    cfg = ServerConfig(job=JOB, model="mlp", rounds=1, min_devices=2, round_timeout_s=round_timeout_s,
                       presence_timeout_s=20)
    return Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(out), evaluator=None,
                       init_weights=init_shared(get_spec("mlp"), 0))


def _will_device(fleet: InProcessFleet, dev: str):
    """A device that says hello and then never trains; its will says it went offline."""
    c = fleet.hub.client(dev, subscriptions=[topic(JOB, "round")],
                         will=(topic(JOB, "presence", dev), encode_message(Presence(dev, False))), birth=[
        (topic(JOB, "presence", dev), encode_message(Presence(dev, True)), True),
        (topic(JOB, "hello", dev), encode_message(Hello(dev, "p", 32, "torch", "float32", 32, 9, "0")), True)])
    c.connect()
    return c


def test_open_round_settles_when_every_selected_device_answered_or_left() -> None:
    rnd = OpenRound(3, frozenset({"a", "b", "c"}))
    assert rnd.outstanding() == ["a", "b", "c"] and not rnd.settled()
    rnd.accepted["a"] = 0.0
    assert not rnd.mark_gone("a", "left")          # answered: not gone
    assert not rnd.mark_gone("z", "left")          # not selected
    assert rnd.mark_gone("b", "left") and not rnd.mark_gone("b", "left")
    assert rnd.outstanding() == ["c"] and not rnd.settled()
    rnd.accepted["c"] = 1.0
    assert rnd.outstanding() == [] and rnd.settled()


def test_a_selected_device_whose_last_will_arrives_is_a_straggler_at_once(tmp_path: Path, caplog) -> None:
    """The deadline is 60 s; the round closes within a second of the last will."""
    fleet = InProcessFleet(JOB)
    start_device(fleet, tmp_path, "a")
    leaver = _will_device(fleet, "leaver")
    events: list[tuple[str, dict]] = []
    co = coordinator(fleet, tmp_path / "out", round_timeout_s=60.0)
    co.collector.outstanding_every_s = 0.2
    co.collector.back_within_s = 0.5  # (a restarted device back within it is waited for: test_runtime.py)
    co.on_event = co.collector.on_event = lambda e, f: events.append((e, f))
    result: dict = {}
    th = threading.Thread(target=lambda: result.setdefault("h", co.run()), daemon=True)
    caplog.set_level(logging.INFO, logger="fedbit.server")
    t0 = time.monotonic()
    th.start()
    while time.monotonic() - t0 < 20:  # the announcement selects it: then it drops (its will)
        m = leaver.recv(0.2)
        if m is not None and m.payload and "leaver" in decode_message(m.payload).selected:
            break
    leaver.drop()
    th.join(30)
    assert not th.is_alive(), "the round waited for the device that left"
    (rec,) = result["h"]
    assert time.monotonic() - t0 < 20
    assert rec["accepted_ids"] == ["a"] and rec["straggler_ids"] == ["leaver"] and rec["counts"]["stragglers"] == 1
    gone = [f for e, f in events if e == "gone"]
    assert gone == [{"round": 1, "device": "leaver", "why": "left", "outstanding": 1}]
    text = caplog.text
    assert "selected device 'leaver' is gone (left) before answering: a straggler unless back within 0.5 s" in text
    assert "every selected device answered or is gone; 1 straggler(s) excluded (1 gone: leaver)" in text


def test_outstanding_devices_are_named_in_the_log_while_the_round_waits(tmp_path: Path, caplog) -> None:
    fleet = InProcessFleet(JOB)
    start_device(fleet, tmp_path, "a")
    start_device(fleet, tmp_path, "slow", delay=0.8)
    co = coordinator(fleet, tmp_path / "out", round_timeout_s=30.0)
    co.collector.outstanding_every_s = 0.25
    caplog.set_level(logging.INFO, logger="fedbit.server")
    (rec,) = co.run()
    assert rec["accepted"] == 2 and rec["stragglers"] == 0
    assert "round 1: 1 of 2 update(s); waiting for 1 device(s): slow, deadline in" in caplog.text


def test_the_dashboard_snapshot_and_status_name_the_outstanding_devices() -> None:
    mon = FleetMonitor({}, 3, "t", clock=lambda: 1000.0)
    mon("round_start", {"round": 2, "selected": ["a", "b", "c", "d"], "deadline_s": 30})
    mon("update", {"round": 2, "device": "a", "accepted": 1, "bytes": 10, "codec": "float32-32"})
    mon("gone", {"round": 2, "device": "c", "why": "left", "outstanding": 2})
    cur = mon.snapshot()["current"]
    assert cur["outstanding"] == 2 and cur["outstanding_ids"] == ["b", "d"] and cur["gone"] == {"c": "left"}
    assert outstanding_lines(cur) == ["  waiting for 2 device(s): b, d",
                                      "  gone before answering (stragglers): c (left)"]
    out = io.StringIO()
    view = {"job": {}, "rounds": [], "state": "running", "why": "pid 1", "rounds_planned": 3, "run_dir": "r",
            "current": cur | {"deadline": time.time() + 30}, "devices": [], "totals": {}}
    render(view, console=Console(file=out, width=140))
    assert "waiting for 2 device(s): b, d" in out.getvalue()
