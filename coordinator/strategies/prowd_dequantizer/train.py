"""Training the progressive dequantizer (ProWD Algorithm 1) on full-precision weights.

The training set: models (float32 devices' weights, the global model) cut into blocks
(``blocks.BlockLayout``) and quantized down the ladder, ``q_j = Q_{π_j}(w)``. One step, on
a batch of blocks of one model:

- L_recon = Σ_j mean |q_{j+1} - φ^{π_j → π_j+1}(q_j)| over the real (unpadded) elements
  (eq. 4, each block fed its own rung's quantized weights);
- L_distill = -mean cos(softmax f(u; w), softmax f(u; w')) (eq. 5), ``w'`` the model with
  the batch's blocks replaced by φ^{π_0 → π_k}(q_0), ``u`` a minibatch of the server's
  unlabeled inputs plus Gaussian noise (skipped without a model spec or with λ = 0);
- L = L_recon + λ·L_distill, one optimizer step.

Quantization runs in torch on the batch (the same rounding as ``ladder.quantize``: half to
even), so the full ladder of a large model is never materialized.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from coordinator.strategies.prowd_dequantizer.blocks import BlockLayout
from coordinator.strategies.prowd_dequantizer.config import FULL_PRECISION, DequantizerConfig
from coordinator.strategies.prowd_dequantizer.ladder import level_max, level_scale
from coordinator.strategies.prowd_dequantizer.network import ProgressiveDequantizer, spec_forward
from firmware_models import ModelSpec


class TrainingStopped(Exception):
    """Raised inside a training when its stop event is set (the stage is closing)."""


@dataclass
class Distillation:
    """What the distillation term needs: the spec, its α_l, the unlabeled inputs
    (float32 tensor [N, *input_shape])."""

    spec: ModelSpec
    alphas: list[float]
    inputs: torch.Tensor


@dataclass
class TrainStats:
    """One training run: optimizer steps, blocks seen, last epoch's mean losses, seconds."""

    steps: int
    blocks: int
    recon: float
    distill: float
    seconds: float


def quantize_t(x: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    """Q_bits on a tensor (``bits >= 32``: ``x`` itself)."""
    if bits >= FULL_PRECISION:
        return x
    s = level_scale(bits)
    m = float(level_max(bits, clip))
    return torch.clamp(torch.round(x * s), -m, m) / s


class Optimizer:
    """SGD (with ``cfg.momentum``) or Adam (β = 0.9, 0.999, ε = 1e-8) steps written out:
    ``torch.optim`` imports ``torch._dynamo``, tens of MB more resident memory for the
    coordinator and the emulator that runs it (docs/performance.md#memory)."""

    def __init__(self, params: list[torch.Tensor], cfg: DequantizerConfig) -> None:
        self.params = params
        self.lr = float(cfg.lr)
        self.adam = cfg.optimizer == "adam"
        self.momentum = float(cfg.momentum)
        self.t = 0
        self.m = [torch.zeros_like(p) for p in params] if self.adam or self.momentum else []
        self.v = [torch.zeros_like(p) for p in params] if self.adam else []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for k, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if self.adam:
                self.m[k].mul_(0.9).add_(g, alpha=0.1)
                self.v[k].mul_(0.999).addcmul_(g, g, value=0.001)
                m_hat = self.m[k] / (1 - 0.9 ** self.t)
                v_hat = self.v[k] / (1 - 0.999 ** self.t)
                p.sub_(self.lr * m_hat / (v_hat.sqrt() + 1e-8))
            elif self.momentum:
                self.m[k].mul_(self.momentum).add_(g)
                p.sub_(self.lr * self.m[k])
            else:
                p.sub_(self.lr * g)


@dataclass
class _Model:
    blocks: np.ndarray       # float32 [N, C, H, W]
    layers: np.ndarray       # int64 [N]: the layer of each block
    ks: np.ndarray           # int64 [N]: its number within the layer
    flat: torch.Tensor | None  # float32 [n_params], the weights concatenated (distillation)


def _prepare(layout: BlockLayout, models: Sequence[Sequence[np.ndarray]], flat: bool) -> list[_Model]:
    out = []
    for w in models:
        blocks, layers, ks = layout.cut_model(w)
        f = torch.from_numpy(np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in w])) if flat else None
        out.append(_Model(blocks, layers, ks, f))
    return out


def _batches(models: list[_Model], cfg: DequantizerConfig, rng: np.random.Generator) -> list[tuple[int, np.ndarray]]:
    """(model, block indices) batches of one epoch: at most ``max_train_blocks`` blocks
    drawn without replacement, grouped by model, in a shuffled order."""
    pairs = np.concatenate([np.stack([np.full(len(m.blocks), k), np.arange(len(m.blocks))], 1)
                            for k, m in enumerate(models)])
    if cfg.max_train_blocks and len(pairs) > cfg.max_train_blocks:
        pairs = pairs[rng.choice(len(pairs), cfg.max_train_blocks, replace=False)]
    batches = []
    for k in range(len(models)):
        mine = pairs[pairs[:, 0] == k, 1]
        rng.shuffle(mine)
        batches += [(k, mine[s:s + cfg.batch]) for s in range(0, len(mine), cfg.batch)]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def train_network(net: ProgressiveDequantizer, cfg: DequantizerConfig, layout: BlockLayout,
                  models: Sequence[Sequence[np.ndarray]], distill: Distillation | None, *,
                  seed: int, epochs: int | None = None, stop: threading.Event | None = None) -> TrainStats:
    """Train ``net`` in place on ``models`` (each a list of float32 layers, spec order) for
    ``epochs`` (default ``cfg.epochs``), with torch limited to ``cfg.threads`` threads
    (restored after). ``stop``: checked before every step (:class:`TrainingStopped`)."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(net, cfg, layout, models, distill, seed, cfg.epochs if epochs is None else int(epochs),
                      stop or threading.Event())
    finally:
        torch.set_num_threads(threads)


def _train(net: ProgressiveDequantizer, cfg: DequantizerConfig, layout: BlockLayout,
           models: Sequence[Sequence[np.ndarray]], distill: Distillation | None, seed: int,
           n_epochs: int, stop: threading.Event) -> TrainStats:
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(int(seed))
    use_distill = distill is not None and cfg.lam > 0
    data = _prepare(layout, models, use_distill)
    opt = Optimizer(list(net.parameters()), cfg)
    lad = cfg.ladder
    sizes = [int(np.prod(s)) for s in layout.shapes]
    steps = seen = 0
    recon_sum = distill_sum = 0.0
    net.train()
    for _ in range(n_epochs):
        recon_sum = distill_sum = 0.0
        batches = _batches(data, cfg, rng)
        for k, idx in batches:
            if stop.is_set():
                raise TrainingStopped
            m = data[k]
            x = torch.from_numpy(m.blocks[idx])
            index = layout.model_index(m.layers[idx], m.ks[idx])  # -1 = padding
            mask = torch.from_numpy(index >= 0).to(x.dtype).reshape(x.shape)
            n_real = mask.sum().clamp_min(1.0)
            q = [quantize_t(x, b, cfg.clip) for b in lad]
            recon = x.new_zeros(())
            for j in range(len(lad) - 1):
                recon = recon + ((net.step(q[j], j) - q[j + 1]).abs() * mask).sum() / n_real
            loss = recon
            if use_distill:
                d = _distill_loss(net, q[0], m, index, distill, sizes, layout, cfg, gen)
                loss = loss + cfg.lam * d
                distill_sum += float(d.detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
            recon_sum += float(recon.detach())
            steps += 1
            seen += len(idx)
        n_b = max(1, len(batches))
        recon_sum, distill_sum = recon_sum / n_b, distill_sum / n_b
    net.eval()
    return TrainStats(steps, seen, recon_sum, distill_sum, time.perf_counter() - t0)


def _distill_loss(net: ProgressiveDequantizer, q0: torch.Tensor, m: _Model, index: np.ndarray,
                  distill: Distillation, sizes: list[int], layout: BlockLayout, cfg: DequantizerConfig,
                  gen: torch.Generator) -> torch.Tensor:
    """eq. 5 for one batch of one model's blocks (``index``: their elements' positions in
    the model, -1 = padding; see the module docstring)."""
    assert m.flat is not None
    n = distill.inputs.shape[0]
    pick = torch.randint(n, (min(cfg.distill_batch, n),), generator=gen)
    u = distill.inputs[pick]
    if cfg.noise_std > 0:
        u = u + cfg.noise_std * torch.randn(u.shape, generator=gen)
    deq = net(q0, 0).reshape(len(index), -1)
    gi = torch.from_numpy(index)
    real = gi >= 0
    w_new = m.flat.index_put((gi[real],), deq[real])
    layers = [t.reshape(s) for t, s in zip(torch.split(w_new, sizes), layout.shapes, strict=True)]
    with torch.no_grad():
        true = [t.reshape(s) for t, s in zip(torch.split(m.flat, sizes), layout.shapes, strict=True)]
        p_true = F.softmax(spec_forward(distill.spec, true, u, distill.alphas), 1)
    p_deq = F.softmax(spec_forward(distill.spec, layers, u, distill.alphas), 1)
    return -F.cosine_similarity(p_true, p_deq, dim=1).mean()
