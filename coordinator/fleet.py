"""The coordinator's view of the devices: the :class:`Fleet` interface and two fleets.

The round loop (``server.py``) never touches MQTT or a topic name: it hands a ``Fleet`` the
round's model, announcement and status payloads (published retained), receives hello /
presence / update payloads from it as :class:`Inbound` messages, and acknowledges each
once it is handled (persist, then ack).

- :class:`MqttFleet`: a real broker through :class:`edge_client.transport.MqttTransport`:
  QoS 1, retained round/model/status, a last-will ``error`` status, manual PUBACK and a
  persistent session, so an update received but not persisted is redelivered after a
  crash (on amqtt only when the coordinator connects with a username:
  docs/mqtt.md#amqtt-the-zero-install-fallback).
- :class:`InProcessFleet`: the same messages and bytes through an in-memory
  :class:`~edge_client.transport.LocalHub` (no broker, no sockets); device runtimes in the
  same process connect with :meth:`InProcessFleet.device_connector`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.devices import Cohort
from edge_client.errors import ProtocolError
from edge_client.protocol import Status, encode_message, parse_topic, topic
from edge_client.transport import LocalHub, MqttTransport, TlsOptions, Transport


@dataclass(frozen=True)
class Inbound:
    """One received message.

    - ``kind``: ``hello``, ``presence``, ``update``, ``secagg`` (secure aggregation's),
      ``knock`` (a hello on another job), ``status`` (a coordinator's status, this job's or
      another's: ``device_id`` empty), or ``invalid`` (a topic outside the protocol:
      ``device_id`` is then empty);
    - ``device_id``: the id in the topic (the payload's own id is checked against it);
    - ``payload``: the exact bytes; ``received_at``: a ``time.monotonic()`` stamp (s);
    - ``topic``: the topic as received (for logs);
    - ``receipt``: what the fleet that delivered it needs to :meth:`Fleet.ack` it (opaque
      to everyone else).
    """

    kind: str
    device_id: str
    payload: bytes
    received_at: float
    topic: str
    receipt: Any = field(default=None, repr=False, compare=False)


class Fleet(ABC):
    """Messages between the coordinator and the devices of job ``job``; the fleet owns
    the topic names both ways (the round loop never formats one).

    Outbound, every message is retained and sent with QoS 1, in call order: the models,
    the round announcement and the coordinator status. Inbound, hello / presence /
    update messages come out of :meth:`recv` and each is acknowledged with :meth:`ack`
    once handled (persist, then ack)."""

    job: str

    @abstractmethod
    def start(self, timeout: float = 30.0) -> None:
        """Connect (and subscribe); ConnectionError when impossible within ``timeout`` s."""

    @abstractmethod
    def announce_round(self, models: Mapping[str, bytes], announcement: bytes, status: bytes) -> None:
        """Queue the round's messages without waiting: each model variant (retained on its
        variant's topic), then the announcement, then the status. :meth:`flush` waits for
        the broker's acknowledgements (devices act on the messages, not on our PUBACKs,
        so that wait is kept off the round's critical path)."""

    @abstractmethod
    def publish_status(self, status: bytes, *, wait: bool = False) -> None:
        """The retained coordinator status; ``wait``: return once the broker has it
        (ConnectionError when it does not in time), else as :meth:`announce_round`."""

    @abstractmethod
    def reset(self, status: bytes) -> None:
        """A fresh run: clear the previous run's retained announcement and publish
        ``status``; returns once the broker has both."""

    def flush(self) -> None:
        """Wait until every queued publish is acknowledged, re-sending what was not
        (ConnectionError when that fails within the publish timeout)."""
        return None

    def more_expected(self, round_id: int) -> bool:
        """False once the fleet knows that no further update of round ``round_id`` will
        arrive (an emulated fleet knows; a broker cannot): the round then closes without
        waiting for its deadline."""
        return True

    def roster(self) -> list[Cohort]:
        """Devices this fleet registers in bulk (an emulated fleet, which knows its devices
        up front: no hello per device); the coordinator adds them to its registry when it
        starts. Empty for fleets whose devices say hello themselves."""
        return []

    def now(self) -> float:
        """The fleet's clock in seconds (monotonic): how long devices take is measured on it
        (an emulated fleet's: simulated seconds)."""
        return time.monotonic()

    def done(self) -> bool:
        """True once the fleet wants no further round (an emulated fleet past its simulated
        time budget); the loop then ends early."""
        return False

    def offline(self) -> list[str]:
        """Members of the :meth:`roster` that are not online when the run starts (an
        emulated fleet's availability); the coordinator registers them offline."""
        return []

    def round_report(self, round_id: int) -> dict[str, Any]:
        """Figures the fleet measured about round ``round_id`` (an emulated fleet's
        simulated time, dropouts ...), merged into the round's metrics record."""
        return {}

    @abstractmethod
    def recv(self, timeout: float) -> Inbound | None:
        """Next received message, or None after ``timeout`` seconds."""

    @abstractmethod
    def ack(self, msg: Inbound) -> None:
        """Acknowledge a handled message (after persisting it, for updates)."""

    @abstractmethod
    def close(self) -> None:
        """Disconnect cleanly."""

    def describe(self) -> str:
        return type(self).__name__


class TransportFleet(Fleet):
    """A :class:`Fleet` over any :class:`~edge_client.transport.Transport`."""

    def __init__(self, job: str, transport: Transport, *, publish_timeout: float = 60.0) -> None:
        self.job = job
        self.t_round = topic(job, "round")  # validates the job id
        self.t_status = topic(job, "status")
        self.transport = transport
        self.publish_timeout = publish_timeout
        self.invalid_topics = 0
        self._unconfirmed: list[tuple[str, bytes, Any]] = []  # (topic, payload, handle)
        self._sent: list[tuple[str, bytes, Any]] = []  # messages to one device, not retained
        #: what the broker should retain (topic -> last payload), published again after a
        #: reconnect: a broker restarted without persistence has lost it
        self._retained: dict[str, bytes] = {}
        self._connects = 0
        self.republished = 0

    @staticmethod
    def subscriptions(job: str, other_jobs: bool = False) -> list[str]:
        """The coordinator's topic filters; ``other_jobs``: every job's hellos and
        coordinator statuses (on a broker whose ACL allows it: the embedded anonymous one),
        so that a device knocking on a job nobody serves is logged (``knock`` messages).
        Hello before presence: the broker hands out the retained messages of a new
        subscription in filter order, so a device's retained presence (its last word:
        ``offline`` from a clean exit or its will) comes after its retained hello, which
        registers it online, and has the last say (no ghost after a restart)."""
        root = topic(job, "round").rsplit("/", 1)[0]
        if other_jobs:
            every = root.rsplit("/", 1)[0] + "/+"
            return [f"{every}/hello/+", f"{root}/presence/+", f"{root}/update/+",
                    f"{root}/secagg/+", f"{every}/status"]
        return [f"{root}/hello/+", f"{root}/presence/+", f"{root}/update/+", f"{root}/secagg/+"]

    def start(self, timeout: float = 30.0) -> None:
        self.transport.connect(timeout=timeout)

    # ------------------------------------------------------------------ outbound

    def announce_round(self, models: Mapping[str, bytes], announcement: bytes, status: bytes) -> None:
        items = [(topic(self.job, "model", v), p) for v, p in models.items()]
        self._queue([*items, (self.t_round, announcement), (self.t_status, status)])

    def publish_status(self, status: bytes, *, wait: bool = False) -> None:
        self._queue([(self.t_status, status)])
        if wait:
            self.flush()

    def reset(self, status: bytes) -> None:
        self._queue([(self.t_round, b""), (self.t_status, status)])
        self.flush()

    def send(self, device_id: str, payload: bytes) -> None:
        """Queue one message to one device (secure aggregation's, on ``secagg-in/<id>``; QoS 1,
        not retained); :meth:`flush` waits for the broker."""
        name = topic(self.job, "secagg-in", device_id)
        start = getattr(self.transport, "publish_start", None)
        h = start(name, payload, qos=1, retain=False) if start is not None else None
        if h is None:
            if not self.transport.publish(name, payload, qos=1, retain=False, timeout=self.publish_timeout):
                raise ConnectionError(f"{name}: the broker did not acknowledge the publish")
            return
        self._sent.append((name, payload, h))

    def _publish_retained(self, name: str, payload: bytes) -> None:
        """One retained QoS 1 publish, re-sent until acknowledged (or the timeout)."""
        end = time.monotonic() + self.publish_timeout
        while True:
            left = end - time.monotonic()
            if self.transport.publish(name, payload, qos=1, retain=True, timeout=min(10.0, max(left, 0.1))):
                return
            if left <= 0:
                raise ConnectionError(f"{name}: the broker did not acknowledge the publish "
                                      f"within {self.publish_timeout:.0f} s")
            time.sleep(0.2)

    def _queue(self, items: list[tuple[str, bytes]]) -> None:
        """Queue ``(topic, payload)`` retained QoS 1 publishes in order without waiting
        (a transport without ``publish_start`` publishes each and waits)."""
        for name, payload in items:
            self._retained.pop(name, None)
            self._retained[name] = payload  # (in publish order)
        start = getattr(self.transport, "publish_start", None)
        if start is None:
            for name, payload in items:
                self._publish_retained(name, payload)
            return
        for name, payload in items:
            h = start(name, payload, qos=1, retain=True)
            if h is None:  # not queued (no connection): everything from here on, in order
                self.flush()
                self._publish_retained(name, payload)
            else:
                self._unconfirmed.append((name, payload, h))

    def flush(self) -> None:
        sent, self._sent = self._sent, []
        end = time.monotonic() + self.publish_timeout
        for name, payload, h in sent:  # to one device each: re-sent (not retained) when not acked
            if not h.wait(max(0.0, end - time.monotonic())) and not self.transport.publish(
                    name, payload, qos=1, retain=False, timeout=10.0):
                raise ConnectionError(f"{name}: the broker did not acknowledge the publish")
        pending, self._unconfirmed = self._unconfirmed, []
        end = time.monotonic() + min(10.0, self.publish_timeout)
        failed = False
        for name, payload, h in pending:
            # slow path: from the first one not acked in time on, re-send each (in order,
            # so a retained topic never ends on an older payload) until acked
            failed = failed or not h.wait(max(0.0, end - time.monotonic()))
            if failed:
                self._publish_retained(name, payload)

    # ------------------------------------------------------------------ inbound

    def _check_reconnect(self) -> None:
        """After a reconnect, publish the retained messages again (the round and models of
        the open round, the status): a broker back from a restart without persistence
        has none, and devices that join would wait for a round nobody announces."""
        n = getattr(self.transport, "connects", 0)
        if n == self._connects:
            return
        again = self._connects > 0
        self._connects = n
        if again and self._retained:
            self.republished += 1
            self._queue(list(self._retained.items()))

    def recv(self, timeout: float) -> Inbound | None:
        self._check_reconnect()
        msg = self.transport.recv(timeout=timeout)
        if msg is None:
            return None
        try:
            job, kind, ident = parse_topic(msg.topic)
            if kind == "status" or (kind == "hello" and job != self.job):  # (other_jobs subscriptions)
                return Inbound("status" if kind == "status" else "knock", ident or "", msg.payload,
                               time.monotonic(), msg.topic, msg)
            if job != self.job or kind not in ("hello", "presence", "update", "secagg") or ident is None:
                raise ProtocolError(f"topic: {msg.topic!r} is not an inbound topic of job {self.job!r}")
        except ProtocolError:
            self.invalid_topics += 1
            return Inbound("invalid", "", msg.payload, time.monotonic(), msg.topic, msg)
        return Inbound(kind, ident, msg.payload, time.monotonic(), msg.topic, msg)

    def ack(self, msg: Inbound) -> None:
        self.transport.ack(msg.receipt)

    def close(self, linger_s: float = 2.0) -> None:
        """Disconnect, after waiting up to ``linger_s`` s for queued publishes' PUBACKs
        (not re-sent: the broker may be gone)."""
        pending, self._unconfirmed = self._unconfirmed, []
        end = time.monotonic() + linger_s
        for _name, _payload, h in pending:
            if not h.wait(max(0.0, end - time.monotonic())):
                break
        self.transport.close()


class MqttFleet(TransportFleet):
    """A fleet behind an MQTT broker (see the module docstring).

    ``url`` may carry ``user:password@``; ``tls`` gives CA / client certificate files;
    ``client_id`` must stay the same across restarts for the persistent session;
    ``watch_jobs``: also hear every job's hellos and statuses (see :meth:`subscriptions`).
    """

    def __init__(self, url: str, job: str = "default", *, client_id: str | None = None,
                 username: str | None = None, password: str | None = None,
                 tls: TlsOptions | None = None, protocol: str = "auto",
                 max_payload: int = 64 * 1024 * 1024 + 64 * 1024, watch_jobs: bool = False) -> None:
        will = (topic(job, "status"),
                encode_message(Status(state="error", round_id=0, message="coordinator offline")))
        t = MqttTransport(url, client_id or f"fedbit-coordinator-{job}", username=username,
                          password=password, tls=tls, will=will,
                          subscriptions=self.subscriptions(job, watch_jobs), manual_ack=True,
                          persistent_session=True, protocol=protocol, max_payload=max_payload)
        super().__init__(job, t)
        self.url = url

    @property
    def version(self) -> str | None:
        return self.transport.version  # type: ignore[attr-defined]

    def describe(self) -> str:
        return f"MQTT {self.version or '?'} at {self.url}"


class InProcessFleet(TransportFleet):
    """A fleet of device runtimes in this process, over an in-memory hub."""

    def __init__(self, job: str = "default", hub: LocalHub | None = None) -> None:
        self.hub = hub or LocalHub()
        t = self.hub.client("coordinator", subscriptions=self.subscriptions(job), manual_ack=True)
        super().__init__(job, t)

    def device_connector(self, device_id: str) -> Callable[..., Transport]:
        """``connect(**session_spec)`` for :class:`edge_client.runtime.DeviceRuntime`."""

        def connect(**kw: Any) -> Transport:
            return self.hub.client(device_id, **kw)

        return connect

    def describe(self) -> str:
        return "in-process hub (no broker)"
