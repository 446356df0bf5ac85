"""Bridged brokers (``fedbit broker-config --edges M``, coordinator/ops/brokerconf.py): the files
it writes run three mosquitto instances on loopback as written (a core and two edges,
TLS, per-bridge credentials, ACLs); devices enrolled on two edges and a coordinator on the
core run a full round, every device counted once with the exact model; a device's
credentials open its own edge only."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ShiftTrainer

from coordinator.cli import main as fedbit
from coordinator.config import ServerConfig
from coordinator.fleet import MqttFleet
from coordinator.ops.admission import AdmissionConfig
from coordinator.ops.broker import free_port, wait_for_port
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client import auth
from edge_client.intnn import init_shared
from edge_client.runtime import DeviceConfig, DeviceRuntime
from edge_client.transport import MqttTransport, TlsOptions
from firmware_models import get_spec

pytestmark = pytest.mark.mosquitto
JOB = "edgejob"
DEVICES = [("pi-a", 30, 0.25), ("pi-b", 10, -0.5), ("pi-c", 20, 1.0)]  # (id, samples, shift): edges 0, 1, 0




def _device(creds: auth.Credentials, tmp: Path, samples: int, shift: float) -> DeviceRuntime:
    tls = TlsOptions(*auth.tls_files(creds, tmp / f"{creds.device_id}-tls"))
    cfg = DeviceConfig(creds.device_id, 32, "torch", "float32", 32, job=JOB, workdir=tmp / creds.device_id,
                       publish_timeout_s=5.0, connect_timeout_s=5.0)
    connect = auth.signing_connector(lambda **kw: MqttTransport(creds.broker, creds.device_id, username=creds.username,
                                                                password=creds.password, tls=tls, **kw),
                                     creds.mac_key_bytes)
    data = SimpleNamespace(x=np.zeros((1, 1, 8, 8), np.float32), y=np.zeros(samples, np.int64))
    rt = DeviceRuntime(cfg, data, connect, trainer_factory=lambda *_a: ShiftTrainer(shift))
    threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True).start()
    return rt


def test_devices_on_two_edges_run_a_round_through_the_core(mosquitto_bin: str, openssl_bin: str,
                                                           tmp_path: Path) -> None:
    csv = tmp_path / "devices.csv"
    csv.write_text("device_id,max_samples\n" + "".join(f"{d},100\n" for d, _, _ in DEVICES))
    # (outside pytest's 0700 tmp folder: mosquitto started as root reads its files as user mosquitto)
    base = Path(tempfile.mkdtemp(prefix="fedbit-edges-"))
    os.chmod(base, 0o711)
    out, core, e0, e1 = base / "cfg", free_port(), free_port(), free_port()
    assert fedbit(["broker-config", "--devices", str(csv), "--out", str(out), "--job", JOB, "--edges", "2",
                   "--listen", f"127.0.0.1:{core}", "--edge-address", f"127.0.0.1:{e0}",
                   "--edge-address", f"127.0.0.1:{e1}", "--hostname", "127.0.0.1"]) == 0
    creds = {d: auth.load_credentials(out / "devices" / f"{d}.toml") for d, _, _ in DEVICES}
    assert [creds[d].broker for d, _, _ in DEVICES] == [f"mqtts://127.0.0.1:{p}" for p in (e0, e1, e0)]
    bridge = (out / "edge-1" / "mosquitto.conf").read_text()
    assert f"address 127.0.0.1:{core}" in bridge and "remote_username fedbit-edge-1" in bridge
    assert f"topic fedbit/{JOB}/update/+ out 1" in bridge and f"topic fedbit/{JOB}/round in 1" in bridge
    procs = []
    try:
        for name, port in (("core", core), ("edge-0", e0), ("edge-1", e1)):
            procs.append(subprocess.Popen([mosquitto_bin, "-c", str(out / name / "mosquitto.conf")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            assert wait_for_port("127.0.0.1", port, 10), procs[-1].stderr.read().decode()[-500:]
        cc = auth.load_credentials(out / "coordinator.toml")
        assert cc.broker == f"mqtts://127.0.0.1:{core}"
        # a device's credentials open its own edge only (its password is in that edge's file)
        wrong = MqttTransport(f"mqtts://127.0.0.1:{e1}", "pi-a", username="pi-a", password=creds["pi-a"].password,
                              tls=TlsOptions(*auth.tls_files(creds["pi-a"], tmp_path / "wrong")))
        with pytest.raises(ConnectionError, match="not authorised"):
            wrong.connect(timeout=5)
        wrong.close()
        fleet = MqttFleet(cc.broker, JOB, username=cc.username, password=cc.password, client_id=cc.username,
                          tls=TlsOptions(*auth.tls_files(cc, tmp_path / "ctls")))
        cfg = ServerConfig(job=JOB, model="mlp", rounds=1, min_devices=len(DEVICES), round_timeout_s=60,
                           presence_timeout_s=60, admission=AdmissionConfig(enrolment=str(out / "enrolled.json")))
        w0 = init_shared(get_spec("mlp"), 0)
        co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp_path / "run"), evaluator=None,
                         init_weights=w0)
        result: dict = {}
        th = threading.Thread(target=lambda: result.setdefault("h", co.run()), daemon=True)
        th.start()
        devices = [_device(creds[d], tmp_path, n, s) for d, n, s in DEVICES]
        th.join(timeout=60)
        for rt in devices:
            rt.stop()
        fleet.close()
        assert not th.is_alive() and result.get("h"), "the round did not complete"
        # retained messages crossed the bridges with their flag: the edge holds the core's
        # round, the core the devices' hellos
        late = MqttTransport(creds["pi-a"].broker, "pi-a", username="pi-a", password=creds["pi-a"].password,
                             tls=TlsOptions(*auth.tls_files(creds["pi-a"], tmp_path / "late")),
                             subscriptions=[f"fedbit/{JOB}/round"])
        core_view = MqttTransport(cc.broker, cc.username, username=cc.username, password=cc.password,
                                  tls=TlsOptions(*auth.tls_files(cc, tmp_path / "ctls2")),
                                  subscriptions=[f"fedbit/{JOB}/hello/+"])
        for t in (late, core_view):
            t.connect(timeout=10)
        got = [late.recv(5.0)] + [core_view.recv(5.0) for _ in DEVICES]
        late.close()
        core_view.close()
        assert all(m is not None and m.retain for m in got), got
        assert sorted(m.topic.rsplit("/", 1)[1] for m in got[1:]) == sorted(d for d, _, _ in DEVICES)
        rec = result["h"][0]
        assert rec["accepted_ids"] == sorted(d for d, _, _ in DEVICES)
        assert not {k: v for k, v in rec["counts"].items() if k.startswith("rejected")}
        step = sum(n * s for _, n, s in DEVICES) / sum(n for _, n, _ in DEVICES)
        for w, w_init in zip(co.weights, w0, strict=True):
            np.testing.assert_allclose(w, w_init + step, atol=1e-5, rtol=0)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(base, ignore_errors=True)
