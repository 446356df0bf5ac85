"""The messages of the wire format and the names they travel under: limits, the codec
names and widths the wire accepts (read from :mod:`edge_client.codecs`, which defines
:class:`EncodedTensor`), the six message kinds, model variants and topics
(:mod:`edge_client.protocol`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, Union

import msgpack

from edge_client.codecs.registry import CODECS
from edge_client.codecs.tensor import EncodedTensor
from edge_client.errors import ProtocolError
from edge_client.protocol.secure import SECURE_TYPES

PROTOCOL_VERSION = 1

#: codec name -> (min bits, max bits), read from the codec classes (the wire accepts
#: exactly the registered codecs).
CODEC_BITS: Mapping[str, tuple[int, int]] = MappingProxyType({n: c.bits_range for n, c in CODECS.items()})
#: dtypes a decoded tensor may have.
DTYPES = frozenset({"float32", "float16", "int8", "int16", "int32", "uint8", "uint16"})
#: codec name -> the numpy dtype of its payload where that is raw IEEE floats, which the
#: wire checks for NaN/Inf (:attr:`Codec.wire_dtype`).
FLOAT_CODECS: Mapping[str, str] = MappingProxyType({n: c.wire_dtype for n, c in CODECS.items() if c.wire_dtype})


@dataclass(frozen=True)
class Limits:
    """Caps enforced before allocation. The defaults fit a 2.2 M-parameter model in
    float32 with room; a deployment with bigger models raises them on both sides.

    ``max_abs_value`` bounds the magnitude of the values an update may carry (in the
    shared float domain, where weights are O(1)); the coordinator checks it before an
    update touches the sums, so finite but huge values cannot overflow them to Inf.
    """

    max_payload_bytes: int = 64 * 1024 * 1024
    max_layers: int = 256
    max_ndim: int = 6
    max_tensor_elements: int = 1 << 25
    max_total_elements: int = 1 << 26
    max_aux_items: int = 16
    max_aux_list: int = 1 << 16
    max_str: int = 256
    max_devices: int = 100_000
    max_map_items: int = 64
    max_abs_value: float = 1e6


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------- tensors


def tensor_to_wire(t: EncodedTensor) -> dict[str, Any]:
    """One tensor as the map it travels as."""
    return {
        "name": t.name, "shape": list(t.shape), "dtype": t.dtype, "codec": t.codec,
        "bits": t.bits, "data": bytes(t.data), "aux": dict(t.aux),
    }


def tensors_digest(tensors: Iterable[EncodedTensor]) -> str:
    """SHA-256 hex digest of tensors' names, shapes, dtypes, codecs, bits, data and aux."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(msgpack.packb(tensor_to_wire(t), use_bin_type=True))
    return h.hexdigest()


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Hello:
    """A device introduces itself (topic ``hello/<device_id>``)."""

    KIND: ClassVar[str] = "hello"
    device_id: str
    profile: str
    compute_bits: int
    trainer: str
    codec: str
    codec_bits: int
    num_samples: int
    sdk_version: str


@dataclass(frozen=True)
class Presence:
    """Retained on ``presence/<device_id>``; the last-will publishes ``online=False``.

    ``round_id`` > 0: the device's acknowledgement of the announcement of that round (sent,
    not retained, when a round selects it): the coordinator knows at once that a selected
    device is alive and at work, and one that stays silent is a straggler long before the
    deadline. 0 (the retained messages, and devices of older versions): no round."""

    KIND: ClassVar[str] = "presence"
    device_id: str
    online: bool
    round_id: int = 0


@dataclass(frozen=True)
class RoundAnnouncement:
    """Retained on ``round``: who trains in round ``round_id`` and until when.

    ``deadline`` is a Unix time in seconds; ``variants`` maps a model variant name
    (``"float32"``, ``"int8"``...) to its digest; ``hparams`` holds the local training
    hyper-parameters (``epochs``, ``batch``, ``prox_mu``, ...).

    ``mode = "buffered"``: ``round_id`` is the current model version and ``selected`` the
    devices asked to train, ``tickets[i]`` the number of ``selected[i]``'s request (one
    training per ticket; tickets only grow within a run). An update trained on version
    ``v`` while the coordinator is at ``round_id`` has staleness ``round_id - v`` and is
    refused past ``max_staleness``; ``refusals`` lists recent refusals as ``(device,
    ticket, reason)``. Absent from an older coordinator's announcement (a round).
    """

    KIND: ClassVar[str] = "round"
    job: str
    round_id: int
    model: str
    selected: tuple[str, ...]
    deadline: float
    variants: dict[str, str]
    hparams: dict[str, Any] = field(default_factory=dict)
    mode: str = "sync"
    tickets: tuple[int, ...] = ()
    max_staleness: int = 0
    refusals: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class ModelMessage:
    """Retained on ``model/<variant>``: the global model in one bitwidth variant.

    ``last_global_step`` (FedFOR) is empty when the strategy does not need it;
    ``sigma_g`` (DANUQ) is one float per layer or empty.
    """

    KIND: ClassVar[str] = "model"
    round_id: int
    variant: str
    model: str
    tensors: tuple[EncodedTensor, ...]
    digest: str
    last_global_step: tuple[EncodedTensor, ...] = ()
    sigma_g: tuple[float, ...] = ()


@dataclass(frozen=True)
class Update:
    """A device's result for one round, on ``update/<device_id>`` (QoS 1).

    ``content`` says what the tensors hold: ``"weights"`` (full local weights) or ``"delta"``
    (local minus global). ``model_digest`` names the model the device started from.
    ``not_applied``: announced hyper-parameters the device did not apply, each with the
    reason (an unknown key, a bad value, a setting it cannot honour); the coordinator logs
    and counts them. Absent from an older device's update (read as empty). ``ticket``: in
    buffered mode, the request it answers (``RoundAnnouncement.tickets``; 0 otherwise).
    """

    KIND: ClassVar[str] = "update"
    device_id: str
    round_id: int
    num_samples: int
    compute_bits: int
    content: str
    tensors: tuple[EncodedTensor, ...]
    model_digest: str = ""
    train_loss: float = 0.0
    train_seconds: float = 0.0
    not_applied: dict[str, str] = field(default_factory=dict)
    ticket: int = 0


@dataclass(frozen=True)
class Status:
    """Retained on ``status``: the coordinator's state (``"waiting"``, ``"round"``,
    ``"done"``, ``"error"``) and the last round's metrics."""

    KIND: ClassVar[str] = "status"
    state: str
    round_id: int
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


Message = Union[Hello, Presence, RoundAnnouncement, ModelMessage, Update, Status]  # 3.9: no X | Y
MESSAGE_TYPES: dict[str, type] = {
    cls.KIND: cls for cls in (Hello, Presence, RoundAnnouncement, ModelMessage, Update, Status)
}
MESSAGE_TYPES.update(SECURE_TYPES)  # secure aggregation's (protocol.secure)
UPDATE_CONTENTS = frozenset({"weights", "delta"})
TRAINERS = frozenset({"int", "torch"})
STATUS_STATES = frozenset({"waiting", "round", "done", "error"})
#: how a job aggregates: synchronous rounds, or a buffer of asynchronous updates
ROUND_MODES = frozenset({"sync", "buffered"})


_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def valid_id(v: str) -> bool:
    """Ids appear in MQTT topics: no wildcards, separators or control characters."""
    return bool(v) and len(v) <= 128 and all(c in _ID_CHARS for c in v)


# --------------------------------------------------------------------------- variants

#: the model variant of float devices (the shared weights, lossless)
FLOAT_VARIANT = "float32"


def model_variant(compute_bits: int, trainer: str) -> str:
    """The model variant a device downloads and trains: ``float32`` for float devices
    (trainer ``torch`` or 32 bits), ``int<s>`` for s-bit integer devices (its weights on
    the device's storage grid, docs/algorithms.md §2). Variant names are topic levels
    (``model/<variant>``)."""
    return FLOAT_VARIANT if trainer == "torch" or compute_bits >= 32 else f"int{int(compute_bits)}"


def variant_bits(variant: str) -> int:
    """The compute bitwidth of a variant name: 32 for ``float32``, s for ``int<s>``
    (ProtocolError for anything else)."""
    if variant == FLOAT_VARIANT:
        return 32
    if variant.startswith("int") and variant[3:].isdigit() and 2 <= int(variant[3:]) <= 16:
        return int(variant[3:])
    raise ProtocolError(f"variant: {variant!r} is not float32 or int2..int16")


# --------------------------------------------------------------------------- topics

TOPIC_ROOT = "fedbit"
#: ``linktest``: a device's link measurement (``fedbit-edge measure-link``), which no one
#: subscribes to: the broker acknowledges and drops it
#: ``secagg``: a device's secure-aggregation messages, ``secagg-in``: the coordinator's to it
_TOPIC_KINDS_WITH_ID = frozenset({"presence", "hello", "model", "update", "linktest", "secagg", "secagg-in"})
_TOPIC_KINDS_PLAIN = frozenset({"round", "status"})


def topic(job: str, kind: str, ident: str | None = None) -> str:
    """``fedbit/<job>/<kind>[/<ident>]``; ids must be valid topic levels."""
    if not valid_id(job):
        raise ProtocolError(f"job: {job!r} is not a valid id")
    if kind in _TOPIC_KINDS_PLAIN and ident is None:
        return f"{TOPIC_ROOT}/{job}/{kind}"
    if kind in _TOPIC_KINDS_WITH_ID and ident is not None and valid_id(ident):
        return f"{TOPIC_ROOT}/{job}/{kind}/{ident}"
    raise ProtocolError(f"topic: no topic {kind!r} with id {ident!r}")


def parse_topic(name: str) -> tuple[str, str, str | None]:
    """``(job, kind, ident)`` of a fedbit topic; :class:`ProtocolError` otherwise."""
    parts = name.split("/")
    if len(parts) in (3, 4) and parts[0] == TOPIC_ROOT and valid_id(parts[1]):
        if len(parts) == 3 and parts[2] in _TOPIC_KINDS_PLAIN:
            return parts[1], parts[2], None
        if len(parts) == 4 and parts[2] in _TOPIC_KINDS_WITH_ID and valid_id(parts[3]):
            return parts[1], parts[2], parts[3]
    raise ProtocolError(f"topic: {name!r} is not a fedbit topic")


def as_mapping(msg: Message) -> Mapping[str, Any]:
    """The message's fields as a plain dict (for logs)."""
    return {f.name: getattr(msg, f.name) for f in fields(msg)}
