"""TorchTrainer: float32 local training of the shared domain, with the float forward or an
integer devices' forward (``forward="int<s>"``). torch is imported only when one is built."""

from __future__ import annotations

import math
import time

import numpy as np

from edge_client.compat import zip_strict
from edge_client.data import Dataset, float_images
from edge_client.errors import ConfigError, ProtocolError, TrainingError
from edge_client.intnn.quant import (
    DEFAULT_CLIP,
    TERNARY_WEIGHT,
    alpha_shifts,
    grid_scale,
    init_shared,
    ternary_threshold,
)
from edge_client.protocol import FLOAT_VARIANT, variant_bits
from edge_client.trainers.common import (
    DEFAULT_LR_SHIFT,
    DEFAULT_MOMENTUM,
    DEFAULT_TORCH_LR,
    TrainReport,
    as_spec,
    batches,
    check_sgd,
    check_train_args,
)
from firmware_models import MaxPool2d, ModelSpec


class TorchTrainer:
    """float32 local training of the same parameter domain (docs/algorithms.md §2).

    Forward ``layer(a, W) / alpha_l`` (no quantization), softmax cross-entropy, SGD with
    momentum (fresh each :meth:`train` call), gradient-norm clipping of the data gradient
    (the FedProx / FedFOR terms are added after it), and ``W`` clamped to
    ``[-clip, clip]`` after every step. ``weight_standardization`` (FedWSQ): each output
    channel's weights are standardized, ``W~ = rho (W - mean) / std`` with ``rho = 1e-3``
    (FedWSQ's value), and, since these models have no normalization layer after it, the
    layer output is rescaled by ``sqrt(2 / fan_in) / rho`` (He gain). ``weight_norm``
    (ProWD appendix B: Weight Normalization on the float clients, so that the scale of the
    aggregated weights, which integer devices pull toward their ternary levels, does not
    change the float network): each output channel's weights are used as
    ``g W_c / ||W_c||`` with the gain ``g = sqrt(2)`` fixed (the He norm of a filter; the
    shared domain has no parameter to carry a trained g) in place of ``W / alpha_l``.

    ``forward``: the network it trains and evaluates. ``"float32"`` (default): the float
    forward above. ``"int<s>"``: the s-bit integer devices' forward (:mod:`edge_client.intnn`,
    docs/algorithms.md §1), computed in float32 so that one global model is one function for
    every group: inputs ``round(x (S - 1)) / S`` (``S = 2^(s-1)``), weights
    ``0.5 ternary(W)`` (``|round(W S(s_g))| > S(s_g)/4``, as the device ternarizes its grid
    integers), each conv/linear output divided by ``alpha_l`` (the integer shift by
    ``1 + log2 alpha_l`` of ``sum t a``), ReLU, rounded half away from zero to the 1/S grid
    and clipped to ``+-(S - 1)/S``; the logits are the integer engine's divided by S
    (exactly: every partial sum is a multiple of 2^-(s + 1) far below 2^24). Gradients
    are straight-through: to ``W`` through the ternary weights, through the rounding and
    the upper clip (the ReLU masks), as the integer backward passes its errors. Its loss
    is the integer devices' (WAGE's SSE against ``(S - 1)/S`` one-hot) unless ``loss`` is
    given; weight standardization does not apply to it. Its data step is the integer
    devices' too (:func:`integer_step`: per layer, the largest gradient element moves
    ``2^lr_shift`` LSBs of the 8-bit grid, no momentum, no gradient clip): SGD with the
    float forward's ``lr`` and momentum on this piecewise-constant forward drove most
    first-layer filters past the ternary threshold in the first steps of a round
    (docs/training-health.md). ``lr``/``momentum`` then set the FedProx/FedFOR step only,
    ``lr / (1 - momentum)``, as on an integer device.
    """

    def __init__(self, spec: ModelSpec | str, lr: float = DEFAULT_TORCH_LR, seed: int = 0,
                 weight_standardization: bool = False, momentum: float = DEFAULT_MOMENTUM,
                 grad_clip: float = 2.0, clip: float = DEFAULT_CLIP, ws_rho: float = 1e-3,
                 loss: str | None = None, forward: str = FLOAT_VARIANT,
                 lr_shift: int = DEFAULT_LR_SHIFT, weight_norm: bool = False, step: str = "sgd") -> None:
        import torch

        self._torch = torch
        self.spec = as_spec(spec)
        self.bits = 32
        check_sgd(lr, momentum)
        self.forward_bits = forward_bits(forward)
        if loss not in (None, "ce", "sse"):
            raise ConfigError(f"loss must be 'ce' or 'sse', got {loss!r}")
        _check_norms(weight_standardization, weight_norm, self.forward_bits, forward)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.lr_shift = check_lr_shift(lr_shift)
        self.step = _check_step(step)
        self.grad_clip = float(grad_clip)
        self.clip = float(clip)
        self.seed = int(seed)
        self.weight_standardization = bool(weight_standardization)
        self.weight_norm = bool(weight_norm)
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
            for i, (p, w, s) in enumerate(zip_strict(self.params, weights, shapes)):
                w = np.asarray(w, dtype=np.float32)
                if tuple(w.shape) != tuple(s):
                    raise TrainingError(f"{self.spec.name}: weight {i} has shape "
                                        f"{list(w.shape)}, expected {list(s)}")
                if not np.all(np.isfinite(w)):
                    raise TrainingError(f"{self.spec.name}: weight {i} has NaN/Inf values")
                p.copy_(self._torch.from_numpy(np.ascontiguousarray(w)))

    def to_shared(self) -> list[np.ndarray]:
        return [p.detach().cpu().numpy().astype(np.float32, copy=True) for p in self.params]

    def int_weights(self) -> None:
        """A float device holds no grid integers."""
        return None

    def ternary_weights(self) -> None:
        """A float device sends shared-domain weights, whatever forward it trains."""
        return None

    # model -----------------------------------------------------------------

    def _effective(self, i: int, w, ws: bool, wn: bool = False):
        """(the layer's effective weight, the factor its output is multiplied by)."""
        if wn:
            flat = w.reshape(w.shape[0], -1)
            norm = flat.norm(dim=1, keepdim=True).clamp_min(1e-12)
            return (flat * (WN_GAIN / norm)).reshape(w.shape), 1.0
        if not ws:
            return w, 1.0 / self._alpha[i]
        flat = w.reshape(w.shape[0], -1)
        mean = flat.mean(dim=1, keepdim=True)
        std = flat.std(dim=1, unbiased=False, keepdim=True)
        ws = self.ws_rho * (flat - mean) / (std + 1e-8)
        gain = math.sqrt(2.0 / flat.shape[1]) / self.ws_rho
        return ws.reshape(w.shape), gain

    def forward(self, x, ws: bool | None = None, bits: int | None = None, taps: list | None = None,
                wn: bool | None = None):
        """Logits of a float32 batch ``x`` [N, C, H, W] (torch tensor) in [0, 1]; ``ws``:
        weight standardization; ``wn``: weight normalization; ``bits``: 32 for the float
        forward, s for the s-bit integer forward (class docstring). None: the trainer's
        settings. ``taps``: a list that gets each conv/linear layer's output (after the ReLU
        right after it, if any), as the integer engine keeps its activations."""
        bits = self.forward_bits if bits is None else bits
        if bits != 32:
            return self._int_forward(x, bits, taps)
        ws = self.weight_standardization if ws is None else ws
        wn = self.weight_norm if wn is None else wn
        h = x
        p = 0
        layers = self.spec.layers
        for i, layer in enumerate(layers):
            if layer.has_weights:
                w, scale = self._effective(p, self.params[p], ws, wn)
                h = layer.torch_forward(self._torch, h, w) * scale
                p += 1
            else:
                h = layer.torch_forward(self._torch, h)
            if taps is not None and _tap_after(layers, i):
                taps.append(h)
        return h

    def _int_forward(self, x, bits: int, taps: list | None = None):
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
            if not layer.has_weights:
                h = layer.torch_int_forward(torch, h, s_one)
                continue
            w = self.params[p]
            with torch.no_grad():
                q = torch.round(w * g_one)  # the device's grid integers (half to even)
                wt = TERNARY_WEIGHT * ((q > thr).to(w.dtype) - (q < -thr).to(w.dtype))
            w = w + (wt - w).detach()
            h = layer.torch_forward(torch, h, w)
            h = h / self._alpha[p]
            relu = i + 1 < len(layers) and layers[i + 1].is_relu
            if relu:
                h = F.relu(h)
            with torch.no_grad():
                v = h * s_one  # round half away from zero, as the integer shift does
                hq = torch.sign(v) * torch.floor(v.abs() + 0.5)
                hq = hq.clamp(0.0 if relu else -amax, amax) / s_one
            h = h + (hq - h).detach()
            p += 1
            if taps is not None:
                taps.append(h)
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
              forward: str | None = None, lr_shift: int | None = None,
              weight_norm: bool | None = None, step: str | None = None) -> TrainReport:
        """Local SGD; loss reported is the mean training loss (CE or SSE) over the steps.
        ``lr``, ``momentum``, ``grad_clip``, ``weight_standardization``, ``weight_norm``,
        ``forward`` (the network trained: ``float32`` or ``int<s>``, class docstring),
        ``lr_shift`` (the data step of an integer forward), ``step`` (the float forward's:
        ``sgd``, or ``integer``: the integer devices' step, as on an integer forward): this
        call's values (None: the trainer's)."""
        torch = self._torch
        n_steps = check_train_args(data, self.spec, epochs, steps, batch, prox_mu,
                                    fedfor_alpha, last_global_step)
        lr = self.lr if lr is None else float(lr)
        momentum = self.momentum if momentum is None else float(momentum)
        check_sgd(lr, momentum)
        grad_clip = self.grad_clip if grad_clip is None else float(grad_clip)
        if not grad_clip >= 0:
            raise ConfigError(f"grad_clip must be >= 0, got {grad_clip}")
        ws = self.weight_standardization if weight_standardization is None else bool(weight_standardization)
        wn = self.weight_norm if weight_norm is None else bool(weight_norm)
        bits = self.forward_bits if forward is None else forward_bits(forward)
        _check_norms(ws, wn, bits, forward)
        lr_shift = self.lr_shift if lr_shift is None else check_lr_shift(lr_shift)
        int_step = bits != 32 or (self.step if step is None else _check_step(step)) == "integer"
        t0 = time.perf_counter()
        rng = np.random.default_rng([self.seed, self._calls])
        self._calls += 1
        anchor = [p.detach().clone() for p in self.params]
        gsteps = None
        if fedfor_alpha > 0 and last_global_step is not None:
            gsteps = [torch.from_numpy(np.asarray(g, dtype=np.float32)) for g in last_global_step]
        buffers: list = [None] * len(self.params)  # momentum buffers, fresh each call
        y_all = np.ascontiguousarray(data.y, dtype=np.int64)
        total = 0.0
        samples = 0
        for idx in batches(len(data), batch, n_steps, rng):
            # only the batch's images made float (a device's whole split each call cost more)
            xb = torch.from_numpy(float_images(data.x[idx]))
            yb = torch.from_numpy(y_all[idx])
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
            loss = self._loss(self.forward(xb, ws, bits, wn=wn), yb, bits)
            loss.backward()
            with torch.no_grad():
                if int_step:  # the integer devices' step, the terms beside it (class docstring)
                    reg = [self._reg_term(p, anchor[i], prox_mu, gsteps, i, fedfor_alpha)
                           for i, p in enumerate(self.params)]
                    integer_step(self.params, lr_shift)
                    for p, r in zip_strict(self.params, reg):
                        if r is not None:
                            p.sub_(r, alpha=lr / (1.0 - momentum))
                else:
                    if grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
                    for i, p in enumerate(self.params):
                        r = self._reg_term(p, anchor[i], prox_mu, gsteps, i, fedfor_alpha)
                        if r is not None:
                            p.grad.add_(r)
                    sgd_step(self.params, buffers, lr, momentum)
                for p in self.params:
                    p.clamp_(-self.clip, self.clip)
            total += float(loss.detach()) * len(idx)
            samples += len(idx)
        loss_mean = total / samples if samples else 0.0
        return TrainReport(n_steps, samples, loss_mean, time.perf_counter() - t0)

    def _reg_term(self, p, anchor, prox_mu: float, gsteps, i: int, fedfor_alpha: float):
        """The FedProx + FedFOR gradient terms of parameter ``p`` (None when both are off):
        ``mu (W - W_g) + alpha g [g (W - W_g) > 0]``."""
        if prox_mu <= 0 and gsteps is None:
            return None
        torch = self._torch
        d = p - anchor
        r = d * prox_mu if prox_mu > 0 else torch.zeros_like(d)
        if gsteps is not None:
            g = gsteps[i]
            r.add_(torch.where(g * d > 0, g, torch.zeros_like(g)), alpha=fedfor_alpha)
        return r

    def evaluate(self, data: Dataset, batch: int = 256) -> tuple[float, float]:
        """(mean loss, accuracy in [0, 1]) of the current weights on ``data``."""
        torch = self._torch
        if len(data) == 0:
            raise TrainingError("evaluate: the data set is empty")
        y_all = torch.from_numpy(np.ascontiguousarray(data.y, dtype=np.int64))
        total = 0.0
        hits = 0
        with torch.no_grad():
            for s in range(0, len(data), batch):
                xb, yb = torch.from_numpy(float_images(data.x[s:s + batch])), y_all[s:s + batch]
                logits = self.forward(xb)
                total += float(self._loss(logits, yb)) * len(yb)
                hits += int((logits.argmax(dim=1) == yb).sum())
        return total / len(data), hits / len(data)


def max_pool(torch, h, layer: MaxPool2d):
    """``layer``'s max-pool of ``h`` [N, C, H, W] (``MaxPool2d.torch_forward``: channels-last
    when no gradient is recorded)."""
    return layer.torch_forward(torch, h)


def _tap_after(layers, i: int) -> bool:
    """Whether layer ``i`` ends a conv/linear layer's output: the layer itself when no ReLU
    follows it, else that ReLU."""
    layer = layers[i]
    if layer.has_weights:
        return not (i + 1 < len(layers) and layers[i + 1].is_relu)
    return layer.is_relu and i > 0 and layers[i - 1].has_weights


#: Weight Normalization's fixed gain: every output channel's effective weight has norm sqrt(2)
WN_GAIN = math.sqrt(2.0)


def _check_norms(ws: bool, wn: bool, bits: int, forward: object) -> None:
    """ConfigError when weight standardization or normalization cannot apply: both at
    once, or either with an integer forward."""
    if ws and wn:
        raise ConfigError("weight standardization and weight normalization exclude each other")
    if (ws or wn) and bits != 32:
        what = "weight standardization" if ws else "weight normalization"
        raise ConfigError(f"{what} applies to the float forward, not {forward!r}")


def forward_bits(forward: str) -> int:
    """The bitwidth of a forward name: 32 for ``float32`` (the float forward), s for
    ``int<s>`` (the s-bit integer devices' forward); ConfigError otherwise."""
    try:
        return variant_bits(str(forward))
    except ProtocolError:
        raise ConfigError(f"forward must be 'float32' or 'int2'..'int16', got {forward!r}") from None


def check_lr_shift(lr_shift: int) -> int:
    """An integer forward's step exponent (-8..8, as on an integer device)."""
    if isinstance(lr_shift, bool) or not isinstance(lr_shift, (int, np.integer)) or not -8 <= lr_shift <= 8:
        raise ConfigError(f"lr_shift must be an integer in -8..8, got {lr_shift!r}")
    return int(lr_shift)


def integer_step(params: list, lr_shift: int) -> None:
    """The integer devices' data step (paper eq. 15-16, WAGE) in float: per layer,
    ``W <- W - 2^(lr_shift - 7) G / 2^round(log2 max|G|)``, i.e. the largest gradient
    element moves ``2^lr_shift`` LSBs of the 8-bit grid (1/16 of the shared domain's unit
    at the default 3), whatever the gradient's magnitude. ``round(log2 m)`` is the
    engine's (``m > 2^(b + 1/2)`` rounds up), computed exactly from the float's exponent.
    No stochastic rounding: a float device keeps the fraction. The clip is the caller's."""
    for p in params:
        g = p.grad
        if g is None:
            continue
        m = float(g.abs().max())
        if not (m > 0 and math.isfinite(m)):
            continue
        f, e = math.frexp(m)  # m = f 2^e, f in [0.5, 1): round(log2 m) = e or e - 1
        k = e if f > math.sqrt(0.5) else e - 1
        p.add_(g, alpha=-math.ldexp(1.0, lr_shift - 7 - k))


def sgd_step(params: list, buffers: list, lr: float, momentum: float) -> None:
    """One step of SGD with momentum, as ``torch.optim.SGD`` computes it (dampening 0, no
    Nesterov, no weight decay; the same operations, so the same bits): ``b <- grad`` on the
    first step, then ``b <- momentum * b + grad``; ``p <- p - lr * b``. Written out because
    constructing ``torch.optim.SGD`` imports ``torch._dynamo``, tens of MB of RSS on a device
    (docs/performance.md#memory)."""
    for i, p in enumerate(params):
        g = p.grad
        if momentum:
            if buffers[i] is None:
                buffers[i] = g.detach().clone()
            else:
                buffers[i].mul_(momentum).add_(g)
            g = buffers[i]
        p.add_(g, alpha=-lr)


def _check_step(step: str) -> str:
    """``sgd`` or ``integer`` (ConfigError naming the value otherwise)."""
    if step not in ("sgd", "integer"):
        raise ConfigError(f"step must be 'sgd' or 'integer', got {step!r}")
    return step
