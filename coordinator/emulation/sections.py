"""The experiment file's sections with fixed keys, as dataclasses: ``[data]``, ``[round]``,
``[cluster]``, ``[clock]``, ``[stop]``.

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

from coordinator.config import ServerConfig
from coordinator.emulation.datasets import DATASETS, NEEDS_PATH, PARTITIONS
from edge_client.errors import ConfigError

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
    same results)."""

    fraction: float = _SERVER.fraction
    quorum: float = _SERVER.quorum
    min_updates: int = _SERVER.min_updates
    deadline_s: float = 0.0
    wall_timeout_s: float = 600.0
    workers: int = 0
    parallel: int = 2
    engine: str = "cpu"

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
    simulated compute time instead of measuring it at start-up (bit-reproducible runs)."""

    seconds_per_sample: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        for v, s in self.seconds_per_sample.items():
            if isinstance(s, bool) or not isinstance(s, int | float) or not (s > 0 and math.isfinite(s)):
                raise ConfigError(f"seconds_per_sample.{v}: must be a number > 0, got {s!r}")


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
