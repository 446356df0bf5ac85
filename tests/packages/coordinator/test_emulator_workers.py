"""The emulator's workers: the same seed gives the same metrics with one worker (this
process), two worker processes and Ray actors (a local Ray head started here, on
127.0.0.1 with 2 CPUs); a worker process killed mid-round makes its devices stragglers of
that round and is replaced for the next; the config's workers/cluster keys are checked."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.emulation.config import from_dict
from coordinator.emulation.emulator import Emulator
from coordinator.emulation.fleet_plan import DeviceGroup, FleetPlan, SampledShards
from coordinator.emulation.pool import WorkerPool
from coordinator.emulation.worker import RoundMessages, WorkerEvent
from coordinator.ops.logs import ProgressDisplay
from edge_client.errors import ConfigError

#: record fields measured in wall time (differ between runs by nature)
WALL = {"time", "run", "round_seconds", "wait_seconds", "collect_seconds", "aggregate_seconds", "coordinator_seconds",
        "coordinator_cpu_seconds", "eval_seconds", "announce_seconds", "handle_seconds",
        "checkpoint_seconds", "device_train_seconds", "device_wall_seconds", "health_seconds"}
#: every bitwidth group, a lossy uplink codec, and a device too slow for the deadline (int6:
#: 1e-2 s per sample / 0.08 speed: a straggler every round)
RAW = {"name": "w", "model": "mlp", "rounds": 2, "strategy": "fedavg", "transport": "inproc",
       "devices": {"raspberry-pi-4": 2, "raspberry-pi-5": 1, "raspberry-pi-zero-2w": 1, "desktop": 1},
       "data": {"partition": "dirichlet", "alpha": 0.5}, "train": {"epochs": 1, "batch": 32},
       "round": {"deadline_s": 5.0},
       "clock": {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5, "int6": 1e-2}}}


def strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL} for r in records]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    path = Path(sys.executable).parent / "ray"
    if not path.exists() and shutil.which("ray") is None:
        msg = "Ray is not installed (pip install 'fedbit[cluster]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {msg}; .ci/run installs the cluster extra")
        pytest.skip(msg)
    return str(path if path.exists() else shutil.which("ray"))


#: Ray binds its node address to the loopback interface only with this (it otherwise
#: replaces 127.0.0.1 by the machine's outward address)
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture
def ray_head() -> Iterator[str]:
    """A Ray head on 127.0.0.1 with 2 CPUs, every port free-picked, its own temp folder;
    stopped (by its process group, which it started) afterwards. Yields its address."""
    exe = ray_cli()
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="fray")  # short: Ray's socket paths live under it
    ports = {f"--{name}": str(free_port()) for name in (
        "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "runtime-env-agent-port", "metrics-export-port", "object-manager-port", "node-manager-port")}
    cmd = [exe, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2", "--node-ip-address",
           "127.0.0.1", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", tmp,
           *[x for kv in ports.items() for x in kv]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=os.environ | RAY_LOOPBACK)
    out = []
    try:
        end = time.monotonic() + 120
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if "Ray runtime started" in line:
                break
            assert time.monotonic() < end, "".join(out)
        assert proc.poll() is None, "".join(out)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left
        except ProcessLookupError:
            pass
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def test_one_worker_two_worker_processes_and_ray_give_the_same_metrics(tmp_path: Path, ray_head: str) -> None:
    """Every group's accuracy, the uplink bytes by codec, the simulated time and the
    stragglers (the Pi Zero, past the 5 s deadline) are the same whoever trains the devices."""
    one = Emulator(from_dict(RAW | {"round": RAW["round"] | {"workers": 1}}, "t"), 7, tmp_path / "one").run()
    two = Emulator(from_dict(RAW | {"round": RAW["round"] | {"workers": 2}}, "t"), 7, tmp_path / "two").run()
    assert one.info["workers"] == 1 and not one.info["processes"]
    assert two.info["workers"] == 2 and two.info["processes"] and two.info["cores"] >= 1
    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert strip(a) == strip(b)
    assert {"int6", "int8", "float32"} <= set(a[-1]["groups"]) and a[-1]["sim_time"] > 0
    assert all(r["sim_late_ids"] == ["raspberry-pi-zero-2w-0"] and r["accepted"] == 4 for r in a)
    assert set(a[-1]["uplink_bytes"]) == {"int-8", "kmeans-4", "float32-32"}
    # Ray: the command line, against the head started above (2 CPUs: 2 actors)
    cfg = tmp_path / "w.toml"
    cfg.write_text(_toml(RAW))
    proc = subprocess.run([str(Path(sys.executable).parent / "fedbit"), "emulate", str(cfg), "--out",
                           str(tmp_path / "ray"), "--quiet", "--set", "seeds=[7]", "--set", "cluster.backend=ray",
                           "--set", f"cluster.address={ray_head}"],
                          capture_output=True, text=True, timeout=300, env=os.environ | RAY_LOOPBACK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert strip(records(tmp_path / "ray")) == strip(a)
    info = json.loads((tmp_path / "ray" / "emulation.json").read_text())
    assert info["backend"] == "ray" and info["workers"] == 2 and info["cluster_cpus"] == 2
    assert "Devices trained in 2 worker(s): Ray actors" in (tmp_path / "ray" / "summary.md").read_text()


def _toml(raw: dict) -> str:
    lines, tables = [], []
    for k, v in raw.items():
        (tables if isinstance(v, dict) else lines).append((k, v))
    out = [f"{k} = {json.dumps(v)}" for k, v in lines]
    for k, v in tables:
        out.append(f"[{k}]")
        for kk, vv in v.items():
            out.append(f"{json.dumps(kk)} = " + ("{" + ", ".join(f"{json.dumps(a)} = {b!r}" for a, b in vv.items())
                                                  + "}" if isinstance(vv, dict) else json.dumps(vv)))
    return "\n".join(out) + "\n"


def test_a_worker_killed_mid_round_leaves_stragglers_and_is_replaced(tmp_path: Path) -> None:
    """Two worker processes; one is SIGKILLed as round 2 starts. The round closes without
    waiting for the wall timeout, the devices it trained are its stragglers (failed on
    the simulated clock), and round 3 has every device again, from a new process."""
    raw = {"name": "k", "model": "digits_cnn", "rounds": 3, "strategy": "fedavg", "transport": "inproc",
           "devices": {"raspberry-pi-4": 4}, "data": {"partition": "iid"}, "train": {"steps": 150, "batch": 32},
           "round": {"workers": 2, "deadline_s": 0.0, "wall_timeout_s": 120.0},
           "clock": {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5}}}
    killed: dict[str, object] = {}
    progress: list[dict] = []

    def on_event(event: str, f: dict) -> None:
        if event == "devices":
            progress.append(f)
        if event == "round_start" and f["round"] == 2:
            pool = emu.pool
            assert pool is not None
            victim = pool.handles[1]
            killed["pid"] = victim.pid
            killed["devices"] = sorted(d for d, w in pool.assignment().items() if w == 1)
            os.kill(victim.pid, signal.SIGKILL)

    emu = Emulator(from_dict(raw, "t"), 0, tmp_path / "run", on_event=on_event)
    t0 = time.monotonic()
    hist = emu.run().history
    assert time.monotonic() - t0 < 100  # never the 120 s wall timeout
    r1, r2, r3 = hist
    assert r1["accepted"] == 4 and r3["accepted"] == 4 and r3["stragglers"] == 0
    assert len(killed["devices"]) == 2
    # (killed as the round starts: long before its devices' 150 steps are done)
    assert r2["straggler_ids"] == killed["devices"] == r2["sim_failed_ids"]
    assert r2["accepted_ids"] == sorted(set(r1["accepted_ids"]) - set(killed["devices"])) and r2["aggregated"]
    info = json.loads((tmp_path / "run" / "emulation.json").read_text())
    assert info["workers_lost"] == 1
    # the progress display's events: devices done (2 of them failed) and workers busy
    assert {"round": 2, "started": 4, "done": 4, "failed": 2, "workers": 2, "busy": 0} in progress
    assert any(p["round"] == 3 and p["busy"] >= 1 and p["done"] < 4 for p in progress)
    assert emu.pool.handles[1].pid != killed["pid"]


def test_the_progress_display_shows_devices_done_and_workers_busy() -> None:
    stream = io.StringIO()
    stream.isatty = lambda: True  # type: ignore[method-assign]
    show = ProgressDisplay(3, stream)
    show("devices", {"round": 2, "started": 10, "done": 7, "failed": 1, "workers": 2, "busy": 1})
    assert "round 2: 7/10 devices done, 1 failed, 1/2 workers busy" in stream.getvalue()


@pytest.mark.parametrize("key,value,why", [
    ("round.workers", -1, "must be >= 0"),
    ("cluster.backend", "dask", "is not 'local' or 'ray'"),
    ("cluster.address", "somewhere", "expected"),
])
def test_workers_and_cluster_settings_are_checked(key: str, value: object, why: str) -> None:
    sec, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"{key}.*{why}"):
        from_dict(RAW | {sec: RAW.get(sec, {}) | {name: value}}, "t")


class _FakeHandle:
    """A worker that answers at once: every device sends ``b"u:<id>"`` and ends."""

    def __init__(self, index: int, pool, tag: str) -> None:
        self.index, self.pool, self.tag = index, pool, tag
        self.rounds: list[list[str]] = []

    def submit(self, msgs, devices) -> None:
        self.rounds.append([d.device_id for d in devices])
        for d in devices:
            self.pool.on_event(self, WorkerEvent("update", msgs.round_id, d.device_id, f"u:{d.device_id}".encode()))
            self.pool.on_event(self, WorkerEvent("end", msgs.round_id, d.device_id, state="done"))

    def stop(self) -> None:
        pass

    def describe(self) -> str:
        return self.tag


class _FakeBackend:
    def __init__(self, tag: str) -> None:
        self.tag, self.name, self.closed, self.started = tag, tag, False, []

    def start(self, index: int, pool) -> _FakeHandle:
        self.started.append(_FakeHandle(index, pool, self.tag))
        return self.started[-1]

    def share(self, msgs):
        return msgs

    def close(self) -> None:
        self.closed = True

    def describe(self) -> dict:
        return {"backend": self.tag}


def test_auto_workers_move_to_processes_after_a_heavy_round_and_relay_every_update(tmp_path: Path) -> None:
    """workers = 0: rounds stay in this process while they are light; after one that took
    more CPU than the threshold the worker processes are started and take the next round,
    balanced; every update goes out unchanged on its device's topic."""
    from hw_profiles import load_profile

    plan = FleetPlan([DeviceGroup(load_profile("raspberry-pi-4"), "int", 8, 6, 0, True)], SampledShards(100, 4, 0), 0,
                     "job", tmp_path)
    published: list[tuple[str, bytes]] = []

    class Relay:
        def publish(self, t: str, payload: bytes, **kw) -> bool:
            published.append((t, payload))
            return True

    here, procs = _FakeBackend("here"), _FakeBackend("procs")
    pool = WorkerPool(plan, here, 1, Relay(), "job", grow=lambda: (procs, 2), grow_after_cpu_s=0.25)
    ids = sorted(plan.ids())
    msgs = RoundMessages(1, {}, b"", b"")
    pool.activate(1, ids, msgs)
    pool.on_round_cpu(pool.handles[0], 0.1)  # light: nothing starts
    assert not procs.started and pool.progress().done == 6 and not pool.failed(ids[0], 1)
    pool.activate(2, ids, msgs)
    pool.on_round_cpu(pool.handles[0], 0.9)
    end = time.monotonic() + 10
    while len(procs.started) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    pool.activate(3, ids, msgs, costs={d: float(i + 1) for i, d in enumerate(ids)})
    assert pool.grown_at == 3 and [h.tag for h in pool.handles] == ["procs", "procs"]
    shares = [h.rounds[-1] for h in pool.handles]
    assert sorted(shares[0] + shares[1]) == ids and abs(len(shares[0]) - len(shares[1])) <= 1
    assert here.started[0].rounds == [ids, ids]
    expected = [(f"fedbit/job/update/{d}", f"u:{d}".encode()) for d in ids]
    assert published[:12] == expected * 2 and sorted(published[12:]) == expected
    assert pool.describe() == {"workers": 2, "backend": "procs", "auto": True, "processes_from_round": 3}
    pool.close()
    assert here.closed and procs.closed
