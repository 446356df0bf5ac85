"""The round's combiner: the coordinator's side of its ingest workers.

:class:`IngestWorkers` answers the workers' claims (the rules of ``coordinator.ingest``
that need the round's state, steps 5-7a: an admitted device is accepted at once, so a
second copy of its update, on any worker, is a duplicate), turns what the workers report
into the collector's bookkeeping (``Inbound`` messages of kind ``ingest`` that
:class:`IngestFleet` delivers and ``Collector.on_ingest`` hands back here), and at the
round's end (:class:`PartialStrategy`'s ``finish``) adds every worker's partial sums to
the round strategy's own. A worker that dies mid-round loses nothing it acknowledged: its
claimed devices are released, its inbox log's updates folded here, and a new process
under the same MQTT client id takes over its broker session; without one, the session is
ended and the round announced again, so every selected device re-sends its update from
its outbox (why: docs/architecture.md#ingest-workers).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from coordinator.fleet import Inbound, MqttFleet
from coordinator.ingest import Rejected
from coordinator.ingest_workers.pool import WorkerPool
from coordinator.ingest_workers.worker import WorkerConfig
from coordinator.strategies.types import AggregateResult, EncodedUpdate
from edge_client.errors import ConfigError
from edge_client.protocol import Hello, topic

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.collect import Collector
    from coordinator.config import ServerConfig
    from coordinator.job import ServeJob
    from coordinator.ops.broker import Broker
    from coordinator.strategies.base import Strategy

log = logging.getLogger("fedbit.ingest")

#: the run folder's record of how many workers the job's broker sessions belong to
RECORD = "ingest-workers.json"


def refusal(cfg: ServerConfig) -> str:
    """Why the job of ``cfg`` (a :class:`~coordinator.config.ServerConfig`) cannot run ingest
    workers ("" when it can): a strategy that does not fold a round in parts (robust
    aggregation holds the round's updates; a dequantizer reads every one), or privacy
    (secure aggregation and DP handle every update in the round loop), or buffered mode
    (each update answers its own request and counts with its own staleness weight)."""
    from coordinator.strategies.registry import folds_in_parts

    if getattr(cfg, "mode", "sync") == "buffered":
        return ("round.mode = \"buffered\" admits, weighs and folds each update in its own loop (a request "
                "per device, a staleness weight per update), not in partial sums of a round")
    if cfg.privacy.active:
        return "privacy (secure aggregation, DP) handles every update in the round loop itself"
    why = folds_in_parts(cfg.strategy, cfg.strategy_params)
    return f"strategy {cfg.strategy!r} {why}: it cannot add partial sums" if why else ""


def ingest_workers_for(job: ServeJob, broker: Broker | None, url: str, conn: Mapping[str, Any],
                       logger: logging.Logger | None = None) -> IngestWorkers:
    """``fedbit serve``'s workers for ``job`` (a :class:`~coordinator.job.ServeJob`), whose
    coordinator reaches ``url`` with ``conn``; ConfigError on an embedded amqtt broker
    (it accepts ``$share`` subscriptions but delivers nothing to them)."""
    if broker is not None and getattr(broker, "kind", "") == "amqtt":
        raise ConfigError("--ingest-workers: the embedded amqtt broker delivers nothing to shared "
                          "subscriptions; install mosquitto (or give --broker URL)")
    return IngestWorkers(job.ingest_workers, job.server, {"url": url, **conn}, job.out, logger=logger)


class FoldsPartials(Protocol):
    """What the workers' partial sums are added to: a strategy that folds a round in parts
    (its outermost wrapper: the poisoning guard, :class:`PartialStrategy`)."""

    def fold_partial(self, part: Mapping[str, Any]) -> None: ...


class IngestWorkers:
    """``n`` ingest worker processes and their combiner (see the module docstring).

    Args:
        n: worker processes.
        cfg: the round loop's settings.
        conn: how the coordinator reaches its broker (``MqttFleet``'s ``url``,
            ``username``, ``password``, ``tls``, ``client_id``, ``protocol``,
            ``max_payload``); worker ``i`` connects as ``<username>-ingest-<i>`` (the
            coordinator's password) with client id ``<client id>-ingest-<i>``.
        run_dir: the run folder (each worker's inbox log goes to its ``inbox/``).
        respawn: replace a worker that died (else end its session, announce the round
            again and go on with the others).
        partial_timeout_s: how long the round's end waits for a worker's partial sums
            before it is killed (and its inbox folded here).
    """

    def __init__(self, n: int, cfg: ServerConfig, conn: Mapping[str, Any], run_dir: str | Path, *,
                 logger: logging.Logger | None = None, respawn: bool = True,
                 partial_timeout_s: float = 300.0) -> None:
        if n < 1:
            raise ConfigError(f"ingest workers: need at least 1, got {n}")
        self.n = n
        self.cfg = cfg
        self.conn = dict(conn)
        self.run_dir = Path(run_dir)
        self.log = logger or log
        self.respawn = respawn
        self.partial_timeout_s = partial_timeout_s
        self.cv = threading.Condition(threading.RLock())
        self.events: queue.Queue[tuple] = queue.Queue()
        self.collector: Collector | None = None
        self.target: FoldsPartials | None = None  # what the partial sums are folded into (attach)
        self.fleet: IngestFleet | None = None
        self.round_id: int | None = None
        self._begin: tuple | None = None  # the open round's begin message
        #: device -> (worker, generation, payload bytes, codec) of this round's admitted claims
        self.claims: dict[str, tuple[int, int, int, str]] = {}
        self.partials: dict[tuple[int, int], tuple[int, Any, list[str]]] = {}
        self.dead: dict[tuple[int, int], str] = {}  # processes that ended, not yet recovered -> inbox tag
        self.gathering = False
        #: (device, round, (worker, generation)) of claims whose "accepted" report was counted,
        #: and of claims released (their report, if it comes later, is dropped)
        self._noted: set[tuple[str, int, tuple[int, int]]] = set()
        self._void: set[tuple[str, int, tuple[int, int]]] = set()
        self.retired: set[int] = set()
        self.restarts: list[float] = []
        self.stats: Counter[str] = Counter()
        self.pool = WorkerPool(n, self._config, self._on_message, self._on_exit)

    # ------------------------------------------------------------------ wiring

    def fleet_for(self, url: str, job: str, **kw: Any) -> IngestFleet:
        """The coordinator's fleet: ``MqttFleet``'s, without the update subscription."""
        self.fleet = IngestFleet(url, job, workers=self, **kw)
        return self.fleet

    def wrap(self, strategy: Strategy) -> PartialStrategy:
        return PartialStrategy(strategy, self)

    def attach(self, collector: Collector, strategy: FoldsPartials | None = None) -> None:
        """The round loop's collector (its open round, registry, bookkeeping) and its
        outermost strategy (the poisoning guard around :class:`PartialStrategy`), which the
        workers' partial sums are folded into (its ``fold_partial``)."""
        self.collector = collector
        self.target = strategy
        collector.on_ingest = self.handle

    def _worker_name(self, base: str | None, i: int) -> str | None:
        return f"{base}-ingest-{i}" if base else None

    def _config(self, i: int) -> WorkerConfig:
        c, cfg = self.conn, self.cfg
        client = c.get("client_id") or f"fedbit-coordinator-{cfg.job}"
        root = topic(cfg.job, "round").rsplit("/", 1)[0]
        return WorkerConfig(
            index=i, job=cfg.job, model=cfg.model, strategy=cfg.strategy, strategy_params=dict(cfg.strategy_params),
            run_dir=str(self.run_dir), url=c["url"], client_id=self._worker_name(client, i) or "",
            username=self._worker_name(c.get("username"), i), password=c.get("password"), tls=c.get("tls"),
            protocol=c.get("protocol", "auto"), max_payload=int(c.get("max_payload", 64 * 1024 * 1024 + 65536)),
            limits=cfg.limits, admission=cfg.admission, defense=cfg.defense,
            share=f"$share/fedbit-{cfg.job}/{root}/update/+")

    def start(self, timeout: float = 120.0) -> None:
        """End the broker sessions of workers a previous run had beyond ``n``, start the
        workers, wait until each is connected (ConnectionError naming one that is not)."""
        record = self.run_dir / RECORD
        try:
            before = int(json.loads(record.read_text()).get("workers", 0))
        except (OSError, ValueError, AttributeError):
            before = 0
        for i in range(self.n, before):
            self.end_session(i)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"workers": max(self.n, 0)}))
        for i in range(self.n):
            self.pool.spawn(i)
        self.pool.wait_ready(timeout)
        self.log.info("%d ingest worker(s) started (pids %s), sharing the updates of job %s", self.n,
                      ", ".join(str(self.pool.pid(i)) for i in range(self.n)), self.cfg.job,
                      extra={"event": "ingest_workers", "workers": self.n})

    def stop(self) -> None:
        self.pool.stop()

    def end_session(self, i: int) -> None:
        """End worker ``i``'s broker session (connect once with a clean start under its
        client id): the broker stops giving it a share of the updates, and the messages it
        held are dropped (their devices re-send when the round is announced again)."""
        from edge_client.transport import MqttTransport

        wc = self._config(i)
        t = MqttTransport(wc.url, wc.client_id, username=wc.username, password=wc.password, tls=wc.tls,
                          persistent_session=False, protocol=wc.protocol)
        try:
            t.connect(timeout=30.0)
        finally:
            t.close()

    # ------------------------------------------------------------------ worker messages (reader threads)

    def _on_message(self, i: int, gen: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "claim":
            self.pool.send(i, ("claims", self._answer(i, gen, msg[1])))
        elif kind == "unclaim":
            _, dev, r, reason, detail = msg
            with self.cv:
                self._release(dev, (i, gen))
            self.events.put(("refused", r, Rejected(reason, detail), dev))
        elif kind == "refused":
            for reason, detail, dropped, quiet, dev in msg[1]:
                self.events.put(("refused", None, Rejected(reason, detail, dropped=dropped, quiet=quiet), dev))
        elif kind == "partial":
            with self.cv:
                self.partials[(i, gen)] = (msg[1], msg[2], msg[3])
                self.cv.notify_all()
        elif kind == "error":
            self.log.error("ingest worker %d: %s", i, msg[1], extra={"event": "ingest_worker_error", "worker": i})

    def _answer(self, i: int, gen: int, claims: Sequence[tuple]) -> list[tuple[bool, int]]:
        """Steps 5-7a for each claimed update, against the open round (see the module docstring)."""
        col = self.collector
        out = []
        with self.cv:
            rnd = col.round
            for _k, dev, r, n, nbytes, codec, not_applied in claims:
                try:
                    if self.gathering:
                        raise Rejected("late", f"round {r} is closing", dropped=True)
                    col.ingest.admit(dev, r, rnd, col.completed)
                    limit = col.ingest.sample_limit(dev, n, col.devices)
                except Rejected as exc:
                    self.events.put(("refused", r, exc, dev))
                    out.append((False, 0))
                    continue
                rnd.accepted[dev] = time.monotonic()
                self.claims[dev] = (i, gen, nbytes, codec)
                notes = ["clipped_num_samples"] if limit != n else []
                self.events.put(("accepted", r, dev, nbytes, codec, notes, not_applied, (i, gen)))
                out.append((True, limit))
        return out

    def _release(self, dev: str, key: tuple[int, int]) -> None:
        """Take back an admitted claim (under the lock): the device is outstanding again."""
        c = self.claims.get(dev)
        if c is None or c[:2] != key:
            return
        del self.claims[dev]
        rnd = self.collector.round if self.collector is not None else None
        if rnd is not None:
            rnd.accepted.pop(dev, None)
        r = self.round_id or 0
        if (dev, r, key) in self._noted:
            self.collector.uplink_bytes[c[3]] -= c[2]
            if self.collector.uplink_bytes[c[3]] <= 0:
                del self.collector.uplink_bytes[c[3]]
        self._void.add((dev, r, key))

    def _on_exit(self, i: int, gen: int, tag: str, code: int | None) -> None:
        with self.cv:
            self.dead[(i, gen)] = tag
            self.cv.notify_all()
        self.events.put(("died", i, gen, tag, code))

    # ------------------------------------------------------------------ the round loop's thread

    def next_event(self) -> Inbound | None:
        """The next worker report as an ``ingest`` message (None when there is none)."""
        try:
            ev = self.events.get_nowait()
        except queue.Empty:
            return None
        dev = {"accepted": 2, "refused": 3}.get(ev[0])
        return Inbound("ingest", ev[dev] if dev else "", b"", time.monotonic(), "", ev)

    def handle(self, msg: Inbound) -> None:
        """``Collector.on_ingest``: one worker report."""
        ev = msg.receipt
        col = self.collector
        if ev[0] == "accepted":
            _, r, dev, nbytes, codec, notes, not_applied, key = ev
            rnd = col.round
            mark = (dev, r, key)
            with self.cv:
                if mark in self._void or rnd is None or rnd.round_id != r:
                    return
                self._noted.add(mark)
            col.note_accepted(rnd, dev, nbytes, codec, notes, not_applied)
        elif ev[0] == "refused":
            col.refuse(ev[2], "update", ev[3])
        elif ev[0] == "died":
            _, i, gen, tag, code = ev
            self._recover(i, gen)
            self._replace(i, gen, code)

    def drain(self) -> None:
        """Handle every pending worker report now."""
        while (m := self.next_event()) is not None:
            self.handle(m)

    def _recover(self, i: int, gen: int) -> None:
        """Worker ``i``'s process ``gen`` ended: release its claims of the open round and
        fold here the updates its inbox log holds (every one it acknowledged), unless its
        partial sums already arrived."""
        col = self.collector
        with self.cv:
            tag = self.dead.pop((i, gen), None)
            if tag is None or (i, gen) in self.partials:
                return
            mine = [d for d, c in self.claims.items() if c[:2] == (i, gen)]
            for d in mine:
                self._release(d, (i, gen))
            rnd, r = col.round, self.round_id
            if rnd is None or r is None or rnd.round_id != r or not tag:
                return
            folded = sum(col.update(dev, payload, replay=True) for dev, payload in col.state.inbox_items(r, tag=tag))
        self.stats["recovered"] += folded
        self.log.warning("ingest worker %d (process generation %d) ended in round %d: %d claimed update(s), "
                         "%d folded from its inbox log, the rest left to the broker's redelivery", i, gen, r,
                         len(mine), folded, extra={"event": "ingest_worker_lost", "worker": i, "round": r})

    def _replace(self, i: int, gen: int, code: int | None) -> None:
        if self.pool.stopping or gen != self.pool.gens[i] or i in self.retired:
            return
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 60.0] + [now]
        if self.respawn and len(self.restarts) > 5 * self.n:
            raise ConnectionError(f"ingest workers keep ending ({len(self.restarts)} in 60 s; the last: worker "
                                  f"{i}, exit code {code}{': ' + self.pool.errors[i] if self.pool.errors[i] else ''})")
        if self.respawn:
            self.stats["restarts"] += 1
            with self.cv:
                self.pool.spawn(i, [self._begin] if self._begin is not None else [])
            self.log.warning("ingest worker %d ended (exit code %s); started again (pid %s) under the same "
                             "broker session", i, code, self.pool.pid(i),
                             extra={"event": "ingest_worker_restart", "worker": i})
            return
        self.retired.add(i)
        self.pool.forget(i)
        self.stats["retired"] += 1
        if len(self.retired) == self.n:
            raise ConnectionError("every ingest worker ended and none is replaced (respawn off)")
        self.end_session(i)
        if self.fleet is not None:
            self.fleet.announce_again()
        self.log.warning("ingest worker %d ended (exit code %s): its broker session ended and the round "
                         "announced again (devices re-send from their outbox)", i, code,
                         extra={"event": "ingest_worker_retired", "worker": i})

    def begin(self, round_id: int, weights: list[np.ndarray], groups: dict[int, list[np.ndarray]] | None) -> None:
        """A round opens: every worker folds it from ``weights`` (and a grouped combiner's
        per-bitwidth ``groups``) from now on."""
        with self.cv:
            self.round_id, self._begin = round_id, ("begin", round_id, [np.asarray(w) for w in weights], groups)
            self.claims.clear()
            self.partials.clear()
            self._noted.clear()
            self._void.clear()
            self.gathering = False
            for i in range(self.n):
                if i not in self.retired:
                    self.pool.send(i, self._begin)

    def gather(self, inner: FoldsPartials) -> None:
        """The round's end: refuse further claims, collect every worker's partial sums
        (a worker that ended or does not answer in ``partial_timeout_s``: its inbox log
        instead) and add them to the round (through the outermost strategy when attached
        with one, else ``inner``)."""
        target = self.target if self.target is not None else inner
        with self.cv:
            self.gathering = True
            r = self.round_id
            live = [(i, self.pool.gens[i]) for i in range(self.n) if i not in self.retired and self.pool.alive(i)]
            for i, _gen in live:
                self.pool.send(i, ("finish", r))
            end = time.monotonic() + self.partial_timeout_s
            while True:
                missing = [(i, g) for i, g in live if (i, g) not in self.partials and (i, g) not in self.dead]
                if not missing:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    for i, _g in missing:
                        self.log.error("ingest worker %d did not hand over its partial sums in %.0f s: killed", i,
                                       self.partial_timeout_s)
                        self.pool.kill(i)
                    end = time.monotonic() + 30.0
                    continue
                self.cv.wait(min(left, 1.0))
        self.drain()  # counts, refusals, and the workers that ended: folded from their logs
        with self.cv:
            for key in list(self.dead):
                self._recover(*key)
            for (i, gen), (pr, part, devices) in sorted(self.partials.items()):
                if pr != r or part is None:
                    continue
                target.fold_partial(part)
                claimed = {d for d, c in self.claims.items() if c[:2] == (i, gen)}
                if set(devices) != claimed:
                    self.log.error("ingest worker %d: its partial sums hold %d update(s), %d were claimed", i,
                                   len(devices), len(claimed))
            self.stats["partials"] += sum(1 for p in self.partials.values() if p[0] == r and p[1] is not None)

    def report(self) -> dict[str, Any]:
        """What the round's metrics record says about the workers."""
        return {"workers": self.n, "retired": len(self.retired), **{k: int(v) for k, v in self.stats.items()}}


class PartialStrategy:
    """A :class:`~coordinator.strategies.round.RoundStrategy` whose rounds the ingest
    workers fold in parts: ``begin_round`` opens the round in every worker too,
    ``fold`` folds here (the inbox replayed on resume, a dead worker's log), ``finish``
    adds the workers' partial sums first."""

    def __init__(self, inner: Strategy, workers: IngestWorkers) -> None:
        if not getattr(inner, "folds_in_parts", False):
            raise ConfigError(f"strategy {inner.name!r} cannot fold a round in parts: no ingest workers")
        self.inner = inner
        self.workers = workers
        self.name = inner.name

    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        self.inner.begin_round(round_id, global_weights)
        grouped = getattr(getattr(self.inner, "combiner", None), "grouped", False)
        self.workers.begin(round_id, global_weights, dict(self.inner.group_models) if grouped else None)

    def fold(self, update: EncodedUpdate) -> None:
        self.inner.fold(update)

    def fold_partial(self, part: Mapping[str, Any]) -> None:
        self.inner.fold_partial(part)

    def finish(self) -> AggregateResult:
        self.workers.gather(self.inner)
        return self.inner.finish()

    def device_hparams(self, hparams: Mapping[str, Any], devices: Sequence[Hello] = ()) -> dict[str, Any]:
        return self.inner.device_hparams(hparams, devices)

    def server_state(self) -> dict[str, Any]:
        return self.inner.server_state()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # (what health checks and reports read of the strategy)
        return getattr(self.inner, name)


class IngestFleet(MqttFleet):
    """The coordinator's :class:`~coordinator.fleet.MqttFleet` when ingest workers take the
    updates: the same session without the update subscription, the workers' reports
    delivered as ``ingest`` messages, the workers started with it and stopped with it."""

    def __init__(self, url: str, job: str = "default", *, workers: IngestWorkers, **kw: Any) -> None:
        self.workers = workers
        super().__init__(url, job, **kw)

    @staticmethod
    def subscriptions(job: str, other_jobs: bool = False) -> list[str]:
        return [t for t in MqttFleet.subscriptions(job, other_jobs) if "/update/" not in t]

    def start(self, timeout: float = 30.0) -> None:
        super().start(timeout)
        root = topic(self.job, "round").rsplit("/", 1)[0]
        self.transport.unsubscribe(f"{root}/update/+")  # (a persistent session of a run without workers)
        self.workers.start()

    def recv(self, timeout: float) -> Inbound | None:
        ev = self.workers.next_event()
        if ev is not None:
            return ev
        return super().recv(min(timeout, 0.02))

    def ack(self, msg: Inbound) -> None:
        if msg.kind != "ingest":
            super().ack(msg)

    def announce_again(self) -> None:
        """Publish the open round's announcement once more (devices that sent their update
        send it again)."""
        payload = self._retained.get(self.t_round)
        if payload:
            self._queue([(self.t_round, payload)])

    def round_report(self, round_id: int) -> dict[str, Any]:
        return {"ingest_workers": self.workers.report()}

    def describe(self) -> str:
        return f"{super().describe()}, {self.workers.n} ingest worker(s)"

    def close(self, linger_s: float = 2.0) -> None:
        self.workers.stop()
        super().close(linger_s)
