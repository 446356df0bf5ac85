"""Which selected devices of the open round can still answer, so that a round waits for
them and for nobody else.

A selected device is *gone* for the round when

- ``refused``: its update was refused for what it holds (non-finite, malformed, wrong
  shapes, out of range, oversized, too many samples) or because the device is no longer
  enrolled: it sends no other;
- ``silent``: it acknowledged an earlier round's announcement (a presence message with
  that round's id: devices of this version do, at once) but not this one's within
  ``ack_timeout_s`` of the announcement: alive for the broker, perhaps, but not at work.

The round then closes as soon as every selected device answered or is gone (the gone ones
are its stragglers), not at the deadline. A device that never acknowledged a round (an
older version, an emulated fleet) is waited for until the deadline, as before.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

#: refusal reasons of an update after which its device cannot answer the round
FINAL_REASONS = frozenset({"nonfinite", "malformed", "wrong_shape", "out_of_range", "oversized",
                           "too_many_samples", "unenrolled"})


class RoundWatch:
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
        #: device -> why it is gone this round (``refused``, ``silent``)
        self.gone: dict[str, str] = {}
        self._swept = False

    def open(self, round_id: int, selected: Collection[str], now: float | None = None) -> None:
        """A round starts (its announcement goes out now)."""
        self.round_id, self.selected = round_id, selected
        self.started = time.monotonic() if now is None else now
        self.acked, self.gone, self._swept = set(), {}, False

    def ack(self, device_id: str, round_id: int) -> None:
        """``device_id`` acknowledged the announcement of ``round_id``."""
        self.ackers.add(device_id)
        if round_id == self.round_id and device_id in self.selected:
            self.acked.add(device_id)

    def refused(self, device_id: str, reason: str) -> None:
        """An update of ``device_id`` was refused for ``reason``."""
        if reason in FINAL_REASONS and device_id in self.selected:
            self.gone.setdefault(device_id, "refused")

    def settled(self, accepted: Mapping[str, Any] | Collection[str], now: float | None = None) -> bool:
        """Whether every selected device answered (``accepted``) or is gone; marks the
        silent ones once ``ack_timeout_s`` has passed."""
        if self.round_id is None:
            return False
        if not self._swept and self.ack_timeout_s > 0 and self.ackers and \
                (time.monotonic() if now is None else now) - self.started >= self.ack_timeout_s:
            self._swept = True
            for d in self.ackers & set(self.selected):
                if d not in self.acked and d not in accepted:
                    self.gone.setdefault(d, "silent")
        gone = sum(1 for d in self.gone if d not in accepted)
        return bool(self.selected) and len(accepted) + gone >= len(self.selected)

    def report(self, accepted: Mapping[str, Any] | Collection[str]) -> dict[str, list[str]]:
        """The round's gone devices that did not answer after all, by reason."""
        out: dict[str, list[str]] = {}
        for d, why in sorted(self.gone.items()):
            if d not in accepted:
                out.setdefault(why, []).append(d)
        return out
