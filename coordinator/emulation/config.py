"""Emulator experiments as TOML files: :class:`ExperimentConfig`, validation, sweeps.

A config (``fedbit emulate FILE``; the bundled default is ``coordinator/emulation/default.toml``)::

    name = "demo"              # names the run folder
    model = "digits_cnn"       # a firmware_models spec
    rounds = 12
    seeds = [0]                # every run (and every sweep combination) once per seed
    strategy = "fedshift"      # coordinator.strategies name
    transport = "inproc"       # (default: no sockets) | "mqtt" (embedded broker, or `broker`)
    broker = ""                # an external broker URL instead of the embedded one
    on_collapse = "rollback"   # a collapsed aggregate (coordinator.health): rollback | log

    [strategy_params]          # build_strategy(strategy, **strategy_params)
    [devices]                  # hardware profile (bundled name or TOML path) = device count
    raspberry-pi-4 = 4
    [codecs]                   # uplink override per profile: "<codec>-<bits>"
    raspberry-pi-5 = "kmeans-4"
    [data]                     # dataset (digits, fashion-mnist, mnist, cifar10, idx, npz), path,
                               # partition, shards_per_device, alpha, per_device, validation
                               # (the fraction of the training split held out for choices;
                               # drawn with `seed`), seed, inferior (the [devices] profiles
                               # that hold the odd labels of the parity split; default:
                               # integer devices and lossy uplinks)
    [train]                    # announced to devices: epochs, batch, steps, ... (any key)
    [round]                    # fraction, quorum, min_updates, deadline_s (simulated),
                               # wall_timeout_s, workers (processes or actors that train
                               # the devices; 0: one per core / per Ray CPU; 1: this
                               # process), parallel (devices training at once per worker),
                               # engine ("cpu" | "cuda": the integer devices of a round
                               # train together on the GPU, same results); mode = "sync" |
                               # "buffered" (coordinator.buffered: buffer_size, concurrency,
                               # server_lr, max_staleness, staleness; deadline_s then bounds
                               # how long a request holds a slot)
    [availability]             # model = "none" | "diurnal" | "trace", trace (CSV: device,start,
                               # end), start_hour, time_scale, [availability.profiles.<profile>]
                               # (coordinator.emulation.availability)
    [cluster]                  # backend = "local" (processes here) | "ray"; address = "auto"
                               # | "host:port" | "ray://host:port" | "local" (a new Ray here)
    [clock]                    # seconds_per_sample = {variant = s}: pin the compute model;
                               # until_s: end the run at this simulated time (0: `rounds` ends it);
                               # eval_every_s: score only once per this many simulated s (0: every round)
    [stop]                     # plateau = true: stop at a plateau of the validation accuracy
                               # (window, min_delta, min_rounds; rounds is the maximum;
                               # coordinator.emulation.stopping)
    [privacy]                  # secure aggregation and DP, as fedbit serve's job
                               # (coordinator.privacy.config)
    [defense]                  # the round loop's poisoning defense (coordinator.defense.config):
                               # norm_bound, sample_bound, hold, strikes, window
    [attack]                   # emulated attackers (coordinator.emulation.attack): devices
                               # or fraction, kind, factor, from_round

``paper = "<name>"`` (``coordinator.emulation.papers``: fedshift, prowd, prowd-fedprox, prowd-grouped,
prowd-grouped-asym, fedfor, fedwsq) starts from that paper's strategy, its parameters and
the settings it trains devices with; the config's own keys override them.
    [sweep]                    # dotted key = [values]: every combination is run
    baseline = "fedavg"        # paired differences of every method to this value (analysis)
    tune = "train.lr"          # chosen per combination of the others on the validation split;
                               # or a table: a bracket per method, tuning seeds apart
                               # (coordinator.emulation.tuning)
    strategy = ["fedavg", "fedshift"]
    "data.partition" = ["shards", "parity"]
    "@mix" = [                 # "@name": values set together, each a table with a label
      {label = "50/50", "devices.raspberry-pi-4" = 5, "devices.desktop" = 5},
      {label = "80/20", "devices.raspberry-pi-4" = 8, "devices.desktop" = 2}]

``extends = "other.toml"`` (a path relative to this file) starts from that config: this
file's tables are merged over its tables key by key, any other value replaces the base's
(a sweep dimension given here replaces the base's whole list). An experiment too long to
run at once is cut this way into parts that share one text: ``fmnist-fedfor-dirichlet.toml``
is ``fmnist-fedfor.toml`` with another name and another ``"@split"``.

``target_accuracy`` (0 < t <= 1, optional) makes the reports count the rounds and the
simulated seconds each group's model takes to reach it.

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
file and the key.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config import (
    DEFAULT_HPARAMS,
    ON_COLLAPSE,
    ServerConfig,
    TomlSchema,
    checked,
    read_toml,
    section_keys,
)
from coordinator.defense.config import DefenseConfig
from coordinator.emulation.attack import AttackConfig
from coordinator.emulation.sections import (
    AvailabilitySettings,
    ClockSettings,
    ClusterSettings,
    DataSettings,
    RoundSettings,
    StopSettings,
)
from coordinator.privacy.config import PrivacyConfig
from edge_client.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")

_SERVER = ServerConfig()


@dataclass
class ExperimentConfig:
    """One emulator experiment (see the module docstring); ``source`` names the file.

    The top-level keys are the fields up to ``on_collapse``; ``data``, ``round``,
    ``cluster`` and ``clock`` (:mod:`coordinator.emulation.sections`) and ``privacy``
    (:class:`~coordinator.privacy.config.PrivacyConfig`) are the sections with fixed keys;
    ``strategy_params``, ``devices``, ``codecs``, ``train`` and ``sweep`` are free tables
    whose keys their consumer checks."""

    name: str = "run"
    model: str = _SERVER.model
    rounds: int = _SERVER.rounds
    seeds: list[int] = field(default_factory=lambda: [0])
    strategy: str = _SERVER.strategy
    transport: str = "inproc"
    broker: str = ""
    target_accuracy: float = 0.0
    paper: str = ""
    on_collapse: str = _SERVER.on_collapse
    strategy_params: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)
    codecs: dict[str, str] = field(default_factory=dict)
    data: DataSettings = field(default_factory=DataSettings)
    train: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_HPARAMS))
    round: RoundSettings = field(default_factory=RoundSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    clock: ClockSettings = field(default_factory=ClockSettings)
    stop: StopSettings = field(default_factory=StopSettings)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    availability: AvailabilitySettings = field(default_factory=AvailabilitySettings)
    #: the round loop's poisoning defense (``[defense]``), and emulated attackers (``[attack]``)
    defense: DefenseConfig = field(default_factory=DefenseConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    sweep: dict[str, list[Any]] = field(default_factory=dict)
    source: str = field(default="<config>", metadata={"file": False})
    #: the paper's settings of the strategy's own stages (``swa.<key>``, ``dequantize.<key>``;
    #: ``papers.PaperSettings.stage_params``), under the config's own ``strategy_params``
    paper_stage_params: dict[str, Any] = field(default_factory=dict, metadata={"file": False})

    def build_params(self) -> dict[str, Any]:
        """The strategy's parameters as the run builds it: the paper's stage settings, then
        the config's own ``strategy_params`` over them."""
        return self.paper_stage_params | self.strategy_params

    def as_dict(self) -> dict[str, Any]:
        """The config as the TOML table it came from (for reports and run folders)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("file", True):
                v = getattr(self, f.name)
                out[f.name] = dataclasses.asdict(v) if f.name in SCHEMA.classes else copy.deepcopy(v)
        return out


#: the file's sections with fixed keys, and the free tables
SECTIONS = {"data": DataSettings, "round": RoundSettings, "cluster": ClusterSettings, "clock": ClockSettings,
            "stop": StopSettings, "privacy": PrivacyConfig, "defense": DefenseConfig, "attack": AttackConfig,
            "availability": AvailabilitySettings}
FREE = ("strategy_params", "devices", "codecs", "train", "sweep")
SCHEMA = TomlSchema.of(
    {"": section_keys(ExperimentConfig, exclude=(*SECTIONS, *FREE)), **SECTIONS},
    free=FREE)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read and validate a config file (None: the bundled default), then apply dotted
    ``overrides`` (``{"rounds": 3, "round.deadline_s": 20}``)."""
    src = Path(path) if path is not None else DEFAULT_CONFIG
    raw = read_extended(src)
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value, str(src))
    return from_dict(raw, str(src))


def read_extended(src: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The table of config file ``src`` with its ``extends`` base (module docstring) merged
    under it; ConfigError naming the file for a missing base, a non-string or a cycle."""
    raw = read_toml(src)
    base = raw.pop("extends", None)
    if base is None or base == "":  # "": none, the documented default
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{src}: extends: expected the file name of a config, got {base!r}")
    path = (src.parent / base).resolve()
    chain = (*chain, src.resolve())
    if path in chain:
        raise ConfigError(f"{src}: extends: {base!r} leads back to a file of this chain (a cycle)")
    if not path.is_file():
        raise ConfigError(f"{src}: extends: no config file {path}")
    return _merged(read_extended(path, chain), raw)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged over ``base``: tables key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def set_dotted(table: dict[str, Any], key: str, value: Any, source: str) -> None:
    """``table["a"]["b"] = value`` for ``key == "a.b"`` (:meth:`TomlSchema.set_dotted`)."""
    SCHEMA.set_dotted(table, key, value, source)


def from_dict(raw: dict[str, Any], source: str = "<config>") -> ExperimentConfig:
    """Validate a config table; ConfigError naming ``source`` and the key."""
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {why}")

    raw = copy.deepcopy(raw)
    if raw.get("paper"):  # a paper's settings first; the config's own keys override them
        from coordinator.emulation.papers import paper_settings

        for sec in ("strategy_params", "train"):
            if not isinstance(raw.get(sec, {}), dict):
                raise bad(sec, "expected a table")
        try:
            ps = paper_settings(str(raw["paper"]), **raw.get("train", {}))
        except ConfigError as exc:
            raise bad("paper", str(exc)) from None
        raw.setdefault("strategy", ps.strategy)
        raw["strategy_params"] = ps.strategy_params | raw.get("strategy_params", {})
        raw["train"] = ps.hparams
        if ps.int_codec:
            _paper_codecs(raw, ps.int_codec, bad)
    values = SCHEMA.load(raw, source)
    cfg = ExperimentConfig(source=source, **values.pop(""))
    for sec, table in values.items():
        if sec in SCHEMA.free and sec not in raw:
            continue  # the dataclass default (e.g. [train]: DEFAULT_HPARAMS)
        setattr(cfg, sec, table)
    if cfg.paper:
        _paper_stages(cfg, ps.stage_params)
    _check_values(cfg, bad)
    return cfg


def _paper_codecs(raw: dict[str, Any], codec: str, bad) -> None:
    """The paper's integer uplink for every integer profile of ``[devices]`` that the
    config's ``[codecs]`` leaves out."""
    from hw_profiles import load_profile

    devices, codecs = raw.get("devices", {}), raw.setdefault("codecs", {})
    if not isinstance(devices, dict) or not isinstance(codecs, dict):
        return  # the schema names the bad section
    for name in devices:
        try:
            prof = load_profile(name)
        except ValueError as exc:
            raise bad(f"devices.{name}", str(exc)) from None
        if prof.trainer == "int":
            codecs.setdefault(name, codec)


def _paper_stages(cfg: ExperimentConfig, stage_params: dict[str, Any]) -> None:
    """Keep the paper's stage settings the strategy has a stage for (and the config does
    not set itself)."""
    from coordinator.strategies import strategy_stages

    own = cfg.strategy_params
    stages = strategy_stages(cfg.strategy, own)

    def set_by_config(key: str) -> bool:
        stage, _, name = key.partition(".")
        if key in own:
            return True
        return name in (own if stage == "swa" else own.get("dequantize_params") or {})

    cfg.paper_stage_params = {k: v for k, v in stage_params.items()
                              if k.partition(".")[0] in stages and not set_by_config(k)}


def _check_values(cfg: ExperimentConfig, bad) -> None:
    from coordinator.strategies import available_strategies, build_strategy
    from firmware_models import SpecError, is_model_file, resolve_model

    if is_model_file(cfg.model):  # a user's model file: relative to the config's folder, else the cwd
        near = Path(cfg.source).parent / cfg.model
        cfg.model = str((near if near.is_file() and not Path(cfg.model).is_absolute() else Path(cfg.model)).resolve())
    try:
        resolve_model(cfg.model)
    except SpecError as exc:
        raise bad("model", str(exc)) from None
    if cfg.rounds < 1:
        raise bad("rounds", f"must be >= 1, got {cfg.rounds}")
    if not cfg.seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in cfg.seeds):
        raise bad("seeds", f"must be a non-empty list of integers >= 0, got {cfg.seeds!r}")
    if cfg.strategy not in available_strategies():
        raise bad("strategy", f"{cfg.strategy!r} is not one of {available_strategies()}")
    if cfg.transport not in ("mqtt", "inproc"):
        raise bad("transport", f"{cfg.transport!r} is not 'mqtt' or 'inproc'")
    if cfg.on_collapse not in ON_COLLAPSE:
        raise bad("on_collapse", f"{cfg.on_collapse!r} is not one of {list(ON_COLLAPSE)}")
    if cfg.broker and cfg.transport != "mqtt":
        raise bad("broker", "an external broker needs transport = \"mqtt\"")
    if not cfg.devices:
        raise bad("devices", "no devices: give `profile = count` entries")
    for prof, n in cfg.devices.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise bad(f"devices.{prof}", f"count must be an integer >= 0, got {n!r}")
    if sum(cfg.devices.values()) < 1:
        raise bad("devices", "all counts are 0")
    for prof, spec in cfg.codecs.items():
        if prof not in cfg.devices:
            raise bad(f"codecs.{prof}", "not a profile listed in [devices]")
        parse_codec(spec, f"codecs.{prof}", bad)
    _check_profiles(cfg, bad)
    checked(cfg.data, "data", cfg.source)
    for prof in cfg.data.inferior:
        if prof not in cfg.devices:
            raise bad("data.inferior", f"{prof!r} is not a profile listed in [devices]")
    checked(cfg.round, "round", cfg.source)
    checked(cfg.cluster, "cluster", cfg.source)
    checked(cfg.clock, "clock", cfg.source)
    checked(cfg.availability, "availability", cfg.source)
    checked(cfg.defense, "defense", cfg.source)
    checked(cfg.attack, "attack", cfg.source)
    checked(cfg.stop, "stop", cfg.source)
    if cfg.stop.plateau and not cfg.data.validation > 0 and "data.validation" not in cfg.sweep:
        raise bad("stop.plateau", "the plateau is read on the validation split: set data.validation "
                                  "(e.g. 0.1); the test split never stops a run")
    _check_mode(cfg, bad)
    _check_availability(cfg, bad)
    for key, t in cfg.train.items():
        if isinstance(t, dict | list):
            raise bad(f"train.{key}", "must be a number, boolean or string")
    try:  # the strategy's parameters, and the announced settings as the coordinator checks them
        build_strategy(cfg.strategy, **cfg.build_params()).device_hparams(cfg.train)
    except ConfigError as exc:
        raise bad("[strategy_params] / [train]", str(exc)) from None
    try:
        cfg.privacy.validate(cfg.strategy, cfg.build_params())
    except ConfigError as exc:
        raise bad("[privacy]", str(exc)) from None
    if not 0 <= cfg.target_accuracy <= 1:
        raise bad("target_accuracy", f"must be in (0, 1] (0: none), got {cfg.target_accuracy}")
    from coordinator.emulation.analysis import ANALYSIS_KEYS, check_analysis

    for key, values in cfg.sweep.items():
        if key in ANALYSIS_KEYS:
            continue
        if not isinstance(values, list) or not values:
            raise bad(f"sweep.{key}", "must be a non-empty list of values")
        if key in ("sweep", "seeds"):
            raise bad(f"sweep.{key}", "cannot be swept (seeds: list them in `seeds`)")
        if key.startswith("@") and not all(
                isinstance(v, dict) and isinstance(v.get("label"), str) and len(v) > 1 for v in values):
            raise bad(f"sweep.{key}", "each value must be a table with a `label` and the keys it sets")
    try:
        check_analysis(cfg.sweep)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.source}: {exc}") from None
    from coordinator.emulation.analysis import dimensions
    from coordinator.emulation.tuning import check_tune, is_table

    if is_table(cfg.sweep.get("tune")) and dimensions(cfg.sweep):
        try:
            check_tune(cfg.sweep["tune"], dimensions(cfg.sweep), cfg.seeds)
        except ConfigError as exc:
            raise ConfigError(f"{cfg.source}: {exc}") from None
    if cfg.sweep.get("tune") and not cfg.data.validation > 0 and "data.validation" not in cfg.sweep:
        raise bad("sweep.tune", "tuning chooses on the validation split: set data.validation "
                                "(e.g. 0.1); the test split is only reported")


def _check_mode(cfg: ExperimentConfig, bad) -> None:
    """Buffered mode's strategy, content and privacy, as ``fedbit serve`` checks them."""
    from coordinator.buffered.settings import buffered_conflict

    if cfg.round.mode != "buffered":
        return
    why = buffered_conflict(cfg.strategy, cfg.build_params())
    if why:
        raise bad("strategy", f"{cfg.strategy!r} cannot run with round.mode = \"buffered\": {why}")
    if cfg.train.get("content", "delta") != "delta":
        raise bad("train.content", "buffered mode needs updates relative to the version each device started "
                                   f"from (\"delta\"), got {cfg.train['content']!r}")
    if cfg.privacy.active:
        raise bad("privacy", "secure aggregation and differential privacy run in rounds, not with round.mode = "
                             "\"buffered\"")
    if cfg.round.engine == "cuda":
        raise bad("round.engine", "the GPU engine trains a round's integer devices as one batch; buffered mode "
                                  "starts each request's device on its own (use engine = \"cpu\")")


def _check_availability(cfg: ExperimentConfig, bad) -> None:
    """A trace file relative to the config's folder (else the cwd); the profile overrides."""
    from coordinator.emulation.availability import profile_overrides

    av = cfg.availability
    if av.trace and not Path(av.trace).is_absolute():
        near = Path(cfg.source).parent / av.trace
        av.trace = str(near.resolve() if near.is_file() else Path(av.trace).resolve())
    profile_overrides(av.profiles, cfg.source)


def _check_profiles(cfg: ExperimentConfig, bad) -> None:
    """Every ``[devices]`` profile loads (a bundled name or a TOML file) and takes its
    ``[codecs]`` override (an integer-only codec, ``int``, only on an integer device)."""
    from edge_client.codecs import get_codec
    from hw_profiles import load_profile

    for name in cfg.devices:
        try:
            prof = load_profile(name)
        except ValueError as exc:
            raise bad(f"devices.{name}", str(exc)) from None
        codec = parse_codec(cfg.codecs[name], f"codecs.{name}", bad)[0] if name in cfg.codecs else None
        if codec is not None and get_codec(codec).integer_only and prof.trainer != "int":
            raise bad(f"codecs.{name}", f"codec {codec!r} needs an integer device")


def parse_codec(spec: Any, key: str = "codec", bad=None) -> tuple[str, int]:
    """``"kmeans-4"`` -> ``("kmeans", 4)``; ``"float32"`` -> ``("float32", 32)``."""
    from edge_client.protocol import CODEC_BITS

    def fail(why: str) -> ConfigError:
        return bad(key, why) if bad else ConfigError(f"{key}: {why}")

    if not isinstance(spec, str):
        raise fail(f"expected a string like \"kmeans-4\", got {spec!r}")
    name, dash, bits = spec.partition("-")
    if name not in CODEC_BITS:
        raise fail(f"codec {name!r} is not one of {sorted(CODEC_BITS)}")
    lo, hi = CODEC_BITS[name]
    if not dash and lo == hi:
        return name, hi  # float32, float16, ternary: one width
    b = int(bits) if bits.isdigit() else -1
    if not lo <= b <= hi:
        raise fail(f"{spec!r}: expected \"{name}-<bits>\" with bits in {lo}..{hi}")
    return name, b


def expand_sweep(cfg: ExperimentConfig) -> list[tuple[dict[str, Any], ExperimentConfig]]:
    """``[(combination, config)]``: one config per combination of the sweep's values (the
    config itself when there is no sweep), validated, with the sweep's dimensions removed
    (its ``baseline`` and ``tune`` are kept: they say how to read the results)."""
    from coordinator.emulation.analysis import ANALYSIS_KEYS

    keys = [k for k in cfg.sweep if k not in ANALYSIS_KEYS]
    if not keys:
        return [({}, cfg)]
    out = []
    for values in itertools.product(*(cfg.sweep[k] for k in keys)):
        raw = cfg.as_dict()
        raw["sweep"] = {k: v for k, v in cfg.sweep.items() if k in ANALYSIS_KEYS}
        combo = {}
        for k, v in zip(keys, values, strict=True):
            if k.startswith("@"):  # a group of keys set together, named by its label
                combo[k[1:]] = v["label"]
                for kk, vv in v.items():
                    if kk != "label":
                        set_dotted(raw, kk, vv, f"{cfg.source} [sweep.{k}]")
            else:
                combo[k] = v
                set_dotted(raw, k, v, f"{cfg.source} [sweep]")
        out.append((combo, from_dict(raw, f"{cfg.source} [sweep {combo}]")))
    return out


def run_slug(combo: dict[str, Any]) -> str:
    """A folder name for a sweep combination (``strategy-fedshift_data.partition-parity``)."""
    text = "_".join(f"{k}-{v}" for k, v in combo.items()) or "default"
    return "".join(c if c.isalnum() or c in ".-_" else "-" for c in text)[:120]
