"""The emulator's workers: :class:`WorkerPool` runs each round's selected devices in
:class:`~coordinator.emulation.worker.DeviceWorker` s and publishes their updates to the real
fleet.

Backends (``round.workers``, ``[cluster] backend``):

- one worker in this process (``workers = 1``: the single process of old; ``workers =
  0``, auto, starts here and moves to processes once a round is heavy: ``grow``);
- :class:`ProcessBackend`: ``workers`` processes on this machine, each with
  ``max(1, cores // workers)`` kernel threads, the training split shared with them
  through tmpfs (:class:`~coordinator.emulation.worker.SharedData`: opened memory-mapped,
  not copied);
- Ray actors, one per CPU they are given (``coordinator.emulation.ray_backend``, imported
  only for ``backend = "ray"``; the split and each round's messages go to Ray's object
  store once).

Per round the pool deals the started devices to the workers (the costliest first, each
to the least loaded worker: ties to the lowest index), sends each worker the round's
messages once with its devices (made from the :class:`~coordinator.emulation.fleet_plan.FleetPlan`
then), and publishes every update a worker hands back on that device's update topic of
the real fleet (in-process hub or broker: the same bytes, QoS 1) through one relay
session. Which worker trains a device changes nothing in what it sends: its seeds come
from the run seed, its id and the round.

A worker lost mid-round (its process killed, its actor dead) leaves its devices that had
not sent their update ``failed`` (stragglers of that round on the simulated clock); a new
worker takes its place at once, for the next round.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from coordinator.devices import Cohort
from coordinator.emulation.fleet_plan import EmulatedDevice, FleetPlan
from coordinator.emulation.worker import (
    DeviceWorker,
    RoundMessages,
    SharedData,
    WorkerEvent,
    WorkerSpec,
    thread_env,
)
from edge_client.data import Dataset
from edge_client.protocol import topic

log = logging.getLogger("fedbit.emulator")


class Handle(Protocol):
    """One worker as the pool sees it."""

    index: int

    def submit(self, msgs: Any, devices: list[EmulatedDevice]) -> None:
        """Queue a round (``msgs``: the backend's :meth:`Backend.share` of the round's
        messages) without waiting."""

    def stop(self) -> None:
        """End the worker (waits a little, then kills it)."""

    def describe(self) -> str:
        """What it runs on (``pid 1234``, ``ray actor ...``)."""


class Backend(Protocol):
    """Makes workers: ``start(index, pool)`` returns a :class:`Handle` that reports to
    ``pool.on_event(handle, event)`` and ``pool.on_lost(handle, why)``."""

    name: str

    def start(self, index: int, pool: WorkerPool) -> Handle: ...

    def share(self, msgs: RoundMessages) -> Any:
        """The round's messages as workers receive them (Ray: a reference in its object
        store, put there once)."""

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


def machine_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- in-process


class InlineHandle:
    """The single worker of ``workers = 1``: a :class:`DeviceWorker` in this process, its
    rounds run one after the other on a thread of their own."""

    def __init__(self, index: int, pool: WorkerPool, train: Dataset, spec: WorkerSpec) -> None:
        self.index = index
        self.worker = DeviceWorker(train, spec)
        self.worker.warm_up()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, args=(pool,), name="fedbit-worker-0", daemon=True)
        self._thread.start()

    def _loop(self, pool: WorkerPool) -> None:
        while (item := self._queue.get()) is not None:
            msgs, devices = item
            cpu0 = time.process_time()
            self.worker.run_round(msgs, devices, lambda ev: pool.on_event(self, ev))
            pool.on_round_cpu(self, time.process_time() - cpu0)

    def submit(self, msgs: Any, devices: list[EmulatedDevice]) -> None:
        self._queue.put((msgs, devices))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)
        self.worker.close()

    def describe(self) -> str:
        return "this process"


class InlineBackend:
    name = "inline"

    def __init__(self, train: Dataset, spec: WorkerSpec) -> None:
        self.train, self.spec = train, spec

    def start(self, index: int, pool: WorkerPool) -> Handle:
        return InlineHandle(index, pool, self.train, self.spec)

    def share(self, msgs: RoundMessages) -> Any:
        return msgs

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": "local", "processes": 0}


# --------------------------------------------------------------------------- processes


class ProcessHandle:
    """A worker process (``python -c ...worker.main()``, :func:`~coordinator.emulation.worker.serve`)
    on one end of a socket pair, and the two threads that talk to it: one sends the
    queued rounds, one reads its events. (A plain subprocess, not ``multiprocessing``:
    nothing of the caller's ``__main__`` is imported again in it.)"""

    def __init__(self, index: int, pool: WorkerPool, spec: WorkerSpec, data: SharedData) -> None:
        self.index = index
        self._pool = pool
        mine, theirs = socket.socketpair()
        env = dict(os.environ) | thread_env(spec.threads)
        # (a process group of its own: a terminal's Ctrl-C reaches the emulator, which stops it)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from coordinator.emulation.worker import main; main()", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, process_group=0)
        theirs.close()
        self._conn = Connection(mine.detach())
        self.pid: int | None = self.proc.pid
        self.ready = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put((spec, data))
        self._stopping = False
        self._lost = False
        self._lock = threading.Lock()
        threading.Thread(target=self._send_loop, name=f"fedbit-worker-{index}-send", daemon=True).start()
        threading.Thread(target=self._read_loop, name=f"fedbit-worker-{index}-read", daemon=True).start()

    def submit(self, msgs: Any, devices: list[EmulatedDevice]) -> None:
        self._queue.put((msgs, devices))

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._conn.send(item)
            except (OSError, ValueError) as exc:  # the process is gone: the reader reports it
                self._gone(f"send failed: {exc}")
                return
            if item is None:  # the process ends after its rounds
                return

    def _read_loop(self) -> None:
        while True:
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._gone("its connection closed" if isinstance(exc, EOFError) else str(exc))
                return
            if kind == "ready":
                self.ready.set()
            elif kind == "event":
                self._pool.on_event(self, rest[0])

    def _gone(self, why: str) -> None:
        with self._lock:
            if self._lost or self._stopping:
                return
            self._lost = True
        try:
            code = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        self._pool.on_lost(self, f"worker process {self.pid} ended ({why}, exit code {code})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request_stop(self) -> None:
        """Tell the process to end after its rounds (:meth:`stop` waits for it)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._queue.put(None)

    def stop(self) -> None:
        self.request_stop()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)
        self._conn.close()

    def describe(self) -> str:
        return f"pid {self.pid}"


class ProcessBackend:
    """``workers`` processes on this machine (see the module docstring)."""

    name = "processes"

    def __init__(self, train: Dataset, spec: WorkerSpec) -> None:
        self.data = SharedData.create(train)
        self.spec = spec

    def start(self, index: int, pool: WorkerPool) -> Handle:
        return ProcessHandle(index, pool, self.spec, self.data)

    def share(self, msgs: RoundMessages) -> Any:
        return msgs

    def close(self) -> None:
        self.data.remove()

    def describe(self) -> dict[str, Any]:
        return {"backend": "local", "processes": True, "threads_per_worker": self.spec.threads}


# --------------------------------------------------------------------------- the pool


@dataclass(frozen=True)
class Progress:
    """The open round as the workers run it: devices started, done (sent or failed),
    failed; workers, and how many have devices still running."""

    round: int
    started: int
    done: int
    failed: int
    workers: int
    busy: int


class WorkerPool:
    """The devices' host for :class:`~coordinator.emulation.emulated_fleet.EmulatedFleet` (see the
    module docstring).

    Args:
        plan: the fleet.
        backend: makes the workers.
        workers: how many.
        relay: a connected transport of the real fleet that publishes the updates.
        job: the job id (the update topics).
        grow: ``workers = 0`` (auto): makes the worker processes (a backend and how many)
            once a round run in this process took more than ``grow_after_cpu_s`` CPU
            seconds; rounds go to them from the first round after they are all ready.
    """

    def __init__(self, plan: FleetPlan, backend: Backend, workers: int, relay: Any, job: str, *,
                 grow: Callable[[], tuple[Backend, int]] | None = None, grow_after_cpu_s: float = 0.25) -> None:
        self.plan = plan
        self.backend = backend
        self.relay = relay
        self.job = job
        self.lost = 0  # workers lost and replaced over the run
        self.grown_at: int | None = None  # (auto) the first round the worker processes trained
        self._lock = threading.Lock()
        self._relay_lock = threading.Lock()
        self._closing = False
        self._round = 0
        self._state: dict[str, str] = {}  # device id -> running | sent | done | failed (this round)
        self._batch: dict[str, int] = {}  # device id -> the round (batch) it was last started for
        self._where: dict[str, Handle] = {}
        self._grow = grow
        self._grow_after = grow_after_cpu_s
        self._growing = False
        self._next: tuple[Backend, list[Handle]] | None = None  # (auto) started, maybe not ready
        self._retired: list[tuple[Backend, list[Handle]]] = []
        self.handles: list[Handle] = []
        try:
            for i in range(max(1, workers)):
                self.handles.append(backend.start(i, self))
        except BaseException:
            self.close()
            raise

    def roster(self) -> list[Cohort]:
        return self.plan.roster()

    def activate(self, round_id: int, ids: list[str], msgs: RoundMessages,
                 costs: Mapping[str, float] | None = None, *, add: bool = False) -> None:
        """Run devices ``ids`` for round ``round_id`` (``costs``: their expected training
        work, to balance the workers); ``add``: beside the devices of earlier rounds still
        running (a buffered job's requests: ``round_id`` numbers each batch)."""
        costs = costs or {}
        with self._lock:
            if self._next is not None and all(_ready(h) for h in self._next[1]):
                self._retired.append((self.backend, self.handles))
                (self.backend, self.handles), self._next = self._next, None
                self.grown_at = round_id
                log.info("round %d: %d worker processes train from now on", round_id, len(self.handles))
            self._round = round_id
            if not add:
                self._state, self._batch, self._where = {}, {}, {}
            self._state.update(dict.fromkeys(ids, "running"))
            self._batch.update(dict.fromkeys(ids, round_id))
            handles = list(self.handles)
            loads = [0.0] * len(handles)
            shares: list[list[str]] = [[] for _ in handles]
            for d in sorted(ids, key=lambda d: (-costs.get(d, 1.0), d)):
                k = min(range(len(handles)), key=lambda j: (loads[j], j))
                shares[k].append(d)
                loads[k] += costs.get(d, 1.0)
            self._where.update({d: handles[k] for k, share in enumerate(shares) for d in share})
        shared = self.backend.share(msgs) if ids else None
        for h, share in zip(handles, shares, strict=True):
            if share:
                h.submit(shared, [self.plan.device(d) for d in sorted(share)])

    def failed(self, device_id: str, round_id: int) -> bool:
        """Whether the device started for ``round_id`` ended without sending its update."""
        with self._lock:
            return self._batch.get(device_id) == round_id and self._state.get(device_id) == "failed"

    def assignment(self) -> dict[str, int]:
        """Device id -> index of the worker that trains it in the open round."""
        with self._lock:
            return {d: h.index for d, h in self._where.items()}

    def progress(self) -> Progress:
        with self._lock:
            running = {d for d, s in self._state.items() if s == "running"}
            busy = len({id(self._where[d]) for d in running if d in self._where})
            return Progress(self._round, len(self._state), len(self._state) - len(running),
                            sum(1 for s in self._state.values() if s == "failed"), len(self.handles), busy)

    # ------------------------------------------------------------------ from the workers

    def on_round_cpu(self, handle: Handle, cpu_s: float) -> None:
        """A worker in this process ran a round in ``cpu_s`` CPU seconds (auto: more than
        ``grow_after_cpu_s`` starts the worker processes)."""
        with self._lock:
            if self._grow is None or self._growing or self._closing or cpu_s <= self._grow_after:
                return
            self._growing = True
        threading.Thread(target=self._start_processes, name="fedbit-workers-start", daemon=True).start()

    def _start_processes(self) -> None:
        assert self._grow is not None
        try:
            backend, n = self._grow()
            handles = [backend.start(i, self) for i in range(n)]
        except Exception:  # noqa: BLE001 - the run goes on in this process
            log.exception("starting the worker processes failed; the devices keep training in this process")
            return
        with self._lock:
            if not self._closing:
                self._next = (backend, handles)
                return
        for h in handles:
            h.stop()
        backend.close()

    def on_event(self, handle: Handle, ev: WorkerEvent) -> None:
        """A worker's event (called from its thread)."""
        if ev.kind == "update":
            ok = self._publish(ev.device_id, ev.payload)
            with self._lock:
                if ev.round_id == self._batch.get(ev.device_id) and self._state.get(ev.device_id) == "running":
                    self._state[ev.device_id] = "sent" if ok else "failed"
        elif ev.kind == "end":
            with self._lock:
                if ev.round_id == self._batch.get(ev.device_id):
                    s = self._state.get(ev.device_id)
                    if s == "running":
                        self._state[ev.device_id] = "failed"  # ended without an update
                    elif s == "sent":
                        self._state[ev.device_id] = "done"

    def _publish(self, device_id: str, payload: bytes) -> bool:
        """The update, unchanged, on the device's update topic of the real fleet."""
        try:
            with self._relay_lock:
                ok = self.relay.publish(topic(self.job, "update", device_id), payload, qos=1, timeout=30.0)
        except Exception as exc:  # noqa: BLE001 - a lost update is the device's failure, not the run's
            log.warning("relaying the update of %s failed: %s", device_id, exc)
            return False
        if not ok:
            log.warning("relaying the update of %s: the broker did not acknowledge it", device_id)
        return bool(ok)

    def on_lost(self, handle: Handle, why: str) -> None:
        """A worker is gone: its devices still running this round failed; a new worker
        takes its index."""
        with self._lock:
            if self._closing:
                return
            gone = sorted(d for d, h in self._where.items() if h is handle and self._state.get(d) == "running")
            for d in gone:
                self._state[d] = "failed"
            self.lost += 1
            group, backend = ((self._next[1], self._next[0]) if self._next is not None and handle in self._next[1]
                              else (self.handles, self.backend))
        if not _ready(handle):  # it never started: another would fail alike
            log.error("%s before it was ready; not starting another", why)
            return
        if handle not in group:
            return
        log.warning("%s; %d device(s) of round %d lost with it; starting a new worker", why, len(gone),
                    self._round, extra={"event": "worker_lost", "round": self._round, "devices": gone})
        new = backend.start(handle.index, self)
        with self._lock:
            stale = self._closing or group[handle.index] is not handle
            if not stale:
                group[handle.index] = new
        if stale:
            new.stop()

    def describe(self) -> dict[str, Any]:
        """Workers, backend, and (auto) the first round the worker processes trained."""
        out = {"workers": len(self.handles), **self.backend.describe(), "auto": self._grow is not None}
        if self.grown_at is not None:
            out["processes_from_round"] = self.grown_at
        return out

    def close(self) -> None:
        """Stop every worker and release what the backends hold."""
        with self._lock:
            self._closing = True
            groups = [(self.backend, self.handles), *self._retired, *([self._next] if self._next else [])]
        for _, handles in groups:  # every worker told first, then each waited for
            for h in handles:
                getattr(h, "request_stop", lambda: None)()
        for backend, handles in groups:
            for h in handles:
                h.stop()
            backend.close()


def _ready(handle: Handle) -> bool:
    """Whether a worker can take a round (a process: it said ready)."""
    ev = getattr(handle, "ready", None)
    return ev is None or ev.is_set()


def wait_ready(pool: WorkerPool, timeout: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait until every worker process said it is ready (in-process and Ray workers are
    ready when made); False after ``timeout`` s."""
    end = clock() + timeout
    for h in pool.handles:
        ev = getattr(h, "ready", None)
        while ev is not None and not ev.wait(min(0.1, max(0.0, end - clock()))):
            if clock() >= end or not h.alive():
                return False
    return True
