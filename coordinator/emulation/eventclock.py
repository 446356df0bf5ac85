"""The simulated clock of a buffered job: requests, update arrivals, presence changes and
request timeouts are events in simulated time.

:class:`BufferedEmulatedFleet` sits between the buffered coordinator and the real fleet as
``clock.EmulatedFleet`` does for rounds. A new ticket is a request at the current
simulated time: its device starts in the workers on the announced version (the
announcement re-dated in wall time for it) unless the request is lost (``loss_rate``);
its update arrives after download, compute and upload (``SimLinks``) unless the device's
session ends first. Events reach the coordinator one at a time in simulated order (then
kind: presence, arrival, timeout; then device id), each once no device still training
can arrive before it (an arrival's earliest time is known at the request), so the
coordinator reacts to each at its simulated time and the run does not depend on the
wall clock. A request unanswered ``timeout_s`` after it was made wakes the coordinator
(a presence message that changes nothing) so that it frees the slot.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from coordinator.devices import Cohort
from coordinator.emulation.availability import Availability
from coordinator.emulation.emulated_fleet import SimLinks, presence_message
from coordinator.emulation.worker import RoundMessages
from coordinator.fleet import Fleet, Inbound
from edge_client.errors import ProtocolError
from edge_client.protocol import RoundAnnouncement, Update, decode_message, encode_message

if TYPE_CHECKING:
    from coordinator.emulation.pool import WorkerPool


@dataclass
class _Flight:
    """One request in the workers: its device, ticket, simulated start, the earliest its
    update can arrive, its arrival once the update is there, and the worker batch."""

    device: str
    ticket: int
    t0: float
    lower: float
    batch: int
    wall0: float
    samples: int
    model_bytes: int
    arrival: float | None = None
    msg: Inbound | None = None
    lost: bool = False
    timed_out: bool = False


class BufferedEmulatedFleet(Fleet):
    """See the module docstring.

    Args:
        inner: the real fleet (MQTT or in-process).
        host: runs the requested devices and registers the fleet (its roster).
        links: the simulated link and compute model.
        timeout_s: simulated seconds after which an unanswered request wakes the
            coordinator (it frees the slot then; inf: never).
        wall_timeout_s: a started device that has not answered after this many wall
            seconds counts as failed (its update never arrives).
        availability: when devices are online (None: always).
        until_s: the simulated time budget (0: none): no version is applied past it.
        on_progress: the workers' progress, as :class:`EmulatedFleet` reports it.
    """

    def __init__(self, inner: Fleet, host: WorkerPool, links: SimLinks, *, timeout_s: float,
                 wall_timeout_s: float, availability: Availability | None = None, until_s: float = 0.0,
                 on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.inner = inner
        self.job = inner.job
        self.host = host
        self.links = links
        self.timeout_s = timeout_s
        self.wall_timeout_s = wall_timeout_s
        self.availability = availability if availability is not None and not availability.always else None
        self.on_progress = on_progress
        self.until_s = until_s
        self.sim_time = 0.0
        self._flights: dict[tuple[str, int], _Flight] = {}
        self._dropped: set[tuple[str, int]] = set()  # requests whose update is lost: dropped on arrival
        self._seen: dict[str, int] = {}  # device -> the last ticket it was given
        self._models: dict[str, bytes] = {}
        self._batch = 0
        self._out: deque[Inbound] = deque()
        self._changes: list[tuple[float, str]] = []
        if self.availability is not None:
            self._changes = [(s.next_change(0.0), d) for d, s in self.availability.sessions.items()]
            heapq.heapify(self._changes)
        self._shown: Any = None
        self.lost = 0  # updates lost: request dropped, device gone offline, worker failed
        self.lost_ids: list[str] = []

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
        if msg.receipt is not None:  # (a presence change made here: nothing to ack)
            self.inner.ack(msg)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"simulated clock (buffered) over {self.inner.describe()}"

    def roster(self) -> list[Cohort]:
        return self.host.roster()

    def offline(self) -> list[str]:
        return self.availability.offline_at(0.0) if self.availability else []

    def now(self) -> float:
        return self.sim_time

    def done(self) -> bool:
        return bool(self.until_s) and self.sim_time >= self.until_s

    def round_report(self, round_id: int) -> dict[str, Any]:
        av = self.availability
        out = {"sim_time": self.sim_time, "sim_lost": self.lost, "sim_lost_ids": sorted(self.lost_ids),
               "sim_training": sum(1 for f in self._flights.values() if not f.lost)}
        if av is not None:
            out["sim_available"] = len(self.links.plan) - len(av.offline_at(self.sim_time))
        self.lost, self.lost_ids = 0, []
        return out

    # ------------------------------------------------------------------ requests

    def announce_round(self, models: Mapping[str, bytes], announcement: bytes, status: bytes) -> None:
        ann = decode_message(announcement)
        assert isinstance(ann, RoundAnnouncement)
        self.inner.announce_round(models, announcement, status)
        if models:
            self._models = dict(models)
        new = [(d, t) for d, t in zip(ann.selected, ann.tickets, strict=True) if t > self._seen.get(d, 0)]
        if not new:
            return
        self._batch += 1
        started = []
        for d, t in new:
            self._seen[d] = t
            samples = self.links.samples(d, ann.hparams)
            model_bytes = len(self._models.get(self.links.plan.variant(d), b""))
            lower = self.sim_time + self.links.arrival(d, model_bytes, samples, 0)
            f = _Flight(d, t, self.sim_time, lower, self._batch, time.monotonic(), samples, model_bytes)
            self._flights[(d, t)] = f
            if self.links.dropped(d, t):
                self._lose(f)
            else:
                started.append(d)
        if started:  # the devices get the announcement with a deadline in wall time
            wall = encode_message(replace(ann, deadline=time.time() + self.wall_timeout_s))
            costs = {d: self.links.compute_seconds(d, self._flights[(d, self._seen[d])].samples) for d in started}
            self.host.activate(self._batch, started, RoundMessages(self._batch, dict(self._models), wall, status),
                               costs, add=True)

    def _lose(self, f: _Flight) -> None:
        """``f``'s update will not arrive: dropped if it comes; the request stays until its
        timeout wakes the coordinator."""
        f.lost = True
        self.lost += 1
        self.lost_ids.append(f.device)
        if f.msg is not None:
            self.inner.ack(f.msg)
        else:
            self._dropped.add((f.device, f.ticket))
        if math.isinf(self.timeout_s) or f.timed_out:
            del self._flights[(f.device, f.ticket)]

    # ------------------------------------------------------------------ events

    def recv(self, timeout: float) -> Inbound | None:
        end = time.monotonic() + timeout
        while True:
            if self._out:
                return self._out.popleft()
            msg = self.inner.recv(timeout=0.0)
            if msg is not None and not self._hold(msg):
                return msg
            if msg is not None:
                continue
            self._check_workers()
            if self._release():
                continue
            self._show_progress()
            left = end - time.monotonic()
            if left <= 0:
                return None
            msg = self.inner.recv(timeout=min(0.02, left))
            if msg is not None and not self._hold(msg):
                return msg

    def _hold(self, msg: Inbound) -> bool:
        """Keep a device's update until its arrival time (True: held, or dropped because
        its request's update was lost)."""
        if msg.kind != "update":
            return False
        try:
            m = decode_message(msg.payload)
        except ProtocolError:
            return False  # the coordinator refuses it, with its reason
        if not isinstance(m, Update):
            return False
        key = (msg.device_id, m.ticket)
        if key in self._dropped:
            self._dropped.discard(key)
            self.inner.ack(msg)
            return True
        f = self._flights.get(key)
        if f is None or f.msg is not None or f.lost:
            return False
        f.arrival = f.t0 + self.links.arrival(f.device, f.model_bytes, f.samples, len(msg.payload))
        f.msg = msg
        return True

    def _check_workers(self) -> None:
        """Requests whose device failed in its worker, or ran out of wall time: lost."""
        now = time.monotonic()
        for f in list(self._flights.values()):
            if f.msg is None and not f.lost and (self.host.failed(f.device, f.batch)
                                                 or now - f.wall0 > self.wall_timeout_s):
                self._lose(f)

    def _release(self) -> bool:
        """Queue the next event when no earlier one can still come; whether it did."""
        av = self.availability
        best: tuple[float, int, str] | None = None
        if self._changes:
            t, d = self._changes[0]
            best = (t, 0, d)
        for f in self._flights.values():
            if f.msg is not None and not f.lost:
                cand = (f.arrival, 1, f.device)
                if best is None or cand < best:
                    best = cand
            if not f.timed_out and self.timeout_s < math.inf:
                cand = (f.t0 + self.timeout_s, 2, f.device)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return False
        t = best[0]
        if math.isinf(t):
            return False
        for f in self._flights.values():  # a device still training that could arrive first
            if f.msg is None and not f.lost and f.lower <= t and (av is None or av.session_end(f.device, f.t0) > f.lower):
                return False
        self.sim_time = max(self.sim_time, t)
        _, kind, dev = best
        if kind == 0:
            heapq.heappop(self._changes)
            online = av.online(dev, t)
            heapq.heappush(self._changes, (av.sessions[dev].next_change(t), dev))
            if not online:  # what it was training is lost with it
                for f in [f for f in self._flights.values() if f.device == dev and not f.lost]:
                    self._lose(f)
            self._out.append(presence_message(self.job, dev, online))
        elif kind == 1:
            f = min((f for f in self._flights.values() if f.device == dev and f.msg is not None and not f.lost
                     and f.arrival == t), key=lambda f: f.ticket)
            del self._flights[(f.device, f.ticket)]
            self._out.append(f.msg)
        else:
            f = min((f for f in self._flights.values() if f.device == dev and not f.timed_out
                     and f.t0 + self.timeout_s == t), key=lambda f: f.ticket)
            f.timed_out = True
            if f.lost:
                del self._flights[(f.device, f.ticket)]  # (its update, if it comes, is dropped)
            self._out.append(presence_message(self.job, dev, av is None or av.online(dev, t)))
        return True

    def more_expected(self, round_id: int) -> bool:
        return bool(self._out or self._flights or self._changes and self._changes[0][0] < math.inf)

    def _show_progress(self) -> None:
        if self.on_progress is None:
            return
        p = self.host.progress()
        if p != self._shown:
            self._shown = p
            self.on_progress(asdict(p))
