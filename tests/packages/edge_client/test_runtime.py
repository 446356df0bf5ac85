"""The device loop over a real mosquitto: the outbox across a broker restart and a device
restart, round closing, SIGTERM; and the per-profile update encoding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ShiftTrainer

from coordinator.config import ServerConfig
from coordinator.fleet import InProcessFleet, MqttFleet
from coordinator.ops.broker import MosquittoBroker
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.intnn import init_shared
from edge_client.protocol import (
    Presence,
    RoundAnnouncement,
    decode_message,
    encode_message,
    topic,
)
from edge_client.runtime import DeviceConfig, DeviceRuntime, encode_update_tensors
from edge_client.transport import MqttTransport
from firmware_models import get_spec

JOB = "rt"
SPEC = get_spec("mlp")
BIN = Path(sys.executable).parent




def data(n: int = 12) -> SimpleNamespace:
    return SimpleNamespace(x=np.zeros((n, 1, 8, 8), np.float32), y=np.zeros(n, np.int64))


def run_coordinator(url: str, out: Path, **kw) -> tuple[Coordinator, threading.Thread, dict]:
    cfg = ServerConfig(job=JOB, model="mlp", **({"rounds": 1, "min_devices": 1, "round_timeout_s": 30,
                                                 "presence_timeout_s": 30} | kw))
    co = Coordinator(cfg, MqttFleet(url, JOB), build_strategy("fedavg"), RunState(out),
                     evaluator=None, init_weights=init_shared(SPEC, 0))
    result: dict = {}

    def main():
        try:
            result["history"] = co.run()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            result["error"] = exc
        finally:
            co.fleet.close()

    th = threading.Thread(target=main, daemon=True)
    th.start()
    return co, th, result


def device(url: str, workdir: Path, dev: str = "dev1", trainer=None, transport_cls=MqttTransport,
           **cfg_kw) -> tuple[DeviceRuntime, threading.Thread]:
    cfg = DeviceConfig(dev, 32, "torch", "float32", 32, job=JOB, workdir=workdir,
                       publish_timeout_s=1.5, **cfg_kw)

    def connect(**kw):
        return transport_cls(url, dev, backoff=(0.5, 1.0), **kw)

    rt = DeviceRuntime(cfg, data(), connect,
                       trainer_factory=lambda spec, bits, seed: trainer or ShiftTrainer())
    th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
    th.start()
    return rt, th


def test_update_survives_a_broker_crash_mid_upload(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    """The broker dies while the device trains; the publish fails, the update waits in the
    outbox, the broker comes back on the same port, the device reconnects and re-sends.
    (The strict outbox path, a device process that dies mid-upload and restarts, is the
    next test.)"""
    port, workdir = mosquitto.port, mosquitto.workdir
    restarted: list[MosquittoBroker] = []

    def crash_broker():
        if restarted:
            return
        mosquitto.kill()

        def back():
            time.sleep(2.0)
            restarted.append(MosquittoBroker(port, workdir=workdir, persistence=True,
                                             binary=mosquitto.binary).start())

        threading.Thread(target=back, daemon=True).start()
        restarted.append(None)  # type: ignore[arg-type]  # mark: crash done

    co, th, result = run_coordinator(mosquitto.url, tmp_path / "out")
    try:
        rt, dth = device(mosquitto.url, tmp_path / "dev1", trainer=ShiftTrainer(on_train=crash_broker))
        th.join(40)
        assert "error" not in result, result.get("error")
        hist = result["history"]
        assert hist[0]["accepted_ids"] == ["dev1"]  # it arrived after the reconnect
        assert rt.rounds_done == [1] and rt.sent == 0  # the live publish was never acked
        # Re-sent by the outbox flush after the reconnect, or by paho's own session queue
        # when that came first (then the outbox copy was a duplicate, or the round closed
        # before the flush); either way exactly one update counted.
        assert hist[0]["accepted"] == 1
        dth.join(10)
    finally:
        for b in restarted:
            if b is not None:
                b.stop()


class DiesMidUpload(MqttTransport):
    """The process 'dies' while publishing its update: no PUBACK, no more network."""

    def publish(self, topic_name, payload, **kw):
        if "/update/" in topic_name:
            self.kill()
            return False
        return super().publish(topic_name, payload, **kw)


def test_restarted_device_sends_its_update_from_the_outbox(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    co, th, result = run_coordinator(mosquitto.url, tmp_path / "out")
    wd = tmp_path / "dev1"
    rt1, t1 = device(mosquitto.url, wd, transport_cls=DiesMidUpload)
    end = time.monotonic() + 20
    while not rt1.rounds_done and time.monotonic() < end:
        time.sleep(0.05)
    rt1.stop()
    t1.join(10)
    assert rt1.rounds_done == [1] and rt1.sent == 0 and len(rt1.outbox) == 1
    rt2, t2 = device(mosquitto.url, wd)            # same workdir: same outbox and state
    th.join(30)
    assert "error" not in result, result.get("error")
    assert result["history"][0]["accepted_ids"] == ["dev1"]
    t2.join(10)
    assert rt2.resent == 1 and rt2.rounds_done == []   # re-sent, not re-trained
    assert len(rt2.outbox) == 0


def test_outbox_items_of_closed_rounds_are_discarded(tmp_path: Path) -> None:
    fleet = InProcessFleet(JOB)
    cfg = DeviceConfig("d", 32, "torch", "float32", 32, job=JOB, workdir=tmp_path)
    rt = DeviceRuntime(cfg, data(), fleet.device_connector("d"),
                       trainer_factory=lambda *a: ShiftTrainer())
    rt.outbox.put(1, topic(JOB, "update", "d"), b"stale")
    ann = RoundAnnouncement(JOB, 2, "mlp", ("other",), time.time() + 30, {"float32": "0" * 64})
    fleet.hub.route(topic(JOB, "round"), encode_message(ann), True)
    rt.run(max_seconds=1.0)
    assert len(rt.outbox) == 0


def test_a_trainer_short_of_the_protocol_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    class Partial:  # what a device loop once probed for, not what the Trainer protocol says
        def load_shared(self, weights): ...

        def train(self, data, **_kw): ...

        def to_shared(self): ...

    cfg = DeviceConfig("d", 8, "int", "int", 8, job=JOB, workdir=tmp_path)
    rt = DeviceRuntime(cfg, data(), InProcessFleet(JOB).device_connector("d"), trainer_factory=lambda *a: Partial())
    with pytest.raises(TypeError, match=r"Partial, which lacks \['spec', 'bits', 'lr', 'lr_shift', 'int_weights', "
                                        r"'ternary_weights', 'evaluate'\] of the Trainer protocol"):
        rt._trainer("mlp")
    ok = DeviceRuntime(cfg, data(), InProcessFleet(JOB).device_connector("d"), trainer_factory=lambda *a: ShiftTrainer())
    assert isinstance(ok._trainer("mlp")[1], ShiftTrainer)


def test_int_update_encoding_uses_the_storage_grid_when_needed() -> None:
    q = [np.array([[-64, 0, 63]], np.int8), np.array([3, -2], np.int8)]
    w = [x.astype(np.float32) / 128 for x in q]
    t = encode_update_tensors(w, ["a", "b"], "int", 6, int_weights=q, compute_bits=6)
    assert [x.codec for x in t] == ["int", "int"]
    assert t[0].bits == 8            # |q| up to 64 needs 8 bits on the 8-bit grid
    assert t[1].bits == 6            # small integers keep the profile's 6 bits
    assert t[1].nbytes == 2
    f = encode_update_tensors(w, ["a", "b"], "float32", 32)
    assert f[0].codec == "float32" and f[0].nbytes == 12


def test_fedbit_edge_run_stops_cleanly_on_sigterm(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    watcher = MqttTransport(mosquitto.url, "watch", subscriptions=[topic(JOB, "presence", "sig1")])
    watcher.connect(10)
    p = subprocess.Popen([str(BIN / "fedbit-edge"), "run", "--broker", mosquitto.url,
                          "--profile", "raspberry-pi-4", "--data", "digits:1/8", "--id", "sig1",
                          "--job", JOB],  # the default working directory: the user's state dir
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state")), cwd=tmp_path)
    try:
        m = watcher.recv(30)
        assert m is not None and decode_message(m.payload) == Presence("sig1", True)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
        assert "stopped after 0 round(s)" in p.stdout.read()
        assert (tmp_path / "state" / "fedbit" / "sig1" / "outbox").is_dir()
        assert not list(tmp_path.glob(".fedbit*"))  # nothing left in the directory it ran in
        m = watcher.recv(10)
        assert m is not None and decode_message(m.payload) == Presence("sig1", False)
    finally:
        watcher.close()
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("bad", ["mqtt://127.0.0.1:1", "mqtts://127.0.0.1:1"])
def test_unreachable_broker_fails_after_the_timeout(bad: str) -> None:
    t = MqttTransport(bad, "x", backoff=(0.2, 0.4))
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="unreachable"):
        t.connect(timeout=1.0)
    assert time.monotonic() - t0 < 5


INT_DEVICE_SCRIPT = r"""
import sys, time
from pathlib import Path
import numpy as np
from edge_client.data import load_source
from edge_client.intnn import from_shared, init_shared, storage_grid_bits
from edge_client.codecs import encode
from edge_client.protocol import (ModelMessage, RoundAnnouncement, Update, decode_message,
                                  encode_message, tensors_digest, topic)
from edge_client.runtime import DeviceConfig, DeviceRuntime
from edge_client.transport import LocalHub
from firmware_models import get_spec
from hw_profiles import load_profile

spec = get_spec("digits_cnn")
ints = from_shared(init_shared(spec, 0), 8)
tensors = tuple(encode(q, codec="int", bits=storage_grid_bits(8), name=n)
                for q, n in zip(ints, spec.param_names()))
digest = tensors_digest(tensors)
hub = LocalHub()
hub.route(topic("j", "model", "int8"), encode_message(
    ModelMessage(1, "int8", "digits_cnn", tensors, digest)), True)
hub.route(topic("j", "round"), encode_message(RoundAnnouncement(
    "j", 1, "digits_cnn", ("pi",), time.time() + 60, {"int8": digest}, {"steps": 3})), True)
watch = hub.client("w", subscriptions=[topic("j", "update", "pi")])
watch.connect()
cfg = DeviceConfig.from_profile("pi", load_profile("raspberry-pi-4"), job="j",
                                workdir=Path(sys.argv[1]))
rt = DeviceRuntime(cfg, load_source("digits:1/8"), lambda **kw: hub.client("pi", **kw))
import threading
th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
th.start()
m = watch.recv(60)
rt.stop(); th.join(10)
u = decode_message(m.payload)
assert isinstance(u, Update) and u.round_id == 1 and u.compute_bits == 8
assert [t.codec for t in u.tensors] == ["int"] * 4, [t.codec for t in u.tensors]
print("torch loaded:", "torch" in sys.modules)
"""


def test_integer_device_round_keeps_torch_out(tmp_path: Path) -> None:
    """An Int8 device downloads the int8 variant, trains with the integer engine, sends its
    own integers, and never imports torch (docs/architecture.md#dependency-rules: a Pi
    Zero cannot afford it)."""
    out = subprocess.run([sys.executable, "-c", INT_DEVICE_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch loaded: False" in out.stdout


def test_reconnect_backoff_is_capped_and_jittered() -> None:
    a, b = MqttTransport("mqtt://127.0.0.1:1", "a", backoff=(1.0, 30.0)), MqttTransport("mqtt://127.0.0.1:1", "b")
    b.backoff = a.backoff
    da, db = [a.next_delay() for _ in range(12)], [b.next_delay() for _ in range(12)]
    for k, (x, y) in enumerate(zip(da, db, strict=True)):
        d = min(30.0, 2.0 ** k)
        assert d / 2 <= x <= d and d / 2 <= y <= d, (k, x, y)
    assert da != db                                               # two devices do not agree
    assert max(da) <= 30.0 and min(da[6:]) >= 15.0                # capped: from 2^5 s on, [15, 30]
    client = a._make_client("5")
    assert client._reconnect_wait == a._reconnect_wait            # paho waits our jittered delay


def test_a_device_gives_up_after_connect_timeout_and_ctrl_c_ends_it_at_once(tmp_path: Path) -> None:
    """No broker on the port: with --connect-timeout 2 the device exits 3, naming why; with
    --connect-timeout 0 (forever) a SIGINT ends it within 2 s, exit 130."""
    import signal
    import subprocess
    import sys

    from coordinator.ops.broker import free_port

    exe = str(Path(sys.executable).parent / "fedbit-edge")
    url = f"mqtt://127.0.0.1:{free_port()}"

    def start(dev: str, timeout: str) -> subprocess.Popen:
        return subprocess.Popen([exe, "run", "--broker", url, "--id", dev, "--profile", "desktop", "--data",
                                 "digits:1/9", "--workdir", str(tmp_path / dev), "--connect-timeout", timeout],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    gives_up, forever = start("d1", "2"), start("d2", "0")
    try:
        assert forever.stdout.readline().startswith("fedbit-edge: device d2")   # (its banner: connecting)
        time.sleep(1.0)
        t0 = time.monotonic()
        forever.send_signal(signal.SIGINT)
        assert forever.wait(timeout=10) == 130 and time.monotonic() - t0 < 2.0
        out, err = gives_up.communicate(timeout=60)
        assert gives_up.returncode == 3, err[-2000:]
        assert "gives up: no session with the broker after 2 s" in err and "unreachable" in err
    finally:
        for p in (gives_up, forever):
            if p.poll() is None:
                p.kill()
                p.wait()
