"""A device's secure rounds: what the device loop (``edge_client.runtime``) hands over
when a round's announcement carries ``secagg`` (the round's session, hex).

After training, :meth:`SecureSession.start` keeps the update ``W - W_global`` (an
integer device's grid differences exactly) and returns the device's signed keys, which the
loop publishes on ``secagg/<device>`` in place of an update; :meth:`SecureSession.handle`
answers each coordinator message on ``secagg-in/<device>`` (roster -> shares, inbox ->
masked input, unmask request -> reveal). The device's Ed25519 identity lives in
``<workdir>/secagg-identity`` (mode 0600).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ProtocolError
from edge_client.protocol import encode_message, topic
from edge_client.protocol.secure import SecAggInbox, SecAggRoster, SecAggUnmask
from edge_client.secagg.encode import Grid, secure_vector

if TYPE_CHECKING:
    from edge_client.protocol.messages import ModelMessage, RoundAnnouncement
    from edge_client.runtime import DeviceConfig
    from edge_client.secagg.client import SecAggClient
    from edge_client.trainers.common import Trainer


class SecureSession:
    """The secure-aggregation half of one device (see the module docstring)."""

    def __init__(self, cfg: DeviceConfig, log: logging.Logger) -> None:
        self.cfg, self.log = cfg, log
        self.topic = topic(cfg.job, "secagg", cfg.device_id)
        self.inbox_topic = topic(cfg.job, "secagg-in", cfg.device_id)
        self._identity_path = os.path.join(str(cfg.workdir), "secagg-identity")
        self._identity: bytes | None = None
        self.client: SecAggClient | None = None
        self._update: tuple[list[np.ndarray], int | None, int] | None = None

    @property
    def busy(self) -> bool:
        """A secure round is under way (the loop keeps running until it ends)."""
        return self.client is not None

    def start(self, a: RoundAnnouncement, m: ModelMessage, trainer: Trainer, shared: list[np.ndarray],
              start: list[np.ndarray], weight: int) -> bytes:
        """Keep the update of round ``a`` (announcement) trained from model ``m``; return the
        device's keys message. ``shared``: the trained shared-domain weights, ``start``: the
        model's; an integer trainer's own integers are used when it has them."""
        # cryptography on first use
        from edge_client.secagg.client import SecAggClient, load_identity

        if self._identity is None:
            self._identity = load_identity(self._identity_path)
        self.keep(m, trainer, shared, start, weight)
        self.client = SecAggClient(self._identity, self.cfg.job, self.cfg.device_id, a.round_id,
                                   bytes.fromhex(str(a.hparams["secagg"])), a.selected,
                                   int(a.hparams.get("secagg_degree", 0) or 0))
        return encode_message(self.client.keys(), self.cfg.limits)

    def keep(self, m: ModelMessage, trainer: Trainer, shared: list[np.ndarray], start: list[np.ndarray],
             weight: int) -> None:
        """Keep ``(layers, grid bits or None, weight)``: an integer trainer's own grid
        differences (exact; units of 2^-(bits-1), its storage grid), else the shared-domain
        ``shared - start``."""
        from edge_client.codecs import decode
        from edge_client.intnn import storage_grid_bits

        ints = trainer.int_weights() if self.cfg.trainer == "int" else None  # the Trainer protocol's
        if ints is not None:
            layers = [q.astype(np.int64) - decode(t).astype(np.int64) for q, t in zip(ints, m.tensors)]
            self._update = (layers, int(storage_grid_bits(self.cfg.compute_bits)), int(weight))
        else:
            self._update = ([w.astype(np.float64) - g for w, g in zip(shared, start)], None, int(weight))

    def handle(self, m: object) -> bytes | None:
        """The answer to a coordinator message (None: nothing to send; a message the
        device refuses is logged and ends its secure round)."""
        c = self.client
        if c is None or getattr(m, "round_id", None) != c.round_id:
            return None
        try:
            if isinstance(m, SecAggRoster):
                reply = c.on_roster(m)
                for peer, why in sorted(c.rejected.items()):
                    self.log.warning("round %d: secure aggregation: neighbour %s left out: %s", c.round_id, peer, why)
            elif isinstance(m, SecAggInbox):
                assert self._update is not None
                layers, bits, weight = self._update
                grid = Grid.from_map(c.grid, self.cfg.limits.max_total_elements * 4)
                rng = np.random.default_rng(secrets.randbits(128))
                reply = c.on_inbox(m, secure_vector(layers, grid, weight, rng, int_bits=bits))
                self._update = None  # the plain update is not kept beyond masking
            elif isinstance(m, SecAggUnmask):
                reply = c.on_unmask(m)
                self.client = None
            else:
                return None
        except ProtocolError as exc:
            self.log.warning("round %d: secure aggregation: %s; this device leaves the round", c.round_id, exc)
            self.client, self._update = None, None
            return None
        return encode_message(reply, self.cfg.limits)
