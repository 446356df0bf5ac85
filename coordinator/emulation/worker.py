"""The device side of the emulator: :class:`DeviceWorker` runs the real device runtimes of
the devices it is given for a round, in whatever process it lives in (the emulator's own,
a worker process, a Ray actor).

A worker has its own in-memory hub (:class:`~edge_client.transport.LocalHub`). Per round it
gets the coordinator's messages once (:class:`RoundMessages`: the model variants, the
round announcement, the status, as the coordinator published them) and publishes them,
retained, on that hub; each of its devices then runs :class:`edge_client.runtime.DeviceRuntime`,
made by :func:`coordinator.emulation.fleet_plan.device_runtime` (the code a Pi runs: download, train with its profile's trainer, encode with its codec,
publish) against the hub, at most ``slots`` training at once, and every update a device
publishes is handed on unchanged (:class:`WorkerEvent` ``update``, the exact bytes) for
the emulator to publish on the device's update topic of the real fleet. When a device's
runtime ends, an ``end`` event says whether it sent its update (``done``) or not
(``failed``).

This module imports neither numba nor torch itself: a worker process sets its thread
limits (:func:`serve`) before the trainers load them.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.emulation.fleet_plan import EmulatedDevice, derive_seed, device_runtime
from edge_client.data import Dataset
from edge_client.protocol import decode_message, parse_topic, topic
from edge_client.transport import LocalHub

if TYPE_CHECKING:  # pragma: no cover
    from multiprocessing.connection import Connection

    from coordinator.emulation.gpu import GpuFleet
    from edge_client.runtime import DeviceRuntime
    from edge_client.trainers import Trainer, TrainReport
    from edge_client.transport.base import Received, Transport
    from firmware_models import ModelSpec
    from hw_profiles import HardwareProfile

log = logging.getLogger("fedbit.emulator")


@dataclass(frozen=True)
class RoundMessages:
    """One round as the coordinator announced it (the payloads it published, retained):
    ``models`` by variant, the ``announcement``, the ``status``."""

    round_id: int
    models: dict[str, bytes]
    announcement: bytes
    status: bytes


@dataclass(frozen=True)
class WorkerEvent:
    """What a worker reports: ``update`` (device ``device_id`` published ``payload``, the
    exact bytes) or ``end`` (its runtime ended; ``state`` ``done`` when it sent its update,
    else ``failed``)."""

    kind: str
    round_id: int
    device_id: str
    payload: bytes = b""
    state: str = ""


@dataclass(frozen=True)
class WorkerSpec:
    """How to build a worker: the job, training slots, the devices' wall-clock limit (s),
    the folder of the devices' work folders, and the threads its kernels may use."""

    job: str
    slots: int
    wall_timeout_s: float
    workdir: str
    threads: int = 1
    #: warm up (compile or load the kernels of) these before the first round: the
    #: model, and each group's profile with its uplink codec
    model: str = ""
    profiles: tuple[HardwareProfile, ...] = ()
    #: the integer devices' engine: "cpu" (each trains on its own), or "cuda" (a round's
    #: train together on the GPU: coordinator.emulation.gpu)
    engine: str = "cpu"


class SharedData:
    """A training split that processes on this machine open without a copy each: ``x`` and
    ``y`` as ``.npy`` files in a folder on tmpfs (``/dev/shm`` where there is one),
    opened memory-mapped (read-only; a device's shard is copied out of it)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    @classmethod
    def create(cls, data: Dataset) -> SharedData:
        shm = "/dev/shm"
        base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        folder = tempfile.mkdtemp(prefix="fedbit-train-", dir=base)
        np.save(os.path.join(folder, "x.npy"), np.ascontiguousarray(data.x))
        np.save(os.path.join(folder, "y.npy"), np.ascontiguousarray(data.y))
        return cls(folder)

    def open(self) -> Dataset:
        return Dataset(np.load(os.path.join(self.folder, "x.npy"), mmap_mode="r"),
                       np.load(os.path.join(self.folder, "y.npy"), mmap_mode="r"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class _GatedTrainer:
    """A device's trainer whose ``train`` waits for one of the worker's training slots."""

    def __init__(self, trainer: Trainer, slots: threading.Semaphore) -> None:
        self._trainer = trainer
        self._slots = slots

    def train(self, *args: Any, **kwargs: Any) -> TrainReport:
        with self._slots:
            return self._trainer.train(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the wrapped trainer's
        return getattr(self._trainer, name)


class _Quiet:
    """A device transport on the worker's hub that leaves nothing retained behind it (no
    presence on close): the coordinator knows the fleet from the roster, and a worker
    hosts a million devices over a run without keeping a message of each."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def close(self, clear_will: tuple[str, bytes] | None = None) -> None:
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # the wrapped transport's
        return getattr(self._transport, name)


class DeviceWorker:
    """Runs the runtimes of the devices it is given, one round at a time (see the module
    docstring).

    Args:
        train: the training split (a device trains on ``train.subset(shard)``).
        spec: job, slots, wall-clock limit, work folder (``<workdir>/<device id>``).
    """

    def __init__(self, train: Dataset, spec: WorkerSpec) -> None:
        self.train = train
        self.spec = spec
        self.hub = LocalHub()
        self.slots = threading.Semaphore(max(1, spec.slots))
        #: the GPU batches of the integer devices (engine "cuda"): every runtime of a round
        #: runs at once, waiting in its ``train`` for the batch
        self.gpu: GpuFleet | None = None
        if spec.engine == "cuda":
            from coordinator.emulation.gpu import GpuFleet

            self.gpu = GpuFleet(train)
        #: the devices' runtimes run on these threads (kept from round to round); a runtime
        #: waits on its training slot, its I/O (the outbox) overlaps the others' training
        runtimes = max(8, 4 * spec.slots) if self.gpu is None else 4096
        self._threads = ThreadPoolExecutor(runtimes, thread_name_prefix="fedbit-device")
        self._running: set[DeviceRuntime] = set()  # the runtimes running now (stopped by close)
        self._lock = threading.Lock()
        self._closed = False
        self._not_applied: dict[str, str] = {}  # device id -> its runtime's not_applied_logged
        self._feed = self.hub.client("fedbit-worker-feed")
        self._feed.connect()
        updates = topic(spec.job, "round").rsplit("/", 1)[0] + "/update/+"
        self._relay = self.hub.client("fedbit-worker-relay", subscriptions=[updates])
        self._relay.connect()

    def warm_up(self) -> None:
        """One training step and one encoding of each profile of ``spec.profiles``, so
        that the first round does not load kernels (or torch)."""
        if not self.spec.model:
            return
        from edge_client.codecs import decode
        from edge_client.protocol import float32_tensor
        from edge_client.warmup import warm_up

        decode(float32_tensor(np.zeros(4, np.float32), "w"))  # the codecs' import, once

        for prof in self.spec.profiles:
            if prof.trainer == "int":
                warm_up(prof, self.spec.model)
            else:
                from edge_client.trainers import make_trainer
                from firmware_models import resolve_model

                spec = resolve_model(self.spec.model)  # a bundled model or the user's file
                trainer = make_trainer(spec, 32, seed=0)
                one_thread_torch()
                rng = np.random.default_rng(0)
                trainer.train(Dataset(rng.random((8, *spec.input_shape), dtype=np.float32),
                                      rng.integers(0, spec.num_classes, 8).astype(np.int64)), steps=1, batch=8)

    def run_round(self, msgs: RoundMessages, devices: list[EmulatedDevice],
                  emit: Callable[[WorkerEvent], None]) -> None:
        """Publish the round on the hub, run ``devices``' runtimes, and ``emit`` each update
        and each device's end (an update before its device's end); returns when every
        runtime ended."""
        job = self.spec.job
        for variant, payload in msgs.models.items():
            self._feed.publish(topic(job, "model", variant), payload, retain=True)
        self._feed.publish(topic(job, "round"), msgs.announcement, retain=True)
        self._feed.publish(topic(job, "status"), msgs.status, retain=True)
        results: dict[str, str] = {}
        finished: queue.Queue[str] = queue.Queue()
        if self.gpu is not None:
            self.gpu.begin([dev.device_id for dev in devices])

        def run(dev: EmulatedDevice) -> None:
            try:
                self._run(dev, msgs.round_id, results)
            finally:
                finished.put(dev.device_id)

        for dev in devices:
            self._threads.submit(run, dev)
        pending = {dev.device_id for dev in devices}
        attackers = {dev.device_id: dev for dev in devices
                     if dev.attack is not None and dev.attack.acts_in(msgs.round_id)}
        while pending:
            msg = self._relay.recv(timeout=0.02)
            if msg is not None:
                self._forward(msg, msgs, emit, attackers)
                continue
            while True:
                try:
                    dev_id = finished.get_nowait()
                except queue.Empty:
                    break
                while (msg := self._relay.recv(timeout=0)) is not None:  # its update comes first
                    self._forward(msg, msgs, emit, attackers)
                emit(WorkerEvent("end", msgs.round_id, dev_id, state=results.get(dev_id, "failed")))
                pending.discard(dev_id)

    def _forward(self, msg: Received, msgs: RoundMessages, emit: Callable[[WorkerEvent], None],
                 attackers: dict[str, EmulatedDevice]) -> None:
        _, _, dev_id = parse_topic(msg.topic)
        payload = bytes(msg.payload)
        dev = attackers.get(str(dev_id))
        if dev is not None:  # an emulated attacker: its update rewritten on its way out
            from coordinator.emulation.attack import attack_update
            from edge_client.runtime import model_to_shared

            model = msgs.models.get(dev.variant)
            payload = attack_update(dev.attack, payload, model_to_shared(decode_message(model)) if model else None,
                                    derive_seed("attack", dev.device_id, msgs.round_id))
        emit(WorkerEvent("update", msgs.round_id, str(dev_id), payload))

    def _run(self, dev: EmulatedDevice, round_id: int, results: dict[str, str]) -> None:
        from edge_client.trainers import make_trainer

        def trainer_factory(spec: ModelSpec, bits: int, seed: int) -> Trainer:
            trainer = make_trainer(spec, bits, seed=derive_seed(seed, round_id))
            if self.gpu is not None and bits != 32:  # trains in the round's GPU batch
                return self.gpu.trainer(trainer, dev.device_id, dev.shard)
            if "torch" in sys.modules:  # a float device: one torch thread, as everywhere in the emulator
                one_thread_torch()
            return _GatedTrainer(trainer, self.slots)

        def connect(**kw: Any) -> _Quiet:
            kw.pop("birth", None)  # the coordinator knows the fleet from the roster
            return _Quiet(self.hub.client(dev.device_id, **kw))

        cfg = replace(dev.config, workdir=Path(self.spec.workdir) / dev.device_id)
        state = "failed"
        rt = None
        data = self.train.subset(dev.shard)
        if dev.attack is not None and dev.attack.kind == "label_flip" and dev.attack.acts_in(round_id):
            from coordinator.emulation.attack import flip_labels
            from firmware_models import resolve_model

            data = Dataset(data.x, flip_labels(data.y, resolve_model(self.spec.model).num_classes))
        try:
            rt = device_runtime(cfg, data, connect, trainer_factory=trainer_factory,
                               logger=log.getChild("device"))
            rt.not_applied_logged = self._not_applied.get(dev.device_id, "")
            with self._lock:
                self._running.add(rt)
            if not self._closed:
                rt.run(max_seconds=self.spec.wall_timeout_s)
            if rt.not_applied_logged:  # logged once per device, not once per round
                self._not_applied[dev.device_id] = rt.not_applied_logged
            state = "done" if rt.rounds_done else "failed"
        except Exception:  # noqa: BLE001 - a device failing is an event of the round, not of the worker
            log.exception("device %s failed in round %d", dev.device_id, round_id)
        finally:
            with self._lock:
                self._running.discard(rt)
            if self.gpu is not None:
                self.gpu.gone(dev.device_id)
        results[dev.device_id] = state

    def close(self) -> None:
        """Stop the runtimes still running (a round given up on) and the threads."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        for rt in running:
            rt.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)


def one_thread_torch() -> None:
    """Float devices and the evaluator compute with one torch thread each: deterministic
    results (a reduction's order does not depend on the thread count) and no
    oversubscription of the cores the device threads share."""
    try:
        import torch
    except ImportError:  # the coordinator extra is not installed: no float devices then
        return
    torch.set_num_threads(1)


def thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a process's kernels ``threads`` threads (numba, BLAS)."""
    n = str(max(1, int(threads)))
    return {var: n for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def limit_threads(threads: int) -> None:
    """Kernels of this process use ``threads`` threads (numba, BLAS; torch one, as the
    emulator's float devices always do): effective before numba or torch is imported."""
    os.environ.update(thread_env(threads))


def serve(conn: Connection) -> None:
    """A worker process on connection ``conn``: receive ``(WorkerSpec, SharedData)``, build
    a :class:`DeviceWorker` on the shared training split, say ``("ready", pid)``, then
    run each ``(RoundMessages, [EmulatedDevice])`` it receives, sending ``("event",
    WorkerEvent)`` as it goes and ``("idle", round_id, seconds)`` after the round; ``None``
    or a closed connection ends it."""
    spec, data = conn.recv()
    limit_threads(spec.threads)
    from edge_client.intnn.memory import keep_freed_memory, release_compiler_pages

    keep_freed_memory()  # the float devices' activations: reused heap, not fresh pages
    worker = DeviceWorker(data.open(), spec)
    worker.warm_up()
    release_compiler_pages()  # LLVM's machine code, not run again once the kernels are loaded
    lock = threading.Lock()

    def send(item: tuple[object, ...]) -> None:
        with lock:
            conn.send(item)

    send(("ready", os.getpid()))
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        if cmd is None:
            return
        msgs, devices = cmd
        t0 = time.monotonic()
        worker.run_round(msgs, devices, lambda ev: send(("event", ev)))
        send(("idle", msgs.round_id, time.monotonic() - t0))


def main() -> None:
    """Entry of a worker process: ``python -c "...worker import main; main()" FD`` with
    ``FD`` its end of a socket pair to the emulator."""
    from multiprocessing.connection import Connection

    # the emulator stops its workers (a SIGINT sent to this process alone is ignored)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (numba, torch): the outboxes are synced already
