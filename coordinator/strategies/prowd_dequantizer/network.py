"""The progressive dequantizer network (torch): ProWD eq. 2-3, 17-18.

- ρ, an affine coupling layer (eq. 17) on a block x = [x_a, x_b] split by channels:
  ``y_a = x_a + α(x_b)``; ``y_b = x_b ⊙ exp(β(y_a)) + γ(y_a)``, α, β, γ small dense conv
  blocks (:class:`DenseBlock`; β and γ share one with two heads); ρ' is ρ with the halves
  swapped.
- a step ``φ(x) = x + τ·(ρ'(ρ(x)) - x)`` (``residual="deviation"``, the default: exactly
  the identity at initialization, every sub-network gets a gradient from the first step)
  or eq. 18 as printed (``residual="literal"``); why: docs/algorithms.md §4.
- the dequantizer is the stack of steps (eq. 2); a layer entering at rung j runs steps
  j..k-1.

:func:`spec_forward` is the float forward of a ``firmware_models`` spec on given weight
tensors (the shared domain: ``layer(a, W) / α_l``, no bias), for the distillation loss (eq. 5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from coordinator.strategies.prowd_dequantizer.config import DequantizerConfig
from firmware_models import ModelSpec

MAX_LOG_SCALE = 4.0  # exp(β) is clamped to e^4: a diverging scale cannot overflow
LITERAL_LOG_SCALE = -8.0  # β's initial value in the literal form: exp(-8) scales each half away


class DenseBlock(nn.Module):
    """α, β or γ: ``h1 = relu(f1(x))``, ``h2 = relu(f2([x, h1]))``, ``out = f3([x, h1, h2])``
    with k×k convolutions on [N, c, H, W] (``kernel`` > 1), or, for ``kernel`` = 1, the same
    per-position maps as linear layers on [positions, c] (one matrix product each instead
    of a 1×1 convolution); ``f3`` starts at 0 (:func:`build_network`)."""

    def __init__(self, c_in: int, c_out: int, growth: int, kernel: int) -> None:
        super().__init__()
        if kernel == 1:
            self.f1 = nn.Linear(c_in, growth)
            self.f2 = nn.Linear(c_in + growth, growth)
            self.out = nn.Linear(c_in + 2 * growth, c_out)
            self.dim = -1
        else:
            pad = kernel // 2
            self.f1 = nn.Conv2d(c_in, growth, kernel, padding=pad)
            self.f2 = nn.Conv2d(c_in + growth, growth, kernel, padding=pad)
            self.out = nn.Conv2d(c_in + 2 * growth, c_out, 1)
            self.dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = F.relu(self.f1(x))
        h2 = F.relu(self.f2(torch.cat([x, h1], self.dim)))
        return self.out(torch.cat([x, h1, h2], self.dim))


class Coupling(nn.Module):
    """ρ (eq. 17) on features along ``dim`` (1: [N, C, H, W]; -1: [positions, C]).
    ``swap``: the second half is the additive one."""

    def __init__(self, channels: int, growth: int, kernel: int, log_scale_init: float, swap: bool) -> None:
        super().__init__()
        self.d = channels // 2
        self.swap = swap
        self.dim = -1 if kernel == 1 else 1
        self.alpha = DenseBlock(self.d, self.d, growth, kernel)
        # β and γ read the same input: one dense block, two output heads (β's first)
        self.beta_gamma = DenseBlock(self.d, 2 * self.d, growth, kernel)
        with torch.no_grad():
            self.beta_gamma.out.bias[:self.d].fill_(log_scale_init)
        self.log_scale_init = float(log_scale_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, self.d, self.dim)
        if self.swap:
            a, b = b, a
        ya = a + self.alpha(b)
        beta, gamma = torch.split(self.beta_gamma(ya), self.d, self.dim)
        yb = b * torch.exp(torch.clamp(beta, max=MAX_LOG_SCALE)) + gamma
        return torch.cat([yb, ya] if self.swap else [ya, yb], self.dim)


class Step(nn.Module):
    """φ^{π_j → π_j+1} on the layout of :class:`Coupling`: ``x + τ·(ρ'(ρ(x)) - x)``
    (``residual="deviation"``, the default) or ``x + τ·ρ'(ρ(x))`` (``"literal"``, eq. 18
    as printed); see the module docstring."""

    def __init__(self, cfg: DequantizerConfig) -> None:
        super().__init__()
        c = cfg.block[0]
        self.tau = float(cfg.tau)
        self.deviation = cfg.residual == "deviation"
        log_scale = 0.0 if self.deviation else LITERAL_LOG_SCALE
        self.rho1 = Coupling(c, cfg.growth, cfg.kernel, log_scale, swap=False)
        self.rho2 = Coupling(c, cfg.growth, cfg.kernel, log_scale, swap=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rho2(self.rho1(x))
        return x + self.tau * (y - x if self.deviation else y)


class ProgressiveDequantizer(nn.Module):
    """One :class:`Step` per ladder step; ``forward(x, start)`` runs steps start..k-1 on
    blocks ``x`` float32 [N, C, H, W] (returned in that shape). Out of training mode each
    step's output is clamped to ±clip (the shared domain); in training it is not (a clamp
    there has no gradient, and the ±clip levels, where plain dequantization errs most,
    would never learn). A per-position network (kernel 1) runs on [N·H·W, C]."""

    def __init__(self, cfg: DequantizerConfig) -> None:
        super().__init__()
        self.clip = float(cfg.clip)
        self.pointwise = cfg.kernel == 1
        self.steps = nn.ModuleList(Step(cfg) for _ in range(len(cfg.ladder) - 1))

    def _into(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]) if self.pointwise else x

    def _back(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if not self.pointwise:
            return y
        n, c, h, w = like.shape
        return y.reshape(n, h, w, c).permute(0, 3, 1, 2)

    def _clamp(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.training else torch.clamp(y, -self.clip, self.clip)

    def step(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Step j alone on blocks [N, C, H, W]."""
        return self._back(self._clamp(self.steps[j](self._into(x))), x)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        y = self._into(x)
        for j in range(start, len(self.steps)):
            y = self._clamp(self.steps[j](y))
        return self._back(y, x)


def build_network(cfg: DequantizerConfig, seed: int) -> ProgressiveDequantizer:
    """A fresh network, initialized from ``seed`` only (no global RNG): the dense layers
    uniform in ±1/sqrt(fan_in), the projections 0 except β's bias in the literal form
    (``LITERAL_LOG_SCALE``)."""
    net = ProgressiveDequantizer(cfg)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, DenseBlock):
                for f in (m.f1, m.f2):
                    bound = 1.0 / math.sqrt(f.weight[0].numel())
                    f.weight.copy_((torch.rand(f.weight.shape, generator=gen) * 2 - 1) * bound)
                    f.bias.copy_((torch.rand(f.bias.shape, generator=gen) * 2 - 1) * bound)
                m.out.weight.zero_()
                m.out.bias.zero_()
        for m in net.modules():  # after the pass above (it reaches a Coupling's blocks later)
            if isinstance(m, Coupling):
                m.beta_gamma.out.bias[:m.d].fill_(m.log_scale_init)
    return net


def get_arrays(net: nn.Module) -> list[tuple[str, np.ndarray]]:
    """The parameters as (name, float32 copy), in ``named_parameters`` order."""
    return [(n, p.detach().cpu().numpy().astype(np.float32, copy=True)) for n, p in net.named_parameters()]


def set_arrays(net: nn.Module, arrays: Sequence[tuple[str, np.ndarray]]) -> None:
    """Load :func:`get_arrays` output; ValueError naming the first mismatch."""
    params = dict(net.named_parameters())
    names = [n for n, _ in arrays]
    if names != list(params):
        raise ValueError(f"parameter names differ: {names[:3]}... vs {list(params)[:3]}...")
    with torch.no_grad():
        for n, a in arrays:
            p = params[n]
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"parameter {n}: shape {list(a.shape)} != {list(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))


def spec_forward(spec: ModelSpec, weights: Sequence[torch.Tensor], x: torch.Tensor,
                 alphas: Sequence[float]) -> torch.Tensor:
    """Logits [N, classes] of ``spec`` with ``weights`` (spec order and shapes) on ``x``
    [N, *input_shape]: the float forward of the shared domain, ``layer(a, W) / α_l``."""
    h = x
    p = 0
    for layer in spec.layers:
        if layer.has_weights:
            h = layer.torch_forward(torch, h, weights[p]) / alphas[p]
            p += 1
        else:
            h = layer.torch_forward(torch, h)
    return h
