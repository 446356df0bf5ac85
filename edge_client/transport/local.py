"""An in-process broker: :class:`LocalHub` and its :class:`LocalTransport` sessions.

The same interface as :class:`~edge_client.transport.mqtt.MqttTransport` without sockets:
retained messages, ``+``/``#`` wildcards, last-will on :meth:`LocalTransport.drop`, and
persistent sessions with redelivery of unacknowledged messages for ``manual_ack``
clients. The coordinator's ``InProcessFleet`` and in-process device runtimes (tests, the
emulator's ``inproc`` transport) exchange the same bytes through it as over a broker.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from edge_client.errors import ProtocolError
from edge_client.transport.base import Received


def topic_matches(pattern: str, name: str) -> bool:
    """MQTT topic-filter match with ``+`` and ``#``."""
    p, n = pattern.split("/"), name.split("/")
    for i, part in enumerate(p):
        if part == "#":
            return True
        if i >= len(n) or (part != "+" and part != n[i]):
            return False
    return len(p) == len(n)


class LocalHub:
    """A tiny in-process broker: retained messages, wildcard subscriptions, last-will, and
    persistent sessions for manual-ack clients.

    Payloads are delivered as the same bytes a broker would carry (copied per receiver).
    A client created with ``manual_ack=True`` has a session that outlives its connection,
    as an MQTT persistent session does (``clean_start=False``): every message delivered to
    it stays in the session until :meth:`LocalTransport.ack`; messages routed while it is
    not connected are queued there; on (re)connect the client starts with an empty inbox
    and the session's unacknowledged messages are redelivered first, in order, then the
    retained ones. So a coordinator that read an update and crashed before acknowledging
    it gets the update again, whether it reconnects with the same transport or a new one
    under the same client id.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retained: dict[str, bytes] = {}
        self._clients: list[LocalTransport] = []
        self._sessions: dict[str, _LocalSession] = {}
        self._token = 0
        self.published = 0

    def client(self, client_id: str, *, will: tuple[str, bytes] | None = None,
               birth: list[tuple[str, bytes, bool]] | None = None,
               subscriptions: list[str] | None = None, manual_ack: bool = False,
               max_payload: int = 64 * 1024 * 1024 + 64 * 1024) -> LocalTransport:
        """A transport attached to this hub (call ``connect()`` on it)."""
        return LocalTransport(self, client_id, will=will, birth=birth,
                              subscriptions=subscriptions, manual_ack=manual_ack,
                              max_payload=max_payload)

    def unacked(self, client_id: str) -> int:
        """How many messages the session of ``client_id`` holds unacknowledged (0: none)."""
        with self._lock:
            s = self._sessions.get(client_id)
            return len(s.unacked) if s is not None else 0

    def _attach(self, t: LocalTransport) -> None:
        with self._lock:
            self._clients = [c for c in self._clients if c.client_id != t.client_id] + [t]
            redeliver: list[tuple[str, bytes]] = []
            if t.manual_ack:
                t._inbox = queue.Queue()  # what the old connection held is redelivered below
                s = self._sessions.setdefault(t.client_id, _LocalSession())
                s.subscriptions = list(t.subscriptions)
                # retained deliveries come again below with their current payload
                redeliver = [(m.topic, m.payload) for m in s.unacked.values() if not m.retain]
                s.unacked.clear()
            for name, payload in redeliver:
                self._deliver_locked(t, name, payload, retain=False)
            for name in self._retained_for(t.subscriptions):
                self._deliver_locked(t, name, self._retained[name], retain=True)

    def _deliver_retained(self, t: LocalTransport, filters: list[str]) -> None:
        """The retained messages matching ``filters``, to ``t`` (a new subscription)."""
        with self._lock:
            for name in self._retained_for(filters):
                self._deliver_locked(t, name, self._retained[name], retain=True)

    def _retained_for(self, filters: list[str]) -> list[str]:
        """Retained topics matching any of ``filters``, each once: exact filters are
        looked up (a device's subscriptions: no scan of a fleet's worth of retained
        hellos), wildcard ones scan the retained topics."""
        if any("+" in f or "#" in f for f in filters):
            return [n for n in self._retained if any(topic_matches(f, n) for f in filters)]
        return [f for f in dict.fromkeys(filters) if f in self._retained]

    def _detach(self, t: LocalTransport) -> None:
        with self._lock:
            self._clients = [c for c in self._clients if c is not t]

    def _ack(self, t: LocalTransport, token: int) -> None:
        with self._lock:
            s = self._sessions.get(t.client_id)
            if s is not None:
                s.unacked.pop(token, None)

    def _deliver_locked(self, t: LocalTransport, name: str, payload: bytes, retain: bool) -> None:
        self._token += 1
        msg = Received(name, payload, 1, retain, self._token)
        if t.manual_ack:
            s = self._sessions.get(t.client_id)
            if s is not None:
                s.unacked[msg.token] = msg
        t._inbox.put(msg)

    def route(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            self.published += 1
            if retain:
                if payload:
                    self._retained[topic] = bytes(payload)
                else:
                    self._retained.pop(topic, None)
            online = set()
            for c in self._clients:
                online.add(c.client_id)
                if any(topic_matches(f, topic) for f in c.subscriptions):
                    self._deliver_locked(c, topic, bytes(payload), retain=False)
            for cid, s in self._sessions.items():  # offline persistent sessions queue it
                if cid not in online and any(topic_matches(f, topic) for f in s.subscriptions):
                    self._token += 1
                    s.unacked[self._token] = Received(topic, bytes(payload), 1, False, self._token)


@dataclass
class _LocalSession:
    """A persistent session of the hub: its subscriptions and the messages delivered or
    queued to it that were not acknowledged yet (by token, in delivery order)."""

    subscriptions: list[str] = field(default_factory=list)
    unacked: dict[int, Received] = field(default_factory=dict)


@dataclass
class LocalTransport:
    """:class:`Transport` over a :class:`LocalHub` (no sockets)."""

    hub: LocalHub
    client_id: str
    will: tuple[str, bytes] | None = None
    birth: list[tuple[str, bytes, bool]] | None = None
    subscriptions: list[str] = field(default_factory=list)
    manual_ack: bool = False
    max_payload: int = 64 * 1024 * 1024 + 64 * 1024
    version: str = "local"

    def __post_init__(self) -> None:
        self._inbox: queue.Queue[Received] = queue.Queue()
        self._connected = False
        self._connects = 0
        self.subscriptions = list(self.subscriptions or [])

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def connects(self) -> int:
        return self._connects

    def connect(self, timeout: float = 10.0, cancel: threading.Event | None = None) -> None:
        self._connected = True
        self._connects += 1
        self.hub._attach(self)
        for t, payload, retain in self.birth or []:
            self.hub.route(t, payload, retain)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                timeout: float = 10.0) -> bool:
        if len(payload) > self.max_payload:
            raise ProtocolError(f"payload: {len(payload)} bytes exceed the transport limit "
                                f"{self.max_payload}", reason="oversized")
        if not self._connected:
            return False
        self.hub.route(topic, bytes(payload), retain)
        return True

    def subscribe(self, topic_filter: str) -> None:
        """Subscribe to ``topic_filter`` now (its retained messages are delivered)."""
        if topic_filter not in self.subscriptions:
            self.subscriptions.append(topic_filter)
            if self._connected:
                self.hub._deliver_retained(self, [topic_filter])

    def unsubscribe(self, topic_filter: str) -> None:
        if topic_filter in self.subscriptions:
            self.subscriptions.remove(topic_filter)

    def recv(self, timeout: float | None = None) -> Received | None:
        try:
            return self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def ack(self, msg: Received) -> None:
        """Acknowledge (``manual_ack`` sessions only): the hub forgets the message."""
        if self.manual_ack:
            self.hub._ack(self, msg.token)

    def drop(self) -> None:
        """Lose the connection (the hub publishes the will)."""
        if self._connected:
            self._connected = False
            self.hub._detach(self)
            if self.will is not None:
                self.hub.route(self.will[0], self.will[1], True)

    def close(self, clear_will: tuple[str, bytes] | None = None) -> None:
        if self._connected:
            if clear_will is not None:
                self.hub.route(clear_will[0], clear_will[1], True)
            self._connected = False
            self.hub._detach(self)
