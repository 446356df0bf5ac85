"""Stopping ``fedbit serve`` and ``fedbit emulate`` with a signal: no traceback, one line
saying where it stopped and the ``--resume`` command, the shell's exit status, brokers
stopped; the printed command goes on and completes the job.

``fedbit serve`` runs as a real subprocess in a session of its own, interrupted as a
terminal's Ctrl-C does (SIGINT to the whole process group, its embedded mosquitto
included), against scripted devices over that broker (float32 updates, no training).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
from conftest import wait_for

from coordinator.ops.broker import free_port, wait_for_port
from coordinator.state import RunState
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
from edge_client.transport import MqttTransport
from firmware_models import get_spec

BIN = Path(sys.executable).parent
JOB = "stops"
ENV = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


class ScriptedDevice:
    """A float32 device over MQTT that answers every announcement of a round it is selected
    for (the initial model plus 0.01), unless ``hold`` holds that round back."""

    def __init__(self, url: str, dev: str, hold: set[int]) -> None:
        self.dev, self.hold, self.answered = dev, hold, set()
        self.announced: set[int] = set()
        birth = [(topic(JOB, "presence", dev), encode_message(Presence(dev, True)), True),
                 (topic(JOB, "hello", dev), encode_message(Hello(dev, "p", 32, "torch", "float32", 32, 9, "0")), True)]
        self.t = MqttTransport(url, dev, birth=birth, subscriptions=[topic(JOB, "round")], backoff=(0.2, 1.0),
                               will=(topic(JOB, "presence", dev), encode_message(Presence(dev, False))))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        weights = [w + np.float32(0.01) for w in init_shared(get_spec("mlp"), 0)]
        while not self.stop.is_set():
            try:
                self.t.connect(timeout=1.0, cancel=self.stop)
                break
            except ConnectionError:
                continue
        while not self.stop.is_set():
            m = self.t.recv(0.1)
            a = decode_message(m.payload) if m is not None and m.payload else None
            if not isinstance(a, RoundAnnouncement) or self.dev not in a.selected:
                continue
            self.announced.add(a.round_id)
            if a.round_id not in self.hold:  # (again when announced again: a resumed coordinator)
                up = Update(self.dev, a.round_id, 9, 32, "weights", tuple(float32_tensor(w) for w in weights))
                if self.t.publish(topic(JOB, "update", self.dev), encode_message(up), timeout=5):
                    self.answered.add(a.round_id)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.t.close()


def serve(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=f, stderr=subprocess.STDOUT, env=ENV,
                                start_new_session=True)


def test_serve_sigint_mid_round_then_the_printed_resume_command_completes_the_job(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "run"
    args = ["fedbit", "serve", "--model", "mlp", "--rounds", "2", "--strategy", "fedavg", "--out", str(out),
            "--job", JOB, "--min-devices", "2", "--round-timeout", "60", "--presence-timeout", "60",
            "--port", str(port)]
    hold = {2}
    devs = [ScriptedDevice(f"mqtt://127.0.0.1:{port}", d, hold if d == "d2" else set()) for d in ("d1", "d2")]
    procs = [serve(args, tmp_path / "serve1.log")]
    try:
        st = RunState(out)
        wait_for(lambda: len(st.read_metrics()) == 1 and 2 in devs[1].announced and 2 in devs[0].answered, 90,
                 "round 2 announced, d1's update sent, d2 holding back")
        wait_for(lambda: len(st.inbox_items(2)) == 1, 10, "d1's round-2 update in the inbox")
        os.killpg(procs[0].pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert procs[0].wait(30) == 128 + signal.SIGINT
        text = (tmp_path / "serve1.log").read_text()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        last = text.strip().splitlines()[-1]
        assert last.startswith("fedbit serve: stopped by SIGINT during round 2 (1 round(s) complete); `"), last
        assert not wait_for_port("127.0.0.1", port, timeout=0.5)  # the embedded broker is stopped
        resume = shlex.split(last.split("`")[1])
        assert resume[:2] == ["fedbit", "serve"] and resume[-1] == "--resume"
        hold.clear()  # d2 answers round 2 once it is announced again
        procs.append(serve(resume, tmp_path / "serve2.log"))
        assert procs[1].wait(90) == 0, (tmp_path / "serve2.log").read_text()[-3000:]
        text = (tmp_path / "serve2.log").read_text()
        assert "Traceback" not in text, text[-3000:]
        lines = st.read_metrics()
        assert [m["round"] for m in lines] == [1, 2]
        assert lines[1]["resumed"] and lines[1]["replayed"] == 1 and lines[1]["accepted_ids"] == ["d1", "d2"]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for d in devs:
            d.close()


def test_emulate_sigint_mid_round_says_where_and_the_resume_command_completes_the_run(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """In-process: SIGINT arrives at the start of round 2 (signal.raise_signal, handled as a
    real one); the run folder is then finished by the printed ``--resume`` command."""
    from coordinator.cli import main
    from coordinator.cli.common import StopPoint

    cfg = tmp_path / "tiny.toml"
    cfg.write_text('name = "tiny"\nmodel = "mlp"\nrounds = 2\ntransport = "inproc"\n[devices]\ndesktop = 2\n'
                   '[data]\npartition = "iid"\n[round]\nworkers = 1\n[clock]\nseconds_per_sample = {float32 = 1e-4}\n')
    seen = StopPoint.__call__

    def interrupting(self, event, f):
        seen(self, event, f)
        if event == "round_start" and f["round"] == 2:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(StopPoint, "__call__", interrupting)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["emulate", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 128 + signal.SIGINT
        err = capsys.readouterr().err
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("fedbit emulate: stopped by SIGINT during round 2 (1 round(s) complete); `"), last
        resume = shlex.split(last.split("`")[1])
        assert resume == ["fedbit", "emulate", str(cfg), "--out", str(tmp_path / "run"), "--quiet", "--resume"]
        monkeypatch.setattr(StopPoint, "__call__", seen)
        assert main(resume[1:]) == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert "Traceback" not in capsys.readouterr().err
    assert [m["round"] for m in RunState(tmp_path / "run" / "out").read_metrics()] == [1, 2]
