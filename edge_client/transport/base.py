"""What the device loop and the coordinator's fleet need from a message session.

:class:`Transport` is the protocol both implementations follow: :class:`~.mqtt.MqttTransport`
(paho-mqtt, a real broker) and :class:`~.local.LocalTransport` (the in-process
:class:`~.local.LocalHub`). A received message is a :class:`Received`; ``ack`` takes it back
after the receiver has persisted it (manual-ack sessions).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Received:
    """One delivered message. ``token`` identifies it for :meth:`Transport.ack`."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    token: int = 0


class Transport(Protocol):
    """What the device loop and the fleet need from a message session."""

    @property
    def connected(self) -> bool: ...

    @property
    def connects(self) -> int: ...

    def connect(self, timeout: float = 10.0, cancel: threading.Event | None = None) -> None:
        """Wait up to ``timeout`` s for a session (ConnectionError without one); ``cancel``
        set ends the wait at once."""

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                timeout: float = 10.0) -> bool: ...

    def recv(self, timeout: float | None = None) -> Received | None: ...

    def ack(self, msg: Received) -> None: ...

    def close(self, clear_will: tuple[str, bytes] | None = None) -> None:
        """End the session; ``clear_will`` (topic, payload): published first, retained (a
        clean exit's presence in place of the last will)."""
