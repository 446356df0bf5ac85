"""A whole fleet on one machine: real device runtimes, a real coordinator, simulated links.

:class:`Emulator` runs one experiment (``coordinator.emulation.config.ExperimentConfig``) for one
seed. Every emulated device runs the real :class:`edge_client.runtime.DeviceRuntime` (the
code a Pi runs: download, train with its profile's trainer, encode with its codec,
publish), over a real broker (``transport = "mqtt"``: the embedded one, or ``broker``) or
the in-process hub (``transport = "inproc"``: the same bytes, no sockets), against the
real :class:`~coordinator.server.Coordinator`.

**Devices cost what the selected ones cost.** The fleet is a plan
(:class:`~coordinator.emulation.fleet_plan.FleetPlan`): the coordinator registers it in bulk
(:meth:`Fleet.roster`: one cohort per profile, no hello per device), and a device is made
(its config, seed and shard) only when it is selected. A million registered devices cost
the registry their sample counts, not a hello each.

**Workers.** The selected devices train in workers (:mod:`coordinator.emulation.pool`):
this process (``round.workers = 1``), N processes on this machine (``= N``), Ray actors
across a cluster (``[cluster] backend = "ray"``), or, by default (``= 0``), this process
until a round costs it more than :data:`AUTO_CPU_S` CPU seconds and one process per core
from then on. Each gets the round's messages once and runs the real
:class:`edge_client.runtime.DeviceRuntime` of each of its devices (the code a Pi runs:
download, train with its profile's trainer, encode with its codec, publish) on its own
in-memory hub, at most ``round.parallel`` training at once; each update goes unchanged to
the coordinator's fleet (the in-process hub for ``transport = "inproc"``, the broker for
``"mqtt"``) on the device's update topic. Which worker trains a device changes nothing
in its update.

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
nothing more will come (:meth:`Fleet.more_expected`); later ones are stragglers, and so
are the devices of a worker lost mid-round. Nothing
sleeps for simulated seconds. The seconds per sample are measured once per variant at
start-up (``calibrate``), or pinned by the config (``[clock] seconds_per_sample``) for
bit-reproducible runs. The coordinator's own time is not part of the simulated round.

**Seeds.** The run seed picks the data split, the coordinator's initial model and
selections, and each device's seed (a hash of the run seed and its id; its stochastic
rounding stream in round r is keyed by both), so the same seed gives the same metrics,
whatever the number of workers or the backend.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.emulation.analysis import LAST_ROUNDS
from coordinator.emulation.availability import (
    Availability,
    availability_series,
    profile_overrides,
    read_trace,
)
from coordinator.emulation.config import ExperimentConfig
from coordinator.emulation.datasets import DataSplit, class_counts, load_dataset
from coordinator.emulation.emulated_fleet import (
    EmulatedFleet,
    SimLinks,
    calibrate,
    one_thread_torch,
)
from coordinator.emulation.eventclock import BufferedEmulatedFleet
from coordinator.emulation.fleet_plan import FleetPlan, build_fleet
from coordinator.emulation.pool import (
    InlineBackend,
    ProcessBackend,
    WorkerPool,
    machine_cores,
    wait_ready,
)
from coordinator.emulation.stopping import Stopper, stop_summary
from coordinator.emulation.worker import WorkerSpec
from coordinator.fleet import Fleet, InProcessFleet, MqttFleet
from edge_client.protocol import FLOAT_VARIANT

log = logging.getLogger("fedbit.emulator")

#: devices listed one by one in ``emulation.json``: all of a fleet up to this size, the
#: first 1,000 of a larger one (``fleet_size`` says how many there are)
DESCRIBED_DEVICES = 10_000
#: ``round.workers = 0`` (auto): a round that takes the emulator's own process more CPU
#: seconds than this starts one worker process per core (fewer devices than cores: one
#: per device) for the rounds after it. Smaller rounds stay in the emulator's process: a
#: worker process costs ~360 MB (its kernels, torch) and a pipe each way per round.
AUTO_CPU_S = 0.25
#: validation samples scored each round (a fixed random subsample: the per-round curve the
#: stopping rule, the health watch and tuning read)
VAL_SAMPLE = 1000

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
        on_event: the coordinator's progress callback; the emulator adds ``devices``
            events (the workers' :class:`~coordinator.emulation.pool.Progress` as fields:
            ``round``, ``started``, ``done``, ``failed``, ``workers``, ``busy``).
    """

    def __init__(self, cfg: ExperimentConfig, seed: int, run_dir: str | Path, *,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        self.run_dir = Path(run_dir)
        self.on_event = on_event
        self.pool: WorkerPool | None = None  # the workers of the run in progress

    def run(self) -> RunResult:
        from coordinator.config import ServerConfig
        from coordinator.evaluate import evaluator_for
        from coordinator.job import coordinator_for
        from coordinator.ops.admission import AdmissionConfig
        from coordinator.ops.dashboard.monitor import fan_out
        from coordinator.state import RunState
        from coordinator.strategies import build_strategy
        from edge_client.intnn import init_shared
        from edge_client.intnn.memory import keep_freed_memory
        from firmware_models import resolve_model

        cfg, seed = self.cfg, self.seed
        self.run_dir.mkdir(parents=True, exist_ok=True)
        one_thread_torch()
        keep_freed_memory()  # the evaluator's activations: reused heap, not fresh pages
        t_start = time.monotonic()
        job = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{cfg.name}-s{seed}")[:64]
        data = load_dataset(cfg.data.dataset, cfg.data.path or None, validation=float(cfg.data.validation),
                            seed=cfg.data.seed)
        plan = build_fleet(cfg, seed, data, self.run_dir / "devices", job)
        variants = sorted(plan.variants() | {FLOAT_VARIANT})
        pinned = {str(k): float(v) for k, v in cfg.clock.seconds_per_sample.items()}
        missing = [v for v in variants if v not in pinned]
        measured = calibrate(cfg.model, missing, data.train.subset(np.arange(min(64, len(data.train))))) \
            if missing else {}
        sps = pinned | measured
        info = self._describe(plan, data, sps, measured)
        rnd = cfg.round
        strategy = build_strategy(cfg.strategy, model=cfg.model, **cfg.build_params())
        n = len(plan)
        availability = self._availability(plan)
        buffered = rnd.mode == "buffered"  # (its requests time out on the simulated clock)
        timeout = (float(rnd.deadline_s) or math.inf) if buffered else float(rnd.wall_timeout_s)
        server_cfg = ServerConfig(
            job=job, model=cfg.model, rounds=cfg.rounds, strategy=cfg.strategy,
            strategy_params=cfg.build_params(), fraction=float(rnd.fraction), min_devices=1,
            max_devices=n, min_present=1 if availability else n, quorum=float(rnd.quorum),
            min_updates=rnd.min_updates, round_timeout_s=min(timeout, 1e12),
            presence_timeout_s=max(120.0, float(rnd.wall_timeout_s)), hparams=dict(cfg.train), seed=seed,
            admission=replace(AdmissionConfig(), max_registered=max(n, AdmissionConfig().max_registered),
                              hello_rate=1e9, hello_burst=1 << 30),  # (presence changes come from the clock)
            on_collapse=cfg.on_collapse, privacy=cfg.privacy, defense=cfg.defense, mode=rnd.mode,
            buffered=rnd.buffered())
        broker, inner, relay = self._transport(job)
        info["broker"] = (f"embedded {broker.kind} at {broker.url}" if broker is not None
                          else self.cfg.broker or "in-process hub")
        pool = fleet = evaluator = None
        try:
            relay.connect(timeout=30.0)
            pool = self.pool = self._workers(plan, data, relay, job)
            info |= pool.describe() | {"cores": machine_cores()}
            (self.run_dir / "emulation.json").write_text(json.dumps(info, indent=1))
            if not wait_ready(pool, float(rnd.wall_timeout_s)):
                raise ConnectionError("the emulator's worker processes did not start (see the log)")
            links = SimLinks(plan, sps, seed)
            progress = (lambda f: self.on_event("devices", f)) if self.on_event else None
            if buffered:
                fleet = BufferedEmulatedFleet(inner, pool, links, timeout_s=timeout, until_s=float(cfg.clock.until_s),
                                              wall_timeout_s=float(rnd.wall_timeout_s),
                                              availability=availability, on_progress=progress)
            else:
                fleet = EmulatedFleet(inner, pool, links, quorum=float(rnd.quorum),
                                      deadline_s=float(rnd.deadline_s), wall_timeout_s=float(rnd.wall_timeout_s),
                                      on_progress=progress, availability=availability,
                                      until_s=float(cfg.clock.until_s))
            # the test split only in the reported rounds (the last LAST_ROUNDS, or those after a
            # plateau; every round for a target accuracy, and for a run its simulated time budget
            # ends, which does not know its last rounds), a validation subsample every round;
            # decisions read the validation split, else the training split: never the test split.
            # Every core scores, the device workers idle meanwhile.
            evaluator = evaluator_for(cfg.model, data.test, strategy.device_hparams(cfg.train), seed=seed,
                                      validation=data.validation, val_sample=VAL_SAMPLE,
                                      report_from=0 if cfg.target_accuracy or cfg.clock.until_s
                                      else cfg.rounds - LAST_ROUNDS + 1,
                                      threads=machine_cores(), probe_data=data.train)
            stopper = Stopper(asdict(cfg.stop), server_cfg, evaluator)
            if cfg.clock.eval_every_s:
                evaluator = SimTimeEvaluator(evaluator, fleet, float(cfg.clock.eval_every_s))
            coord = coordinator_for(server_cfg, fleet, strategy, RunState(self.run_dir / "out"), evaluator=evaluator,
                                    init_weights=init_shared(resolve_model(cfg.model), seed),
                                    on_event=fan_out(stopper, self.on_event), logger=log.getChild("server"))
            history = coord.run()
            info["stop"] = stop_summary(history, asdict(cfg.stop), stopper.plateau_round)
            info |= pool.describe() | {"workers_lost": pool.lost}
        finally:
            if evaluator is not None:
                evaluator.close()
            if pool is not None:
                pool.close()
            if fleet is not None:
                fleet.close()
            else:
                inner.close()
            relay.close()
            if broker is not None:
                broker.stop()
        info["onnx"] = _export(self.run_dir / "out")
        info["wall_seconds"] = time.monotonic() - t_start
        info["sim_seconds"] = fleet.sim_time
        if availability is not None:
            info["availability"] = availability_series(availability, fleet.sim_time)
        (self.run_dir / "emulation.json").write_text(json.dumps(info, indent=1))
        return RunResult(self.run_dir, history, info)

    def _availability(self, plan: FleetPlan) -> Availability | None:
        """The ``[availability]`` of the config for this fleet (None: every device always online)."""
        av = self.cfg.availability
        if av.model == "none":
            return None
        devices = {d: g.profile.name for g in plan.groups for d in (g.device_id(i) for i in range(g.count))}
        trace = read_trace(av.trace, devices) if av.model == "trace" else None
        return Availability(av.model, devices, seed=self.seed, start_hour=float(av.start_hour),
                            profiles=profile_overrides(av.profiles, self.cfg.source), trace=trace,
                            time_scale=float(av.time_scale))

    def _workers(self, plan: FleetPlan, data: DataSplit, relay: Any, job: str) -> WorkerPool:
        """The pool of ``round.workers`` workers on the ``[cluster]`` backend."""
        rnd, cluster = self.cfg.round, self.cfg.cluster
        cores = machine_cores()
        workers = rnd.workers
        kinds = {(g.profile.trainer, g.profile.compute_bits, g.codec, g.bits):
                 replace(g.profile, codec=g.codec, codec_bits=g.bits) for g in plan.groups}
        spec = WorkerSpec(job=job, slots=rnd.parallel, wall_timeout_s=float(rnd.wall_timeout_s),
                          workdir=str(plan.workdir), model=self.cfg.model, profiles=tuple(kinds.values()),
                          engine=rnd.engine)
        if rnd.engine == "cuda":  # one GPU, one process: this one trains every round's devices
            return WorkerPool(plan, InlineBackend(data.train, spec), 1, relay, job)
        if cluster.backend == "ray":
            from coordinator.emulation.ray_backend import RayBackend

            backend: Any = RayBackend(cluster.address, data.train, spec)
            return WorkerPool(plan, backend, workers or backend.cpus, relay, job)
        n = min(workers or cores, len(plan))
        if n <= 1:
            return WorkerPool(plan, InlineBackend(data.train, spec), 1, relay, job)
        procs = replace(spec, threads=max(1, cores // n))
        if workers:
            return WorkerPool(plan, ProcessBackend(data.train, procs), n, relay, job)
        # auto: rounds run here until one of them takes more CPU than a process's cost is worth
        return WorkerPool(plan, InlineBackend(data.train, spec), 1, relay, job,
                          grow=lambda: (ProcessBackend(data.train, procs), n), grow_after_cpu_s=AUTO_CPU_S)

    def _transport(self, job: str) -> tuple[Any, Fleet, Any]:
        """(broker or None, the coordinator's fleet, the transport that relays the devices'
        updates to it) for ``transport = inproc | mqtt``."""
        if self.cfg.transport == "inproc":
            inner = InProcessFleet(job)
            return None, inner, inner.hub.client("fedbit-emulator")
        from coordinator.ops.broker import start_embedded_broker
        from edge_client.transport import MqttTransport

        broker = None
        url = self.cfg.broker
        if not url:
            broker = start_embedded_broker()
            if hasattr(broker, "keep_alive"):  # (mosquitto: started again should it die)
                broker.keep_alive()
            url = broker.url
        inner = MqttFleet(url, job, client_id=f"fedbit-coordinator-{job}-{self.seed}", username="fedbit-coordinator")
        return broker, inner, MqttTransport(url, f"fedbit-emulator-{job}-{self.seed}")

    def _describe(self, plan: FleetPlan, data: DataSplit, sps: dict[str, float],
                  measured: dict[str, float]) -> dict[str, Any]:
        n = len(plan)
        listed = list(itertools.islice(plan.ids(), n if n <= DESCRIBED_DEVICES else 1000))
        devices = [plan.device(d) for d in listed]
        counts = class_counts([d.shard for d in devices], data.train.y, data.num_classes)
        return {
            "config": self.cfg.as_dict(), "paper_stage_params": dict(self.cfg.paper_stage_params),
            "source": self.cfg.source, "seed": self.seed,
            "dataset": data.name, "train_samples": len(data.train), "test_samples": len(data.test),
            "validation_samples": len(data.validation) if data.validation is not None else 0,
            "seconds_per_sample": sps, "calibrated": sorted(measured),
            "profiles": {g.profile.name: {"count": g.count, **{k: v for k, v in asdict(g.profile).items()
                                                               if k != "notes"}} for g in plan.groups},
            "fleet_size": n, "attackers": sorted(plan.attackers)[:1000],
            "devices": [{"id": d.device_id, "profile": d.profile.name, "variant": d.variant,
                         "codec": f"{d.config.codec}-{d.config.codec_bits}", "inferior": d.inferior,
                         "samples": len(d.shard), "class_counts": counts[i].tolist(),
                         **({"attacker": True} if d.attack is not None else {})}
                        for i, d in enumerate(devices)],
        }


class SimTimeEvaluator:
    """Scores a round (a buffer) only when the fleet's simulated clock has passed the next
    multiple of ``every_s`` (``[clock] eval_every_s``): the other records have no
    accuracy. For runs whose rounds are shorter than the resolution their curves need."""

    def __init__(self, inner: Any, fleet: Fleet, every_s: float) -> None:
        self.inner, self.fleet, self.every_s = inner, fleet, every_s
        self._next = 0.0

    def __call__(self, variants: Any, **kw: Any) -> dict[str, Any]:
        t = self.fleet.now()
        if t < self._next:
            return {}
        self._next = (math.floor(t / self.every_s) + 1) * self.every_s
        return self.inner(variants, **kw)

    def __getattr__(self, name: str) -> Any:  # probe, close
        return getattr(self.inner, name)


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
