"""Received bytes -> what the round loop acts on, every per-message rule applied once.

An update, from :meth:`Fleet.recv` to the strategy's sums::

    Inbound(kind="update", device_id, payload)
      -> Ingest.update(device_id, payload, round, completed)
           1. size            payload <= Limits.max_payload_bytes     rejected_oversized
           1a. enrolment      (with a registry) the topic's device is  rejected_unenrolled
                              enrolled ...
           1b. MAC            ... and the payload's MAC verifies       rejected_bad_mac
                              under its key (before any parsing)
           2. parse           protocol.decode_message (every field)   rejected_<reason>
           3. kind            an Update on an update topic             rejected_wrong_kind
           4. identity        topic id == payload id                   rejected_spoofed
           5. round           closed: dropped_late; not the open one:  rejected_wrong_round
           6. selection       selected in the open round               rejected_not_selected
           7. duplicate       not yet accepted this round              dropped_duplicate
           7a. num_samples    <= the device's bound (job cap, enrolled rejected_too_many_samples
                              value, its hello's): clipped, or refused  (or clipped_num_samples)
           8. tensors         layer shapes, integer tensors only from integer devices,
                              |v| <= Limits.max_abs_value, sigma_loc   (``strategies.checks``)
         -> EncodedUpdate (nothing decoded)
      -> Strategy.fold: every codec checks its tensor (header, aux, NaN/Inf of float
         payloads), then the update is fused into the sums or decoded first.

A refused message raises :class:`Rejected` (its ``reason`` labels the metric,
``rejected_<reason>`` or, when ``dropped``, ``dropped_<reason>``: a repeat or late message
from an honest device). Hello and presence messages go through :meth:`Ingest.device`:
steps 1-4, then a per-device rate limit (``rejected_rate_limited``) and the registry's
size (``rejected_registry_full``). The admission settings (enrolment, sample bound, rate,
registry size) are :class:`~coordinator.ops.admission.AdmissionConfig`.

Topic id = payload id = the authenticated client: the broker binds a topic to the user
that may publish on it (the generated ACL: ``update/%u``), and with a registry the MAC
(step 1b) binds the payload to the device's own key, so that a broker without that ACL
still cannot make the coordinator count a message in another device's name.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.ops.admission import AdmissionConfig, RateLimiter
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
        if m.round_id <= completed:
            raise Rejected("late", f"round {m.round_id} is closed (current {self.round_id})", dropped=True)
        if m.round_id != self.round_id:
            raise Rejected("wrong_round", f"round {m.round_id} is not open (current {self.round_id})")
        if m.device_id not in self.selected:
            raise Rejected("not_selected", f"{m.device_id} is not selected in round {self.round_id}")
        if m.device_id in self.accepted:
            raise Rejected("duplicate", f"round {self.round_id} already counted", dropped=True)


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
            from coordinator.ops.security import EnrolledDevices

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
        m = self._parse(payload, device_id)
        if not isinstance(m, Update):
            raise Rejected("wrong_kind", f"{m.KIND} on an update topic")
        _check_identity(m, device_id)
        if rnd is None:
            if m.round_id <= completed:
                raise Rejected("late", f"round {m.round_id} is closed (current None)", dropped=True)
            raise Rejected("wrong_round", f"round {m.round_id} is not open (current None)")
        rnd.admit(m, completed)
        try:
            eu = self.encoded(m)
        except ProtocolError as exc:
            raise Rejected.from_protocol(exc) from None
        bound, source = self.sample_bound(m.device_id, registry)
        if bound and eu.num_samples > bound:
            if self.admission.samples_policy == "reject":
                raise Rejected("too_many_samples", f"num_samples {eu.num_samples} > {bound} ({source})")
            eu.num_samples = bound
            self.notes["clipped_num_samples"] += 1
        return eu

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
                           dict(m.not_applied))
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
