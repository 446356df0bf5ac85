"""The open buffer: which updates it admits, and how each is weighed and folded.

:class:`Requests` holds the devices asked to train (one numbered request, a *ticket*,
each) and which of them hold a concurrency slot. :class:`BufferWindow` is the open
buffer as :class:`~coordinator.ingest.Ingest` sees it: an update (after the per-message
rules of ``ingest``) must answer its device's open request (else ``not_selected``, or
``dropped_closed`` for a request already answered, replaced or refused), hold a delta
(``wrong_content``), be trained on a published version (``wrong_round``) and be at most
``max_staleness`` versions old (``stale``: refused, the reason kept for the announcement
so the device logs it). Any answer closes the request and frees its slot. Updates
replayed from the inbox skip these checks (they passed them once). :class:`BufferFold`
is what the collector folds with: the update's movement scaled by ``η·s(τ)``
(``EncodedUpdate.scale``), then the strategy's own fold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.buffered.settings import BufferedSettings
from coordinator.ingest import OpenRound, Rejected
from coordinator.strategies.round import RoundStrategy
from coordinator.strategies.types import AggregateResult, EncodedUpdate
from edge_client.protocol import Hello, Update

#: refusals an announcement lists (the most recent; older ones fall off)
MAX_REFUSALS = 256


class Requests:
    """Open requests by device (``tickets``), the devices holding a slot (``slots``: when
    they got it, on the fleet's clock), the last ticket issued, recent refusals."""

    def __init__(self, tickets: Mapping[str, int] | None = None, last_ticket: int = 0, now: float = 0.0) -> None:
        self.tickets: dict[str, int] = dict(tickets or {})
        self.last_ticket = max([int(last_ticket), *self.tickets.values()])
        self.slots: dict[str, float] = dict.fromkeys(self.tickets, now)
        self.refusals: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self.refused = False  # a refusal was added since the last announcement

    def issue(self, device_id: str, now: float) -> int:
        """A new request of ``device_id`` at ``now`` (it replaces an open one); its ticket."""
        self.last_ticket += 1
        self.tickets[device_id] = self.last_ticket
        self.slots[device_id] = now
        return self.last_ticket

    def close(self, device_id: str) -> None:
        """``device_id`` answered: its request is closed, its slot free."""
        self.tickets.pop(device_id, None)
        self.slots.pop(device_id, None)

    def release(self, device_id: str) -> None:
        """Free the slot (the device left, or took too long); its request stays open until
        it answers or is asked again."""
        self.slots.pop(device_id, None)

    def refuse(self, device_id: str, ticket: int, reason: str) -> None:
        """Note why ``device_id``'s answer to ``ticket`` was refused (the announcements list
        each device's last refusal, the :data:`MAX_REFUSALS` most recent)."""
        self.refusals.pop(device_id, None)
        self.refusals[device_id] = (ticket, reason[:200])
        while len(self.refusals) > MAX_REFUSALS:
            self.refusals.popitem(last=False)
        self.refused = True

    def refusal_list(self) -> tuple[tuple[str, int, str], ...]:
        return tuple((d, t, why) for d, (t, why) in self.refusals.items())


@dataclass
class Entry:
    """One update in the buffer: its device, ticket, base version, staleness τ and the
    weight ``η·s(τ)`` its movement counted with."""

    device: str
    ticket: int
    base: int
    staleness: int
    weight: float

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "ticket": self.ticket, "base": self.base, "staleness": self.staleness,
                "weight": self.weight}


@dataclass
class BufferWindow(OpenRound):
    """The buffer that will make version ``round_id`` from version ``version``
    (``round_id - 1``); ``round_id`` also names its inbox log. See the module docstring."""

    version: int = 0
    settings: BufferedSettings = field(default_factory=BufferedSettings)
    requests: Requests = field(default_factory=Requests)
    entries: list[Entry] = field(default_factory=list)
    #: updates come from the inbox: admitted as they were the first time
    replaying: bool = False
    _admitted: dict[str, Entry] = field(default_factory=dict)

    def admit(self, m: Update, completed: int) -> None:
        req, dev, ticket, base = self.requests, m.device_id, m.ticket, m.round_id
        if self.replaying:
            if req.tickets.get(dev) == ticket:
                req.close(dev)
        else:
            if ticket == 0 or req.tickets.get(dev) != ticket:
                if 0 < ticket <= req.last_ticket:
                    raise Rejected("closed", f"request {ticket} of {dev} is not open (answered, replaced or "
                                   "refused)", dropped=True)
                raise Rejected("not_selected", f"{dev} has no open request {ticket}")
            req.close(dev)
            if m.content != "delta":
                self._refuse(dev, ticket, "wrong_content", f"{m.content!r}: buffered mode takes the update "
                             "relative to the version it trained on (\"delta\")")
            if base > self.version:
                self._refuse(dev, ticket, "wrong_round", f"trained on version {base}, which is not published "
                             f"(current {self.version})")
            if self.version - base > self.settings.max_staleness:
                self._refuse(dev, ticket, "stale", f"staleness {self.version - base} > max_staleness "
                             f"{self.settings.max_staleness} (trained on version {base}, current {self.version})")
        tau = self.version - base
        self._admitted[dev] = Entry(dev, ticket, base, tau, self.settings.weight(tau))

    def _refuse(self, dev: str, ticket: int, reason: str, detail: str) -> None:
        self.requests.refuse(dev, ticket, f"{reason}: {detail}")
        raise Rejected(reason, detail)

    def take(self, device_id: str) -> Entry:
        """The entry :meth:`admit` made for ``device_id``'s update (to fold it)."""
        return self._admitted.pop(device_id)

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.settings.buffer_size


class BufferFold:
    """The collector's strategy in buffered mode: scales each update by its entry's
    weight, folds it with ``strategy``, adds the entry to the buffer and calls
    ``on_fold(entry)``; every other call goes to ``strategy`` unchanged."""

    def __init__(self, strategy: RoundStrategy, window: Callable[[], BufferWindow],
                 on_fold: Callable[[Entry], None]) -> None:
        self.strategy = strategy
        self.name = strategy.name
        self._window = window
        self._on_fold = on_fold

    def fold(self, update: EncodedUpdate) -> None:
        w = self._window()
        entry = w.take(update.device_id)
        update.scale = entry.weight
        self.strategy.fold(update)
        w.entries.append(entry)
        self._on_fold(entry)

    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        self.strategy.begin_round(round_id, global_weights)

    def finish(self) -> AggregateResult:
        return self.strategy.finish()

    def device_hparams(self, hparams: Mapping[str, Any], devices: Sequence[Hello] = ()) -> dict[str, Any]:
        return self.strategy.device_hparams(hparams, devices)

    def server_state(self) -> dict[str, Any]:
        return self.strategy.server_state()

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(state)
