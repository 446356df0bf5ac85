"""Local trainers of a device: IntTrainer (integer-only, intnn) and TorchTrainer (float32).

Both train the shared parameter domain (docs/algorithms.md §2): real weights ``W`` in
``[-0.5, 0.5]``, layer outputs scaled by ``1/alpha_l``, no bias, no batch norm. Weights
enter with ``load_shared`` and leave with ``to_shared`` as ``list[np.ndarray]`` float32 in
``spec.param_shapes()`` order. torch is imported lazily, only by :class:`TorchTrainer`:
integer training never loads it.

FedProx (``prox_mu``) and FedFOR (``fedfor_alpha`` with ``last_global_step``) pull each
step towards the received global model with the same strength on both kinds of device:
a float device adds the terms to its clipped data gradient before SGD with momentum; an
integer device adds them beside its normalized data step, in fixed point, at the float
device's effective step ``lr / (1 - momentum)`` (derivation: docs/algorithms.md §1).
"""

from __future__ import annotations

from edge_client.trainers.common import (
    DEFAULT_LR_SHIFT,
    DEFAULT_MOMENTUM,
    DEFAULT_TORCH_LR,
    Trainer,
    TrainReport,
    missing_members,
)
from edge_client.trainers.floating import TorchTrainer, forward_bits
from edge_client.trainers.integer import IntTrainer
from firmware_models import ModelSpec

__all__ = ["DEFAULT_LR_SHIFT", "DEFAULT_MOMENTUM", "DEFAULT_TORCH_LR", "IntTrainer", "TorchTrainer",
           "TrainReport", "Trainer", "forward_bits", "make_trainer", "missing_members"]


def make_trainer(spec: ModelSpec | str, bits: int, seed: int = 0, threads: int = 1,
                 engine: str = "cpu", **hparams) -> Trainer:
    """``bits == 32`` -> :class:`TorchTrainer`, else an s-bit :class:`IntTrainer` whose
    training steps use ``threads`` cores on ``engine`` (``"cpu"`` or ``"cuda"``; torch keeps
    its own thread setting and trains on the CPU)."""
    if bits == 32:
        return TorchTrainer(spec, seed=seed, **hparams)
    return IntTrainer(spec, bits, seed=seed, threads=threads, engine=engine, **hparams)
