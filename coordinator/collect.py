"""The inbound side of the round loop: messages from the fleet into the strategy's sums,
made durable, then acknowledged.

:class:`Collector` takes what :meth:`Fleet.recv` delivers in batches: hello and presence
messages update the :class:`~coordinator.devices.DeviceRegistry`; an update goes
:meth:`Ingest.update` (every per-update rule, once) -> :meth:`Strategy.fold` (into the
running sums) -> the inbox. The inbox append, the group ``fdatasync`` and the acks run in
the :class:`~coordinator.commit.AckCommitter`'s background threads; nothing is acked before
the sync that covers it, and refused messages are acked too (never redelivered), logged
with their reason and counted (``rejected_<reason>`` / ``dropped_<reason>``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.commit import AckCommitter
from coordinator.defense.reputation import STRIKE_REASONS
from coordinator.devices import DeviceRegistry
from coordinator.fleet import Fleet, Inbound
from coordinator.ingest import Ingest, OpenRound, Rejected
from coordinator.ops.knocks import JobsOnBroker
from coordinator.ops.untrusted import safe_text
from coordinator.presence.roundwatch import AckWatch
from coordinator.presence.selection import NotEnoughDevices, draw
from coordinator.state import RunState
from coordinator.strategies.round import RoundStrategy
from edge_client.errors import ProtocolError
from edge_client.hparams import not_applied_level
from edge_client.protocol import Presence

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from coordinator.config import ServerConfig
    from edge_client.codecs.tensor import EncodedTensor


def _names(ids: list[str], most: int = 20) -> str:
    """``: a, b, c`` (the first ``most`` ids, then how many more); empty for none."""
    if not ids:
        return ""
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return ": " + ", ".join(ids[:most]) + more


def codec_label(tensors: Sequence[EncodedTensor]) -> str:
    """``<codec>-<bits>`` of an update's first layer (devices use one codec), ``mixed`` when
    its layers use different codecs."""
    codecs = {t.codec for t in tensors}
    if len(codecs) != 1:
        return "mixed" if codecs else "none"
    return f"{tensors[0].codec}-{tensors[0].bits}"


class Stopwatch:
    """Wall and CPU seconds the coordinator itself spends on a round (s)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.parts: dict[str, float] = {}

    @contextmanager
    def timed(self, part: str = "") -> Iterator[None]:
        """Count the block's time (wall and this thread's CPU); ``parts[part]`` also gets
        its wall seconds."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.wall += dt
            self.cpu += time.thread_time() - c0
            if part:
                self.parts[part] = self.parts.get(part, 0.0) + dt


class Collector:
    """Receives, checks, folds, persists and acknowledges; see the module docstring.

    Args:
        fleet: where messages come from (and acks go).
        ingest: the per-message rules.
        strategy: folds accepted updates (``fold``).
        state: the run directory (the inbox).
        on_event: progress callback (``update``, ``reject``, ``device`` events).
        logger: where refusals are logged.
    """

    def __init__(self, fleet: Fleet, ingest: Ingest, strategy: RoundStrategy, state: RunState, *,
                 on_event: Callable[[str, dict[str, Any]], None], logger: logging.Logger,
                 ack_timeout_s: float = 10.0) -> None:
        self.fleet = fleet
        self.ingest = ingest
        self.strategy = strategy
        self.state = state
        self.on_event = on_event
        self.log = logger
        self.devices = DeviceRegistry()
        self.round: OpenRound | None = None
        self.completed = 0  # the last closed round: older updates are late
        self.counts: Counter[str] = Counter()  # this round's refusals (and stragglers)
        self.totals: Counter[str] = Counter()
        self.uplink_bytes: Counter[str] = Counter()  # this round's accepted payload bytes by codec
        #: this round's devices whose update was refused for its content (reason), and
        #: those whose sample claim was cut to its bound (the reputation's strikes)
        self.refused_devices: dict[str, str] = {}
        self.over_claimed: set[str] = set()
        #: the selected devices' acknowledgements of the open round (silent ones are gone)
        self.acks = AckWatch(ack_timeout_s)
        self.clock = Stopwatch()
        #: most messages handled before they go to the committer, which syncs every batch
        #: queued since its last sync at once (group commit). Small batches let the sync
        #: of one overlap the decoding of the next (docs/performance.md#codecs-and-the-coordinators-update-path)
        self.batch_max = 8
        #: appends the accepted updates to the inbox, syncs, then acks, in two background
        #: threads while ``pump`` goes on (the append's checksum and write release the GIL)
        self.committer: AckCommitter[Inbound, tuple[int, str, bytes]] = AckCommitter(
            lambda: self.state.inbox_sync(), lambda m: self.fleet.ack(m),
            persist=lambda rec: self.state.inbox_append(*rec))
        self._to_persist: list[tuple[int, str, bytes]] = []
        #: handles secure-aggregation messages (``coordinator.privacy.round.Privacy.handle``;
        #: None: they are refused); raises Rejected
        self.on_secure: Callable[[Inbound], None] | None = None
        #: handles what ingest worker processes report (``kind == "ingest"``;
        #: ``coordinator.ingest_workers``; None: refused as a bad topic)
        self.on_ingest: Callable[[Inbound], None] | None = None
        #: devices present when the last round's devices were selected
        self.present = 0
        #: (device, what it reported) already logged at WARNING: a device that reports the
        #: same setting not applied every round is logged once, then at DEBUG (still counted)
        self._reported: set[tuple[str, str]] = set()
        #: which jobs of the broker have a coordinator, and devices knocking on the others
        self.jobs = JobsOnBroker(getattr(fleet, "job", "default"))
        self._gone_until: dict[str, float] = {}  # gone device -> when the round stops waiting for it

    def select(self, cfg: ServerConfig, rng: np.random.Generator, quarantined: frozenset[str] = frozenset()) -> list[str]:
        """Wait (bounded by ``cfg.presence_timeout_s``: :class:`NotEnoughDevices`) until
        ``max(min_devices, min_present)`` devices are present, then select ``clamp(ceil(fraction * eligible), min, max)`` of
        the present ones not ``quarantined`` with ``rng`` (:func:`~coordinator.presence.selection.draw`);
        sorted ids. A revoked device is taken offline first."""
        self.drop_revoked()
        devices = self.devices
        end = time.monotonic() + cfg.presence_timeout_s
        last_note = 0.0
        need = max(cfg.min_devices, cfg.min_present)
        waited = False
        while len(devices.present()) < need:
            waited = True
            if time.monotonic() >= end:
                raise NotEnoughDevices(f"only {len(devices.present())} device(s) present after "
                                       f"{cfg.presence_timeout_s:.0f} s; need {need}")
            if time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                self.on_event("waiting", {"present": len(devices.present()), "need": need})
            self.pump(min(end, time.monotonic() + 0.5))
        if waited:  # let hellos that arrive together settle
            self.pump(time.monotonic() + 0.05)
        present = devices.present()
        self.present = len(present)
        return draw(cfg, present, rng, frozenset(d for d in quarantined if d in devices.hellos and devices.is_online(d)))

    def drop_revoked(self) -> None:
        """Take the present devices that are no longer enrolled offline (a revoked device is
        offline, whatever its last presence message said)."""
        enrolled = self.ingest.enrolled
        if enrolled is None:
            return
        for d in [d for d in self.devices.present() if enrolled.key(d) is None]:
            self.devices.apply(Presence(d, False))
            self._device_changed(d, "left")

    def new_round(self) -> None:
        """Reset the per-round counters and the stopwatch (before selection)."""
        self.counts = Counter()
        self.uplink_bytes = Counter()
        self.refused_devices, self.over_claimed = {}, set()
        self.clock = Stopwatch()

    def open(self, rnd: OpenRound) -> None:
        """Collect updates for ``rnd`` (the strategy's round must be begun)."""
        self.round = rnd
        self.acks.open(rnd.round_id, rnd.selected)

    def close(self, completed: int) -> None:
        """No round is open; updates of rounds up to ``completed`` are late from now on."""
        self.round = None
        self.completed = completed

    # ------------------------------------------------------------------ messages

    def handle_batch(self, batch: list[Inbound], *, background: bool = False) -> None:
        """Handle messages, make the accepted updates durable with one sync (group
        commit), then acknowledge every message (refused ones too: never redelivered).
        Nothing is acked when persisting fails (the exception propagates).

        ``background``: the appends, the sync and the acks are left to :attr:`committer`
        (same order, same rule); the caller must :meth:`AckCommitter.drain` it before the
        round ends (:meth:`pump` does).
        """
        with self.clock.timed():
            self._to_persist = []
            for msg in batch:
                if msg.kind == "update":
                    self.update(msg.device_id, msg.payload)
                elif msg.kind in ("hello", "presence"):
                    try:
                        m = self.ingest.device(msg.kind, msg.device_id, msg.payload, self.devices, msg.received_at)
                        change = self.devices.apply(m)
                        if change:
                            self._device_changed(msg.device_id, change)
                        if isinstance(m, Presence) and m.round_id:
                            self.acks.ack(m.device_id, m.round_id)
                    except Rejected as exc:
                        self._refused(exc, msg.kind, msg.device_id)
                elif msg.kind == "status":
                    self.jobs.status(msg.topic, msg.payload)
                elif msg.kind == "knock":
                    self.jobs.knock(msg.topic, msg.payload, msg.received_at)
                elif msg.kind == "ingest" and self.on_ingest is not None:
                    self.on_ingest(msg)
                elif msg.kind == "secagg" and self.on_secure is not None:
                    try:
                        self.on_secure(msg)
                    except Rejected as exc:
                        self._refused(exc, msg.kind, msg.device_id)
                else:
                    self._refused(Rejected("bad_topic", msg.topic), msg.kind, msg.device_id)
            records, self._to_persist = self._to_persist, []
            if background:
                self.committer.submit(batch, records)
                return
            self.committer.drain()  # earlier batches' appends and acks come first
            for rec in records:
                self.state.inbox_append(*rec)
            self.state.inbox_sync()
            for msg in batch:
                self.fleet.ack(msg)

    def update(self, device_id: str, payload: bytes, *, replay: bool = False) -> bool:
        """Ingest -> fold into the strategy's sums -> queue for the inbox (unless
        ``replay``: it came from there). True if accepted."""
        rnd = self.round
        try:
            self.ingest.notes.clear()
            eu = self.ingest.update(device_id, payload, rnd, self.completed, self.devices)
            try:
                self.strategy.fold(eu)
            except ProtocolError as exc:
                raise Rejected.from_protocol(exc, "strategy: ") from None
        except Rejected as exc:
            self._refused(exc, "update", device_id)
            return False
        assert rnd is not None
        if not replay:
            # persisted and synced by handle_batch (or its committer), then acked. A crash
            # before the sync leaves the update unacked: the broker redelivers it.
            self._to_persist.append((rnd.round_id, device_id, payload))
        rnd.accepted[device_id] = time.monotonic()
        self.note_accepted(rnd, device_id, len(payload), codec_label(eu.tensors), sorted(self.ingest.notes),
                           eu.not_applied)
        return True

    def note_accepted(self, rnd: OpenRound, device_id: str, nbytes: int, codec: str, notes: list[str],
                      not_applied: dict[str, str]) -> None:
        """Count (and report as an ``update`` event) an update of ``rnd`` accepted from
        ``device_id`` (``nbytes`` of payload, its ``codec`` label, what was changed rather
        than refused, the settings it did not apply): here or by an ingest worker."""
        if notes:  # changed rather than refused (clipped_num_samples)
            self.counts.update(notes)
            self.totals.update(notes)
            self.over_claimed.add(device_id)
        if not_applied:
            self._not_applied(device_id, rnd.round_id, not_applied)
        self.uplink_bytes[codec] += nbytes
        self.on_event("update", {"round": rnd.round_id, "device": device_id, "accepted": len(rnd.accepted),
                                 "selected": len(rnd.selected), "bytes": nbytes, "codec": codec,
                                 "notes": notes})

    def refuse(self, exc: Rejected, kind: str, device_id: str) -> None:
        """Count, log and report a refused message (an ingest worker's too)."""
        self._refused(exc, kind, device_id)

    def _device_changed(self, device_id: str, change: str) -> None:
        """A device joined (came online with a hello, or changed it) or left: one log line
        and a ``device`` event (with its hello's profile, bitwidth and codec)."""
        h = self.devices.hellos[device_id]
        n = self.devices.n_present
        what = f"joined ({h.profile}, {h.trainer}{h.compute_bits}, uplink {h.codec}-{h.codec_bits})" \
            if change == "joined" else "left"
        self.log.info("device %r %s; %d online", device_id, what, n,
                      extra={"event": f"device_{change}", "device": device_id, "online": n})
        self.on_event("device", {"device": device_id, "change": change, "online": n, "profile": h.profile,
                                 "compute_bits": h.compute_bits, "trainer": h.trainer,
                                 "codec": f"{h.codec}-{h.codec_bits}", "num_samples": h.num_samples})
        rnd = self.round
        if rnd is not None and change == "left":
            self.device_gone(device_id, "left", self.back_within_s)
        elif rnd is not None and rnd.gone.get(device_id) == "left":  # back before the round closed
            del rnd.gone[device_id]
            self._gone_until.pop(device_id, None)
            self.log.info("round %d: selected device %r is back; waiting for its update", rnd.round_id, device_id)

    #: a selected device that left (its last will) and comes back within this many seconds
    #: (a restarted process re-sending its update from its outbox) is still waited for
    back_within_s = 5.0

    def device_gone(self, device_id: str, why: str, back_within_s: float = 0.0) -> None:
        """A selected device of the open round will not answer (``why``: ``left``, its last
        will arrived): a straggler, logged and reported (``gone`` event); the round closes
        when every other selected device answered or is gone too, and ``back_within_s``
        seconds have passed without it coming back."""
        rnd = self.round
        if rnd is None or not rnd.mark_gone(device_id, why):
            return
        self._gone_until[device_id] = time.monotonic() + back_within_s
        left = rnd.outstanding()
        self.log.warning("round %d: selected device %r is gone (%s) before answering: a straggler%s; "
                         "%d outstanding%s", rnd.round_id, device_id, why,
                         f" unless back within {back_within_s:g} s" if back_within_s else "", len(left),
                         _names(left), extra={"event": "gone", "round": rnd.round_id, "device": device_id,
                                              "why": why})
        self.on_event("gone", {"round": rnd.round_id, "device": device_id, "why": why,
                               "outstanding": len(left)})

    def _report_knocks(self) -> None:
        """Log (and report as ``knock`` events) the devices saying hello on a job that has
        no coordinator on this broker, each once."""
        for k in self.jobs.due(time.monotonic()):
            self.log.warning("device %r says hello on job %r, which has no coordinator on this broker; this "
                             "coordinator serves job %r (start the device with --job %s)", k.device_id, k.job,
                             self.jobs.job, self.jobs.job, extra={"event": "knock", "device": k.device_id,
                                                                   "job": k.job})
            self.on_event("knock", {"device": k.device_id, "job": k.job, "serving": self.jobs.job})

    #: refusals of one reason logged per round at their level; more go to debug (a flood
    #: must not flood the log; every one is counted)
    log_per_reason = 20
    #: most (device, report) pairs remembered for logging not-applied settings once
    max_reported = 100_000

    def _not_applied(self, device_id: str, round_id: int, items: dict[str, str]) -> None:
        """An accepted update whose device reports announced hyper-parameters it did not
        apply: logged, and counted per key (``not_applied_<key>``)."""
        for key in items:
            self.counts[f"not_applied_{key}"] += 1
            self.totals[f"not_applied_{key}"] += 1
        what = "; ".join(f"{k} ({v})" for k, v in items.items())
        first = (device_id, what) not in self._reported
        if first and len(self._reported) < self.max_reported:
            self._reported.add((device_id, what))
        self.log.log(not_applied_level(items) if first else logging.DEBUG,
                     "round %d: %r did not apply %s%s", round_id, device_id, what,
                     " (logged once per device; counted every round)" if first else "",
                     extra={"event": "not_applied", "round": round_id, "device": device_id,
                            "keys": sorted(items)})

    def _refused(self, exc: Rejected, kind: str, device_id: str) -> None:
        exc.detail = safe_text(exc.detail, 400, backslash=False)  # (it may quote what the device sent)
        self.counts[exc.metric] += 1
        self.totals[exc.metric] += 1
        if self.ingest.enrolled is not None and not exc.dropped and (
                exc.reason == "unenrolled" or kind == "update" and exc.reason in STRIKE_REASONS):
            # an enrolled job's update refused after its MAC verified, or a revoked device: the
            # device's own doing, it sends no other (the round need not wait for it), and what
            # it held counts against it. (Without enrolment anyone may have sent it.)
            self.device_gone(device_id, "revoked" if exc.reason == "unenrolled" else "refused")
            if exc.reason in STRIKE_REASONS:
                self.refused_devices[device_id] = exc.reason
        if exc.reason == "unenrolled" and self.devices.is_online(device_id) and device_id in self.devices.hellos:
            self.devices.apply(Presence(device_id, False))  # revoked: offline, whatever it last said
            self._device_changed(device_id, "left")
        fields = {"reason": exc.reason, "device": device_id,
                  "round": self.round.round_id if self.round else None}
        if exc.quiet or self.counts[exc.metric] > self.log_per_reason:
            self.log.debug("%s %s from %r: %s", exc.metric, kind, device_id, exc.detail)
            return
        self.on_event("reject", {**fields, "kind": kind, "detail": exc.detail, "dropped": exc.dropped})
        if exc.dropped:
            self.log.info("dropped %s from %r: %s (%s)", kind, device_id, exc.reason, exc.detail,
                          extra={"event": "drop", **fields})
            return
        self.log.warning("rejected %s from %r: %s (%s)", kind, device_id, exc.reason, exc.detail,
                         extra={"event": "reject", **fields})

    #: how often the devices a round still waits for are logged by name (s)
    outstanding_every_s = 15.0

    def collect(self, need: int, until: float, more: Callable[[], bool] = lambda: True) -> list[str]:
        """Collect the open round until ``need`` updates are accepted, every selected device
        answered or is gone (:meth:`OpenRound.settled`; a device that left: once it stayed
        away :attr:`back_within_s`), ``more()`` is False (the fleet
        knows nothing more will come) or ``time.monotonic() >= until`` (the deadline). The
        devices still outstanding are logged by name every :attr:`outstanding_every_s`.
        Returns the stragglers (selected, no update; counted), empty once ``need`` was met."""
        rnd = self.round
        assert rnd is not None
        self._gone_until = {}

        def done() -> bool:
            for d in self.acks.silent(rnd.accepted):  # acknowledged earlier rounds, not this one
                self.device_gone(d, "silent")
            return len(rnd.accepted) >= need or not more() or (
                rnd.settled() and time.monotonic() >= max(self._gone_until.values(), default=0.0))

        while not done() and time.monotonic() < until:
            self.pump(min(until, time.monotonic() + self.outstanding_every_s), stop=done)
            if not done() and time.monotonic() < until:
                left = rnd.outstanding()
                self.log.info("round %d: %d of %d update(s); waiting for %d device(s)%s, deadline in %.0f s",
                              rnd.round_id, len(rnd.accepted), len(rnd.selected), len(left), _names(left),
                              until - time.monotonic(), extra={"event": "outstanding", "round": rnd.round_id})
        if len(rnd.accepted) >= need:
            return []
        stragglers = sorted(rnd.selected - rnd.accepted.keys())
        self.counts["stragglers"] = len(stragglers)
        why = ("every selected device answered or is gone" if rnd.settled() else
               "the fleet expects no more updates" if not more() else "deadline passed")
        gone = f" ({len(rnd.gone)} gone{_names(sorted(rnd.gone), 10)})" if rnd.gone else ""
        self.log.warning("round %d: %s; %d straggler(s) excluded%s: %s", rnd.round_id, why, len(stragglers), gone,
                         stragglers, extra={"event": "stragglers", "round": rnd.round_id})
        return stragglers

    def pump(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Handle messages until ``time.monotonic() >= until`` or ``stop()``.

        Each batch's sync and acks run in the committer thread while this loop waits for
        the next message; before returning, every handled message is synced and acked
        (that last wait counts as coordinator time).
        """
        cpu0 = self.committer.cpu_seconds
        try:
            while not stop():
                self.committer.check()  # a failed sync or ack stops the loop at once
                left = until - time.monotonic()
                if left <= 0:
                    return
                msg = self.fleet.recv(timeout=min(left, 0.25))
                self._report_knocks()
                if msg is None:
                    continue
                batch = [msg]
                while len(batch) < self.batch_max:  # what is already queued joins the batch
                    more = self.fleet.recv(timeout=0)
                    if more is None:
                        break
                    batch.append(more)
                self.handle_batch(batch, background=True)
        finally:
            with self.clock.timed():
                self.committer.drain()
            self.clock.cpu += self.committer.cpu_seconds - cpu0
