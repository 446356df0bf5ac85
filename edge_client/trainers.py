"""Local trainers of a device: IntTrainer (integer-only, intnn) and TorchTrainer (float32).

Both train the same shared parameter domain (ALGORITHMS.md §2): real weights ``W`` in
``[-0.5, 0.5]``, layer outputs scaled by ``1/alpha_l``, no bias, no batch norm. Weights
enter with :meth:`load_shared` and leave with :meth:`to_shared` as ``list[np.ndarray]``
float32 in ``spec.param_shapes()`` order.

torch is imported lazily, only by :class:`TorchTrainer`: integer training never loads it.

FedProx (``prox_mu``) and FedFOR (``fedfor_alpha`` with ``last_global_step``) add
``mu (w - w_g)`` and ``alpha g [g (w - w_g) > 0]`` to each step's gradient, ``w_g`` being
the weights at the start of :meth:`train` (the received global model), with the same
strength on both kinds of device in the shared domain:

- float32 (:class:`TorchTrainer`): the terms join the data gradient after its norm is
  clipped (clipping bounds the data gradient, not the regulariser), then SGD with learning
  rate ``lr`` and momentum ``beta``. For a term that changes slowly from step to step the
  momentum buffer settles at ``term / (1 - beta)``: each step moves ``W`` by
  ``lr / (1 - beta) * (mu (W - W_g) + alpha g [.])``.
- integer (:class:`IntTrainer`, ALGORITHMS.md §1-2): the device holds ``q = W S(s_g)``
  (``S(s_g) = 2^(s_g - 1)``). Its data step is WAGE's normalized one (magnitude discarded),
  so it has no float learning rate; the terms are applied beside it, with the float
  device's step ``eta_r = lr / (1 - beta)`` (the float devices' ``lr`` and ``momentum``,
  announced or default): per step, in LSBs,
  ``dq = eta_r mu (q - q_g) + eta_r alpha g S(s_g) [g (q - q_g) > 0]``,
  exactly the float device's ``dW * S(s_g)``. In integers: ``mu_q = round(eta_r mu 2^F)``,
  ``alpha_q = round(eta_r alpha 2^F)`` (F = 20 fractional bits, fewer only when the
  coefficients are so large that the int64 numerator could overflow), FedFOR's
  ``g_q = round(g 2^29)`` (int32: ``g`` keeps a resolution of 2^-29 in the shared domain,
  ``2^(30 - s_g)`` times finer than the weights, so its sign pattern survives: on Int8 a
  ``|g| = 1e-3`` is 0.128 LSB, which the grid would round to 0), and
  ``dq = stoch_round(((mu_q (q - q_g)) << (30 - s_g) + alpha_q g_q [.]) / 2^(F + 30 - s_g))``
  on its own random stream: its expectation is the float step above (up to the rounding
  of ``mu_q``/``alpha_q``, relative 2^-21 / (eta_r mu)).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from edge_client.data import Dataset
from edge_client.errors import ConfigError, ProtocolError, TrainingError
from edge_client.intnn import kernels as K
from edge_client.intnn.model import IntModel, Regularizer
from edge_client.intnn.quant import (
    DEFAULT_CLIP,
    TERNARY_WEIGHT,
    alpha_shifts,
    grid_scale,
    init_int,
    init_shared,
    ternary_threshold,
)
from edge_client.protocol import FLOAT_VARIANT, variant_bits
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU, get_spec

DEFAULT_LR_SHIFT = 3      # eta_8 = 2^3 = 8 LSBs (ProWD appendix A: eta = 8)
# Measured on digits_cnn (3 seeds, 20 epochs, lr/8 for the last 6): lr 1.0 -> 98-99% test
# accuracy, 0.3 -> 97%; one round on a 360-sample shard: 38-44% (1.0) vs 24% (0.3).
# The large value fits this domain: weights are clipped to +-0.5 and outputs divided by
# alpha_l, so the gradients are small; the gradient norm is clipped to 2.0 anyway.
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
    spec: ModelSpec
    bits: int

    def load_shared(self, weights: list[np.ndarray]) -> None: ...

    def to_shared(self) -> list[np.ndarray]: ...

    def train(self, data: Dataset, *, epochs: int = 1, steps: int | None = None,
              batch: int = 32, prox_mu: float = 0.0, fedfor_alpha: float = 0.0,
              last_global_step: list[np.ndarray] | None = None, lr: float | None = None,
              momentum: float | None = None) -> TrainReport: ...

    def evaluate(self, data: Dataset, batch: int = 256) -> tuple[float, float]: ...


def _as_spec(spec: ModelSpec | str) -> ModelSpec:
    if isinstance(spec, str):
        return get_spec(spec)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"expected a ModelSpec or a model name, got {type(spec).__name__}")
    return spec


def _check_train_args(data: Dataset, spec: ModelSpec, epochs: int, steps: int | None,
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
                for g, s in zip(last_global_step, shapes, strict=False)):
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


def _check_sgd(lr: float, momentum: float) -> None:
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be > 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"momentum must be in [0, 1), got {momentum}")


def _batches(n_samples: int, batch: int, n_steps: int, rng: np.random.Generator):
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


class IntTrainer:
    """Integer-only local training of an s-bit device (ProWD appendix B).

    ``lr_shift``: log2 of eta in LSBs of the 8-bit grid (3 -> eta = 8, the paper's value);
    on a finer grid the step is ``2^(lr_shift + s_g - 8)`` LSBs (same real step).
    ``loss``: "sse" (WAGE, the default) or "ce" (integer base-2 softmax cross-entropy,
    NITI style); the measurements behind the default are in :mod:`edge_client.intnn.model`.
    ``seed`` keys the shuffling and the stochastic rounding; the step counter runs on
    across calls of :meth:`train`, so two trainers with the same seed and the same calls
    end bit for bit equal. ``lr``/``momentum``: the float devices' SGD settings whose
    FedProx/FedFOR step ``lr / (1 - momentum)`` this device's terms match (module docstring);
    they do not change the data step.
    """

    def __init__(self, spec_or_model: ModelSpec | IntModel | str, bits: int,
                 lr_shift: int = DEFAULT_LR_SHIFT, seed: int = 0,
                 clip: float = DEFAULT_CLIP, loss: str = "sse", lr: float = DEFAULT_TORCH_LR,
                 momentum: float = DEFAULT_MOMENTUM) -> None:
        if isinstance(spec_or_model, IntModel):
            self.model = spec_or_model
            if spec_or_model.bits != bits:
                raise ConfigError(f"IntTrainer: model has {spec_or_model.bits} bits, not {bits}")
        else:
            spec = _as_spec(spec_or_model)
            self.model = IntModel(spec, bits, clip, loss=loss)
            self.model.load_int(init_int(spec, seed, bits, clip))
        if not -8 <= lr_shift <= 8:
            raise ConfigError(f"lr_shift must be in -8..8, got {lr_shift}")
        _check_sgd(lr, momentum)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.spec = self.model.spec
        self.bits = self.model.bits
        self.lr_shift = int(lr_shift)
        self.seed = int(seed)
        self.step_count = 0
        self._calls = 0
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

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
                g = model._to_internal(op, np.clip(g, -INT32_MAX, INT32_MAX).astype(np.int32))
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
        n_steps = _check_train_args(data, self.spec, epochs, steps, batch, prox_mu,
                                    fedfor_alpha, last_global_step)
        lr = self.lr if lr is None else float(lr)
        momentum = self.momentum if momentum is None else float(momentum)
        _check_sgd(lr, momentum)
        lr_shift = self.lr_shift if lr_shift is None else int(lr_shift)
        if not -8 <= lr_shift <= 8:
            raise ConfigError(f"lr_shift must be in -8..8, got {lr_shift}")
        t0 = time.perf_counter()
        model = self.model
        xq = self._inputs(data)
        y_all = np.ascontiguousarray(data.y, dtype=np.int64)
        reg = self._regularizer(prox_mu, fedfor_alpha, last_global_step, lr, momentum)
        ws = model.workspace(min(batch, len(data)))
        rng = np.random.default_rng([self.seed, self._calls])
        self._calls += 1
        lr_log2 = lr_shift + model.grid_bits - 8
        sse = 0
        samples = 0
        for idx in _batches(len(data), batch, n_steps, rng):
            n = len(idx)
            np.take(xq, idx, axis=0, out=ws.x[:n])
            sse += model.train_step(ws, y_all[idx], n, lr_log2, self.seed, self.step_count, reg)
            self.step_count += 1
            samples += n
        loss = self._loss_value(sse, samples)
        return TrainReport(n_steps, samples, loss, time.perf_counter() - t0)

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


# ============================================================================ float32


class TorchTrainer:
    """float32 local training of the same parameter domain (ALGORITHMS.md §2).

    Forward ``layer(a, W) / alpha_l`` (no quantization), softmax cross-entropy, SGD with
    momentum (fresh each :meth:`train` call), gradient-norm clipping of the data gradient
    (the FedProx / FedFOR terms are added after it), and ``W`` clamped to
    ``[-clip, clip]`` after every step. ``weight_standardization`` (FedWSQ): each output
    channel's weights are standardized, ``W~ = rho (W - mean) / std`` with ``rho = 1e-3``
    (FedWSQ's value), and, since these models have no normalization layer after it, the
    layer output is rescaled by ``sqrt(2 / fan_in) / rho`` (He gain).

    ``forward``: the network it trains and evaluates. ``"float32"`` (default): the float
    forward above. ``"int<s>"``: the s-bit integer devices' forward (:mod:`edge_client.intnn`,
    ALGORITHMS.md §1), computed in float32 so that one global model is one function for
    every group: inputs ``round(x (S - 1)) / S`` (``S = 2^(s-1)``), weights
    ``0.5 ternary(W)`` (``|round(W S(s_g))| > S(s_g)/4``, as the device ternarizes its grid
    integers), each conv/linear output divided by ``alpha_l`` (the integer shift by
    ``1 + log2 alpha_l`` of ``sum t a``), ReLU, rounded half away from zero to the 1/S grid
    and clipped to ``+-(S - 1)/S``; the logits are the integer engine's divided by S
    (exactly: every partial sum is a multiple of 2^-(s + 1) far below 2^24). Gradients
    are straight-through: to ``W`` through the ternary weights, through the rounding and
    the upper clip (the ReLU masks), as the integer backward passes its errors. Its loss
    is the integer devices' (WAGE's SSE against ``(S - 1)/S`` one-hot) unless ``loss`` is
    given; weight standardization does not apply to it.
    """

    def __init__(self, spec: ModelSpec | str, lr: float = DEFAULT_TORCH_LR, seed: int = 0,
                 weight_standardization: bool = False, momentum: float = DEFAULT_MOMENTUM,
                 grad_clip: float = 2.0, clip: float = DEFAULT_CLIP, ws_rho: float = 1e-3,
                 loss: str | None = None, forward: str = FLOAT_VARIANT) -> None:
        import torch

        self._torch = torch
        self.spec = _as_spec(spec)
        self.bits = 32
        _check_sgd(lr, momentum)
        self.forward_bits = forward_bits(forward)
        if loss not in (None, "ce", "sse"):
            raise ConfigError(f"loss must be 'ce' or 'sse', got {loss!r}")
        if weight_standardization and self.forward_bits != 32:
            raise ConfigError(f"weight standardization applies to the float forward, not {forward!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.grad_clip = float(grad_clip)
        self.clip = float(clip)
        self.seed = int(seed)
        self.weight_standardization = bool(weight_standardization)
        self.ws_rho = float(ws_rho)
        self.loss_kind = loss  # None: CE for the float forward, SSE for an integer one
        self._alpha = [float(1 << a) for a in alpha_shifts(self.spec)]
        self._calls = 0
        self.params = [torch.tensor(w, dtype=torch.float32, requires_grad=True)
                       for w in init_shared(self.spec, seed, clip)]

    # weights ---------------------------------------------------------------

    def load_shared(self, weights: list[np.ndarray]) -> None:
        shapes = self.spec.param_shapes()
        if len(weights) != len(shapes):
            raise TrainingError(f"{self.spec.name}: expected {len(shapes)} weight tensors, "
                                f"got {len(weights)}")
        with self._torch.no_grad():
            for i, (p, w, s) in enumerate(zip(self.params, weights, shapes, strict=True)):
                w = np.asarray(w, dtype=np.float32)
                if tuple(w.shape) != tuple(s):
                    raise TrainingError(f"{self.spec.name}: weight {i} has shape "
                                        f"{list(w.shape)}, expected {list(s)}")
                if not np.all(np.isfinite(w)):
                    raise TrainingError(f"{self.spec.name}: weight {i} has NaN/Inf values")
                p.copy_(self._torch.from_numpy(np.ascontiguousarray(w)))

    def to_shared(self) -> list[np.ndarray]:
        return [p.detach().cpu().numpy().astype(np.float32, copy=True) for p in self.params]

    # model -----------------------------------------------------------------

    def _effective(self, i: int, w, ws: bool):
        if not ws:
            return w, 1.0 / self._alpha[i]
        flat = w.reshape(w.shape[0], -1)
        mean = flat.mean(dim=1, keepdim=True)
        std = flat.std(dim=1, unbiased=False, keepdim=True)
        ws = self.ws_rho * (flat - mean) / (std + 1e-8)
        gain = math.sqrt(2.0 / flat.shape[1]) / self.ws_rho
        return ws.reshape(w.shape), gain

    def forward(self, x, ws: bool | None = None, bits: int | None = None):
        """Logits of a float32 batch ``x`` [N, C, H, W] (torch tensor) in [0, 1]; ``ws``:
        weight standardization; ``bits``: 32 for the float forward, s for the s-bit integer
        forward (class docstring). None: the trainer's settings."""
        bits = self.forward_bits if bits is None else bits
        if bits != 32:
            return self._int_forward(x, bits)
        F = self._torch.nn.functional
        ws = self.weight_standardization if ws is None else ws
        h = x
        p = 0
        for layer in self.spec.layers:
            if isinstance(layer, Conv2d):
                w, scale = self._effective(p, self.params[p], ws)
                h = F.conv2d(h, w, stride=layer.stride, padding=layer.padding) * scale
                p += 1
            elif isinstance(layer, Linear):
                w, scale = self._effective(p, self.params[p], ws)
                h = F.linear(h, w) * scale
                p += 1
            elif isinstance(layer, ReLU):
                h = F.relu(h)
            elif isinstance(layer, MaxPool2d):
                h = F.max_pool2d(h, layer.kernel, stride=layer.step, padding=layer.padding)
            elif isinstance(layer, Flatten):
                h = h.flatten(1)
        return h

    def _int_forward(self, x, bits: int):
        """The s-bit integer devices' forward in float32, straight-through (class docstring)."""
        torch = self._torch
        F = torch.nn.functional
        s_one = float(1 << (bits - 1))        # S(s): the activations' scale
        amax = s_one - 1.0
        g_one = float(grid_scale(bits))       # S(s_g): the weights' storage grid
        thr = float(ternary_threshold(bits))
        h = torch.round(x.clamp(0.0, 1.0) * amax) / s_one
        layers = self.spec.layers
        p = 0
        for i, layer in enumerate(layers):
            if isinstance(layer, (Conv2d, Linear)):
                w = self.params[p]
                with torch.no_grad():
                    q = torch.round(w * g_one)  # the device's grid integers (half to even)
                    wt = TERNARY_WEIGHT * ((q > thr).to(w.dtype) - (q < -thr).to(w.dtype))
                w = w + (wt - w).detach()
                if isinstance(layer, Conv2d):
                    h = F.conv2d(h, w, stride=layer.stride, padding=layer.padding)
                else:
                    h = F.linear(h, w)
                h = h / self._alpha[p]
                relu = i + 1 < len(layers) and isinstance(layers[i + 1], ReLU)
                if relu:
                    h = F.relu(h)
                with torch.no_grad():
                    v = h * s_one  # round half away from zero, as the integer shift does
                    hq = torch.sign(v) * torch.floor(v.abs() + 0.5)
                    hq = hq.clamp(0.0 if relu else -amax, amax) / s_one
                h = h + (hq - h).detach()
                p += 1
            elif isinstance(layer, ReLU):
                h = F.relu(h)
            elif isinstance(layer, MaxPool2d):
                h = F.max_pool2d(h, layer.kernel, stride=layer.step, padding=layer.padding)
            elif isinstance(layer, Flatten):
                h = h.flatten(1)
        return h

    def _loss(self, logits, y, bits: int | None = None):
        F = self._torch.nn.functional
        bits = self.forward_bits if bits is None else bits
        if (self.loss_kind or ("ce" if bits == 32 else "sse")) == "ce":
            return F.cross_entropy(logits, y)
        # SSE against the integer devices' target (S - 1)/S for an integer forward
        target = 0.5 if bits == 32 else 1.0 - 1.0 / (1 << (bits - 1))
        onehot = F.one_hot(y, self.spec.num_classes).to(logits.dtype) * target
        return ((logits - onehot) ** 2).sum(dim=1).mean()

    # training --------------------------------------------------------------

    def train(self, data: Dataset, *, epochs: int = 1, steps: int | None = None,
              batch: int = 32, prox_mu: float = 0.0, fedfor_alpha: float = 0.0,
              last_global_step: list[np.ndarray] | None = None, lr: float | None = None,
              momentum: float | None = None, grad_clip: float | None = None,
              weight_standardization: bool | None = None,
              forward: str | None = None) -> TrainReport:
        """Local SGD; loss reported is the mean training loss (CE or SSE) over the steps.
        ``lr``, ``momentum``, ``grad_clip``, ``weight_standardization``, ``forward`` (the
        network trained: ``float32`` or ``int<s>``, class docstring): this call's values
        (None: the trainer's)."""
        torch = self._torch
        n_steps = _check_train_args(data, self.spec, epochs, steps, batch, prox_mu,
                                    fedfor_alpha, last_global_step)
        lr = self.lr if lr is None else float(lr)
        momentum = self.momentum if momentum is None else float(momentum)
        _check_sgd(lr, momentum)
        grad_clip = self.grad_clip if grad_clip is None else float(grad_clip)
        if not grad_clip >= 0:
            raise ConfigError(f"grad_clip must be >= 0, got {grad_clip}")
        ws = self.weight_standardization if weight_standardization is None else bool(weight_standardization)
        bits = self.forward_bits if forward is None else forward_bits(forward)
        if ws and bits != 32:
            raise ConfigError(f"weight standardization applies to the float forward, not {forward!r}")
        t0 = time.perf_counter()
        rng = np.random.default_rng([self.seed, self._calls])
        self._calls += 1
        anchor = [p.detach().clone() for p in self.params]
        gsteps = None
        if fedfor_alpha > 0 and last_global_step is not None:
            gsteps = [torch.from_numpy(np.asarray(g, dtype=np.float32)) for g in last_global_step]
        buffers: list = [None] * len(self.params)  # momentum buffers, fresh each call
        x_all = torch.from_numpy(np.ascontiguousarray(data.x, dtype=np.float32))
        y_all = torch.from_numpy(np.ascontiguousarray(data.y, dtype=np.int64))
        total = 0.0
        samples = 0
        for idx in _batches(len(data), batch, n_steps, rng):
            ti = torch.from_numpy(idx)
            xb, yb = x_all[ti], y_all[ti]
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
            loss = self._loss(self.forward(xb, ws, bits), yb, bits)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
            if prox_mu > 0 or gsteps is not None:
                with torch.no_grad():
                    for i, p in enumerate(self.params):
                        d = p - anchor[i]
                        if prox_mu > 0:
                            p.grad.add_(d, alpha=prox_mu)
                        if gsteps is not None:
                            g = gsteps[i]
                            p.grad.add_(torch.where(g * d > 0, g, torch.zeros_like(g)),
                                        alpha=fedfor_alpha)
            with torch.no_grad():
                _sgd_step(self.params, buffers, lr, momentum)
                for p in self.params:
                    p.clamp_(-self.clip, self.clip)
            total += float(loss.detach()) * len(idx)
            samples += len(idx)
        loss_mean = total / samples if samples else 0.0
        return TrainReport(n_steps, samples, loss_mean, time.perf_counter() - t0)

    def evaluate(self, data: Dataset, batch: int = 256) -> tuple[float, float]:
        """(mean loss, accuracy in [0, 1]) of the current weights on ``data``."""
        torch = self._torch
        if len(data) == 0:
            raise TrainingError("evaluate: the data set is empty")
        x_all = torch.from_numpy(np.ascontiguousarray(data.x, dtype=np.float32))
        y_all = torch.from_numpy(np.ascontiguousarray(data.y, dtype=np.int64))
        total = 0.0
        hits = 0
        with torch.no_grad():
            for s in range(0, len(data), batch):
                xb, yb = x_all[s:s + batch], y_all[s:s + batch]
                logits = self.forward(xb)
                total += float(self._loss(logits, yb)) * len(yb)
                hits += int((logits.argmax(dim=1) == yb).sum())
        return total / len(data), hits / len(data)


def forward_bits(forward: str) -> int:
    """The bitwidth of a forward name: 32 for ``float32`` (the float forward), s for
    ``int<s>`` (the s-bit integer devices' forward); ConfigError otherwise."""
    try:
        return variant_bits(str(forward))
    except ProtocolError:
        raise ConfigError(f"forward must be 'float32' or 'int2'..'int16', got {forward!r}") from None


def _sgd_step(params: list, buffers: list, lr: float, momentum: float) -> None:
    """One step of SGD with momentum, as ``torch.optim.SGD`` computes it (dampening 0, no
    Nesterov, no weight decay; the same operations, so the same bits): ``b <- grad`` on the
    first step, then ``b <- momentum * b + grad``; ``p <- p - lr * b``. Written out because
    constructing ``torch.optim.SGD`` imports ``torch._dynamo`` (~70 MB of RSS on a device)."""
    for i, p in enumerate(params):
        g = p.grad
        if momentum:
            if buffers[i] is None:
                buffers[i] = g.detach().clone()
            else:
                buffers[i].mul_(momentum).add_(g)
            g = buffers[i]
        p.add_(g, alpha=-lr)


def make_trainer(spec: ModelSpec | str, bits: int, seed: int = 0, **hparams) -> Trainer:
    """``bits == 32`` -> :class:`TorchTrainer`, else an s-bit :class:`IntTrainer`."""
    if bits == 32:
        return TorchTrainer(spec, seed=seed, **hparams)
    return IntTrainer(spec, bits, seed=seed, **hparams)
