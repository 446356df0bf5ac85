"""Evaluating a global model on a held-out set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Evaluator = Callable[[list[np.ndarray]], tuple[float, float]]  # weights -> (loss, accuracy)


def make_evaluator(model: str, data: Any, *, seed: int = 0,
                   weight_standardization: bool = False) -> Evaluator:
    """``weights -> (loss, accuracy)`` on ``data`` with the float32 torch path
    (``edge_client.trainers.make_trainer(spec, 32)``; torch is imported here, lazily).
    ``weight_standardization``: evaluate the forward the devices train (FedWSQ's ``ws``)."""
    from edge_client.trainers import make_trainer
    from firmware_models import get_spec

    trainer = make_trainer(get_spec(model), 32, seed=seed,
                           weight_standardization=weight_standardization)

    def evaluate(weights: list[np.ndarray]) -> tuple[float, float]:
        trainer.load_shared([np.asarray(w, dtype=np.float32) for w in weights])
        loss, acc = trainer.evaluate(data)
        return float(loss), float(acc)

    return evaluate
