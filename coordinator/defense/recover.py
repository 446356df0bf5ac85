"""After a collapse: find the update(s) that caused it and keep the round without them,
instead of throwing the whole round away (and every later one, while the culprit keeps
sending).

The round's accepted updates are in its inbox, as received. The aggregate is formed again
without some of them, from the strategy's state before the round's ``finish()``, and
judged as the health watch judges a round (:meth:`HealthWatch.assess`, never on the test
split). Tried in order, at most :data:`MAX_TRIES` aggregates: each update alone left out,
the largest movements first, then the largest two, three, ... together, up to half of the
round; of the healthy ones without one update, the one closest to the previous model is
kept. The devices left out get a strike each; when nothing tried is healthy the round is
rolled back whole, and rollbacks in :data:`ALERT_AFTER` consecutive rounds raise an
operator alert (:meth:`~coordinator.defense.loop.RoundDefense.rolled_back`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.ingest import OpenRound, Rejected
from edge_client.auth import strip_mac
from edge_client.errors import ProtocolError
from edge_client.protocol import decode_message

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.health import Verdict
    from coordinator.server import Coordinator

#: most aggregates formed again after one collapse (each costs a fold and an evaluation)
MAX_TRIES = 8
#: consecutive rounds rolled back whole that raise an operator alert
ALERT_AFTER = 2

Weights = list[np.ndarray]


def suspects(accepted: list[str], norms: dict[str, float], tries: int = MAX_TRIES) -> list[frozenset[str]]:
    """The sets of devices to leave out, in order: each alone (largest measured movement
    first, unmeasured ones after), then the largest two, three, ... together (at most half
    of the round); at most ``tries``."""
    order = sorted(accepted, key=lambda d: (-norms.get(d, -1.0), d))
    sets = [frozenset([d]) for d in order]
    sets += [frozenset(order[:k]) for k in range(2, len(order) // 2 + 1)]
    return sets[:tries]


def recover(co: Coordinator, r: int, rnd: OpenRound, old: tuple[Weights, dict[int, Weights]],
            verdict: Verdict) -> dict[str, tuple[Any, ...]]:
    """Round ``r`` of coordinator ``co`` collapsed and is to be rolled back (``verdict``:
    the health watch's, which restored the strategy's state from before ``finish()``).
    Sets ``co.weights`` / ``co.group_weights`` to a healthy aggregate without some of the
    round's updates, else to ``old``; returns the scores to record. The record gets
    ``excluded`` (the devices left out; empty: the whole round rolled back).

    Of the healthy aggregates without one update, the one closest to ``old`` is kept
    (leaving an honest device out leaves the culprit more weight: the model moves more);
    only when none is healthy are larger sets tried, the first healthy one kept."""
    guard = co.defense.guard
    bounded = dict(guard.bounded) if guard is not None else {}
    pre = co.strategy.state_dict()
    items = [(d, p) for d, p in co.state.inbox_items(r) if d in rnd.accepted]
    norms = dict(guard.norms) if guard is not None and guard.norms else _norms(co, items, old[0])
    best: tuple[float, frozenset[str], Any, Any] | None = None  # (movement, left out, model, scores)
    for leave_out in suspects(sorted(rnd.accepted), norms):
        if best is not None and len(leave_out) > 1:
            break
        co.strategy.load_state_dict(pre)
        model = _aggregate(co, r, rnd, items, leave_out, old[0])
        if model is None:
            continue
        co.weights, co.group_weights = model
        scores = co._evaluate(r)
        if co.health.assess(r, model, old, scores, co.history)[1]:
            continue
        move = float(sum(np.sum((a - b).astype(np.float64) ** 2) for a, b in zip(model[0], old[0], strict=True)))
        if best is None or move < best[0]:
            best = (move, leave_out, model, (co.strategy.state_dict(), scores))
    if guard is not None:
        guard.bounded = bounded  # (the strikes of what the round received)
    found = best[1] if best is not None else frozenset()
    verdict.record["excluded"] = sorted(found)
    if best is not None:
        co.weights, co.group_weights = best[2]
        co.strategy.load_state_dict(best[3][0])
        co.log.warning("round %d: the aggregate without the update(s) of %s is healthy: kept (they get a strike)",
                       r, sorted(found), extra={"event": "recovered", "round": r, "excluded": sorted(found)})
        co.defense.collapsed_by(found)
        return best[3][1]
    co.strategy.load_state_dict(pre)
    co.weights, co.group_weights = old
    co.defense.rolled_back(r)
    # the kept model scored as round r is (the test split too in a reported round: the
    # last healthy round's figures lack it when that round came before the reported ones)
    return co._evaluate(r) or verdict.scores or {}


def _norms(co: Coordinator, items: list[tuple[str, bytes]], start: Weights) -> dict[str, float]:
    """``‖x - g‖`` of each of the round's updates (when the guard did not measure them)."""
    from coordinator.defense.normbound import update_norm
    from coordinator.strategies.decode import decode_update

    col, flat = co.collector, [np.ascontiguousarray(w, dtype=np.float32).reshape(-1) for w in start]
    out = {}
    for dev, payload in items:
        try:
            cu = decode_update(col.ingest.encoded(decode_message(strip_mac(payload), co.cfg.limits)))
        except ProtocolError:
            continue
        out[dev] = update_norm([np.ascontiguousarray(w).reshape(-1) for w in cu.weights], flat,
                               cu.kind == "delta")
    return out


def _aggregate(co: Coordinator, r: int, rnd: OpenRound, items: list[tuple[str, bytes]], leave_out: frozenset[str],
               start: Weights) -> tuple[Weights, dict[int, Weights]] | None:
    """The round's aggregate without ``leave_out``'s updates (None: fewer than
    ``min_updates`` left)."""
    s, col = co.strategy, co.collector
    again = OpenRound(r, rnd.selected)
    s.begin_round(r, [w.copy() for w in start])
    for dev, payload in items:
        if dev in leave_out or dev in again.accepted:
            continue
        try:
            s.fold(col.ingest.update(dev, payload, again, col.completed, col.devices))
        except (Rejected, ProtocolError):  # (accepted once: it passes again)
            continue
        again.accepted[dev] = 0.0
    if len(again.accepted) < co.cfg.min_updates:
        return None
    res = s.finish()
    return ([np.asarray(w, dtype=np.float32) for w in res.weights],
            {int(b): [np.asarray(w, dtype=np.float32) for w in ws] for b, ws in (res.group_weights or {}).items()})
