"""One secure round with every device in this process: the coordinator's
:class:`~coordinator.privacy.secagg.SecAggServer` and each device's
:class:`~edge_client.secagg.SecAggClient`, every message through the wire format
(encoded by its sender, decoded by its receiver) as over MQTT. For tests and benchmarks.

``drop``: device -> the phase before which it goes silent (``keys``, ``shares``,
``masked``, ``reveal``); ``tamper``: a hook ``(phase, message) -> message`` that may
change what a device sends (tests of bad signatures and shares). :class:`Costs` gets the
CPU seconds (this thread's) of the coordinator and of each device, and each device's
uplink bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from coordinator.privacy.secagg import SecAggServer
from edge_client.errors import ProtocolError
from edge_client.protocol import decode_message, encode_message
from edge_client.secagg import SecAggClient
from edge_client.secagg.encode import Grid

T = TypeVar("T")

PHASES = ("keys", "shares", "masked", "reveal")


@dataclass
class Costs:
    """CPU seconds of the coordinator (``server``) and of each device, and each device's
    uplink bytes (every message it sent)."""

    server: float = 0.0
    devices: dict[str, float] = field(default_factory=dict)
    uplink: dict[str, int] = field(default_factory=dict)

    def timed(self, who: str | None, fn: Callable[[], T]) -> T:
        t0 = time.thread_time()
        try:
            return fn()
        finally:
            dt = time.thread_time() - t0
            if who is None:
                self.server += dt
            else:
                self.devices[who] = self.devices.get(who, 0.0) + dt


def run_round(server: SecAggServer, identities: Mapping[str, bytes],
              vector_of: Callable[[str, Grid], np.ndarray], *, drop: Mapping[str, str] | None = None,
              tamper: Callable[[str, Any], Any] | None = None, costs: Costs | None = None) -> np.ndarray:
    """Run ``server``'s round with a client per device of ``identities`` (its Ed25519
    key); ``vector_of(device, grid)`` is its uint32 input. Returns the unmasked sum
    (UnmaskError when it cannot be)."""
    drop = drop or {}
    tamper = tamper or (lambda _p, m: m)
    c = costs if costs is not None else Costs()
    clients: dict[str, SecAggClient] = {}

    def up(phase: str, u: str, make: Callable[[], Any], to: Callable[[Any], None]) -> None:
        """Device ``u`` makes its message and sends it; the coordinator decodes and takes it."""
        try:
            payload = c.timed(u, lambda: encode_message(tamper(phase, make())))
        except ProtocolError:
            return  # the device refused (its check failed): it leaves the round
        c.uplink[u] = c.uplink.get(u, 0) + len(payload)
        try:
            c.timed(None, lambda: to(decode_message(payload)))
        except ProtocolError:
            pass  # refused, or excluded (named in server.excluded)

    def down(out: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The coordinator closes a phase; each device decodes its message."""
        msgs = c.timed(None, lambda: {u: encode_message(m) for u, m in out().items()})
        return {u: c.timed(u, lambda p=p: decode_message(p)) for u, p in msgs.items()}

    for u in [u for u in server.selected if u in identities]:
        clients[u] = c.timed(u, lambda u=u: SecAggClient(identities[u], server.job, u, server.round_id,
                                                          server.session, server.selected, server.degree))
        if drop.get(u) != "keys":
            up("keys", u, clients[u].keys, server.keys)
    for u, roster in down(server.rosters).items():
        if drop.get(u) not in ("keys", "shares"):
            up("shares", u, lambda u=u, r=roster: clients[u].on_roster(r), server.shares)
    for u, inbox in down(server.inboxes).items():
        if drop.get(u) not in ("keys", "shares", "masked"):
            up("masked", u, lambda u=u, i=inbox: clients[u].on_inbox(
                i, vector_of(u, Grid.from_map(clients[u].grid, 1 << 30))), server.masked)
    for u, req in down(server.unmask_requests).items():
        if drop.get(u) not in PHASES:
            up("reveal", u, lambda u=u, q=req: clients[u].on_unmask(q), server.reveal)
    return c.timed(None, server.unmask)
