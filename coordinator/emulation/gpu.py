"""``round.engine = "cuda"``: a worker's integer devices of a round train together on the
GPU (``edge_client.intnn.cuda.fleet``), every other step of their rounds unchanged (the
real device runtimes download, encode and publish as on the CPU).

Each integer device's trainer is a :class:`GpuTrainer`: its ``train`` plans the call
(``IntTrainer.plan``) and waits; once every device of the round has either called
``train`` or ended (:meth:`GpuFleet.gone`), the waiting calls run as one batch on the GPU
and each returns its device's report. Batching changes no result (each device's
computation is its own), so a device that is late (more than :data:`GATHER_S` after the
last arrival) only starts another batch. The training split lives on the GPU for the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.data import Dataset

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.fleet import FleetJob
    from edge_client.trainers import IntTrainer, TrainReport

#: seconds without a new ``train`` call after which the waiting calls run without the rest
GATHER_S = 5.0


@dataclass
class _Call:
    job: FleetJob
    done: threading.Event = field(default_factory=threading.Event)
    report: TrainReport | None = None
    error: BaseException | None = None


class GpuFleet:
    """The rendezvous of one worker's devices (see the module docstring); ``train``: the
    worker's training split, whose images go to the GPU once."""

    def __init__(self, train: Dataset) -> None:
        from edge_client.intnn.cuda.fleet import ResidentData

        self.data = ResidentData(train.x)
        self._cond = threading.Condition()
        self._expected: set[str] = set()
        self._waiting: dict[str, _Call] = {}
        self._last = time.monotonic()
        self.batches = 0  # GPU batches run (tests and logs)

    def begin(self, device_ids: list[str]) -> None:
        """A round starts with these devices."""
        with self._cond:
            self._expected |= set(device_ids)
            self._last = time.monotonic()

    def trainer(self, trainer: IntTrainer, device_id: str, rows: np.ndarray) -> GpuTrainer:
        return GpuTrainer(self, trainer, device_id, np.asarray(rows, np.int64))

    def gone(self, device_id: str) -> None:
        """The device's runtime ended (whether or not it trained)."""
        with self._cond:
            self._expected.discard(device_id)
            ready = self._ready()
        if ready:
            self._run(ready)

    def submit(self, device_id: str, job: FleetJob) -> TrainReport:
        """Queue ``job`` (a ``FleetJob``); returns its report once its batch ran."""
        call = _Call(job)
        with self._cond:
            self._waiting[device_id] = call
            self._last = time.monotonic()
            ready = self._ready()
        if ready:
            self._run(ready)
        while not call.done.wait(0.05):
            with self._cond:
                late = (device_id in self._waiting
                        and time.monotonic() - self._last > GATHER_S)
                ready = self._take() if late else None
            if ready:
                self._run(ready)
        if call.error is not None:
            raise call.error
        return call.report

    def _ready(self) -> dict[str, _Call] | None:
        """Under the lock: the waiting calls, taken, when every expected device waits."""
        if self._waiting and set(self._waiting) >= self._expected:
            return self._take()
        return None

    def _take(self) -> dict[str, _Call]:
        calls, self._waiting = self._waiting, {}
        self._expected -= set(calls)
        return calls

    def _run(self, calls: dict[str, _Call]) -> None:
        from edge_client.intnn.cuda.fleet import train_together

        ordered = [calls[k] for k in sorted(calls)]
        try:
            reports = train_together([c.job for c in ordered], self.data)
        except BaseException as exc:  # noqa: BLE001 - every device of the batch fails with it
            for c in ordered:
                c.error = exc
                c.done.set()
            return
        self.batches += 1
        for c, rep in zip(ordered, reports, strict=True):
            c.report = rep
            c.done.set()


class GpuTrainer:
    """An integer device's ``IntTrainer`` whose ``train`` runs in its worker's GPU batch;
    everything else is the trainer's own."""

    def __init__(self, fleet: GpuFleet, trainer: IntTrainer, device_id: str, rows: np.ndarray) -> None:
        self._fleet = fleet
        self._trainer = trainer
        self._device_id = device_id
        self._rows = rows

    def train(self, data: Dataset, **kwargs: Any) -> TrainReport:
        from edge_client.intnn.cuda.fleet import FleetJob

        if len(data) != len(self._rows):
            raise ValueError(f"{self._device_id}: {len(data)} samples for a shard of {len(self._rows)}")
        plan = self._trainer.plan(data, **kwargs)
        return self._fleet.submit(self._device_id, FleetJob(self._trainer, plan, self._rows))

    def __getattr__(self, name: str) -> Any:  # the wrapped trainer's
        return getattr(self._trainer, name)
