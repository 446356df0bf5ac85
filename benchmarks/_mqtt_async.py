"""A small MQTT 3.1.1 client over asyncio streams, for holding thousands of connections in
one process (``fleet_load.py``): one socket and one reader task per connection, no thread.

What a device needs and nothing more: CONNECT (client id, username/password, a retained
QoS 1 will, clean session), PUBLISH QoS 0/1 both ways (incoming QoS 1 acknowledged at
once; outgoing QoS 1 awaited until its PUBACK), SUBSCRIBE, keep-alive pings and
DISCONNECT. A large PUBLISH can be streamed in chunks to a sink instead of being held
whole (``on_large``: thousands of devices downloading the same model at once must not
hold one copy each). A lost connection sets :attr:`AsyncMqtt.closed`; there is no
reconnect (the load generator counts a dropped connection as one not held).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK = 1, 2, 3, 4, 8, 9, 10, 11
PINGREQ, PINGRESP, DISCONNECT = 12, 13, 14
#: PUBLISH bodies above this many bytes go to ``on_large`` (when set) in chunks
LARGE = 256 * 1024
CHUNK = 64 * 1024


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def _packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([kind << 4 | flags]) + _varint(len(body)) + body


class MqttError(Exception):
    """The broker refused or dropped the session."""


class AsyncMqtt:
    """One MQTT 3.1.1 session (see the module docstring).

    ``on_message(topic, payload, retain)`` runs in the reader task for every PUBLISH
    received (it must not block; schedule work with ``asyncio.create_task``).
    ``on_large(topic, nbytes, retain)`` may return a sink for a PUBLISH of more than
    :data:`LARGE` bytes: its ``feed(chunk)`` gets the payload in order, then ``done()``
    (None: the payload goes to ``on_message`` whole).
    """

    def __init__(self, host: str, port: int, client_id: str, *, username: str | None = None,
                 password: str | None = None, will: tuple[str, bytes] | None = None, keepalive: int = 60,
                 on_message: Callable[[str, bytes, bool], None] | None = None,
                 on_large: Callable[[str, int, bool], object] | None = None) -> None:
        self.host, self.port = host, port
        self.client_id = client_id
        self.username, self.password = username, password
        self.will = will
        self.keepalive = keepalive
        self.on_message = on_message or (lambda _t, _p, _r: None)
        self.on_large = on_large
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self.closed = asyncio.Event()
        self.error = ""

    async def connect(self, timeout: float = 30.0) -> None:
        """Open the socket, CONNECT, await the CONNACK (MqttError when refused)."""
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=1 << 16), timeout)
        flags = 0x02  # clean session
        payload = _str(self.client_id)
        if self.will is not None:
            flags |= 0x04 | (1 << 3) | 0x20  # will, QoS 1, retained
            payload += _str(self.will[0]) + _str(self.will[1])
        if self.username is not None:
            flags |= 0x80
            payload += _str(self.username)
        if self.password is not None:
            flags |= 0x40
            payload += _str(self.password)
        self._writer.write(_packet(CONNECT, 0, _str("MQTT") + bytes([4, flags]) + struct.pack("!H", self.keepalive)
                                   + payload))
        kind, _, body = await asyncio.wait_for(self._read_packet(), timeout)
        if kind != CONNACK or len(body) < 2 or body[1] != 0:
            raise MqttError(f"{self.client_id}: connect refused (CONNACK {body.hex()})")
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._ping_loop())]

    async def _read_head(self) -> tuple[int, int, int]:
        """(packet type, flags, remaining length)."""
        r = self._reader
        assert r is not None
        head = await r.readexactly(1)
        n, shift = 0, 0
        while True:
            b = (await r.readexactly(1))[0]
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
        return head[0] >> 4, head[0] & 0x0F, n

    async def _read_packet(self) -> tuple[int, int, bytes]:
        kind, flags, n = await self._read_head()
        assert self._reader is not None
        return kind, flags, (await self._reader.readexactly(n) if n else b"")

    async def _read_publish(self, flags: int, n: int) -> None:
        r = self._reader
        assert r is not None
        tlen = struct.unpack("!H", await r.readexactly(2))[0]
        topic = (await r.readexactly(tlen)).decode()
        qos, left = (flags >> 1) & 3, n - 2 - tlen
        mid = b""
        if qos:
            mid = await r.readexactly(2)
            left -= 2
        sink = self.on_large(topic, left, bool(flags & 1)) if self.on_large is not None and left > LARGE else None
        if sink is None:
            payload = await r.readexactly(left) if left else b""
        else:
            while left:
                chunk = await r.readexactly(min(CHUNK, left))
                left -= len(chunk)
                sink.feed(chunk)  # type: ignore[attr-defined]
        if qos:
            self._send(_packet(PUBACK, 0, mid))
        if sink is None:
            self.on_message(topic, payload, bool(flags & 1))
        else:
            sink.done()  # type: ignore[attr-defined]

    async def _read_loop(self) -> None:
        try:
            while True:
                kind, flags, n = await self._read_head()
                if kind == PUBLISH:
                    await self._read_publish(flags, n)
                    continue
                body = await self._reader.readexactly(n) if n else b""  # type: ignore[union-attr]
                if kind in (PUBACK, SUBACK, UNSUBACK):
                    fut = self._waiting.pop(struct.unpack_from("!H", body)[0], None)
                    if fut is not None and not fut.done():
                        fut.set_result(body[2:])
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.error = self.error or f"connection lost ({type(exc).__name__})"
        finally:
            self._fail_waiting()
            self.closed.set()

    async def _ping_loop(self) -> None:
        while not self.closed.is_set():
            await asyncio.sleep(self.keepalive * 0.7)
            self._send(_packet(PINGREQ, 0, b""))

    def _fail_waiting(self) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(MqttError(f"{self.client_id}: {self.error or 'closed'}"))
        self._waiting.clear()

    def _send(self, data: bytes) -> None:
        w = self._writer
        if w is not None and not w.is_closing():
            w.write(data)

    def _mid(self) -> tuple[int, asyncio.Future]:
        self._next_id = self._next_id % 65535 + 1
        fut = asyncio.get_running_loop().create_future()
        self._waiting[self._next_id] = fut
        return self._next_id, fut

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      timeout: float = 120.0) -> None:
        """Publish; for QoS 1 return once the broker's PUBACK arrived (MqttError when the
        connection went first, TimeoutError after ``timeout`` s)."""
        if self.closed.is_set():
            raise MqttError(f"{self.client_id}: {self.error or 'closed'}")
        flags = (qos << 1) | (1 if retain else 0)
        if not qos:
            self._send(_packet(PUBLISH, flags, _str(topic) + payload))
            return
        mid, fut = self._mid()
        self._send(_packet(PUBLISH, flags, _str(topic) + struct.pack("!H", mid) + payload))
        assert self._writer is not None
        await self._writer.drain()
        await asyncio.wait_for(fut, timeout)

    async def subscribe(self, filters: list[str], timeout: float = 60.0) -> bytes:
        """Subscribe to ``filters`` with QoS 1; the SUBACK's return codes (0x80: refused)."""
        mid, fut = self._mid()
        body = struct.pack("!H", mid) + b"".join(_str(f) + b"\x01" for f in filters)
        self._send(_packet(SUBSCRIBE, 0x02, body))
        return await asyncio.wait_for(fut, timeout)

    async def unsubscribe(self, filters: list[str], timeout: float = 60.0) -> None:
        """Stop receiving ``filters``."""
        mid, fut = self._mid()
        self._send(_packet(UNSUBSCRIBE, 0x02, struct.pack("!H", mid) + b"".join(_str(f) for f in filters)))
        await asyncio.wait_for(fut, timeout)

    async def disconnect(self) -> None:
        """DISCONNECT (the will is not published) and close the socket."""
        self._send(_packet(DISCONNECT, 0, b""))
        await self.close()

    async def close(self) -> None:
        """Close the socket without DISCONNECT (the broker publishes the will)."""
        for t in self._tasks:
            t.cancel()
        w = self._writer
        if w is not None:
            w.close()
            try:
                await w.wait_closed()
            except (ConnectionError, OSError):
                pass
        self.closed.set()
