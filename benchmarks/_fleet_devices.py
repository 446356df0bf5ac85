"""The simulated devices of ``fleet_load.py``: one load process's asyncio devices.

Each :class:`SimDevice` is one MQTT connection (``_mqtt_async.AsyncMqtt``) doing what
``edge_client.runtime`` does (see ``fleet_load.py``'s docstring); :class:`ModelSink`
streams a model download and checks it against the one copy per process that
:class:`ModelCopy` decodes. ``load_main`` runs a slice of the fleet and writes its counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np
from _mqtt_async import AsyncMqtt, MqttError

JOB = "load"
MODEL = "fedshift_cnn"  # (--model)
SAMPLES = 100  # each device's num_samples

# --------------------------------------------------------------------------- payloads


def update_tensors(bits: int, model: str = MODEL, seed: int = 0, distinct: int = 4) -> list[tuple]:
    """``distinct`` sets of ASYM-``bits`` ``fedshift_cnn`` update tensors (initial weights
    plus noise), re-used by every device (payloads differ by device id, round and MAC)."""
    from edge_client.codecs import encode
    from edge_client.intnn import init_shared
    from firmware_models import get_spec

    spec = get_spec(model)
    base, names = init_shared(spec, seed), spec.param_names()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(distinct):
        w = [b + rng.normal(0, 0.01, b.shape).astype(np.float32) for b in base]
        out.append(tuple(encode(x, codec="asym", bits=bits, name=n) for x, n in zip(w, names, strict=True)))
    return out


def update_payload(dev: str, key: bytes, round_id: int, tensors: tuple, digest: str, compute_bits: int,
                   compute_s: float) -> bytes:
    from edge_client.auth import sign
    from edge_client.protocol import Update, encode_message

    return sign(encode_message(Update(dev, round_id, SAMPLES, compute_bits, "weights", tensors, model_digest=digest,
                                      train_seconds=compute_s)), key)



# --------------------------------------------------------------------------- load process


class ModelCopy:
    """One load process's checked copy of each model message (by topic, length and first
    4 KiB, which hold its round): the first device to receive it buffers, decodes and
    checks its digest; the others compare."""

    SAMPLE = 4096

    def __init__(self) -> None:
        self.ref: dict[tuple[str, int, bytes], asyncio.Future] = {}

    def samples(self, data: bytes | bytearray) -> tuple[bytes, bytes, bytes]:
        n, s = len(data), self.SAMPLE
        return bytes(data[:s]), bytes(data[n // 2:n // 2 + s]), bytes(data[-s:])

    def reference(self, topic: str, n: int, head: bytes) -> tuple[asyncio.Future, bool]:
        """(the future of the checked copy of this model, whether the caller must make it)."""
        key = (topic, n, head)
        fut = self.ref.get(key)
        if fut is None:
            self.ref = {k: f for k, f in self.ref.items() if k[0] != topic}  # a new model on the topic
            fut = self.ref[key] = asyncio.get_running_loop().create_future()
            return fut, True
        return fut, False


class ModelSink:
    """A device's download of one model message (``AsyncMqtt.on_large``)."""

    def __init__(self, device: SimDevice, topic: str, n: int) -> None:
        self.device, self.topic, self.n = device, topic, n
        self.fut: asyncio.Future | None = None
        self.buf: bytearray | None = None
        self.got = 0
        self.heads: list[bytes] = []
        self.mid = b""
        self.tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        if self.fut is None:  # the first chunk (64 KiB) names the model
            self.fut, owner = self.device.ctx.copies.reference(self.topic, self.n, bytes(chunk[:ModelCopy.SAMPLE]))
            self.buf = bytearray() if owner else None
        if self.buf is not None:
            self.buf += chunk
        else:  # keep only the three samples
            s, start, n = ModelCopy.SAMPLE, self.got, self.n
            if start < s:
                self.heads.append(chunk[:s - start])
            m = n // 2
            if start <= m + s and start + len(chunk) > m:
                self.mid += chunk[max(0, m - start):m + s - start]
            self.tail = (self.tail + chunk)[-s:]
        self.got += len(chunk)

    def done(self) -> None:
        asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        from edge_client.protocol import decode_message, tensors_digest

        copies = self.device.ctx.copies
        if self.buf is not None:
            m = decode_message(bytes(self.buf))
            ok = tensors_digest(m.tensors) == m.digest
            if not self.fut.done():  # (one owner per copy)
                self.fut.set_result((m.round_id, m.digest, copies.samples(self.buf)) if ok else None)
            ref = self.fut.result()
        else:
            ref = await self.fut
            mine = (b"".join(self.heads), bytes(self.mid), bytes(self.tail))
            if ref is not None and mine != ref[2]:
                ref = None
        if ref is None:
            self.device.ctx.stats["bad_models"] += 1
            return
        self.device.model_received(ref[0], ref[1])


class LoadContext:
    """What the devices of one load process share."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.copies = ModelCopy()
        self.tensors = update_tensors(args.codec_bits, args.model)
        self.stats: dict = {"connected": 0, "dropped": 0, "refused": 0, "bad_models": 0, "resent": 0,
                            "acked": {}, "published_at": {}, "errors": []}
        self.decoded: dict[str, tuple[bytes, object]] = {}
        self.connect_slots = asyncio.Semaphore(args.connect_concurrency)
        self.done = asyncio.Event()

    def decode(self, topic: str, payload: bytes):  # -> protocol.Message (one decode per distinct payload)
        from edge_client.protocol import decode_message

        cached = self.decoded.get(topic)
        if cached is not None and cached[0] == payload:
            return cached[1]
        m = decode_message(payload)
        if hasattr(m, "selected"):
            m = (m, frozenset(m.selected))
        self.decoded[topic] = (payload, m)
        return m


class SimDevice:
    """One enrolled device on one connection (see the module docstring)."""

    def __init__(self, ctx: LoadContext, dev: str, password: str, key_hex: str, index: int) -> None:
        from edge_client.protocol import model_variant, topic

        self.ctx, self.id, self.password, self.key = ctx, dev, password, bytes.fromhex(key_hex)
        self.index = index
        a = ctx.args
        self.variant = model_variant(a.compute_bits, "int" if a.compute_bits <= 16 else "torch")
        self.t = {k: topic(JOB, k, dev) for k in ("presence", "hello", "update")}
        self.t_round, self.t_status, self.t_model = topic(JOB, "round"), topic(JOB, "status"), \
            topic(JOB, "model", self.variant)
        self.client = None
        self.model: tuple[int, str] | None = None  # (round, digest) of the last checked model
        self.model_event = asyncio.Event()
        self.announcement = None
        self.sent: dict[int, bytes] = {}
        self.working: set[int] = set()
        self.finished = False

    def _sign(self, msg) -> bytes:
        from edge_client.auth import sign
        from edge_client.protocol import encode_message

        return sign(encode_message(msg), self.key)

    async def run(self) -> None:
        from edge_client.protocol import Hello, Presence

        a, ctx = self.ctx.args, self.ctx
        self.client = AsyncMqtt(a.host, a.port, self.id, username=self.id, password=self.password,
                                will=(self.t["presence"], self._sign(Presence(self.id, False))),
                                keepalive=60, on_message=self.on_message, on_large=self.on_large)
        async with ctx.connect_slots:
            try:
                await self.client.connect()
                hello = Hello(self.id, "load", a.compute_bits, "int" if a.compute_bits <= 16 else "torch",
                              "asym", a.codec_bits, SAMPLES, "fleet-load")
                await self.client.publish(self.t["presence"], self._sign(Presence(self.id, True)), retain=True)
                await self.client.publish(self.t["hello"], self._sign(hello), retain=True)
                subs = [self.t_round, self.t_status] + ([self.t_model] if a.download == "all" else [])
                codes = await self.client.subscribe(subs)
                if any(c & 0x80 for c in codes):
                    raise MqttError(f"{self.id}: subscription refused {codes.hex()}")
            except (TimeoutError, MqttError, OSError) as exc:
                ctx.stats["refused"] += 1
                ctx.stats["errors"].append(f"{self.id}: {exc!r}"[:200])
                await self.client.close()
                return
        ctx.stats["connected"] += 1
        done = asyncio.create_task(ctx.done.wait())
        lost = asyncio.create_task(self.client.closed.wait())
        await asyncio.wait([done, lost], return_when=asyncio.FIRST_COMPLETED)
        if self.client.closed.is_set() and not self.finished:
            ctx.stats["dropped"] += 1
            ctx.stats["errors"].append(f"{self.id}: {self.client.error}"[:200])
        else:
            try:
                await self.client.publish(self.t["presence"], self._sign(Presence(self.id, False)), retain=True,
                                          timeout=30)
            except (TimeoutError, MqttError, OSError):
                pass
            await self.client.disconnect()
        for t in (done, lost):
            t.cancel()

    # ------------------------------------------------------------------ messages

    def on_large(self, topic: str, n: int, _retain: bool):
        return ModelSink(self, topic, n) if topic == self.t_model else None

    def on_message(self, topic: str, payload: bytes, _retain: bool) -> None:
        if not payload:
            return
        try:
            m = self.ctx.decode(topic, payload)
        except Exception as exc:  # noqa: BLE001 - counted, the device carries on
            self.ctx.stats["errors"].append(f"{self.id}: {topic}: {exc!r}"[:200])
            return
        if topic == self.t_round:
            ann, selected = m
            again = self.announcement is not None and self.announcement.round_id == ann.round_id
            self.announcement = ann
            if self.id not in selected:
                return
            if ann.round_id in self.sent and again:  # announced again: send it once more
                self.ctx.stats["resent"] += 1
                asyncio.get_running_loop().create_task(self._publish(ann.round_id, self.sent[ann.round_id]))
            elif ann.round_id not in self.sent and ann.round_id not in self.working:
                self.working.add(ann.round_id)
                asyncio.get_running_loop().create_task(self._train(ann))
        elif topic == self.t_status:
            if m.state == "done":
                self.finished = True
                self.ctx.done.set()
        elif topic == self.t_model:  # a model small enough to come whole
            from edge_client.protocol import tensors_digest

            if tensors_digest(m.tensors) == m.digest:
                self.model_received(m.round_id, m.digest)

    def model_received(self, round_id: int, digest: str) -> None:
        self.model = (round_id, digest)
        self.model_event.set()

    async def _train(self, ann) -> None:
        """Wait for the round's model, then publish the update ``--compute-s`` after the
        announcement arrived (or at once when the model came later than that)."""
        a = self.ctx.args
        t_announced = time.monotonic()
        want = ann.variants.get(self.variant)
        if a.download == "selected":
            await self.client.subscribe([self.t_model])
        while self.model is None or self.model[0] != ann.round_id or self.model[1] != want:
            self.model_event.clear()
            try:
                await asyncio.wait_for(self.model_event.wait(), max(1.0, ann.deadline - time.time()))
            except TimeoutError:
                self.ctx.stats["errors"].append(f"{self.id}: no model for round {ann.round_id}")
                return
        if a.download == "selected":
            await self.client.unsubscribe([self.t_model])
        delay = a.compute_s * random.uniform(1 - a.jitter, 1 + a.jitter)
        await asyncio.sleep(max(0.0, t_announced + delay - time.monotonic()))
        payload = update_payload(self.id, self.key, ann.round_id, self.ctx.tensors[self.index % len(self.ctx.tensors)],
                                 want, a.compute_bits, delay)
        self.sent[ann.round_id] = payload
        self.ctx.stats["published_at"].setdefault(str(ann.round_id), time.time())
        await self._publish(ann.round_id, payload)

    async def _publish(self, round_id: int, payload: bytes) -> None:
        try:
            await self.client.publish(self.t["update"], payload, qos=1)
        except (TimeoutError, MqttError, OSError) as exc:
            self.ctx.stats["errors"].append(f"{self.id}: update of round {round_id}: {exc!r}"[:200])
            return
        acked = self.ctx.stats["acked"].setdefault(str(round_id), [])
        if self.id not in acked:
            acked.append(self.id)


async def load_main(args: argparse.Namespace) -> int:
    rows = json.loads(Path(args.devices_file).read_text())[args.first:args.first + args.count]
    ctx = LoadContext(args)
    devices = [SimDevice(ctx, d, pw, key, args.first + i) for i, (d, pw, key) in enumerate(rows)]
    tasks = [asyncio.create_task(d.run()) for d in devices]
    end = time.monotonic() + args.max_seconds
    last = None
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.5)
        now = (ctx.stats["connected"], ctx.stats["dropped"], sum(len(v) for v in ctx.stats["acked"].values()))
        if now != last:
            print(json.dumps({"connected": now[0], "dropped": now[1], "acked": now[2]}), flush=True)
            last = now
        if time.monotonic() > end:
            ctx.stats["errors"].append("stopped at --max-seconds")
            ctx.done.set()
            await asyncio.sleep(2)
            break
    for t in tasks:
        t.cancel()
    ctx.stats["held"] = ctx.stats["connected"] - ctx.stats["dropped"]
    ctx.stats["errors"] = ctx.stats["errors"][:50]
    Path(args.stats).write_text(json.dumps(ctx.stats))
    return 0
