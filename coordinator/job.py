"""``fedbit serve``'s job: one TOML file (``fedbit serve --config job.toml``), the flags
that override it, and :class:`ServeJob`, what the command runs.

The file follows the conventions of :mod:`coordinator.config` (unknown keys are errors
naming the file and the key): top-level ``job``, ``model``, ``rounds``, ``strategy``,
``seed``, ``out``, ``eval_data``, ``resume``, ``on_collapse`` (:class:`JobSettings`) and the
sections ``[strategy_params]``, ``[train]``, ``[round]``, ``[broker]``, ``[admission]``,
``[limits]``, ``[log]``, ``[dashboard]``, ``[defense]``, ``[privacy]``, ``[ingest]``, each a
dataclass of this module or of the package that owns it (:data:`SCHEMA`);
``examples/job.toml`` shows every key and docs/operations.md#fedbit-serve-with-a-job-file
says what each section does.

Every flag of ``fedbit serve`` sets one of these keys (:data:`FLAGS`; ``--set KEY=VALUE``
sets any), so a flag and the file never disagree about a default: defaults come from
:class:`~coordinator.config.ServerConfig`, :class:`~coordinator.ops.admission.AdmissionConfig`
and ``edge_client.protocol.Limits``. :func:`coordinator_for` makes the loop of
``round.mode`` (``fedbit serve``'s and the emulator's).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coordinator.buffered.loop import BufferedCoordinator
from coordinator.buffered.settings import BufferedSettings
from coordinator.config import (
    DEFAULT_HPARAMS,
    ON_COLLAPSE,
    ServerConfig,
    TomlSchema,
    checked,
    parse_assignments,
    read_toml,
)
from coordinator.defense.config import DefenseConfig
from coordinator.ops.admission import AdmissionConfig
from coordinator.ops.dashboard.access import parse_address
from coordinator.privacy.config import FLAGS as PRIVACY_FLAGS
from coordinator.privacy.config import PrivacyConfig
from coordinator.server import Coordinator
from edge_client.errors import ConfigError
from edge_client.protocol import DEFAULT_LIMITS, Limits
from firmware_models import MODELS

#: ``round.mode`` -> its loop (each takes :class:`~coordinator.server.Coordinator`'s arguments)
LOOPS: dict[str, type[Coordinator]] = {"sync": Coordinator, "buffered": BufferedCoordinator}
EMBEDDED_KINDS = ("auto", "mosquitto", "amqtt")
SECURITY_MODES = ("auto", "none", "password", "tls")
MQTT_VERSIONS = ("auto", "5", "3.1.1")
LOG_LEVELS = ("debug", "info", "warning", "error")


_S, _A = ServerConfig(), AdmissionConfig()


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")


@dataclass
class JobSettings:
    """The job file's top-level keys (the module docstring): the job id, the model, the
    rounds, the strategy, the seed, the run directory ``out``, the held-out ``eval_data``,
    ``resume`` and what a collapsed aggregate does (``on_collapse``)."""

    job: str = _S.job
    model: str = _S.model
    rounds: int = _S.rounds
    strategy: str = _S.strategy
    seed: int = _S.seed
    out: str = ""
    eval_data: str = "digits:test"
    resume: bool = False
    on_collapse: str = _S.on_collapse

    def check(self) -> None:
        _one_of("on_collapse", self.on_collapse, ON_COLLAPSE)
        if not self.out:
            raise ConfigError("out: no run directory (give --out DIR or `out = \"DIR\"` in the job file)")


@dataclass
class JobRound:
    """``[round]``: :class:`~coordinator.config.ServerConfig`'s round-loop settings under
    the file's names (``timeout_s`` is ``round_timeout_s``)."""

    fraction: float = _S.fraction
    min_devices: int = _S.min_devices
    max_devices: int = _S.max_devices
    min_present: int = _S.min_present
    quorum: float = _S.quorum
    min_updates: int = _S.min_updates
    timeout_s: float = _S.round_timeout_s
    presence_timeout_s: float = _S.presence_timeout_s
    ack_timeout_s: float = _S.ack_timeout_s
    mode: str = _S.mode
    buffer_size: int = _S.buffered.buffer_size
    concurrency: int = _S.buffered.concurrency
    server_lr: float = _S.buffered.server_lr
    max_staleness: int = _S.buffered.max_staleness
    staleness: str = _S.buffered.staleness

    def buffered(self) -> BufferedSettings:
        """Buffered mode's settings (``coordinator.buffered``)."""
        return BufferedSettings(self.buffer_size, self.concurrency, float(self.server_lr), self.max_staleness,
                                self.staleness)


@dataclass
class BrokerSettings:
    """Where the coordinator's broker is and how it connects (the ``[broker]`` table).

    ``url`` empty: an embedded broker (``embedded`` kind) on ``127.0.0.1:port`` (0: a free
    port), or on ``listen`` (``HOST:PORT``) with ``security`` (``auto``: TLS for a job with
    enrolled devices or beyond loopback, none for a loopback job without enrolments) and
    the job's security material in ``security_dir`` (default ``OUT/security``) for the
    server certificate's ``hostnames``. ``url`` given: that broker,
    reached with ``credentials`` (the file ``fedbit broker-config`` writes) or ``username`` /
    ``password_file`` and the TLS files ``ca`` / ``cert`` / ``key``."""

    url: str = ""
    embedded: str = "auto"
    port: int = 0
    listen: str = ""
    security: str = "auto"
    security_dir: str = ""
    hostnames: list[str] = field(default_factory=list)
    credentials: str = ""
    mqtt_version: str = "auto"
    username: str = ""
    password_file: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""
    insecure: bool = False

    def check(self) -> None:
        _one_of("embedded", self.embedded, EMBEDDED_KINDS)
        _one_of("security", self.security, SECURITY_MODES)
        _one_of("mqtt_version", self.mqtt_version, MQTT_VERSIONS)
        if not all(isinstance(h, str) and h for h in self.hostnames):
            raise ConfigError(f"hostnames: expected a list of names, got {self.hostnames!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in 0..65535 (0: a free port), got {self.port}")


@dataclass
class LimitSettings:
    """``[limits]``: the two protocol limits a job sets (``edge_client.protocol.Limits``)."""

    max_payload_bytes: int = DEFAULT_LIMITS.max_payload_bytes
    max_abs_value: float = DEFAULT_LIMITS.max_abs_value

    def check(self) -> None:
        if self.max_payload_bytes < 1024:
            raise ConfigError(f"max_payload_bytes: must be >= 1024, got {self.max_payload_bytes}")

    def limits(self) -> Limits:
        return replace(DEFAULT_LIMITS, max_payload_bytes=self.max_payload_bytes, max_abs_value=self.max_abs_value)


@dataclass
class LogSettings:
    """``[log]``: JSON lines instead of text (``json``), the ``level``, no progress display
    (``quiet``)."""

    json: bool = False
    level: str = "info"
    quiet: bool = False

    def check(self) -> None:
        _one_of("level", self.level, LOG_LEVELS)


@dataclass
class DashboardSettings:
    """The live dashboard and ``/metrics`` (the ``[dashboard]`` table;
    :mod:`coordinator.ops.dashboard.access`): ``listen`` ``[HOST:]PORT`` (empty: none; a
    bare port is on 127.0.0.1, 0 a free one; beyond loopback HTTPS with the job CA and a
    password), ``password_file`` (default beyond loopback: ``SECURITY/dashboard.password``)."""

    listen: str = field(default="", metadata={"toml": (str, int)})  # a bare port may be a number
    password_file: str = ""

    def __post_init__(self) -> None:
        self.listen = str(self.listen).strip()

    def check(self) -> None:
        if self.listen:
            try:
                parse_address(self.listen)
            except ConfigError as exc:
                raise ConfigError(f"listen: {exc}") from None


@dataclass
class IngestSettings:
    """``[ingest]``: ``workers`` processes take the updates through a shared subscription
    (``coordinator.ingest_workers``; 0: the round loop takes them itself)."""

    workers: int = 0

    def check(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"workers: must be >= 0, got {self.workers}")


@dataclass
class ServeJob:
    """Everything ``fedbit serve`` runs (see the module docstring); ``source`` names the file."""

    server: ServerConfig
    broker: BrokerSettings
    out: str
    eval_data: str = "digits:test"
    resume: bool = False
    log_json: bool = False
    log_level: str = "info"
    quiet: bool = False
    source: str = "<flags>"
    dashboard: DashboardSettings = field(default_factory=DashboardSettings)
    #: the validated job table (every key, defaults filled in), as the dashboard shows it
    table: dict[str, Any] = field(default_factory=dict)
    #: ingest worker processes (``[ingest] workers``; 0: the round loop takes the updates)
    ingest_workers: int = 0


SCHEMA = TomlSchema.of({
    "": JobSettings, "round": JobRound, "broker": BrokerSettings, "admission": AdmissionConfig,
    "limits": LimitSettings, "log": LogSettings, "dashboard": DashboardSettings, "privacy": PrivacyConfig,
    "defense": DefenseConfig, "ingest": IngestSettings,
}, free=("strategy_params", "train"))


def coordinator_for(cfg: ServerConfig, *args: Any, **kw: Any) -> Coordinator:
    """The loop of ``cfg.mode`` (rounds; buffered: ``coordinator.buffered``), built with
    :class:`~coordinator.server.Coordinator`'s arguments."""
    return LOOPS[cfg.mode](cfg, *args, **kw)


def job_from_dict(raw: dict[str, Any], source: str) -> ServeJob:
    """Validate a job table (file values with the command line's already applied)."""
    v = SCHEMA.validate(raw, source)
    s = SCHEMA.build(v)
    top, rnd, broker, lim, log, dash = (checked(s[name], name, source) for name in
                                        ("", "round", "broker", "limits", "log", "dashboard"))
    hparams = copy.deepcopy(DEFAULT_HPARAMS) | s["train"]
    cfg = ServerConfig(
        job=top.job, model=_model(top.model, source), rounds=top.rounds, strategy=top.strategy,
        strategy_params=s["strategy_params"], fraction=float(rnd.fraction), min_devices=rnd.min_devices,
        max_devices=rnd.max_devices, min_present=rnd.min_present, quorum=float(rnd.quorum),
        min_updates=rnd.min_updates, round_timeout_s=float(rnd.timeout_s),
        presence_timeout_s=float(rnd.presence_timeout_s), hparams=hparams, seed=top.seed,
        limits=lim.limits(), admission=s["admission"], on_collapse=top.on_collapse, privacy=s["privacy"],
        ack_timeout_s=float(rnd.ack_timeout_s), defense=s["defense"], mode=rnd.mode, buffered=rnd.buffered())
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    ingest = checked(s["ingest"], "ingest", source)
    if ingest.workers:
        from coordinator.ingest_workers import refusal

        if why := refusal(cfg):
            raise ConfigError(f"{source}: ingest.workers: {why}")
    return ServeJob(cfg, broker, top.out, eval_data=top.eval_data, resume=top.resume,
                    log_json=log.json, log_level=log.level, quiet=log.quiet, source=source,
                    dashboard=dash, table={**v[""], **{sec: t for sec, t in v.items() if sec}},
                    ingest_workers=ingest.workers)


def _model(ref: str, source: str) -> str:
    """A bundled model's name, or a user's model file (``*.toml`` / ``*.py``) as an absolute
    path (relative to the job file's folder when it is there, else to the cwd); ConfigError
    naming the job file and the model file (and layer) when it does not load."""
    from firmware_models import SpecError, is_model_file, resolve_model

    if not is_model_file(ref) and ref not in MODELS:
        raise ConfigError(f"{source}: model: {ref!r} is not one of {sorted(MODELS)} (or a model file: "
                          f"*.toml, *.py)")
    if is_model_file(ref) and not Path(ref).is_absolute():
        near = Path(source).parent / ref
        ref = str((near if source != "<flags>" and near.is_file() else Path(ref)).resolve())
    try:
        resolve_model(ref)
    except SpecError as exc:
        raise ConfigError(f"{source}: model: {exc}") from None
    return ref


def load_job(path: str | Path | None, overrides: dict[str, Any] | None = None) -> ServeJob:
    """The job of ``path`` (None: defaults only) with dotted ``overrides`` applied."""
    raw = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "<flags>"
    for key, value in (overrides or {}).items():
        SCHEMA.set_dotted(raw, key, value, source)
    return job_from_dict(raw, source)


# --------------------------------------------------------------------------- flags

#: ``fedbit serve``'s flags: (flag, dotted key, argparse keyword arguments). Broker
#: connection and logging flags come from edge_client.connection / edge_client.logs.
FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--out", "out", {"metavar": "DIR", "help": "run directory (checkpoint, inbox, metrics.jsonl)"}),
    ("--resume", "resume", {"action": "store_true", "help": "continue the run in --out"}),
    ("--job", "job", {"help": "job id (topic prefix fedbit/<job>/)"}),
    ("--model", "model", {"metavar": "SPEC", "help": "a bundled model's name, or a model file (TOML layers, "
                                                     "or a Python file defining a ModelSpec)"}),
    ("--rounds", "rounds", {"type": int, "metavar": "N", "help": "rounds the job runs"}),
    ("--strategy", "strategy", {"metavar": "NAME", "help": "aggregation strategy; prowd = ProWD's "
                                "dequantizer + selective aggregation"}),
    ("--seed", "seed", {"type": int, "help": "seed of the initial model and of the device selection"}),
    ("--on-collapse", "on_collapse", {"choices": list(ON_COLLAPSE), "help": "a collapsed aggregate (every "
                                      "group at chance, a constant output, a dead layer): go back to the last "
                                      "healthy model without that round's updates, or log it and keep it"}),
    ("--eval-data", "eval_data", {"metavar": "SRC", "help": "held-out set: a data source (digits:test, fashion-mnist:test, an IDX/CIFAR-10 folder or .npz: its test split)"}),
    ("--fraction", "round.fraction", {"type": float, "metavar": "C", "help": "fraction of present devices per round"}),
    ("--min-devices", "round.min_devices", {"type": int, "help": "fewest devices a round selects; a round "
                                            "starts once this many are present (or --min-present, if more)"}),
    ("--max-devices", "round.max_devices", {"type": int, "help": "most devices selected per round"}),
    ("--min-present", "round.min_present", {"type": int, "help": "devices that must be present before a "
                                            "round starts, when more than --min-devices (0: --min-devices)"}),
    ("--quorum", "round.quorum", {"type": float, "help": "fraction of the selected that closes a round early"}),
    ("--min-updates", "round.min_updates", {"type": int, "help": "fewer updates at the deadline keep the old model"}),
    ("--round-timeout", "round.timeout_s", {"type": float, "metavar": "S", "help": "round deadline in seconds"}),
    ("--presence-timeout", "round.presence_timeout_s", {"type": float, "metavar": "S",
                                                        "help": "how long a round waits for --min-devices "
                                                                "(or --min-present) devices to be present"}),
    ("--mode", "round.mode", {"choices": ["sync", "buffered"], "help": "synchronous rounds, or buffered "
                              "asynchronous aggregation (FedBuff: see --buffer-size, --concurrency)"}),
    ("--buffer-size", "round.buffer_size", {"type": int, "help": "buffered: updates per model version"}),
    ("--concurrency", "round.concurrency", {"type": int, "help": "buffered: most devices training at once"}),
    ("--max-staleness", "round.max_staleness", {"type": int, "help": "buffered: refuse updates trained more "
                                                "than this many versions ago"}),
    ("--epochs", "train.epochs", {"type": int, "help": "local epochs per round"}),
    ("--batch", "train.batch", {"type": int, "help": "local batch size"}),
    ("--steps", "train.steps", {"type": int, "help": "local steps per round (0: whole epochs)"}),
    ("--max-payload", "limits.max_payload_bytes", {"type": int, "metavar": "BYTES", "help": "largest accepted update"}),
    ("--max-abs-value", "limits.max_abs_value", {"type": float, "metavar": "X", "help": "reject updates carrying "
                                                 "a value with |v| > X (shared float domain)"}),
    ("--embedded", "broker.embedded", {"choices": list(EMBEDDED_KINDS), "help": "embedded broker kind "
                                       "(auto: mosquitto when on PATH, else amqtt)"}),
    ("--port", "broker.port", {"type": int, "help": "TCP port of the embedded broker on 127.0.0.1 (0: a free one)"}),
    ("--listen", "broker.listen", {"metavar": "HOST:PORT", "help": "where the embedded broker listens for devices "
                                   "(0.0.0.0:8883: every interface); a job with enrolled devices, or "
                                   "one beyond loopback, takes TLS, per-device passwords and an ACL"}),
    ("--security", "broker.security", {"choices": list(SECURITY_MODES), "help": "embedded broker security "
                                       "(auto: follows the job: tls when devices are enrolled or beyond "
                                       "loopback, none for a loopback job without enrolments)"}),
    ("--security-dir", "broker.security_dir", {"metavar": "DIR", "help": "the job's CA, registry, password file "
                                               "and ACL (default OUT/security; with --broker: the folder "
                                               "fedbit broker-config wrote)"}),
    ("--hostname", "broker.hostnames", {"action": "append", "metavar": "NAME", "help": "a name devices dial, for "
                                        "the server certificate (repeatable; default: this host's names)"}),
    ("--max-samples", "admission.max_samples", {"type": int, "metavar": "N", "help": "job-wide cap of an "
                                                "update's num_samples (0: none; enrolment and hello "
                                                "declarations bound it too)"}),
    ("--allow-uncapped", "admission.allow_uncapped", {"action": "store_true", "help": "start even though "
                                                      "an enrolled device has no sample cap (enrolled "
                                                      "with --max-samples 0) and --max-samples is 0"}),
    ("--samples-policy", "admission.samples_policy", {"choices": ["clip", "reject"], "help": "an update claiming "
                                                      "more samples than its bound: clipped or rejected"}),
    ("--max-registered", "admission.max_registered", {"type": int, "metavar": "N", "help": "most devices the job registers"}),
    ("--hello-rate", "admission.hello_rate", {"type": float, "metavar": "PER_S", "help": "hello/presence "
                                              "messages per device per second (after --hello-burst)"}),
    ("--hello-burst", "admission.hello_burst", {"type": int, "metavar": "N", "help": "hello/presence "
                                                "messages a device may send at once before --hello-rate applies"}),
    ("--quiet", "log.quiet", {"action": "store_true", "help": "no progress display"}),
    ("--dashboard", "dashboard.listen", {"metavar": "[HOST:]PORT", "help": "serve the live dashboard and "
                                         "Prometheus /metrics (8080: on 127.0.0.1; 0: a free port; beyond "
                                         "loopback: HTTPS with the job CA and a password)"}),
    ("--dashboard-password-file", "dashboard.password_file", {"metavar": "FILE", "help": "the dashboard's "
                                                              "password (default beyond loopback: "
                                                              "SECURITY/dashboard.password, made once)"}),
    *PRIVACY_FLAGS,
    ("--ingest-workers", "ingest.workers", {"type": int, "metavar": "N", "help": "N processes take the updates "
                                            "through a shared subscription, fold them into partial sums and hand "
                                            "those to the round loop (0: it takes them itself; needs mosquitto "
                                            "or another broker with shared subscriptions, and a strategy that "
                                            "sums: not robust aggregation, a dequantizer or privacy)"}),
]
#: the shared connection and logging options' keys in the job file
CONNECTION_KEYS = {name: f"broker.{'url' if name == 'broker' else name}" for name in
                   ("broker", "credentials", "mqtt_version", "username", "password_file", "ca", "cert", "key",
                    "insecure")}
LOG_KEYS = {"json": "log.json", "level": "log.level"}


def default_of(key: str) -> Any:
    """The default of a dotted key (for help texts; None where there is none)."""
    sec, dot, name = key.partition(".")
    if sec == "train":
        return DEFAULT_HPARAMS.get(name)
    return SCHEMA.sections[sec if dot else ""][name if dot else sec][1]


def add_job_options(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--set``, ``--strategy-param``, ``--hparam`` and every flag of
    :data:`FLAGS`, each stored under its dotted key only when given."""
    from edge_client.connection import add_connection_options
    from edge_client.logs import add_logging_options

    p.add_argument("--config", metavar="FILE", help="the job file (TOML); flags and --set override it")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="set_items",
                   help="set any key of the job file, dotted for sections (round.quorum=0.8)")
    p.add_argument("--strategy-param", action="append", metavar="K=V", dest="strategy_param_items",
                   help="strategy parameter (tau=0.1; the dequantizer's as dequantize.K=V)")
    p.add_argument("--hparam", action="append", metavar="K=V", dest="hparam_items",
                   help="announced hyper-parameter (lr=0.1, float_forward=int8)")
    for flag, key, kw in FLAGS:
        kw = dict(kw)
        d = default_of(key)
        if kw.get("action") != "store_true" and d not in ("", [], None):
            kw["help"] = f"{kw.get('help', '')} (default: {d})".lstrip()
        if "metavar" not in kw and "choices" not in kw and "action" not in kw:
            kw["metavar"] = {int: "N", float: "X"}.get(kw.get("type"), "VALUE")
        p.add_argument(flag, dest=key, default=argparse.SUPPRESS, **kw)
    add_connection_options(p, dest=CONNECTION_KEYS, suppress=True,
                           credentials_help="the coordinator's credentials file for --broker (fedbit "
                                            "broker-config writes DIR/coordinator.toml)")
    add_logging_options(p, dest=LOG_KEYS, suppress=True)


def job_from_args(args: argparse.Namespace) -> ServeJob:
    """The job file of ``--config`` (if any) with the flags given, then ``--strategy-param``,
    ``--hparam`` and ``--set``, applied in that order."""
    keys = {key for _, key, _ in FLAGS} | set(CONNECTION_KEYS.values()) | set(LOG_KEYS.values())
    overrides = {k: v for k, v in vars(args).items() if k in keys}
    overrides |= {f"strategy_params.{k}": v
                  for k, v in parse_assignments(args.strategy_param_items, "--strategy-param").items()}
    overrides |= {f"train.{k}": v for k, v in parse_assignments(args.hparam_items, "--hparam").items()}
    overrides |= parse_assignments(args.set_items, "--set")
    return load_job(args.config, overrides)
