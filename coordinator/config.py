"""The coordinator's round-loop settings (:class:`ServerConfig`), validated as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coordinator.admission import AdmissionConfig
from edge_client.errors import ConfigError
from edge_client.hparams import validate_hparams
from edge_client.protocol import DEFAULT_LIMITS, Limits

#: The largest allowed ``Limits.max_abs_value``: with ``num_samples <= 2**40`` as weights and
#: at most 10**5 updates a round, a float32 sum then stays below 1.2e38 (finite).
MAX_ABS_VALUE_CAP = 1e21


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
      (:class:`~coordinator.admission.AdmissionConfig`).
    """

    job: str = "default"
    model: str = "digits_cnn"
    rounds: int = 3
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
    hparams: dict[str, Any] = field(default_factory=lambda: {"epochs": 1, "batch": 32})
    seed: int = 0
    limits: Limits = DEFAULT_LIMITS
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def validate(self, strategy: Any = None) -> None:
        """ConfigError naming the first bad setting; with ``strategy``, also a configured
        hyper-parameter that contradicts what it announces (``Strategy.device_hparams``)."""
        if self.rounds < 1:
            raise ConfigError(f"rounds: must be >= 1, got {self.rounds}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction: must be in (0, 1], got {self.fraction}")
        if not 0.0 < self.quorum <= 1.0:
            raise ConfigError(f"quorum: must be in (0, 1], got {self.quorum}")
        if self.min_devices < 1 or self.max_devices < self.min_devices:
            raise ConfigError(f"min/max devices: need 1 <= {self.min_devices} <= {self.max_devices}")
        if self.round_timeout_s <= 0 or self.presence_timeout_s <= 0:
            raise ConfigError("round_timeout_s and presence_timeout_s must be > 0")
        v = self.limits.max_abs_value
        if not (isinstance(v, int | float) and 0.0 < v <= MAX_ABS_VALUE_CAP):
            raise ConfigError(f"limits.max_abs_value: must be in (0, {MAX_ABS_VALUE_CAP:g}], got {v!r} "
                              f"(larger values let the float32 sums overflow)")
        self.admission.validate()
        validate_hparams(self.hparams)
        if strategy is not None and hasattr(strategy, "device_hparams"):
            strategy.device_hparams(self.hparams)
