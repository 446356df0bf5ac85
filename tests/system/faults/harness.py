"""Real coordinator and device processes for the fault-injection suite, with kill points.

    python tests/system/faults/harness.py coordinator --broker URL --out DIR [--fault POINT:N] [--resume]
                                               [--mode buffered --buffer-size K --concurrency C]
    python tests/system/faults/harness.py device --broker URL --id D --shift S --samples N --workdir DIR
                                          [--fault crash_after_publish:R] [--delay S]

The coordinator is the real round loop (``Coordinator`` + ``MqttFleet`` + the run folder,
``mlp``, FedAvg, no evaluation); devices are real ``DeviceRuntime`` loops whose local
training adds a constant ``shift`` to every weight, so the global model after R rounds is
known exactly: ``w_0 + R * Σ n_k s_k / Σ n_k`` when every device counts once a round. An
update lost or counted twice changes it.

A fault ``POINT:N`` makes the process ``SIGKILL`` itself (what ``kill -9`` does) at the
N-th time it reaches POINT:

- ``before_ack``: an update was persisted and synced, its PUBACK not yet sent;
- ``after_ack``: an update's PUBACK was sent (and had 0.2 s to leave);
- ``aggregate``: round N's aggregation started (buffered: the buffer of version N);
- ``checkpoint``: half of round N's checkpoint was written to its temporary file;
- ``crash_after_publish`` (devices): the broker acknowledged round N's update.

``--samples`` is the sample count a device reports (its hello and updates); the shift
trainer reads no data.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

MODEL = "mlp"


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def parse_fault(text: str | None) -> tuple[str, int]:
    if not text:
        return "", 0
    point, _, n = text.partition(":")
    return point, int(n or 1)


def install_coordinator_fault(point: str, n: int) -> None:
    """Patch the real classes so that the process kills itself at the fault point."""
    from coordinator import state as state_mod
    from coordinator.fleet import TransportFleet
    from coordinator.strategies.base import Strategy

    hits = {"n": 0}
    if point in ("before_ack", "after_ack"):
        real_ack = TransportFleet.ack

        def ack(self, msg):
            if msg.kind == "update":
                hits["n"] += 1
                if hits["n"] == n and point == "before_ack":
                    die()
            real_ack(self, msg)
            if msg.kind == "update" and hits["n"] == n and point == "after_ack":
                time.sleep(0.2)  # the PUBACK leaves through paho's network thread
                die()

        TransportFleet.ack = ack
    elif point == "aggregate":
        real_finish = Strategy.finish

        def finish(self):
            if self.round_id == n:
                die()
            return real_finish(self)

        Strategy.finish = finish
    elif point == "checkpoint":
        real_write = state_mod.atomic_write

        def atomic_write(path, data, *, durable=True):
            p = Path(path)
            if p.name == "checkpoint.msgpack":
                hits["n"] += 1
                if hits["n"] == n:
                    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
                    with open(tmp, "wb") as f:
                        f.write(data[: len(data) // 2])
                        f.flush()
                        os.fsync(f.fileno())
                    die()
            real_write(path, data, durable=durable)

        state_mod.atomic_write = atomic_write
    elif point:
        raise SystemExit(f"unknown coordinator fault {point!r}")


def run_coordinator(a: argparse.Namespace) -> int:
    from coordinator.buffered import BufferedSettings
    from coordinator.config import ServerConfig
    from coordinator.fleet import MqttFleet
    from coordinator.job import coordinator_for
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.intnn import init_shared
    from edge_client.logs import setup_logging
    from firmware_models import get_spec

    install_coordinator_fault(*parse_fault(a.fault))
    logger = setup_logging(json_lines=True, level="info")
    from coordinator.ops.admission import AdmissionConfig

    admission = AdmissionConfig(enrolment=a.enrolment or "", max_registered=a.max_registered,
                                samples_policy=a.samples_policy)
    cfg = ServerConfig(job=a.job, model=MODEL, rounds=a.rounds, min_devices=a.devices,
                       round_timeout_s=a.round_timeout, presence_timeout_s=60, seed=0, admission=admission,
                       mode=a.mode, buffered=BufferedSettings(buffer_size=a.buffer_size, concurrency=a.concurrency))
    if a.credentials:  # a secured broker: the coordinator's own user (client id = username)
        from edge_client.auth import load_credentials

        c = load_credentials(a.credentials)
        fleet = MqttFleet(a.broker, a.job, username=c.username, password=c.password, client_id=c.username)
    else:
        fleet = MqttFleet(a.broker, a.job, username="fedbit-coordinator")
    co = coordinator_for(cfg, fleet, build_strategy("fedavg"), RunState(a.out), evaluator=None,
                         init_weights=init_shared(get_spec(MODEL), 0), logger=logger.getChild("server"))
    history = co.run(resume=a.resume)
    fleet.close()
    print(json.dumps({"rounds": len(history), "republished": fleet.republished,
                      "connects": fleet.transport.connects}), flush=True)
    return 0


class ShiftTrainer:
    """Local training that adds ``shift`` to every weight."""

    spec, bits, lr, lr_shift = None, 32, 1.0, 3  # the Trainer protocol (spec: unused)

    def __init__(self, shift: float) -> None:
        self.shift = np.float32(shift)
        self.w: list[np.ndarray] = []

    def load_shared(self, weights):
        self.w = [np.array(w, dtype=np.float32) for w in weights]

    def train(self, data, **_kw):
        self.w = [w + self.shift for w in self.w]
        return SimpleNamespace(loss=0.1)

    def to_shared(self):
        return [w.copy() for w in self.w]

    def int_weights(self):
        return None

    def ternary_weights(self):
        return None

    def evaluate(self, data, batch=256):
        return 0.0, 0.0


def run_device(a: argparse.Namespace) -> int:
    import logging

    from edge_client.runtime import DeviceConfig, DeviceRuntime
    from edge_client.transport import MqttTransport

    logging.basicConfig(level="INFO", stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    point, n = parse_fault(a.fault)

    class Transport(MqttTransport):
        def publish(self, topic_name, payload, **kw):
            ok = super().publish(topic_name, payload, **kw)
            if point == "crash_after_publish" and ok and "/update/" in topic_name and \
                    rt.announcement is not None and rt.announcement.round_id == n:
                die()
            return ok

    cfg = DeviceConfig(a.id, 32, "torch", "float32", 32, job=a.job, workdir=Path(a.workdir),
                       train_delay_s=a.delay, publish_timeout_s=5.0, connect_timeout_s=5.0)
    data = SimpleNamespace(x=np.zeros((1, 1, 8, 8), np.float32), y=np.zeros(a.samples, np.int64))

    user = password = None
    mac_key = a.mac_key
    if a.credentials:  # an enrolled device on a secured broker
        from edge_client.auth import load_credentials

        c = load_credentials(a.credentials)
        user, password, mac_key = c.username, c.password, c.mac_key

    def connect(**kw):
        return Transport(a.broker, a.id, backoff=(0.5, 1.0), username=user, password=password, **kw)

    if mac_key:
        from edge_client.auth import signing_connector

        connect = signing_connector(connect, bytes.fromhex(mac_key))
    rt = DeviceRuntime(cfg, data, connect, trainer_factory=lambda spec, bits, seed: ShiftTrainer(a.shift))
    signal.signal(signal.SIGTERM, lambda *_: rt.stop())
    rounds = rt.run(max_seconds=a.max_seconds)
    print(json.dumps({"device": a.id, "rounds": rounds, "sent": rt.sent, "resent": rt.resent,
                      "connects": rt.transport.connects}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="role", required=True)
    c = sub.add_parser("coordinator")
    c.add_argument("--broker", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--devices", type=int, default=2)
    c.add_argument("--round-timeout", type=float, default=20.0)
    c.add_argument("--fault")
    c.add_argument("--resume", action="store_true")
    c.add_argument("--job", default="faults")
    c.add_argument("--enrolment", help="the job's enrolled.json: MACs checked")
    c.add_argument("--max-registered", type=int, default=100_000)
    c.add_argument("--samples-policy", default="clip")
    c.add_argument("--credentials", help="the coordinator's credentials file (a secured broker)")
    c.add_argument("--mode", default="sync")
    c.add_argument("--buffer-size", type=int, default=2)
    c.add_argument("--concurrency", type=int, default=2)
    d = sub.add_parser("device")
    d.add_argument("--broker", required=True)
    d.add_argument("--id", required=True)
    d.add_argument("--shift", type=float, required=True)
    d.add_argument("--samples", type=int, required=True)
    d.add_argument("--workdir", required=True)
    d.add_argument("--delay", type=float, default=0.0)
    d.add_argument("--max-seconds", type=float, default=90.0)
    d.add_argument("--fault")
    d.add_argument("--job", default="faults")
    d.add_argument("--mac-key", help="sign every message with this key (hex)")
    d.add_argument("--credentials", help="the device's credentials file: user, password, MAC key")
    a = p.parse_args(argv)
    return run_coordinator(a) if a.role == "coordinator" else run_device(a)


if __name__ == "__main__":
    sys.exit(main())
