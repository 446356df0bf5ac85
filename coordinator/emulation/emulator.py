"""The emulated devices: the fleet a config describes (:func:`build_fleet`: profiles,
codecs, data shards, seeds) and :class:`DeviceHost`, which registers every device once and runs
the real device runtimes of the selected ones (the one coordinator module that runs
``edge_client.runtime``, by design). See :mod:`coordinator.emulation.run`."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.emulation.config import ExperimentConfig, parse_codec
from coordinator.emulation.datasets import DataSplit, partition
from edge_client.errors import ConfigError
from edge_client.protocol import (
    model_variant,
)
from edge_client.runtime import DeviceConfig, DeviceRuntime, birth_messages
from firmware_models import is_model_file

log = logging.getLogger("fedbit.emulator")


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts`` (SHA-256 of their text): the same on every run
    and machine, unlike ``hash()``."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF





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
    keys = []  # each device's [devices] key
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
            keys.append(name)
    inferior = [p.trainer == "int" or p.compute_bits < 32 or c != "float32" for _, p, c, _ in specs]
    if cfg.data["inferior"]:  # the parity split's groups named, whatever the uplinks
        inferior = [k in cfg.data["inferior"] for k in keys]
    model_files = (cfg.model,) if is_model_file(cfg.model) else ()  # a user's model: the devices get the file
    d = cfg.data
    shards = partition(d["partition"], data.train.y, len(specs), np.random.default_rng(derive_seed("data", seed)),
                       k=d["shards_per_device"], alpha=float(d["alpha"]), inferior=inferior,
                       per_device=d["per_device"])
    devices = []
    for (dev_id, prof, codec, bits), shard, inf in zip(specs, shards, inferior, strict=True):
        dc = replace(DeviceConfig.from_profile(dev_id, prof, job=job, workdir=workdir / dev_id,
                                               seed=derive_seed("device", seed, dev_id), max_rounds=1,
                                               model_files=model_files),
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
