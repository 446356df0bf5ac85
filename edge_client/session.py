"""A device's broker session over time: the first connect, a session lost and regained,
and giving up after too long without one (``fedbit-edge run --connect-timeout``).

The transport does the backing off (capped, jittered: :mod:`edge_client.transport.mqtt`);
this only waits, logs why there is no session (a refused password reads "not authorised:
this device may be revoked") and decides when to stop trying. :class:`RoundAck` is what the
device says on its session when a round selects it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.protocol import RoundAnnouncement
    from edge_client.transport.base import Transport


class SessionWatch:
    """Args:
        give_up_after_s: seconds without a session (at the start or after losing it)
            after which :attr:`failure` is set; 0: never.
        attempt_s: how long one connect attempt is waited for (a warning after each).
        stop: set when the device is asked to stop (ends every wait at once).
        log: where the warnings go.
    """

    def __init__(self, give_up_after_s: float, attempt_s: float, stop: threading.Event,
                 log: logging.Logger, who: str) -> None:
        self.give_up_after_s = give_up_after_s
        self.attempt_s = attempt_s
        self.stop = stop
        self.log = log
        self.who = who
        self.down_since: float | None = None
        #: why the device gives up ("" while it does not)
        self.failure = ""

    def first(self, t: Transport, end: float = math.inf) -> bool:
        """Connect ``t``; False when stopped, past ``end`` (a monotonic time) or given up."""
        start = time.monotonic()
        give_up = self.give_up_after_s
        while not self.stop.is_set():
            left = min(end, start + give_up if give_up > 0 else math.inf) - time.monotonic()
            try:
                t.connect(timeout=max(0.05, min(self.attempt_s, left)), cancel=self.stop)
                return True
            except ConnectionError as exc:
                if self.stop.is_set():
                    return False
                waited = time.monotonic() - start
                if give_up > 0 and waited >= give_up:
                    self._give_up(f"no session with the broker after {waited:.0f} s ({exc})")
                    return False
                if time.monotonic() >= end:
                    return False
                self.log.warning("no session yet: %s; retrying (%s)", exc,
                                 f"giving up in {give_up - waited:.0f} s" if give_up > 0 else "until stopped")
        return False

    def watch(self, t: Transport) -> bool:
        """Log a lost and a regained session; False once the device gives up."""
        now = time.monotonic()
        if t.connected:
            if self.down_since is not None:
                self.log.info("session with the broker back after %.0f s", now - self.down_since)
            self.down_since = None
            return True
        why = getattr(t, "last_error", "") or "no reason given"
        if self.down_since is None:
            self.log.warning("lost the session with the broker (%s); reconnecting", why)
            self.down_since = now
        elif self.give_up_after_s > 0 and now - self.down_since >= self.give_up_after_s:
            self._give_up(f"no session with the broker for {now - self.down_since:.0f} s ({why})")
        return not self.failure

    def _give_up(self, why: str) -> None:
        self.failure = why
        self.log.error("device %s gives up: %s", self.who, why)


class RoundAck:
    """A device's acknowledgement of the announcements that select it: a presence message
    (online, the round id; not retained) once per announcement received, so that the
    coordinator knows at once that a selected device is at work (and takes one that stays
    silent for a straggler long before the deadline); a round announced again is
    acknowledged again."""

    def __init__(self, job: str, device_id: str) -> None:
        from edge_client.protocol import topic

        self.topic = topic(job, "presence", device_id)
        self.device_id = device_id
        self._last: RoundAnnouncement | None = None  # the announcement acknowledged last

    def send(self, transport: Transport | None, announcement: RoundAnnouncement,
             timeout: float) -> None:
        """Acknowledge ``announcement`` (a RoundAnnouncement) unless it already was."""
        from edge_client.protocol import Presence, encode_message

        if transport is None or announcement is self._last:
            return
        self._last = announcement
        transport.publish(self.topic, encode_message(Presence(self.device_id, True, round_id=announcement.round_id)),
                          qos=1, timeout=timeout)
