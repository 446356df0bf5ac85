"""Secure rounds in the emulator: the devices' halves of SecAgg+ played here, with the
devices' own code (``edge_client.secagg.session.SecureSession``) on their real updates.

An emulated device trains in its worker and hands its exact update (``RelaySecure``: an
integer device's grid differences, a float device's ``W - W_global``) to the
:class:`~coordinator.emulation.emulated_fleet.EmulatedFleet`, which, once the simulated round closes,
gives it to :class:`SecureDevices`: each device then advertises keys, deals and opens
shares, masks and reveals exactly as a real one would, through the wire format, while
the coordinator runs its side unchanged. A device lost on its link (``loss_rate``) drops
at a phase drawn from the run seed: before its keys (it never trains), or after its keys,
its shares or its masked input.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from coordinator.emulation.fleet_plan import derive_seed
from edge_client.errors import ProtocolError
from edge_client.protocol import (
    DEFAULT_LIMITS,
    Limits,
    RoundAnnouncement,
    Update,
    decode_message,
    encode_message,
)
from edge_client.secagg import SecAggClient, crypto
from edge_client.secagg.session import SecureSession

log = logging.getLogger("fedbit.emulator")

#: the phase a lost device stops before (it answers every phase before it)
PHASES = ("keys", "shares", "masked", "reveal")
_STOPS = {"shares": "sa_roster", "masked": "sa_inbox", "reveal": "sa_unmask"}


def drop_phase(seed: int, device_id: str, round_id: int) -> str:
    """The phase a device lost in round ``round_id`` drops at (uniform over :data:`PHASES`)."""
    return PHASES[int(np.random.default_rng(derive_seed("secagg-drop", seed, device_id, round_id)).integers(4))]


class SecureDevices:
    """The secure-aggregation halves of one emulated round's devices (see the module
    docstring); ``identities``: device -> Ed25519 key, kept by the fleet across rounds
    (the coordinator pins them)."""

    def __init__(self, ann: RoundAnnouncement, identities: dict[str, bytes], drops: dict[str, str],
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.ann, self.identities, self.drops, self.limits = ann, identities, drops, limits
        self.sessions: dict[str, SecureSession] = {}

    def keys(self, payload: bytes) -> tuple[str, bytes] | None:
        """A device's update (its relayed payload) -> ``(device, its keys message)``; None
        when it drops before its keys or the payload is not an update of this round."""
        try:
            m = decode_message(payload, self.limits)
        except ProtocolError:
            return None
        if not isinstance(m, Update) or m.round_id != self.ann.round_id or self.drops.get(m.device_id) == "keys":
            return None
        from edge_client.codecs import decode
        from edge_client.intnn import storage_grid_bits

        dev = m.device_id
        layers = [decode(t).astype(np.float64) for t in m.tensors]
        bits = None
        if m.compute_bits <= 16:
            layers, bits = [np.rint(x).astype(np.int64) for x in layers], int(storage_grid_bits(m.compute_bits))
        cfg = SimpleNamespace(job=self.ann.job, device_id=dev, workdir=".", trainer="int" if bits else "torch",
                              compute_bits=m.compute_bits, limits=self.limits)
        s = SecureSession(cfg, log.getChild("device"))
        s._update = (layers, bits, int(m.num_samples))
        ident = self.identities.setdefault(dev, crypto.identity_keypair()[0])
        s.client = SecAggClient(ident, self.ann.job, dev, self.ann.round_id, bytes.fromhex(str(self.ann.hparams["secagg"])),
                                self.ann.selected, int(self.ann.hparams.get("secagg_degree", 0) or 0))
        self.sessions[dev] = s
        return dev, encode_message(s.client.keys(), self.limits)

    def answer(self, device_id: str, payload: bytes) -> bytes | None:
        """The device's answer to a coordinator message (None: it has dropped, or has nothing to say)."""
        s = self.sessions.get(device_id)
        if s is None:
            return None
        try:
            m = decode_message(payload, self.limits)
        except ProtocolError:
            return None
        if _STOPS.get(self.drops.get(device_id, "")) == getattr(m, "KIND", None):
            self.sessions.pop(device_id)
            return None
        return s.handle(m)
