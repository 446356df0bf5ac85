"""The emulated fleet a config describes (:func:`build_fleet` -> :class:`FleetPlan`:
profiles, codecs, data shards, seeds), made device by device only when a device is
selected. See :mod:`coordinator.emulation.emulator`.

A :class:`FleetPlan` holds one :class:`DeviceGroup` per ``[devices]`` entry (a profile, its
uplink codec, a count and the index of its first device) and the data shards: the shards
of ``iid``/``shards``/``dirichlet``/``parity`` splits (at most one device per training
sample: their index arrays together hold each sample once), or, for ``sample``, the rule
that draws a device's ``per_device`` samples from its own seed when it is first needed.
Registering, selecting and timing a device use its group and index alone; its
:class:`EmulatedDevice` (the device config with its seed and work folder, the shard) is
made when it trains.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.devices import Cohort
from coordinator.emulation.config import ExperimentConfig, parse_codec
from coordinator.emulation.datasets import DataSplit, partition
from edge_client.codecs import get_codec
from edge_client.errors import ConfigError
from edge_client.protocol import Update, encode_message, float32_tensor, model_variant, topic
from edge_client.runtime import DeviceConfig, DeviceRuntime, device_hello
from edge_client.secagg.session import SecureSession
from firmware_models import is_model_file
from hw_profiles import HardwareProfile

if TYPE_CHECKING:  # pragma: no cover
    import logging
    from collections.abc import Callable

    from coordinator.emulation.attack import AttackConfig
    from edge_client.data import Dataset
    from edge_client.protocol import ModelMessage, RoundAnnouncement
    from edge_client.trainers import Trainer
    from edge_client.transport.base import Transport

__all__ = ["DeviceGroup", "EmulatedDevice", "FleetPlan", "ListedShards", "SampledShards", "build_fleet",
           "derive_seed", "device_runtime"]


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts`` (SHA-256 of their text): the same on every run
    and machine, unlike ``hash()``."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


@dataclass
class EmulatedDevice:
    """One device of the fleet: its profile, config (codec override and seed applied) and
    shard (``int64`` indices into the training split)."""

    device_id: str
    profile: HardwareProfile
    config: DeviceConfig
    shard: np.ndarray
    variant: str
    inferior: bool  # FedShift's inferior group: an integer device or a lossy uplink
    attack: AttackConfig | None = None  # set when it is an emulated attacker


def device_runtime(cfg: DeviceConfig, data: Dataset, connect: Callable[..., Transport], **kw: Any
                   ) -> DeviceRuntime:
    """The real device runtime of one emulated device (``kw``: ``trainer_factory``,
    ``logger``): this module is the emulator's one door to the device application. Its
    secure rounds are relayed (:class:`RelaySecure`)."""
    rt = DeviceRuntime(cfg, data, connect, **kw)
    rt.secure = RelaySecure(cfg, rt.log)
    return rt


class RelaySecure(SecureSession):
    """An emulated device's half of a secure round, as far as its worker goes: the update it
    would mask (exact: an integer device's grid differences as integer-valued float32) goes
    out on its update topic, and the emulator (``coordinator.emulation.secure``) plays the
    protocol with it, with the same device code (``edge_client.secagg``)."""

    def __init__(self, cfg: DeviceConfig, log: logging.Logger) -> None:
        super().__init__(cfg, log)
        self.topic = topic(cfg.job, "update", cfg.device_id)

    def start(self, a: RoundAnnouncement, m: ModelMessage, trainer: Trainer, shared: list[np.ndarray],
              start: list[np.ndarray], weight: int) -> bytes:
        self.keep(m, trainer, shared, start, weight)
        assert self._update is not None
        layers, _, w = self._update
        self._update = None
        tensors = tuple(float32_tensor(np.asarray(x, dtype=np.float32)) for x in layers)
        return encode_message(Update(self.cfg.device_id, a.round_id, int(w), int(self.cfg.compute_bits), "delta",
                                     tensors, m.digest), self.cfg.limits)


@dataclass(frozen=True)
class DeviceGroup:
    """The devices of one ``[devices]`` entry: ids ``<profile>-<i>`` (``i`` zero-padded to
    the width of ``count - 1``), fleet indices ``offset .. offset + count - 1``."""

    profile: HardwareProfile
    codec: str
    bits: int
    count: int
    offset: int
    #: FedShift's inferior group (the parity split): integer or low-bit compute, or a lossy
    #: uplink, unless ``data.inferior`` names the groups
    inferior: bool

    @property
    def prefix(self) -> str:
        return f"{self.profile.name}-"

    @property
    def width(self) -> int:
        return len(str(max(1, self.count) - 1))

    @property
    def variant(self) -> str:
        return model_variant(self.profile.compute_bits, self.profile.trainer)

    def device_id(self, i: int) -> str:
        return f"{self.prefix}{i:0{self.width}d}"


class SampledShards:
    """``partition = "sample"``: device ``g``'s shard is ``per_device`` distinct samples of
    ``n`` (all of them when ``n`` is smaller), drawn from its own seed (the run's data
    seed and ``g``) when it is asked for: nothing is stored per device."""

    def __init__(self, n: int, per_device: int, seed: int) -> None:
        self.n, self.k, self.seed = int(n), min(int(per_device), int(n)), int(seed)

    def __getitem__(self, g: int) -> np.ndarray:
        rng = np.random.default_rng(derive_seed("data", self.seed, int(g)))
        return np.sort(rng.choice(self.n, size=self.k, replace=False)).astype(np.int64)

    def size(self, g: int) -> int:
        return self.k

    def sizes(self, offset: int, count: int) -> int:
        return self.k


class ListedShards:
    """Shards drawn up front (one index array per device)."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        self.shards = shards

    def __getitem__(self, g: int) -> np.ndarray:
        return self.shards[g]

    def size(self, g: int) -> int:
        return len(self.shards[g])

    def sizes(self, offset: int, count: int) -> np.ndarray:
        return np.fromiter((len(s) for s in self.shards[offset:offset + count]), np.int64, count)


class FleetPlan:
    """The fleet of a config (see the module docstring).

    Args:
        groups: one per ``[devices]`` entry with devices, in config order.
        shards: ``shards[g]`` is device ``g``'s shard (``g``: its fleet index).
        seed: the run seed (device seeds are derived from it and the id).
        job: the job id the devices join.
        workdir: the folder of the devices' work folders (``<workdir>/<device id>``).
        model_files: the user's model file the devices load (``model`` a file), if any.
        attack: the ``[attack]`` settings (its attackers are drawn here), if any.
    """

    def __init__(self, groups: list[DeviceGroup], shards: SampledShards | ListedShards, seed: int, job: str,
                 workdir: Path, model_files: tuple[str, ...] = (),
                 attack: AttackConfig | None = None) -> None:
        prefixes = [g.prefix for g in groups]
        dup = sorted({p for p in prefixes if prefixes.count(p) > 1})
        if dup:
            raise ConfigError(f"devices: two entries name the profile {dup[0][:-1]!r}: their ids would collide")
        self.groups = groups
        self.shards = shards
        self.seed = seed
        self.job = job
        self.workdir = Path(workdir)
        self.model_files = tuple(model_files)
        self._starts = [g.offset for g in groups]
        self.attack = attack if attack is not None and attack.active else None
        #: the emulated attackers' ids
        self.attackers: frozenset[str] = self.attack.attackers(self, seed) if self.attack else frozenset()

    def __len__(self) -> int:
        return sum(g.count for g in self.groups)

    def locate(self, device_id: str) -> tuple[DeviceGroup, int]:
        """(group, index in it) of a device of this fleet; KeyError otherwise."""
        for g in self.groups:
            rest = device_id[len(g.prefix):]
            if device_id.startswith(g.prefix) and len(rest) == g.width and rest.isdigit() and rest.isascii() \
                    and int(rest) < g.count:
                return g, int(rest)
        raise KeyError(device_id)

    def group_of(self, index: int) -> DeviceGroup:
        return self.groups[bisect.bisect_right(self._starts, index) - 1]

    def device_id(self, index: int) -> str:
        """The id of the device with fleet index ``index``."""
        g = self.group_of(index)
        return g.device_id(index - g.offset)

    def ids(self) -> Iterator[str]:
        """Every device id in fleet order."""
        for g in self.groups:
            yield from (g.device_id(i) for i in range(g.count))

    def __iter__(self) -> Iterator[EmulatedDevice]:
        """Every device, made one after the other (for small fleets: tests, listings)."""
        return (self.device(d) for d in self.ids())

    def profile(self, device_id: str) -> HardwareProfile:
        return self.locate(device_id)[0].profile

    def variant(self, device_id: str) -> str:
        return self.locate(device_id)[0].variant

    def num_samples(self, device_id: str) -> int:
        g, i = self.locate(device_id)
        return self.shards.size(g.offset + i)

    def variants(self) -> set[str]:
        return {g.variant for g in self.groups}

    def config(self, g: DeviceGroup, i: int) -> DeviceConfig:
        dev_id = g.device_id(i)
        return replace(DeviceConfig.from_profile(dev_id, g.profile, job=self.job, workdir=self.workdir / dev_id,
                                                 seed=derive_seed("device", self.seed, dev_id), max_rounds=1,
                                                 model_files=self.model_files),
                       codec=g.codec, codec_bits=g.bits)

    def device(self, device_id: str) -> EmulatedDevice:
        """The device, made now (its config and shard)."""
        g, i = self.locate(device_id)
        return EmulatedDevice(device_id, g.profile, self.config(g, i), self.shards[g.offset + i], g.variant,
                              g.inferior, self.attack if device_id in self.attackers else None)

    def roster(self) -> list[Cohort]:
        """The fleet as cohorts for the coordinator's registry: one per group, with the
        hello each of its devices would send."""
        out = []
        for g in self.groups:
            hello = device_hello(self.config(g, 0), 0)
            out.append(Cohort(g.prefix, g.width, g.count, hello, self.shards.sizes(g.offset, g.count)))
        return out


def build_fleet(cfg: ExperimentConfig, seed: int, data: DataSplit, workdir: Path, job: str) -> FleetPlan:
    """The devices of ``cfg`` (``[devices]`` counts, ``[codecs]`` overrides) with their
    data shards (``[data]`` partition, drawn with the run seed)."""
    from hw_profiles import load_profile

    groups: list[DeviceGroup] = []
    offset = 0
    d = cfg.data
    for name, count in cfg.devices.items():
        try:
            prof = load_profile(name)
        except ValueError as exc:
            raise ConfigError(f"{cfg.source}: devices.{name}: {exc}") from None
        codec, bits = (parse_codec(cfg.codecs[name], f"codecs.{name}") if name in cfg.codecs
                       else (prof.codec, prof.codec_bits))
        if get_codec(codec).integer_only and prof.trainer != "int":
            raise ConfigError(f"{cfg.source}: codecs.{name}: codec {codec!r} needs an integer device")
        if count:
            inferior = (name in d.inferior if d.inferior  # the parity split's groups, named
                        else prof.trainer == "int" or prof.compute_bits < 32 or get_codec(codec).lossy)
            groups.append(DeviceGroup(prof, codec, bits, count, offset, inferior))
            offset += count
    if d.partition == "sample":
        if d.per_device < 1:
            raise ConfigError(f"data.per_device: must be >= 1, got {d.per_device}")
        shards: SampledShards | ListedShards = SampledShards(len(data.train), d.per_device, seed)
    else:
        inferior = [g.inferior for g in groups for _ in range(g.count)]
        shards = ListedShards(partition(d.partition, data.train.y, offset,
                                        np.random.default_rng(derive_seed("data", seed)),
                                        k=d.shards_per_device, alpha=float(d.alpha), inferior=inferior,
                                        per_device=d.per_device))
    model_files = (cfg.model,) if is_model_file(cfg.model) else ()  # a user's model: the devices get the file
    return FleetPlan(groups, shards, seed, job, workdir, model_files, attack=cfg.attack)
