"""The combine stage: the new global model (and per-group models) from the averages.

Every function here is pure math on float64 flat arrays; the classes only hold params and
declare what they need devices to do (``device_hparams``, announced with each round by
``coordinator.strategies.announce``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from coordinator.strategies.accumulate import GroupSums
from coordinator.strategies.announce import variant_counts
from coordinator.strategies.mask import MaskStage
from edge_client.codecs import get_codec
from edge_client.errors import ConfigError
from edge_client.protocol import Hello

Stats = dict[str, float | int]


@dataclass
class RoundSums:
    """What the combiner sees at the end of a round."""

    sums: GroupSums
    global_flat: list[np.ndarray]                # float32 flat, the round's start model
    group_flat: dict[int, list[np.ndarray]]      # float32 flat, known group models
    n_updates: int
    n_inferior: int
    #: float32 flat, the previous round's global step ``w_{t-2} - w_{t-1}`` (None before)
    last_step: list[np.ndarray] | None = None


class Combiner(Protocol):
    name: str
    grouped: bool

    def combine(self, rs: RoundSums, mask: MaskStage) -> tuple[list[np.ndarray], dict[int, list[np.ndarray]], Stats]:
        """(global flat float64 layers, group flat layers, stats)."""
        ...

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        """Hyper-parameters this stage needs the round's ``devices`` (the selected ones'
        hellos; empty when only checking the configuration) to use."""
        ...


def fedshift(avg: np.ndarray, n_inferior: int, n_total: int) -> tuple[np.ndarray, float]:
    """FedShift eq. 8 on one layer, in place: ``avg - (I/N)·m``, m = mean(avg). Returns
    (the shifted layer, m)."""
    m = float(avg.mean()) if avg.size else 0.0
    if n_total and n_inferior:
        avg -= (n_inferior / n_total) * m
    return avg, m


class FedAvgCombine:
    """FedAvg: Σ ω_k w_k / Σ ω_k (ω = samples, or 1 when unweighted)."""

    name, grouped = "fedavg", False

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        return {}

    def combine(self, rs: RoundSums, mask: MaskStage):
        avg, stats = mask.average(rs.sums, rs.global_flat)
        return avg, {}, stats


class FedShiftCombine:
    """FedShift (eq. 5-8): per shifted layer, ``w_avg - (I/N)·m``; m = mean over the
    layer's elements of the all-client average, I = inferior updates, N = all updates.
    ``layers`` picks the layers to shift (default all: fedbit models hold weights only,
    no normalisation buffers; a model with buffers lists its weight layers here)."""

    name, grouped = "fedshift", False

    def __init__(self, layers: list[int] | None = None) -> None:
        self.layers = None if layers is None else {int(i) for i in layers}

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        return {}

    def combine(self, rs: RoundSums, mask: MaskStage):
        avg, stats = mask.average(rs.sums, rs.global_flat)
        for i, layer in enumerate(avg):
            if self.layers is None or i in self.layers:
                _, m = fedshift(layer, rs.n_inferior, rs.n_updates)
                stats[f"shift_mean/{i}"] = m
        return avg, {}, stats


class FedPaqCombine:
    """FedPAQ: the global model plus ``server_lr`` times the average update. Devices send
    their update ``W - W_global`` through their codec (``content = "delta"``, announced),
    so with ``server_lr = 1`` the model moves by the mean of the quantized updates, as in
    the paper (Reisizadeh et al., 2020), not by the mean of quantized weights."""

    name, grouped = "fedpaq", False

    def __init__(self, server_lr: float = 1.0) -> None:
        if not float(server_lr) > 0:
            raise ConfigError(f"{self.name}: server_lr must be > 0, got {server_lr}")
        self.server_lr = float(server_lr)

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        return {"content": "delta"}

    def combine(self, rs: RoundSums, mask: MaskStage):
        avg, stats = mask.average(rs.sums, rs.global_flat)
        for a, g in zip(avg, rs.global_flat, strict=True):
            a -= g
            a *= self.server_lr
            a += g
        return avg, {}, stats


class FedAvgMCombine:
    """FedAvgM (Hsu, Qi and Brown, 2019): server momentum over the FedAvg step. With the
    round's start model ``g``, the average ``a`` and the previous global step ``s``
    (``w_{t-2} - w_{t-1}``, which the strategy checkpoints anyway): ``v = β·s / η + (g -
    a)``, the new model ``g - η·v`` (β ``server_momentum``, η ``server_lr``); the first
    round has no ``s`` (plain FedAvg times η)."""

    name, grouped = "fedavgm", False

    def __init__(self, server_momentum: float = 0.9, server_lr: float = 1.0) -> None:
        if not 0.0 <= float(server_momentum) < 1.0:
            raise ConfigError(f"fedavgm: server_momentum must be in [0, 1), got {server_momentum}")
        if not float(server_lr) > 0:
            raise ConfigError(f"fedavgm: server_lr must be > 0, got {server_lr}")
        self.momentum = float(server_momentum)
        self.server_lr = float(server_lr)

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        return {}

    def combine(self, rs: RoundSums, mask: MaskStage):
        avg, stats = mask.average(rs.sums, rs.global_flat)
        for i, (a, g) in enumerate(zip(avg, rs.global_flat, strict=True)):
            v = g - a                      # this round's FedAvg step, float64
            if rs.last_step is not None:
                v += (self.momentum / self.server_lr) * rs.last_step[i]
            np.subtract(g, self.server_lr * v, out=a)
        return avg, {}, stats


class FedWsqCombine(FedPaqCombine):
    """FedWSQ (server side): the global model plus ``server_lr`` (1 in the paper) times the
    average update; devices train with weight standardization and send their update
    DANUQ-quantized at ``bits`` (1..8; the paper's 1, 2 or 4), standardized by the
    server's σ_g (kept by the strategy from the devices' σ_loc, sent with the model)."""

    name = "fedwsq"

    def __init__(self, server_lr: float = 1.0, bits: int = 2) -> None:
        super().__init__(server_lr)
        lo, hi = get_codec("danuq").bits_range
        if isinstance(bits, bool) or not isinstance(bits, int) or not lo <= bits <= hi:
            raise ConfigError(f"fedwsq: bits must be an integer in {lo}..{hi}, got {bits!r}")
        self.bits = bits

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        return {"content": "delta", "ws": True, "codec": "danuq", "codec_bits": self.bits}


class GroupedCombine:
    """FedGroupedAvg: FedAvg within each bitwidth group, one model per group. With
    ``asymmetric``, group b averages its own and every higher-bitwidth update. A known
    group with nothing to average this round keeps its model. The global ``weights`` is
    the highest-bitwidth group's model ([decision]: the most precise one; the coordinator
    publishes ``group_weights`` to the groups). With ``scale_lr`` (ProWD appendix A), each
    group's devices scale their learning rate by the group's share of the round's selected
    devices (announced as ``lr_scale.<variant>``; integer devices round it to a power of
    two, :mod:`edge_client.hparams`)."""

    grouped = True

    def __init__(self, asymmetric: bool = False, scale_lr: bool = False) -> None:
        if not isinstance(scale_lr, bool):
            raise ConfigError(f"grouped: scale_lr must be true or false, got {scale_lr!r}")
        self.asymmetric = asymmetric
        self.scale_lr = scale_lr
        self.name = "grouped-asym" if asymmetric else "grouped"

    def device_hparams(self, devices: Sequence[Hello]) -> dict[str, Any]:
        if not self.scale_lr or not devices:
            return {}
        return {f"lr_scale.{v}": n / len(devices) for v, n in sorted(variant_counts(devices).items())}

    def combine(self, rs: RoundSums, mask: MaskStage):
        present = rs.sums.bits
        groups: dict[int, list[np.ndarray]] = {}
        for b in sorted(set(present) | set(rs.group_flat)):
            members = [x for x in present if x >= b] if self.asymmetric else [b]
            total, w = rs.sums.combined(members)
            if total is None:
                groups[b] = [g.astype(np.float64) for g in rs.group_flat[b]]
                continue
            for t in total:
                t /= w
            groups[b] = total
        top = max(groups)
        return [a.copy() for a in groups[top]], groups, {"n_groups": len(groups)}
