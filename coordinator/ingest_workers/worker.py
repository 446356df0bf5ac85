"""One ingest worker process: updates from a shared subscription, checked, decoded and
folded into this worker's part of the round, persisted, then acknowledged.

Started by :class:`~coordinator.ingest_workers.pool.WorkerPool` as ``python -c
"...worker import main; main()" FD`` (``FD``: its end of a socket pair; it exits when the
pool's end closes). Per batch of received updates: ``Ingest.checked`` and ``encoded``
(steps 1-4 and 8 of ``coordinator.ingest``: size, MAC, parse, identity, tensors), one
``claim`` to the combiner (steps 5-7a, which need the round's state: round, selection,
duplicate, sample bound), ``Strategy.fold`` of the claimed ones, then this process's
inbox log (``RunState`` with its own tag), one ``fdatasync`` and the PUBACKs, in the
background (``AckCommitter``). Refused messages are acknowledged too and reported. On
``finish`` it drains its committer and hands the round's partial sums to the combiner.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from coordinator.defense.config import DefenseConfig
from coordinator.ops.admission import AdmissionConfig
from edge_client.protocol import DEFAULT_LIMITS, Limits

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.transport import TlsOptions

#: most received updates checked and claimed together
BATCH = 16


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs (sent once, pickled, over its socket pair)."""

    index: int
    job: str
    model: str
    strategy: str
    strategy_params: dict[str, Any]
    run_dir: str
    url: str
    client_id: str
    username: str | None = None
    password: str | None = None
    tls: TlsOptions | None = None
    protocol: str = "auto"
    max_payload: int = 64 * 1024 * 1024 + 65536
    limits: Limits = DEFAULT_LIMITS
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    #: the poisoning guard, run on this worker's share of the round (its medians)
    defense: DefenseConfig = field(default_factory=DefenseConfig)
    #: the shared subscription's topic filter (``$share/<group>/fedbit/<job>/update/+``)
    share: str = ""


class Worker:
    """The loop of one worker process (see the module docstring)."""

    def __init__(self, cfg: WorkerConfig, conn: Connection) -> None:
        from coordinator.commit import AckCommitter
        from coordinator.ingest import Ingest
        from coordinator.state import RunState
        from coordinator.strategies import build_strategy
        from edge_client.transport import MqttTransport
        from firmware_models import resolve_model

        self.cfg, self.conn = cfg, conn
        self.tag = f"w{cfg.index}-{os.getpid()}"
        self.state = RunState(cfg.run_dir, inbox_tag=self.tag)
        shapes = [tuple(s) for s in resolve_model(cfg.model).param_shapes()]
        self.ingest = Ingest(cfg.model, shapes, cfg.limits, cfg.admission, cfg.job)
        self.strategy = build_strategy(cfg.strategy, model=cfg.model, **cfg.strategy_params)
        if cfg.defense.norm_bound or cfg.defense.sample_bound:
            from coordinator.defense.guard import GuardedStrategy

            self.strategy = GuardedStrategy(self.strategy, cfg.defense)
        self.round_id: int | None = None  # the round the strategy folds
        self.folded: list[str] = []  # devices folded into this round's part
        self.transport = MqttTransport(cfg.url, cfg.client_id, username=cfg.username, password=cfg.password,
                                       tls=cfg.tls, subscriptions=[cfg.share], manual_ack=True,
                                       persistent_session=True, protocol=cfg.protocol, max_payload=cfg.max_payload)
        self.committer: AckCommitter = AckCommitter(self.state.inbox_sync, self.transport.ack,
                                                    persist=lambda rec: self.state.inbox_append(*rec))
        self._later: list[tuple] = []  # control messages that came while a claim was answered

    def run(self) -> None:
        self.transport.connect(timeout=60.0)
        self.conn.send(("ready", os.getpid(), self.tag))
        while True:
            while self._later:
                if self._control(self._later.pop(0)):
                    return
            while self.conn.poll():
                if self._control(self.conn.recv()):
                    return
            self.committer.check()
            msg = self.transport.recv(timeout=0.05)
            if msg is None:
                continue
            batch = [msg]
            while len(batch) < BATCH and (more := self.transport.recv(timeout=0)) is not None:
                batch.append(more)
            self._handle(batch)

    def _control(self, msg: tuple) -> bool:
        """A message of the combiner; True to stop."""
        kind = msg[0]
        if kind == "begin":
            _, r, weights, groups = msg
            if groups is not None:  # (a grouped combiner's per-bitwidth models: the guard's references)
                getattr(self.strategy, "inner", self.strategy).group_models = groups
            self.strategy.begin_round(r, weights)
            self.round_id, self.folded = r, []
        elif kind == "finish":
            r = msg[1]
            self.committer.drain()
            if r == self.round_id:
                self.conn.send(("partial", r, self.strategy.partial(), list(self.folded)))
                self.round_id, self.folded = None, []
            else:
                self.conn.send(("partial", r, None, []))
        elif kind == "stop":
            self.committer.drain()
            return True
        return False

    def _handle(self, batch: list[Any]) -> None:
        from coordinator.collect import codec_label
        from coordinator.ingest import Rejected
        from edge_client.errors import ProtocolError
        from edge_client.protocol import parse_topic

        refused: list[tuple] = []
        candidates: list[tuple[Any, Any]] = []
        for msg in batch:
            try:
                job, kind, dev = parse_topic(msg.topic)
                if job != self.cfg.job or kind != "update" or dev is None:
                    raise ProtocolError("not an update topic of this job")
            except ProtocolError:
                refused.append(("bad_topic", msg.topic, False, False, ""))
                continue
            try:
                m = self.ingest.checked(dev, msg.payload)
                try:
                    eu = self.ingest.encoded(m)
                except ProtocolError as exc:
                    raise Rejected.from_protocol(exc) from None
            except Rejected as exc:
                refused.append((exc.reason, exc.detail, exc.dropped, exc.quiet, dev))
                continue
            candidates.append((msg, (m, eu)))
        records = []
        if candidates:
            claims = [(k, m.device_id, m.round_id, eu.num_samples, len(msg.payload), codec_label(eu.tensors),
                       dict(eu.not_applied)) for k, (msg, (m, eu)) in enumerate(candidates)]
            self.conn.send(("claim", claims))
            answers = self._answers()
            for (msg, (m, eu)), (ok, n) in zip(candidates, answers, strict=True):
                if not ok:
                    continue  # refused by the combiner, which counts it
                if m.round_id != self.round_id:  # (the combiner begins a round here before it admits any)
                    self.conn.send(("unclaim", m.device_id, m.round_id, "wrong_round", "not begun in the worker"))
                    continue
                eu.num_samples = n
                try:
                    self.strategy.fold(eu)
                except ProtocolError as exc:
                    self.conn.send(("unclaim", m.device_id, m.round_id, exc.reason, f"strategy: {exc}"))
                    continue
                self.folded.append(m.device_id)
                records.append((m.round_id, m.device_id, msg.payload))
        if refused:
            self.conn.send(("refused", refused))
        self.committer.submit(batch, records)

    def _answers(self) -> list[tuple[bool, int]]:
        """Wait for the combiner's answers to the claim just sent (keeping control messages
        that come first for later)."""
        while True:
            msg = self.conn.recv()
            if msg[0] == "claims":
                return msg[1]
            self._later.append(msg)


def main() -> None:
    """Entry of a worker process (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops its workers
    conn = Connection(int(sys.argv[1]))
    code = 0
    worker = None
    try:
        kind, cfg = conn.recv()
        assert kind == "config", kind
        worker = Worker(cfg, conn)
        worker.run()
        worker.transport.close()
    except (EOFError, BrokenPipeError):  # the coordinator is gone: stop at once (unacked: redelivered)
        code = 0
    except Exception as exc:  # noqa: BLE001 - reported to the pool, then the process ends
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
