"""Received bytes -> what the round loop acts on, every per-message rule applied once.

:meth:`Ingest.update` takes an update's exact payload and the open round, applies the
numbered rules of docs/architecture.md#the-update-path in order (size; enrolment and the
device's MAC, before any parsing; parse; kind; topic id = payload id; round; selection;
duplicate; the ``num_samples`` bound; tensors) and returns an ``EncodedUpdate``:
nothing is decoded here, the strategy's fold does that. :meth:`Ingest.device` takes hello
and presence messages: rules 1-4, then a per-device rate limit and the registry's size.

A refused message raises :class:`Rejected`; its ``reason`` labels the metric
(``rejected_<reason>``, or ``dropped_<reason>`` for a repeat or late message from an
honest device). The admission settings are :class:`~coordinator.ops.admission.AdmissionConfig`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.ops.admission import AdmissionConfig, RateLimiter
from coordinator.ops.untrusted import safe_map, safe_text
from coordinator.strategies.checks import check_encoded, is_lossy, sigma_loc_of
from coordinator.strategies.types import FLOAT_BITS, EncodedUpdate
from edge_client.auth import verify as verify_mac
from edge_client.errors import FedbitError, ProtocolError
from edge_client.protocol import Hello, Limits, Presence, Update, decode_message

#: compute bitwidths a device may declare (integer trainers up to 16, float devices 32)
DEVICE_BITS = (2, 4, 6, 8, 12, 16, 32)


class Rejected(FedbitError):
    """A received message the round loop does not use: ``reason`` (``spoofed``,
    ``wrong_round``, a :class:`ProtocolError` reason, ...), ``detail`` for the log, and
    ``dropped`` for a repeat or late message (counted apart from rejections), ``quiet``
    for one logged at debug level only (a flood must not flood the log)."""

    def __init__(self, reason: str, detail: str, *, dropped: bool = False, quiet: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.dropped = dropped
        self.quiet = quiet

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
    #: selected devices known to be gone before they answered (device id -> why: ``left``,
    #: their last will arrived): stragglers at once, the round does not wait for them
    gone: dict[str, str] = field(default_factory=dict)

    def mark_gone(self, device_id: str, why: str) -> bool:
        """Stop waiting for selected device ``device_id`` (``why``: ``left``, ...); True
        when it was still outstanding."""
        if device_id not in self.selected or device_id in self.accepted or device_id in self.gone:
            return False
        self.gone[device_id] = why
        return True

    def outstanding(self) -> list[str]:
        """Selected devices that neither answered nor are gone, by id."""
        return sorted(self.selected - self.accepted.keys() - self.gone.keys())

    def settled(self) -> bool:
        """Every selected device answered or is gone: nothing more to wait for."""
        return len(self.accepted) + len(self.gone.keys() - self.accepted.keys()) >= len(self.selected)

    def admit(self, m: Update, completed: int) -> None:
        """Steps 5-7 for a parsed update (``completed``: the last closed round); raises
        :class:`Rejected`. (A buffered window has rules of its own: ``coordinator.buffered``.)"""
        Ingest.admit(m.device_id, m.round_id, self, completed)


class Ingest:
    """Checks received messages against the model and the open round.

    Args:
        model: the model spec's name (for messages).
        shapes: the model's layer shapes, in ``spec.param_shapes()`` order.
        limits: the protocol limits (payload size, element counts, ``max_abs_value``).
        admission: enrolment, sample bound, rates (:mod:`coordinator.ops.admission`).
        job: the job id (the registry's).

    ``notes`` counts what was changed rather than refused (``clipped_num_samples``); the
    caller takes them.
    """

    def __init__(self, model: str, shapes: Sequence[tuple[int, ...]], limits: Limits,
                 admission: AdmissionConfig | None = None, job: str = "default") -> None:
        self.model = model
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.limits = limits
        self.admission = admission or AdmissionConfig()
        self.enrolled = None
        if self.admission.enrolment:
            from coordinator.ops.credentials import EnrolledDevices

            self.enrolled = EnrolledDevices(self.admission.enrolment, job)
        self.rate = RateLimiter(self.admission.hello_rate, self.admission.hello_burst,
                                2 * self.admission.max_registered)
        self.notes: Counter[str] = Counter()

    def update(self, device_id: str, payload: bytes, rnd: OpenRound | None, completed: int,
               registry: Any = None) -> EncodedUpdate:
        """Steps 1-8 of the module docstring for an update received on device
        ``device_id``'s topic, with ``rnd`` the open round (None between rounds),
        ``completed`` the last closed round and ``registry`` the
        :class:`~coordinator.devices.DeviceRegistry` (its hellos bound ``num_samples``).
        Returns the checked update; raises :class:`Rejected`."""
        m = self.checked(device_id, payload)
        if rnd is None:
            self.admit(m.device_id, m.round_id, rnd, completed)  # (raises: no round is open)
        rnd.admit(m, completed)
        try:
            eu = self.encoded(m)
        except ProtocolError as exc:
            raise Rejected.from_protocol(exc) from None
        n = self.sample_limit(m.device_id, eu.num_samples, registry)
        if n != eu.num_samples:
            eu.num_samples = n
            self.notes["clipped_num_samples"] += 1
        return eu

    def checked(self, device_id: str, payload: bytes) -> Update:
        """Steps 1-4: the parsed update a device sent on its own topic (:class:`Rejected`
        otherwise). What needs no round state, so ingest workers run it."""
        m = self._parse(payload, device_id)
        if not isinstance(m, Update):
            raise Rejected("wrong_kind", f"{m.KIND} on an update topic")
        _check_identity(m, device_id)
        return m

    @staticmethod
    def admit(device_id: str, round_id: int, rnd: OpenRound | None, completed: int) -> None:
        """Steps 5-7: an update of ``round_id`` from ``device_id`` is for the open round
        ``rnd``, from a selected device, and its first (:class:`Rejected` otherwise)."""
        current = rnd.round_id if rnd is not None else None
        if round_id <= completed:
            raise Rejected("late", f"round {round_id} is closed (current {current})", dropped=True)
        if rnd is None or round_id != rnd.round_id:
            raise Rejected("wrong_round", f"round {round_id} is not open (current {current})")
        if device_id not in rnd.selected:
            raise Rejected("not_selected", f"{device_id} is not selected in round {rnd.round_id}")
        if device_id in rnd.accepted:
            raise Rejected("duplicate", f"round {rnd.round_id} already counted", dropped=True)

    def sample_limit(self, device_id: str, num_samples: int, registry: Any = None) -> int:
        """Step 7a: the ``num_samples`` an update claiming ``num_samples`` counts with (its
        bound when it claims more and the policy clips; :class:`Rejected` when it rejects)."""
        bound, source = self.sample_bound(device_id, registry)
        if bound and num_samples > bound:
            if self.admission.samples_policy == "reject":
                raise Rejected("too_many_samples", f"num_samples {num_samples} > {bound} ({source})")
            return bound
        return num_samples

    def sample_bound(self, device_id: str, registry: Any = None) -> tuple[int, str]:
        """Step 7a: the most samples an update of ``device_id`` may claim (0: unbounded)
        and where that bound comes from."""
        bounds = []
        if self.admission.max_samples:
            bounds.append((self.admission.max_samples, "the job's max_samples"))
        if self.enrolled is not None and self.enrolled.max_samples(device_id):
            bounds.append((self.enrolled.max_samples(device_id), "declared at enrolment"))
        hello = registry.hellos.get(device_id) if registry is not None else None
        if hello is not None and hello.num_samples > 0:
            bounds.append((hello.num_samples, "declared in its hello"))
        return min(bounds) if bounds else (0, "")

    def encoded(self, m: Update) -> EncodedUpdate:
        """Step 8: a parsed update's tensors checked against the model (ProtocolError);
        an integer device's bitwidth as sent, a float device's as 32."""
        bits = m.compute_bits if m.compute_bits <= 16 else FLOAT_BITS
        eu = EncodedUpdate(m.device_id, m.num_samples, m.tensors, m.content, bits,
                           is_lossy(m.tensors), sigma_loc_of(f"update from {m.device_id!r}", m.tensors),
                           safe_map(m.not_applied))
        check_encoded(eu, self.shapes, self.limits.max_abs_value)
        return eu

    def device(self, kind: str, device_id: str, payload: bytes, registry: Any = None,
               now: float | None = None) -> Hello | Presence | None:
        """A hello or presence message from ``device_id``'s topic of that ``kind``; None for
        an empty payload (a cleared retained message). ``registry``: the
        :class:`~coordinator.devices.DeviceRegistry` whose size is capped; ``now``: a
        ``time.monotonic()`` stamp for the rate limit. Raises :class:`Rejected`."""
        if not payload:
            return None
        m = self._parse(payload, device_id)
        if not isinstance(m, Hello | Presence) or m.KIND != kind:
            raise Rejected("wrong_kind", f"{m.KIND} on a {kind} topic")
        _check_identity(m, device_id)
        if isinstance(m, Hello) and (m.compute_bits not in DEVICE_BITS or (
                m.trainer == "int" and m.compute_bits > 16)):
            raise Rejected("malformed", f"unsupported compute_bits {m.compute_bits}")
        if isinstance(m, Hello):  # its free text, as it is registered, logged and shown
            m = replace(m, profile=safe_text(m.profile), sdk_version=safe_text(m.sdk_version))
        if not self.rate.allow(device_id, time.monotonic() if now is None else now):
            raise Rejected("rate_limited", f"more than {self.admission.hello_burst} hello/presence "
                           f"messages at {self.admission.hello_rate:g}/s", quiet=True)
        cap = self.admission.max_registered
        if registry is not None and device_id not in registry.hellos and (
                len(registry.hellos) >= cap or len(registry.online) >= 2 * cap):
            raise Rejected("registry_full", f"{len(registry.hellos)} devices registered (max_registered {cap})")
        return m

    def secure(self, device_id: str, payload: bytes, kinds: frozenset[str]):  # -> protocol.Message
        """A secure-aggregation message from ``device_id``'s ``secagg`` topic: steps 1-4
        (size, enrolment, MAC, parse, a kind of ``kinds``, identity); raises :class:`Rejected`."""
        m = self._parse(payload, device_id)
        if m.KIND not in kinds:
            raise Rejected("wrong_kind", f"{m.KIND} on a secagg topic")
        _check_identity(m, device_id)
        return m

    def _parse(self, payload: bytes, device_id: str):  # -> protocol.Message
        """Steps 1, 1a, 1b and 2."""
        if len(payload) > self.limits.max_payload_bytes:
            raise Rejected("oversized", f"{len(payload)} bytes > {self.limits.max_payload_bytes}")
        if self.enrolled is not None:
            key = self.enrolled.key(device_id)
            if key is None:
                raise Rejected("unenrolled", f"{device_id!r} is not enrolled in this job")
            if not verify_mac(payload, key):
                raise Rejected("bad_mac", "no MAC, or one that does not verify under the device's key")
        try:
            return decode_message(payload, self.limits)
        except ProtocolError as exc:
            raise Rejected.from_protocol(exc) from None


def _check_identity(m: Any, device_id: str) -> None:
    """Step 4: a device speaks only under its own id (the broker's ACL should already
    enforce it; this holds on a misconfigured broker too)."""
    if m.device_id != device_id:
        raise Rejected("spoofed", f"topic id {device_id!r} != payload id {m.device_id!r}")
