"""The experiment file's sections with fixed keys, as dataclasses: ``[data]``, ``[round]``,
``[cluster]``, ``[clock]``, ``[availability]``, ``[stop]``.

Each field is a key of its section (its annotation the accepted TOML types, its default
the default: :func:`coordinator.config.section_keys`); ``check()`` validates the values
one section can judge alone, raising ``ConfigError("key: why")`` (the loader adds the
file and the section). What depends on other sections (``data.inferior`` against
``[devices]``) is checked in :mod:`coordinator.emulation.config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.buffered.settings import BufferedSettings
from coordinator.config import ServerConfig
from coordinator.emulation.datasets import DATASETS, NEEDS_PATH, PARTITIONS
from edge_client.errors import ConfigError
from edge_client.protocol import ROUND_MODES

_SERVER = ServerConfig()


@dataclass
class DataSettings:
    """``[data]``: the data set (``dataset``, its file or folder ``path``), how it is split
    over the devices (``partition``: iid, shards, dirichlet, parity, sample; ``shards_per_device``,
    ``alpha``, ``per_device`` samples), the fraction of the training split held out for
    choices (``validation``, drawn with ``seed``), and the ``[devices]`` profiles that hold
    the parity split's odd labels (``inferior``; empty: integer devices and lossy uplinks)."""

    dataset: str = "digits"
    path: str = ""
    partition: str = "iid"
    shards_per_device: int = 2
    alpha: float = 0.5
    per_device: int = 32
    seed: int = 0
    validation: float = 0.0
    inferior: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"dataset: {self.dataset!r} is not one of {list(DATASETS)}")
        if self.dataset in NEEDS_PATH and not self.path:
            raise ConfigError(f"path: dataset {self.dataset!r} needs a path (its file or folder; "
                              f"fedbit never downloads data)")
        if self.path:
            where = Path(self.path).expanduser()
            kind = "file" if self.dataset == "npz" else "folder"
            if not (where.is_file() if kind == "file" else where.is_dir()):
                raise ConfigError(f"path: {self.path!r} is not a {kind} (the {self.dataset} data; fedbit "
                                  f"never downloads data)")
        if not 0 <= self.validation < 1:
            raise ConfigError(f"validation: must be in [0, 1) (the fraction held out), got {self.validation}")
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition: {self.partition!r} is not one of {list(PARTITIONS)}")
        if not self.alpha > 0:
            raise ConfigError(f"alpha: must be > 0, got {self.alpha}")
        for key in ("shards_per_device", "per_device"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be >= 1, got {getattr(self, key)}")


@dataclass
class RoundSettings:
    """``[round]``: the share of the fleet selected (``fraction``), the share of the selected
    whose updates close a round (``quorum``) and the fewest that update the model
    (``min_updates``), the simulated deadline (``deadline_s``, 0: none) and the wall-clock
    one (``wall_timeout_s``), the workers that train the devices (``workers``: processes or
    Ray actors; 0: one per core, 1: this process) and the devices training at once in each
    (``parallel``); ``engine``: where the integer devices train, ``"cpu"`` or ``"cuda"``
    (a round's together on the GPU, in this process: ``coordinator.emulation.gpu``; the
    same results); ``mode`` ``sync`` or ``buffered`` (``coordinator.buffered``, with
    ``buffer_size``, ``concurrency``, ``server_lr``, ``max_staleness``, ``staleness``;
    ``deadline_s`` then bounds how long a request holds a slot)."""

    fraction: float = _SERVER.fraction
    quorum: float = _SERVER.quorum
    min_updates: int = _SERVER.min_updates
    deadline_s: float = 0.0
    wall_timeout_s: float = 600.0
    workers: int = 0
    parallel: int = 2
    engine: str = "cpu"
    mode: str = _SERVER.mode
    buffer_size: int = _SERVER.buffered.buffer_size
    concurrency: int = _SERVER.buffered.concurrency
    server_lr: float = _SERVER.buffered.server_lr
    max_staleness: int = _SERVER.buffered.max_staleness
    staleness: str = _SERVER.buffered.staleness

    def buffered(self) -> BufferedSettings:
        """Buffered mode's settings."""
        return BufferedSettings(self.buffer_size, self.concurrency, float(self.server_lr), self.max_staleness,
                                self.staleness)

    def check(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"fraction: must be in (0, 1], got {self.fraction}")
        if not 0 < self.quorum <= 1:
            raise ConfigError(f"quorum: must be in (0, 1], got {self.quorum}")
        if self.min_updates < 1:
            raise ConfigError(f"min_updates: must be >= 1, got {self.min_updates}")
        if not (self.deadline_s >= 0 and math.isfinite(self.deadline_s)):
            raise ConfigError(f"deadline_s: must be >= 0 (0: no simulated deadline), got {self.deadline_s}")
        if not self.wall_timeout_s > 0:
            raise ConfigError(f"wall_timeout_s: must be > 0, got {self.wall_timeout_s}")
        if self.parallel < 1:
            raise ConfigError(f"parallel: must be >= 1, got {self.parallel}")
        if self.workers < 0:
            raise ConfigError(f"workers: must be >= 0 (0: one per core), got {self.workers}")
        if self.engine not in ("cpu", "cuda"):
            raise ConfigError(f"engine: {self.engine!r} is not 'cpu' or 'cuda'")
        if self.mode not in ROUND_MODES:
            raise ConfigError(f"mode: {self.mode!r} is not one of {sorted(ROUND_MODES)}")
        if self.mode == "buffered":
            try:
                self.buffered().validate()
            except ConfigError as exc:  # ("round.buffer_size: ..."; the loader adds "round.")
                raise ConfigError(str(exc).removeprefix("round.")) from None


@dataclass
class ClusterSettings:
    """``[cluster]``: where the workers run (``backend``: "local", processes on this
    machine, or "ray") and the Ray cluster's ``address`` ("auto", "local": a new Ray here,
    "host:port", "ray://host:port")."""

    backend: str = "local"
    address: str = "auto"

    def check(self) -> None:
        if self.backend not in ("local", "ray"):
            raise ConfigError(f"backend: {self.backend!r} is not 'local' or 'ray'")
        a = self.address
        if not a or not (a in ("auto", "local") or a.startswith("ray://") or a.rpartition(":")[2].isdigit()):
            raise ConfigError(f"address: {a!r}: expected \"auto\", \"local\", \"host:port\" or "
                              f"\"ray://host:port\"")


@dataclass
class ClockSettings:
    """``[clock]``: ``seconds_per_sample`` per variant (``{"int8": 2e-4, ...}``) pins the
    simulated compute time instead of measuring it at start-up (bit-reproducible runs);
    ``until_s`` ends a run at that simulated time (0: ``rounds`` ends it); ``eval_every_s``
    scores the model once per that many simulated seconds (0: every round)."""

    seconds_per_sample: dict[str, float] = field(default_factory=dict)
    until_s: float = 0.0
    eval_every_s: float = 0.0

    def check(self) -> None:
        for v, s in self.seconds_per_sample.items():
            if isinstance(s, bool) or not isinstance(s, int | float) or not (s > 0 and math.isfinite(s)):
                raise ConfigError(f"seconds_per_sample.{v}: must be a number > 0, got {s!r}")
        for key in ("until_s", "eval_every_s"):
            if not (getattr(self, key) >= 0 and math.isfinite(getattr(self, key))):
                raise ConfigError(f"{key}: must be >= 0 (0: none), got {getattr(self, key)}")


@dataclass
class AvailabilitySettings:
    """``[availability]``: when each device is online (``coordinator.emulation.availability``):
    ``model`` none, diurnal (the bundled model, per-profile overrides in ``profiles``) or
    trace (the CSV file ``trace``); the local hour at simulated time 0 (``start_hour``);
    ``time_scale``, how many times faster than the simulated clock the model's runs."""

    model: str = "none"
    trace: str = ""
    start_hour: float = 8.0
    time_scale: float = 1.0
    profiles: dict[str, dict] = field(default_factory=dict)

    def check(self) -> None:
        from coordinator.emulation.availability import MODELS

        if self.model not in MODELS:
            raise ConfigError(f"model: {self.model!r} is not one of {list(MODELS)}")
        if self.model == "trace" and not self.trace:
            raise ConfigError("trace: model \"trace\" needs a CSV file (device,start,end)")
        if not 0 <= self.start_hour < 24:
            raise ConfigError(f"start_hour: must be in [0, 24), got {self.start_hour}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ConfigError(f"time_scale: must be > 0, got {self.time_scale}")


@dataclass
class StopSettings:
    """``[stop]``: with ``plateau``, a run stops 5 rounds (the reported ones) after the first
    round >= ``min_rounds`` whose mean validation accuracy over the last ``window`` rounds
    gains at most ``min_delta`` on the ``window`` before (``rounds``: the maximum;
    :mod:`coordinator.emulation.stopping`)."""

    plateau: bool = False
    window: int = 5
    min_delta: float = 0.005
    min_rounds: int = 10

    def check(self) -> None:
        if self.window < 1:
            raise ConfigError(f"window: must be >= 1, got {self.window}")
        if not (self.min_delta >= 0 and math.isfinite(self.min_delta)):
            raise ConfigError(f"min_delta: must be >= 0, got {self.min_delta}")
        if self.min_rounds < 1:
            raise ConfigError(f"min_rounds: must be >= 1, got {self.min_rounds}")
