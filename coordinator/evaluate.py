"""Evaluating the global model as each bitwidth group runs it, on a held-out set.

A float32 device runs the shared weights through the float forward (or, when the fleet
announces ``float_forward = "int<s>"``, through the s-bit integer forward computed in
float, the network it then trains); an s-bit integer device runs ``from_shared(W, s)``
through the integer forward (ternary weights, shifts, s-bit activations). :class:`ModelEvaluator` scores every variant it is given with the
same trainer code the devices use (``edge_client.trainers.make_trainer``), one trainer
per variant, kept between rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from edge_client.protocol import variant_bits

#: ``{variant: weights}`` -> ``{variant: (loss, accuracy)}``, or ``(loss, accuracy,
#: {figure: value})`` with further figures of the group (``val_loss``, ``val_accuracy``)
Evaluator = Callable[[Mapping[str, list[np.ndarray]]], dict[str, tuple[Any, ...]]]


class ModelEvaluator:
    """``{variant: shared-domain weights}`` -> ``{variant: (loss, accuracy in [0, 1])}``.

    Args:
        model: the model spec's name.
        data: the held-out ``edge_client.data.Dataset``.
        seed: the trainers' seed (evaluation itself draws nothing).
        weight_standardization: evaluate the float forward the devices train (FedWSQ's
            ``ws``; integer variants are unaffected).
        weight_norm: the same for weight normalization (ProWD's float clients, ``wn``).
        float_forward: the network the float devices train (the announced
            ``float_forward``): ``float32`` or ``int<s>``; the float32 variant is scored in it.
        validation: a second held-out set (the validation split carved from the training
            data): each variant's result gains ``{"val_loss", "val_accuracy"}`` on it.
    """

    def __init__(self, model: str, data: Any, *, seed: int = 0, weight_standardization: bool = False,
                 float_forward: str = "float32", validation: Any = None, weight_norm: bool = False) -> None:
        from edge_client.trainers import forward_bits

        self.model = model
        self.data = data
        self.validation = validation if validation is not None and len(validation) else None
        self.seed = seed
        self.float_forward = str(float_forward)
        forward_bits(self.float_forward)  # ConfigError naming a bad value
        self.weight_standardization = bool(weight_standardization) and self.float_forward == "float32"
        # as a float device reads the announcement (edge_client.hparams.round_settings)
        self.weight_norm = (bool(weight_norm) and self.float_forward == "float32"
                            and not self.weight_standardization)
        self._trainers: dict[str, Any] = {}

    def _trainer(self, variant: str) -> Any:
        if variant not in self._trainers:
            from edge_client.trainers import forward_bits, make_trainer
            from firmware_models import resolve_model

            bits = variant_bits(variant)
            extra = {}
            fbits = forward_bits(self.float_forward)
            if bits == 32 and fbits != 32:
                # the float devices' int<s> forward is the s-bit integer forward, bit for bit
                # (tests/test_float_forward.py): score it with the integer engine, several
                # times faster than torch computing the same integers in float
                bits = fbits
            elif bits == 32:
                extra = {"forward": self.float_forward}
                if self.weight_standardization:
                    extra["weight_standardization"] = True
                if self.weight_norm:
                    extra["weight_norm"] = True
            self._trainers[variant] = make_trainer(resolve_model(self.model), bits, seed=self.seed, **extra)
        return self._trainers[variant]

    def probe(self, n: int) -> np.ndarray:
        """The first ``n`` held-out inputs (float32 [n, C, H, W]): the health check's probe."""
        return np.asarray(self.data.x[:n], dtype=np.float32)

    def __call__(self, variants: Mapping[str, list[np.ndarray]]) -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        for v in sorted(variants):
            trainer = self._trainer(v)
            trainer.load_shared([np.asarray(w, dtype=np.float32) for w in variants[v]])
            loss, acc = trainer.evaluate(self.data)
            out[v] = (float(loss), float(acc))
            if self.validation is not None:
                vloss, vacc = trainer.evaluate(self.validation)
                out[v] += ({"val_loss": float(vloss), "val_accuracy": float(vacc)},)
        return out


def make_evaluator(model: str, data: Any, *, seed: int = 0, weight_standardization: bool = False,
                   float_forward: str = "float32", validation: Any = None,
                   weight_norm: bool = False) -> ModelEvaluator:
    """A :class:`ModelEvaluator` of ``model`` on ``data`` (and ``validation``; torch is
    imported lazily, for the float32 variant only)."""
    return ModelEvaluator(model, data, seed=seed, weight_standardization=weight_standardization,
                          float_forward=float_forward, validation=validation, weight_norm=weight_norm)


def evaluator_for(model: str, data: Any, announced: Mapping[str, Any], *, seed: int = 0,
                  validation: Any = None) -> ModelEvaluator:
    """The evaluator of a run whose rounds announce ``announced`` (the strategy's
    ``device_hparams``): the float32 variant in the forward the float devices train
    (``float_forward``, ``ws``, ``wn``); ``validation``: see :class:`ModelEvaluator`."""
    return make_evaluator(model, data, seed=seed, weight_standardization=bool(announced.get("ws", False)),
                          float_forward=str(announced.get("float_forward", "float32")), validation=validation,
                          weight_norm=bool(announced.get("wn", False)))
