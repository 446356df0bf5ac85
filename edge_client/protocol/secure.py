"""The messages of secure aggregation (SecAgg+; docs/security.md#secure-aggregation).

Devices send on ``secagg/<device>``, the coordinator answers each on
``secagg-in/<device>``. One secure round, after the announcement (whose ``secagg``
hyper-parameter is the round's session, hex):

1. :class:`SecAggKeys`: a device's two X25519 public keys and a commitment to its
   self-mask seed, signed with its Ed25519 identity;
2. :class:`SecAggRoster`: its neighbours' signed keys, the threshold and the sum's grid;
3. :class:`SecAggShares`: Shamir shares of its self-mask seed and mask key, each sealed
   for its neighbour (the coordinator cannot read them);
4. :class:`SecAggInbox`: the sealed shares addressed to the device;
5. :class:`SecAggMasked`: its masked input, and the neighbours whose shares did not open;
6. :class:`SecAggUnmask`: which neighbours survived, which dropped;
7. :class:`SecAggReveal`: survivors' self-mask shares, dropped devices' mask-key shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from edge_client.errors import ProtocolError

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from edge_client.protocol.wire import _Reader

T = TypeVar("T")

#: the sizes of what the messages carry (bytes)
KEY = 32
SIG = 64
SHARE = 66
#: a sealed share: nonce 12 + two shares + the AEAD tag 16
SEALED = 12 + 2 * SHARE + 16


@dataclass(frozen=True)
class PeerKeys:
    """A neighbour's signed round keys (in a :class:`SecAggRoster`); ``x`` its Shamir
    x-coordinate."""

    device_id: str
    x: int
    identity: bytes
    c_pk: bytes
    s_pk: bytes
    b_commit: bytes
    signature: bytes


@dataclass(frozen=True)
class PeerShare:
    """A sealed pair of shares to (in :class:`SecAggShares`) or from (in
    :class:`SecAggInbox`) ``peer``; ``hb``/``hs`` commit to the two shares inside (checked
    when they are revealed)."""

    peer: str
    ct: bytes
    hb: bytes = b""
    hs: bytes = b""


@dataclass(frozen=True)
class RevealedShare:
    """A device's share of ``of``'s secret ``secret`` (``"b"``: self-mask seed, ``"s"``:
    mask key)."""

    of: str
    secret: str
    share: bytes


@dataclass(frozen=True)
class SecAggKeys:
    KIND: ClassVar[str] = "sa_keys"
    device_id: str
    round_id: int
    identity: bytes
    c_pk: bytes
    s_pk: bytes
    b_commit: bytes
    signature: bytes


@dataclass(frozen=True)
class SecAggRoster:
    """``grid``: the encoding of the sum (``edge_client.secagg.encode.Grid`` fields)."""

    KIND: ClassVar[str] = "sa_roster"
    device_id: str
    round_id: int
    session: bytes
    threshold: int
    x: int
    peers: tuple[PeerKeys, ...]
    grid: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SecAggShares:
    KIND: ClassVar[str] = "sa_shares"
    device_id: str
    round_id: int
    shares: tuple[PeerShare, ...]


@dataclass(frozen=True)
class SecAggInbox:
    KIND: ClassVar[str] = "sa_inbox"
    device_id: str
    round_id: int
    shares: tuple[PeerShare, ...]


@dataclass(frozen=True)
class SecAggMasked:
    """``data``: the masked vector, uint32 little-endian."""

    KIND: ClassVar[str] = "sa_masked"
    device_id: str
    round_id: int
    data: bytes
    complaints: tuple[str, ...] = ()


@dataclass(frozen=True)
class SecAggUnmask:
    KIND: ClassVar[str] = "sa_unmask"
    device_id: str
    round_id: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class SecAggReveal:
    KIND: ClassVar[str] = "sa_reveal"
    device_id: str
    round_id: int
    shares: tuple[RevealedShare, ...]


#: any one of the messages above (3.9: no X | Y at run time)
SecureMessage = Union[SecAggKeys, SecAggRoster, SecAggShares, SecAggInbox, SecAggMasked,
                      SecAggUnmask, SecAggReveal]

SECURE_TYPES = {c.KIND: c for c in (SecAggKeys, SecAggRoster, SecAggShares, SecAggInbox, SecAggMasked,
                                    SecAggUnmask, SecAggReveal)}
#: what a device sends (the rest the coordinator sends)
FROM_DEVICES = frozenset({"sa_keys", "sa_shares", "sa_masked", "sa_reveal"})


def _bytes(r: _Reader, key: str, size: int = 0, max_size: int = 0) -> bytes:
    v = r.raw(key)
    if not isinstance(v, bytes):
        raise ProtocolError(f"{r.where(key)}: expected bytes, got {type(v).__name__}")
    if size and len(v) != size or max_size and len(v) > max_size:
        raise ProtocolError(f"{r.where(key)}: {len(v)} bytes, expected {size or f'<= {max_size}'}")
    return v


def _ids(r: _Reader, key: str) -> tuple[str, ...]:
    items = r.list(key, r.limits.max_devices, default=[])
    for i, s in enumerate(items):
        sub = type(r)({"id": s}, f"{r.where(key)}[{i}]", r.limits)
        sub.device_id("id")
    if len(set(items)) != len(items):
        raise ProtocolError(f"{r.where(key)}: repeated ids")
    return tuple(items)


def _records(r: _Reader, key: str, read: Callable[[_Reader], T]) -> tuple[T, ...]:
    items = r.list(key, r.limits.max_devices)
    out = tuple(read(type(r)(raw, f"{r.where(key)}[{i}]", r.limits)) for i, raw in enumerate(items))
    return out


def parse_secure(kind: str, r: _Reader) -> SecureMessage:
    """The secure-aggregation message ``kind`` from the wire reader ``r``
    (``protocol.wire._Reader``); ProtocolError naming the field."""
    dev, rnd = r.device_id("device_id"), r.int("round_id", 0, 1 << 40)
    if kind == "sa_keys":
        return SecAggKeys(dev, rnd, _bytes(r, "identity", KEY), _bytes(r, "c_pk", KEY), _bytes(r, "s_pk", KEY),
                          _bytes(r, "b_commit", KEY), _bytes(r, "signature", SIG))
    if kind == "sa_roster":
        peers = _records(r, "peers", lambda p: PeerKeys(
            p.device_id("device_id"), p.int("x", 1, 1 << 31), _bytes(p, "identity", KEY), _bytes(p, "c_pk", KEY),
            _bytes(p, "s_pk", KEY), _bytes(p, "b_commit", KEY), _bytes(p, "signature", SIG)))
        grid = r.map("grid", {})
        for k, v in grid.items():
            if isinstance(v, (bytes, list, dict)) or v is None or isinstance(v, float) and v != v:
                raise ProtocolError(f"{r.where('grid')}.{k}: not a scalar")
        return SecAggRoster(dev, rnd, _bytes(r, "session", max_size=64), r.int("threshold", 1, 1 << 20),
                            r.int("x", 1, 1 << 31), peers, dict(grid))
    if kind in ("sa_shares", "sa_inbox"):
        shares = _records(r, "shares", lambda p: PeerShare(
            p.device_id("peer"), _bytes(p, "ct", SEALED), _bytes(p, "hb", max_size=KEY), _bytes(p, "hs", max_size=KEY)))
        if len({s.peer for s in shares}) != len(shares):
            raise ProtocolError(f"{r.where('shares')}: a peer appears twice")
        return (SecAggShares if kind == "sa_shares" else SecAggInbox)(dev, rnd, shares)
    if kind == "sa_masked":
        data = _bytes(r, "data", max_size=r.limits.max_payload_bytes)
        if len(data) % 4:
            raise ProtocolError(f"{r.where('data')}: {len(data)} bytes is not a whole number of uint32")
        return SecAggMasked(dev, rnd, data, _ids(r, "complaints"))
    if kind == "sa_unmask":
        return SecAggUnmask(dev, rnd, _ids(r, "survivors"), _ids(r, "dropped"))
    if kind == "sa_reveal":
        shares = _records(r, "shares", lambda p: RevealedShare(
            p.device_id("of"), p.str("secret", frozenset({"b", "s"})), _bytes(p, "share", SHARE)))
        return SecAggReveal(dev, rnd, shares)
    raise ProtocolError(f"kind: unknown message kind {kind!r}")  # pragma: no cover
