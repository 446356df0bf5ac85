"""The device loop: hello -> wait for selection -> download -> train -> encode -> publish.

One :class:`DeviceRuntime` per device owns a :class:`~edge_client.transport.Transport`
(MQTT or in-memory; last-will presence, retained presence + hello, subscriptions to ``round``,
its model variant and ``status``) and an on-disk :class:`~edge_client.outbox.Outbox`. When a
retained announcement selects it before its deadline, the device acknowledges a round (a
presence with the round id), waits for its group's model variant (digest checked), trains with the
announced settings (:mod:`edge_client.hparams`; those it cannot honour go in ``not_applied``),
encodes per its profile and publishes the :class:`Update` with QoS 1, outbox first: re-sent
after a reconnect while the round is open, again when it is announced again, dropped when it
closes; a secure round goes to ``edge_client.secagg.session``; a buffered announcement asks
for one update per ticket (``edge_client.assignment``). No torch, no ``coordinator``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client import __version__
from edge_client.assignment import RefusalLog, never_counts, outbox_kept, still_counts, work_number
from edge_client.compat import zip_strict
from edge_client.errors import CodecError, ConfigError, ProtocolError, TrainingError
from edge_client.hparams import RoundSettings, not_applied_level, round_settings
from edge_client.jobcheck import CoordinatorCheck
from edge_client.outbox import Outbox
from edge_client.protocol import (
    DEFAULT_LIMITS,
    FLOAT_VARIANT,
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
    model_variant,
    parse_topic,
    tensors_digest,
    topic,
    variant_bits,
)
from edge_client.secagg.session import SecureSession
from edge_client.session import RoundAck, SessionWatch
from edge_client.transport import Received, Transport
from hw_profiles import HardwareProfile

if TYPE_CHECKING:
    from edge_client.trainers import Trainer
    from firmware_models import ModelSpec

log = logging.getLogger("fedbit.device")


# --------------------------------------------------------------------------- tensors


def model_to_shared(msg: ModelMessage) -> list[np.ndarray]:
    """The shared-domain float32 weights a model message carries (``int<s>`` variants
    hold ``round(W * S(s_g))`` integers: converted exactly with ``intnn.to_shared``)."""
    from edge_client.codecs import decode

    arrays = [decode(t) for t in msg.tensors]
    bits = variant_bits(msg.variant)
    if bits < 32:
        from edge_client.intnn import to_shared

        return to_shared(arrays, bits)
    return [np.asarray(a, dtype=np.float32) for a in arrays]


def encode_update_tensors(weights: list[np.ndarray], names: list[str], codec: str, bits: int,
                          *, int_weights: list[np.ndarray] | None = None,
                          compute_bits: int = 32, delta: bool = False,
                          ternary_weights: list[np.ndarray] | None = None,
                          sigma_g: tuple[float, ...] = (), kmeans_method: str = "fast",
                          seed: tuple[int, int] = (0, 0)) -> tuple[EncodedTensor, ...]:
    """Encode a device's result with its uplink ``codec`` at ``bits``: the codec's
    :meth:`~edge_client.codecs.Codec.encode_update` picks what it sends of the shared-domain
    float32 ``weights`` (or their change, ``delta``), the device's own integers
    ``int_weights`` and its ternary forward weights ``ternary_weights`` (worth
    ``intnn.TERNARY_WEIGHT`` each), with the model's ``sigma_g`` and the K-means
    ``kmeans_method`` / ``seed`` (device seed, round id)."""
    from edge_client.codecs import DeviceUpdate, get_codec

    ternary_weight = 0.0
    if ternary_weights is not None:
        from edge_client.intnn import TERNARY_WEIGHT

        ternary_weight = TERNARY_WEIGHT
    u = DeviceUpdate(names, weights, compute_bits=compute_bits, delta=delta, integers=int_weights,
                     ternary=ternary_weights, ternary_weight=ternary_weight, sigma_g=tuple(sigma_g),
                     kmeans_method=kmeans_method, seed=seed)
    return get_codec(codec).encode_update(u, bits)


def int_delta(after: list[np.ndarray], before: list[np.ndarray]) -> list[np.ndarray] | None:
    """An integer device's update on its grid, ``q - q_global`` per layer (int8 when it
    fits, else int16); None when a layer's differences do not fit 16 bits (a weight that
    crossed the whole range of an Int16 grid in one round)."""
    out = []
    for q, b in zip_strict(after, before):
        d = q.astype(np.int32) - b.astype(np.int32)
        m = int(np.abs(d).max(initial=0))
        if m > 32767:
            return None
        out.append(d.astype(np.int8 if m <= 127 else np.int16))
    return out


# --------------------------------------------------------------------------- runtime


@dataclass
class DeviceConfig:
    """A device's identity and behaviour.

    ``workdir`` holds the outbox and the last completed round; ``exit_when_done`` stops
    the loop on the coordinator's ``done`` status (seen after this device took part or
    saw it active); ``max_rounds`` (> 0) stops it once the device has trained and sent
    that many rounds (a device that wakes up for one round; the emulator's devices);
    ``publish_timeout_s`` bounds the wait for a PUBACK before the update is left to the
    outbox; ``connect_timeout_s`` is how long one connect attempt is waited for (a warning
    is logged after each); ``give_up_after_s`` (> 0) ends the loop, with :attr:`DeviceRuntime.failure`
    set, once the device has had no session for that long (at the start or after losing
    it; 0: it retries forever, as a service does); ``train_delay_s`` sleeps before each local training (emulates a slow device
    in trials and tests); ``kmeans_method`` picks the K-means uplink's method (``fast`` |
    ``authors``) unless a round announces one; ``threads`` the cores the default trainer's
    integer training step uses (the profile's ``threads``, or ``fedbit-edge run --threads``);
    ``engine`` where its integer steps run, ``"cpu"`` or ``"cuda"`` (``fedbit-edge run``
    resolves the profile's or ``--engine``'s ``"auto"``).
    ``model_files``: the user's model files (``*.toml`` / ``*.py``, ``firmware_models.files``)
    this device may train; a round announcing a model file is matched to one of them by
    file name (a device never loads a path the coordinator names).
    """

    device_id: str
    compute_bits: int
    trainer: str
    codec: str
    codec_bits: int
    profile: str = "custom"
    kmeans_method: str = "fast"
    job: str = "default"
    workdir: Path = field(default_factory=lambda: Path(".fedbit-device"))
    seed: int = 0
    exit_when_done: bool = True
    limits: Limits = DEFAULT_LIMITS
    resend_interval_s: float = 1.0
    connect_timeout_s: float = 10.0
    give_up_after_s: float = 0.0
    publish_timeout_s: float = 10.0
    train_delay_s: float = 0.0
    max_rounds: int = 0
    model_files: tuple[str, ...] = ()
    threads: int = 1
    engine: str = "cpu"

    @classmethod
    def from_profile(cls, device_id: str, profile: HardwareProfile, **kw: Any) -> DeviceConfig:
        """From a :class:`hw_profiles.HardwareProfile`."""
        kw.setdefault("kmeans_method", getattr(profile, "kmeans_method", "fast"))
        kw.setdefault("threads", getattr(profile, "threads", 1))
        kw.setdefault("engine", "cpu")
        return cls(device_id=device_id, compute_bits=profile.compute_bits, trainer=profile.trainer,
                   codec=profile.codec, codec_bits=profile.codec_bits, profile=profile.name, **kw)


def device_hello(cfg: DeviceConfig, num_samples: int) -> Hello:
    """The hello a device with ``cfg`` and ``num_samples`` local samples publishes."""
    return Hello(device_id=cfg.device_id, profile=cfg.profile, compute_bits=cfg.compute_bits,
                 trainer=cfg.trainer, codec=cfg.codec, codec_bits=cfg.codec_bits,
                 num_samples=int(num_samples), sdk_version=__version__)


def birth_messages(cfg: DeviceConfig, num_samples: int) -> list[tuple[str, bytes, bool]]:
    """``(topic, payload, retain)`` a device publishes on every connect: presence online,
    then its hello (both retained)."""
    return [(topic(cfg.job, "presence", cfg.device_id), encode_message(Presence(cfg.device_id, True)), True),
            (topic(cfg.job, "hello", cfg.device_id), encode_message(device_hello(cfg, num_samples)), True)]


TrainerFactory = Callable[["ModelSpec", int, int], "Trainer"]  # (spec, bits, seed) -> Trainer


def load_model_files(paths: Any) -> dict[str, Any]:
    """``{file name: ModelSpec}`` of a device's model files (ConfigError naming a bad one)."""
    from firmware_models import SpecError, load_model_file

    out = {}
    for path in paths:
        try:
            out[os.path.basename(str(path))] = load_model_file(str(path))
        except SpecError as exc:
            raise ConfigError(str(exc)) from None
    return out


def default_trainer_factory(spec: ModelSpec, bits: int, seed: int, threads: int = 1,
                            engine: str = "cpu") -> Trainer:
    """A device's trainer: ``threads`` cores, its integer steps on ``engine``; an integer
    one on the CPU drops LLVM's machine code from the process's resident memory once its
    kernels are loaded (``edge_client.intnn.memory``)."""
    from edge_client.trainers import make_trainer

    if bits == 32:
        return make_trainer(spec, bits, seed=seed)
    return make_trainer(spec, bits, seed=seed, threads=threads, engine=engine,
                        release_pages=engine == "cpu")


class DeviceRuntime:
    """The device loop. ``connect(will=, birth=, subscriptions=)`` builds the transport.

    ``data`` is an ``edge_client.data.Dataset``; ``trainer_factory(spec, bits, seed)``
    builds the local trainer (by default ``edge_client.trainers.make_trainer`` with the
    config's ``threads``).
    """

    def __init__(self, cfg: DeviceConfig, data: Any,
                 connect: Callable[..., Transport], *,
                 trainer_factory: TrainerFactory | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.cfg = cfg
        self.data = data
        self._connect = connect
        self._trainer_factory = trainer_factory or functools.partial(
            default_trainer_factory, threads=cfg.threads, engine=cfg.engine)
        self.log = logger or log
        self.variant = model_variant(cfg.compute_bits, cfg.trainer)
        self.outbox = Outbox(Path(cfg.workdir) / "outbox")
        self._state_path = Path(cfg.workdir) / "device-state.json"
        self.rounds_done: list[int] = []
        self.run_token = ""
        self.last_done = self._load_last_done()
        self.announcement: RoundAnnouncement | None = None
        self.models: dict[str, ModelMessage] = {}
        self.coordinator_active = False
        #: the last "not applied" report logged at WARNING (the same again goes to DEBUG);
        #: a host that re-creates runtimes (the emulator) carries it from one to the next
        self.not_applied_logged = ""
        self.transport: Transport | None = None
        self._trainers: dict[str, tuple[ModelSpec, Trainer]] = {}
        self._model_files = load_model_files(cfg.model_files)
        self.stop_event = threading.Event()
        #: why the loop gave up ("" unless it did: no session for ``give_up_after_s``)
        self.failure = ""
        self.sent = 0
        self.resent = 0
        #: the open round was announced again (a resumed coordinator, a broker that lost its
        #: retained messages, a reconnect): its sent update goes out once more
        self._announced_again = False
        self.refusals = RefusalLog(cfg.device_id, self.log)
        self.acks = RoundAck(cfg.job, cfg.device_id)  # (what the coordinator hears at once: at work)
        self.coordinator_check = CoordinatorCheck(cfg.job, self.log)  # (no coordinator on the job: says so)
        j, d = cfg.job, cfg.device_id
        self.t_presence = topic(j, "presence", d)
        self.t_hello = topic(j, "hello", d)
        self.t_update = topic(j, "update", d)
        self.t_round = topic(j, "round")
        self.t_status = topic(j, "status")
        self.t_model = topic(j, "model", self.variant)
        self.secure = SecureSession(cfg, self.log)  # the rounds whose announcement says secagg

    # ------------------------------------------------------------------ state

    def _load_last_done(self) -> int:
        """Last round this device trained in the coordinator run ``self.run_token``."""
        try:
            st = json.loads(self._state_path.read_text())
            self.run_token = str(st.get("run", ""))
            return int(st["last_done"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return -1

    def _save_last_done(self, r: int) -> None:
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run": self.run_token, "last_done": r}))
        tmp.replace(self._state_path)

    def hello(self) -> Hello:
        return device_hello(self.cfg, int(len(self.data.y)))

    def session_spec(self) -> dict[str, Any]:
        """will / birth / subscriptions for the transport."""
        offline = encode_message(Presence(self.cfg.device_id, False))
        return {
            "will": (self.t_presence, offline),
            "birth": birth_messages(self.cfg, int(len(self.data.y))),
            "subscriptions": [self.t_round, self.t_model, self.t_status, self.secure.inbox_topic],
        }

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        """Ask the loop to finish (SIGTERM handler calls this)."""
        self.stop_event.set()

    def run(self, max_seconds: float | None = None) -> int:
        """Run until stopped, the coordinator says ``done``, or ``max_seconds``; returns
        the number of rounds this device trained."""
        t = self._connect(**self.session_spec())
        self.transport = t
        end = time.monotonic() + max_seconds if max_seconds else math.inf
        session = SessionWatch(self.cfg.give_up_after_s, self.cfg.connect_timeout_s, self.stop_event,
                                self.log, self.cfg.device_id)
        ok = session.first(t, end)
        self.failure = session.failure
        if not ok:
            t.close()
            return 0
        v = str(getattr(t, "version", "") or "?")
        self.log.info("device %s connected (%s%s, job %s, variant %s)", self.cfg.device_id, "MQTT " * v[0].isdigit(), v, self.cfg.job, self.variant)
        seen_connects = t.connects
        next_resend = 0.0
        idle = False  # True once a work pass found nothing queued: then block in recv
        try:
            while not self.stop_event.is_set() and time.monotonic() < end:
                if not session.watch(t):
                    self.failure = session.failure
                    break
                if self.cfg.max_rounds and len(self.rounds_done) >= self.cfg.max_rounds and not (
                        self.outbox.pending() or self.secure.busy):
                    self.log.info("device %s: %d round(s) done, stopping", self.cfg.device_id,
                                  len(self.rounds_done))
                    break
                msg = t.recv(timeout=0.1 if idle else 0)
                if msg is not None:
                    idle = False
                    if self._handle(msg):
                        break
                    continue  # drain the queue before working
                idle = True  # the queue is drained: work now, then wait for the next message
                now = time.monotonic()
                if t.connected and (t.connects != seen_connects or now >= next_resend or self._announced_again):
                    seen_connects = t.connects
                    next_resend = now + self.cfg.resend_interval_s
                    self._flush_outbox(self._announced_again)
                    self._announced_again = False
                self._maybe_train()
                self.coordinator_check.tick(t, now)
        finally:
            t.close(clear_will=(self.t_presence, encode_message(Presence(self.cfg.device_id, False))))
        return len(self.rounds_done)

    def _handle(self, msg: Received) -> bool:
        """Process one received message; True when the loop should end."""
        try:
            job, kind, ident = parse_topic(msg.topic)
            if self.coordinator_check.other_job(job, kind, msg.payload):  # (seen while it checks the broker's jobs)
                return False
            if not msg.payload:  # a cleared retained message
                if kind == "round":
                    self.announcement = None
                return False
            m = decode_message(msg.payload, self.cfg.limits)
        except ProtocolError as exc:
            self.log.warning("ignored message on %s: %s", msg.topic, exc)
            return False
        if isinstance(m, RoundAnnouncement) and kind == "round":
            prev = self.announcement
            same_run = prev is not None and prev.hparams.get("run") == m.hparams.get("run")
            self.announcement = m
            self.coordinator_active = True
            if m.mode == "buffered":
                self.refusals.note(m, self.last_done)
                same_run = m.hparams.get("run") == (prev.hparams.get("run") if prev else self.run_token)
            else:
                self._announced_again |= same_run and prev.round_id == m.round_id
            kept, newer = outbox_kept(m, same_run)
            n = self.outbox.discard_closed(kept, keep_newer=newer)
            if n:
                self.log.debug("discarded %d outbox item(s) of closed rounds", n)
        elif isinstance(m, ModelMessage) and kind == "model" and ident == m.variant:
            if tensors_digest(m.tensors) != m.digest:  # (what the announcement's digest names)
                self.log.warning("ignored model on %s: its digest does not match its tensors", msg.topic)
                return False
            self.models[m.variant] = m
        elif kind == "secagg-in" and (reply := self.secure.handle(m)) is not None and self.transport is not None:
            self.transport.publish(self.secure.topic, reply, qos=1, timeout=self.cfg.publish_timeout_s)
        elif isinstance(m, Status) and kind == "status":
            if m.state in ("waiting", "round"):
                self.coordinator_active = True
            if m.state == "done" and self.cfg.exit_when_done and (
                    self.coordinator_active or self.rounds_done):
                self.log.info("coordinator done after round %d", m.round_id)
                return True
        return False

    def _flush_outbox(self, again: bool = False) -> None:
        """Re-send pending updates of the open round (and, ``again``, the sent ones: the
        round was announced again); forget those of closed rounds."""
        t = self.transport
        assert t is not None
        for item in self.outbox.pending() + (self.outbox.sent() if again else []):
            if not still_counts(self.announcement, item.round_id):
                if never_counts(self.announcement, item.round_id):
                    self.outbox.remove(item)
                continue
            if t.publish(item.topic, item.payload(), qos=1, timeout=self.cfg.publish_timeout_s):
                self.outbox.mark_sent(item)
                self.resent += 1
                self.log.info("re-sent update of round %d from the outbox", item.round_id)

    def _maybe_train(self) -> None:
        a = self.announcement
        if a is None or self.cfg.device_id not in a.selected:
            return
        run = str(a.hparams.get("run", ""))
        if run != self.run_token:  # a new coordinator run: round ids start again
            self.run_token, self.last_done = run, -1
        ticket = work_number(a, self.cfg.device_id)
        if ticket <= self.last_done or time.time() >= a.deadline:
            return
        if a.mode != "buffered":  # (a buffered request is held until the device answers or leaves)
            self.acks.send(self.transport, a, self.cfg.publish_timeout_s)
        m = self.models.get(self.variant)
        want = a.variants.get(self.variant)
        if m is None or m.round_id != a.round_id or want is None or m.digest != want:
            return
        if self.cfg.train_delay_s > 0:
            self.log.info("round %d: waiting %.1f s (emulated slow device)", a.round_id,
                          self.cfg.train_delay_s)
            if self.stop_event.wait(self.cfg.train_delay_s):
                return
        try:
            payload = self.train_round(a, m)
        except (ProtocolError, CodecError, TrainingError) as exc:  # a model that will not load
            self.log.warning("round %d: cannot train on the received model (%s); waiting for another",
                             a.round_id, exc)
            self.models.pop(self.variant, None)
            return
        self.last_done = ticket
        self.rounds_done.append(a.round_id)
        self._save_last_done(ticket)
        to = self.secure.topic if "secagg" in a.hparams else self.t_update  # a secure round: its keys
        item = self.outbox.put(a.round_id, to, payload)
        t = self.transport
        assert t is not None
        what = f"version {a.round_id}, request {ticket}" if a.mode == "buffered" else f"round {a.round_id}"
        if t.publish(to, payload, qos=1, timeout=self.cfg.publish_timeout_s):
            self.outbox.mark_sent(item)
            self.sent += 1
            self.log.info("%s: update sent (%d bytes)", what, len(payload))
        else:
            self.log.warning("%s: update not acknowledged; kept in the outbox", what)

    # ------------------------------------------------------------------ training

    def _trainer(self, model: str) -> tuple[ModelSpec, Trainer]:
        """The spec and the trainer of ``model`` (made once); TypeError when the factory's
        trainer lacks a member of the :class:`~edge_client.trainers.Trainer` protocol."""
        if model not in self._trainers:
            from edge_client.trainers import missing_members
            from firmware_models import resolve_model

            spec = resolve_model(model, self._model_files, allow_paths=False)
            trainer = self._trainer_factory(spec, self.cfg.compute_bits, self.cfg.seed)
            missing = missing_members(trainer)
            if missing:
                raise TypeError(f"trainer_factory made a {type(trainer).__name__}, which lacks "
                                f"{missing} of the Trainer protocol")
            self._trainers[model] = (spec, trainer)
        return self._trainers[model]

    def round_settings(self, a: RoundAnnouncement) -> RoundSettings:
        """This device's settings for round ``a`` (announcement + profile)."""
        return round_settings(a.hparams, variant=self.variant, codec=self.cfg.codec,
                              codec_bits=self.cfg.codec_bits, kmeans_method=self.cfg.kmeans_method)

    def train_kwargs(self, st: RoundSettings, trainer: Trainer) -> dict[str, Any]:
        """The ``trainer.train`` arguments of ``st`` beyond epochs/steps/batch (the ones left
        out keep the trainer's own values). ``lr_scale`` multiplies a float device's learning
        rate; on an integer device, and on a float device training an integer forward, it
        moves ``lr_shift`` by ``round(log2 lr_scale)`` (its step is a power of two) and
        scales the FedProx/FedFOR step like a float device's."""
        kw: dict[str, Any] = {"prox_mu": st.prox_mu, "fedfor_alpha": st.fedfor_alpha}
        lr = st.lr
        if st.lr_scale != 1.0:
            lr = (lr if lr is not None else trainer.lr) * st.lr_scale
        for key, value in (("lr", lr), ("momentum", st.momentum), ("grad_clip", st.grad_clip),
                           ("weight_standardization", st.ws), ("weight_norm", st.wn),
                           ("forward", st.float_forward), ("step", st.float_step)):
            if value is not None:
                kw[key] = value
        integer_step = (self.variant != FLOAT_VARIANT or st.float_forward not in (None, FLOAT_VARIANT)
                        or st.float_step == "integer")
        # an integer device, or a float device training an integer forward or with the integer step, whose step moves
        if integer_step and (st.lr_shift is not None or st.lr_scale != 1.0):
            shift = st.lr_shift if st.lr_shift is not None else trainer.lr_shift
            shift += round(math.log2(st.lr_scale))
            if not -8 <= shift <= 8:
                st.not_applied["lr_scale"] = f"lr_shift {shift} outside -8..8; clamped"
                shift = min(8, max(-8, shift))
            kw["lr_shift"] = shift
        if self.variant != FLOAT_VARIANT:  # the float devices' settings
            for key in ("weight_standardization", "weight_norm", "forward", "step"):
                kw.pop(key, None)
        return kw

    def train_round(self, a: RoundAnnouncement, m: ModelMessage) -> bytes:
        """Train on the downloaded model; return the encoded update payload. ProtocolError
        when the model is not one this SDK knows or its layers do not fit it."""
        from firmware_models import SpecError

        try:
            spec, trainer = self._trainer(a.model)
        except SpecError as exc:
            raise ProtocolError(f"round {a.round_id}: model {a.model!r}: {exc}") from None
        st = self.round_settings(a)
        weights = model_to_shared(m)
        want = [tuple(s) for s in spec.param_shapes()]
        if [w.shape for w in weights] != want:
            raise ProtocolError(f"model {m.variant} of round {m.round_id}: layer shapes "
                                f"{[w.shape for w in weights]} do not fit {a.model} {want}", reason="wrong_shape")
        trainer.load_shared(weights)
        from edge_client.codecs import decode, get_codec

        lgs = [decode(t) for t in m.last_global_step] or None
        kw = self.train_kwargs(st, trainer)
        t0 = time.perf_counter()
        report = trainer.train(self.data, epochs=st.epochs, steps=st.steps or None, batch=st.batch,
                               last_global_step=lgs, **kw)
        secs = time.perf_counter() - t0
        names = spec.param_names()
        shared = [np.asarray(w, dtype=np.float32) for w in trainer.to_shared()]
        if "secagg" in a.hparams:  # a secure round: the update goes into the protocol, not on the wire
            return self.secure.start(a, m, trainer, shared, weights, int(len(self.data.y)))
        delta = st.content == "delta"
        wants = get_codec(st.codec).device_input  # what the uplink codec sends of a device
        ints = trainer.int_weights() if wants == "integers" else None
        tern = trainer.ternary_weights() if wants == "ternary_forward" and not delta else None
        if delta:
            shared = [w - g for w, g in zip_strict(shared, weights)]
            if ints is not None:
                ints = int_delta(ints, [decode(t) for t in m.tensors])
        tensors = encode_update_tensors(shared, names, st.codec, st.codec_bits, int_weights=ints,
                                        compute_bits=self.cfg.compute_bits, delta=delta,
                                        ternary_weights=tern, sigma_g=m.sigma_g,
                                        kmeans_method=st.kmeans_method, seed=(self.cfg.seed, a.round_id))
        loss = float(report.loss)
        not_applied = {k: v[:self.cfg.limits.max_str] for k, v in st.not_applied.items()}
        if not_applied:  # logged once while the job announces the same; reported every round
            what = "; ".join(f"{k}: {v}" for k, v in not_applied.items())
            self.log.log(logging.DEBUG if what == self.not_applied_logged else not_applied_level(not_applied),
                         "round %d: announced settings not applied: %s", a.round_id, what)
            self.not_applied_logged = what
        upd = Update(device_id=self.cfg.device_id, round_id=a.round_id,
                     num_samples=int(len(self.data.y)), compute_bits=self.cfg.compute_bits,
                     content=st.content, tensors=tensors, model_digest=m.digest,
                     train_loss=loss if math.isfinite(loss) else 0.0, train_seconds=secs,
                     not_applied=not_applied, ticket=work_number(a, self.cfg.device_id) if a.mode == "buffered" else 0)
        return encode_message(upd, self.cfg.limits)
