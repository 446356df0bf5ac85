"""Who trains in a round: wait until enough devices are present, then draw
``clamp(ceil(C * eligible), min_devices, max_devices)`` of the eligible ones with the run's
seeded selection RNG.

*Present*: said hello (or registered in bulk) and online by the broker's last word;
*eligible*: present, still admitted (an enrolled job's device that was revoked is taken
offline here, whatever its last presence message said) and not quarantined
(:mod:`coordinator.defense.reputation`). Without quarantined devices the draw is the
one it always was (the same RNG calls, so a resumed run selects like an uninterrupted
one); with ``q`` of them present, ``k + q`` are drawn in random order and the first ``k``
eligible kept: a uniform draw among the eligible, without listing them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from coordinator.config import ServerConfig
from coordinator.devices import DeviceRegistry
from edge_client.errors import FedbitError


class RoundError(FedbitError, RuntimeError):
    """A round cannot start (not enough devices within the presence timeout)."""


def wait_for_devices(cfg: ServerConfig, devices: Callable[[], DeviceRegistry], pump: Callable[[float], None],
                     on_event: Callable[[str, dict[str, Any]], None]) -> None:
    """Pump messages until ``max(min_devices, min_present)`` devices are present;
    RoundError after ``presence_timeout_s``."""
    end = time.monotonic() + cfg.presence_timeout_s
    last_note = 0.0
    need = max(cfg.min_devices, cfg.min_present)
    waited = False
    while devices().n_present < need:
        waited = True
        if time.monotonic() >= end:
            raise RoundError(f"only {devices().n_present} device(s) present after "
                             f"{cfg.presence_timeout_s:.0f} s; need {need}")
        if time.monotonic() - last_note > 5:
            last_note = time.monotonic()
            on_event("waiting", {"present": devices().n_present, "need": need})
        pump(min(end, time.monotonic() + 0.5))
    if waited:  # let hellos that arrive together settle
        pump(time.monotonic() + 0.05)


def draw(cfg: ServerConfig, present: Sequence[str], rng: np.random.Generator,
         quarantined: Collection[str] = ()) -> list[str]:
    """The sorted selection among ``present`` minus ``quarantined`` (see the module
    docstring); RoundError when every present device is quarantined."""
    q = sum(1 for d in quarantined if d in present) if quarantined else 0
    eligible = len(present) - q
    if eligible <= 0:
        raise RoundError(f"every one of the {len(present)} present device(s) is quarantined "
                         f"(fedbit release DEVICE --run DIR lets one back in)")
    k = min(eligible, max(cfg.min_devices, min(cfg.max_devices, math.ceil(cfg.fraction * eligible))))
    idx = rng.choice(len(present), size=min(k + q, len(present)), replace=False)
    picked = [present[i] for i in idx]
    if q:
        picked = [d for d in picked if d not in quarantined][:k]
    return sorted(picked)
