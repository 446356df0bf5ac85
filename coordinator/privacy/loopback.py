"""One secure round with every device in this process: the coordinator's
:class:`~coordinator.privacy.secagg.SecAggServer` and each device's
:class:`~edge_client.secagg.SecAggClient`, every message through the wire format
(encoded, then decoded) as over MQTT. For tests, benchmarks and the emulator, whose
devices' secure-aggregation halves run here on their real updates.

``drop``: device -> the phase before which it goes silent (``keys``, ``shares``,
``masked``, ``reveal``); ``tamper``: a hook ``(phase, message) -> message`` that may
change what a device sends (tests of bad signatures and shares).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from coordinator.privacy.secagg import SecAggServer
from edge_client.errors import ProtocolError
from edge_client.protocol import decode_message, encode_message
from edge_client.secagg import SecAggClient
from edge_client.secagg.encode import Grid

PHASES = ("keys", "shares", "masked", "reveal")


def _wire(m: Any) -> Any:
    return decode_message(encode_message(m))


def run_round(server: SecAggServer, identities: Mapping[str, bytes],
              vector_of: Callable[[str, Grid], np.ndarray], *, drop: Mapping[str, str] | None = None,
              tamper: Callable[[str, Any], Any] | None = None,
              timing: dict[str, float] | None = None) -> np.ndarray:
    """Run ``server``'s round with a client per device of ``identities`` (its Ed25519
    key); ``vector_of(device, grid)`` is its uint32 input. Returns the unmasked sum
    (UnmaskError when it cannot be). ``timing`` (device -> s) gets each device's CPU
    seconds."""
    import time

    drop = drop or {}
    tamper = tamper or (lambda _p, m: m)
    cpu = timing if timing is not None else {}
    clients: dict[str, SecAggClient] = {}

    def device(u: str, fn: Callable[[], Any]) -> Any:
        t0 = time.thread_time()
        try:
            return fn()
        finally:
            cpu[u] = cpu.get(u, 0.0) + time.thread_time() - t0

    def send(phase: str, u: str, m: Any, to: Callable[[Any], None]) -> None:
        try:
            to(_wire(tamper(phase, m)))
        except ProtocolError:
            pass  # excluded (named in server.excluded)

    live = [u for u in server.selected if u in identities]
    for u in live:
        clients[u] = device(u, lambda u=u: SecAggClient(identities[u], server.job, u, server.round_id,
                                                         server.session, server.selected, server.degree))
        if drop.get(u) != "keys":
            send("keys", u, device(u, clients[u].keys), server.keys)
    for u, roster in server.rosters().items():
        if drop.get(u) in ("keys", "shares"):
            continue
        try:
            msg = device(u, lambda u=u, r=roster: clients[u].on_roster(_wire(r)))
        except ProtocolError:
            continue
        send("shares", u, msg, server.shares)
    for u, inbox in server.inboxes().items():
        if drop.get(u) in ("keys", "shares", "masked"):
            continue
        grid = Grid.from_map(clients[u].grid, 1 << 30)
        try:
            msg = device(u, lambda u=u, i=inbox, g=grid: clients[u].on_inbox(_wire(i), vector_of(u, g)))
        except ProtocolError:
            continue
        send("masked", u, msg, server.masked)
    for u, req in server.unmask_requests().items():
        if drop.get(u) in PHASES:
            continue
        try:
            msg = device(u, lambda u=u, q=req: clients[u].on_unmask(_wire(q)))
        except ProtocolError:
            continue
        send("reveal", u, msg, server.reveal)
    return server.unmask()
