"""The round loop: select, announce, publish models, collect, aggregate, evaluate, checkpoint.

:class:`Coordinator` speaks only to a :class:`~coordinator.fleet.Fleet`. One round:

1. wait (bounded by ``presence_timeout_s``) until ``min_devices`` devices are present
   (retained hello + presence); select ``clamp(ceil(C * present), min, max)`` of them with
   the seeded selection RNG;
2. build one model variant per bitwidth group among the selected: ``float32`` (the shared
   weights) and ``int<s>`` = ``from_shared(W, s)`` sent with the ``int`` codec on the
   storage grid (ALGORITHMS.md §2); save the round plan; publish the models (retained),
   then the announcement (retained: id, selected, deadline, variant digests, hparams);
3. collect until ``quorum`` of the selected answered or the deadline passed. Each update
   is checked (size, msgpack/fields, topic id == payload id, round, selection, duplicate,
   shapes), decoded to the shared domain, streamed into the strategy (which rejects
   NaN/Inf and wrong shapes before touching its sums), persisted to the inbox, then acked. Rejected messages are acked too (never redelivered),
   logged with their reason and counted. Stragglers past the deadline are excluded and
   counted; the round never waits past its deadline;
4. ``strategy.finish()`` -> new global weights (and per-group weights), evaluation on the
   held-out set, atomic checkpoint, one metrics line, retained status.

``run(resume=True)`` continues from the checkpoint of the last completed round. When the
coordinator died inside a round, that round's plan (same selection, same model digests)
is re-announced with a fresh deadline and the updates already in its inbox are replayed,
so every acked update is counted exactly once and no round is repeated or skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from coordinator.buffers import LayerBufferPool
from coordinator.commit import AckCommitter
from coordinator.fleet import Fleet, Inbound
from coordinator.state import Checkpoint, RoundPlan, RunState
from edge_client.errors import ConfigError, FedbitError, ProtocolError
from edge_client.protocol import (
    DEFAULT_LIMITS,
    EncodedTensor,
    Hello,
    Limits,
    ModelMessage,
    Presence,
    RoundAnnouncement,
    Status,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    tensors_digest,
    topic,
)

log = logging.getLogger("fedbit.server")

Evaluator = Callable[[list[np.ndarray]], tuple[float, float]]  # weights -> (loss, accuracy)


class RoundError(FedbitError, RuntimeError):
    """A round cannot start (not enough devices within the presence timeout)."""


@dataclass
class ServerConfig:
    """Round-loop settings (times in seconds).

    - ``fraction``: C, the fraction of present devices selected per round, clamped to
      ``[min_devices, max_devices]``;
    - ``min_present``: devices that must be present before a round starts (at least
      ``min_devices``; waited for up to ``presence_timeout_s``);
    - ``quorum``: the fraction of the selected whose accepted updates close a round early;
    - ``min_updates``: fewer accepted at the deadline keep the previous global model;
    - ``hparams``: local training hyper-parameters announced to devices;
    - ``strategy``/``strategy_params``: recorded in metrics and checkpoints.
    """

    job: str = "default"
    model: str = "digits_cnn"
    rounds: int = 3
    strategy: str = "fedavg"
    strategy_params: dict[str, Any] = field(default_factory=dict)
    fraction: float = 1.0
    min_devices: int = 1
    max_devices: int = 10_000
    min_present: int = 0
    quorum: float = 1.0
    min_updates: int = 1
    round_timeout_s: float = 60.0
    presence_timeout_s: float = 120.0
    hparams: dict[str, Any] = field(default_factory=lambda: {"epochs": 1, "batch": 32})
    seed: int = 0
    limits: Limits = DEFAULT_LIMITS

    def validate(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"rounds: must be >= 1, got {self.rounds}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction: must be in (0, 1], got {self.fraction}")
        if not 0.0 < self.quorum <= 1.0:
            raise ConfigError(f"quorum: must be in (0, 1], got {self.quorum}")
        if self.min_devices < 1 or self.max_devices < self.min_devices:
            raise ConfigError(f"min/max devices: need 1 <= {self.min_devices} <= {self.max_devices}")
        if self.round_timeout_s <= 0 or self.presence_timeout_s <= 0:
            raise ConfigError("round_timeout_s and presence_timeout_s must be > 0")
        v = self.limits.max_abs_value
        if not (isinstance(v, int | float) and 0.0 < v <= MAX_ABS_VALUE_CAP):
            raise ConfigError(f"limits.max_abs_value: must be in (0, {MAX_ABS_VALUE_CAP:g}], got {v!r} "
                              f"(larger values let the float32 sums overflow)")


#: The largest allowed ``Limits.max_abs_value``: with ``num_samples <= 2**40`` as weights and
#: at most 10**5 updates a round, a float32 sum then stays below 1.2e38 (finite).
MAX_ABS_VALUE_CAP = 1e21


@dataclass
class DeviceInfo:
    """What the coordinator knows about a device."""

    hello: Hello | None = None
    online: bool = False


def variant_of(hello: Hello) -> str:
    """Model variant of a device: ``float32`` or ``int<s>`` (as in ``edge_client.runtime``)."""
    return "float32" if hello.trainer == "torch" or hello.compute_bits >= 32 else f"int{hello.compute_bits}"


def model_tensors(weights: list[np.ndarray], names: list[str], variant: str) -> tuple[EncodedTensor, ...]:
    """The wire tensors of one model variant (float32, or the int codec on the grid)."""
    if variant == "float32":
        return tuple(float32_tensor(w, n) for w, n in zip(weights, names, strict=True))
    from edge_client.codecs import encode
    from edge_client.intnn import from_shared, storage_grid_bits

    bits = int(variant[3:])
    ints = from_shared(weights, bits)
    return tuple(encode(q, codec="int", bits=storage_grid_bits(bits), name=n)
                 for q, n in zip(ints, names, strict=True))


def classify(exc: ProtocolError) -> str:
    """A short reason label for metrics from a ProtocolError's message."""
    text = str(exc)
    if "NaN" in text or "not finite" in text or "non-finite" in text:
        return "nonfinite"
    if "exceed" in text and text.startswith("payload"):
        return "oversized"
    if ".shape" in text or " layers, model " in text or "decoded shape" in text:
        return "wrong_shape"
    if "max_abs_value" in text:
        return "out_of_range"
    return "malformed"


class Coordinator:
    """The round loop against a :class:`Fleet`; see the module docstring.

    Args:
        cfg: the loop settings.
        fleet: where devices are.
        strategy: a ``coordinator.strategies`` strategy (``begin_round``/``accept``/
            ``finish``/``server_state``/``state_dict``/``load_state_dict``).
        state: the run directory.
        evaluator: ``weights -> (loss, accuracy)`` on the held-out set (None: skipped).
        init_weights: the initial shared weights (``intnn.init_shared(spec, seed)``).
        on_event: progress callback ``(event, fields)``; events ``round_start``,
            ``update``, ``reject``, ``round_end``, ``waiting``.
    """

    def __init__(self, cfg: ServerConfig, fleet: Fleet, strategy: Any, state: RunState, *,
                 evaluator: Evaluator | None, init_weights: list[np.ndarray],
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 logger: logging.Logger | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.fleet = fleet
        self.strategy = strategy
        self.state = state
        self.evaluator = evaluator
        self.on_event = on_event or (lambda _e, _f: None)
        self.log = logger or log
        from firmware_models import get_spec

        self.spec = get_spec(cfg.model)
        self.names = self.spec.param_names()
        self.shapes = [tuple(s) for s in self.spec.param_shapes()]
        #: decode targets of float32-decoding codecs, reused once the strategy let go
        self._decode_buffers = LayerBufferPool(self.shapes)
        if [tuple(w.shape) for w in init_weights] != self.shapes:
            raise ConfigError(f"initial weights do not match model {cfg.model}")
        self.weights = [np.asarray(w, dtype=np.float32).copy() for w in init_weights]
        self.group_weights: dict[int, list[np.ndarray]] = {}
        self.devices: dict[str, DeviceInfo] = {}
        self.rng = np.random.default_rng(cfg.seed)
        self.completed = 0
        self.run_id = f"{int(time.time())}-{os.getpid()}"
        self.totals: Counter[str] = Counter()
        self.history: list[dict[str, Any]] = []
        # per-round
        self._round: int | None = None
        self._selected: set[str] = set()
        self._accepted: dict[str, float] = {}
        self._counts: Counter[str] = Counter()
        self._coord_s = 0.0
        self._coord_cpu = 0.0
        #: most messages handled before they go to the committer, which syncs every batch
        #: queued since its last sync at once (group commit). Small batches let the sync
        #: of one overlap the decoding of the next (fedshift_cnn bursts: 8 -> ~1.1x of 64)
        self.batch_max = 8
        #: appends the accepted updates to the inbox, syncs, then acks, in two background
        #: threads while ``pump`` goes on (the append's checksum and write release the GIL)
        self.committer: AckCommitter[Inbound, tuple[int, str, bytes]] = AckCommitter(
            lambda: self.state.inbox_sync(), lambda m: self.fleet.ack(m),
            persist=lambda rec: self.state.inbox_append(*rec))
        #: accepted updates of the batch being handled, to persist before its acks
        self._to_persist: list[tuple[int, str, bytes]] = []

    # ------------------------------------------------------------------ presence

    def present(self) -> list[str]:
        """Ids of devices that said hello and are online, sorted."""
        return sorted(d for d, i in self.devices.items() if i.online and i.hello is not None)

    def _reject(self, msg: Inbound, reason: str, detail: str) -> None:
        self._counts[f"rejected_{reason}"] += 1
        self.totals[f"rejected_{reason}"] += 1
        self.log.warning("rejected %s from %r: %s (%s)", msg.kind, msg.topic_id, reason, detail,
                         extra={"event": "reject", "reason": reason, "device": msg.topic_id,
                                "round": self._round})
        self.on_event("reject", {"reason": reason, "device": msg.topic_id, "detail": detail})

    def _drop(self, msg: Inbound, reason: str, detail: str) -> None:
        self._counts[f"dropped_{reason}"] += 1
        self.totals[f"dropped_{reason}"] += 1
        self.log.info("dropped update from %r: %s (%s)", msg.topic_id, reason, detail,
                      extra={"event": "drop", "reason": reason, "device": msg.topic_id,
                             "round": self._round})

    def handle(self, msg: Inbound) -> None:
        """Handle one received message and acknowledge it (never raises ProtocolError)."""
        self.handle_batch([msg])

    def handle_batch(self, batch: list[Inbound], *, background: bool = False) -> None:
        """Handle messages, make the accepted updates durable with one sync (group
        commit), then acknowledge every message (rejected ones too: never redelivered).
        Nothing is acked when persisting fails (the exception propagates).

        ``background``: the appends, the sync and the acks are left to :attr:`committer`
        (same order, same rule); the caller must :meth:`AckCommitter.drain` it before the
        round ends.
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        self._to_persist = []
        try:
            for msg in batch:
                if msg.kind == "update":
                    self._handle_update(msg)
                elif msg.kind in ("hello", "presence"):
                    self._handle_device(msg)
                else:
                    self._reject(msg, "bad_topic", msg.raw.topic)
            records, self._to_persist = self._to_persist, []
            if background:
                self.committer.submit(batch, records)
                return
            self.committer.drain()  # earlier batches' appends and acks come first
            for rec in records:
                self.state.inbox_append(*rec)
            self.state.inbox_sync()
            for msg in batch:
                self.fleet.ack(msg)
        finally:
            self._coord_s += time.perf_counter() - t0
            self._coord_cpu += time.thread_time() - c0

    def _handle_device(self, msg: Inbound) -> None:
        if not msg.payload:
            return  # a cleared retained message
        try:
            m = decode_message(msg.payload, self.cfg.limits)
        except ProtocolError as exc:
            self._reject(msg, classify(exc), str(exc))
            return
        if not isinstance(m, Hello | Presence) or m.KIND != msg.kind:
            self._reject(msg, "wrong_kind", f"{m.KIND} on a {msg.kind} topic")
            return
        if m.device_id != msg.topic_id:
            self._reject(msg, "spoofed", f"topic id {msg.topic_id!r} != payload id {m.device_id!r}")
            return
        info = self.devices.setdefault(m.device_id, DeviceInfo())
        if isinstance(m, Hello):
            if m.compute_bits not in (2, 4, 6, 8, 12, 16, 32) or (
                    m.trainer == "int" and m.compute_bits > 16):
                self._reject(msg, "malformed", f"unsupported compute_bits {m.compute_bits}")
                return
            info.hello = m
            info.online = True
        else:
            info.online = m.online

    def _encoded_update(self, m: Update) -> Any:
        """Wire update -> ``EncodedUpdate`` (layer count, shapes and the magnitude of the
        values checked, nothing decoded; integer devices' bitwidth as sent, float devices'
        as 32). Every codec but float32 counts as lossy (FedShift's inferior set also
        includes every integer device)."""
        from coordinator.strategies.decode import integer_scale, is_lossy, sigma_loc_of
        from coordinator.strategies.types import EncodedUpdate
        from edge_client.codecs import max_abs

        if len(m.tensors) != len(self.shapes):
            raise ProtocolError(f"tensors: {len(m.tensors)} layers, model {self.cfg.model} has {len(self.shapes)}")
        for i, (t, shape) in enumerate(zip(m.tensors, self.shapes, strict=True)):
            if tuple(t.shape) != shape:
                raise ProtocolError(f"tensors[{i}].shape: {list(t.shape)} != {list(shape)}")
        bits = m.compute_bits if m.compute_bits <= 16 else 32
        limit = self.cfg.limits.max_abs_value
        for i, t in enumerate(m.tensors):
            # from the header for every codec but float32/float16 (one pass over the bits)
            try:
                bound = max_abs(t)
            except ProtocolError:
                raise
            except Exception as exc:  # noqa: BLE001 - a codec failing on received bytes
                raise ProtocolError(f"tensors[{i}]: cannot read ({type(exc).__name__}: {exc})") from None
            if t.dtype in ("int8", "int16") and bits < 32:
                bound *= integer_scale(bits)  # the integers' value in the shared domain
            if not bound <= limit:
                raise ProtocolError(f"tensors[{i}]: values up to |v| = {bound:.4g} exceed the "
                                    f"limit max_abs_value = {limit:.4g}")
        return EncodedUpdate(m.device_id, m.num_samples, m.tensors, m.content, bits,
                             is_lossy(m.tensors), sigma_loc_of(m.tensors))

    def _takes_encoded(self, eu: Any) -> bool:
        takes = getattr(self.strategy, "takes_encoded", None)
        return bool(takes is not None and takes(eu))

    def _decode_update(self, eu: Any) -> Any:
        """Checked ``EncodedUpdate`` -> ``ClientUpdate`` in the shared domain (the path
        for updates the strategy cannot fold encoded); ProtocolError if unusable.

        Integer tensors (codec ``int``) are mapped exactly to ``q / 2^(max(s, 8) - 1)``
        (ALGORITHMS.md §2); float ones are decoded into reused buffers.
        """
        from coordinator.strategies.types import ClientUpdate
        from edge_client.codecs import decode, get_codec
        from edge_client.runtime import decode_tensor

        bits = eu.compute_bits
        bufs = self._decode_buffers.take()
        weights = []
        for i, (t, shape) in enumerate(zip(eu.tensors, self.shapes, strict=True)):
            try:
                # float32 results straight into a reused buffer; integer ones the old way
                a = decode(t, out=bufs[i]) if t.dtype == "float32" else np.asarray(decode_tensor(t))
            except ProtocolError:
                raise
            except Exception as exc:  # noqa: BLE001 - a codec failing on received bytes
                raise ProtocolError(f"tensors[{i}]: cannot decode ({type(exc).__name__}: {exc})") from None
            if a.shape != shape:
                raise ProtocolError(f"tensors[{i}]: decoded shape {list(a.shape)} != {list(shape)}")
            if a.dtype.kind in "iu":
                if bits >= 32:
                    raise ProtocolError(f"tensors[{i}]: integer tensor from a float device")
                a = a.astype(np.float32) * np.float32(2.0 ** -(max(bits, 8) - 1))
            weights.append(np.asarray(a, dtype=np.float32))
        # every value already proved finite by the codecs' decode: the strategy need not re-read
        finite = all(get_codec(t.codec).finite_output for t in eu.tensors)
        return ClientUpdate(eu.device_id, eu.num_samples, weights, eu.kind, bits, eu.lossy, eu.sigma_loc,
                            finite=finite)

    def _handle_update(self, msg: Inbound, *, replay: bool = False) -> bool:
        """Validate -> decode into the strategy's sums (fused where the strategy can) ->
        queue for the inbox (``handle_batch`` persists, syncs, then acks). True if accepted."""
        if len(msg.payload) > self.cfg.limits.max_payload_bytes:
            self._reject(msg, "oversized", f"{len(msg.payload)} bytes > {self.cfg.limits.max_payload_bytes}")
            return False
        try:
            m = decode_message(msg.payload, self.cfg.limits)
        except ProtocolError as exc:
            self._reject(msg, classify(exc), str(exc))
            return False
        if not isinstance(m, Update):
            self._reject(msg, "wrong_kind", f"{m.KIND} on an update topic")
            return False
        if m.device_id != msg.topic_id:
            self._reject(msg, "spoofed", f"topic id {msg.topic_id!r} != payload id {m.device_id!r}")
            return False
        r = self._round
        if m.round_id <= self.completed:
            self._drop(msg, "late", f"round {m.round_id} is closed (current {r})")
            return False
        if r is None or m.round_id != r:
            self._reject(msg, "wrong_round", f"round {m.round_id} is not open (current {r})")
            return False
        if m.device_id not in self._selected:
            self._reject(msg, "not_selected", f"{m.device_id} is not selected in round {r}")
            return False
        if m.device_id in self._accepted:
            self._drop(msg, "duplicate", f"round {r} already counted")
            return False
        try:
            eu = self._encoded_update(m)
            fused = self._takes_encoded(eu)
            cu = None if fused else self._decode_update(eu)
        except ProtocolError as exc:
            self._reject(msg, classify(exc), str(exc))
            return False
        try:
            # the strategy checks shapes and finiteness before it changes its sums; an
            # update it can fold straight from the wire is never decoded to float32
            if cu is None:
                self.strategy.accept_encoded(eu)
            else:
                self.strategy.accept(cu)
        except ProtocolError as exc:
            self._reject(msg, classify(exc), f"strategy: {exc}")
            return False
        if not replay:
            # persisted and synced by handle_batch (or its committer), then acked. A crash
            # before the sync leaves the update unacked: the broker redelivers it to the
            # resumed session.
            self._to_persist.append((r, m.device_id, msg.payload))
        self._accepted[m.device_id] = time.monotonic()
        self._counts["accepted"] += 1
        self.on_event("update", {"round": r, "device": m.device_id, "accepted": len(self._accepted),
                                 "selected": len(self._selected)})
        return True

    def pump(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Handle messages until ``time.monotonic() >= until`` or ``stop()``.

        Each batch's sync and acks run in the committer thread while this loop waits for
        the next message; before returning, every handled message is synced and acked
        (that last wait counts as coordinator time).
        """
        cpu0 = self.committer.cpu_seconds
        try:
            while not stop():
                self.committer.check()  # a failed sync or ack stops the loop at once
                left = until - time.monotonic()
                if left <= 0:
                    return
                msg = self.fleet.recv(timeout=min(left, 0.25))
                if msg is None:
                    continue
                batch = [msg]
                while len(batch) < self.batch_max:  # what is already queued joins the batch
                    more = self.fleet.recv(timeout=0)
                    if more is None:
                        break
                    batch.append(more)
                self.handle_batch(batch, background=True)
        finally:
            t0 = time.perf_counter()
            try:
                self.committer.drain()
            finally:
                self._coord_s += time.perf_counter() - t0
                self._coord_cpu += self.committer.cpu_seconds - cpu0

    # ------------------------------------------------------------------ rounds

    def _select(self) -> list[str]:
        cfg = self.cfg
        end = time.monotonic() + cfg.presence_timeout_s
        last_note = 0.0
        need = max(cfg.min_devices, cfg.min_present)
        while len(self.present()) < need:
            if time.monotonic() >= end:
                raise RoundError(f"only {len(self.present())} device(s) present after "
                                 f"{cfg.presence_timeout_s:.0f} s; need {need}")
            if time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                self.on_event("waiting", {"present": len(self.present()), "need": need})
            self.pump(min(end, time.monotonic() + 0.5))
        # let hellos that arrive together settle
        self.pump(time.monotonic() + 0.05)
        present = self.present()
        k = max(cfg.min_devices, min(cfg.max_devices, math.ceil(cfg.fraction * len(present))))
        k = min(k, len(present))
        idx = self.rng.choice(len(present), size=k, replace=False)
        return sorted(present[i] for i in idx)

    def _variants(self, selected: list[str], wanted: set[str] | None = None) -> dict[str, tuple[bytes, str]]:
        """Encoded model messages of the variants the selected devices need (or of
        ``wanted``, the variants a resumed round announced)."""
        r = self._round
        assert r is not None
        if wanted is None:
            wanted = {"float32"}
            for d in selected:
                h = self.devices[d].hello if d in self.devices else None
                if h is not None:
                    wanted.add(variant_of(h))
        server_state = self.strategy.server_state() if hasattr(self.strategy, "server_state") else {}
        lgs = server_state.get("last_global_step") or None
        sigma = server_state.get("sigma_g") or ()
        out = {}
        for v in sorted(wanted):
            bits = 32 if v == "float32" else int(v[3:])
            w = self.group_weights.get(bits, self.weights)
            tensors = model_tensors(w, self.names, v)
            step = tuple(float32_tensor(g, n) for g, n in zip(lgs, self.names, strict=True)) if lgs else ()
            digest = tensors_digest(tensors)
            msg = ModelMessage(round_id=r, variant=v, model=self.cfg.model, tensors=tensors,
                               digest=digest, last_global_step=step,
                               sigma_g=tuple(float(s) for s in sigma))
            out[v] = (encode_message(msg, self.cfg.limits), digest)
        return out

    def _announce(self, plan: RoundPlan, payloads: dict[str, tuple[bytes, str]]) -> None:
        """Models first, then the announcement and the status: one pipelined batch of
        retained QoS 1 publishes (MQTT keeps their order). Their PUBACKs are waited for
        (``fleet.flush()``, re-sending what was not acknowledged) once the round's updates
        are collected: devices act on the messages, not on our PUBACKs, so that wait is
        not on the round's critical path."""
        ann = RoundAnnouncement(job=self.cfg.job, round_id=plan.round_id, model=self.cfg.model,
                                selected=tuple(plan.selected), deadline=plan.deadline,
                                variants=dict(plan.variants), hparams=dict(plan.hparams))
        items = [(topic(self.cfg.job, "model", v), p) for v, (p, _) in payloads.items()]
        items.append((topic(self.cfg.job, "round"), encode_message(ann, self.cfg.limits)))
        items.append((topic(self.cfg.job, "status"),
                      encode_message(Status("round", plan.round_id, f"round {plan.round_id}"))))
        self.fleet.publish_retained_nowait(items)

    def run_round(self, r: int, plan: RoundPlan | None = None) -> dict[str, Any]:
        """Run round ``r`` (``plan`` given: resume it) and return its metrics record."""
        cfg = self.cfg
        t_start = time.monotonic()
        self._round = r
        self._accepted = {}
        self._counts = Counter()
        self._coord_s = 0.0
        self._coord_cpu = 0.0
        resumed = plan is not None
        if plan is None:
            selected = self._select()
        else:
            selected = list(plan.selected)
            if plan.rng_state:
                self.rng.bit_generator.state = json.loads(plan.rng_state)
        self._selected = set(selected)
        tc, cc = time.perf_counter(), time.thread_time()
        payloads = self._variants(selected, set(plan.variants) if plan is not None else None)
        digests = {v: d for v, (_, d) in payloads.items()}
        if plan is not None and digests != plan.variants:
            raise ConfigError(f"round {r}: the resumed model differs from the announced one")
        hparams = dict(cfg.hparams) | {"run": self.run_id}
        plan = RoundPlan(round_id=r, selected=selected, deadline=time.time() + cfg.round_timeout_s,
                         variants=digests, hparams=hparams, started_at=time.time(),
                         rng_state=json.dumps(self.rng.bit_generator.state))
        self.state.save_plan(plan)
        self.strategy.begin_round(r, [w.copy() for w in self.weights])
        replayed = 0
        for dev, payload in self.state.inbox_items(r):
            fake = Inbound("update", dev, payload, time.monotonic(), None)  # type: ignore[arg-type]
            if self._handle_update(fake, replay=True):
                replayed += 1
        self._announce(plan, payloads)
        announce_s = time.perf_counter() - tc
        self._coord_s += announce_s
        self._coord_cpu += time.thread_time() - cc
        self.on_event("round_start", {"round": r, "selected": selected, "resumed": resumed,
                                      "replayed": replayed, "deadline_s": cfg.round_timeout_s})
        self.log.info("round %d: selected %d device(s)%s", r, len(selected),
                      f", resumed with {replayed} update(s) from the inbox" if resumed else "",
                      extra={"event": "round_start", "round": r, "selected": selected})
        need = max(1, math.ceil(cfg.quorum * len(selected)))
        deadline_mono = time.monotonic() + cfg.round_timeout_s
        self.pump(deadline_mono, stop=lambda: len(self._accepted) >= need)
        t_collect = time.monotonic()
        tc, cc = time.perf_counter(), time.thread_time()
        self.fleet.flush()  # the announcement's PUBACKs (long arrived, as a rule)
        confirm_s = time.perf_counter() - tc
        announce_s += confirm_s
        self._coord_s += confirm_s
        self._coord_cpu += time.thread_time() - cc
        stragglers = sorted(self._selected - set(self._accepted))
        if len(self._accepted) < need:
            self._counts["stragglers"] = len(stragglers)
            self.log.warning("round %d: deadline passed; %d straggler(s) excluded: %s", r,
                             len(stragglers), stragglers, extra={"event": "stragglers", "round": r})
        tc, cc = time.perf_counter(), time.thread_time()
        stats: dict[str, Any] = {}
        aggregated = len(self._accepted) >= cfg.min_updates
        old = [w.copy() for w in self.weights]
        if aggregated:
            result = self.strategy.finish()
            self.weights = [np.asarray(w, dtype=np.float32) for w in result.weights]
            self.group_weights = {int(b): [np.asarray(w, dtype=np.float32) for w in ws]
                                  for b, ws in (result.group_weights or {}).items()}
            stats = {k: v for k, v in (result.stats or {}).items()
                     if isinstance(v, int | float) and math.isfinite(v)}
        else:
            self.log.warning("round %d: %d update(s) < min_updates %d; the model is unchanged",
                             r, len(self._accepted), cfg.min_updates)
        agg_s = time.perf_counter() - tc
        self._coord_s += agg_s
        self._coord_cpu += time.thread_time() - cc
        te = time.perf_counter()
        loss, acc = self.evaluator(self.weights) if self.evaluator else (float("nan"), float("nan"))
        eval_s = time.perf_counter() - te
        change = float(math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(self.weights, old, strict=True))))
        record: dict[str, Any] = {
            "round": r, "time": time.time(), "run": self.run_id, "strategy": cfg.strategy,
            "model": cfg.model, "accuracy": acc if math.isfinite(acc) else None,
            "loss": loss if math.isfinite(loss) else None, "selected": len(selected),
            "selected_ids": selected, "accepted": len(self._accepted),
            "accepted_ids": sorted(self._accepted), "stragglers": len(stragglers) if len(self._accepted) < need else 0,
            "straggler_ids": stragglers if len(self._accepted) < need else [],
            "aggregated": aggregated, "resumed": resumed, "replayed": replayed,
            "weight_change_l2": change, "round_seconds": time.monotonic() - t_start,
            "collect_seconds": t_collect - t_start, "aggregate_seconds": agg_s,
            "coordinator_seconds": self._coord_s, "coordinator_cpu_seconds": self._coord_cpu,
            "eval_seconds": eval_s,
            "announce_seconds": announce_s,
            "handle_seconds": self._coord_s - announce_s - agg_s,
            "counts": {k: v for k, v in self._counts.items() if k != "accepted"},
            "stats": stats,
        }
        tc, cc = time.perf_counter(), time.thread_time()
        self.completed = r
        self.state.save_checkpoint(self._checkpoint(record))
        self.state.append_metrics(record)
        self.state.inbox_prune(r + 1)
        # PUBACK waited for by the next round's flush (or run()'s, after the last round)
        self.fleet.publish_retained_nowait([(topic(cfg.job, "status"), encode_message(Status(
            "waiting" if r < cfg.rounds else "done", r, f"round {r} complete",
            {k: float(v) for k, v in (("accuracy", acc), ("loss", loss)) if math.isfinite(v)})))])
        # (in memory only: the line on disk was written before these were known)
        record["checkpoint_seconds"] = time.perf_counter() - tc
        record["coordinator_seconds"] = self._coord_s + record["checkpoint_seconds"]
        record["coordinator_cpu_seconds"] = self._coord_cpu + (time.thread_time() - cc)
        record["round_seconds"] = time.monotonic() - t_start
        self.history.append(record)
        self.on_event("round_end", record)
        self.log.info("round %d: %d/%d updates, accuracy %s", r, len(self._accepted), len(selected),
                      f"{acc:.4f}" if math.isfinite(acc) else "n/a",
                      extra={"event": "round_end", "round": r, "accuracy": record["accuracy"]})
        self._round = None
        return record

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, record: dict[str, Any]) -> Checkpoint:
        devices = {d: asdict(i.hello) for d, i in self.devices.items() if i.hello is not None}
        return Checkpoint(
            job=self.cfg.job, model=self.cfg.model, completed_round=self.completed,
            weights=self.weights, group_weights=self.group_weights,
            strategy_state=self.strategy.state_dict() if hasattr(self.strategy, "state_dict") else {},
            rng_state={"json": json.dumps(self.rng.bit_generator.state)},
            metrics=record, devices=devices,
            config={"run_id": self.run_id, "rounds": self.cfg.rounds, "strategy": self.cfg.strategy,
                    "totals": dict(self.totals)},
        )

    def _restore(self) -> RoundPlan | None:
        ckpt = self.state.load_checkpoint()
        plan = self.state.load_plan()
        if ckpt is not None:
            if ckpt.model != self.cfg.model or ckpt.job != self.cfg.job:
                raise ConfigError(f"{self.state.checkpoint_path}: job/model {ckpt.job}/{ckpt.model} "
                                  f"!= {self.cfg.job}/{self.cfg.model}")
            self.completed = ckpt.completed_round
            self.weights = [np.asarray(w, dtype=np.float32) for w in ckpt.weights]
            self.group_weights = dict(ckpt.group_weights)
            if ckpt.strategy_state and hasattr(self.strategy, "load_state_dict"):
                self.strategy.load_state_dict(ckpt.strategy_state)
            if ckpt.rng_state.get("json"):
                self.rng.bit_generator.state = json.loads(ckpt.rng_state["json"])
            for d, h in ckpt.devices.items():
                self.devices[d] = DeviceInfo(Hello(**h), online=False)
            self.run_id = str(ckpt.config.get("run_id", self.run_id))
            self.totals.update(ckpt.config.get("totals", {}))
            self.history = [m for m in self.state.read_metrics() if m.get("round", 0) <= self.completed]
        elif plan is not None:
            self.run_id = str(plan.hparams.get("run", self.run_id))
        self.state.repair_metrics(ckpt)
        self.history = self.state.read_metrics()
        if plan is not None and plan.round_id == self.completed + 1:
            return plan
        return None

    # ------------------------------------------------------------------ main

    def run(self, *, resume: bool = False) -> list[dict[str, Any]]:
        """Run the remaining rounds; returns the metrics records of all completed rounds."""
        plan = None
        if resume:
            plan = self._restore()
            self.log.info("resuming after round %d%s", self.completed,
                          f" (round {plan.round_id} in progress)" if plan else "")
        elif self.state.checkpoint_path.exists() or self.state.plan_path.exists():
            raise ConfigError(f"{self.state.dir} holds a previous run: pass --resume or use another --out")
        self.fleet.start()
        # (no pump here: on resume, messages queued for this session, such as updates of
        # the open round, are handled once that round is set up again)
        if not resume or self.completed == 0 and plan is None:
            # a fresh run: clear a previous run's retained announcement, say we are here
            self.fleet.publish_retained([
                (topic(self.cfg.job, "round"), b""),
                (topic(self.cfg.job, "status"),
                 encode_message(Status("waiting", 0, "coordinator started"))),
            ])
        try:
            while self.completed < self.cfg.rounds:
                r = self.completed + 1
                self.run_round(r, plan if plan is not None and plan.round_id == r else None)
                plan = None
            self.fleet.flush()  # the last status reached the broker
        except BaseException:
            try:
                self.fleet.publish_status(encode_message(Status("error", self.completed, "coordinator stopped")))
            except Exception:  # noqa: BLE001 - the broker may be gone
                pass
            raise
        return self.history


def make_evaluator(model: str, data: Any, *, seed: int = 0) -> Evaluator:
    """``weights -> (loss, accuracy)`` on ``data`` with the float32 torch path
    (``edge_client.trainers.make_trainer(spec, 32)``; torch is imported here, lazily)."""
    from edge_client.trainers import make_trainer
    from firmware_models import get_spec

    trainer = make_trainer(get_spec(model), 32, seed=seed)

    def evaluate(weights: list[np.ndarray]) -> tuple[float, float]:
        trainer.load_shared([np.asarray(w, dtype=np.float32) for w in weights])
        loss, acc = trainer.evaluate(data)
        return float(loss), float(acc)

    return evaluate
