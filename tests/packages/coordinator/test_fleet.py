"""Fleets: the same round loop over MQTT 3.1.1 (amqtt), MQTT 5 (mosquitto) and the
in-process hub; the in-process fleet carries the same bytes as a broker."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from conftest import ShiftTrainer

from coordinator.config import ServerConfig
from coordinator.fleet import InProcessFleet, MqttFleet
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.intnn import init_shared
from edge_client.protocol import ModelMessage, decode_message, topic
from edge_client.runtime import DeviceConfig, DeviceRuntime
from edge_client.transport import MqttTransport
from firmware_models import get_spec

JOB = "fl"
SPEC = get_spec("mlp")




def run(fleet, connector, tmp: Path, rounds: int = 2) -> Coordinator:
    threads = []
    for i, dev in enumerate(("a", "b")):
        cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=tmp / dev)
        data = SimpleNamespace(x=np.zeros((10 + 10 * i, 1, 8, 8), np.float32),
                               y=np.zeros(10 + 10 * i, np.int64))
        rt = DeviceRuntime(cfg, data, connector(dev),
                           trainer_factory=lambda spec, bits, seed, s=0.01 * (i + 1): ShiftTrainer(s))
        th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
        th.start()
        threads.append((rt, th))
    cfg = ServerConfig(job=JOB, model="mlp", rounds=rounds, min_devices=2, round_timeout_s=20,
                       presence_timeout_s=30)
    co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp / "out"), evaluator=None,
                     init_weights=init_shared(SPEC, 0))
    hist = co.run()
    assert [h["accepted"] for h in hist] == [2] * rounds
    for rt, th in threads:
        th.join(15)
        assert rt.rounds_done == list(range(1, rounds + 1))
    return co


def test_mqtt_fleet_over_amqtt_uses_mqtt_311(amqtt_broker, tmp_path: Path) -> None:
    fleet = MqttFleet(amqtt_broker.url, JOB, username="coordinator")

    def connector(dev):
        return lambda **kw: MqttTransport(amqtt_broker.url, dev, **kw)

    try:
        run(fleet, connector, tmp_path)
        assert fleet.version == "3.1.1"
    finally:
        fleet.close()


def test_in_process_fleet_carries_the_same_bytes_as_mosquitto(mosquitto, tmp_path: Path) -> None:
    local = InProcessFleet(JOB)
    co_local = run(local, local.device_connector, tmp_path / "local")
    mqtt = MqttFleet(mosquitto.url, JOB)

    def connector(dev):
        return lambda **kw: MqttTransport(mosquitto.url, dev, **kw)

    try:
        co_mqtt = run(mqtt, connector, tmp_path / "mqtt")
        assert mqtt.version == "5"
    finally:
        mqtt.close()
    for a, b in zip(co_local.weights, co_mqtt.weights, strict=True):
        np.testing.assert_array_equal(a, b)
    # the retained round-2 model: byte for byte the same
    t = topic(JOB, "model", "float32")
    watcher = MqttTransport(mosquitto.url, "watch", subscriptions=[t])
    watcher.connect(10)
    try:
        m = watcher.recv(5)
    finally:
        watcher.close()
    assert m is not None and m.retain
    assert m.payload == local.hub._retained[t]
    msg = decode_message(m.payload)
    assert isinstance(msg, ModelMessage) and msg.round_id == 2


def test_queued_retained_publishes_are_confirmed_and_kept_in_order(mosquitto) -> None:
    """``publish_status`` queues without waiting; ``flush`` waits for every PUBACK; the
    retained topic ends on the last payload queued (MQTT keeps the order)."""
    fleet = MqttFleet(mosquitto.url, JOB)
    fleet.start()
    t = topic(JOB, "status")
    try:
        for i in range(20):
            fleet.publish_status(b"s%02d" % i)
        assert len(fleet._unconfirmed) == 20
        fleet.flush()
        assert fleet._unconfirmed == []
        fleet.publish_status(b"last")  # close() lingers for its PUBACK
    finally:
        fleet.close()
    watcher = MqttTransport(mosquitto.url, "watch", subscriptions=[t])
    watcher.connect(10)
    try:
        m = watcher.recv(5)
    finally:
        watcher.close()
    assert m is not None and m.retain and m.payload == b"last"
