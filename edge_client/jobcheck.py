"""Is there a coordinator for this device's job on its broker?

A coordinator keeps a retained status on ``fedbit/<job>/status`` from its start (its last
will too), so a device that connected and saw none within :attr:`CoordinatorCheck.after_s`
seconds is on a job nobody serves: most often a missing or wrong ``--job``. The check then
listens on ``fedbit/+/status`` for a moment (where the broker allows it) to name the jobs
that do have a coordinator, logs one warning saying so, and stops listening; a status that
arrives later is logged once too. It never stops the device: a coordinator may start later.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from edge_client.protocol import topic

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.transport.base import Transport

#: the topic filter of every job's coordinator status
ALL_STATUS = topic("x", "status").replace("/x/", "/+/")


class CoordinatorCheck:
    """Args:
        job: the device's job id.
        log: where the warning goes.
        after_s: seconds after the first connect without a status of ``job`` before the
            device says so.
        listen_s: how long the jobs of the broker are listened for then.
    """

    def __init__(self, job: str, log: logging.Logger, after_s: float = 5.0, listen_s: float = 1.0) -> None:
        self.job = job
        self.log = log
        self.after_s = after_s
        self.listen_s = listen_s
        self.seen = False  # a status of this job arrived
        self.warned = False
        self.jobs: set[str] = set()  # other jobs with a coordinator status
        self._started: float | None = None
        self._listening: float | None = None

    def status(self, job: str) -> None:
        """A coordinator status of ``job`` arrived (this device's job or another)."""
        if job != self.job:
            if len(self.jobs) < 20:
                self.jobs.add(job)
            return
        if not self.seen and self.warned:
            self.log.info("a coordinator for job %r is on the broker now", self.job)
        self.seen = True

    def other_job(self, job: str, kind: str, payload: bytes) -> bool:
        """Note a received message's topic (a coordinator status); True when it is another
        job's, which the device ignores."""
        if kind == "status" and payload:
            self.status(job)
        return job != self.job

    def tick(self, t: Transport, now: float) -> None:
        """Called from the device loop (``now``: ``time.monotonic()``); acts while ``t`` is
        connected."""
        if self.seen or self.warned or not t.connected:
            return
        if self._started is None:
            self._started = now
        if self._listening is None and now - self._started >= self.after_s:
            subscribe = getattr(t, "subscribe", None)
            if subscribe is None:
                self._warn()
                return
            subscribe(ALL_STATUS)
            self._listening = now
        elif self._listening is not None and now - self._listening >= self.listen_s:
            unsubscribe = getattr(t, "unsubscribe", None)
            if unsubscribe is not None:
                unsubscribe(ALL_STATUS)
            self._warn()

    def _warn(self) -> None:
        self.warned = True
        if self.seen:
            return
        others = sorted(self.jobs)
        hint = (f"jobs seen: {', '.join(others)} (start the device with --job {others[0]}?)" if len(others) == 1
                else f"jobs seen: {', '.join(others)} (pick one with --job)" if others
                else "jobs seen: none (the coordinator may not have started yet)")
        self.log.warning("no coordinator for job %r on this broker (no status on %s after %g s); %s; "
                         "waiting for one", self.job, topic(self.job, "status"), self.after_s, hint)
