"""A whole fleet on one machine: real device runtimes, a real coordinator, simulated links.

:class:`Emulator` runs one experiment (``coordinator.emulation.config.ExperimentConfig``) for one
seed. Every emulated device runs the real :class:`edge_client.runtime.DeviceRuntime` (the
code a Pi runs: download, train with its profile's trainer, encode with its codec,
publish), over a real broker (``transport = "mqtt"``: the embedded one, or ``broker``) or
the in-process hub (``transport = "inproc"``: the same bytes, no sockets), against the
real :class:`~coordinator.server.Coordinator`.

**Devices cost what the selected ones cost.** Every registered device's hello and
presence are published once (retained), so the coordinator sees the whole fleet; a
device's runtime runs only in the rounds it is selected in (:class:`DeviceHost`: one
thread per selected device, ``DeviceConfig(max_rounds=1)``, at most ``round.parallel``
training at once), on its shard of the training split (an index array until then).

**Simulated clock.** Devices train as fast as this machine allows; the round's time is
simulated (:class:`SimLinks`): a device's update arrives at

    download (model bytes / downlink + latency) + compute (samples trained x the seconds
    per sample of its variant on this machine / relative_speed) + upload (update bytes /
    uplink + latency)

after the round starts, in simulated seconds, and is lost with probability ``loss_rate``
(a dropout: the device is not even started). :class:`EmulatedFleet` holds the round's
updates until every started device has answered (or failed), then hands the coordinator
the first ``ceil(quorum x selected)`` that arrive within the simulated ``deadline_s``, in
device-id order (so the aggregate does not depend on thread timing), and tells it that
nothing more will come (:meth:`Fleet.more_expected`); later ones are stragglers. Nothing
sleeps for simulated seconds. The seconds per sample are measured once per variant at
start-up (``calibrate``), or pinned by the config (``[clock] seconds_per_sample``) for
bit-reproducible runs. The coordinator's own time is not part of the simulated round.

**Seeds.** The run seed picks the data split, the coordinator's initial model and
selections, and each device's seed (a hash of the run seed and its id; its stochastic
rounding stream in round r is keyed by both), so the same seed gives the same metrics.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.emulation.clock import EmulatedFleet, SimLinks, calibrate, one_thread_torch
from coordinator.emulation.config import ExperimentConfig
from coordinator.emulation.datasets import DataSplit, class_counts, load_dataset
from coordinator.emulation.emulator import DeviceHost, EmulatedDevice, build_fleet
from coordinator.fleet import Fleet, InProcessFleet, MqttFleet
from edge_client.protocol import (
    FLOAT_VARIANT,
)

log = logging.getLogger("fedbit.emulator")




@dataclass
class RunResult:
    """What one emulated run left: its folder and metrics records."""

    run_dir: Path
    history: list[dict[str, Any]]
    info: dict[str, Any]


class Emulator:
    """One experiment run for one seed (see the module docstring).

    Args:
        cfg: the experiment.
        seed: the run seed.
        run_dir: the run folder (created): ``out/`` the coordinator's run state
            (``metrics.jsonl``, checkpoint), ``devices/`` the started devices' work
            folders, ``emulation.json`` the fleet, split and clock.
        on_event: the coordinator's progress callback.
    """

    def __init__(self, cfg: ExperimentConfig, seed: int, run_dir: str | Path, *,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        self.run_dir = Path(run_dir)
        self.on_event = on_event

    def run(self) -> RunResult:
        from coordinator.config import ServerConfig
        from coordinator.evaluate import evaluator_for
        from coordinator.server import Coordinator
        from coordinator.state import RunState
        from coordinator.strategies import build_strategy
        from edge_client.intnn import init_shared
        from firmware_models import resolve_model

        cfg, seed = self.cfg, self.seed
        self.run_dir.mkdir(parents=True, exist_ok=True)
        one_thread_torch()
        t_start = time.monotonic()
        job = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{cfg.name}-s{seed}")[:64]
        data = load_dataset(cfg.data["dataset"], cfg.data["path"] or None,
                            validation=float(cfg.data["validation"]), seed=int(cfg.data["seed"]))
        devices = build_fleet(cfg, seed, data, self.run_dir / "devices", job)
        variants = sorted({d.variant for d in devices} | {FLOAT_VARIANT})
        pinned = {str(k): float(v) for k, v in cfg.clock["seconds_per_sample"].items()}
        missing = [v for v in variants if v not in pinned]
        measured = calibrate(cfg.model, missing, data.train.subset(np.arange(min(64, len(data.train))))) \
            if missing else {}
        sps = pinned | measured
        info = self._describe(devices, data, sps, measured)
        (self.run_dir / "emulation.json").write_text(json.dumps(info, indent=1))
        rnd = cfg.round
        strategy = build_strategy(cfg.strategy, model=cfg.model, **cfg.build_params())
        server_cfg = ServerConfig(
            job=job, model=cfg.model, rounds=cfg.rounds, strategy=cfg.strategy,
            strategy_params=cfg.build_params(), fraction=float(rnd["fraction"]), min_devices=1,
            max_devices=len(devices), min_present=len(devices), quorum=float(rnd["quorum"]),
            min_updates=int(rnd["min_updates"]), round_timeout_s=float(rnd["wall_timeout_s"]),
            presence_timeout_s=max(120.0, float(rnd["wall_timeout_s"])), hparams=dict(cfg.train), seed=seed)
        broker, inner, connect, registrar = self._transport(job)
        info["broker"] = (f"embedded {broker.kind} at {broker.url}" if broker is not None
                          else self.cfg.broker or "in-process hub")
        try:
            host = DeviceHost(devices, data.train, connect, slots=int(rnd["parallel"]),
                              wall_timeout_s=float(rnd["wall_timeout_s"]))
            links = SimLinks({d.device_id: d for d in devices}, sps, seed)
            fleet = EmulatedFleet(inner, host, links, quorum=float(rnd["quorum"]),
                                  deadline_s=float(rnd["deadline_s"]), wall_timeout_s=float(rnd["wall_timeout_s"]))
            registrar.connect(timeout=30.0)
            host.register(registrar)
            coord = Coordinator(server_cfg, fleet, strategy, RunState(self.run_dir / "out"),
                                evaluator=evaluator_for(cfg.model, data.test, strategy.device_hparams(cfg.train),
                                                        seed=seed, validation=data.validation),
                                init_weights=init_shared(resolve_model(cfg.model), seed), on_event=self.on_event,
                                logger=log.getChild("server"))
            history = coord.run()
            host.join()
            fleet.close()
            registrar.close()
        finally:
            if broker is not None:
                broker.stop()
        info["onnx"] = _export(self.run_dir / "out")
        info["wall_seconds"] = time.monotonic() - t_start
        info["sim_seconds"] = fleet.sim_time
        (self.run_dir / "emulation.json").write_text(json.dumps(info, indent=1))
        return RunResult(self.run_dir, history, info)

    def _transport(self, job: str) -> tuple[Any, Fleet, Callable[[str], Callable[..., Any]], Any]:
        """(broker or None, the coordinator's fleet, device connector, the registrar's
        transport) for ``transport = inproc | mqtt``."""
        if self.cfg.transport == "inproc":
            inner = InProcessFleet(job)
            return None, inner, inner.device_connector, inner.hub.client("fedbit-emulator")
        from coordinator.ops.broker import start_embedded_broker
        from edge_client.transport import MqttTransport

        broker = None
        url = self.cfg.broker
        if not url:
            broker = start_embedded_broker()
            url = broker.url
        inner = MqttFleet(url, job, client_id=f"fedbit-coordinator-{job}-{self.seed}", username="fedbit-coordinator")

        def connect(dev_id: str) -> Callable[..., Any]:
            return lambda **kw: MqttTransport(url, dev_id, **kw)

        return broker, inner, connect, MqttTransport(url, f"fedbit-emulator-{job}")

    def _describe(self, devices: list[EmulatedDevice], data: DataSplit, sps: dict[str, float],
                  measured: dict[str, float]) -> dict[str, Any]:
        counts = class_counts([d.shard for d in devices], data.train.y, data.num_classes)
        by_profile = Counter(d.profile.name for d in devices)
        return {
            "config": self.cfg.as_dict(), "paper_stage_params": dict(self.cfg.paper_stage_params),
            "source": self.cfg.source, "seed": self.seed,
            "dataset": data.name, "train_samples": len(data.train), "test_samples": len(data.test),
            "validation_samples": len(data.validation) if data.validation is not None else 0,
            "seconds_per_sample": sps, "calibrated": sorted(measured),
            "profiles": {p: {"count": n, **{k: v for k, v in asdict(next(
                d.profile for d in devices if d.profile.name == p)).items() if k != "notes"}}
                for p, n in by_profile.items()},
            "devices": [{"id": d.device_id, "profile": d.profile.name, "variant": d.variant,
                         "codec": f"{d.config.codec}-{d.config.codec_bits}", "inferior": d.inferior,
                         "samples": len(d.shard), "class_counts": counts[i].tolist()}
                        for i, d in enumerate(devices)],
        }


def _export(run_dir: Path) -> list[str] | str:
    """The ONNX export of every bitwidth variant of the final model into ``RUN_DIR/onnx/``,
    as ``fedbit serve`` writes it (the paths; or why not: onnx missing, an export error)."""
    import importlib.util

    if importlib.util.find_spec("onnx") is None:
        return "skipped: onnx is not installed (pip install 'fedbit[onnx]')"
    from coordinator.ops.export import export_run

    try:
        return [p.name for p in export_run(run_dir)]
    except Exception as exc:  # noqa: BLE001 - the run itself succeeded; say why there is no export
        log.warning("no ONNX export of %s: %s", run_dir, exc)
        return f"failed: {type(exc).__name__}: {exc}"
