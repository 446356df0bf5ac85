"""The simulated clock: :class:`SimLinks` (each device's link and compute model),
:func:`calibrate` (seconds per sample of each variant on this machine) and
:class:`EmulatedFleet`, which puts that clock between the coordinator and the real fleet
of a job in rounds (``coordinator.emulation.eventclock``: in buffered mode). Device
availability (``coordinator.emulation.availability``) reaches the coordinator as presence
messages at their simulated time. See :mod:`coordinator.emulation.emulator`."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.devices import Cohort
from coordinator.emulation.availability import Availability
from coordinator.emulation.fleet_plan import FleetPlan, derive_seed
from coordinator.emulation.secure import SecureDevices, drop_phase
from coordinator.emulation.worker import RoundMessages, one_thread_torch
from coordinator.fleet import Fleet, Inbound
from edge_client.errors import ProtocolError
from edge_client.protocol import (
    Presence,
    RoundAnnouncement,
    Update,
    decode_message,
    encode_message,
    topic,
)

if TYPE_CHECKING:
    from coordinator.emulation.pool import WorkerPool

log = logging.getLogger("fedbit.emulator")

__all__ = ["EmulatedFleet", "SimLinks", "calibrate", "one_thread_torch", "presence_message"]

def presence_message(job: str, device_id: str, online: bool) -> Inbound:
    """A device's presence change as the coordinator receives it (made, not received)."""
    return Inbound("presence", device_id, encode_message(Presence(device_id, online)), time.monotonic(),
                   topic(job, "presence", device_id))  # (no receipt: nothing to ack)


@dataclass
class SimLinks:
    """The simulated link and compute model (see the module docstring). Times in s."""

    plan: FleetPlan
    seconds_per_sample: Mapping[str, float]
    seed: int

    def dropped(self, device_id: str, round_id: int) -> bool:
        """Whether the device's round is lost (probability ``loss_rate``, drawn from the run
        seed, the device and the round)."""
        p = self.plan.profile(device_id).loss_rate
        return p > 0 and np.random.default_rng(derive_seed("loss", self.seed, device_id, round_id)).random() < p

    def samples(self, device_id: str, hparams: Mapping[str, Any]) -> int:
        """Samples the device trains on in a round announced with ``hparams``: ``steps`` x
        ``batch``, else ``epochs`` x its shard."""
        return int(hparams.get("steps") or 0) * int(hparams.get("batch", 32)) \
            or int(hparams.get("epochs", 1)) * self.plan.num_samples(device_id)

    def compute_seconds(self, device_id: str, samples: int) -> float:
        """Seconds this machine takes to train ``samples`` on the device's variant."""
        return samples * self.seconds_per_sample[self.plan.variant(device_id)]

    def arrival(self, device_id: str, model_bytes: int, samples: int, update_bytes: int) -> float:
        """Simulated seconds from the round's start to the update's arrival."""
        g, _ = self.plan.locate(device_id)
        prof = g.profile
        lat = prof.latency_ms / 1e3
        down = model_bytes * 8 / (prof.downlink_kbps * 1e3) + lat
        compute = samples * self.seconds_per_sample[g.variant] / prof.relative_speed
        up = update_bytes * 8 / (prof.uplink_kbps * 1e3) + lat
        return down + compute + up


def calibrate(model: str, variants: list[str], sample: Any, *, batch: int = 32, steps: int = 4) -> dict[str, float]:
    """Seconds per training sample of each variant's trainer on this machine (one thread,
    after a warm-up step that compiles the kernels); the best of ``steps`` timed steps."""
    one_thread_torch()  # as the emulated devices train (torch's default uses every core)
    from edge_client.protocol import variant_bits
    from edge_client.trainers import make_trainer
    from firmware_models import resolve_model

    spec = resolve_model(model)
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




@dataclass
class _SimRound:
    round_id: int
    selected: list[str]
    started: list[str]
    lost: list[str]
    model_bytes: dict[str, int]
    hparams: dict[str, Any]
    t0: float  # wall (monotonic)
    sim_t0: float = 0.0  # simulated start
    pending: dict[str, tuple[float, Inbound]] = field(default_factory=dict)
    train_seconds: dict[str, float] = field(default_factory=dict)
    out: deque = field(default_factory=deque)
    final: bool = False
    report: dict[str, Any] = field(default_factory=dict)
    secure: SecureDevices | None = None  # a secure round's devices (coordinator.emulation.secure)


class EmulatedFleet(Fleet):
    """A :class:`Fleet` that puts the simulated clock between the coordinator and a real
    fleet (see the module docstring).

    Args:
        inner: the real fleet (MQTT or in-process).
        host: runs the selected devices (:class:`~coordinator.emulation.pool.WorkerPool`)
            and registers the fleet (its roster).
        links: the simulated link and compute model.
        quorum: the fraction of the selected whose updates close a round.
        deadline_s: the simulated round deadline (0: none; the round closes at the last
            arrival).
        wall_timeout_s: a started device that has not answered after this many wall
            seconds counts as failed.
        on_progress: called (from the coordinator's thread, while it waits for updates)
            with the workers' :class:`~coordinator.emulation.pool.Progress` as fields
            whenever it changed.
        availability: when devices are online (None: always). A selected device whose
            session ends before its update arrives is lost (``sim_offline``); the changes
            of a round's simulated time reach the coordinator after its updates, and while
            it waits for ``need`` present devices between rounds the clock moves on to
            the changes that bring them.
        until_s: the simulated time budget (0: none): no round starts past it.
    """

    def __init__(self, inner: Fleet, host: WorkerPool, links: SimLinks, *, quorum: float,
                 deadline_s: float, wall_timeout_s: float,
                 on_progress: Callable[[dict[str, Any]], None] | None = None,
                 availability: Availability | None = None, need: int = 1, until_s: float = 0.0) -> None:
        self.inner = inner
        self.job = inner.job
        self.host = host
        self.links = links
        self.quorum = quorum
        self.deadline_s = deadline_s
        self.wall_timeout_s = wall_timeout_s
        self.sim_time = 0.0
        self.on_progress = on_progress
        self._shown: Any = None
        self._round: _SimRound | None = None
        self.availability = availability if availability is not None and not availability.always else None
        self.need = need
        self.until_s = until_s
        self._between: deque[Inbound] = deque()  # presence changes made while the coordinator waits
        self._waited = 0.0  # simulated seconds waited for devices since the last round started
        self._identities: dict[str, bytes] = {}  # the devices' secure-aggregation identities

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
        if msg.receipt is not None:  # (a secure round's device messages, presence changes: made here)
            self.inner.ack(msg)

    def send(self, device_id: str, payload: bytes) -> None:
        """A secure round's message to one device: its emulated half answers at once."""
        rnd = self._round
        reply = rnd.secure.answer(device_id, payload) if rnd is not None and rnd.secure is not None else None
        if reply is not None:
            rnd.out.append(Inbound("secagg", device_id, reply, time.monotonic(), f"secagg/{device_id}"))

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"emulated links over {self.inner.describe()}"

    def roster(self) -> list[Cohort]:
        return self.host.roster()

    def offline(self) -> list[str]:
        return self.availability.offline_at(0.0) if self.availability else []

    def now(self) -> float:
        return self.sim_time

    def done(self) -> bool:
        return bool(self.until_s) and self.sim_time >= self.until_s

    # the round
    def announce_round(self, models: Mapping[str, bytes], announcement: bytes, status: bytes) -> None:
        ann = decode_message(announcement)
        assert isinstance(ann, RoundAnnouncement)
        self.inner.announce_round(models, announcement, status)
        self.inner.flush()  # the round is retained before any device connects
        selected = list(ann.selected)
        av = self.availability
        lost = [d for d in selected if self.links.dropped(d, ann.round_id)
                or av is not None and not av.online(d, self.sim_time)]
        secure = None
        if "secagg" in ann.hparams:  # lost devices drop at a phase; those past the first train
            drops = {d: drop_phase(self.links.seed, d, ann.round_id) for d in lost}
            secure = SecureDevices(ann, self._identities, drops)
            lost = [d for d in lost if drops[d] == "keys"]
        started = [d for d in selected if d not in lost]
        self._round = _SimRound(ann.round_id, selected, started, lost, {v: len(p) for v, p in models.items()},
                                dict(ann.hparams), time.monotonic(), self.sim_time, secure=secure)
        costs = {d: self.links.compute_seconds(d, self.links.samples(d, ann.hparams)) for d in started}
        self.host.activate(ann.round_id, started, RoundMessages(ann.round_id, dict(models), announcement, status),
                           costs)

    def recv(self, timeout: float) -> Inbound | None:
        end = time.monotonic() + timeout
        while True:
            rnd = self._round
            if rnd is not None and rnd.out:
                return rnd.out.popleft()
            if self._between or (rnd is None or rnd.final) and self._wait_for_devices():
                return self._between.popleft()
            msg = self.inner.recv(timeout=max(0.0, min(0.05, end - time.monotonic())))
            if msg is not None and not self._hold(msg):
                return msg
            self._show_progress()
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

    def _wait_for_devices(self) -> bool:
        """Between rounds, with fewer than ``need`` devices online: move the clock on to the
        changes that bring them (queued as presence messages); whether it did."""
        av = self.availability
        if av is None:
            return False
        online = len(self.links.plan) - len(av.offline_at(self.sim_time))
        prev = t = self.sim_time
        while online < self.need and (t := av.next_change(t)) < math.inf:
            for _, d, on in av.changes(prev, t):
                self._between.append(presence_message(self.job, d, on))
                online += 1 if on else -1
            prev = t
        if not self._between:
            return False
        self._waited += prev - self.sim_time
        self.sim_time = prev
        return True

    def _show_progress(self) -> None:
        if self.on_progress is None or self._round is None:
            return
        p = self.host.progress()
        if p != self._shown:
            self._shown = p
            self.on_progress(asdict(p))

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
        samples = self.links.samples(m.device_id, rnd.hparams)
        variant = self.links.plan.variant(m.device_id)
        t = self.links.arrival(m.device_id, rnd.model_bytes.get(variant, 0), samples, len(msg.payload))
        rnd.pending[m.device_id] = (t, msg)
        rnd.train_seconds[m.device_id] = m.train_seconds
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
        av = self.availability
        gone = sorted(d for t, d in arrivals if av is not None and av.session_end(d, rnd.sim_t0) < rnd.sim_t0 + t)
        for d in gone:  # offline before its update arrived: the update is lost with it
            self.inner.ack(rnd.pending[d][1])
        arrivals = [(t, d) for t, d in arrivals if d not in gone]
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
        if rnd.secure is None:
            rnd.out.extend(rnd.pending[d][1] for _, d in sorted(chosen, key=lambda x: x[1]))
        for _, d in sorted(chosen, key=lambda x: x[1]) if rnd.secure is not None else ():
            msg = rnd.pending[d][1]
            self.inner.ack(msg)  # the update stays here: the device's secure half takes it
            keys = rnd.secure.keys(msg.payload)
            if keys is not None:
                rnd.out.append(Inbound("secagg", d, keys[1], time.monotonic(), f"secagg/{d}"))
        if av is not None:  # who came and went meanwhile, after the round's updates
            rnd.out.extend(presence_message(self.job, d, on) for _, d, on in av.changes(rnd.sim_t0, self.sim_time))
        failed = sorted(d for d in rnd.started if d not in rnd.pending)
        compute = [rnd.train_seconds.get(d, 0.0) for _, d in chosen]
        rnd.report = {
            "sim_round_seconds": duration, "sim_time": self.sim_time,
            "sim_dropouts": len(rnd.lost), "sim_late": len(late), "sim_failed": len(failed),
            "sim_dropout_ids": sorted(rnd.lost), "sim_late_ids": sorted(late), "sim_failed_ids": failed,
            "device_train_seconds": float(sum(compute)),
            "device_wall_seconds": time.monotonic() - rnd.t0,
        }
        if av is not None:
            rnd.report |= {"sim_offline": len(gone), "sim_offline_ids": gone, "sim_wait_seconds": self._waited,
                           "sim_available": len(self.links.plan) - len(av.offline_at(rnd.sim_t0))}
            self._waited = 0.0
        rnd.final = True
