"""The ``[defense]`` settings of a job or an experiment (:class:`DefenseConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge_client.errors import ConfigError


@dataclass(frozen=True)
class DefenseConfig:
    """Poisoning resistance (:mod:`coordinator.defense`); every bound is relative to the
    round's own medians, so it needs no tuning to a model or a dataset.

    - ``norm_bound`` (k > 1, 0: off): an update moves the model at most k times as far as
      the round's median update (its movement ``x - g`` is scaled down to that length);
    - ``sample_bound`` (m >= 1, 0: off): an update weighs at most m times the round's median
      ``num_samples`` (besides the enrolled cap and the job's ``max_samples``);
    - ``hold``: updates held (by reference, their wire bytes) before the first is folded,
      so that the round's first medians are known; a round of at most ``hold`` updates is
      bounded by its exact medians, a larger one by the medians of the updates so far;
    - ``strikes`` / ``window``: a device with ``strikes`` rounds of norm-bounded or refused
      updates among its last ``window`` rounds is quarantined until the operator releases
      it (``strikes`` 0: never).

    ``check()`` raises ``ConfigError("key: why")`` (a loader adds the file and section).
    """

    norm_bound: float = 3.0
    sample_bound: float = 4.0
    hold: int = 32
    strikes: int = 3
    window: int = 5

    def check(self) -> None:
        for name in ("norm_bound", "sample_bound"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name}: must be a number >= 0 (0: off), got {v!r}")
        if 0 < self.norm_bound <= 1:
            raise ConfigError(f"norm_bound: must be > 1 (the median update itself is never bounded) "
                              f"or 0 (off), got {self.norm_bound}")
        if 0 < self.sample_bound < 1:
            raise ConfigError(f"sample_bound: must be >= 1 or 0 (off), got {self.sample_bound}")
        for name, lo in (("hold", 1), ("strikes", 0), ("window", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}: must be an integer >= {lo}, got {v!r}")
        if self.strikes > self.window:
            raise ConfigError(f"strikes: {self.strikes} can never happen in a window of {self.window} rounds")
