"""Who trains in a round: ``clamp(ceil(C * eligible), min_devices, max_devices)`` of the
eligible devices, drawn with the run's seeded selection RNG (:func:`draw`).

*Present*: said hello (or registered in bulk) and online by the broker's last word;
*eligible*: present and not quarantined (:mod:`coordinator.defense.reputation`; a revoked
device is taken offline before, :meth:`Collector.drop_revoked`). Without quarantined
devices the draw is a plain seeded sample of the present (the same RNG calls whatever the
defense, so a resumed run selects like an uninterrupted one); with ``q`` of them present, ``k + q`` are drawn in random order
and the first ``k`` eligible kept: a uniform draw among the eligible, without listing them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import FedbitError

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.config import ServerConfig


class NotEnoughDevices(FedbitError, RuntimeError):
    """A round cannot start (not enough devices within the presence timeout, or every
    present one quarantined)."""


def draw(cfg: ServerConfig, present: Sequence[str], rng: np.random.Generator,
         quarantined: Collection[str] = ()) -> list[str]:
    """The sorted selection among ``present`` minus ``quarantined`` (present devices
    only; ``cfg``: its ``fraction``, ``min_devices``, ``max_devices``; see the module
    docstring); NotEnoughDevices when every present device is quarantined."""
    q = len(quarantined)
    eligible = len(present) - q
    if eligible <= 0:
        raise NotEnoughDevices(f"every one of the {len(present)} present device(s) is quarantined "
                               f"(fedbit release DEVICE --run DIR lets one back in)")
    k = min(eligible, max(cfg.min_devices, min(cfg.max_devices, math.ceil(cfg.fraction * eligible))))
    idx = rng.choice(len(present), size=min(k + q, len(present)), replace=False)
    picked = [present[i] for i in idx]
    if q:
        picked = [d for d in picked if d not in quarantined][:k]
    return sorted(picked)
