"""Devices that knock on a job nobody serves, seen by a coordinator that hears every job of
its broker (``MqttFleet(watch_jobs=True)``: the embedded anonymous broker).

A device started without ``--job`` (or with a wrong one) says hello on
``fedbit/<its job>/hello/<id>``; when no coordinator keeps a status on that job, it waits
for nothing. :class:`JobsOnBroker` remembers which jobs have a coordinator status and
which devices said hello on other jobs, and reports each such device once, after
:attr:`JobsOnBroker.settle_s` (retained statuses and hellos arrive in any order).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.errors import ProtocolError
from edge_client.protocol import parse_topic


@dataclass(frozen=True)
class Knock:
    """Device ``device_id`` said hello on job ``job``, which has no coordinator."""

    device_id: str
    job: str


class JobsOnBroker:
    """See the module docstring. ``limit`` bounds the devices remembered (a flood of
    hellos on other jobs costs a bounded amount of memory)."""

    settle_s = 1.0

    def __init__(self, job: str, limit: int = 1000) -> None:
        self.job = job
        self.limit = limit
        self.served: set[str] = {job}  # jobs with a coordinator status
        self._pending: dict[tuple[str, str], float] = {}  # (device, job) -> first seen
        self._reported: set[tuple[str, str]] = set()

    def status(self, topic_name: str, payload: bytes) -> None:
        """A coordinator status (retained, or published now) on ``topic_name``."""
        try:
            job, _, _ = parse_topic(topic_name)
        except ProtocolError:
            return
        if payload:
            self.served.add(job)

    def knock(self, topic_name: str, payload: bytes, now: float) -> None:
        """A hello on another job's topic (``now``: ``time.monotonic()``)."""
        try:
            job, _, device = parse_topic(topic_name)
        except ProtocolError:
            return
        key = (device or "", job)
        if payload and device and key not in self._reported and len(self._pending) < self.limit:
            self._pending.setdefault(key, now)

    def due(self, now: float) -> list[Knock]:
        """The devices to report now: said hello at least :attr:`settle_s` ago on a job
        with no coordinator status, not reported before (each is reported once)."""
        out = []
        for key, t in list(self._pending.items()):
            if now - t < self.settle_s:
                continue
            del self._pending[key]
            if key[1] in self.served or len(self._reported) >= self.limit:
                continue
            self._reported.add(key)
            out.append(Knock(*key))
        return out
