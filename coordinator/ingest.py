"""Received bytes -> what the round loop acts on, every per-message rule applied once.

An update, from :meth:`Fleet.recv` to the strategy's sums::

    Inbound(kind="update", device_id, payload)
      -> Ingest.update(device_id, payload, round, completed)
           1. size            payload <= Limits.max_payload_bytes     rejected_oversized
           2. parse           protocol.decode_message (every field)   rejected_<reason>
           3. kind            an Update on an update topic             rejected_wrong_kind
           4. identity        topic id == payload id                   rejected_spoofed
           5. round           closed: dropped_late; not the open one:  rejected_wrong_round
           6. selection       selected in the open round               rejected_not_selected
           7. duplicate       not yet accepted this round              dropped_duplicate
           8. tensors         layer shapes, integer tensors only from integer devices,
                              |v| <= Limits.max_abs_value, sigma_loc   (``strategies.checks``)
         -> EncodedUpdate (nothing decoded)
      -> Strategy.fold: every codec checks its tensor (header, aux, NaN/Inf of float
         payloads), then the update is fused into the sums or decoded first.

A refused message raises :class:`Rejected` (its ``reason`` labels the metric,
``rejected_<reason>`` or, when ``dropped``, ``dropped_<reason>``: a repeat or late message
from an honest device). Hello and presence messages go through :meth:`Ingest.device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.strategies.checks import check_encoded, is_lossy, sigma_loc_of
from coordinator.strategies.types import FLOAT_BITS, EncodedUpdate
from edge_client.errors import FedbitError, ProtocolError
from edge_client.protocol import Hello, Limits, Presence, Update, decode_message

#: compute bitwidths a device may declare (integer trainers up to 16, float devices 32)
DEVICE_BITS = (2, 4, 6, 8, 12, 16, 32)


class Rejected(FedbitError):
    """A received message the round loop does not use: ``reason`` (``spoofed``,
    ``wrong_round``, a :class:`ProtocolError` reason, ...), ``detail`` for the log, and
    ``dropped`` for a repeat or late message (counted apart from rejections)."""

    def __init__(self, reason: str, detail: str, *, dropped: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.dropped = dropped

    @property
    def metric(self) -> str:
        """The counter it goes under: ``rejected_<reason>`` or ``dropped_<reason>``."""
        return f"{'dropped' if self.dropped else 'rejected'}_{self.reason}"

    @classmethod
    def from_protocol(cls, exc: ProtocolError, prefix: str = "") -> Rejected:
        return cls(exc.reason, f"{prefix}{exc}")


@dataclass
class OpenRound:
    """The round being collected: its id, who was selected, who was accepted (device id ->
    ``time.monotonic()`` of acceptance, in order)."""

    round_id: int
    selected: frozenset[str]
    accepted: dict[str, float] = field(default_factory=dict)


class Ingest:
    """Checks received messages against the model and the open round.

    Args:
        model: the model spec's name (for messages).
        shapes: the model's layer shapes, in ``spec.param_shapes()`` order.
        limits: the protocol limits (payload size, element counts, ``max_abs_value``).
    """

    def __init__(self, model: str, shapes: Sequence[tuple[int, ...]], limits: Limits) -> None:
        self.model = model
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.limits = limits

    def update(self, device_id: str, payload: bytes, rnd: OpenRound | None, completed: int) -> EncodedUpdate:
        """Steps 1-8 of the module docstring for an update received on device
        ``device_id``'s topic, with ``rnd`` the open round (None between rounds) and
        ``completed`` the last closed round. Returns the checked update; raises
        :class:`Rejected`."""
        m = self._parse(payload)
        if not isinstance(m, Update):
            raise Rejected("wrong_kind", f"{m.KIND} on an update topic")
        _check_identity(m, device_id)
        current = rnd.round_id if rnd is not None else None
        if m.round_id <= completed:
            raise Rejected("late", f"round {m.round_id} is closed (current {current})", dropped=True)
        if rnd is None or m.round_id != rnd.round_id:
            raise Rejected("wrong_round", f"round {m.round_id} is not open (current {current})")
        if m.device_id not in rnd.selected:
            raise Rejected("not_selected", f"{m.device_id} is not selected in round {rnd.round_id}")
        if m.device_id in rnd.accepted:
            raise Rejected("duplicate", f"round {rnd.round_id} already counted", dropped=True)
        try:
            return self.encoded(m)
        except ProtocolError as exc:
            raise Rejected.from_protocol(exc) from None

    def encoded(self, m: Update) -> EncodedUpdate:
        """Step 8: a parsed update's tensors checked against the model (ProtocolError);
        an integer device's bitwidth as sent, a float device's as 32."""
        bits = m.compute_bits if m.compute_bits <= 16 else FLOAT_BITS
        eu = EncodedUpdate(m.device_id, m.num_samples, m.tensors, m.content, bits,
                           is_lossy(m.tensors), sigma_loc_of(f"update from {m.device_id!r}", m.tensors),
                           dict(m.not_applied))
        check_encoded(eu, self.shapes, self.limits.max_abs_value)
        return eu

    def device(self, kind: str, device_id: str, payload: bytes) -> Hello | Presence | None:
        """A hello or presence message from ``device_id``'s topic of that ``kind``; None for
        an empty payload (a cleared retained message). Raises :class:`Rejected`."""
        if not payload:
            return None
        m = self._parse(payload)
        if not isinstance(m, Hello | Presence) or m.KIND != kind:
            raise Rejected("wrong_kind", f"{m.KIND} on a {kind} topic")
        _check_identity(m, device_id)
        if isinstance(m, Hello) and (m.compute_bits not in DEVICE_BITS or (
                m.trainer == "int" and m.compute_bits > 16)):
            raise Rejected("malformed", f"unsupported compute_bits {m.compute_bits}")
        return m

    def _parse(self, payload: bytes):  # -> protocol.Message
        """Steps 1 and 2."""
        if len(payload) > self.limits.max_payload_bytes:
            raise Rejected("oversized", f"{len(payload)} bytes > {self.limits.max_payload_bytes}")
        try:
            return decode_message(payload, self.limits)
        except ProtocolError as exc:
            raise Rejected.from_protocol(exc) from None


def _check_identity(m: Hello | Presence | Update, device_id: str) -> None:
    """Step 4: a device speaks only under its own id (the broker's ACL should already
    enforce it; this holds on a misconfigured broker too)."""
    if m.device_id != device_id:
        raise Rejected("spoofed", f"topic id {device_id!r} != payload id {m.device_id!r}")
