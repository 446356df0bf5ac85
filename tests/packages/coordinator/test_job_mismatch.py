"""A device on the wrong job, over a real mosquitto: the device says within seconds that no
coordinator serves its job and names the jobs that have one; the coordinator logs the
device knocking on a job nobody serves."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from coordinator.config import ServerConfig
from coordinator.fleet import MqttFleet
from coordinator.server import Coordinator, RoundError
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.intnn import init_shared
from edge_client.protocol import Status, decode_message, topic
from edge_client.runtime import DeviceConfig, DeviceRuntime
from edge_client.transport import MqttTransport
from firmware_models import get_spec


def device(url: str, job: str, tmp: Path) -> DeviceRuntime:
    cfg = DeviceConfig("dev1", 32, "torch", "float32", 32, job=job, workdir=tmp / "dev1", give_up_after_s=20)
    data = SimpleNamespace(x=np.zeros((4, 1, 8, 8), np.float32), y=np.zeros(4, np.int64))
    rt = DeviceRuntime(cfg, data, lambda **kw: MqttTransport(url, "dev1", **kw))
    rt.coordinator_check.after_s = rt.coordinator_check.listen_s = 0.5
    return rt


def test_a_device_on_a_job_without_coordinator_is_told_and_the_coordinator_logs_it(
        mosquitto, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    fleet = MqttFleet(mosquitto.url, "example", watch_jobs=True, username="fedbit-coordinator")
    cfg = ServerConfig(job="example", model="mlp", rounds=1, min_devices=1, presence_timeout_s=3)
    co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp_path / "out"), evaluator=None,
                     init_weights=init_shared(get_spec("mlp"), 0))
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            co.run()
        except RoundError as exc:
            failed.append(exc)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    watch = MqttTransport(mosquitto.url, "watch", subscriptions=[topic("example", "status")])
    watch.connect(10)
    end = time.monotonic() + 20
    while time.monotonic() < end:  # the coordinator's retained status is there
        m = watch.recv(0.2)
        if m is not None and m.payload and isinstance(decode_message(m.payload), Status):
            break
    watch.close()
    rt = device(mosquitto.url, "default", tmp_path)  # started without --job
    t0 = time.monotonic()
    rt.run(max_seconds=1.6)
    th.join(20)
    fleet.close()
    assert failed and "only 0 device(s) present" in str(failed[0])  # it never joined job example
    said = [r.getMessage() for r in caplog.records if r.name == "fedbit.device" and r.levelno == logging.WARNING]
    assert ("no coordinator for job 'default' on this broker (no status on fedbit/default/status after 0.5 s); "
            "jobs seen: example (start the device with --job example?); waiting for one") in said, said
    assert time.monotonic() - t0 < 10
    knocks = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "knock"]
    assert knocks == ["device 'dev1' says hello on job 'default', which has no coordinator on this broker; this "
                      "coordinator serves job 'example' (start the device with --job example)"]


def test_a_device_whose_job_has_a_coordinator_says_nothing_of_the_kind(mosquitto, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    status = MqttTransport(mosquitto.url, "coord")
    status.connect(10)
    from edge_client.protocol import encode_message

    assert status.publish(topic("default", "status"), encode_message(Status("waiting", 0, "x")), retain=True)
    status.close()
    rt = device(mosquitto.url, "default", tmp_path)
    rt.run(max_seconds=1.2)
    assert not [r for r in caplog.records if "no coordinator for job" in r.getMessage()]
    assert rt.coordinator_check.seen
    connected = [r.getMessage() for r in caplog.records if "connected (" in r.getMessage()]
    assert connected and connected[0].startswith("device dev1 connected (MQTT 5, job default, variant float32)")
