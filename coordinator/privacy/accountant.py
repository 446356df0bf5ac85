"""The privacy accountant: ε at the job's δ after every round, from Google's
``dp-accounting`` (Rényi DP: Mironov 2017; Poisson-subsampled Gaussian: Mironov, Talwar,
Zhang 2019; conversion to (ε, δ): Balle et al. 2020, as the library implements it).

Each round is one Gaussian mechanism of noise multiplier ``z`` (the sum's noise std over
its L2 sensitivity), subsampled with probability ``q`` = the devices selected over the
devices present (the usual Poisson approximation of fixed-size selection, as in
DP-FedAvg); ``q = 1`` composes the Gaussian itself. The rounds are kept as
``(z, q, count)`` events: that list is the checkpointed state, and ε is recomputed from it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import dp_accounting


def _event(z: float, q: float) -> dp_accounting.DpEvent:
    import dp_accounting

    g = dp_accounting.GaussianDpEvent(z)
    return g if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(q, g)


@functools.lru_cache(maxsize=256)
def _curve(z: float, q: float) -> tuple[float, ...]:
    """One round's RDP at the library's default orders (composition adds these up)."""
    logging.getLogger("absl").setLevel(logging.ERROR)  # orders it skips are logged, not errors
    from dp_accounting import rdp

    acc = rdp.RdpAccountant()
    acc.compose(_event(z, q), 1)
    return tuple(float(x) for x in acc._rdp)


def rdp_epsilon(events: list[tuple[float, float, int]], delta: float) -> float:
    """ε at ``delta`` after ``events`` (``(z, q, count)``): dp-accounting's RDP of each
    round, composed (summed) and converted as its ``RdpAccountant.get_epsilon`` does."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    total = np.zeros(len(rdp.DEFAULT_RDP_ORDERS))
    for z, q, n in events:
        if n and z <= 0:
            return float("inf")
        if n:
            total += n * np.asarray(_curve(float(z), float(q)))
    return float(rdp.compute_epsilon(rdp.DEFAULT_RDP_ORDERS, total, delta)[0])


@dataclass
class Accountant:
    """ε of the job so far; :meth:`after` tells what one more round would make it."""

    delta: float
    events: list[tuple[float, float, int]] = field(default_factory=list)

    def add(self, z: float, q: float) -> float:
        """Compose one round; returns ε after it."""
        z, q = round(float(z), 12), round(min(1.0, float(q)), 12)
        if self.events and self.events[-1][:2] == (z, q):
            self.events[-1] = (z, q, self.events[-1][2] + 1)
        else:
            self.events.append((z, q, 1))
        return self.epsilon()

    def epsilon(self) -> float:
        return rdp_epsilon(self.events, self.delta) if self.events else 0.0

    def after(self, z: float, q: float) -> float:
        """ε if one more round with ``(z, q)`` were composed."""
        return rdp_epsilon([*self.events, (float(z), min(1.0, float(q)), 1)], self.delta)

    def rounds(self) -> int:
        return sum(n for _, _, n in self.events)

    def state(self) -> dict[str, Any]:
        return {"delta": self.delta, "events": [list(e) for e in self.events]}

    @classmethod
    def from_state(cls, state: dict[str, Any], delta: float) -> Accountant:
        return cls(delta, [(float(z), float(q), int(n)) for z, q, n in state.get("events", [])])


def noise_for_epsilon(target: float, delta: float, rounds: int, q: float, *, lo: float = 0.3,
                      hi: float = 200.0) -> float:
    """The smallest noise multiplier (to 0.5 %) whose ``rounds`` rounds at sampling rate
    ``q`` stay within ε ``target`` at ``delta`` (bisection over the accountant)."""
    if rdp_epsilon([(hi, q, rounds)], delta) > target:
        raise ValueError(f"target_epsilon {target}: not reachable in {rounds} rounds with noise multiplier <= {hi}")
    while hi / lo > 1.005:
        mid = (lo * hi) ** 0.5
        if rdp_epsilon([(mid, q, rounds)], delta) <= target:
            hi = mid
        else:
            lo = mid
    return hi
