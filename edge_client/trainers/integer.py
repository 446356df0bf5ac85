"""IntTrainer: integer-only local training on the intnn engine (Int2..Int16; the FedProx /
FedFOR terms in integers as :mod:`edge_client.trainers` derives them)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from edge_client.data import Dataset
from edge_client.errors import ConfigError, TrainingError
from edge_client.intnn import kernels as K
from edge_client.intnn.memory import release_compiler_pages
from edge_client.intnn.model import IntModel
from edge_client.intnn.quant import (
    DEFAULT_CLIP,
    init_int,
)
from edge_client.intnn.workspace import Regularizer
from edge_client.trainers.common import (
    DEFAULT_LR_SHIFT,
    DEFAULT_MOMENTUM,
    DEFAULT_TORCH_LR,
    EVAL_CAPACITY,
    FIXED_POINT_BITS,
    INT32_MAX,
    STEP_G_BITS,
    TrainReport,
    as_spec,
    batches,
    check_sgd,
    check_train_args,
)
from firmware_models import ModelSpec


@dataclass
class TrainPlan:
    """One call of :meth:`IntTrainer.train`, decided: its ``batches`` (index arrays into
    the data set, in order), the labels ``y`` (int64), the workspace ``capacity``, the step
    ``lr_log2`` (LSBs of the storage grid), the FedProx / FedFOR terms ``reg`` and the step
    counter of its first step ``step0`` (its streams' keys)."""

    batches: list[np.ndarray]
    y: np.ndarray
    capacity: int
    lr_log2: int
    reg: Regularizer | None
    step0: int


class IntTrainer:
    """Integer-only local training of an s-bit device (ProWD appendix B).

    ``lr_shift``: log2 of eta in LSBs of the 8-bit grid (3 -> eta = 8, the paper's value);
    on a finer grid the step is ``2^(lr_shift + s_g - 8)`` LSBs (same real step).
    ``loss``: "sse" (WAGE, the default) or "ce" (integer base-2 softmax cross-entropy,
    NITI style); the measurements behind the default: docs/algorithms.md §1.
    ``seed`` keys the shuffling and the stochastic rounding; the step counter runs on
    across calls of :meth:`train`, so two trainers with the same seed and the same calls
    end bit for bit equal. ``lr``/``momentum``: the float devices' SGD settings whose
    FedProx/FedFOR step ``lr / (1 - momentum)`` this device's terms match (module docstring);
    they do not change the data step. ``threads``: cores a training step uses (results
    are the same bit for bit for any number; ignored when a model is passed in).
    ``release_pages``: a device process's trainer drops LLVM's code and read-only data from
    its resident memory once its kernels are loaded (:mod:`edge_client.intnn.memory`; after
    construction and after the first :meth:`train`). ``engine``: the backend that runs the
    steps, ``"cpu"`` or ``"cuda"`` (``edge_client.intnn.backend``; the same results).
    """

    def __init__(self, spec_or_model: ModelSpec | IntModel | str, bits: int,
                 lr_shift: int = DEFAULT_LR_SHIFT, seed: int = 0,
                 clip: float = DEFAULT_CLIP, loss: str = "sse", lr: float = DEFAULT_TORCH_LR,
                 momentum: float = DEFAULT_MOMENTUM, threads: int = 1,
                 release_pages: bool = False, engine: str = "cpu") -> None:
        self._release_pages = bool(release_pages)
        if self._release_pages:
            # drop the code `import numba` touched; start Numba (its JIT engine, its runtime
            # helpers compiled by LLVM) now, before the model's buffers exist; drop again
            release_compiler_pages()
            K.stream_key(0, 0, 0, 0)
            release_compiler_pages()
        if isinstance(spec_or_model, IntModel):
            self.model = spec_or_model
            if spec_or_model.bits != bits:
                raise ConfigError(f"IntTrainer: model has {spec_or_model.bits} bits, not {bits}")
        else:
            spec = as_spec(spec_or_model)
            self.model = IntModel(spec, bits, clip, loss=loss, threads=threads, backend=engine)
            self.model.load_int(init_int(spec, seed, bits, clip))
        if not -8 <= lr_shift <= 8:
            raise ConfigError(f"lr_shift must be in -8..8, got {lr_shift}")
        check_sgd(lr, momentum)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.spec = self.model.spec
        self.bits = self.model.bits
        self.lr_shift = int(lr_shift)
        self.seed = int(seed)
        self.step_count = 0
        self._calls = 0
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None
        if self._release_pages:
            release_compiler_pages()  # the weight kernels' cache loads

    # weights ---------------------------------------------------------------

    def load_shared(self, weights: list[np.ndarray]) -> None:
        self.model.load_shared(weights)

    def load_int(self, int_weights: list[np.ndarray]) -> None:
        """Set the device's own integers (spec layout), e.g. a decoded downlink."""
        self.model.load_int(int_weights)

    def to_shared(self) -> list[np.ndarray]:
        return self.model.to_shared()

    def int_weights(self) -> list[np.ndarray]:
        """The device's own integers (int8 for s <= 8, int16 above), spec layout."""
        return self.model.int_weights()

    def ternary_weights(self) -> list[np.ndarray]:
        """The ternary forward weights (int8 in {-1, 0, 1}), spec layout; ``t = +1`` stands
        for ``intnn.TERNARY_WEIGHT`` (0.5) in the shared domain."""
        return self.model.ternary_weights()

    # data ------------------------------------------------------------------

    def _inputs(self, data: Dataset) -> np.ndarray:
        """Quantized inputs, engine layout; cached for the last data set seen."""
        if self._cache is not None and self._cache[0] == id(data) and self._cache[1] is data.x:
            return self._cache[2]
        xq = self.model.prepare_inputs(data.x)
        self._cache = (id(data), data.x, xq)
        return xq

    def _regularizer(self, prox_mu: float, fedfor_alpha: float,
                     last_global_step: list[np.ndarray] | None, lr: float,
                     momentum: float) -> Regularizer | None:
        """The integer form of the FedProx / FedFOR terms (module docstring)."""
        alpha = fedfor_alpha if last_global_step is not None else 0.0
        if prox_mu == 0 and alpha == 0:
            return None
        model = self.model
        step = lr / (1.0 - momentum)
        # |mu_q (q - q_g)| << d_shift < mu_q 2^30 and |alpha_q g_q| < alpha_q 2^31: keep
        # mu_q + 2 alpha_q <= 2^31 so that their sum stays below 2^62
        frac = min(FIXED_POINT_BITS, 31 - math.ceil(math.log2(step * (prox_mu + 2 * alpha))))
        if frac < 0:
            raise ConfigError(f"prox_mu {prox_mu} / fedfor_alpha {fedfor_alpha} with step "
                              f"lr / (1 - momentum) = {step:g} are too large")
        mu_q = int(round(step * prox_mu * (1 << frac)))
        alpha_q = int(round(step * alpha * (1 << frac)))
        step_g = []
        for i, op in enumerate(model.param_ops):
            if alpha_q:
                g = np.rint(np.asarray(last_global_step[i], np.float64) * (1 << STEP_G_BITS))
                g = op.to_internal(np.clip(g, -INT32_MAX, INT32_MAX).astype(np.int32))
            else:
                g = np.zeros(model.internal_shapes[i], np.int32)
            step_g.append(g)
        d_shift = STEP_G_BITS + 1 - model.grid_bits
        anchor = [w.copy() for w in model.w]
        return Regularizer(anchor=anchor, step_g=step_g, mu_q=mu_q, alpha_q=alpha_q,
                           d_shift=d_shift, shift=frac + d_shift)

    # training --------------------------------------------------------------

    def train(self, data: Dataset, *, epochs: int = 1, steps: int | None = None,
              batch: int = 32, prox_mu: float = 0.0, fedfor_alpha: float = 0.0,
              last_global_step: list[np.ndarray] | None = None, lr: float | None = None,
              momentum: float | None = None, lr_shift: int | None = None) -> TrainReport:
        """Local SGD on ``data``; ``steps`` overrides ``epochs`` when given. ``lr``,
        ``momentum`` (the FedProx/FedFOR step) and ``lr_shift`` (the data step): this call's
        values (None: the trainer's).

        Reported loss: with SSE (default) the mean per-sample
        ``sum_o ((z_o - T onehot_o) / S(s))^2``, ``T = S(s) - 1``; with the softmax loss the
        mean of ``1 - p_true``.
        """
        t0 = time.perf_counter()
        plan = self.plan(data, epochs=epochs, steps=steps, batch=batch, prox_mu=prox_mu,
                         fedfor_alpha=fedfor_alpha, last_global_step=last_global_step, lr=lr,
                         momentum=momentum, lr_shift=lr_shift)
        model = self.model
        xq = self._inputs(data)
        ws = model.workspace(plan.capacity)
        sse = 0
        samples = 0
        for k, idx in enumerate(plan.batches):
            n = len(idx)
            np.take(xq, idx, axis=0, out=ws.x[:n])
            sse += model.train_step(ws, plan.y[idx], n, plan.lr_log2, self.seed, plan.step0 + k,
                                    plan.reg)
            self.step_count = plan.step0 + k + 1
            samples += n
        return self.finish(plan, sse, samples, t0)

    def plan(self, data: Dataset, *, epochs: int = 1, steps: int | None = None,
             batch: int = 32, prox_mu: float = 0.0, fedfor_alpha: float = 0.0,
             last_global_step: list[np.ndarray] | None = None, lr: float | None = None,
             momentum: float | None = None, lr_shift: int | None = None) -> TrainPlan:
        """What :meth:`train` with these arguments will run (checked, its batches drawn):
        the CPU loop of :meth:`train` runs it, or an engine that trains many devices at
        once (``edge_client.intnn.cuda.fleet``), which then calls :meth:`finish`."""
        n_steps = check_train_args(data, self.spec, epochs, steps, batch, prox_mu,
                                    fedfor_alpha, last_global_step)
        lr = self.lr if lr is None else float(lr)
        momentum = self.momentum if momentum is None else float(momentum)
        check_sgd(lr, momentum)
        lr_shift = self.lr_shift if lr_shift is None else int(lr_shift)
        if not -8 <= lr_shift <= 8:
            raise ConfigError(f"lr_shift must be in -8..8, got {lr_shift}")
        reg = self._regularizer(prox_mu, fedfor_alpha, last_global_step, lr, momentum)
        rng = np.random.default_rng([self.seed, self._calls])
        self._calls += 1
        return TrainPlan(
            batches=list(batches(len(data), batch, n_steps, rng)),
            y=np.ascontiguousarray(data.y, dtype=np.int64),
            capacity=min(batch, len(data)), lr_log2=lr_shift + self.model.grid_bits - 8,
            reg=reg, step0=self.step_count)

    def finish(self, plan: TrainPlan, loss_sum: int, samples: int, t0: float) -> TrainReport:
        """The report of ``plan`` run (its integer loss sum over ``samples``, started at
        ``t0``, ``time.perf_counter``); the step counter moves past its steps."""
        self.step_count = plan.step0 + len(plan.batches)
        loss = self._loss_value(loss_sum, samples)
        if self._release_pages and self._calls == 1:
            release_compiler_pages()  # the kernels' cache loads
        return TrainReport(len(plan.batches), samples, loss, time.perf_counter() - t0)

    def _loss_value(self, total: int, samples: int) -> float:
        """Reporting only: mean SSE in real units, or mean (1 - p_true) for the softmax."""
        if not samples:
            return 0.0
        if self.model.loss == "sse":
            return total / float(1 << (2 * (self.bits - 1))) / samples
        return total / float(K.SOFTMAX_ONE) / samples

    def evaluate(self, data: Dataset, batch: int = 256) -> tuple[float, float]:
        """(mean loss as in :meth:`train`, accuracy in [0, 1]) on ``data``."""
        if len(data) == 0:
            raise TrainingError("evaluate: the data set is empty")
        model = self.model
        xq = self._inputs(data)
        y_all = np.ascontiguousarray(data.y, dtype=np.int64)
        # results do not depend on the batching: reuse the training buffers when present
        ws = model.eval_workspace(min(batch, len(data), EVAL_CAPACITY))
        cap = ws.capacity
        err = np.zeros((cap, self.spec.num_classes), np.int32)
        hits = 0
        total = 0
        for s in range(0, len(data), cap):
            n = min(cap, len(data) - s)
            ws.x[:n] = xq[s:s + n]
            z = model.forward(ws, n)
            if model.loss == "sse":
                total += int(K.sse_error(z, y_all[s:s + n], model.target, err[:n]))
            else:
                total += int(K.softmax_error(z, y_all[s:s + n], self.bits,
                                             model.ce_temp_shift, err[:n]))
            hits += int(K.argmax_correct(z, y_all[s:s + n]))
        return self._loss_value(total, len(data)), hits / len(data)
