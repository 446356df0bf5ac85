"""A whole fleet on one machine: real device runtimes, a real coordinator, simulated links.

:class:`Emulator` runs one experiment (``coordinator.experiment.ExperimentConfig``) for one
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

import hashlib
import json
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.datasets import DataSplit, class_counts, load_dataset, partition
from coordinator.experiment import ExperimentConfig, parse_codec
from coordinator.fleet import Fleet, Inbound, InProcessFleet, MqttFleet
from edge_client.errors import ConfigError, ProtocolError
from edge_client.protocol import (
    FLOAT_VARIANT,
    RoundAnnouncement,
    Update,
    decode_message,
    model_variant,
)
from edge_client.runtime import DeviceConfig, DeviceRuntime, birth_messages

log = logging.getLogger("fedbit.emulator")


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts`` (SHA-256 of their text): the same on every run
    and machine, unlike ``hash()``."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------- devices


@dataclass
class EmulatedDevice:
    """One device of the fleet: its profile, config (codec override and seed applied) and
    shard (indices into the training split)."""

    device_id: str
    profile: Any  # hw_profiles.HardwareProfile
    config: DeviceConfig
    shard: np.ndarray
    variant: str
    inferior: bool  # FedShift's inferior group: an integer device or a lossy uplink


def build_fleet(cfg: ExperimentConfig, seed: int, data: DataSplit, workdir: Path, job: str) -> list[EmulatedDevice]:
    """The devices of ``cfg`` (``[devices]`` counts, ``[codecs]`` overrides) with their
    data shards (``[data]`` partition, drawn with the run seed)."""
    from hw_profiles import load_profile

    specs = []
    for name, count in cfg.devices.items():
        try:
            prof = load_profile(name)
        except ValueError as exc:
            raise ConfigError(f"{cfg.source}: devices.{name}: {exc}") from None
        codec, bits = (parse_codec(cfg.codecs[name], f"codecs.{name}") if name in cfg.codecs
                       else (prof.codec, prof.codec_bits))
        if codec == "int" and prof.trainer != "int":
            raise ConfigError(f"{cfg.source}: codecs.{name}: codec 'int' needs an integer device")
        width = len(str(max(1, count) - 1))
        for i in range(count):
            specs.append((f"{prof.name}-{i:0{width}d}", prof, codec, bits))
    inferior = [p.trainer == "int" or p.compute_bits < 32 or c != "float32" for _, p, c, _ in specs]
    d = cfg.data
    shards = partition(d["partition"], data.train.y, len(specs), np.random.default_rng(derive_seed("data", seed)),
                       k=d["shards_per_device"], alpha=float(d["alpha"]), inferior=inferior,
                       per_device=d["per_device"])
    devices = []
    for (dev_id, prof, codec, bits), shard, inf in zip(specs, shards, inferior, strict=True):
        dc = replace(DeviceConfig.from_profile(dev_id, prof, job=job, workdir=workdir / dev_id,
                                               seed=derive_seed("device", seed, dev_id), max_rounds=1),
                     codec=codec, codec_bits=bits)
        devices.append(EmulatedDevice(dev_id, prof, dc, shard, model_variant(prof.compute_bits, prof.trainer), inf))
    return devices


class _GatedTrainer:
    """A device's trainer whose ``train`` waits for one of the host's training slots (at
    most ``round.parallel`` devices compute at once, like cores)."""

    def __init__(self, trainer: Any, slots: threading.Semaphore) -> None:
        self._trainer = trainer
        self._slots = slots

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with self._slots:
            return self._trainer.train(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


class _StaysPresent:
    """A device transport whose ``close`` does not announce the device offline: between
    the rounds it is selected in, an emulated device sleeps but stays registered."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def close(self, clear_will: Any = None) -> None:
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class DeviceHost:
    """Registers every device once and runs the runtimes of the selected ones.

    Args:
        devices: the fleet.
        train: the training split (devices get ``train.subset(shard)`` when started).
        connect: ``device_id -> connect(**session_spec) -> Transport``.
        slots: training slots (devices computing at once).
        wall_timeout_s: a device runtime gives up after this many seconds.
    """

    def __init__(self, devices: list[EmulatedDevice], train: Any, connect: Callable[[str], Callable[..., Any]],
                 *, slots: int, wall_timeout_s: float) -> None:
        self.devices = {d.device_id: d for d in devices}
        self.train = train
        self.connect = connect
        self.slots = threading.Semaphore(slots)
        self.wall_timeout_s = wall_timeout_s
        #: device id -> (round, running | done | failed) of its latest start
        self._state: dict[str, tuple[int, str]] = {}
        self.train_seconds: dict[str, float] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def register(self, transport: Any) -> None:
        """Publish every device's presence and hello (retained) through ``transport``."""
        for d in self.devices.values():
            for t, payload, retain in birth_messages(d.config, len(d.shard)):
                if not transport.publish(t, payload, qos=1, retain=retain, timeout=30.0):
                    raise ConnectionError(f"registering {d.device_id}: the broker did not acknowledge")

    def activate(self, round_id: int, ids: list[str]) -> None:
        """Start the runtimes of ``ids`` for round ``round_id`` (a device still closing
        its previous session is waited for: one session per device id)."""
        for dev_id in ids:
            old = self._threads.get(dev_id)
            if old is not None:
                old.join(self.wall_timeout_s)
            with self._lock:
                self._state[dev_id] = (round_id, "running")
            th = threading.Thread(target=self._run, args=(self.devices[dev_id], round_id),
                                  name=f"device-{dev_id}", daemon=True)
            self._threads[dev_id] = th
            th.start()

    def failed(self, device_id: str, round_id: int) -> bool:
        """Whether the device started for ``round_id`` ended without sending its update
        (one that did send it may still have it in flight)."""
        with self._lock:
            return self._state.get(device_id) == (round_id, "failed")

    def _run(self, dev: EmulatedDevice, round_id: int) -> None:
        from edge_client.trainers import make_trainer

        def trainer_factory(spec: Any, bits: int, seed: int) -> Any:
            return _GatedTrainer(make_trainer(spec, bits, seed=derive_seed(seed, round_id)), self.slots)

        connect = self.connect(dev.device_id)
        rt = DeviceRuntime(dev.config, self.train.subset(dev.shard),
                           lambda **kw: _StaysPresent(connect(**kw)), trainer_factory=trainer_factory,
                           logger=log.getChild("device"))
        state = "failed"
        try:
            rt.run(max_seconds=self.wall_timeout_s)
            state = "done" if rt.rounds_done else "failed"
        except Exception:  # noqa: BLE001 - a device failing is an event of the round, not of the emulator
            log.exception("device %s failed in round %d", dev.device_id, round_id)
        with self._lock:
            if self._state.get(dev.device_id, (None,))[0] == round_id:
                self._state[dev.device_id] = (round_id, state)

    def join(self, timeout: float = 30.0) -> None:
        """Wait for every started runtime to end (up to ``timeout`` s in all)."""
        end = time.monotonic() + timeout
        for th in list(self._threads.values()):
            th.join(max(0.0, end - time.monotonic()))


# --------------------------------------------------------------------------- links


@dataclass
class SimLinks:
    """The simulated link and compute model (see the module docstring). Times in s."""

    devices: Mapping[str, EmulatedDevice]
    seconds_per_sample: Mapping[str, float]
    seed: int

    def dropped(self, device_id: str, round_id: int) -> bool:
        """Whether the device's round is lost (probability ``loss_rate``, drawn from the run
        seed, the device and the round)."""
        p = self.devices[device_id].profile.loss_rate
        return p > 0 and np.random.default_rng(derive_seed("loss", self.seed, device_id, round_id)).random() < p

    def arrival(self, device_id: str, model_bytes: int, samples: int, update_bytes: int) -> float:
        """Simulated seconds from the round's start to the update's arrival."""
        dev = self.devices[device_id]
        prof = dev.profile
        lat = prof.latency_ms / 1e3
        down = model_bytes * 8 / (prof.downlink_kbps * 1e3) + lat
        compute = samples * self.seconds_per_sample[dev.variant] / prof.relative_speed
        up = update_bytes * 8 / (prof.uplink_kbps * 1e3) + lat
        return down + compute + up


def calibrate(model: str, variants: list[str], sample: Any, *, batch: int = 32, steps: int = 4) -> dict[str, float]:
    """Seconds per training sample of each variant's trainer on this machine (one thread,
    after a warm-up step that compiles the kernels); the best of ``steps`` timed steps."""
    _one_thread_torch()  # as the emulated devices train (torch's default uses every core)
    from edge_client.protocol import variant_bits
    from edge_client.trainers import make_trainer
    from firmware_models import get_spec

    spec = get_spec(model)
    out = {}
    for v in sorted(set(variants)):
        trainer = make_trainer(spec, variant_bits(v), seed=0)
        trainer.train(sample, steps=1, batch=batch)  # compile / warm up
        best = math.inf
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train(sample, steps=1, batch=batch)
            best = min(best, time.perf_counter() - t0)
        out[v] = best / min(batch, len(sample))
    return out


# --------------------------------------------------------------------------- the fleet


@dataclass
class _SimRound:
    round_id: int
    selected: list[str]
    started: list[str]
    lost: list[str]
    model_bytes: dict[str, int]
    hparams: dict[str, Any]
    t0: float  # wall (monotonic)
    pending: dict[str, tuple[float, Inbound]] = field(default_factory=dict)
    out: deque = field(default_factory=deque)
    final: bool = False
    report: dict[str, Any] = field(default_factory=dict)


class EmulatedFleet(Fleet):
    """A :class:`Fleet` that puts the simulated clock between the coordinator and a real
    fleet (see the module docstring).

    Args:
        inner: the real fleet (MQTT or in-process).
        host: starts the selected devices' runtimes.
        links: the simulated link and compute model.
        quorum: the fraction of the selected whose updates close a round.
        deadline_s: the simulated round deadline (0: none; the round closes at the last
            arrival).
        wall_timeout_s: a started device that has not answered after this many wall
            seconds counts as failed.
    """

    def __init__(self, inner: Fleet, host: DeviceHost, links: SimLinks, *, quorum: float,
                 deadline_s: float, wall_timeout_s: float) -> None:
        self.inner = inner
        self.job = inner.job
        self.host = host
        self.links = links
        self.quorum = quorum
        self.deadline_s = deadline_s
        self.wall_timeout_s = wall_timeout_s
        self.sim_time = 0.0
        self._round: _SimRound | None = None

    # pass-throughs
    def start(self, timeout: float = 30.0) -> None:
        self.inner.start(timeout)

    def publish_status(self, status: bytes, *, wait: bool = False) -> None:
        self.inner.publish_status(status, wait=wait)

    def reset(self, status: bytes) -> None:
        self.inner.reset(status)

    def flush(self) -> None:
        self.inner.flush()

    def ack(self, msg: Inbound) -> None:
        self.inner.ack(msg)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"emulated links over {self.inner.describe()}"

    # the round
    def announce_round(self, models: Mapping[str, bytes], announcement: bytes, status: bytes) -> None:
        ann = decode_message(announcement)
        assert isinstance(ann, RoundAnnouncement)
        self.inner.announce_round(models, announcement, status)
        self.inner.flush()  # the round is retained before any device connects
        selected = list(ann.selected)
        lost = [d for d in selected if self.links.dropped(d, ann.round_id)]
        started = [d for d in selected if d not in lost]
        self._round = _SimRound(ann.round_id, selected, started, lost, {v: len(p) for v, p in models.items()},
                                dict(ann.hparams), time.monotonic())
        self.host.activate(ann.round_id, started)

    def recv(self, timeout: float) -> Inbound | None:
        end = time.monotonic() + timeout
        while True:
            rnd = self._round
            if rnd is not None and rnd.out:
                return rnd.out.popleft()
            msg = self.inner.recv(timeout=max(0.0, min(0.05, end - time.monotonic())))
            if msg is not None and not self._hold(msg):
                return msg
            self._maybe_close()
            if rnd is not None and rnd.out:
                return rnd.out.popleft()
            if msg is None and time.monotonic() >= end:
                return None

    def more_expected(self, round_id: int) -> bool:
        rnd = self._round
        return not (rnd is not None and rnd.round_id == round_id and rnd.final and not rnd.out)

    def round_report(self, round_id: int) -> dict[str, Any]:
        rnd = self._round
        return dict(rnd.report) if rnd is not None and rnd.round_id == round_id else {}

    def _hold(self, msg: Inbound) -> bool:
        """Keep an update of the open round from a started device until the round closes
        (True: held, or swallowed because its round already closed on the simulated
        clock)."""
        rnd = self._round
        if rnd is None or msg.kind != "update" or msg.device_id not in rnd.started \
                or msg.device_id in rnd.pending:
            return False
        try:
            m = decode_message(msg.payload)
        except ProtocolError:
            return False  # the coordinator rejects it, with its reason
        if not isinstance(m, Update) or m.round_id != rnd.round_id:
            return False
        if rnd.final:  # in wall time after its device was given up on: a straggler
            rnd.report["sim_late"] = rnd.report.get("sim_late", 0) + 1
            self.inner.ack(msg)
            return True
        dev = self.links.devices[m.device_id]
        hp = rnd.hparams
        samples = int(hp.get("steps") or 0) * int(hp.get("batch", 32)) or int(hp.get("epochs", 1)) * len(dev.shard)
        t = self.links.arrival(m.device_id, rnd.model_bytes.get(dev.variant, 0), samples, len(msg.payload))
        rnd.pending[m.device_id] = (t, msg)
        self.host.train_seconds[m.device_id] = m.train_seconds
        return True

    def _maybe_close(self) -> None:
        """Once every started device answered (or failed, or ran out of wall time):
        release the first ``need`` arrivals within the deadline, in device-id order."""
        rnd = self._round
        if rnd is None or rnd.final:
            return
        timed_out = time.monotonic() - rnd.t0 > self.wall_timeout_s
        waiting = [d for d in rnd.started if d not in rnd.pending and not self.host.failed(d, rnd.round_id)]
        if waiting and not timed_out:
            return
        arrivals = sorted((t, d) for d, (t, _) in rnd.pending.items())
        need = max(1, math.ceil(self.quorum * len(rnd.selected)))
        in_time = [(t, d) for t, d in arrivals if not self.deadline_s or t <= self.deadline_s]
        chosen = in_time[:need]
        chosen_ids = {d for _, d in chosen}
        late = [d for _, d in arrivals if d not in chosen_ids]
        for d in late:
            self.inner.ack(rnd.pending[d][1])  # never handed over: the coordinator counts a straggler
        if len(chosen) >= need or not self.deadline_s:
            duration = chosen[-1][0] if chosen else 0.0
        else:
            duration = self.deadline_s
        self.sim_time += duration
        rnd.out.extend(rnd.pending[d][1] for _, d in sorted(chosen, key=lambda x: x[1]))
        failed = sorted(d for d in rnd.started if d not in rnd.pending)
        compute = [self.host.train_seconds.get(d, 0.0) for _, d in chosen]
        rnd.report = {
            "sim_round_seconds": duration, "sim_time": self.sim_time,
            "sim_dropouts": len(rnd.lost), "sim_late": len(late), "sim_failed": len(failed),
            "sim_dropout_ids": sorted(rnd.lost), "sim_late_ids": sorted(late), "sim_failed_ids": failed,
            "device_train_seconds": float(sum(compute)),
            "device_wall_seconds": time.monotonic() - rnd.t0,
        }
        rnd.final = True


# --------------------------------------------------------------------------- the run


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
        from firmware_models import get_spec

        cfg, seed = self.cfg, self.seed
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _one_thread_torch()
        t_start = time.monotonic()
        job = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{cfg.name}-s{seed}")[:64]
        data = load_dataset(cfg.data["dataset"], cfg.data["path"] or None)
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
        strategy = build_strategy(cfg.strategy, model=cfg.model, **cfg.strategy_params)
        server_cfg = ServerConfig(
            job=job, model=cfg.model, rounds=cfg.rounds, strategy=cfg.strategy,
            strategy_params=dict(cfg.strategy_params), fraction=float(rnd["fraction"]), min_devices=1,
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
                                                        seed=seed),
                                init_weights=init_shared(get_spec(cfg.model), seed), on_event=self.on_event,
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
        from coordinator.broker import start_embedded_broker
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
            "config": self.cfg.as_dict(), "source": self.cfg.source, "seed": self.seed,
            "dataset": data.name, "train_samples": len(data.train), "test_samples": len(data.test),
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
    from coordinator.export import export_run

    try:
        return [p.name for p in export_run(run_dir)]
    except Exception as exc:  # noqa: BLE001 - the run itself succeeded; say why there is no export
        log.warning("no ONNX export of %s: %s", run_dir, exc)
        return f"failed: {type(exc).__name__}: {exc}"


def _one_thread_torch() -> None:
    """Float devices and the evaluator compute with one torch thread each: deterministic
    results (a reduction's order does not depend on the thread count) and no
    oversubscription of the cores the device threads share."""
    try:
        import torch
    except ImportError:  # the coordinator extra is not installed: no float devices then
        return
    torch.set_num_threads(1)
