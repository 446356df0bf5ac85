"""The emulator's workers as Ray actors (``[cluster] backend = "ray"``): imported only
then; Ray is the optional extra ``fedbit[cluster]``.

``address``: ``"auto"`` (the cluster this machine belongs to, as ``ray start`` left it),
``"host:port"`` (a cluster's GCS address), ``"ray://host:port"`` (Ray Client) or
``"local"`` (a new single-machine Ray, stopped with the run). Each actor asks for one CPU
and hosts a :class:`~coordinator.emulation.worker.DeviceWorker`; Ray places the actors on
the cluster's nodes. The training split is put in Ray's object store once (every node
fetches it once, read without a copy on each), each round's messages once per round.
Every node needs fedbit installed as on the machine that runs the emulator.

An actor that dies (its node lost, its process killed) fails its devices for that
round (:meth:`WorkerPool.on_lost`); a new actor takes its place.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from coordinator.emulation.fleet_plan import EmulatedDevice
from coordinator.emulation.worker import (
    DeviceWorker,
    RoundMessages,
    WorkerEvent,
    WorkerSpec,
    limit_threads,
    one_thread_torch,
)
from edge_client.data import Dataset
from edge_client.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from coordinator.emulation.pool import WorkerPool

log = logging.getLogger("fedbit.emulator")


class RayDeviceWorker:
    """The actor: a :class:`DeviceWorker` on the object store's copy of the split, its
    devices' work folders in a temporary folder of its node."""

    def __init__(self, x: np.ndarray, y: np.ndarray, spec: WorkerSpec) -> None:
        limit_threads(spec.threads)
        one_thread_torch()
        from edge_client.intnn.memory import keep_freed_memory

        keep_freed_memory()
        spec = replace(spec, workdir=tempfile.mkdtemp(prefix="fedbit-ray-worker-"))
        self.worker = DeviceWorker(Dataset(x, y), spec)
        self.worker.warm_up()

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Remove the devices' work folders of this actor."""
        shutil.rmtree(self.worker.spec.workdir, ignore_errors=True)

    def run_round(self, msgs: RoundMessages, devices: list[EmulatedDevice]) -> list[WorkerEvent]:
        events: list[WorkerEvent] = []
        self.worker.run_round(msgs, devices, events.append)
        return events


class RayHandle:
    """One actor; each round's call waits on a thread of its own."""

    def __init__(self, index: int, pool: WorkerPool, actor: ActorHandle) -> None:
        self.index = index
        self._pool = pool
        self.actor = actor
        self._lock = threading.Lock()
        self._last: threading.Thread | None = None
        self._lost = False
        #: set once the actor answered (it started and warmed up); one that fails before
        #: is not replaced (another would fail alike: fedbit missing on its node, ...)
        self.ready = threading.Event()
        self._last = threading.Thread(target=self._ping, name=f"fedbit-ray-{index}-start", daemon=True)
        self._last.start()

    def _ping(self) -> None:
        import ray

        try:
            ray.get(self.actor.pid.remote())
        except ray.exceptions.RayError as exc:
            self._fail(f"Ray actor {self.index} did not start: {exc}")
            return
        self.ready.set()

    def _fail(self, why: str) -> None:
        with self._lock:
            if self._lost:
                return
            self._lost = True
        self._pool.on_lost(self, why)

    def alive(self) -> bool:
        return not self._lost

    def submit(self, msgs: ObjectRef, devices: list[EmulatedDevice]) -> None:
        import ray

        ref = self.actor.run_round.remote(msgs, devices)  # actors run their calls in order

        def wait(previous: threading.Thread | None) -> None:
            if previous is not None:
                previous.join()
            try:
                events = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self._fail(f"Ray actor {self.index} failed: {type(exc).__name__}")
                return
            for ev in events:
                self._pool.on_event(self, ev)

        with self._lock:
            th = threading.Thread(target=wait, args=(self._last,), name=f"fedbit-ray-{self.index}", daemon=True)
            self._last = th
        th.start()

    def stop(self) -> None:
        import ray

        with self._lock:
            self._lost = True
        try:
            ray.get(self.actor.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - gone, or busy past the wait: its node keeps the folder
            pass
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def describe(self) -> str:
        return f"Ray actor {self.index}"


class RayBackend:
    """Workers as Ray actors (see the module docstring)."""

    name = "ray"

    def __init__(self, address: str, train: Dataset, spec: WorkerSpec) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("cluster.backend = \"ray\" needs Ray: pip install 'fedbit[cluster]'") from None
        self.address = address
        self._owns = not ray.is_initialized()
        if self._owns:
            try:
                ray.init(address=None if address == "local" else address, logging_level=logging.WARNING,
                         configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"cluster.address {address!r}: cannot connect to Ray: {exc}") from None
        self.spec = spec
        self.cpus = int(ray.cluster_resources().get("CPU", 1))
        self.nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        self._x, self._y = ray.put(train.x), ray.put(train.y)
        self._actor = ray.remote(num_cpus=1, max_restarts=0)(RayDeviceWorker)

    def start(self, index: int, pool: WorkerPool) -> RayHandle:
        return RayHandle(index, pool, self._actor.remote(self._x, self._y, self.spec))

    def share(self, msgs: RoundMessages) -> ObjectRef:
        import ray

        return ray.put(msgs)

    def close(self) -> None:
        import ray

        if self._owns and ray.is_initialized():
            ray.shutdown()

    def describe(self) -> dict[str, Any]:
        return {"backend": "ray", "address": self.address, "cluster_cpus": self.cpus, "nodes": self.nodes}
