"""Which selected devices are at work: the acknowledgements of a round.

Devices acknowledge each announcement that selects them (a presence message with the
round's id, sent at once: ``edge_client.session.RoundAck``). A selected device that
acknowledged an earlier round but not this one within ``ack_timeout_s`` of the
announcement is *silent*: alive for the broker, perhaps, but not at work; the collector
takes it for gone (a straggler at once, :meth:`Collector.device_gone`) instead of holding
the round to its deadline. A device that never acknowledged a round (an older SDK, an
emulated fleet) is waited for until the round's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Collection


class AckWatch:
    """See the module docstring; ``ack_timeout_s`` 0 turns the silence rule off.

    Memory: the ids of the devices that ever acknowledged a round (at most the registry's
    size), and the open round's acknowledgements.
    """

    def __init__(self, ack_timeout_s: float = 10.0) -> None:
        self.ack_timeout_s = float(ack_timeout_s)
        self.ackers: set[str] = set()
        self.round_id: int | None = None
        self.selected: Collection[str] = frozenset()
        self.started = 0.0
        self.acked: set[str] = set()
        self._swept = False

    def open(self, round_id: int, selected: Collection[str], now: float | None = None) -> None:
        """A round starts (its announcement goes out now)."""
        self.round_id, self.selected = round_id, selected
        self.started = time.monotonic() if now is None else now
        self.acked, self._swept = set(), False

    def ack(self, device_id: str, round_id: int) -> None:
        """``device_id`` acknowledged the announcement of ``round_id``."""
        self.ackers.add(device_id)
        if round_id == self.round_id and device_id in self.selected:
            self.acked.add(device_id)

    def silent(self, answered: Collection[str], now: float | None = None) -> list[str]:
        """Once ``ack_timeout_s`` has passed (and only once a round): the selected devices
        that acknowledged an earlier round but neither this one nor answered (sorted)."""
        if self._swept or self.round_id is None or not self.ack_timeout_s or not self.ackers or \
                (time.monotonic() if now is None else now) - self.started < self.ack_timeout_s:
            return []
        self._swept = True
        return sorted(d for d in self.ackers & set(self.selected) if d not in self.acked and d not in answered)
