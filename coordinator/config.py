"""Configuration: the TOML conventions every fedbit config file follows, and the round
loop's settings (:class:`ServerConfig`), validated as a whole.

A config file (an experiment for ``fedbit emulate``, a job for ``fedbit serve --config``) is
one TOML table checked against a :class:`TomlSchema`: known sections, each a dataclass
whose fields are its keys (:func:`section_keys`: the annotation gives the accepted types,
the field the default), plus *free* sections whose keys their consumer checks
(``[train]``, ``[strategy_params]``, ...). :meth:`TomlSchema.load` returns each section
as an instance of its dataclass, read by attribute; a section's ``check()`` validates its
values. An unknown key, a wrong type or a bad value is a :class:`ConfigError` naming the
file and the key. Command-line values reach the same table as dotted keys (``--set
round.quorum=0.8``, :func:`parse_assignments`, the one ``KEY=VALUE`` parser of every
command) and override the file's. docs/architecture.md ("Configuration") has the recipe
for a new key or section.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any

from coordinator.buffered.settings import BufferedSettings, buffered_conflict
from coordinator.defense.config import DefenseConfig
from coordinator.ops.admission import AdmissionConfig
from coordinator.privacy.config import PrivacyConfig
from coordinator.strategies.round import RoundStrategy
from edge_client.errors import ConfigError
from edge_client.hparams import validate_hparams
from edge_client.protocol import DEFAULT_LIMITS, ROUND_MODES, Limits

#: a key's accepted type(s) and default
KeySpec = tuple[type | tuple[type, ...], Any]
NUMBER = (int, float)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The table of a TOML file; ConfigError naming the file when it is missing,
    unreadable or not TOML."""
    src = Path(path)
    try:
        return tomllib.loads(src.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{src}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{src}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{src}: not valid TOML ({exc})") from None


def parse_assignments(items: list[str] | None, option: str = "--set") -> dict[str, Any]:
    """``["k=v", ...]`` -> ``{k: v}`` with TOML values (``5``, ``0.1``, ``true``, ``[0, 1]``,
    ``"x"``); anything that is not a TOML value (``paper``, ``int8``) is a string. The one
    parser of ``--set``, ``--strategy-param`` and ``--hparam``."""
    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or not k:
            raise ConfigError(f"{option}: {item!r} is not KEY=VALUE")
        try:
            out[k] = tomllib.loads(f"v = {v}")["v"]
        except tomllib.TOMLDecodeError:
            out[k] = v
    return out


def check_type(key: str, value: Any, types: type | tuple[type, ...], source: str) -> None:
    """ConfigError naming ``source`` and ``key`` unless ``value`` is one of ``types`` (a
    bool is never taken for a number)."""
    if isinstance(value, bool) and types is not bool and bool not in (types if isinstance(types, tuple) else ()) \
            or not isinstance(value, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ConfigError(f"{source}: {key}: expected {want}, got {type(value).__name__} {value!r}")


def toml_types(annotation: Any) -> type | tuple[type, ...]:
    """The TOML value types a field's annotation accepts: ``float`` takes an integer too,
    ``list[str]`` a list, ``dict[str, float]`` a table, ``str | int`` either."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, UnionType):
        out: list[type] = []
        for arg in typing.get_args(annotation):
            t = toml_types(arg)
            out += list(t) if isinstance(t, tuple) else [t]
        return tuple(dict.fromkeys(out))
    if origin is not None:
        return origin
    return NUMBER if annotation is float else annotation


def section_keys(cls: type, exclude: tuple[str, ...] = ()) -> dict[str, KeySpec]:
    """A settings dataclass's fields as a section's keys: ``{name: (types, default)}``.
    The types come from the annotation (:func:`toml_types`), or from the field's
    ``metadata["toml"]`` where the file accepts more than the attribute holds; a field
    with ``metadata["file"] = False`` is set by the program, never by the file."""
    hints = typing.get_type_hints(cls)
    out: dict[str, KeySpec] = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init or not f.metadata.get("file", True):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = (f.metadata.get("toml", toml_types(hints[f.name])), default)
    return out


def checked(section: Any, name: str, source: str) -> Any:
    """``section`` after its ``check()`` (if it has one), which raises ConfigError
    ``"key: why"``; re-raised as ``"SOURCE: NAME.key: why"``."""
    check = getattr(section, "check", None)
    if check is not None:
        try:
            check()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {name + '.' if name else ''}{exc}") from None
    return section


@dataclass(frozen=True)
class TomlSchema:
    """Sections (``""``: the top level) of ``{key: (types, default)}``, the dataclass each
    section is loaded as (``classes``; a section without one stays a dict), and the free
    sections whose keys their consumer checks."""

    sections: dict[str, dict[str, KeySpec]]
    free: tuple[str, ...] = ()
    classes: dict[str, type] = field(default_factory=dict)

    @classmethod
    def of(cls, sections: dict[str, type | dict[str, KeySpec]], free: tuple[str, ...] = ()) -> TomlSchema:
        """A schema from each section's dataclass (its keys: :func:`section_keys`) or its
        ``{key: (types, default)}``."""
        return cls({name: section_keys(c) if isinstance(c, type) else c for name, c in sections.items()}, free,
                   {name: c for name, c in sections.items() if isinstance(c, type)})

    def load(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """:meth:`validate`, then :meth:`build`."""
        return self.build(self.validate(raw, source))

    def build(self, values: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """:meth:`validate`'s sections, each that has a class as an instance of it (a
        ``float`` field holds a float, also where the file wrote an integer; not yet
        checked: :func:`checked`); the others and the free sections as they are."""
        out: dict[str, Any] = {}
        for name, table in values.items():
            cls = self.classes.get(name)
            if cls is None:
                out[name] = table
                continue
            hints = typing.get_type_hints(cls)
            out[name] = cls(**{k: float(v) if hints[k] is float and type(v) is int else copy.deepcopy(v)
                               for k, v in table.items()})
        return out

    def known(self) -> list[str]:
        """Every top-level key and section name."""
        return sorted(set(self.sections[""]) | (set(self.sections) - {""}) | set(self.free))

    def set_dotted(self, table: dict[str, Any], key: str, value: Any, source: str) -> None:
        """``table["a"]["b"] = value`` for ``key == "a.b"`` (the part after the first dot
        is the key: ``strategy_params.dequantize.ladder``); a top-level key has no dot."""
        sec, dot, name = key.partition(".")
        if not dot:
            table[sec] = value
            return
        if sec not in self.sections and sec not in self.free:
            raise ConfigError(f"{source}: {key}: unknown section {sec!r} (known: {self.known()})")
        sub = table.setdefault(sec, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{source}: {sec}: expected a table")
        sub[name] = value

    def validate(self, raw: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` with every known key (defaults filled in, types
        checked; ``""`` holds the top level) and the free sections as given (``{}`` when
        absent); ConfigError naming ``source`` and the first bad key."""
        for key in raw:
            if key not in self.sections[""] and key not in self.sections and key not in self.free:
                raise ConfigError(f"{source}: {key}: unknown key (known: {self.known()})")
        out: dict[str, dict[str, Any]] = {}
        for sec, keys in self.sections.items():
            table = raw if sec == "" else raw.get(sec, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {sec}: expected a table")
            if sec:
                for key in table:
                    if key not in keys:
                        raise ConfigError(f"{source}: {sec}.{key}: unknown key (known: {sorted(keys)})")
            values = {}
            for key, (types, default) in keys.items():
                v = table.get(key, copy.deepcopy(default))
                check_type(f"{sec}.{key}" if sec else key, v, types, source)
                values[key] = v
            out[sec] = values
        for sec in self.free:
            table = raw.get(sec, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {sec}: expected a table")
            out[sec] = copy.deepcopy(table)
        return out


def finite_number(value: Any) -> bool:
    """A real number (not a bool) that is finite."""
    return isinstance(value, NUMBER) and not isinstance(value, bool) and math.isfinite(value)


#: The largest allowed ``Limits.max_abs_value``: with ``num_samples <= 2**40`` as weights and
#: at most 10**5 updates a round, a float32 sum then stays below 1.2e38 (finite).
MAX_ABS_VALUE_CAP = 1e21


#: what the coordinator does with a collapsed aggregate (coordinator.health)
ON_COLLAPSE = ("rollback", "log")

#: what devices are told to train when a config announces nothing
DEFAULT_HPARAMS: dict[str, Any] = {"epochs": 1, "batch": 32}


@dataclass
class ServerConfig:
    """Round-loop settings (times in seconds).

    - ``fraction``: C, the fraction of present devices selected per round, clamped to
      ``[min_devices, max_devices]``;
    - ``min_present``: devices that must be present before a round starts (at least
      ``min_devices``; waited for up to ``presence_timeout_s``);
    - ``quorum``: the fraction of the selected whose accepted updates close a round early;
    - ``min_updates``: fewer accepted at the deadline keep the previous global model;
    - ``hparams``: local training hyper-parameters announced to devices (the keys and
      ranges of :data:`edge_client.hparams.HPARAMS`; the strategy adds what it needs);
    - ``strategy``/``strategy_params``: recorded in metrics and checkpoints;
    - ``limits``: the protocol limits, ``max_abs_value`` included (at most
      :data:`MAX_ABS_VALUE_CAP`);
    - ``admission``: enrolment, the ``num_samples`` bound, hello rates, registry size
      (:class:`~coordinator.ops.admission.AdmissionConfig`);
    - ``on_collapse``: what a collapsed aggregate does (:mod:`coordinator.health`):
      ``rollback`` to the last healthy model, or ``log`` it and keep it;
    - ``ack_timeout_s``: a selected device that acknowledged earlier rounds but not this
      one within this time is a straggler at once (:mod:`coordinator.presence.roundwatch`; 0: off);
    - ``defense``: poisoning resistance (:class:`~coordinator.defense.config.DefenseConfig`);
    - ``privacy``: secure aggregation and differential privacy
      (:class:`~coordinator.privacy.config.PrivacyConfig`);
    - ``mode``: ``sync`` (rounds) or ``buffered`` (``coordinator.buffered``: ``rounds``
      buffer applications, ``buffered`` its settings; ``fraction``, ``quorum`` and
      ``min_updates`` unused, ``round_timeout_s`` bounds how long a request is held).
    """

    job: str = "default"
    model: str = "digits_cnn"
    rounds: int = 10
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
    hparams: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_HPARAMS))
    seed: int = 0
    limits: Limits = DEFAULT_LIMITS
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    on_collapse: str = "rollback"
    ack_timeout_s: float = 10.0
    defense: DefenseConfig = field(default_factory=DefenseConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    mode: str = "sync"
    buffered: BufferedSettings = field(default_factory=BufferedSettings)

    def validate(self, strategy: RoundStrategy | None = None) -> None:
        """ConfigError naming the first bad setting; with ``strategy``, also a configured
        hyper-parameter that contradicts what it announces (``Strategy.device_hparams``)."""
        if self.rounds < 1:
            raise ConfigError(f"rounds: must be >= 1, got {self.rounds}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction: must be in (0, 1], got {self.fraction}")
        if not 0.0 < self.quorum <= 1.0:
            raise ConfigError(f"quorum: must be in (0, 1], got {self.quorum}")
        if self.min_updates < 1:
            raise ConfigError(f"min_updates: must be >= 1, got {self.min_updates}")
        if self.min_devices < 1 or self.max_devices < self.min_devices:
            raise ConfigError(f"min/max devices: need 1 <= {self.min_devices} <= {self.max_devices}")
        if self.round_timeout_s <= 0 or self.presence_timeout_s <= 0:
            raise ConfigError("round_timeout_s and presence_timeout_s must be > 0")
        if not finite_number(self.ack_timeout_s) or self.ack_timeout_s < 0:
            raise ConfigError(f"ack_timeout_s: must be >= 0 (0: off), got {self.ack_timeout_s!r}")
        v = self.limits.max_abs_value
        if not (isinstance(v, int | float) and 0.0 < v <= MAX_ABS_VALUE_CAP):
            raise ConfigError(f"limits.max_abs_value: must be in (0, {MAX_ABS_VALUE_CAP:g}], got {v!r} "
                              f"(larger values let the float32 sums overflow)")
        if self.on_collapse not in ON_COLLAPSE:
            raise ConfigError(f"on_collapse: {self.on_collapse!r} is not one of {list(ON_COLLAPSE)}")
        self.admission.validate()
        try:
            self.defense.check()
        except ConfigError as exc:
            raise ConfigError(f"defense.{exc}") from None
        self.privacy.validate(self.strategy, self.strategy_params)
        validate_hparams(self.hparams)
        if self.mode not in ROUND_MODES:
            raise ConfigError(f"round.mode: {self.mode!r} is not one of {sorted(ROUND_MODES)}")
        if self.mode == "buffered":
            self.buffered.validate()
            why = buffered_conflict(self.strategy, self.strategy_params)
            if why:
                raise ConfigError(f"strategy {self.strategy!r} cannot run with round.mode = \"buffered\": {why}")
            if self.hparams.get("content", "delta") != "delta":
                raise ConfigError("train.content: buffered mode needs updates relative to the version each "
                                  f"device started from (\"delta\"), got {self.hparams['content']!r}")
            if self.privacy.secure_aggregation or self.privacy.dp:
                raise ConfigError("[privacy]: secure aggregation and differential privacy run in rounds (masks "
                                  "over one round's selected devices; the accountant composes rounds), not with "
                                  "round.mode = \"buffered\"")
        if strategy is not None:
            strategy.device_hparams(self.hparams)
