"""The ``[privacy]`` section, one for jobs (``fedbit serve``) and experiments
(``fedbit emulate``), and the ``fedbit serve`` flags that set its keys.

    [privacy]
    secure_aggregation = true     # SecAgg+: the coordinator sees only sums
    mechanism = "distributed"     # none | central | distributed (needs secure_aggregation)
    clip = 1.0                    # L2 clip of an update (shared domain)
    noise_multiplier = 1.0        # z; or target_epsilon (z derived for `rounds` rounds)
    target_epsilon = 8.0          # the job stops before a round would pass it
    delta = 1e-5

:meth:`PrivacyConfig.validate` refuses, naming the conflict, a strategy that needs one
device's update under secure aggregation, and DP with per-group models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_client.errors import ConfigError

MECHANISMS = ("none", "central", "distributed")
#: strategy parameters of robust aggregation (strategies.registry), which keeps each update
_ROBUST_PARAMS = ("clip", "robust", "trim")
#: combiners whose models come from per-device figures beyond a sum
_NEEDS_SINGLE = {"fedwsq": "FedWSQ's server σ_g is an average of each device's σ_loc and its uplink is DANUQ"}
_GROUPED = ("grouped", "grouped-asym")


@dataclass
class PrivacyConfig:
    """The ``[privacy]`` section (see the module docstring); the keys beyond those:

    - ``adaptive_clip``: central DP's clip follows the ``clip_quantile`` quantile of the
      update norms (Andrew et al. 2021) at rate ``clip_lr``, from ``clip``;
    - ``neighbours``: SecAgg+'s k (0: 2⌈log2 n⌉), ``threshold``: t as a fraction of k;
    - ``bound``: secure aggregation without DP clips each update coordinate to ±bound;
    - ``min_survivors``: distributed DP's noise is sized for this fraction of the selected
      devices; a round with fewer masked inputs is not aggregated;
    - ``phase_timeout_s``: how long each phase after the first waits for the devices.
    """

    secure_aggregation: bool = False
    mechanism: str = "none"
    clip: float = 1.0
    noise_multiplier: float = 0.0
    target_epsilon: float = 0.0
    delta: float = 1e-5
    adaptive_clip: bool = False
    clip_quantile: float = 0.5
    clip_lr: float = 0.2
    neighbours: int = 0
    threshold: float = 0.5
    bound: float = 1.0
    min_survivors: float = 0.8
    phase_timeout_s: float = 30.0

    @property
    def dp(self) -> bool:
        return self.mechanism != "none"

    @property
    def active(self) -> bool:
        return self.secure_aggregation or self.dp

    def validate(self, strategy: str = "fedavg", params: dict[str, Any] | None = None) -> None:
        """ConfigError naming the first bad key or conflict."""
        from coordinator.strategies.registry import strategy_stages

        params = params or {}
        if self.mechanism not in MECHANISMS:
            raise ConfigError(f"privacy.mechanism: {self.mechanism!r} is not one of {list(MECHANISMS)}")
        for key in ("clip", "bound", "phase_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"privacy.{key}: must be > 0, got {getattr(self, key)}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta: must be in (0, 1), got {self.delta}")
        if self.noise_multiplier < 0 or self.target_epsilon < 0:
            raise ConfigError("privacy.noise_multiplier and privacy.target_epsilon must be >= 0")
        if not 0 < self.threshold < 1 or not 0 < self.min_survivors <= 1 or not 0 < self.clip_quantile < 1:
            raise ConfigError("privacy.threshold, privacy.clip_quantile: in (0, 1); privacy.min_survivors: in (0, 1]")
        if self.neighbours < 0 or self.neighbours == 1:
            raise ConfigError(f"privacy.neighbours: 0 (automatic) or >= 2, got {self.neighbours}")
        if self.dp and not (self.noise_multiplier > 0 or self.target_epsilon > 0):
            raise ConfigError(f"privacy.mechanism {self.mechanism!r}: give noise_multiplier or target_epsilon")
        if self.mechanism == "distributed" and not self.secure_aggregation:
            raise ConfigError("privacy.mechanism 'distributed' adds its noise under secure aggregation: "
                              "set privacy.secure_aggregation = true (or use mechanism 'central')")
        if self.mechanism == "central" and self.secure_aggregation:
            raise ConfigError("privacy.mechanism 'central' clips each update at the coordinator, which secure "
                              "aggregation hides from it: use mechanism 'distributed'")
        if self.adaptive_clip and self.mechanism != "central":
            raise ConfigError("privacy.adaptive_clip: only with mechanism 'central'")
        combiner = strategy.rpartition("+")[2]
        if self.dp and combiner in _GROUPED:
            raise ConfigError(f"privacy.mechanism {self.mechanism!r} with strategy {strategy!r}: per-group models "
                              f"each need their own noise and accounting (use a strategy with one global model)")
        if not (self.secure_aggregation or self.mechanism == "central"):
            return
        why = "secure_aggregation" if self.secure_aggregation else "privacy.mechanism 'central'"
        stages = strategy_stages(strategy, params)
        if "swa" in stages:
            raise ConfigError(f"{why} with strategy {strategy!r}: ProWD's selective weight aggregation masks "
                              f"each device's update, which the coordinator must not see")
        if "dequantize" in stages:
            raise ConfigError(f"{why} with strategy {strategy!r}: the dequantizer is trained on each device's "
                              f"update, which the coordinator must not see")
        robust = [k for k in _ROBUST_PARAMS if k in params]
        if robust:
            raise ConfigError(f"{why} with strategy parameter(s) {robust}: robust aggregation compares single "
                              f"updates, which the coordinator must not see")
        if combiner in _NEEDS_SINGLE:
            raise ConfigError(f"{why} with strategy {strategy!r}: {_NEEDS_SINGLE[combiner]}")


#: ``fedbit serve`` flags: (flag, dotted key, argparse keyword arguments)
FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--secure-aggregation", "privacy.secure_aggregation", {"action": "store_true", "help": "SecAgg+: the "
     "coordinator learns only the sum of each round's updates (docs/security.md#secure-aggregation)"}),
    ("--dp", "privacy.mechanism", {"choices": list(MECHANISMS), "help": "differential privacy: central "
     "(clip + Gaussian noise at the coordinator) or distributed (devices' discrete Gaussian under "
     "secure aggregation)"}),
    ("--dp-clip", "privacy.clip", {"type": float, "metavar": "C", "help": "L2 clip of an update"}),
    ("--noise-multiplier", "privacy.noise_multiplier", {"type": float, "metavar": "Z", "help": "Gaussian "
     "noise's standard deviation in units of the clip (0: derived from --target-epsilon)"}),
    ("--target-epsilon", "privacy.target_epsilon", {"type": float, "metavar": "EPS", "help": "privacy "
     "budget: the job ends before a round would pass it (sets the noise when --noise-multiplier is 0)"}),
    ("--delta", "privacy.delta", {"type": float, "metavar": "D", "help": "the delta at which epsilon is "
     "reported (the job's (epsilon, delta)-DP)"}),
]
