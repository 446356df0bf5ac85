"""Evaluating the global model as each bitwidth group runs it, on held-out sets.

:class:`ModelEvaluator` scores every variant (float32: the float forward, or the
announced ``float_forward = "int<s>"``; ``int<s>``: the s-bit integer forward) with the
devices' trainer code. **Threads**: the sets are cut into fixed chunks of
:data:`EVAL_CHUNK` dealt to ``threads`` lanes; the scores do not depend on the count.
**Rounds**: every round scores a fixed random subsample of ``val_sample`` validation
samples (the whole split when 0 or smaller), and rounds ``>= report_from`` (the reported
ones) the test split as well (earlier rounds' test figures are NaN); without a
validation split every round scores the test split. Variants running the same weights in the same forward are scored
once. **Decisions** (the health watch: :meth:`ModelEvaluator.probe`,
:attr:`ModelEvaluator.decision_key`) read the validation split, else the devices'
training data (``probe_data``), never the test split; ``fedbit serve``'s one held-out
set is a monitoring set (``watch_held_out``), which it reads.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edge_client.data import float_images
from edge_client.protocol import variant_bits

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.data import Dataset
    from edge_client.trainers import Trainer

#: samples per evaluation task (a multiple of the trainers' evaluation batch of 256)
EVAL_CHUNK = 1024


class Evaluator(Protocol):
    """``{variant: weights}`` -> ``{variant: (loss, accuracy)}``, or ``(loss, accuracy,
    {figure: value})`` with further figures of the group (``val_loss``, ``val_accuracy``);
    ``at_round``: the round being scored (None: outside a run)."""

    def __call__(self, variants: Mapping[str, list[np.ndarray]], *,
                 at_round: int | None = None) -> dict[str, tuple[Any, ...]]: ...


def _chunks(data: Dataset, size: int) -> list[Dataset]:
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
            data): each variant's result gains ``{"val_loss", "val_accuracy",
            "val_samples"}`` on it (or on its subsample).
        report_from: the first round whose call scores the test split (module docstring).
        val_sample: the validation samples scored each round (0: the whole split).
        threads: how many threads score the chunks (module docstring; >= 1).
        probe_data: the inputs the health watch probes when there is no validation split
            (the devices' training data; module docstring).
        watch_held_out: ``data`` is a monitoring set, not a test split (``fedbit serve``):
            without a validation split, decisions read it.
    """

    def __init__(self, model: str, data: Dataset, *, seed: int = 0, weight_standardization: bool = False,
                 float_forward: str = "float32", validation: Dataset | None = None, weight_norm: bool = False,
                 report_from: int = 0, val_sample: int = 0, threads: int = 1, probe_data: Dataset | None = None,
                 watch_held_out: bool = False) -> None:
        from edge_client.errors import ConfigError
        from edge_client.trainers import forward_bits

        if int(threads) < 1:
            raise ConfigError(f"evaluator threads must be >= 1, got {threads}")
        self.model = model
        self.data = data
        self.validation = validation if validation is not None and len(validation) else None
        #: the first round that scores the test split (the emulator moves it at a plateau)
        self.report_from = int(report_from)
        self.val_sample = int(val_sample)
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
        self._trainers: dict[tuple[str, int], Trainer] = {}
        self._sets: dict[str, list[Dataset]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _split(self, name: str) -> list[Dataset]:
        """The chunks of the held-out set ``test``, ``val`` or ``vsub`` (the validation
        subsample: ``val_sample`` samples drawn with seed 0, in split order), cut once."""
        if name not in self._sets:
            data = self.data if name == "test" else self.validation
            if name == "vsub":
                n = len(data)
                data = data.subset(np.sort(np.random.default_rng(0).permutation(n)[:min(self.val_sample, n)]))
            self._sets[name] = _chunks(data, EVAL_CHUNK)
        return self._sets[name]

    def _forward(self, variant: str) -> tuple[Any, ...]:
        """What decides a variant's scores besides its weights: the network it runs."""
        from edge_client.trainers import forward_bits

        bits, fbits = variant_bits(variant), forward_bits(self.float_forward)
        if bits == 32 and fbits != 32:
            return ("int", fbits)
        if bits == 32:
            return ("float", self.float_forward, self.weight_standardization, self.weight_norm)
        return ("int", bits)

    def _trainer(self, variant: str, lane: int = 0) -> Trainer:
        if (variant, lane) not in self._trainers:
            from edge_client.trainers import forward_bits, make_trainer
            from firmware_models import resolve_model

            bits = variant_bits(variant)
            extra = {}
            fbits = forward_bits(self.float_forward)
            if bits == 32 and fbits != 32:
                # the float devices' int<s> forward is the s-bit integer forward, bit for bit
                # (tests/packages/edge_client/test_float_forward.py): score it with the integer engine, several
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

    def splits(self, at_round: int | None) -> tuple[str, ...]:
        """The sets a call for ``at_round`` scores (module docstring)."""
        if self.validation is None:
            return ("test",)
        val = "vsub" if 0 < self.val_sample < len(self.validation) else "val"
        return ("test", val) if at_round is None or at_round >= self.report_from else (val,)

    def __call__(self, variants: Mapping[str, list[np.ndarray]], *,
                 at_round: int | None = None) -> dict[str, tuple[Any, ...]]:
        splits = self.splits(at_round)
        weights = {v: [np.asarray(w, dtype=np.float32) for w in variants[v]] for v in variants}
        same: dict[tuple[Any, ...], str] = {}  # (forward, weights digest) -> the variant scored
        scored_as = {v: same.setdefault((self._forward(v), _digest(weights[v])), v) for v in sorted(variants)}
        unique = sorted(set(scored_as.values()))
        tasks = [(v, s, i) for v in unique for s in splits for i in range(len(self._split(s)))]
        lanes = min(self.threads, len(tasks))

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
        by_unique: dict[str, tuple[Any, ...]] = {}
        for v in unique:
            scored = {s: _combine([(results[v, s, i], len(c)) for i, c in enumerate(self._split(s))])
                      for s in splits}
            out_v: tuple[Any, ...] = scored.get("test", (math.nan, math.nan))
            val = next((s for s in ("val", "vsub") if s in scored), None)
            if val is not None:
                out_v += ({"val_loss": scored[val][0], "val_accuracy": scored[val][1],
                           "val_samples": sum(len(c) for c in self._split(val))},)
            by_unique[v] = out_v
        return {v: by_unique[scored_as[v]] for v in sorted(variants)}

    def close(self) -> None:
        """End the evaluation threads (a later call starts them again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _digest(weights: list[np.ndarray]) -> bytes:
    """A digest of a model's weights (their shapes and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for w in weights:
        h.update(str(w.shape).encode())
        h.update(np.ascontiguousarray(w).data)
    return h.digest()


def _combine(parts: list[tuple[tuple[float, float], int]]) -> tuple[float, float]:
    """(mean loss, accuracy) of a set from its chunks' ((mean loss, accuracy), size), in
    chunk order."""
    n = sum(size for _, size in parts)
    loss = sum(float(score[0]) * size for score, size in parts) / n
    hits = sum(int(round(float(score[1]) * size)) for score, size in parts)
    return loss, hits / n


def make_evaluator(model: str, data: Dataset, **kw: Any) -> ModelEvaluator:
    """A :class:`ModelEvaluator` of ``model`` on ``data`` (keywords: its own; torch is
    imported lazily, for the float32 variant only)."""
    return ModelEvaluator(model, data, **kw)


def evaluator_for(model: str, data: Dataset, announced: Mapping[str, Any], **kw: Any) -> ModelEvaluator:
    """The evaluator of a run whose rounds announce ``announced`` (the strategy's
    ``device_hparams``): the float32 variant in the forward the float devices train
    (``float_forward``, ``ws``, ``wn``); the other keywords: see :class:`ModelEvaluator`."""
    return ModelEvaluator(model, data, weight_standardization=bool(announced.get("ws", False)),
                          float_forward=str(announced.get("float_forward", "float32")),
                          weight_norm=bool(announced.get("wn", False)), **kw)
