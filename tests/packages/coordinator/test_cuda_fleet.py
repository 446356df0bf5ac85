"""The fleet on one GPU: ``edge_client.intnn.cuda.fleet`` trains many ``IntTrainer`` s as
one stack (each device its own weights, shard, short last batch, step count, FedProx
term) with the results each gets alone on the CPU; ``round.engine = "cuda"`` in the
emulator gives the CPU emulator's metrics and update bytes for the same seed (a mixed
fleet: Int8 and Int16 devices in the GPU batch, a float device on the CPU). Under
Numba's CUDA simulator here (tests/conftest.py), a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.emulation.config import from_dict
from coordinator.emulation.emulator import Emulator
from coordinator.emulation.pool import WorkerPool
from edge_client.data import Dataset
from edge_client.errors import ConfigError
from edge_client.intnn.cuda.fleet import FleetJob, ResidentData, train_together
from edge_client.protocol import decode_message
from edge_client.trainers import IntTrainer
from firmware_models import resolve_model

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

#: 8x8 digits through a strided conv, a max-pool and a linear layer (tiny: the simulator)
TINY = """name = "tiny"
input = [1, 8, 8]
layers = [
  {type = "conv2d", out = 2, kernel = 3, stride = 2, padding = 1}, {type = "relu"},
  {type = "maxpool2d", kernel = 2}, {type = "flatten"}, {type = "linear", out = 10},
]
"""

WALL = {"time", "run", "round_seconds", "wait_seconds", "collect_seconds", "aggregate_seconds", "coordinator_seconds",
        "coordinator_cpu_seconds", "eval_seconds", "announce_seconds", "handle_seconds",
        "checkpoint_seconds", "device_train_seconds", "device_wall_seconds", "health_seconds"}


def test_devices_trained_together_end_as_each_alone(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    spec = resolve_model(str(path))
    rng = np.random.default_rng(0)
    x = rng.random((12, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 12)
    shards = [np.array([0, 3, 5, 7, 9]), np.array([1, 2, 11]), np.array([4, 6, 8, 10])]
    kw = [dict(steps=3, batch=2), dict(epochs=1, batch=2, prox_mu=0.5), dict(steps=1, batch=4)]
    bits = [8, 8, 16]
    alone, together, jobs = [], [], []
    for i, shard in enumerate(shards):
        data = Dataset(x[shard], y[shard])
        a = IntTrainer(spec, bits[i], seed=i + 1)
        b = IntTrainer(spec, bits[i], seed=i + 1)
        alone.append((a, a.train(data, **kw[i])))
        together.append(b)
        jobs.append(FleetJob(b, b.plan(data, **kw[i]), shard))
    reports = train_together(jobs, ResidentData(x))
    for (a, ra), b, rb in zip(alone, together, reports, strict=True):
        assert (ra.steps, ra.samples, ra.loss) == (rb.steps, rb.samples, rb.loss)
        assert b.step_count == a.step_count
        assert all(u.tobytes() == v.tobytes() for u, v in zip(a.int_weights(), b.int_weights(), strict=True))


def _config(model: str, engine: str) -> dict[str, Any]:
    return {"name": engine, "model": model, "rounds": 2, "strategy": "fedavg", "transport": "inproc",
            "devices": {"raspberry-pi-4": 2, "jetson-nano": 1, "desktop": 1},
            "data": {"partition": "iid"}, "train": {"steps": 2, "batch": 4},
            "round": {"workers": 1, "engine": engine},
            "clock": {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5, "int16": 4e-5}}}


def test_the_emulator_on_the_gpu_gives_the_cpu_emulators_metrics_and_updates(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    sent: dict[str, list[tuple[str, bytes]]] = {}
    engine = ["cpu"]
    publish = WorkerPool._publish

    def record(self: WorkerPool, device_id: str, payload: bytes) -> bool:
        sent.setdefault(engine[0], []).append((device_id, payload))
        return publish(self, device_id, payload)

    monkeypatch.setattr(WorkerPool, "_publish", record)
    runs = {}
    for e in ("cpu", "cuda"):
        engine[0] = e
        cfg = from_dict(_config(str(tmp_path / "tiny.toml"), e), str(tmp_path / "x.toml"))
        Emulator(cfg, 3, tmp_path / e).run()
        runs[e] = [{k: v for k, v in json.loads(line).items() if k not in WALL}
                   for line in (tmp_path / e / "out" / "metrics.jsonl").read_text().splitlines()]
    assert runs["cpu"] == runs["cuda"] and len(runs["cpu"]) == 2
    assert {"int8", "int16", "float32"} <= set(runs["cpu"][-1]["groups"])

    def updates(e: str) -> dict[tuple[str, int], list[bytes]]:
        out = {}
        for dev_id, payload in sent[e]:
            u = decode_message(payload)
            out[(dev_id, u.round_id)] = [(t.name, t.data) for t in u.tensors] + [u.train_loss, u.num_samples]
        return out

    assert updates("cpu") == updates("cuda") and len(updates("cpu")) == 8


def test_the_engine_key_is_checked() -> None:
    with pytest.raises(ConfigError, match="engine: 'tpu' is not 'cpu' or 'cuda'"):
        from_dict({"devices": {"raspberry-pi-4": 1}, "round": {"engine": "tpu"}}, "t.toml")
