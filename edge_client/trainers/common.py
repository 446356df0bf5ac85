"""What both trainers share: defaults, the :class:`Trainer` protocol, :class:`TrainReport`
and the checks of ``train``'s arguments (see :mod:`edge_client.trainers`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edge_client.data import Dataset
from edge_client.errors import ConfigError, TrainingError
from firmware_models import ModelSpec, resolve_model

DEFAULT_LR_SHIFT = 3      # eta_8 = 2^3 = 8 LSBs (ProWD appendix A: eta = 8)
# float devices' SGD learning rate (docs/algorithms.md §2). The large value fits this
# domain: weights are clipped to +-0.5 and outputs divided by alpha_l, so the gradients
# are small; the gradient norm is clipped to 2.0 anyway.
DEFAULT_TORCH_LR = 1.0
DEFAULT_MOMENTUM = 0.9    # float devices' SGD momentum (ProWD appendix A)
EVAL_CAPACITY = 64        # integer evaluation runs at most this many samples at a time (RSS)
FIXED_POINT_BITS = 20     # fractional bits of the FedProx/FedFOR coefficients on devices
STEP_G_BITS = 29          # FedFOR's g on integer devices: round(g * 2^29), int32
INT32_MAX = (1 << 31) - 1


@dataclass
class TrainReport:
    """What one call of ``train`` did: steps, samples seen, mean loss, wall seconds."""

    steps: int
    samples: int
    loss: float
    seconds: float


@runtime_checkable
class Trainer(Protocol):
    """A device's local trainer, everything a device runtime (``edge_client.runtime``) and
    the coordinator's evaluation ask of it: :class:`~edge_client.trainers.IntTrainer`,
    :class:`~edge_client.trainers.TorchTrainer`, or what a ``trainer_factory`` makes.
    Weights travel as float32 shared-domain arrays in ``spec.param_shapes()`` order."""

    #: the model it trains
    spec: ModelSpec
    #: its compute bitwidth: 2..16 on an integer device, 32 on a float one
    bits: int
    #: its default float SGD learning rate (an integer device: its FedProx/FedFOR step's)
    lr: float
    #: its default integer data step, log2 LSBs of the 8-bit grid (-8..8)
    lr_shift: int

    def load_shared(self, weights: list[np.ndarray]) -> None:
        """Start from these shared-domain weights (the received global model)."""

    def to_shared(self) -> list[np.ndarray]:
        """The current weights in the shared domain (new float32 arrays)."""

    def int_weights(self) -> list[np.ndarray] | None:
        """The device's own grid integers (int8 for s <= 8, int16 above); None on a
        device without them (a float device)."""

    def ternary_weights(self) -> list[np.ndarray] | None:
        """The int8 ternary weights ({-1, 0, 1}) its forward computes with; None where
        the forward is not ternary (a float device)."""

    def train(self, data: Dataset, *, epochs: int = 1, steps: int | None = None,
              batch: int = 32, prox_mu: float = 0.0, fedfor_alpha: float = 0.0,
              last_global_step: list[np.ndarray] | None = None, lr: float | None = None,
              momentum: float | None = None, lr_shift: int | None = None,
              **float_settings: Any) -> TrainReport:
        """Local training; None: the trainer's own value. ``float_settings``: what only a
        float device takes (``grad_clip``, ``weight_standardization``, ``weight_norm``,
        ``forward``), passed to float devices only."""

    def evaluate(self, data: Dataset, batch: int = 256) -> tuple[float, float]:
        """(mean loss, accuracy) on ``data``."""


def missing_members(trainer: object) -> list[str]:
    """The :class:`Trainer` members ``trainer`` lacks (empty when it has them all; looked up
    with ``getattr``, so a wrapper that forwards its attributes counts as what it wraps)."""
    names = dict.fromkeys(n for n in (*Trainer.__annotations__, *vars(Trainer)) if not n.startswith("_"))
    return [n for n in names if not hasattr(trainer, n)]


def as_spec(spec: ModelSpec | str) -> ModelSpec:
    if isinstance(spec, str):
        return resolve_model(spec)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"expected a ModelSpec or a model name, got {type(spec).__name__}")
    return spec


def check_train_args(data: Dataset, spec: ModelSpec, epochs: int, steps: int | None,
                      batch: int, prox_mu: float, fedfor_alpha: float,
                      last_global_step: list[np.ndarray] | None) -> int:
    """Validate; return the number of steps to run."""
    if len(data) == 0:
        raise TrainingError("train: the data set is empty")
    if tuple(data.x.shape[1:]) != tuple(spec.input_shape):
        raise TrainingError(f"{spec.name}: samples of shape {list(data.x.shape[1:])}, "
                            f"expected {list(spec.input_shape)}")
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    if not (prox_mu >= 0 and fedfor_alpha >= 0 and math.isfinite(prox_mu + fedfor_alpha)):
        raise ConfigError(f"prox_mu and fedfor_alpha must be finite and >= 0, got {prox_mu}, "
                          f"{fedfor_alpha}")
    if last_global_step is not None:
        shapes = spec.param_shapes()
        if len(last_global_step) != len(shapes) or any(
                tuple(np.shape(g)) != tuple(s)
                for g, s in zip(last_global_step, shapes)):
            raise TrainingError(f"{spec.name}: last_global_step does not match the model")
    if data.y.min() < 0 or data.y.max() >= spec.num_classes:
        raise TrainingError(f"{spec.name}: labels outside 0..{spec.num_classes - 1}")
    if steps is not None:
        if steps < 0:
            raise ConfigError(f"steps must be >= 0, got {steps}")
        return int(steps)
    if epochs < 0:
        raise ConfigError(f"epochs must be >= 0, got {epochs}")
    return int(epochs) * math.ceil(len(data) / batch)


def check_sgd(lr: float, momentum: float) -> None:
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be > 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"momentum must be in [0, 1), got {momentum}")


def batches(n_samples: int, batch: int, n_steps: int, rng: np.random.Generator):
    """Index arrays of ``n_steps`` batches, reshuffling each epoch (last batch may be short)."""
    done = 0
    while done < n_steps:
        perm = rng.permutation(n_samples)
        for s in range(0, n_samples, batch):
            if done == n_steps:
                return
            yield perm[s:s + batch]
            done += 1


# ============================================================================ integer


