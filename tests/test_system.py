"""The running system: ``fedbit serve`` and ``fedbit-edge run`` as real subprocesses over
real brokers on loopback (embedded mosquitto, embedded amqtt, a mosquitto started here)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from conftest import wait_for

from coordinator.ops.broker import free_port
from coordinator.state import RunState
from edge_client.intnn import init_shared
from edge_client.protocol import (
    Status,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    topic,
)
from edge_client.transport import MqttTransport
from firmware_models import get_spec

BIN = Path(sys.executable).parent
MODEL = "mlp"
FLEET = ["raspberry-pi-4", "raspberry-pi-4", "raspberry-pi-4", "desktop"]  # Int8 + float32
# two cores shared by five processes: one thread each keeps start-up contention down
ENV = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1"}


class Procs:
    """Subprocesses started by a test; every one is ended by PID in ``close``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.items: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.tmp / f"{name}.out", "wb")  # noqa: SIM115
        err = open(self.tmp / f"{name}.err", "wb")  # noqa: SIM115
        p = subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=out, stderr=err,
                             env=ENV)
        p.name = name  # type: ignore[attr-defined]
        self.items.append(p)
        return p

    def text(self, name: str, stream: str = "out") -> str:
        return (self.tmp / f"{name}.{stream}").read_text(errors="replace")

    def close(self) -> None:
        for p in self.items:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.items:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def serve_args(out: Path, *extra: str, rounds: int = 3, devices: int = 4) -> list[str]:
    return ["fedbit", "serve", "--model", MODEL, "--rounds", str(rounds), "--strategy", "fedavg",
            "--out", str(out), "--job", "sys", "--min-devices", str(devices), "--round-timeout", "60",
            "--presence-timeout", "60", "--steps", "8", "--log-json", *extra]


def start_devices(procs: Procs, url: str, tmp: Path, fleet=FLEET, extra=None) -> list[subprocess.Popen]:
    out = []
    for i, prof in enumerate(fleet):
        dev = f"dev{i + 1}"
        args = ["fedbit-edge", "run", "--broker", url, "--profile", prof, "--data",
                f"digits:{i + 1}/{len(fleet)}", "--id", dev, "--job", "sys", "--seed", str(i),
                "--workdir", str(tmp / dev), "--max-seconds", "100", *((extra or {}).get(dev, []))]
        out.append(procs.start(dev, *args))
    return out


def embedded_url(procs: Procs, name: str) -> str:
    def find():
        for line in procs.text(name).splitlines():
            if line.startswith("broker: mqtt://"):
                return line.split()[1]
        return None
    return wait_for(find, 30, "the embedded broker URL")


def check_run(out: Path, rounds: int, devices: int) -> list[dict]:
    st = RunState(out)
    lines = st.read_metrics()
    assert [m["round"] for m in lines] == list(range(1, rounds + 1))
    for m in lines:
        assert m["accepted"] == devices and len(set(m["accepted_ids"])) == devices
        assert m["weight_change_l2"] > 0
        assert isinstance(m["accuracy"], float) and 0.0 <= m["accuracy"] <= 1.0
    ck = st.load_checkpoint()
    assert ck is not None and ck.completed_round == rounds
    init = init_shared(get_spec(MODEL), 0)
    assert any(not np.array_equal(a, b) for a, b in zip(ck.weights, init, strict=True))
    return lines


def finish(procs: Procs, coord: subprocess.Popen, devs: list[subprocess.Popen], timeout: float = 90) -> None:
    try:
        rc = coord.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("coordinator did not finish:\n" + procs.text(coord.name, "err")[-3000:]) from None
    assert rc == 0, procs.text(coord.name, "err")[-3000:]
    for d in devs:
        assert d.wait(timeout=30) == 0, procs.text(d.name, "err")[-2000:]


def test_three_rounds_over_the_embedded_broker(procs: Procs, tmp_path: Path) -> None:
    """Without --broker, serve starts the default embedded broker (mosquitto when on PATH,
    else amqtt; the amqtt path is covered in-process by test_fleet.py) and prints its URL."""
    out = tmp_path / "run"
    port = free_port()
    coord = procs.start("coord", *serve_args(out, "--port", str(port)))
    # devices start at once and retry with backoff until the broker is up
    devs = start_devices(procs, f"mqtt://127.0.0.1:{port}", tmp_path)
    assert embedded_url(procs, "coord") == f"mqtt://127.0.0.1:{port}"
    finish(procs, coord, devs)
    check_run(out, 3, 4)
    text = procs.text("coord")
    want = "mosquitto" if shutil.which("mosquitto") else "amqtt"
    assert f"(embedded {want};" in text
    for d in ("dev1", "dev4"):
        assert "stopped after 3 round(s)" in procs.text(d)
    # the ONNX export of every bitwidth variant of the final model (Int8 and float32 here)
    if importlib.util.find_spec("onnx") is not None:
        from edge_client.predict import load_model

        assert sorted(p.name for p in (out / "onnx").iterdir()) == ["float32.onnx", "int8.onnx"]
        assert load_model(out / "onnx" / "int8.onnx").variant == "int8"
    else:
        assert "no ONNX export" in procs.text("coord", "err")


def _nan_update(dev: str, r: int) -> bytes:
    shapes = get_spec(MODEL).param_shapes()
    good = encode_message(Update(dev, r, 5, 32, "weights",
                                 tuple(float32_tensor(np.zeros(s, np.float32)) for s in shapes)))
    body = msgpack.unpackb(good, raw=False)
    body["tensors"][1]["data"] = np.full(int(np.prod(shapes[1])), np.inf, "<f4").tobytes()
    return msgpack.packb(body, use_bin_type=True)


def test_three_rounds_over_mosquitto_with_bad_updates(mosquitto, procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "run"
    coord = procs.start("coord", *serve_args(out, "--broker", mosquitto.url, "--max-payload", "200000"))
    devs = start_devices(procs, mosquitto.url, tmp_path)
    # (the rejections below do not depend on the round they land in)
    evil = MqttTransport(mosquitto.url, "evil", subscriptions=[topic("sys", "status")])
    evil.connect(10)
    try:
        def waiting():
            m = evil.recv(0.2)
            return m is not None and isinstance(decode_message(m.payload), Status) and \
                decode_message(m.payload).state == "waiting"
        wait_for(waiting, 30, "the coordinator's waiting status")
        shapes = get_spec(MODEL).param_shapes()
        ok = encode_message(Update("dev1", 1, 5, 32, "weights",
                                   tuple(float32_tensor(np.zeros(s, np.float32)) for s in shapes)))
        up = topic("sys", "update", "dev1")
        for payload, t in [(b"\xc1\xc1 garbage", up),                                  # malformed
                           (ok, topic("sys", "update", "dev2")),                       # spoofed
                           (encode_message(Update("dev1", 9, 5, 32, "weights", decode_message(ok).tensors)), up),  # wrong round
                           (b"\x00" * 300_000, up),                                    # oversized
                           (_nan_update("dev1", 1), up)]:                              # Inf
            assert evil.publish(t, payload, timeout=5)
    finally:
        evil.close()
    finish(procs, coord, devs)
    lines = check_run(out, 3, 4)
    total: dict[str, int] = {}
    for m in lines:
        for k, v in m["counts"].items():
            total[k] = total.get(k, 0) + v
    for reason in ("malformed", "spoofed", "wrong_round", "oversized", "nonfinite"):
        assert total.get(f"rejected_{reason}") == 1, (reason, total)
    logged = [json.loads(ln) for ln in procs.text("coord", "err").splitlines() if ln.startswith("{")]
    reasons = {r.get("reason") for r in logged if r.get("event") == "reject"}
    assert {"malformed", "spoofed", "wrong_round", "oversized", "nonfinite"} <= reasons


def test_kill9_mid_round_then_resume(mosquitto, procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = serve_args(out, "--broker", mosquitto.url, rounds=3, devices=3)
    coord = procs.start("coord1", *args)
    # dev3 is slow: round 2 stays open ~3 s after dev1/dev2 answered
    devs = start_devices(procs, mosquitto.url, tmp_path, fleet=FLEET[:3],
                         extra={"dev3": ["--delay", "3"]})
    st = RunState(out)
    wait_for(lambda: len(st.read_metrics()) == 1, 60, "round 1")
    wait_for(lambda: len(RunState(out).inbox_items(2)) >= 2, 30, "two updates of round 2 in the inbox")
    coord.send_signal(signal.SIGKILL)
    coord.wait(timeout=10)
    persisted = sorted(d for d, _ in RunState(out).inbox_items(2))
    assert len(st.read_metrics()) == 1 and st.load_checkpoint().completed_round == 1
    assert "dev3" not in persisted                    # the round was open when it died
    coord2 = procs.start("coord2", *args, "--resume")
    finish(procs, coord2, devs)
    lines = st.read_metrics()
    assert [m["round"] for m in lines] == [1, 2, 3]   # none repeated, none skipped
    r2 = lines[1]
    assert r2["resumed"] and r2["replayed"] == len(persisted)
    assert set(persisted) <= set(r2["accepted_ids"])
    assert r2["accepted_ids"] == ["dev1", "dev2", "dev3"] and r2["accepted"] == 3
    for m in lines:
        assert m["accepted"] == len(set(m["accepted_ids"])) == 3


def test_serve_stops_on_sigterm_and_takes_its_broker_down(procs: Procs, tmp_path: Path) -> None:
    from coordinator.ops.broker import wait_for_port

    port = free_port()
    coord = procs.start("coord", *serve_args(tmp_path / "run", "--port", str(port)))
    url = embedded_url(procs, "coord")
    watch = MqttTransport(url, "watch", subscriptions=[topic("sys", "status")])
    watch.connect(10)
    try:
        def status():
            m = watch.recv(0.2)
            return decode_message(m.payload).state if m is not None and m.payload else None
        assert wait_for(status, 30, "the coordinator's status") == "waiting"
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=20) == 128 + signal.SIGTERM
        assert wait_for(status, 10, "the error status") == "error"   # said so before leaving
    finally:
        watch.close()
    err = procs.text("coord", "err")
    assert "Traceback" not in err   # one line: where it stopped, how to go on
    last = err.strip().splitlines()[-1]
    assert last.startswith("fedbit serve: stopped by SIGTERM ") and "before round 1; `fedbit serve --model mlp " in last
    assert err.strip().endswith("--resume` goes on")
    assert not wait_for_port("127.0.0.1", port, timeout=1.0)         # the broker is gone too


def test_secure_rounds_with_distributed_dp_over_mosquitto(mosquitto, procs: Procs, tmp_path: Path) -> None:
    """fedbit serve --secure-aggregation --dp distributed with fedbit-edge devices (Int8 and
    float32) over a real broker: every round is a SecAgg+ round whose devices talk to each
    other only sealed, through the coordinator; ε after every round in metrics.jsonl."""
    out = tmp_path / "run"
    coord = procs.start("coord", *serve_args(out, "--broker", mosquitto.url, "--secure-aggregation", "--dp",
                                             "distributed", "--dp-clip", "0.5", "--noise-multiplier", "0.8",
                                             rounds=1))
    devs = start_devices(procs, mosquitto.url, tmp_path)
    finish(procs, coord, devs)
    lines = check_run(out, 1, 4)
    assert [m["secagg_survivors"] for m in lines] == [4] and all(not m["secagg_excluded"] for m in lines)
    assert 0 < lines[0]["epsilon"] < 100 and lines[0]["delta"] == 1e-5 and lines[0]["noise_multiplier"] == pytest.approx(0.8)
    assert all(m["uplink_bytes"]["secagg-masked"] > 0 and set(m["uplink_bytes"]) == {"secagg-masked", "secagg-protocol"}
               for m in lines)
    assert all((tmp_path / d / "secagg-identity").stat().st_mode & 0o777 == 0o600 for d in ("dev1", "dev4"))
