"""A device's identity: its credentials file and the MAC on everything it publishes.

**Credentials file.** ``fedbit enroll`` writes one TOML file per device (mode 0600) that
``fedbit-edge run --credentials FILE`` reads: the job, the device id (= MQTT client id =
username), the broker URL, the password, the device's MAC key and, when the broker speaks
TLS, the job CA, the device's client certificate and its key (PEM text). Secrets live only
in that file (or in environment variables), never on a command line or in a log;
:func:`load_credentials` refuses a file that others may read (as ssh does with keys).

**Update MAC.** Every message a device publishes (hello, presence, update) ends with a
``"mac": bin(28)`` entry: a fresh random 96-bit nonce, then the AES-256-GMAC tag, under
the device's own key, of every byte before the tag. Readers without keys ignore it; the
coordinator refuses a message whose tag does not verify, so a device that can publish on
another's topic still cannot be counted in its name. Why GMAC, its forgery bound and its
cost: docs/security.md#the-device-mac.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_client.compat import tomllib
from edge_client.errors import ConfigError, ProtocolError

if TYPE_CHECKING:  # pragma: no cover
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from edge_client.transport.base import Transport

#: bytes of a MAC key (AES-256), of the nonce and of the GMAC tag
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: bytes of the "mac" entry's value: nonce, then tag
MAC_BYTES = NONCE_BYTES + TAG_BYTES
#: the map entry that carries the MAC: fixstr "mac", then bin8 of 28 bytes
MAC_TAG = b"\xa3mac\xc4" + bytes([MAC_BYTES])
_TAIL = len(MAC_TAG) + MAC_BYTES


# --------------------------------------------------------------------------- MAC


def _map_header(payload: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(header length, entry count, format byte) of a msgpack map at the payload's start;
    ProtocolError when it is not a map."""
    if not payload:
        raise ProtocolError("payload: empty")
    b = payload[0]
    if 0x80 <= b <= 0x8F:
        return 1, b & 0x0F, 0x80
    if b == 0xDE and len(payload) >= 3:
        return 3, int.from_bytes(payload[1:3], "big"), 0xDE
    if b == 0xDF and len(payload) >= 5:
        return 5, int.from_bytes(payload[1:5], "big"), 0xDF
    raise ProtocolError("payload: not a msgpack map")


def _header(n: int, fmt: int) -> bytes:
    if fmt == 0x80 and n <= 15:
        return bytes([0x80 | n])
    if fmt in (0x80, 0xDE) and n <= 0xFFFF:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def has_mac(payload: bytes | bytearray | memoryview) -> bool:
    """Whether the payload ends with a ``"mac"`` entry (not whether it verifies)."""
    return len(payload) > _TAIL and bytes(payload[-_TAIL:-MAC_BYTES]) == MAC_TAG


def strip_mac(payload: bytes) -> bytes:
    """The payload without its ``"mac"`` entry (unchanged when it has none)."""
    if not has_mac(payload):
        return payload
    hlen, n, fmt = _map_header(payload)
    if n < 1:
        raise ProtocolError("payload: a mac entry in an empty map")
    return _header(n - 1, fmt) + payload[hlen:-_TAIL]


def _gmac(key: bytes) -> AESGCM:
    """The AES-256-GCM object of ``key`` (``cryptography``, imported on first use)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def sign(payload: bytes, key: bytes) -> bytes:
    """``payload`` (one msgpack map) with its ``"mac"`` entry (re)computed under ``key``
    with a fresh nonce. An existing mac entry is replaced."""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"mac key: {len(key)} bytes, expected {KEY_BYTES}")
    body = strip_mac(payload)
    hlen, n, fmt = _map_header(body)
    head = b"".join((_header(n + 1, fmt), memoryview(body)[hlen:], MAC_TAG, os.urandom(NONCE_BYTES)))
    # (AESGCM.encrypt of an empty plaintext returns just the tag)
    return head + _gmac(key).encrypt(head[-NONCE_BYTES:], b"", head)


def verify(payload: bytes | bytearray | memoryview, key: bytes) -> bool:
    """Whether ``payload`` ends with a ``"mac"`` entry that verifies under ``key`` (the
    tag compared in constant time by OpenSSL; the payload is not parsed)."""
    if not has_mac(payload) or len(key) != KEY_BYTES:
        return False
    from cryptography.exceptions import InvalidTag

    mv = memoryview(payload)
    nonce = bytes(mv[-MAC_BYTES:-TAG_BYTES])
    try:
        _gmac(key).decrypt(nonce, bytes(mv[-TAG_BYTES:]), mv[:-TAG_BYTES])
    except InvalidTag:
        return False
    return True


class SignedTransport:
    """A :class:`~edge_client.transport.Transport` whose every publish is signed with
    ``key`` (what the device loop publishes, outbox re-sends included). Everything else
    is the wrapped transport's; build the wrapped one from :func:`signed_session`."""

    def __init__(self, inner: Transport, key: bytes) -> None:
        self._inner = inner
        self._key = key

    def publish(self, topic: str, payload: bytes, **kw: Any) -> bool:
        return self._inner.publish(topic, sign(payload, self._key), **kw)

    def close(self, clear_will: tuple[str, bytes] | None = None) -> None:
        if clear_will is not None:
            clear_will = (clear_will[0], sign(clear_will[1], self._key))
        self._inner.close(clear_will=clear_will)

    def __getattr__(self, name: str) -> Any:  # the wrapped transport's, whatever it is
        return getattr(self._inner, name)


def signed_session(key: bytes, will: tuple[str, bytes] | None = None,
                   birth: list[tuple[str, bytes, bool]] | None = None, **kw: Any) -> dict[str, Any]:
    """A device's session spec (``DeviceRuntime.session_spec``) with its last-will and
    birth messages signed, for the transport constructor."""
    return kw | {"will": None if will is None else (will[0], sign(will[1], key)),
                 "birth": [(t, sign(p, key), r) for t, p, r in (birth or [])]}


def signing_connector(connect: Callable[..., Transport], key: bytes
                      ) -> Callable[..., SignedTransport]:
    """``connect(**session_spec)`` -> a transport whose will, birth messages and publishes
    are all signed with ``key``."""

    def signed(**spec: Any) -> SignedTransport:
        return SignedTransport(connect(**signed_session(key, **spec)), key)

    return signed


# --------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Credentials:
    """What one enrolled device (or the coordinator) needs to join a job.

    ``mac_key`` is hex (32 bytes); ``ca``/``cert``/``key`` are PEM text (empty without
    TLS); ``max_samples`` is the sample count the device was enrolled with (0: none
    declared; the coordinator bounds ``num_samples`` by it).
    """

    job: str
    device_id: str
    broker: str
    username: str
    password: str
    mac_key: str = ""
    max_samples: int = 0
    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def mac_key_bytes(self) -> bytes:
        return bytes.fromhex(self.mac_key)

    def to_toml(self) -> str:
        """The file's text (secrets included: write it with mode 0600)."""
        lines = ["# fedbit credentials: secret. Keep this file mode 0600 and off the command line.",
                 "# fedbit-edge run --credentials THIS_FILE --profile ... --data ..."]
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int):
                lines.append(f"{f.name} = {v}")
            elif "\n" in v:
                if "'''" in v:
                    raise ConfigError(f"credentials: {f.name} holds ''' ")
                lines.append(f"{f.name} = '''\n{v}'''")
            else:
                lines.append(f"{f.name} = {json.dumps(v)}")
        text = "\n".join(lines) + "\n"
        if _from_map(tomllib.loads(text), "<generated>") != self:  # pragma: no cover - a bug
            raise ConfigError("credentials: the generated file does not read back")
        return text


def _from_map(data: dict[str, Any], where: str) -> Credentials:
    from edge_client.protocol import valid_id  # the wire's id rule
    from edge_client.transport.mqtt import parse_broker_url

    known = {f.name for f in fields(Credentials)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}")
    for name in ("job", "device_id", "broker", "username", "password"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise ConfigError(f"{where}: {name}: missing or not a non-empty string")
    for name in ("job", "device_id"):
        if not valid_id(data[name]):
            raise ConfigError(f"{where}: {name}: {data[name]!r} is not a valid id ([A-Za-z0-9._-]+)")
    parse_broker_url(data["broker"])
    mac = data.get("mac_key", "")
    if not isinstance(mac, str) or (mac and (len(mac) != 2 * KEY_BYTES
                                             or any(c not in "0123456789abcdef" for c in mac))):
        raise ConfigError(f"{where}: mac_key: expected {2 * KEY_BYTES} lowercase hex digits")
    ms = data.get("max_samples", 0)
    if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= 1 << 40:
        raise ConfigError(f"{where}: max_samples: expected an integer in [0, 2^40]")
    for name in ("ca", "cert", "key"):
        v = data.get(name, "")
        if not isinstance(v, str) or (v and "-----BEGIN" not in v):
            raise ConfigError(f"{where}: {name}: expected PEM text")
    if bool(data.get("cert")) != bool(data.get("key")):
        raise ConfigError(f"{where}: cert and key come together")
    return Credentials(**data)


def load_credentials(path: str | Path, *, check_mode: bool = True) -> Credentials:
    """Read a credentials file; ConfigError naming the file (and key) when it is missing,
    malformed, or readable by anyone but its owner (``check_mode``)."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read credentials ({exc.strerror or exc})") from None
    if check_mode and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{p}: credentials readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"chmod 600 {p}")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: not a TOML credentials file ({exc})") from None
    return _from_map(data, str(p))


def write_private(path: str | Path, text: str | bytes) -> Path:
    """Write ``text`` to ``path`` with mode 0600 from the start (never briefly readable by
    others), atomically (tmp + fsync + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return p


def tls_files(creds: Credentials, directory: str | Path) -> tuple[str | None, str | None, str | None]:
    """Write the credentials' PEM text to ``directory`` (mode 0600 files) for the TLS
    library, which wants paths: (ca file, cert file, key file), None for what is absent."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    out: list[str | None] = []
    for name, text in (("ca.pem", creds.ca), ("cert.pem", creds.cert), ("key.pem", creds.key)):
        out.append(str(write_private(d / name, text)) if text else None)
    return out[0], out[1], out[2]


def new_mac_key() -> str:
    """A fresh random MAC key, hex."""
    return os.urandom(KEY_BYTES).hex()

