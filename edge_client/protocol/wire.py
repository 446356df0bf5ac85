"""msgpack bytes <-> messages: :func:`encode_message`, and :func:`decode_message`, the only
door for received bytes (:mod:`edge_client.protocol`)."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

import msgpack
import numpy as np

from edge_client.codecs.tensor import EncodedTensor, packed_length
from edge_client.errors import ProtocolError
from edge_client.protocol.messages import (
    CODEC_BITS,
    DEFAULT_LIMITS,
    DTYPES,
    FLOAT_CODECS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROUND_MODES,
    STATUS_STATES,
    TRAINERS,
    UPDATE_CONTENTS,
    Hello,
    Limits,
    Message,
    ModelMessage,
    Presence,
    RoundAnnouncement,
    Status,
    Update,
    tensor_to_wire,
    valid_id,
)
from edge_client.protocol.secure import SECURE_TYPES, parse_secure

# --------------------------------------------------------------------------- encoding


def _to_wire(value: Any) -> Any:
    if isinstance(value, EncodedTensor):
        return tensor_to_wire(value)
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in fields(value)}
    return value


#: fields left out of the payload while they hold their default (read back as it)
_SKIP_DEFAULT = {"round": ("mode", "tickets", "max_staleness", "refusals"), "update": ("ticket",)}


def encode_message(msg: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """msgpack bytes of ``msg``. The result is validated like a received payload, so a
    sender can never emit what a receiver rejects (oversized, NaN, wrong lengths)."""
    kind = getattr(msg, "KIND", None)
    if kind not in MESSAGE_TYPES or not isinstance(msg, MESSAGE_TYPES[kind]):
        raise ProtocolError(f"kind: cannot encode {type(msg).__name__}")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if f.name in _SKIP_DEFAULT.get(kind, ()) and v == f.default:
            continue  # (a sync round's messages stay as they were before buffered mode)
        body[f.name] = _to_wire(v)
    try:
        payload = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{kind}: cannot pack: {exc}") from None
    decode_message(payload, limits)
    return payload


# --------------------------------------------------------------------------- decoding


class _Reader:
    """Typed access to a received map; every error names the field path."""

    def __init__(self, data: Any, path: str, limits: Limits) -> None:
        if not isinstance(data, dict):
            raise ProtocolError(f"{path or 'payload'}: expected a map, got {type(data).__name__}")
        self.data, self.path, self.limits = data, path, limits

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str, default: Any = ...) -> Any:
        if key in self.data:
            return self.data[key]
        if default is ...:
            raise ProtocolError(f"{self.where(key)}: missing")
        return default

    def int(self, key: str, lo: int, hi: int, default: Any = ...) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(f"{self.where(key)}: expected an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ProtocolError(f"{self.where(key)}: {v} out of range [{lo}, {hi}]")
        return v

    def float(self, key: str, lo: float = -math.inf, hi: float = math.inf, default: Any = ...) -> float:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(f"{self.where(key)}: expected a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            raise ProtocolError(f"{self.where(key)}: not finite ({v})", reason="nonfinite")
        if not lo <= v <= hi:
            raise ProtocolError(f"{self.where(key)}: {v} out of range [{lo}, {hi}]")
        return v

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise ProtocolError(f"{self.where(key)}: expected a boolean, got {type(v).__name__}")
        return v

    def str(self, key: str, allowed: frozenset[str] | None = None, default: Any = ...,
            empty: bool = True) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str):
            raise ProtocolError(f"{self.where(key)}: expected a string, got {type(v).__name__}")
        if len(v) > self.limits.max_str:
            raise ProtocolError(f"{self.where(key)}: longer than {self.limits.max_str} characters")
        if not empty and not v:
            raise ProtocolError(f"{self.where(key)}: empty")
        if allowed is not None and v not in allowed:
            raise ProtocolError(f"{self.where(key)}: {v!r} not one of {sorted(allowed)}")
        return v

    def device_id(self, key: str) -> str:
        v = self.str(key, empty=False)
        if not valid_id(v):
            raise ProtocolError(f"{self.where(key)}: {v!r} is not a valid id ([A-Za-z0-9._-]+)")
        return v

    def list(self, key: str, max_len: int, default: Any = ...) -> list[Any]:
        v = self.raw(key, default)
        if not isinstance(v, list):
            raise ProtocolError(f"{self.where(key)}: expected a list, got {type(v).__name__}")
        if len(v) > max_len:
            raise ProtocolError(f"{self.where(key)}: {len(v)} items exceed the limit {max_len}")
        return v

    def map(self, key: str, default: Any = ...) -> dict[str, Any]:
        v = self.raw(key, default)
        if not isinstance(v, dict):
            raise ProtocolError(f"{self.where(key)}: expected a map, got {type(v).__name__}")
        if len(v) > self.limits.max_map_items:
            raise ProtocolError(f"{self.where(key)}: more than {self.limits.max_map_items} entries")
        for k in v:
            if not isinstance(k, str) or len(k) > self.limits.max_str:
                raise ProtocolError(f"{self.where(key)}: keys must be short strings")
        return v


def _scalar_ok(v: Any) -> bool:
    if isinstance(v, (bool, int, str, bytes)):
        return True
    return isinstance(v, float) and math.isfinite(v)


def _read_aux(r: _Reader) -> dict[str, Any]:
    aux = r.map("aux", {})
    if len(aux) > r.limits.max_aux_items:
        raise ProtocolError(f"{r.where('aux')}: more than {r.limits.max_aux_items} entries")
    for k, v in aux.items():
        where = f"{r.where('aux')}.{k}"
        if isinstance(v, list):
            if len(v) > r.limits.max_aux_list:
                raise ProtocolError(f"{where}: {len(v)} items exceed the limit {r.limits.max_aux_list}")
            for x in v:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise ProtocolError(f"{where}: items must be finite numbers")
                if not math.isfinite(x):
                    raise ProtocolError(f"{where}: items must be finite numbers", reason="nonfinite")
        elif not _scalar_ok(v):
            raise ProtocolError(f"{where}: not a finite number, string or bytes",
                                reason="nonfinite" if isinstance(v, float) else "malformed")
    return aux


def _read_tensor(raw: Any, path: str, limits: Limits) -> EncodedTensor:
    r = _Reader(raw, path, limits)
    name = r.str("name", default="")
    shape_raw = r.list("shape", limits.max_ndim)
    shape: list[int] = []
    for i, d in enumerate(shape_raw):
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= limits.max_tensor_elements:
            raise ProtocolError(f"{r.where('shape')}[{i}]: {d!r} is not a valid dimension",
                                reason="wrong_shape")
        shape.append(d)
    n = math.prod(shape)
    if n > limits.max_tensor_elements:
        raise ProtocolError(f"{r.where('shape')}: {n} elements exceed the limit {limits.max_tensor_elements}",
                            reason="wrong_shape")
    dtype = r.str("dtype", DTYPES)
    codec = r.str("codec", frozenset(CODEC_BITS))
    lo, hi = CODEC_BITS[codec]
    bits = r.int("bits", lo, hi)
    data = r.raw("data")
    if not isinstance(data, bytes):
        raise ProtocolError(f"{r.where('data')}: expected bytes, got {type(data).__name__}")
    expected = packed_length(n, bits)
    if len(data) != expected:
        raise ProtocolError(
            f"{r.where('data')}: {len(data)} bytes, expected ceil({n}*{bits}/8) = {expected}"
        )
    if codec in FLOAT_CODECS:
        if n and not np.isfinite(np.frombuffer(data, dtype=FLOAT_CODECS[codec])).all():
            raise ProtocolError(f"{r.where('data')}: contains NaN or Inf", reason="nonfinite")
    aux = _read_aux(r)
    return EncodedTensor(tuple(shape), dtype, codec, bits, data, aux, name)


def _read_tensors(r: _Reader, key: str, total: list[int]) -> tuple[EncodedTensor, ...]:
    items = r.list(key, r.limits.max_layers)
    out = []
    for i, raw in enumerate(items):
        t = _read_tensor(raw, f"{r.where(key)}[{i}]", r.limits)
        total[0] += t.size
        if total[0] > r.limits.max_total_elements:
            raise ProtocolError(f"{r.where(key)}: more than {r.limits.max_total_elements} elements in all")
        out.append(t)
    return tuple(out)


def _read_hparams(r: _Reader) -> dict[str, Any]:
    hp = r.map("hparams", {})
    for k, v in hp.items():
        if not _scalar_ok(v) or isinstance(v, bytes):
            raise ProtocolError(f"{r.where('hparams')}.{k}: not a finite number, boolean or string")
    return hp


def _read_str_map(r: _Reader, key: str) -> dict[str, str]:
    m = r.map(key, {})
    for k, v in m.items():
        if not isinstance(v, str) or len(v) > r.limits.max_str:
            raise ProtocolError(f"{r.where(key)}.{k}: expected a string of at most "
                                f"{r.limits.max_str} characters")
    return dict(m)


def _read_floats(r: _Reader, key: str) -> tuple[float, ...]:
    items = r.list(key, r.limits.max_layers, default=[])
    for i, x in enumerate(items):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ProtocolError(f"{r.where(key)}[{i}]: not a finite number",
                                reason="nonfinite" if isinstance(x, float) else "malformed")
    return tuple(float(x) for x in items)


def _read_refusals(r: _Reader) -> tuple[tuple[str, int, str], ...]:
    """``refusals``: ``[device id, ticket, reason]`` triples."""
    out = []
    for i, item in enumerate(r.list("refusals", r.limits.max_devices, default=[])):
        where = f"{r.where('refusals')}[{i}]"
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError(f"{where}: expected [device, ticket, reason]")
        dev, ticket, reason = item
        if not isinstance(dev, str) or not valid_id(dev):
            raise ProtocolError(f"{where}[0]: not a valid device id")
        if isinstance(ticket, bool) or not isinstance(ticket, int) or not 0 <= ticket <= 1 << 62:
            raise ProtocolError(f"{where}[1]: not a ticket number")
        if not isinstance(reason, str) or len(reason) > r.limits.max_str:
            raise ProtocolError(f"{where}[2]: expected a string of at most {r.limits.max_str} characters")
        out.append((dev, ticket, reason))
    return tuple(out)


def _read_digest(r: _Reader, key: str, default: Any = ...) -> str:
    v = r.str(key, default=default)
    if v and (len(v) != 64 or any(c not in "0123456789abcdef" for c in v)):
        raise ProtocolError(f"{r.where(key)}: not a sha256 hex digest")
    return v


def _parse(kind: str, r: _Reader) -> Message:
    lim = r.limits
    if kind in SECURE_TYPES:
        return parse_secure(kind, r)
    if kind == "hello":
        return Hello(
            device_id=r.device_id("device_id"), profile=r.str("profile", empty=False),
            compute_bits=r.int("compute_bits", 2, 32), trainer=r.str("trainer", TRAINERS),
            codec=r.str("codec", frozenset(CODEC_BITS)), codec_bits=r.int("codec_bits", 1, 32),
            num_samples=r.int("num_samples", 0, 1 << 40), sdk_version=r.str("sdk_version"),
        )
    if kind == "presence":
        return Presence(device_id=r.device_id("device_id"), online=r.bool("online"),
                        round_id=r.int("round_id", 0, 1 << 40, default=0))
    if kind == "round":
        selected = r.list("selected", lim.max_devices)
        for i, s in enumerate(selected):
            if not isinstance(s, str) or not valid_id(s):
                raise ProtocolError(f"{r.where('selected')}[{i}]: not a valid device id")
        variants = r.map("variants")
        for k in variants:
            if not valid_id(k):
                raise ProtocolError(f"{r.where('variants')}: {k!r} is not a valid variant name")
            _read_digest(_Reader(variants, r.where("variants"), lim), k)
        mode = r.str("mode", ROUND_MODES, default="sync")
        tickets = r.list("tickets", lim.max_devices, default=[])
        for i, t in enumerate(tickets):
            if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 1 << 62:
                raise ProtocolError(f"{r.where('tickets')}[{i}]: not a ticket number (1..2^62)")
        if tickets and len(tickets) != len(selected):
            raise ProtocolError(f"{r.where('tickets')}: {len(tickets)} tickets for {len(selected)} selected devices")
        return RoundAnnouncement(
            job=r.device_id("job"), round_id=r.int("round_id", 0, 1 << 40),
            model=r.str("model", empty=False), selected=tuple(selected),
            deadline=r.float("deadline", 0.0), variants=dict(variants), hparams=_read_hparams(r),
            mode=mode, tickets=tuple(tickets), max_staleness=r.int("max_staleness", 0, 1 << 40, default=0),
            refusals=_read_refusals(r),
        )
    if kind == "model":
        total = [0]
        return ModelMessage(
            round_id=r.int("round_id", 0, 1 << 40), variant=r.device_id("variant"),
            model=r.str("model", empty=False), tensors=_read_tensors(r, "tensors", total),
            digest=_read_digest(r, "digest"),
            last_global_step=_read_tensors(r, "last_global_step", total) if "last_global_step" in r.data else (),
            sigma_g=_read_floats(r, "sigma_g"),
        )
    if kind == "update":
        total = [0]
        return Update(
            device_id=r.device_id("device_id"), round_id=r.int("round_id", 0, 1 << 40),
            num_samples=r.int("num_samples", 1, 1 << 40), compute_bits=r.int("compute_bits", 2, 32),
            content=r.str("content", UPDATE_CONTENTS), tensors=_read_tensors(r, "tensors", total),
            model_digest=_read_digest(r, "model_digest", default=""),
            train_loss=r.float("train_loss", default=0.0),
            train_seconds=r.float("train_seconds", 0.0, default=0.0),
            not_applied=_read_str_map(r, "not_applied"), ticket=r.int("ticket", 0, 1 << 62, default=0),
        )
    if kind == "status":
        metrics = r.map("metrics", {})
        for k, v in metrics.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ProtocolError(f"{r.where('metrics')}.{k}: not a finite number")
        return Status(
            state=r.str("state", STATUS_STATES), round_id=r.int("round_id", 0, 1 << 40),
            message=r.str("message", default=""), metrics={k: float(v) for k, v in metrics.items()},
        )
    raise ProtocolError(f"kind: unknown message kind {kind!r}")  # pragma: no cover


def decode_message(payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate one received payload; :class:`ProtocolError` on anything wrong."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload: expected bytes, got {type(payload).__name__}")
    if len(payload) > limits.max_payload_bytes:
        raise ProtocolError(
            f"payload: {len(payload)} bytes exceed the limit of {limits.max_payload_bytes}",
            reason="oversized")
    try:
        body = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=limits.max_payload_bytes, max_str_len=max(limits.max_str, 1 << 16),
            max_array_len=max(limits.max_aux_list, limits.max_devices, limits.max_layers),
            max_map_len=max(limits.max_map_items, 16), max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError...)
        raise ProtocolError(f"payload: not a valid msgpack document ({type(exc).__name__}: {exc})") from None
    r = _Reader(body, "", limits)
    v = r.int("v", 0, 1 << 16)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"v: protocol version {v} is not supported (this is {PROTOCOL_VERSION})")
    kind = r.str("kind", frozenset(MESSAGE_TYPES))
    try:
        return _parse(kind, r)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError(f"{kind}: structure too deep") from None


