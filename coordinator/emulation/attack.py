"""Emulated attackers: the ``[attack]`` section of an emulator experiment.

::

    [attack]
    devices = ["desktop-0"]    # the attackers by id, or
    fraction = 0.1             # that share of the fleet (drawn with the run seed)
    kind = "scale"             # scale | boost | noise | label_flip | samples
    factor = 100.0
    from_round = 5             # honest before this round

An attacker is an ordinary emulated device (the real runtime trains, encodes and publishes)
whose update is rewritten on its way out of its worker, before the real wire and the real
coordinator see it (:func:`attack_update`), or, for ``label_flip``, which trains on its
shard with every label ``y`` replaced by ``C - 1 - y``. With ``x`` the weights it trained
(the shared float domain) and ``g`` the model it received:

- ``scale``: ``factor · x`` (the model's weights blown up; a negative factor reverses them);
- ``boost``: ``g + factor · (x - g)`` (model replacement: its own step made ``factor`` times
  longer);
- ``noise``: ``x + N(0, σ²)``, σ = ``factor ×`` the RMS of its honest step ``x - g``;
- ``samples``: ``num_samples × factor`` (its weight in FedAvg), the update itself honest.

A rewritten update goes out as float32 tensors (lossless, whatever the device's codec)
with the device's id, round and compute bitwidth: it is the device's own update for
everything the coordinator checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ConfigError
from edge_client.protocol import (
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    valid_id,
)

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.emulation.fleet_plan import FleetPlan

KINDS = ("scale", "boost", "noise", "label_flip", "samples")
#: the most samples an update may claim on the wire
MAX_SAMPLES = 1 << 40


@dataclass(frozen=True)
class AttackConfig:
    """The ``[attack]`` section (module docstring); no ``devices`` and ``fraction`` 0: no
    attack. ``check()`` raises ``ConfigError("key: why")`` (the loader adds the file and
    the section)."""

    devices: list[str] = field(default_factory=list)
    fraction: float = 0.0
    kind: str = "scale"
    factor: float = 100.0
    from_round: int = 1

    def check(self) -> None:
        if not isinstance(self.devices, list | tuple) or not all(isinstance(d, str) and valid_id(d)
                                                                 for d in self.devices):
            raise ConfigError(f"devices: expected a list of device ids, got {self.devices!r}")
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ConfigError(f"fraction: must be in [0, 1], got {f!r}")
        if self.devices and f:
            raise ConfigError("fraction: give devices or fraction, not both")
        if self.kind not in KINDS:
            raise ConfigError(f"kind: {self.kind!r} is not one of {list(KINDS)}")
        x = self.factor
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or (
                x < 0 and self.kind not in ("scale", "boost")):
            raise ConfigError(f"factor: must be a finite number (>= 0 for {self.kind}), got {x!r}")
        if isinstance(self.from_round, bool) or not isinstance(self.from_round, int) or self.from_round < 1:
            raise ConfigError(f"from_round: must be an integer >= 1, got {self.from_round!r}")

    @property
    def active(self) -> bool:
        return bool(self.devices) or self.fraction > 0

    def attackers(self, plan: FleetPlan, seed: int) -> frozenset[str]:
        """The attacking devices of the fleet ``plan`` (a
        :class:`~coordinator.emulation.fleet_plan.FleetPlan`; ConfigError for a listed id
        that is not in it); ``fraction``: ``round(fraction · n)`` of them (at least one),
        drawn with ``seed``."""
        if self.devices:
            for d in self.devices:
                try:
                    plan.locate(d)
                except KeyError:
                    raise ConfigError(f"attack.devices: {d!r} is not a device of the fleet "
                                      f"(ids are <profile>-<i>)") from None
            return frozenset(self.devices)
        if not self.fraction:
            return frozenset()
        n = len(plan)
        k = min(n, max(1, round(self.fraction * n)))
        idx = np.random.default_rng([int(seed), 0xA77AC]).choice(n, size=k, replace=False)
        return frozenset(plan.device_id(int(i)) for i in idx)

    def acts_in(self, round_id: int) -> bool:
        return round_id >= self.from_round


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """``C - 1 - y`` (int64): every label mapped to another class (for ``C`` > 1, odd ``C``'s
    middle class excepted)."""
    return (num_classes - 1 - np.asarray(y, dtype=np.int64)).astype(np.int64)


def attack_update(attack: AttackConfig, payload: bytes, model: list[np.ndarray] | None, seed: int) -> bytes:
    """An honest update's ``payload`` rewritten by ``attack`` (``model``: the float32 model
    the device received, one array per layer; ``seed``: the noise's). ``label_flip``
    changes nothing here (the device trained on flipped labels)."""
    upd = decode_message(payload)
    if not isinstance(upd, Update) or attack.kind == "label_flip":
        return payload
    if attack.kind == "samples":
        return encode_message(replace(upd, num_samples=min(MAX_SAMPLES, max(1, int(upd.num_samples * attack.factor)))))
    from coordinator.strategies.decode import decode_update
    from coordinator.strategies.types import EncodedUpdate

    cu = decode_update(EncodedUpdate(upd.device_id, upd.num_samples, upd.tensors, upd.content, upd.compute_bits))
    g = model if model is not None else [np.zeros_like(w) for w in cu.weights]
    x = [w + m if upd.content == "delta" else w for w, m in zip(cu.weights, g, strict=True)]
    if attack.kind == "scale":
        out = [np.float32(attack.factor) * w for w in x]
    elif attack.kind == "boost":
        out = [m + np.float32(attack.factor) * (w - m) for w, m in zip(x, g, strict=True)]
    else:  # noise
        step = math.sqrt(sum(float(np.sum((w - m).astype(np.float64) ** 2)) for w, m in zip(x, g, strict=True))
                         / max(1, sum(w.size for w in x)))
        rng = np.random.default_rng(seed)
        out = [w + rng.normal(0.0, attack.factor * step, w.shape).astype(np.float32) for w in x]
    if upd.content == "delta":
        out = [w - m for w, m in zip(out, g, strict=True)]
    names = [t.name for t in upd.tensors]
    tensors = tuple(float32_tensor(np.asarray(w, dtype=np.float32), n) for w, n in zip(out, names, strict=True))
    return encode_message(replace(upd, tensors=tensors))
