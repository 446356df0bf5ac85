"""Who may speak to the coordinator, and how much: the settings of the admission rules
that :mod:`coordinator.ingest` applies, and the per-device rate limiter.

- ``enrolment``: the job's registry (``security/enrolled.json``); when set, every message
  must come from an enrolled device with a MAC that verifies under its key (refused:
  ``unenrolled`` / ``bad_mac``); empty, any valid id is heard (the loopback demo).
- ``max_samples`` (job-wide cap, 0 = none) and ``samples_policy``: an update's claimed
  ``num_samples`` is bounded by the smallest of the cap, the device's enrolled value and
  its hello's; more is clipped (``clipped_num_samples``) or refused (``too_many_samples``).
- ``allow_uncapped``: start a job whose registry holds a device enrolled without a cap
  while ``max_samples`` is 0 too (refused by default: every device's weight is bounded).
- ``max_registered``: most devices the registry holds (``registry_full``).
- ``hello_rate`` / ``hello_burst``: a token bucket per device for hello and presence
  messages; more are refused (``rate_limited``, logged at debug level: a flood cannot
  flood the log).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_client.errors import ConfigError

SAMPLES_POLICIES = ("clip", "reject")


@dataclass
class AdmissionConfig:
    """See the module docstring (rates in messages per second)."""

    enrolment: str = field(default="", metadata={"file": False})  # set by `fedbit serve`, not the job file
    max_samples: int = 0
    samples_policy: str = "clip"
    allow_uncapped: bool = False
    max_registered: int = 100_000
    hello_rate: float = 1.0
    hello_burst: int = 20

    def validate(self) -> None:
        """ConfigError naming the first bad setting."""
        if isinstance(self.max_samples, bool) or not isinstance(self.max_samples, int) or \
                not 0 <= self.max_samples <= 1 << 40:
            raise ConfigError(f"max_samples: must be an integer in [0, 2^40], got {self.max_samples!r}")
        if self.samples_policy not in SAMPLES_POLICIES:
            raise ConfigError(f"samples_policy: {self.samples_policy!r} is not one of {SAMPLES_POLICIES}")
        if not isinstance(self.max_registered, int) or self.max_registered < 1:
            raise ConfigError(f"max_registered: must be an integer >= 1, got {self.max_registered!r}")
        if not self.hello_rate > 0 or not self.hello_burst >= 1:
            raise ConfigError(f"hello_rate/hello_burst: must be > 0 and >= 1, got "
                              f"{self.hello_rate!r}/{self.hello_burst!r}")


class RateLimiter:
    """Token buckets by key: ``burst`` tokens, refilled at ``rate`` per second.

    Memory is bounded: past ``max_keys`` buckets, the full ones (idle keys) are dropped,
    then, if that is not enough, the oldest half.
    """

    def __init__(self, rate: float, burst: int, max_keys: int) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = int(max_keys)
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def allow(self, key: str, now: float) -> bool:
        """Take one token from ``key``'s bucket at time ``now`` (s); False when empty."""
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_keys:
            self._prune(now)
        return ok

    def _prune(self, now: float) -> None:
        full = [k for k, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]
        if len(self._buckets) > self.max_keys:  # a flood of distinct keys: forget the oldest half
            for k in list(self._buckets)[: len(self._buckets) // 2]:
                del self._buckets[k]

    def __len__(self) -> int:
        return len(self._buckets)
