"""Buffered mode's settings (``[round]`` of a job or an experiment), its staleness
weights and which strategies it runs.

An update trained on model version ``b`` that arrives while the coordinator is at
version ``v`` has staleness ``τ = v - b``; it counts with weight ``s(τ)`` times the server
learning rate (``coordinator.buffered.window``). The weight functions (``staleness``):

- ``sqrt`` (default): ``1/√(1+τ)`` (FedBuff, Nguyen et al. 2022);
- ``polynomial-A``: ``(1+τ)^-A`` (FedAsync's polynomial; ``sqrt`` is ``polynomial-0.5``);
- ``hinge-A-B``: 1 for ``τ <= B``, then ``1/(A(τ - B) + 1)`` (FedAsync's hinge);
- ``constant``: 1 (staleness only bounded by ``max_staleness``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge_client.errors import ConfigError


def staleness_function(spec: str) -> Callable[[int], float]:
    """``s(τ)`` of a ``staleness`` setting (see the module docstring); ConfigError naming
    the setting when it is not one."""
    name, _, rest = spec.partition("-") if isinstance(spec, str) else ("", "", "")
    try:
        args = [float(a) for a in rest.split("-")] if rest else []
    except ValueError:
        args = [math.nan]
    if name in ("sqrt", "constant") and not args:
        return (lambda tau: 1.0 / math.sqrt(1.0 + tau)) if name == "sqrt" else (lambda tau: 1.0)
    if name == "polynomial" and len(args) == 1 and args[0] >= 0:
        a = args[0]
        return lambda tau: (1.0 + tau) ** -a
    if name == "hinge" and len(args) == 2 and args[0] > 0 and args[1] >= 0:
        a, b = args
        return lambda tau: 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    raise ConfigError(f"staleness: {spec!r} is not \"sqrt\", \"constant\", \"polynomial-A\" (A >= 0) "
                      f"or \"hinge-A-B\" (A > 0, B >= 0)")


@dataclass
class BufferedSettings:
    """``round.mode = "buffered"``'s knobs.

    - ``buffer_size``: K, the updates folded before the buffer is applied (a new version);
    - ``concurrency``: most devices training at once (each holds a request until it answers,
      leaves, or ``round.timeout_s`` passes);
    - ``server_lr``: η, the new model is ``w + η Σ ω_k s(τ_k) Δ_k / Σ ω_k`` over the buffer;
    - ``max_staleness``: updates staler than this many versions are refused (``stale``);
    - ``staleness``: the weight function ``s`` (module docstring).
    """

    buffer_size: int = 10
    concurrency: int = 20
    server_lr: float = 1.0
    max_staleness: int = 50
    staleness: str = "sqrt"

    def validate(self) -> None:
        """ConfigError naming the first bad setting."""
        if self.buffer_size < 1:
            raise ConfigError(f"round.buffer_size: must be >= 1, got {self.buffer_size}")
        if self.concurrency < 1:
            raise ConfigError(f"round.concurrency: must be >= 1, got {self.concurrency}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ConfigError(f"round.server_lr: must be > 0, got {self.server_lr}")
        if self.max_staleness < 0:
            raise ConfigError(f"round.max_staleness: must be >= 0, got {self.max_staleness}")
        staleness_function(self.staleness)

    def weight(self, tau: int) -> float:
        """``η·s(τ)``: what an update of staleness ``tau`` is scaled by."""
        return self.server_lr * staleness_function(self.staleness)(tau)


def buffered_conflict(strategy: str, params: dict[str, Any]) -> str:
    """Why strategy ``strategy`` with ``params`` cannot aggregate a buffer ("" when it
    can). Per-update stages run buffered; the ones that compare one synchronous cohort's
    updates with each other do not."""
    from coordinator.strategies import strategy_stages

    stages = strategy_stages(strategy, params)
    if "swa" in stages:
        return ("ProWD's selective aggregation compares the high- and low-bitwidth averages of one "
                "synchronous round, which a buffer of stale updates from other versions does not have")
    if "dequantize" in stages:
        return "the ProWD dequantizer is trained on the low- and high-bitwidth weights of one synchronous round"
    if params.get("robust", "none") not in ("none", None):
        return (f"robust = {params['robust']!r} takes coordinate-wise order statistics over a whole "
                "synchronous cohort (clip works buffered: against the buffer's median norm)")
    return ""
