"""What a round announcement asks of one device, in either mode (``RoundAnnouncement.mode``).

A round (``sync``) asks each selected device for one update of that round, until its
deadline. A buffered announcement asks each device it names for one update per ticket,
trained on the current model version; an update of version ``v`` counts while it is
within ``max_staleness`` versions of the current one. These functions answer, for the
device runtime (``edge_client.runtime``), which work is asked for, whether an update of
a round (version) may still count or never will, and which refusals name this device.
"""

from __future__ import annotations

import logging
import time

from edge_client.protocol import RoundAnnouncement


def work_number(a: RoundAnnouncement, device_id: str) -> int:
    """What the device's work for ``a`` is numbered by (it trains once per number, and
    numbers only grow within a run): the round id, or (buffered) its ticket (0: none)."""
    if a.mode != "buffered":
        return a.round_id
    return a.tickets[a.selected.index(device_id)] if device_id in a.selected and a.tickets else 0


def still_counts(a: RoundAnnouncement | None, round_id: int) -> bool:
    """Whether an update of ``round_id`` (buffered: trained on that version) may count now."""
    if a is not None and a.mode == "buffered":
        return a.round_id - a.max_staleness <= round_id <= a.round_id
    return a is not None and a.round_id == round_id and time.time() < a.deadline


def never_counts(a: RoundAnnouncement | None, round_id: int) -> bool:
    """Whether an update of ``round_id`` can no longer count (its round is over; buffered:
    it is more than ``max_staleness`` versions old)."""
    if a is None:
        return False
    if a.mode == "buffered":
        return round_id < a.round_id - a.max_staleness
    return round_id < a.round_id or time.time() >= a.deadline


def outbox_kept(a: RoundAnnouncement, same_run: bool) -> tuple[int | None, bool]:
    """``Outbox.discard_closed``'s arguments on announcement ``a`` (``same_run``: of the run
    the device's updates are from): a round keeps its own round's updates (and, in the
    same run, newer ones); a buffered one those within ``max_staleness`` versions."""
    if a.mode == "buffered":
        return (a.round_id - a.max_staleness if same_run else None), True
    return a.round_id, same_run


def refusals_of(a: RoundAnnouncement, device_id: str) -> list[tuple[int, str]]:
    """``(ticket, reason)`` of the refusals ``a`` lists for ``device_id``."""
    return [(t, why) for dev, t, why in a.refusals if dev == device_id]


class RefusalLog:
    """Logs each refusal of ``device_id``'s updates that announcements list, once."""

    def __init__(self, device_id: str, log: logging.Logger) -> None:
        self.device_id, self.log, self.upto = device_id, log, 0

    def note(self, a: RoundAnnouncement, last_done: int) -> None:
        """The refusals ``a`` lists for requests up to ``last_done`` not logged yet."""
        for ticket, reason in refusals_of(a, self.device_id):
            if self.upto < ticket <= last_done:
                self.log.warning("update for request %d refused by the coordinator: %s", ticket, reason)
                self.upto = ticket
