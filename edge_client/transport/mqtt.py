"""MQTT sessions through paho-mqtt 2.x: the one module that talks to paho.

:class:`MqttTransport`, used by devices (``runtime.py``) and the coordinator's
``MqttFleet``, dials ``mqtt://[user:pass@]host[:1883]`` or ``mqtts://...[:8883]`` (TLS with
an optional CA file and client certificate: :func:`parse_broker_url`, :class:`TlsOptions`),
speaks MQTT v5 when the broker offers it, else 3.1.1 (``protocol="auto"``: one probe
connect), sets its last will before connecting and re-sends "birth" messages and
subscriptions on every connect. It reconnects with capped, jittered exponential backoff
(each wait uniform in ``[d/2, d]``, ``d = min(max_s, min_s * 2^attempt)``, so a fleet that
lost its broker does not come back in lockstep), names a broker that refuses the
credentials (:attr:`MqttTransport.not_authorised`), and can acknowledge QoS 1 messages
only when the caller says so (``manual_ack=True``: after persisting them). Every paho
callback only hands data to a queue and catches everything (an exception there silently
stops paho's network thread: docs/mqtt.md#paho-mqtt-2x). paho itself is imported when a
session is made, not with this module.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from edge_client.errors import ConfigError, ProtocolError
from edge_client.transport.base import Received

log = logging.getLogger("fedbit.transport")


@dataclass(frozen=True)
class TlsOptions:
    """TLS material (PEM file paths). ``insecure`` skips the hostname check (tests only)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL."""

    host: str
    port: int
    tls: bool
    username: str | None = None
    password: str | None = None


def parse_broker_url(url: str) -> BrokerAddress:
    """``mqtt://[user[:pass]@]host[:port]`` or ``mqtts://...``; ConfigError otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"broker: {url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
        raise ConfigError(f"broker: {url!r}: scheme must be mqtt:// or mqtts://")
    if not parts.hostname:
        raise ConfigError(f"broker: {url!r}: no host")
    tls = parts.scheme in ("mqtts", "ssl")
    return BrokerAddress(
        host=parts.hostname, port=port or (8883 if tls else 1883), tls=tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


class PublishHandle:
    """A queued QoS 1 publish; :meth:`wait` blocks until its PUBACK (paho's condition
    variable, no polling)."""

    def __init__(self, info) -> None:  # paho MQTTMessageInfo
        self._info = info

    def wait(self, timeout: float) -> bool:
        """True once acknowledged; False after ``timeout`` s or when the connection was
        lost (paho may still deliver it after a reconnect)."""
        try:
            self._info.wait_for_publish(timeout)
            return bool(self._info.is_published())
        except (RuntimeError, ValueError):
            return False


def _reason_is_failure(reason_code: object) -> bool:
    try:
        return bool(reason_code.is_failure)  # type: ignore[attr-defined]
    except AttributeError:
        return reason_code not in (0, None)


def _is_auth_failure(reason: str) -> bool:
    """Whether a CONNACK reason says the credentials were refused (v5 "Not authorized",
    "Bad user name or password"; 3.1.1 return codes 4 and 5)."""
    r = reason.lower()
    return "not authori" in r or "bad user" in r or "bad username" in r


def _set(event: threading.Event | None) -> bool:
    return event is not None and event.is_set()


def _stop_network_thread(client: object) -> None:
    """``client.loop_stop()`` without paho 2.1's exit race.

    paho's network thread sets ``client._thread = None`` when it ends (after a
    DISCONNECT it ends on its own); ``loop_stop`` checks that attribute and then calls
    ``.join()`` on it, so a thread that finishes between the two raises AttributeError.
    The thread has ended in that case, which is what we asked for.
    """
    try:
        client.loop_stop()  # type: ignore[attr-defined]
    except AttributeError:
        pass


class MqttTransport:
    """One paho-mqtt 2.x client session; see the module docstring.

    Args:
        url: broker URL (``mqtt://`` or ``mqtts://``); credentials in the URL are used
            unless ``username``/``password`` are given.
        client_id: MQTT client id (a device uses its device id, so ACL ``%c`` applies).
        will: ``(topic, payload)`` published retained with QoS 1 by the broker when the
            connection is lost without a DISCONNECT.
        birth: ``(topic, payload, retain)`` messages published on every (re)connect.
        subscriptions: topic filters (QoS 1) subscribed on every (re)connect.
        manual_ack: PUBACK received QoS 1 messages only in :meth:`ack`.
        persistent_session: keep the broker session across disconnects and restarts
            (v5: ``clean_start=False`` + session expiry; 3.1.1: ``clean_session=False``).
        protocol: ``"auto"``, ``"5"`` or ``"3.1.1"``.
        max_payload: bytes; larger publishes raise ProtocolError before reaching paho
            (paho ignores the broker's maximum packet size; an oversized publish would
            just get the connection closed).
        backoff: ``(min_s, max_s)`` reconnect delays (doubling, capped at ``max_s``, jittered).
    """

    def __init__(self, url: str, client_id: str, *, username: str | None = None,
                 password: str | None = None, tls: TlsOptions | None = None,
                 will: tuple[str, bytes] | None = None,
                 birth: list[tuple[str, bytes, bool]] | None = None,
                 subscriptions: list[str] | None = None, manual_ack: bool = False,
                 persistent_session: bool = False, protocol: str = "auto",
                 keepalive: int = 30, max_payload: int = 64 * 1024 * 1024 + 64 * 1024,
                 backoff: tuple[float, float] = (0.5, 8.0), session_expiry_s: int = 7 * 86400,
                 ) -> None:
        if protocol not in ("auto", "5", "3.1.1"):
            raise ConfigError(f"protocol: {protocol!r} is not auto, 5 or 3.1.1")
        self.address = parse_broker_url(url)
        self.url = url
        self.client_id = client_id
        self.username = username if username is not None else self.address.username
        self.password = password if password is not None else self.address.password
        self.tls = tls if tls is not None else (TlsOptions() if self.address.tls else None)
        self.will = will
        self.birth = list(birth or [])
        self.subscriptions = list(subscriptions or [])
        self.manual_ack = manual_ack
        self.persistent_session = persistent_session
        self.protocol = protocol
        self.keepalive = keepalive
        self.max_payload = max_payload
        self.backoff = backoff
        self.session_expiry_s = session_expiry_s
        self.version: str | None = None  # "5" or "3.1.1" once negotiated
        self._inbox: queue.Queue[Received] = queue.Queue()
        self._client = None  # type: ignore[var-annotated]
        self._connected = threading.Event()
        self._connects = 0
        self._lock = threading.Lock()
        self._closed = False
        self._wake = threading.Event()  # ends a backoff wait (close, kill)
        self._attempt = 0  # failed attempts since the last session (the backoff's exponent)
        self._rng = random.Random()  # (seeded from the OS: devices must not agree on delays)
        #: the broker refused the credentials at the last attempt (bad password, revoked)
        self.not_authorised = False
        self._refused = False  # the last CONNACK refused us (its reason stays in last_error)
        self._refusals = 0
        self.last_error: str = ""

    # ------------------------------------------------------------------ properties

    @property
    def connected(self) -> bool:
        """True while the broker session is up (CONNACK received, not yet lost)."""
        return self._connected.is_set()

    @property
    def connects(self) -> int:
        """How many times a session was established (1 after the first connect)."""
        return self._connects

    # ------------------------------------------------------------------ setup

    def _make_client(self, version: str):  # -> paho.mqtt.client.Client
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        proto = mqtt.MQTTv5 if version == "5" else mqtt.MQTTv311
        kwargs = {}
        if version != "5":
            kwargs["clean_session"] = not self.persistent_session
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=proto, manual_ack=self.manual_ack, **kwargs)
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if self.tls is not None:
            client.tls_set(ca_certs=self.tls.ca_file, certfile=self.tls.cert_file,
                           keyfile=self.tls.key_file)
            if self.tls.insecure:
                client.tls_insecure_set(True)
        if self.will is not None:
            client.will_set(self.will[0], self.will[1], qos=1, retain=True)
        client.max_inflight_messages_set(100)
        client.max_queued_messages_set(0)
        lo, hi = self.backoff
        client.reconnect_delay_set(max(1, int(lo)) if lo >= 1 else 1, max(1, int(hi)))
        # paho's own wait (plain doubling, no jitter) replaced by the jittered one
        client._reconnect_wait = self._reconnect_wait
        return client

    def next_delay(self) -> float:
        """The next backoff wait (s): uniform in ``[d/2, d]`` with ``d = min(max_s, min_s *
        2^attempt)``; the attempt count restarts at the next session."""
        lo, hi = self.backoff
        d = min(hi, lo * 2.0 ** min(self._attempt, 40))
        self._attempt += 1
        return self._rng.uniform(d / 2, d)

    def _reconnect_wait(self) -> None:
        """What paho's network thread waits before it reconnects (see :meth:`next_delay`)."""
        try:
            self._wake.wait(self.next_delay())
        except Exception:  # noqa: BLE001 - never let paho's thread die
            pass

    def _connect_kwargs(self, version: str) -> dict:
        if version != "5":
            return {}
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry_s if self.persistent_session else 0
        return {"clean_start": not self.persistent_session, "properties": props}

    def _probe_v5(self, timeout: float, cancel: threading.Event | None = None) -> bool | None:
        """Connect once with v5: True accepted, False refused (3.1.1 broker), None unreachable.

        The probe sends no credentials: a broker that wants them answers "not authorized"
        in v5 (which is all the probe asks), and a broker that ties the client id to the
        username (``use_username_as_clientid``) never hands the probe this client's session
        (it would end the session of a running client and, with a clean start, discard
        the persistent session the coordinator's unacknowledged updates wait in)."""
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        result: dict[str, object] = {}
        done = threading.Event()
        quit_ = threading.Event()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{self.client_id}-probe"[:64],
                        protocol=mqtt.MQTTv5)
        c.connect_timeout = max(1.0, min(timeout, 5.0))
        if self.tls is not None:
            c.tls_set(ca_certs=self.tls.ca_file, certfile=self.tls.cert_file,
                      keyfile=self.tls.key_file)
            if self.tls.insecure:
                c.tls_insecure_set(True)

        def on_connect(_c, _u, _f, rc, _p=None):
            try:
                result["ok"] = not _reason_is_failure(rc)
                result["rc"] = str(rc)
            finally:
                done.set()

        def on_disconnect(_c, _u, _f, rc, _p=None):
            try:
                result.setdefault("ok", False)
                result.setdefault("rc", str(rc))
            finally:
                done.set()

        c.on_connect = on_connect
        c.on_disconnect = on_disconnect

        def run() -> None:
            """On its own thread, so that the caller's wait can be cut short (``cancel``)
            while a TCP connect or TLS handshake hangs."""
            try:
                c.connect(self.address.host, self.address.port, keepalive=10)
            except Exception as exc:  # noqa: BLE001 - socket/TLS errors: unreachable
                result["unreachable"] = f"{type(exc).__name__}: {exc}"
                done.set()
                return
            end = time.monotonic() + timeout
            try:
                while not done.is_set() and not quit_.is_set() and time.monotonic() < end:
                    if c.loop(0.05) != 0:  # the broker hung up without a CONNACK
                        break
            finally:
                try:
                    c.disconnect()
                except Exception:  # noqa: BLE001
                    pass
                done.set()

        threading.Thread(target=run, name="fedbit-probe", daemon=True).start()
        end = time.monotonic() + timeout + c.connect_timeout
        while not done.wait(0.05):
            if (cancel is not None and cancel.is_set()) or time.monotonic() > end:
                quit_.set()
                break
        if "unreachable" in result or (cancel is not None and cancel.is_set()):
            self.last_error = str(result.get("unreachable", "interrupted"))
            return None
        if "ok" not in result:
            # no CONNACK: a 3.1.1 broker may simply close; treat a silent close as refusal
            return False
        if not result["ok"]:
            rc = str(result.get("rc", ""))
            if _is_auth_failure(rc):
                return True  # v5 spoke to us: the protocol is fine (credentials: not tried)
            self.last_error = rc
        return bool(result["ok"])

    def connect(self, timeout: float = 10.0, cancel: threading.Event | None = None) -> None:
        """Negotiate the protocol, connect, start the network thread, wait for CONNACK.

        Raises ConnectionError when no session is up after ``timeout`` seconds (the
        network thread keeps retrying in the background until :meth:`close`), as soon as
        the broker refuses the CONNECT (``last_error`` says why; paho tries again after
        the next backoff wait), or at once when ``cancel`` is set (every wait here is cut
        into 0.1 s slices).
        """
        end = time.monotonic() + timeout
        if self._client is None:
            version = self.protocol
            while version == "auto":
                probe = self._probe_v5(min(2.0, max(0.5, end - time.monotonic())), cancel)
                if probe is not None:
                    version = "5" if probe else "3.1.1"
                    break
                delay = min(self.next_delay(), max(0.0, end - time.monotonic()))
                if (cancel.wait(delay) if cancel is not None else time.sleep(delay)):
                    raise ConnectionError(f"{self.url}: interrupted")
                if time.monotonic() >= end:
                    raise ConnectionError(f"{self.url}: unreachable ({self.last_error})")
            self.last_error = ""
            self.version = version
            client = self._make_client(version)
            client.on_connect = self._on_connect
            client.on_disconnect = self._on_disconnect
            client.on_message = self._on_message
            self._client = client
            client.connect_async(self.address.host, self.address.port, keepalive=self.keepalive,
                                 **self._connect_kwargs(version))
            client.loop_start()
        # a session exists: paho's network thread (re)connects on its own
        refusals = self._refusals
        while not self._connected.wait(max(0.0, min(0.1, end - time.monotonic()))):
            if _set(cancel):
                raise ConnectionError(f"{self.url}: interrupted")
            if self._refusals != refusals:  # the broker answered: no (paho tries again later)
                raise ConnectionError(f"{self.url}: {self.last_error}")
            if time.monotonic() >= end:
                raise ConnectionError(f"{self.url}: no session after {timeout:.1f} s "
                                      f"({self.last_error or 'no answer'})")

    # ------------------------------------------------------------------ callbacks

    def _on_connect(self, client, _userdata, _flags, reason_code, _props=None) -> None:
        try:
            if _reason_is_failure(reason_code):
                self.not_authorised = _is_auth_failure(str(reason_code))
                self.last_error = (f"not authorised: this device may be revoked (the broker refused "
                                   f"{self.username!r}: {reason_code})") if self.not_authorised \
                    else f"connect refused: {reason_code}"
                self._refused = True
                self._refusals += 1
                return
            self.not_authorised = False
            self._attempt = 0
            for t in self.subscriptions:
                client.subscribe(t, qos=1)
            for t, payload, retain in self.birth:
                client.publish(t, payload, qos=1, retain=retain)
            self._connects += 1
            self._connected.set()
        except Exception as exc:  # noqa: BLE001 - never let paho's thread die
            self.last_error = f"on_connect: {exc!r}"

    def _on_disconnect(self, _client, _userdata, _flags, reason_code, _props=None) -> None:
        try:
            self._connected.clear()
            if not self._refused:  # (keep why the CONNECT was refused)
                self.last_error = f"disconnected: {reason_code}"
            self._refused = False
        except Exception:  # noqa: BLE001
            pass

    def _on_message(self, _client, _userdata, message) -> None:
        try:
            self._inbox.put(Received(message.topic, bytes(message.payload), int(message.qos),
                                     bool(message.retain), int(message.mid)))
        except Exception as exc:  # noqa: BLE001
            self.last_error = f"on_message: {exc!r}"

    # ------------------------------------------------------------------ I/O

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                timeout: float = 10.0) -> bool:
        """Publish and, for QoS 1, wait up to ``timeout`` s for the PUBACK.

        Returns True once the broker acknowledged (QoS 1) or the packet was written
        (QoS 0); False when not connected or not acknowledged in time (paho may still
        deliver it later: receivers must tolerate duplicates). ``timeout=0`` returns
        right after queueing.
        """
        handle = self.publish_start(topic, payload, qos=qos, retain=retain)
        if handle is None:
            return False
        return True if timeout <= 0 else handle.wait(timeout)

    def publish_start(self, topic: str, payload: bytes, *, qos: int = 1,
                      retain: bool = False) -> PublishHandle | None:
        """Queue a publish without waiting; ``handle.wait(timeout)`` waits for its PUBACK.
        None when it could not be queued (not connected)."""
        if len(payload) > self.max_payload:
            raise ProtocolError(f"payload: {len(payload)} bytes exceed the transport limit "
                                f"{self.max_payload}", reason="oversized")
        client = self._client
        if client is None or self._closed:
            return None
        try:
            info = client.publish(topic, payload, qos=qos, retain=retain)
        except Exception as exc:  # noqa: BLE001
            self.last_error = f"publish: {exc!r}"
            return None
        if info.rc != 0:
            # MQTT_ERR_NO_CONN: paho keeps a QoS 1 message queued and may still send it
            # after a reconnect; the caller's outbox re-sends it too (receivers dedup).
            self.last_error = f"publish rc={info.rc}"
            return None
        return PublishHandle(info)

    def subscribe(self, topic_filter: str) -> None:
        """Subscribe to ``topic_filter`` (QoS 1) now and on every reconnect (a broker's ACL
        may refuse it: then nothing arrives on it)."""
        if topic_filter not in self.subscriptions:
            self.subscriptions.append(topic_filter)
        client = self._client
        if client is not None and self.connected:
            try:
                client.subscribe(topic_filter, qos=1)
            except Exception as exc:  # noqa: BLE001 - the connection went: on_connect subscribes again
                self.last_error = f"subscribe: {exc!r}"

    def unsubscribe(self, topic_filter: str) -> None:
        """Stop receiving ``topic_filter`` (now and after reconnects)."""
        if topic_filter in self.subscriptions:
            self.subscriptions.remove(topic_filter)
        client = self._client
        if client is not None and self.connected:
            try:
                client.unsubscribe(topic_filter)
            except Exception as exc:  # noqa: BLE001
                self.last_error = f"unsubscribe: {exc!r}"

    def recv(self, timeout: float | None = None) -> Received | None:
        """Next received message, or None after ``timeout`` seconds."""
        try:
            return self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def ack(self, msg: Received) -> None:
        """PUBACK a message received with ``manual_ack`` (no-op for QoS 0 or auto-ack)."""
        client = self._client
        if self.manual_ack and client is not None and msg.qos > 0:
            try:
                client.ack(msg.token, msg.qos)
            except Exception as exc:  # noqa: BLE001 - connection gone: redelivered later
                self.last_error = f"ack: {exc!r}"

    def drop_connection(self) -> None:
        """Close the socket without DISCONNECT (the broker publishes the will); paho then
        reconnects on its own. For tests of the reconnect path."""
        client = self._client
        if client is not None:
            sock = client.socket()
            if sock is not None:
                try:
                    sock.shutdown(2)
                except OSError:
                    pass

    def kill(self) -> None:
        """Stop as a crashed process would: no DISCONNECT, no more network I/O, no acks
        (the broker publishes the will and keeps unacked messages for the session)."""
        client = self._client
        self._closed = True
        self._wake.set()
        self._connected.clear()
        if client is not None:
            _stop_network_thread(client)  # the socket stays open
            sock = client.socket()
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def close(self, clear_will: tuple[str, bytes] | None = None) -> None:
        """Optionally publish ``clear_will`` (e.g. presence offline), DISCONNECT, stop."""
        if self._closed:
            return
        self._wake.set()
        client = self._client
        if client is not None:
            if clear_will is not None and self.connected:
                self.publish(clear_will[0], clear_will[1], qos=1, retain=True, timeout=2.0)
            try:
                client.disconnect()
            except Exception:  # noqa: BLE001
                pass
            _stop_network_thread(client)
        self._closed = True
        self._connected.clear()
