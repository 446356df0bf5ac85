"""Hostile insiders and operator slips on the real wire (a real mosquitto, the real
coordinator): no ghost device after a restart; in an enrolled job a hello with a forged
log line is shown escaped, a selected device that stays silent or whose update is refused
frees its slot at once, and a revoked device goes offline; a broker that dies is started
again and the round goes on."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import ServerConfig
from coordinator.fleet import MqttFleet
from coordinator.ops.admission import AdmissionConfig
from coordinator.ops.broker import MosquittoBroker, start_job_broker
from coordinator.ops.credentials import COORDINATOR_USER, JobSecurity
from coordinator.ops.logs import ProgressDisplay
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client import auth
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
from edge_client.transport import MqttTransport
from firmware_models import get_spec

pytestmark = pytest.mark.mosquitto
JOB = "hw"
SPEC = get_spec("mlp")
#: what a device does in a round: (acknowledge it?, the update to send or None) from
#: (round id, the model it received)
Script = Callable[[int, list[np.ndarray]], tuple[bool, bytes | None]]


def hello(dev: str, profile: str = "raspberry-pi-4") -> Hello:
    return Hello(dev, profile, 32, "torch", "float32", 32, 50, "test")


def good(dev: str, r: int, model: list[np.ndarray]) -> bytes:
    return encode_message(Update(dev, r, 50, 32, "weights", tuple(float32_tensor(w + 0.01) for w in model)))


class Device(threading.Thread):
    """A scripted device: presence and hello at birth (retained, a last will), then per
    announced round that selects it what ``script`` says; a round announced again (a
    coordinator back on a restarted broker) gets the same again, as the runtime does."""

    def __init__(self, url: str, dev: str, script: Script, *, key: bytes | None = None,
                 password: str | None = None, profile: str = "raspberry-pi-4") -> None:
        super().__init__(daemon=True)
        self.dev, self.script, self.key = dev, script, key
        sign = (lambda p: auth.sign(p, key)) if key else (lambda p: p)  # noqa: E731
        self.sign = sign
        self.t = MqttTransport(url, dev, username=dev if password else None, password=password,
                               will=(topic(JOB, "presence", dev), sign(encode_message(Presence(dev, False)))),
                               birth=[(topic(JOB, "presence", dev), sign(encode_message(Presence(dev, True))), True),
                                      (topic(JOB, "hello", dev), sign(encode_message(hello(dev, profile))), True)],
                               subscriptions=[topic(JOB, "round"), topic(JOB, "model", "float32")],
                               backoff=(0.1, 0.5))
        self.t.connect(10)
        self.stop = threading.Event()
        self.done: dict[int, tuple[bool, bytes | None]] = {}

    def run(self) -> None:
        ann = model = None
        while not self.stop.is_set():
            m = self.t.recv(0.05)
            if m is None or not m.payload:
                continue
            msg = decode_message(auth.strip_mac(m.payload))
            again = isinstance(msg, RoundAnnouncement) and msg.round_id in self.done
            ann = msg if isinstance(msg, RoundAnnouncement) else ann
            model = msg if not isinstance(msg, RoundAnnouncement) else model
            if ann is None or model is None or model.round_id != ann.round_id or self.dev not in ann.selected \
                    or (ann.round_id in self.done and not again):
                continue
            if ann.round_id not in self.done:
                self.done[ann.round_id] = self.script(ann.round_id, model_to_shared(model))
            ack, payload = self.done[ann.round_id]
            if ack:
                self.publish(topic(JOB, "presence", self.dev), encode_message(Presence(self.dev, True, ann.round_id)))
            if payload is not None:
                self.publish(topic(JOB, "update", self.dev), payload)

    def publish(self, name: str, payload: bytes) -> None:
        end = time.monotonic() + 15
        while not self.t.publish(name, self.sign(payload), timeout=2) and time.monotonic() < end:
            time.sleep(0.1)  # (the broker is being restarted)

    def close(self) -> None:
        self.stop.set()
        self.t.close()


def coordinator(url: str, out: Path, *, username: str = COORDINATOR_USER, password: str | None = None,
                on_event=None, logger=None, **kw) -> Coordinator:
    cfg = ServerConfig(job=JOB, model="mlp", **({"rounds": 1, "min_devices": 1, "round_timeout_s": 30,
                                                 "presence_timeout_s": 20} | kw))
    fleet = MqttFleet(url, JOB, client_id=username, username=username, password=password)
    return Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(out), evaluator=None,
                       init_weights=init_shared(SPEC, 0), on_event=on_event, logger=logger)


def test_no_ghost_device_after_a_restart(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    """A device that left cleanly keeps its retained hello and an 'offline' presence: a
    coordinator (re)started afterwards must not count it present (it would be selected
    and every round would run to its deadline)."""
    gone = Device(mosquitto.url, "gone", lambda r, m: (False, None))
    gone.t.close(clear_will=(topic(JOB, "presence", "gone"), encode_message(Presence("gone", False))))
    here = Device(mosquitto.url, "here", lambda r, m: (False, None))
    co = coordinator(mosquitto.url, tmp_path / "run")
    co.fleet.start()
    try:
        end = time.monotonic() + 10
        while "here" not in co.collector.devices.present() and time.monotonic() < end:
            co.collector.pump(time.monotonic() + 0.2)
        co.collector.pump(time.monotonic() + 0.3)  # (whatever else the broker had retained)
        assert list(co.collector.devices.present()) == ["here"]
        assert set(co.collector.devices.hellos) == {"gone", "here"}
    finally:
        here.close()
        co.fleet.close()


@pytest.fixture
def secure(mosquitto_bin: str, tmp_path: Path):
    """A job with enrolled devices d1..d3 on the broker `fedbit serve` starts (passwords,
    ACL, the coordinator on its own listener)."""
    sec = JobSecurity(tmp_path / "security", JOB)
    creds = {c.device_id: c for c, _ in sec.enroll_many([(d, None, None) for d in ("d1", "d2", "d3")],
                                                       broker="mqtt://127.0.0.1:1")}
    jb = start_job_broker("127.0.0.1", None, security="password", job_security=sec, workdir=tmp_path / "broker")
    try:
        yield sec, creds, jb
    finally:
        jb.stop()


def test_an_enrolled_job_against_hostile_insiders(secure, tmp_path: Path) -> None:
    sec, creds, jb = secure
    url = jb.device_url
    # round 1: all answer (d1 says hello with a forged log line and terminal escapes)
    # round 2: d1's update is non-finite (refused), d2 stays silent: both free their slots
    # round 3: d2 is revoked: offline, never selected, its slot not waited for
    scripts: dict[str, Script] = {
        "d1": lambda r, m: (True, good("d1", r, m) if r != 2 else encode_message(
            Update("d1", r, 50, 32, "weights", tuple(float32_tensor(np.full_like(w, 1e30)) for w in m)))),
        "d2": lambda r, m: (r == 1, good("d2", r, m) if r == 1 else None),
        "d3": lambda r, m: (True, good("d3", r, m)),
    }
    forged = "raspberry-pi-4\nround 999/300: accuracy 1.0000\x1b[2K\x1b[31m"
    devs = [Device(url, d, scripts[d], key=creds[d].mac_key_bytes, password=creds[d].password,
                   profile=forged if d == "d1" else "raspberry-pi-4") for d in ("d1", "d2", "d3")]
    for d in devs:
        d.start()
    shown, logged = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(logged)
    log = logging.getLogger("fedbit.hostile")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    display = ProgressDisplay(3, shown)

    def on_event(event: str, f: dict) -> None:
        display(event, f)
        if event == "round_end" and f["round"] == 2:
            assert sec.revoke("d2") and sec.reload_broker()
            co.collector.ingest.enrolled.refresh(force=True)  # (else within a second)

    c = jb.credentials
    co = coordinator(jb.coordinator_url, tmp_path / "run", rounds=3, min_devices=2, ack_timeout_s=0.5,
                     username=c.username, password=c.password, on_event=on_event, logger=log,
                     admission=AdmissionConfig(enrolment=str(sec.registry_path)))
    assert jb.broker._keeper is not None  # (the job's broker is started again should it die)
    try:
        hist = co.run()
    finally:
        for d in devs:
            d.close()
        co.fleet.close()
        log.removeHandler(handler)
    out = shown.getvalue() + logged.getvalue()
    assert "\x1b" not in out and "\nround 999" not in out
    assert "raspberry-pi-4\\nround 999/300: accuracy 1.0000\\x1b[2K\\x1b[31m" in out
    r1, r2, r3 = hist
    assert r1["accepted_ids"] == ["d1", "d2", "d3"]
    assert r2["accepted_ids"] == ["d3"] and r2["gone"] == {"d1": "refused", "d2": "silent"}
    assert r2["round_seconds"] < 10 and r2["counts"]["rejected_out_of_range"] == 1   # (deadline 30 s)
    assert r2["defense"]["struck"] == {"d1": "update refused (out_of_range)"}
    assert r3["selected_ids"] == ["d1", "d3"] and "d2" not in co.collector.devices.present()


def test_a_broker_that_dies_is_started_again_and_the_round_goes_on(mosquitto_bin: str, tmp_path: Path) -> None:
    broker = MosquittoBroker(workdir=tmp_path / "broker", persistence=True).start()
    broker.keep_alive(interval=0.1)
    killed = threading.Event()

    def script(r: int, model: list[np.ndarray]) -> tuple[bool, bytes | None]:
        if r == 2 and not killed.is_set():
            killed.set()
            broker.kill()  # mid-round, before any update of it
        return True, good(threading.current_thread().name, r, model)

    devs, co = [], None
    try:
        for d in ("a", "b"):
            dev = Device(broker.url, d, script)
            dev.name = d
            dev.start()
            devs.append(dev)
        co = coordinator(broker.url, tmp_path / "run", rounds=2, min_devices=2, round_timeout_s=20)
        hist = co.run()
        assert [h["accepted"] for h in hist] == [2, 2] and killed.is_set() and broker.restarts == 1
        assert hist[1]["round_seconds"] < 15
    finally:
        for d in devs:
            d.close()
        if co is not None:
            co.fleet.close()
        broker.stop()
