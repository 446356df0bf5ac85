"""The job's privacy in the round loop: :class:`Privacy`, which the coordinator calls at
a few points of a round (it does nothing when ``[privacy]`` is off).

- :meth:`Privacy.wrap`: central DP wraps the strategy (``central.CentralDP``);
- :meth:`Privacy.hparams`: a secure round's announcement carries its session and k;
- :meth:`Privacy.collect`: a secure round's four phases against the fleet, in place of
  collecting updates: keys (until the quorum or the deadline, as updates would be), then
  rosters, shares, masked inputs and reveals (each phase up to ``phase_timeout_s``); the
  unmasked sum goes to the strategy (``Strategy.fold_sum``) one slot per group;
- :meth:`Privacy.end_round`: the accountant composes the round (when its model changed)
  and the round's record gets ``epsilon`` and the protocol's figures;
- :meth:`Privacy.allows`: with ``target_epsilon``, False once one more round would pass it.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.collect import Collector
from coordinator.fleet import Fleet, Inbound
from coordinator.ingest import OpenRound, Rejected
from coordinator.privacy import dp
from coordinator.privacy.accountant import Accountant, noise_for_epsilon
from coordinator.privacy.central import CentralDP, served_bits_of
from coordinator.privacy.secagg import PhaseClosed, SecAggParams, SecAggServer, UnmaskError
from edge_client.errors import ProtocolError
from edge_client.protocol import encode_message, model_variant, variant_bits
from edge_client.protocol.secure import FROM_DEVICES
from edge_client.secagg.encode import Grid, split_slots

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.config import ServerConfig
    from coordinator.strategies.base import Strategy
    from coordinator.strategies.types import EncodedUpdate
    from edge_client.protocol import Hello


class Privacy:
    """See the module docstring. ``shapes``: the model's layer shapes."""

    def __init__(self, server: ServerConfig, fleet: Fleet, collector: Collector, shapes: list[tuple[int, ...]],
                 log: logging.Logger, on_event: Callable[[str, dict[str, Any]], None]) -> None:
        cfg, fraction = server.privacy, server.fraction
        self.rounds = server.rounds
        self.cfg, self.job, self.fleet, self.col, self.log, self.on_event = cfg, server.job, fleet, collector, log, on_event
        self.selection = (server.fraction, server.min_devices, server.max_devices)
        self.shapes = shapes
        self.params = sum(int(np.prod(s)) for s in shapes)
        self.accountant = Accountant(cfg.delta) if cfg.dp else None
        #: the noise multiplier (from target_epsilon: derived before the first round)
        self.z = cfg.noise_multiplier
        self.pinned: dict[str, bytes] = {}
        self.strategy: Strategy | CentralDP | None = None
        self.server: SecAggServer | None = None
        self.grid: dp.DistributedGrid | None = None
        self.q = min(1.0, fraction)
        self.stopped = ""
        collector.on_secure = self.handle

    # ------------------------------------------------------------------ set-up
    def wrap(self, strategy: Strategy) -> Strategy | CentralDP:
        """The strategy the round loop uses: central DP's wrapper, or ``strategy``."""
        if self.cfg.mechanism == "central":
            strategy = CentralDP(strategy, self.cfg, self.z,
                                 lambda: len(self.col.round.selected) if self.col.round is not None else 0,
                                 served=self._served_bits)
        self.strategy = strategy
        return strategy

    def hparams(self, round_id: int) -> dict[str, Any]:
        """What a round's announcement adds: a secure round's session (hex) and k."""
        if not self.cfg.secure_aggregation:
            return {}
        return {"secagg": secrets.token_hex(16), "secagg_degree": int(self.cfg.neighbours)}

    def allows(self, round_id: int) -> bool:
        """False (logged once, ``stopped`` set) when round ``round_id`` would take ε past
        ``target_epsilon``."""
        if self.accountant is None or not self.cfg.target_epsilon:
            return True
        q = self._next_q()
        if not self.z:  # the smallest that keeps every round within the budget at this rate
            self.z = noise_for_epsilon(self.cfg.target_epsilon, self.cfg.delta, self.rounds - round_id + 1, q)
            if isinstance(self.strategy, CentralDP):
                self.strategy.z = self.z
            self.log.info("noise multiplier %.4f keeps %d round(s) at sampling rate %.3g within epsilon %g "
                          "(delta %g)", self.z, self.rounds - round_id + 1, q, self.cfg.target_epsilon,
                          self.cfg.delta)
        eps = self.accountant.after(self.z, q)
        if eps <= self.cfg.target_epsilon * (1 + 1e-9):
            return True
        if not self.stopped:
            self.stopped = (f"round {round_id} would take epsilon to {eps:.4g} > target_epsilon "
                            f"{self.cfg.target_epsilon:g} (delta {self.cfg.delta:g}): the job ends here")
            self.log.warning("%s", self.stopped, extra={"event": "privacy_budget", "round": round_id})
        return False

    def _next_q(self) -> float:
        """The sampling rate the next selection would have among the devices present now
        (the configured fraction while none is)."""
        present = len(self.col.devices.present())
        fraction, lo, hi = self.selection
        if not present:
            return min(1.0, fraction)
        return min(present, max(lo, min(hi, math.ceil(fraction * present)))) / present

    # ------------------------------------------------------------------ the secure round
    def collect(self, rnd: OpenRound, hparams: dict[str, Any], need: int, until: float) -> list[str]:
        """Run round ``rnd``'s secure aggregation (announced with ``hparams``) and fold the
        unmasked sums into the strategy; ``rnd.accepted`` gets the survivors. Returns the
        stragglers (selected, not survivors; counted) when fewer than ``need`` survived."""
        self._run(rnd, hparams, need, until)
        if len(rnd.accepted) >= need:
            return []
        stragglers = sorted(rnd.selected - set(rnd.accepted))
        self.col.counts["stragglers"] = len(stragglers)
        self.log.warning("round %d: %d straggler(s) excluded: %s", rnd.round_id, len(stragglers), stragglers,
                         extra={"event": "stragglers", "round": rnd.round_id})
        return stragglers

    def _run(self, rnd: OpenRound, hparams: dict[str, Any], need: int, until: float) -> None:
        col, fleet, r = self.col, self.fleet, rnd.round_id
        selected = sorted(rnd.selected)
        hellos = {d: col.devices.hellos.get(d) for d in selected}
        groups = self._groups(hellos)
        weighted = bool(getattr(getattr(self.strategy, "inner", self.strategy), "weighted", True)) and not self.cfg.dp
        grid = self._grid(selected, hellos, len(groups), weighted)
        self.server = srv = SecAggServer(self.job, r, selected, grid,
                                         lambda d: groups.index(self._bits(hellos.get(d))) if len(groups) > 1 else 0,
                                         SecAggParams(int(hparams.get("secagg_degree", 0)), self.cfg.threshold),
                                         self.pinned, bytes.fromhex(str(hparams["secagg"])))
        col.pump(until, stop=lambda: len(srv.devices) >= need or not fleet.more_expected(r))
        phases: list[tuple[Callable[[], dict[str, Any]], Callable[[], set[str]]]] = [
            (srv.rosters, lambda: {u for u in srv.u1 if srv.devices[u].shares or u in srv.excluded}),
            (srv.inboxes, lambda: set(srv.u3) | (set(srv.excluded) & set(srv.u2))),
            (srv.unmask_requests, lambda: self._revealed)]
        for close, done in phases:
            self._revealed: set[str] = set()
            out = close()
            for dev, m in out.items():
                fleet.send(dev, encode_message(m, col.ingest.limits))
            fleet.flush()
            want = set(out)
            end = min(time.monotonic() + self.cfg.phase_timeout_s, max(until, time.monotonic() + 1.0))
            col.pump(end, stop=lambda want=want, done=done: want <= done() or not fleet.more_expected(r))
        try:
            total = srv.unmask()
        except UnmaskError as exc:
            self.log.error("round %d: secure aggregation failed: %s; the model is unchanged", r, exc,
                           extra={"event": "secagg_failed", "round": r})
            return
        n_min = math.ceil(self.cfg.min_survivors * len(selected))
        if self.cfg.mechanism == "distributed" and len(srv.survivors) < n_min:
            self.log.error("round %d: %d masked input(s) < %d the noise was sized for; the model is unchanged",
                           r, len(srv.survivors), n_min, extra={"event": "secagg_failed", "round": r})
            return
        for bits, (s, w, n) in zip(groups, split_slots(total, grid), strict=True):
            if n:
                layers = np.split(s, np.cumsum([int(np.prod(sh)) for sh in self.shapes])[:-1])
                self.strategy.fold_sum(bits, layers, float(w), n, inferior=n if bits < 32 else 0)
        now = time.monotonic()
        rnd.accepted.update({d: now for d in srv.survivors})

    def handle(self, msg: Inbound) -> None:
        """A device's secure-aggregation message (the collector's ``on_secure``); Rejected
        when it does not belong to the open secure round."""
        srv = self.server
        m = self.col.ingest.secure(msg.device_id, msg.payload, FROM_DEVICES)
        if srv is None or self.col.round is None or m.round_id != srv.round_id:
            raise Rejected("wrong_round", f"round {m.round_id}: no secure round is open", dropped=True)
        try:
            {"sa_keys": srv.keys, "sa_shares": srv.shares, "sa_masked": srv.masked, "sa_reveal": srv.reveal}[m.KIND](m)
        except PhaseClosed as exc:
            raise Rejected("late", f"secagg: {exc}", dropped=True) from None
        except ProtocolError as exc:
            raise Rejected.from_protocol(exc, "secagg: ") from None
        self.col.uplink_bytes["secagg-masked" if m.KIND == "sa_masked" else "secagg-protocol"] += len(msg.payload)
        if m.KIND == "sa_reveal":
            self._revealed.add(m.device_id)

    def _served_bits(self, update: EncodedUpdate) -> int:
        """The bitwidth of the model variant the update's device was served (its hello's)."""
        hello = self.col.devices.hellos.get(update.device_id)
        return served_bits_of(update) if hello is None else self._bits(hello)

    def _bits(self, hello: Hello | None) -> int:
        return 32 if hello is None else variant_bits(model_variant(hello.compute_bits, hello.trainer))

    def _groups(self, hellos: dict[str, Any]) -> list[int]:
        """The bitwidth of each slot: one per group for a grouped strategy, else one (32)."""
        inner = getattr(self.strategy, "inner", self.strategy)
        if getattr(getattr(inner, "combiner", None), "grouped", False):
            return sorted({self._bits(h) for h in hellos.values()})
        return [32]

    def _grid(self, selected: list[str], hellos: dict[str, Any], slots: int, weighted: bool) -> Grid:
        if self.cfg.mechanism == "distributed":
            n_min = math.ceil(self.cfg.min_survivors * len(selected))
            self.grid = dp.distributed_grid(self.cfg.clip, self.params, len(selected), n_min, self.z)
            return Grid(self.params, slots, 0, self.grid.frac_bits, self.cfg.bound, False, self.cfg.clip,
                        self.grid.device_std)
        total = sum(max(1, h.num_samples if h is not None else 1) for h in hellos.values()) if weighted \
            else len(selected)
        return Grid(self.params, slots, 0, dp.secure_frac_bits(self.cfg.bound, total), self.cfg.bound, weighted)

    # ------------------------------------------------------------------ accounting
    def end_round(self, round_id: int, selected: int, present: int, aggregated: bool) -> dict[str, Any]:
        """The round's privacy figures for its record; composes the round in the
        accountant when its model was released (``aggregated``)."""
        out: dict[str, Any] = {}
        self.q = min(1.0, selected / max(present, 1))
        if self.server is not None:
            out.update(self.server.report())
            if self.server.excluded:
                self.on_event("secagg_excluded", {"round": round_id, "excluded": dict(self.server.excluded)})
            self.server = None
        if self.accountant is None:
            return out
        z = self.z
        if isinstance(self.strategy, CentralDP):
            z = self.strategy.noise_multiplier()
        elif self.grid is not None:
            z = self.grid.noise_multiplier(max(int(out.get("secagg_survivors", 0)), 1))
        if aggregated:
            self.accountant.add(z, self.q)
        eps = self.accountant.epsilon()
        out.update({"epsilon": eps if math.isfinite(eps) else None, "delta": self.cfg.delta,
                    "noise_multiplier": z, "sampling_rate": self.q})
        return out

    def state(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state() if self.accountant else {},
                "pinned": {d: k.hex() for d, k in self.pinned.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.accountant is not None and state.get("accountant"):
            self.accountant = Accountant.from_state(state["accountant"], self.cfg.delta)
        self.pinned.update({d: bytes.fromhex(k) for d, k in (state.get("pinned") or {}).items()})

