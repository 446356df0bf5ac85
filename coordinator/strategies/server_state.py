"""Server state that device-side methods need, carried across rounds and checkpointed.

- FedFOR's last global step ``g = w_{t-1} - w_t`` (docs/algorithms.md §4): None until a round
  has finished (round 1 is then plain FedAvg on the devices).
- DANUQ's per-layer ``σ_g`` (FedWSQ): ``σ_g <- m·σ_g + (1-m)·mean_k σ_loc,k`` with
  m = 0.9. [decision] Until the first round that brings σ_loc reports, σ_g is None; the
  first reports set σ_g to their mean (an EMA from nothing would start at 0.1·σ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.strategies.serialize import arrays_from_state, arrays_to_state


def global_step(previous: list[np.ndarray], new: list[np.ndarray]) -> list[np.ndarray]:
    """FedFOR's ``g = w_{t-1} - w_t`` per layer, float32."""
    return [np.subtract(p, n, dtype=np.float32) for p, n in zip(previous, new, strict=True)]


def sigma_ema(sigma_g: list[float] | None, mean_sigma_loc: list[float], momentum: float) -> list[float]:
    """One σ_g update: ``momentum·σ_g + (1-momentum)·mean σ_loc``; the mean itself when
    σ_g is None."""
    if sigma_g is None:
        return [float(s) for s in mean_sigma_loc]
    return [momentum * g + (1.0 - momentum) * s for g, s in zip(sigma_g, mean_sigma_loc, strict=True)]


@dataclass
class ServerState:
    last_global_step: list[np.ndarray] | None = None
    sigma_g: list[float] | None = None

    def for_devices(self) -> dict[str, Any]:
        """``{"last_global_step": list[np.ndarray] | None, "sigma_g": list[float] | None}``."""
        return {"last_global_step": self.last_global_step, "sigma_g": self.sigma_g}

    def to_state(self) -> dict[str, Any]:
        return {"last_global_step": arrays_to_state(self.last_global_step),
                "sigma_g": None if self.sigma_g is None else [float(s) for s in self.sigma_g]}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> ServerState:
        sg = d.get("sigma_g")
        return cls(arrays_from_state(d.get("last_global_step")),
                   None if sg is None else [float(s) for s in sg])
