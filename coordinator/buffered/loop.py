"""The buffered loop: :class:`BufferedCoordinator`, FedBuff over the round loop's parts.

The model has a version (0: the initial one). While fewer than ``concurrency`` devices
train, present devices without a request are drawn (seeded RNG) and each given a ticket;
the plan (tickets, digests, RNG) is saved, then the announcement published (mode
``buffered``: the open requests, the version's digests, recent refusals; the models when
they changed). Updates go through the collector as in a round, the buffer's rules first
(``window.py``), and are folded scaled by ``η·s(τ)``. A request closes with its answer;
its slot frees when the device leaves or holds it past ``round_timeout_s`` (a straggler).
Every ``buffer_size`` updates ``strategy.finish()`` gives ``w + η Σ ω s(τ) Δ / Σ ω``: it
is evaluated, health-checked, checkpointed with one metrics line (each update's device,
ticket, base version, staleness) and announced. ``run(resume=True)`` loads the last
checkpoint and plan and replays the open buffer's inbox.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from coordinator.buffered.window import BufferFold, BufferWindow, Entry, Requests
from coordinator.server import Coordinator, RoundError
from coordinator.state import RoundPlan
from coordinator.strategies.announce import announced_hparams
from coordinator.variants import model_messages
from edge_client.errors import ProtocolError
from edge_client.protocol import (
    FLOAT_VARIANT,
    RoundAnnouncement,
    Status,
    Update,
    decode_message,
    encode_message,
)


class BufferedCoordinator(Coordinator):
    """``round.mode = "buffered"`` (see the module docstring); the arguments are
    :class:`~coordinator.server.Coordinator`'s. Events beyond a round's: ``buffer``
    (``version``, ``fill``, ``size``, ``in_flight``, and ``staleness`` of the update just
    folded), ``round_end`` per application (its metrics record)."""

    def __init__(self, cfg: Any, fleet: Any, strategy: Any, state: Any, **kw: Any) -> None:
        super().__init__(cfg, fleet, strategy, state, **kw)
        self.buf = cfg.buffered
        self.requests = Requests()
        self.window = BufferWindow(1, frozenset(), version=0, settings=self.buf, requests=self.requests)
        #: (around the guarded strategy: each update weighed by its staleness, then bounded and folded)
        self.collector.strategy = BufferFold(self.strategy, lambda: self.window, self._folded)
        #: one message at a time, each reacted to before the next: a buffer never takes more
        #: than ``buffer_size``, and an emulated fleet's events keep their simulated order
        #: (the committer still syncs what queued meanwhile at once)
        self.collector.batch_max = 1
        self._published: tuple[int, frozenset[str]] = (-1, frozenset())
        self._digests: dict[str, str] = {}
        self._dirty = True  # the announcement must go out again
        self._asked = 0  # requests issued for the open buffer
        self._replayed = 0
        self._opened = time.monotonic()
        self._idle_since = time.monotonic()
        self._quarantined: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ the loop

    def _loop(self, plans: dict[int, RoundPlan]) -> None:
        self._resume_requests()
        self._open()
        while self.completed < self.cfg.rounds and not self.fleet.done():
            if self.window.full:
                self._apply()
                self._open()
                continue
            self.collector.pump(time.monotonic() + 0.5, stop=self._react)

    def _react(self) -> bool:
        """Before each message: free the slots of devices that left, ask devices to fill
        the free slots, publish when that changed anything; True (leave the pump) once the
        buffer is full."""
        if self.window.full:
            return True
        devices, req = self.collector.devices, self.requests
        now = self.fleet.now()
        for d in [d for d in req.slots if not devices.is_online(d)]:
            req.release(d)
        self._expire(now)
        free = self.buf.concurrency - len(req.slots)
        if free > 0:
            for d in self._draw(free):
                req.issue(d, now)
                self._asked += 1
                self._dirty = True
        if self._dirty or req.refused:
            self._publish()
        if req.slots or devices.n_present:
            self._idle_since = time.monotonic()
        elif time.monotonic() - self._idle_since > self.cfg.presence_timeout_s:
            raise RoundError(f"version {self.completed}: no device present and none training for "
                             f"{self.cfg.presence_timeout_s:.0f} s")
        return False

    def _draw(self, k: int) -> list[str]:
        """Up to ``k`` present devices without a slot and not quarantined, drawn with the
        seeded RNG."""
        present, busy, out = self.collector.devices.present(), self.requests.slots, self._quarantined
        n = len(present)
        if n <= 4 * (len(busy) + len(out) + k) or n < 64:
            idle = [d for d in present if d not in busy and d not in out]
            idx = self.rng.choice(len(idle), size=min(k, len(idle)), replace=False) if idle else []
            return sorted(idle[i] for i in idx)
        chosen: set[str] = set()
        while len(chosen) < k:  # a large fleet: rejection sampling, no list of it made
            d = present[int(self.rng.integers(n))]
            if d not in busy and d not in out:
                chosen.add(d)
        return sorted(chosen)

    def _expire(self, now: float) -> None:
        """Free the slots held longer than ``round_timeout_s`` on the fleet's clock
        (stragglers; their request stays open and an answer still counts)."""
        req = self.requests
        late = sorted(d for d, t in req.slots.items() if now - t > self.cfg.round_timeout_s)
        for d in late:
            req.release(d)
        if late:
            self.collector.counts["stragglers"] += len(late)
            self.log.warning("version %d: %d device(s) did not answer within %.0f s: %s", self.completed, len(late),
                             self.cfg.round_timeout_s, late, extra={"event": "stragglers", "round": self.completed})

    # ------------------------------------------------------------------ announcing

    def _publish(self) -> None:
        """Save the plan, then announce the open requests (with the version's models when
        they are new, or a device of a new variant needs one)."""
        cfg, v, devices = self.cfg, self.completed, self.collector.devices
        selected = sorted(self.requests.tickets)
        variants = frozenset(devices.variants() | {FLOAT_VARIANT})
        models: dict[str, bytes] = {}
        if self._published[0] != v or not variants <= self._published[1]:
            payloads = model_messages(v, cfg.model, self.names, variants, weights=self.weights,
                                      group_weights=self.group_weights, server_state=self.strategy.server_state(),
                                      limits=cfg.limits)
            models = {k: p for k, (p, _) in payloads.items()}
            self._digests = {k: d for k, (_, d) in payloads.items()}
            self._published = (v, variants)
        hellos = [devices.hellos[d] for d in selected if d in devices.hellos]
        hparams = announced_hparams(self.strategy.name, self.strategy.device_hparams(cfg.hparams, hellos),
                                    {"content": "delta"}) | {"run": self.run_id}
        deadline = time.time() + cfg.round_timeout_s
        self.state.save_plan(RoundPlan(round_id=v, selected=selected, deadline=deadline, variants=dict(self._digests),
                                       hparams=hparams, started_at=time.time(),
                                       rng_state=json.dumps(self.rng.bit_generator.state),
                                       tickets=dict(self.requests.tickets), last_ticket=self.requests.last_ticket))
        ann = RoundAnnouncement(job=cfg.job, round_id=v, model=cfg.model, selected=tuple(selected), deadline=deadline,
                                variants=dict(self._digests), hparams=hparams, mode="buffered",
                                tickets=tuple(self.requests.tickets[d] for d in selected),
                                max_staleness=self.buf.max_staleness, refusals=self.requests.refusal_list())
        self.fleet.announce_round(models, encode_message(ann, cfg.limits),
                                  encode_message(Status("round", v, f"version {v}")))
        self._dirty = self.requests.refused = False

    # ------------------------------------------------------------------ the buffer

    def _open(self) -> None:
        """Open the buffer of version ``completed + 1`` and replay what its inbox holds."""
        r, col = self.completed + 1, self.collector
        col.new_round()
        self._quarantined = self.defense.quarantined(r)
        self.window = BufferWindow(r, frozenset(), version=self.completed, settings=self.buf, requests=self.requests)
        self.strategy.begin_round(r, [w.copy() for w in self.weights])
        col.open(self.window)
        self._asked, self._opened = 0, time.monotonic()
        items = self.state.inbox_items(r, unique=False)
        self.window.replaying = True
        try:
            self._replayed = sum(col.update(d, p, replay=True) for d, p in items)
        finally:
            self.window.replaying = False
        self._event()
        if items:
            self.log.info("version %d: %d update(s) replayed from the inbox", self.completed, self._replayed,
                          extra={"event": "replayed", "round": r})

    def _folded(self, entry: Entry) -> None:
        self._event(entry.staleness)

    def _event(self, staleness: int | None = None) -> None:
        self.on_event("buffer", {"version": self.completed, "fill": len(self.window.entries),
                                 "size": self.buf.buffer_size, "in_flight": len(self.requests.slots),
                                 "staleness": staleness})

    def _apply(self) -> None:
        """Apply the full buffer: the next version, evaluated, checkpointed, one metrics line."""
        r, col, w = self.completed + 1, self.collector, self.window
        t0 = time.perf_counter()
        old, old_groups = [x.copy() for x in self.weights], self.group_weights
        self.health.snapshot(self.strategy)
        result = self.strategy.finish()
        self.weights = [np.asarray(x, dtype=np.float32) for x in result.weights]
        self.group_weights = {int(b): [np.asarray(x, dtype=np.float32) for x in ws]
                              for b, ws in (result.group_weights or {}).items()}
        stats = {k: v for k, v in (result.stats or {}).items() if isinstance(v, int | float) and math.isfinite(v)}
        t_agg = time.perf_counter() - t0
        scores = self._evaluate(r)
        eval_s = time.perf_counter() - t0 - t_agg
        health = self.health.check(r, (self.weights, self.group_weights), (old, old_groups), scores, self.history)
        if health.rolled_back:  # (the whole buffer: its updates came from several versions)
            self.weights, self.group_weights = old, old_groups
            self.defense.rolled_back(r)
            scores = health.scores or self._evaluate(r)
        loss, acc = scores.get(FLOAT_VARIANT, (math.nan, math.nan))[:2]
        finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
        taus = [e.staleness for e in w.entries]
        record: dict[str, Any] = {
            "round": r, "version": r, "mode": "buffered", "time": time.time(), "run": self.run_id,
            "strategy": self.cfg.strategy, "model": self.cfg.model, "accuracy": finite(acc), "loss": finite(loss),
            "buffer_size": self.buf.buffer_size, "accepted": len(w.entries),
            "accepted_ids": sorted({e.device for e in w.entries}), "updates": [e.as_dict() for e in w.entries],
            "staleness_mean": float(np.mean(taus)), "staleness_max": int(max(taus)), "selected": self._asked,
            "stragglers": int(col.counts.get("stragglers", 0)), "in_flight": len(self.requests.slots),
            "aggregated": True, "resumed": self._replayed > 0, "replayed": self._replayed,
            "weight_change_l2": float(math.sqrt(sum(float(np.sum((a - b) ** 2))
                                                    for a, b in zip(self.weights, old, strict=True)))),
            "round_seconds": time.monotonic() - self._opened, "wait_seconds": 0.0, "aggregate_seconds": t_agg,
            "eval_seconds": eval_s, "counts": dict(col.counts), "stats": stats, "uplink_bytes": dict(col.uplink_bytes),
            "groups": {v: {"loss": finite(s[0]), "accuracy": finite(s[1]),
                           **{k: finite(float(x)) for k, x in (s[2] if len(s) > 2 else {}).items()}}
                       for v, s in scores.items()},
            "health": health.record, "health_seconds": health.seconds, **self.fleet.round_report(r),
            "defense": self.defense.after_round(r, {e.device for e in w.entries}, col.refused_devices,
                                                col.over_claimed),
        }
        self.completed = r
        col.close(r)
        if col.devices.changed:
            self.state.save_devices(col.devices.to_state())
            col.devices.changed = False
        self.state.save_checkpoint(self._checkpoint(record))
        self.state.append_metrics(record)
        self.state.inbox_prune(r)  # this buffer's log is kept until the next checkpoint (fallback)
        self._dirty = True
        if r < self.cfg.rounds and not self.fleet.done():
            self._publish()  # the new version (and the plan after this checkpoint)
        self.history.append(record)
        self.on_event("round_end", record)
        self.log.info("version %d: %d update(s), staleness mean %.1f max %d, accuracy %s", r, len(w.entries),
                      record["staleness_mean"], record["staleness_max"],
                      f"{acc:.4f}" if math.isfinite(acc) else "n/a",
                      extra={"event": "round_end", "round": r, "accuracy": record["accuracy"]})
        if r >= self.cfg.rounds or self.fleet.done():
            self.fleet.publish_status(encode_message(Status("done", r, f"version {r}: done", {
                k: float(x) for k, x in (("accuracy", acc), ("loss", loss)) if math.isfinite(x)})))

    # ------------------------------------------------------------------ resume

    def _resume_requests(self) -> None:
        """The open requests of the last saved plan (and its RNG), minus those the last
        applied buffer's inbox shows answered."""
        plan = None
        for previous in (False, True):
            plan = self._load(lambda previous=previous: self.state.load_plan(previous=previous), "round plan")
            if plan:
                break
        if not plan or not (plan.tickets or plan.last_ticket):
            return
        self.requests = Requests(plan.tickets, plan.last_ticket, self.fleet.now())
        if plan.rng_state:
            self.rng.bit_generator.state = json.loads(plan.rng_state)
        for dev, payload in self.state.inbox_items(self.completed, unique=False) if self.completed else ():
            try:
                m = decode_message(payload, self.cfg.limits)
            except ProtocolError:
                continue
            if isinstance(m, Update) and self.requests.tickets.get(dev) == m.ticket:
                self.requests.close(dev)
        self._dirty = True
