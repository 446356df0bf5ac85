"""Evaluating the global model as each bitwidth group runs it, on a held-out set.

A float32 device runs the shared weights through the float forward (or, when the fleet
announces ``float_forward = "int<s>"``, through the s-bit integer forward computed in
float, the network it then trains); an s-bit integer device runs ``from_shared(W, s)``
through the integer forward (ternary weights, shifts, s-bit activations).
:class:`ModelEvaluator` scores every variant it is given with the same trainer code the
devices use (``edge_client.trainers.make_trainer``), kept between rounds.

**Threads.** The held-out sets are cut into fixed chunks of :data:`EVAL_CHUNK` samples
and the (variant, chunk) tasks are dealt to ``threads`` lanes, each a thread with its own
trainer per variant (the integer kernels and torch release the GIL). The chunks and the
order in which their results are summed do not depend on ``threads``: the scores are the
same for any thread count (the accuracy exactly, the loss up to the float summation of a
chunk's mean; ``tests/test_evaluate.py``).

**Validation rounds.** The validation split (``validation``) is scored only in rounds
``>= validate_from`` (and whenever no round is given): the emulator's reports use it
only over the last rounds they average (``coordinator.emulation.analysis.LAST_ROUNDS``),
to choose a tuned setting, so earlier rounds need not pay for it.

**Decisions never read the test split.** What a run decides from (the health watch's
probe batch and accuracy rule) comes from :meth:`ModelEvaluator.probe` and
:attr:`ModelEvaluator.decision_key`: the validation split; without one, the devices'
training data (``probe_data``, given by the emulator) for the probe and no accuracy
figure. ``fedbit serve`` has one held-out set, the operator's monitoring set and no test
split (``watch_held_out``): there the watch reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from edge_client.data import float_images
from edge_client.protocol import variant_bits

#: samples per evaluation task (a multiple of the trainers' evaluation batch of 256)
EVAL_CHUNK = 1024


class Evaluator(Protocol):
    """``{variant: weights}`` -> ``{variant: (loss, accuracy)}``, or ``(loss, accuracy,
    {figure: value})`` with further figures of the group (``val_loss``, ``val_accuracy``);
    ``at_round``: the round being scored (None: outside a run)."""

    def __call__(self, variants: Mapping[str, list[np.ndarray]], *,
                 at_round: int | None = None) -> dict[str, tuple[Any, ...]]: ...


def _chunks(data: Any, size: int) -> list[Any]:
    """``data`` cut into consecutive pieces of ``size`` samples (the last one shorter)."""
    n = len(data)
    if n <= size:
        return [data]
    return [data.subset(np.arange(s, min(s + size, n))) for s in range(0, n, size)]


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
        validate_from: the first round whose call scores ``validation`` (module docstring).
        threads: how many threads score the chunks (module docstring; >= 1).
        probe_data: the inputs the health watch probes when there is no validation split
            (the devices' training data; module docstring).
        watch_held_out: ``data`` is a monitoring set, not a test split (``fedbit serve``):
            without a validation split, decisions read it.
    """

    def __init__(self, model: str, data: Any, *, seed: int = 0, weight_standardization: bool = False,
                 float_forward: str = "float32", validation: Any = None, weight_norm: bool = False,
                 validate_from: int = 0, threads: int = 1, probe_data: Any = None,
                 watch_held_out: bool = False) -> None:
        from edge_client.errors import ConfigError
        from edge_client.trainers import forward_bits

        if int(threads) < 1:
            raise ConfigError(f"evaluator threads must be >= 1, got {threads}")
        self.model = model
        self.data = data
        self.validation = validation if validation is not None and len(validation) else None
        self.validate_from = int(validate_from)
        self.threads = int(threads)
        self.probe_data = probe_data if probe_data is not None and len(probe_data) else None
        self.watch_held_out = bool(watch_held_out)
        self.seed = seed
        self.float_forward = str(float_forward)
        forward_bits(self.float_forward)  # ConfigError naming a bad value
        self.weight_standardization = bool(weight_standardization) and self.float_forward == "float32"
        # as a float device reads the announcement (edge_client.hparams.round_settings)
        self.weight_norm = (bool(weight_norm) and self.float_forward == "float32"
                            and not self.weight_standardization)
        self._trainers: dict[tuple[str, int], Any] = {}
        self._sets: dict[str, list[Any]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _split(self, name: str) -> list[Any]:
        """The chunks of the held-out set ``test`` or ``val`` (cut once)."""
        if name not in self._sets:
            self._sets[name] = _chunks(self.data if name == "test" else self.validation, EVAL_CHUNK)
        return self._sets[name]

    def _trainer(self, variant: str, lane: int = 0) -> Any:
        if (variant, lane) not in self._trainers:
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
            self._trainers[variant, lane] = make_trainer(resolve_model(self.model), bits, seed=self.seed, **extra)
        return self._trainers[variant, lane]

    @property
    def decision_key(self) -> str | None:
        """The figure of a group that decisions read: ``val_accuracy`` (the validation
        split), ``accuracy`` of a monitoring set (``watch_held_out``), or None (no figure
        a decision may read: the test split is only reported)."""
        if self.validation is not None:
            return "val_accuracy"
        return "accuracy" if self.watch_held_out else None

    def probe(self, n: int) -> np.ndarray | None:
        """The health check's probe batch, float32 [n, C, H, W] in [0, 1]: the first ``n``
        inputs of the validation split, else of ``probe_data``, else of a monitoring set;
        None when there is none of them (never the test split)."""
        for src in (self.validation, self.probe_data, self.data if self.watch_held_out else None):
            if src is not None:
                return float_images(np.asarray(src.x[:n]))
        return None

    def __call__(self, variants: Mapping[str, list[np.ndarray]], *,
                 at_round: int | None = None) -> dict[str, tuple[Any, ...]]:
        validate = self.validation is not None and (at_round is None or at_round >= self.validate_from)
        splits = ("test", "val") if validate else ("test",)
        tasks = [(v, s, i) for v in sorted(variants) for s in splits for i in range(len(self._split(s)))]
        lanes = min(self.threads, len(tasks))
        weights = {v: [np.asarray(w, dtype=np.float32) for w in variants[v]] for v in variants}

        def run_lane(lane: int) -> list[tuple[float, float]]:
            loaded: set[str] = set()
            out = []
            for v, s, i in tasks[lane::lanes]:
                trainer = self._trainer(v, lane)
                if v not in loaded:
                    trainer.load_shared(weights[v])
                    loaded.add(v)
                out.append(trainer.evaluate(self._split(s)[i]))
            return out

        if lanes == 1:
            per_lane = [run_lane(0)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fedbit-eval")
            per_lane = list(self._pool.map(run_lane, range(lanes)))
        results = {t: per_lane[k % lanes][k // lanes] for k, t in enumerate(tasks)}
        out: dict[str, tuple[Any, ...]] = {}
        for v in sorted(variants):
            scored = {s: _combine([(results[v, s, i], len(c)) for i, c in enumerate(self._split(s))])
                      for s in splits}
            out[v] = scored["test"]
            if validate:
                out[v] += ({"val_loss": scored["val"][0], "val_accuracy": scored["val"][1]},)
        return out

    def close(self) -> None:
        """End the evaluation threads (a later call starts them again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _combine(parts: list[tuple[tuple[float, float], int]]) -> tuple[float, float]:
    """(mean loss, accuracy) of a set from its chunks' ((mean loss, accuracy), size), in
    chunk order."""
    n = sum(size for _, size in parts)
    loss = sum(float(score[0]) * size for score, size in parts) / n
    hits = sum(int(round(float(score[1]) * size)) for score, size in parts)
    return loss, hits / n


def make_evaluator(model: str, data: Any, **kw: Any) -> ModelEvaluator:
    """A :class:`ModelEvaluator` of ``model`` on ``data`` (keywords: its own; torch is
    imported lazily, for the float32 variant only)."""
    return ModelEvaluator(model, data, **kw)


def evaluator_for(model: str, data: Any, announced: Mapping[str, Any], **kw: Any) -> ModelEvaluator:
    """The evaluator of a run whose rounds announce ``announced`` (the strategy's
    ``device_hparams``): the float32 variant in the forward the float devices train
    (``float_forward``, ``ws``, ``wn``); the other keywords: see :class:`ModelEvaluator`."""
    return ModelEvaluator(model, data, weight_standardization=bool(announced.get("ws", False)),
                          float_forward=str(announced.get("float_forward", "float32")),
                          weight_norm=bool(announced.get("wn", False)), **kw)
