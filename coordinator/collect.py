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
from typing import Any

from coordinator.commit import AckCommitter
from coordinator.devices import DeviceRegistry
from coordinator.fleet import Fleet, Inbound
from coordinator.ingest import Ingest, OpenRound, Rejected
from coordinator.state import RunState
from coordinator.strategies.round import RoundStrategy
from edge_client.errors import ProtocolError
from edge_client.hparams import not_applied_level


def codec_label(tensors: Any) -> str:
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
                 on_event: Callable[[str, dict[str, Any]], None], logger: logging.Logger) -> None:
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
        self.clock = Stopwatch()
        #: most messages handled before they go to the committer, which syncs every batch
        #: queued since its last sync at once (group commit). Small batches let the sync
        #: of one overlap the decoding of the next (fedshift_cnn bursts: 8 -> ~1.1x of 64)
        self.batch_max = 8
        #: appends the accepted updates to the inbox, syncs, then acks, in two background
        #: threads while ``pump`` goes on (the append's checksum and write release the GIL)
        self.committer: AckCommitter[Inbound, tuple[int, str, bytes]] = AckCommitter(
            lambda: self.state.inbox_sync(), lambda m: self.fleet.ack(m),
            persist=lambda rec: self.state.inbox_append(*rec))
        self._to_persist: list[tuple[int, str, bytes]] = []
        #: (device, what it reported) already logged at WARNING: a device that reports the
        #: same setting not applied every round is logged once, then at DEBUG (still counted)
        self._reported: set[tuple[str, str]] = set()

    def new_round(self) -> None:
        """Reset the per-round counters and the stopwatch (before selection)."""
        self.counts = Counter()
        self.uplink_bytes = Counter()
        self.clock = Stopwatch()

    def open(self, rnd: OpenRound) -> None:
        """Collect updates for ``rnd`` (the strategy's round must be begun)."""
        self.round = rnd

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
                        change = self.devices.apply(self.ingest.device(msg.kind, msg.device_id, msg.payload,
                                                                       self.devices, msg.received_at))
                        if change:
                            self._device_changed(msg.device_id, change)
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
        if self.ingest.notes:  # changed rather than refused (clipped_num_samples)
            self.counts.update(self.ingest.notes)
            self.totals.update(self.ingest.notes)
        if eu.not_applied:
            self._not_applied(device_id, rnd.round_id, eu.not_applied)
        if not replay:
            # persisted and synced by handle_batch (or its committer), then acked. A crash
            # before the sync leaves the update unacked: the broker redelivers it.
            self._to_persist.append((rnd.round_id, device_id, payload))
        rnd.accepted[device_id] = time.monotonic()
        codec = codec_label(eu.tensors)
        self.uplink_bytes[codec] += len(payload)
        self.on_event("update", {"round": rnd.round_id, "device": device_id, "accepted": len(rnd.accepted),
                                 "selected": len(rnd.selected), "bytes": len(payload), "codec": codec,
                                 "notes": sorted(self.ingest.notes)})
        return True

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
        self.counts[exc.metric] += 1
        self.totals[exc.metric] += 1
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

    def await_present(self, need: int, timeout_s: float) -> bool:
        """Handle messages until ``need`` devices are present (a ``waiting`` event every 5 s
        while there are fewer), for at most ``timeout_s``; whether they are."""
        end = time.monotonic() + timeout_s
        last_note = 0.0
        waited = False
        while len(self.devices.present()) < need:
            waited = True
            if time.monotonic() >= end:
                return False
            if time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                self.on_event("waiting", {"present": len(self.devices.present()), "need": need})
            self.pump(min(end, time.monotonic() + 0.5))
        if waited:  # let hellos that arrive together settle
            self.pump(time.monotonic() + 0.05)
        return True

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
