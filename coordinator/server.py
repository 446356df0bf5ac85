"""The round loop: select, announce, collect, aggregate, evaluate, checkpoint.

:class:`Coordinator` speaks only to a :class:`~coordinator.fleet.Fleet`. A round selects
(``Collector.select``: present, eligible, not quarantined, seeded), builds one model
variant per bitwidth group among the selected (``coordinator.variants``), saves the round
plan and announces (models, round, status; retained); collects until quorum, every
selected device answered or is gone, or the deadline (``Collector.collect``: each update
``Ingest`` -> the guarded ``Strategy.fold`` -> inbox, synced, then acked; a secure round
runs ``coordinator.privacy.round`` instead); then ``strategy.finish()``, evaluates every
variant, checks health (a collapse: :mod:`coordinator.defense.recover`), records strikes,
writes the checkpoint atomically, one metrics line and the retained status.

``run(resume=True)`` continues from the last completed round: a round the coordinator
died in is re-announced from its plan and its inbox replayed, so every acked update counts
once (docs/architecture.md#one-round, docs/architecture.md#failure-semantics).
``coordinator.job.coordinator_for`` picks this loop or the buffered one by ``round.mode``.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from coordinator.collect import Collector, NotEnoughDevices
from coordinator.config import ServerConfig
from coordinator.defense.loop import RoundDefense
from coordinator.defense.recover import recover
from coordinator.devices import DeviceRegistry
from coordinator.evaluate import Evaluator
from coordinator.fleet import Fleet
from coordinator.health import HealthWatch
from coordinator.ingest import Ingest, OpenRound
from coordinator.ops.logs import group_accuracy_text
from coordinator.privacy.round import Privacy
from coordinator.state import Checkpoint, CorruptFile, RoundPlan, RunState
from coordinator.strategies.round import RoundStrategy
from coordinator.variants import model_messages
from edge_client.errors import ConfigError
from edge_client.protocol import (
    FLOAT_VARIANT,
    Presence,
    RoundAnnouncement,
    Status,
    encode_message,
    model_variant,
    variant_bits,
)

log = logging.getLogger("fedbit.server")


RoundError = NotEnoughDevices  # a round cannot start (too few devices present in time)


class Coordinator:
    """The round loop against a :class:`Fleet`; see the module docstring.

    Args:
        cfg: the loop settings.
        fleet: where devices are.
        strategy: what aggregates (:class:`~coordinator.strategies.RoundStrategy`).
        state: the run directory.
        evaluator: ``{variant: weights} -> {variant: (loss, accuracy)}`` on the held-out
            set (``coordinator.evaluate.ModelEvaluator``; None: skipped). Every round it
            scores each variant the known devices run; ``accuracy``/``loss`` of the record
            are the float32 (global) model's, ``groups`` has them all (with any further
            figures the evaluator adds, such as ``val_accuracy``).
        init_weights: the initial shared weights (``intnn.init_shared(spec, seed)``).
        on_event: progress callback ``(event, fields)``; events ``round_start``,
            ``update``, ``reject``, ``device``, ``gone``, ``round_end``, ``waiting``, ``health``, ``collapse``.
    """

    def __init__(self, cfg: ServerConfig, fleet: Fleet, strategy: RoundStrategy, state: RunState, *,
                 evaluator: Evaluator | None, init_weights: list[np.ndarray],
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 logger: logging.Logger | None = None) -> None:
        cfg.validate(strategy)
        self.cfg = cfg
        self.fleet = fleet
        self.strategy = strategy
        self.state = state
        self.evaluator = evaluator
        self.on_event = on_event or (lambda _e, _f: None)
        self.log = logger or log
        from firmware_models import resolve_model

        self.spec = resolve_model(cfg.model)
        self.names = self.spec.param_names()
        shapes = [tuple(s) for s in self.spec.param_shapes()]
        if [tuple(w.shape) for w in init_weights] != shapes:
            raise ConfigError(f"initial weights do not match model {cfg.model}")
        self.weights = [np.asarray(w, dtype=np.float32).copy() for w in init_weights]
        self.group_weights: dict[int, list[np.ndarray]] = {}
        self.rng = np.random.default_rng(cfg.seed)
        self.completed = 0
        self.run_id = f"{int(time.time())}-{os.getpid()}"
        self.history: list[dict[str, Any]] = []
        self.health = HealthWatch.for_run(self.spec, cfg, evaluator, log=self.log, on_event=self.on_event)
        #: the inbound side: devices, ingest, folding, the inbox and acks
        self.collector = Collector(fleet, Ingest(cfg.model, shapes, cfg.limits, cfg.admission, cfg.job), strategy, state,
                                   on_event=self.on_event, logger=self.log, ack_timeout_s=cfg.ack_timeout_s)
        self.privacy = Privacy(cfg, fleet, self.collector, shapes, self.log, self.on_event)
        #: poisoning resistance: the strategy folds guarded updates, quarantined devices sit out
        self.defense = RoundDefense(cfg.defense, state.dir, on_event=self.on_event, logger=self.log)
        self.strategy = self.collector.strategy = self.defense.wrap(self.privacy.wrap(strategy))

    # ------------------------------------------------------------------ rounds

    def open_round(self, r: int, selected: list[str]) -> OpenRound:
        """Start collecting round ``r`` from ``selected``, from the current global model."""
        rnd = OpenRound(r, frozenset(selected))
        self.strategy.begin_round(r, [w.copy() for w in self.weights])
        self.collector.open(rnd)
        return rnd

    def run_round(self, r: int, plan: RoundPlan | None = None) -> dict[str, Any]:
        """Run round ``r`` (``plan`` given: resume it) and return its metrics record."""
        cfg, col = self.cfg, self.collector
        t_start = time.monotonic()
        col.new_round()
        clock = col.clock
        resumed = plan is not None
        if plan is None:
            selected = col.select(cfg, self.rng, self.defense.quarantined(r))
            hellos = [col.devices.hellos[d] for d in selected]
            variants = {FLOAT_VARIANT} | {model_variant(h.compute_bits, h.trainer) for h in hellos}
        else:
            selected, variants = list(plan.selected), set(plan.variants)
            if plan.rng_state:
                self.rng.bit_generator.state = json.loads(plan.rng_state)
        wait, t_start = time.monotonic() - t_start, time.monotonic()  # the wait for devices is not round time
        with clock.timed("announce"):
            payloads = model_messages(
                r, cfg.model, self.names, variants, weights=self.weights, group_weights=self.group_weights,
                server_state=self.strategy.server_state(),
                limits=cfg.limits)
            digests = {v: d for v, (_, d) in payloads.items()}
            if plan is not None and digests != plan.variants:
                raise ConfigError(f"round {r}: the resumed model differs from the announced one")
            plan = RoundPlan(round_id=r, selected=selected, deadline=time.time() + cfg.round_timeout_s,
                             variants=digests, hparams=(dict(plan.hparams) if resumed else self.strategy.device_hparams(
                                 cfg.hparams, hellos) | {"run": self.run_id}) | self.privacy.hparams(r),
                             started_at=time.time(), rng_state=json.dumps(self.rng.bit_generator.state))
            self.state.save_plan(plan)
            rnd = self.open_round(r, selected)
            n_damaged = len(self.state.damaged)
            replayed = sum(col.update(dev, payload, replay=True) for dev, payload in self.state.inbox_items(r))
            if len(self.state.damaged) > n_damaged:
                col.counts["inbox_damaged"] += len(self.state.damaged) - n_damaged
            ann = RoundAnnouncement(job=cfg.job, round_id=r, model=cfg.model, selected=tuple(selected),
                                    deadline=plan.deadline, variants=digests, hparams=dict(plan.hparams))
            self.fleet.announce_round({v: p for v, (p, _) in payloads.items()}, encode_message(ann, cfg.limits),
                                      encode_message(Status("round", r, f"round {r}")))
        self.on_event("round_start", {"round": r, "selected": selected, "resumed": resumed, "replayed": replayed,
                                      "deadline_s": cfg.round_timeout_s, "wait_seconds": wait})
        self.log.info("round %d: selected %d device(s)%s%s", r, len(selected), f" after waiting {wait:.1f} s for "
                      "devices" if wait >= 0.1 else "", f", resumed with {replayed} update(s) from the inbox"
                      if resumed else "", extra={"event": "round_start", "round": r, "selected": selected})
        need, until = max(1, math.ceil(cfg.quorum * len(selected))), time.monotonic() + cfg.round_timeout_s
        if cfg.privacy.secure_aggregation:  # the secure round's phases instead of updates
            stragglers = self.privacy.collect(rnd, plan.hparams, need, until)
        else:
            stragglers = col.collect(need, until, more=lambda: self.fleet.more_expected(r))
        t_collect = time.monotonic()
        with clock.timed("announce"):
            self.fleet.flush()  # the announcement's PUBACKs (long arrived, as a rule)
        stats: dict[str, Any] = {}
        aggregated = len(rnd.accepted) >= cfg.min_updates
        old, old_groups = [w.copy() for w in self.weights], self.group_weights
        with clock.timed("aggregate"):
            if aggregated:
                self.health.snapshot(self.strategy)
                result = self.strategy.finish()
                self.weights = [np.asarray(w, dtype=np.float32) for w in result.weights]
                self.group_weights = {int(b): [np.asarray(w, dtype=np.float32) for w in ws]
                                      for b, ws in (result.group_weights or {}).items()}
                stats = {k: v for k, v in (result.stats or {}).items()
                         if isinstance(v, int | float) and math.isfinite(v)}
            else:
                self.log.warning("round %d: %d update(s) < min_updates %d; the model is unchanged",
                                 r, len(rnd.accepted), cfg.min_updates)
        te = time.perf_counter()
        scores = self._evaluate(r)
        eval_s = time.perf_counter() - te
        health = self.health.check(r, (self.weights, self.group_weights), (old, old_groups), scores, self.history)
        if health.rolled_back:  # the round without the update(s) that collapsed it, else the last healthy model
            scores = recover(self, r, rnd, (old, old_groups), health)
        loss, acc = (math.nan if v is None else float(v) for v in scores.get(FLOAT_VARIANT, (None, None))[:2])
        change = float(math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(self.weights, old, strict=True))))
        finite = lambda v: float(v) if isinstance(v, numbers.Real) and math.isfinite(v) else None  # noqa: E731
        parts = clock.parts
        record: dict[str, Any] = {
            "round": r, "time": time.time(), "run": self.run_id, "strategy": cfg.strategy,
            "model": cfg.model, "accuracy": finite(acc), "loss": finite(loss), "selected": len(selected),
            "selected_ids": selected, "accepted": len(rnd.accepted), "accepted_ids": sorted(rnd.accepted),
            "stragglers": len(stragglers), "straggler_ids": stragglers, "gone": dict(sorted(rnd.gone.items())),
            "aggregated": aggregated, "resumed": resumed, "replayed": replayed,
            "weight_change_l2": change, "round_seconds": time.monotonic() - t_start, "wait_seconds": wait,
            "collect_seconds": t_collect - t_start, "aggregate_seconds": parts["aggregate"],
            "coordinator_seconds": clock.wall, "coordinator_cpu_seconds": clock.cpu,
            "eval_seconds": eval_s, "announce_seconds": parts["announce"],
            "handle_seconds": clock.wall - parts["announce"] - parts["aggregate"],
            "counts": dict(col.counts), "stats": stats,
            "groups": {v: {"loss": finite(s[0]), "accuracy": finite(s[1]),
                           **{k: finite(x) for k, x in (s[2] if len(s) > 2 else {}).items()}}
                       for v, s in scores.items()},
            "uplink_bytes": dict(col.uplink_bytes), "health": health.record, "health_seconds": health.seconds,
            "defense": self.defense.after_round(r, rnd.accepted, col.refused_devices, col.over_claimed),
            **self.fleet.round_report(r), **self.privacy.end_round(r, len(selected), col.present, aggregated),
        }
        with clock.timed("checkpoint"):
            self.completed = r
            col.close(r)
            if col.devices.changed:
                self.state.save_devices(col.devices.to_state())
                col.devices.changed = False
            self.state.save_checkpoint(self._checkpoint(record))
            self.state.append_metrics(record)
            self.state.inbox_prune(r)  # round r's is kept until the next checkpoint (fallback)
            # PUBACK waited for by the next round's flush (or run()'s, after the last round)
            self.fleet.publish_status(encode_message(Status(
                "waiting" if r < cfg.rounds and self.privacy.allows(r + 1) else "done", r, f"round {r} complete",
                {k: float(v) for k, v in (("accuracy", acc), ("loss", loss)) if math.isfinite(v)})))
        # (in memory only: the line on disk was written before these were known)
        record |= {"checkpoint_seconds": parts["checkpoint"], "coordinator_seconds": clock.wall,
                   "coordinator_cpu_seconds": clock.cpu, "round_seconds": time.monotonic() - t_start}
        self.history.append(record)
        self.on_event("round_end", record)
        self.log.info("round %d: %d/%d updates, accuracy %s", r, len(rnd.accepted), len(selected),
                      group_accuracy_text(record),
                      extra={"event": "round_end", "round": r, "accuracy": record["accuracy"]})
        return record

    def _evaluate(self, r: int) -> dict[str, tuple[Any, ...]]:
        """(loss, accuracy[, further figures]) of every model variant the known devices run
        after round ``r`` (float32 always; see ``coordinator.evaluate.Evaluator``)."""
        if self.evaluator is None:
            return {}
        return self.evaluator({v: self.group_weights.get(variant_bits(v), self.weights)
                               for v in self.collector.devices.variants()}, at_round=r)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, record: dict[str, Any]) -> Checkpoint:
        return Checkpoint(
            job=self.cfg.job, model=self.cfg.model, completed_round=self.completed,
            weights=self.weights, group_weights=self.group_weights,
            strategy_state=self.strategy.state_dict(),
            rng_state={"json": json.dumps(self.rng.bit_generator.state)},
            metrics=record,
            config={"run_id": self.run_id, "rounds": self.cfg.rounds, "strategy": self.cfg.strategy,
                    "totals": dict(self.collector.totals), "privacy": self.privacy.state()},
        )

    def _restore(self) -> dict[int, RoundPlan]:
        """Load the last good checkpoint; returns the kept plans of the rounds after it
        (by round id) to resume."""
        ckpt = self._load(self.state.load_checkpoint, "checkpoint")
        if ckpt is False:  # damaged: the generation before it, and replay the round after
            ckpt = self.state.load_checkpoint(previous=True)
            self.log.warning("resuming from %s (round %s)", self.state.checkpoint_prev_path,
                             ckpt.completed_round if ckpt else 0, extra={"event": "fallback"})
        plans = {}
        for previous in (True, False):
            p = self._load(lambda previous=previous: self.state.load_plan(previous=previous), "round plan")
            if p:
                plans[p.round_id] = p
        plan = plans.get(max(plans)) if plans else None
        if ckpt is not None:
            if ckpt.model != self.cfg.model or ckpt.job != self.cfg.job:
                raise ConfigError(f"{self.state.checkpoint_path}: job/model {ckpt.job}/{ckpt.model} "
                                  f"!= {self.cfg.job}/{self.cfg.model}")
            self.completed = ckpt.completed_round
            self.collector.close(self.completed)
            self.weights = [np.asarray(w, dtype=np.float32) for w in ckpt.weights]
            self.group_weights = dict(ckpt.group_weights)
            if ckpt.strategy_state:
                self.strategy.load_state_dict(ckpt.strategy_state)
            if ckpt.rng_state.get("json"):
                self.rng.bit_generator.state = json.loads(ckpt.rng_state["json"])
            devices = self._load(self.state.load_devices, "device registry") or {}
            self.collector.devices = DeviceRegistry.from_state(devices or ckpt.devices)
            self.run_id = str(ckpt.config.get("run_id", self.run_id))
            self.defense.restore()
            self.collector.totals.update(ckpt.config.get("totals", {}))
            self.privacy.load_state(ckpt.config.get("privacy") or {})
        elif plan is not None:
            self.run_id = str(plan.hparams.get("run", self.run_id))
        self.state.repair_metrics(ckpt)
        self.history = self.state.read_metrics()
        return {r: p for r, p in plans.items() if r > self.completed}

    def _load(self, read: Callable[[], Any], what: str) -> Any:
        """``read()``, or False after logging a damaged file by name (CorruptFile)."""
        try:
            return read()
        except CorruptFile as exc:
            self.log.error("%s: %s not loaded", exc, what, extra={"event": "corrupt", "path": str(exc.path)})
            return False

    # ------------------------------------------------------------------ main

    def run(self, *, resume: bool = False) -> list[dict[str, Any]]:
        """Run the remaining rounds; returns the metrics records of all completed rounds."""
        plans: dict[int, RoundPlan] = {}
        if resume:
            plans = self._restore()
            self.log.info("resuming after round %d%s", self.completed,
                          f" (round(s) {sorted(plans)} in progress)" if plans else "")
        elif self.state.has_run():
            raise ConfigError(f"{self.state.dir} holds a previous run: pass --resume or use another --out")
        self.fleet.start()
        roster = self.fleet.roster()  # devices the fleet registers in bulk
        for cohort in roster:
            self.collector.devices.add_cohort(cohort)
        for device_id in self.fleet.offline():  # roster members not online at the start
            self.collector.devices.apply(Presence(device_id, False))
        if roster and len(self.collector.devices.hellos) > self.cfg.admission.max_registered:
            raise ConfigError(f"the fleet registers {len(self.collector.devices.hellos)} devices: more than "
                              f"admission.max_registered ({self.cfg.admission.max_registered})")
        # (no pump here: on resume, queued messages are handled once their round is set up again)
        if not resume or self.completed == 0 and not plans:
            # a fresh run: clear a previous run's retained announcement, say we are here
            self.fleet.reset(encode_message(Status("waiting", 0, "coordinator started")))
        try:
            self._loop(plans)
            self.fleet.flush()  # the last status reached the broker
        except BaseException:
            try:
                self.fleet.publish_status(encode_message(Status("error", self.completed, "coordinator stopped")),
                                          wait=True)
            except Exception:  # noqa: BLE001 - the broker may be gone
                pass
            raise
        return self.history

    def _loop(self, plans: dict[int, RoundPlan]) -> None:
        """The rounds left (``plans``: those in progress to resume, by round id)."""
        while self.completed < self.cfg.rounds and self.privacy.allows(self.completed + 1) and not self.fleet.done():
            self.run_round(self.completed + 1, plans.pop(self.completed + 1, None))
