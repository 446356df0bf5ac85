"""Conv slices and the slice dequantizer: ProWD's convolutional blocks (appendix C, kernel 3)
over weight planes in which neighbours are related weights.

:class:`SliceLayout` cuts each layer's flat weights into planes ``[P, H, W]`` and pastes
them back: a conv weight ``[O, I, kh, kw]`` as one plane per output filter (its I kernels
tiled ``gr x gc``), a linear weight that reads a flattened feature map ``(c, h, w)`` as one
``[h, w]`` plane per output unit and input channel, any other linear weight as one plane.

:class:`SliceNet` is the progressive dequantizer on those planes, one :class:`SliceStep`
per ladder step, ``x + τ·(ρ'(ρ(x)) - x)`` with couplings ``x·exp(β) + γ`` whose β and γ are
read per position from ``x`` and from convolutional features of a context plane: ``x``
itself (``context = "update"``) or the global model the device started from
(``"global"``: one output per received level, so :func:`compile_tables` makes lookup
tables that :func:`apply_table` applies as cheaply as decoding). Why and how:
docs/algorithms.md §4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from coordinator.strategies.prowd_dequantizer.config import FULL_PRECISION, DequantizerConfig
from coordinator.strategies.prowd_dequantizer.ladder import level_max, level_scale
from firmware_models import Conv2d, Flatten, Linear, ModelSpec

MAX_LOG_SCALE = 4.0  # exp(β) is clamped to e^4, as in the block network


def flat_inputs(spec: ModelSpec | None) -> dict[int, tuple[int, int, int]]:
    """Parameter index -> the ``(c, h, w)`` feature map a linear layer reads through a
    Flatten (only where h·w > 1)."""
    if spec is None:
        return {}
    out: dict[int, tuple[int, int, int]] = {}
    acts = spec.activation_shapes
    p = 0
    flat_from: tuple[int, ...] | None = None
    for k, layer in enumerate(spec.layers):
        if isinstance(layer, Flatten):
            flat_from = tuple(acts[k])
        elif isinstance(layer, Linear):
            if flat_from is not None and len(flat_from) == 3 and flat_from[1] * flat_from[2] > 1:
                out[p] = (int(flat_from[0]), int(flat_from[1]), int(flat_from[2]))
            flat_from = None
            p += 1
        elif isinstance(layer, Conv2d):
            flat_from = None
            p += 1
    return out


def _grid(n: int) -> tuple[int, int]:
    """(rows, cols) of n tiles: rows the largest divisor of n not above sqrt(n)."""
    r = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
    return r, n // r


class SliceLayout:
    """Each layer (``shapes``, spec order) as planes ``[P, H, W]`` (module docstring);
    ``flats``: :func:`flat_inputs` of the spec. A layer is given and returned flat."""

    def __init__(self, shapes: Sequence[Sequence[int]], flats: dict[int, tuple[int, int, int]] | None = None) -> None:
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.planes: list[tuple[int, int, int]] = []
        #: per layer: flat indices in plane order (int64 [P, H, W]), or None (a reshape)
        self.index: list[np.ndarray | None] = []
        flats = flats or {}
        for i, s in enumerate(self.shapes):
            if len(s) == 4:
                o, n_in, kh, kw = s
                gr, gc = _grid(n_in)
                idx = np.arange(self.sizes[i], dtype=np.int64).reshape(o, gr, gc, kh, kw)
                self.index.append(np.ascontiguousarray(idx.transpose(0, 1, 3, 2, 4)).reshape(o, gr * kh, gc * kw))
                self.planes.append((o, gr * kh, gc * kw))
            elif len(s) == 2 and i in flats and flats[i][0] * flats[i][1] * flats[i][2] == s[1]:
                c, h, w = flats[i]
                self.planes.append((s[0] * c, h, w))
                self.index.append(None)
            else:
                rows = s[0] if len(s) >= 2 else 1
                self.planes.append((1, rows, self.sizes[i] // rows))
                self.index.append(None)

    def cut(self, i: int, flat: np.ndarray) -> np.ndarray:
        """Layer ``i`` (flat) -> float32 [P, H, W]."""
        flat = np.asarray(flat, dtype=np.float32).reshape(-1)
        idx = self.index[i]
        return flat[idx] if idx is not None else flat.reshape(self.planes[i])

    def paste(self, i: int, planes: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`cut` (any leading axes kept: [..., P, H, W] -> [..., n])."""
        lead = planes.shape[:-3]
        planes = np.asarray(planes, dtype=np.float32).reshape(*lead, -1)
        idx = self.index[i]
        if idx is None:
            return np.ascontiguousarray(planes)
        out = np.empty((*lead, self.sizes[i]), np.float32)
        out[..., idx.reshape(-1)] = planes
        return out


def quantize_t(x: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    """Q_bits on a tensor (half to even, as ``ladder.quantize``); ``bits >= 32``: ``x``."""
    if bits >= FULL_PRECISION:
        return x
    s = level_scale(bits)
    m = float(level_max(bits, clip))
    return torch.clamp(torch.round(x * s), -m, m) / s


class _Context(nn.Module):
    """Two k×k convolutions over a context plane, each reading everything before it (a
    dense block): [N, 1, H, W] -> [N, 1 + 2·growth, H, W]."""

    def __init__(self, growth: int, kernel: int) -> None:
        super().__init__()
        pad = kernel // 2
        self.f1 = nn.Conv2d(1, growth, kernel, padding=pad)
        self.f2 = nn.Conv2d(1 + growth, growth, kernel, padding=pad)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        h1 = F.relu(self.f1(c))
        h2 = F.relu(self.f2(torch.cat([c, h1], 1)))
        return torch.cat([c, h1, h2], 1)


class _Head(nn.Module):
    """One coupling's per-position map: features [M, f] -> (β, γ) [M], through a hidden
    layer; the output layer starts at 0 (the coupling starts as the identity)."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.h = nn.Linear(n_in, hidden)
        self.out = nn.Linear(n_in + hidden, 2)

    def forward(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.out(torch.cat([f, F.relu(self.h(f))], 1))
        return y[:, 0], y[:, 1]


class SliceStep(nn.Module):
    """φ^{π_j → π_j+1} on planes (module docstring)."""

    def __init__(self, cfg: DequantizerConfig, bits: int, next_bits: int) -> None:
        super().__init__()
        self.tau = float(cfg.tau)
        self.bits = int(bits)
        self.next_bits = int(next_bits)
        self.clip = float(cfg.clip)
        self.anchored = cfg.context == "global"
        self.context = _Context(cfg.growth, cfg.kernel)
        n_ctx = 1 + 2 * cfg.growth
        n_in = 1 + n_ctx + (3 if self.anchored else 0)
        self.rho1 = _Head(n_in, cfg.growth * 2)
        self.rho2 = _Head(n_in, cfg.growth * 2)

    def features(self, ctx: torch.Tensor) -> torch.Tensor:
        """Context features per position, [P·H·W, f] from planes [P, H, W]."""
        f = self.context(ctx.unsqueeze(1))
        return f.permute(0, 2, 3, 1).reshape(-1, f.shape[1])

    def extra(self, g: torch.Tensor) -> torch.Tensor:
        """The anchored form's per-position inputs besides x: (g, Q_π_j(g), Q_π_j+1(g)),
        [M, 3] (the step's target where the device's code is still the global's)."""
        flat = g.reshape(-1)
        return torch.stack([flat, quantize_t(flat, self.bits, self.clip),
                            quantize_t(flat, self.next_bits, self.clip)], 1)

    def forward_flat(self, x: torch.Tensor, feats: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """The step on positions: ``x`` [M], ``feats`` [M, f] (rows may repeat per level),
        ``extra`` [M, 3] (anchored: :meth:`extra`) -> [M]."""
        y = x
        for head in (self.rho1, self.rho2):
            cols = [y[:, None], feats]
            if extra is not None:
                cols += [extra[:, :1] - y[:, None], (y - extra[:, 1])[:, None], extra[:, 2:] - y[:, None]]
            beta, gamma = head(torch.cat(cols, 1))
            y = y * torch.exp(torch.clamp(beta, max=MAX_LOG_SCALE)) + gamma
        return x + self.tau * (y - x)


class SliceNet(nn.Module):
    """The slice dequantizer: one :class:`SliceStep` per ladder step."""

    def __init__(self, cfg: DequantizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.clip = float(cfg.clip)
        self.anchored = cfg.context == "global"
        self.steps = nn.ModuleList(SliceStep(cfg, b, nb) for b, nb in zip(cfg.ladder[:-1], cfg.ladder[1:], strict=True))

    def _clamp(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.training else torch.clamp(y, -self.clip, self.clip)

    def step(self, x: torch.Tensor, g: torch.Tensor | None, j: int) -> torch.Tensor:
        """Step j alone on planes ``x`` [P, H, W] (``g``: the global's planes, anchored)."""
        st = self.steps[j]
        feats = st.features(g if self.anchored else x)
        extra = st.extra(g) if self.anchored else None
        return self._clamp(st.forward_flat(x.reshape(-1), feats, extra)).reshape(x.shape)

    def forward(self, x: torch.Tensor, g: torch.Tensor | None, start: int = 0) -> torch.Tensor:
        """Steps ``start``.. on planes [P, H, W]."""
        for j in range(start, len(self.steps)):
            x = self.step(x, g, j)
        return x


def build_slice_net(cfg: DequantizerConfig, seed: int) -> SliceNet:
    """A fresh network from ``seed`` only: layers uniform in ±1/sqrt(fan_in), every
    head's output layer 0 (each step starts as the identity)."""
    net = SliceNet(cfg)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                bound = 1.0 / math.sqrt(m.weight[0].numel())
                m.weight.copy_((torch.rand(m.weight.shape, generator=gen) * 2 - 1) * bound)
                m.bias.copy_((torch.rand(m.bias.shape, generator=gen) * 2 - 1) * bound)
        for m in net.modules():
            if isinstance(m, _Head):
                m.out.weight.zero_()
                m.out.bias.zero_()
    return net


def run_planes(net: SliceNet, planes: np.ndarray, start: int, chunk: int = 4096) -> np.ndarray:
    """The unanchored network on a layer's planes [P, H, W] (float32), in chunks of planes."""
    out = np.empty_like(planes)
    with torch.inference_mode():
        for s in range(0, len(planes), chunk):
            out[s:s + chunk] = net(torch.from_numpy(planes[s:s + chunk]), None, start).numpy()
    return out


def compile_tables(net: SliceNet, layout: SliceLayout, global_weights: Sequence[np.ndarray],
                   rungs: Sequence[int], chunk_positions: int = 1 << 16) -> dict[int, list[np.ndarray]]:
    """The anchored network's output for every level of every entry rung in ``rungs`` at
    every weight of the round's global model: ``{bits: [float32 [L, n_i] per layer]}``,
    L = 2·m_bits + 1 levels (row k: level k - m)."""
    cfg = net.cfg
    out: dict[int, list[np.ndarray]] = {}
    with torch.inference_mode():
        for bits in rungs:
            start = cfg.ladder.index(bits)
            m = level_max(bits, cfg.clip)
            levels = torch.arange(-m, m + 1, dtype=torch.float32) / level_scale(bits)
            per_layer = []
            for i, gw in enumerate(global_weights):
                g = torch.from_numpy(layout.cut(i, gw))
                n_pos = g.numel()
                feats = [net.steps[j].features(g) for j in range(start, len(net.steps))]
                extra = [net.steps[j].extra(g) for j in range(start, len(net.steps))]
                res = np.empty((len(levels), n_pos), np.float32)
                for a in range(0, n_pos, chunk_positions):
                    b = min(n_pos, a + chunk_positions)
                    x = levels.repeat_interleave(b - a)
                    for k, j in enumerate(range(start, len(net.steps))):
                        f = feats[k][a:b].repeat(len(levels), 1)
                        e = extra[k][a:b].repeat(len(levels), 1)
                        x = torch.clamp(net.steps[j].forward_flat(x, f, e), -net.clip, net.clip)
                    res[:, a:b] = x.reshape(len(levels), b - a).numpy()
                per_layer.append(layout.paste(i, res.reshape(len(levels), *layout.planes[i])))
            if all(np.all(np.isfinite(t)) for t in per_layer):  # else that rung passes through
                out[bits] = per_layer
    return out


@numba.njit(cache=True, nogil=True)
def _gather(x: np.ndarray, scale: float, m: int, table: np.ndarray, out: np.ndarray) -> bool:
    """out[p] = table[level(x[p]) + m, p]; False when a value is off the grid's range."""
    for p in range(x.size):
        v = np.float64(x[p]) * scale
        if not (abs(v) <= m):  # NaN fails too
            return False
        k = np.int64(np.rint(v))
        if np.float64(k) != v:
            return False
        out[p] = table[k + m, p]
    return True


def apply_table(flat: np.ndarray, table: np.ndarray, bits: int, clip: float) -> np.ndarray | None:
    """A received layer (flat float32 on the ``bits`` grid) looked up in its compiled table
    (float32 [L, n]); None when a value is not a level of that grid."""
    x = np.ascontiguousarray(flat, dtype=np.float32).reshape(-1)
    out = np.empty_like(x)
    ok = _gather(x, level_scale(bits), level_max(bits, clip), table, out)
    return out if ok else None
