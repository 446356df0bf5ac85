"""Emulator experiments as TOML files: :class:`ExperimentConfig`, validation, sweeps.

A config (``fedbit emulate FILE``; the bundled default is ``coordinator/default.toml``)::

    name = "demo"              # names the run folder
    model = "digits_cnn"       # a firmware_models spec
    rounds = 12
    seeds = [0]                # every run (and every sweep combination) once per seed
    strategy = "fedshift"      # coordinator.strategies name
    transport = "mqtt"         # "mqtt" (embedded broker, or `broker`) | "inproc" (no sockets)
    broker = ""                # an external broker URL instead of the embedded one

    [strategy_params]          # build_strategy(strategy, **strategy_params)
    [devices]                  # hardware profile (bundled name or TOML path) = device count
    raspberry-pi-4 = 4
    [codecs]                   # uplink override per profile: "<codec>-<bits>"
    raspberry-pi-5 = "kmeans-4"
    [data]                     # dataset, path, partition, shards_per_device, alpha, per_device
    [train]                    # announced to devices: epochs, batch, steps, ... (any key)
    [round]                    # fraction, quorum, min_updates, deadline_s (simulated),
                               # wall_timeout_s, parallel (devices training at once)
    [clock]                    # seconds_per_sample = {variant = s}: pin the compute model

``paper = "<name>"`` (``coordinator.papers``: fedshift, prowd, prowd-fedprox, prowd-grouped,
prowd-grouped-asym, fedfor, fedwsq) starts from that paper's strategy, its parameters and
the settings it trains devices with; the config's own keys override them.
    [sweep]                    # dotted key = [values]: every combination is run
    strategy = ["fedavg", "fedshift"]
    "data.partition" = ["shards", "parity"]
    "@mix" = [                 # "@name": values set together, each a table with a label
      {label = "50/50", "devices.raspberry-pi-4" = 5, "devices.desktop" = 5},
      {label = "80/20", "devices.raspberry-pi-4" = 8, "devices.desktop" = 2}]

``target_accuracy`` (0 < t <= 1, optional) makes the reports count the rounds and the
simulated seconds each group's model takes to reach it.

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
file and the key.
"""

from __future__ import annotations

import copy
import itertools
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.datasets import DATASETS, PARTITIONS
from edge_client.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")

#: section -> key -> (type, default); "" is the top level
SCHEMA: dict[str, dict[str, tuple[type | tuple[type, ...], Any]]] = {
    "": {"name": (str, "run"), "model": (str, "digits_cnn"), "rounds": (int, 10), "seeds": (list, [0]),
         "strategy": (str, "fedavg"), "transport": (str, "inproc"), "broker": (str, ""),
         "target_accuracy": ((int, float), 0.0), "paper": (str, "")},
    "data": {"dataset": (str, "digits"), "path": (str, ""), "partition": (str, "iid"),
             "shards_per_device": (int, 2), "alpha": ((int, float), 0.5), "per_device": (int, 32),
             "seed": (int, 0)},
    "round": {"fraction": ((int, float), 1.0), "quorum": ((int, float), 1.0), "min_updates": (int, 1),
              "deadline_s": ((int, float), 0.0), "wall_timeout_s": ((int, float), 600.0),
              "parallel": (int, 2)},
    "clock": {"seconds_per_sample": (dict, {})},
}
#: sections whose keys are free (validated by what consumes them)
FREE = ("strategy_params", "devices", "codecs", "train", "sweep")


@dataclass
class ExperimentConfig:
    """One emulator experiment (see the module docstring); ``source`` names the file."""

    name: str = "run"
    model: str = "digits_cnn"
    rounds: int = 10
    seeds: list[int] = field(default_factory=lambda: [0])
    strategy: str = "fedavg"
    transport: str = "inproc"
    broker: str = ""
    target_accuracy: float = 0.0
    paper: str = ""
    strategy_params: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)
    codecs: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=lambda: {"epochs": 1, "batch": 32})
    round: dict[str, Any] = field(default_factory=dict)
    clock: dict[str, Any] = field(default_factory=dict)
    sweep: dict[str, list[Any]] = field(default_factory=dict)
    source: str = "<config>"

    def as_dict(self) -> dict[str, Any]:
        """The config as the TOML table it came from (for reports and run folders)."""
        keys = ("name", "model", "rounds", "seeds", "strategy", "transport", "broker", "target_accuracy", "paper")
        out: dict[str, Any] = {k: copy.deepcopy(getattr(self, k)) for k in keys}
        for sec in ("strategy_params", "devices", "codecs", "data", "train", "round", "clock", "sweep"):
            out[sec] = copy.deepcopy(getattr(self, sec))
        return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read and validate a config file (None: the bundled default), then apply dotted
    ``overrides`` (``{"rounds": 3, "round.deadline_s": 20}``)."""
    src = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        raw = tomllib.loads(src.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{src}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{src}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{src}: not valid TOML ({exc})") from None
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value, str(src))
    return from_dict(raw, str(src))


def set_dotted(table: dict[str, Any], key: str, value: Any, source: str) -> None:
    """``table["a"]["b"] = value`` for ``key == "a.b"`` (a top-level key has no dot)."""
    sec, dot, name = key.partition(".")
    if not dot:
        table[sec] = value
        return
    if sec not in SCHEMA and sec not in FREE:
        raise ConfigError(f"{source}: {key}: unknown section {sec!r}")
    sub = table.setdefault(sec, {})
    if not isinstance(sub, dict):
        raise ConfigError(f"{source}: {sec}: expected a table")
    sub[name] = value


def from_dict(raw: dict[str, Any], source: str = "<config>") -> ExperimentConfig:
    """Validate a config table; ConfigError naming ``source`` and the key."""
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {why}")

    raw = copy.deepcopy(raw)
    if raw.get("paper"):  # a paper's settings first; the config's own keys override them
        from coordinator.papers import paper_settings

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
    cfg = ExperimentConfig(source=source)
    for key in raw:
        if key not in SCHEMA[""] and key not in SCHEMA and key not in FREE:
            raise bad(key, f"unknown key (known: {sorted(set(SCHEMA['']) | set(SCHEMA) - {''} | set(FREE))})")
    for key, (tp, default) in SCHEMA[""].items():
        v = raw.get(key, copy.deepcopy(default))
        _check_type(key, v, tp, bad)
        setattr(cfg, key, v)
    for sec in ("data", "round", "clock"):
        table = raw.get(sec, {})
        if not isinstance(table, dict):
            raise bad(sec, "expected a table")
        for key in table:
            if key not in SCHEMA[sec]:
                raise bad(f"{sec}.{key}", f"unknown key (known: {sorted(SCHEMA[sec])})")
        values = {}
        for key, (tp, default) in SCHEMA[sec].items():
            v = table.get(key, copy.deepcopy(default))
            _check_type(f"{sec}.{key}", v, tp, bad)
            values[key] = v
        setattr(cfg, sec, values)
    for sec in FREE:
        table = raw.get(sec, getattr(cfg, sec))
        if not isinstance(table, dict):
            raise bad(sec, "expected a table")
        setattr(cfg, sec, table)
    _check_values(cfg, bad)
    return cfg


def _check_type(key: str, v: Any, tp: type | tuple[type, ...], bad) -> None:
    if isinstance(v, bool) and tp is not bool or not isinstance(v, tp):
        want = " or ".join(t.__name__ for t in (tp if isinstance(tp, tuple) else (tp,)))
        raise bad(key, f"expected {want}, got {type(v).__name__} {v!r}")


def _check_values(cfg: ExperimentConfig, bad) -> None:
    from coordinator.strategies import available_strategies, build_strategy
    from firmware_models import MODELS

    if cfg.model not in MODELS:
        raise bad("model", f"{cfg.model!r} is not one of {sorted(MODELS)}")
    if cfg.rounds < 1:
        raise bad("rounds", f"must be >= 1, got {cfg.rounds}")
    if not cfg.seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in cfg.seeds):
        raise bad("seeds", f"must be a non-empty list of integers >= 0, got {cfg.seeds!r}")
    if cfg.strategy not in available_strategies():
        raise bad("strategy", f"{cfg.strategy!r} is not one of {available_strategies()}")
    if cfg.transport not in ("mqtt", "inproc"):
        raise bad("transport", f"{cfg.transport!r} is not 'mqtt' or 'inproc'")
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
    d = cfg.data
    if d["dataset"] not in DATASETS:
        raise bad("data.dataset", f"{d['dataset']!r} is not one of {list(DATASETS)}")
    if d["partition"] not in PARTITIONS:
        raise bad("data.partition", f"{d['partition']!r} is not one of {list(PARTITIONS)}")
    if not d["alpha"] > 0:
        raise bad("data.alpha", f"must be > 0, got {d['alpha']}")
    for key in ("shards_per_device", "per_device"):
        if d[key] < 1:
            raise bad(f"data.{key}", f"must be >= 1, got {d[key]}")
    r = cfg.round
    if not 0 < r["fraction"] <= 1:
        raise bad("round.fraction", f"must be in (0, 1], got {r['fraction']}")
    if not 0 < r["quorum"] <= 1:
        raise bad("round.quorum", f"must be in (0, 1], got {r['quorum']}")
    if r["min_updates"] < 1:
        raise bad("round.min_updates", f"must be >= 1, got {r['min_updates']}")
    if not (r["deadline_s"] >= 0 and math.isfinite(r["deadline_s"])):
        raise bad("round.deadline_s", f"must be >= 0 (0: no simulated deadline), got {r['deadline_s']}")
    if not r["wall_timeout_s"] > 0:
        raise bad("round.wall_timeout_s", f"must be > 0, got {r['wall_timeout_s']}")
    if r["parallel"] < 1:
        raise bad("round.parallel", f"must be >= 1, got {r['parallel']}")
    for v, s in cfg.clock["seconds_per_sample"].items():
        if isinstance(s, bool) or not isinstance(s, int | float) or not (s > 0 and math.isfinite(s)):
            raise bad(f"clock.seconds_per_sample.{v}", f"must be a number > 0, got {s!r}")
    for key, t in cfg.train.items():
        if isinstance(t, dict | list):
            raise bad(f"train.{key}", "must be a number, boolean or string")
    try:  # the strategy's parameters, and the announced settings as the coordinator checks them
        build_strategy(cfg.strategy, **cfg.strategy_params).device_hparams(cfg.train)
    except ConfigError as exc:
        raise bad("[strategy_params] / [train]", str(exc)) from None
    if not 0 <= cfg.target_accuracy <= 1:
        raise bad("target_accuracy", f"must be in (0, 1] (0: none), got {cfg.target_accuracy}")
    for key, values in cfg.sweep.items():
        if not isinstance(values, list) or not values:
            raise bad(f"sweep.{key}", "must be a non-empty list of values")
        if key in ("sweep", "seeds"):
            raise bad(f"sweep.{key}", "cannot be swept (seeds: list them in `seeds`)")
        if key.startswith("@") and not all(
                isinstance(v, dict) and isinstance(v.get("label"), str) and len(v) > 1 for v in values):
            raise bad(f"sweep.{key}", "each value must be a table with a `label` and the keys it sets")


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
    config itself when there is no sweep), validated, with the sweep removed."""
    if not cfg.sweep:
        return [({}, cfg)]
    keys = list(cfg.sweep)
    out = []
    for values in itertools.product(*(cfg.sweep[k] for k in keys)):
        raw = cfg.as_dict()
        raw["sweep"] = {}
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


def run_experiment(cfg: ExperimentConfig, out: str | Path, *,
                   on_event: Any = None, echo: Any = print) -> Path:
    """Run every sweep combination with every seed (``coordinator.emulator.Emulator``)
    and write the reports. One run goes to ``out`` itself; several to
    ``out/runs/<combination>/seed-<k>/`` with a sweep summary in ``out``. Returns the
    path of the top ``summary.md``. ``on_event(rounds)`` makes each run's progress
    callback; ``echo`` prints what runs."""
    from coordinator.emulator import Emulator
    from coordinator.report import combo_label, write_report, write_sweep_report

    out = Path(out)
    combos = expand_sweep(cfg)
    single = len(combos) == 1 and len(cfg.seeds) == 1
    runs = []
    for combo, c in combos:
        for seed in c.seeds:
            run_dir = out if single else out / "runs" / run_slug(combo) / f"seed-{seed}"
            if not single:
                echo(f"run {len(runs) + 1}/{len(combos) * len(cfg.seeds)}: {combo_label(combo)}, seed {seed}")
            Emulator(c, seed, run_dir, on_event=on_event(c.rounds) if on_event else None).run()
            summary = write_report(run_dir)
            runs.append((combo, seed, run_dir))
    if single:
        return summary
    return write_sweep_report(out, runs)
