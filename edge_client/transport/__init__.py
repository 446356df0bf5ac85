"""Message sessions: the :class:`Transport` protocol and its two implementations.

- :mod:`.base`: :class:`Transport`, :class:`Received`;
- :mod:`.mqtt`: :class:`MqttTransport` (paho-mqtt 2.x), :class:`TlsOptions`,
  :func:`parse_broker_url`;
- :mod:`.local`: :class:`LocalHub` / :class:`LocalTransport`, an in-process broker with
  MQTT's session semantics (no sockets).
"""

from edge_client.transport.base import Received, Transport
from edge_client.transport.local import LocalHub, LocalTransport, topic_matches
from edge_client.transport.mqtt import (
    BrokerAddress,
    MqttTransport,
    PublishHandle,
    TlsOptions,
    parse_broker_url,
)

__all__ = ["BrokerAddress", "LocalHub", "LocalTransport", "MqttTransport", "PublishHandle",
           "Received", "TlsOptions", "Transport", "parse_broker_url", "topic_matches"]
