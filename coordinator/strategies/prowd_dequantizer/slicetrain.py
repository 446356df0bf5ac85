"""Training and judging the slice dequantizer (``slices``) on what it will see.

A training pair (:class:`Pair`) is a model's true weights and the global model it started
from: a float32 device's weights with its round's global model (each step learns one rung
up, eq. 4, and the whole stack the weights through the model's outputs, eq. 5), or, for
``context = "update"``, an integer device's received weights with the global model it
started from (the stack from its entry rung fitted to that model). One optimizer step per
batch of planes of one layer of one pair. :func:`heldout_l1` gives, per layer and entry
rung, the mean |ŵ - w| over held-out float32 pairs of the dequantized and the plainly
dequantized weights, by the path the stage applies (compiled tables for the global
context). docs/algorithms.md §4 says why these pairs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from coordinator.strategies.prowd_dequantizer.config import DequantizerConfig
from coordinator.strategies.prowd_dequantizer.ladder import quantize
from coordinator.strategies.prowd_dequantizer.network import get_arrays, set_arrays, spec_forward
from coordinator.strategies.prowd_dequantizer.slices import (
    SliceLayout,
    SliceNet,
    apply_table,
    build_slice_net,
    compile_tables,
    quantize_t,
    run_planes,
)
from coordinator.strategies.prowd_dequantizer.train import (
    Distillation,
    Optimizer,
    TrainingStopped,
    TrainStats,
)
from coordinator.strategies.serialize import array_from_state, array_to_state
from edge_client.errors import ProtocolError


@dataclass
class Pair:
    """True weights ``target`` and the global model ``glob`` they started from (lists of
    float32 layers, spec order); ``received``/``bits``: an integer device's received
    weights and each layer's entry rung (0: on no rung; then ``target`` is the global
    model)."""

    target: list[np.ndarray]
    glob: list[np.ndarray]
    received: list[np.ndarray] | None = None
    bits: tuple[int, ...] = ()


def table_rungs(cfg: DequantizerConfig) -> list[int]:
    """The entry rungs the anchored form compiles tables for (at most ``table_levels``
    levels each)."""
    from coordinator.strategies.prowd_dequantizer.ladder import level_max

    return [b for b in cfg.ladder[:-1] if 2 * level_max(b, cfg.clip) + 1 <= cfg.table_levels]


def _batches(layout: SliceLayout, pairs: Sequence[Pair], cfg: DequantizerConfig,
             rng: np.random.Generator) -> list[tuple[int, int, np.ndarray]]:
    """(pair, layer, plane indices) of one epoch: every pair's planes, at most
    ``max_train_blocks`` planes drawn (without replacement), ``batch`` x 64 positions a
    batch, in a shuffled order."""
    units = [(k, i, p) for k, pair in enumerate(pairs) for i, (n_p, _, _) in enumerate(layout.planes)
             if pair.received is None or pair.bits[i] in cfg.ladder[:-1] for p in range(n_p)]
    pick = np.arange(len(units))
    if cfg.max_train_blocks and len(units) > cfg.max_train_blocks:
        pick = np.sort(rng.choice(len(units), cfg.max_train_blocks, replace=False))
    by: dict[tuple[int, int], list[int]] = {}
    for u in pick:
        k, i, p = units[u]
        by.setdefault((k, i), []).append(p)
    out = []
    for (k, i), planes in by.items():
        _, h, w = layout.planes[i]
        per = max(1, (cfg.batch * 64) // (h * w))
        planes = np.array(planes)
        rng.shuffle(planes)
        out += [(k, i, planes[s:s + per]) for s in range(0, len(planes), per)]
    return [out[j] for j in rng.permutation(len(out))]


def train_slices(net: SliceNet, cfg: DequantizerConfig, layout: SliceLayout, pairs: Sequence[Pair],
                 distill: Distillation | None, *, seed: int, epochs: int | None = None,
                 stop: threading.Event | None = None) -> TrainStats:
    """Train ``net`` in place (module docstring), torch limited to ``cfg.threads``."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(net, cfg, layout, pairs, distill, seed, cfg.epochs if epochs is None else int(epochs),
                      stop or threading.Event())
    finally:
        torch.set_num_threads(threads)


def _train(net: SliceNet, cfg: DequantizerConfig, layout: SliceLayout, pairs: Sequence[Pair],
           distill: Distillation | None, seed: int, n_epochs: int, stop: threading.Event) -> TrainStats:
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(int(seed))
    use = [p for p in pairs if p.received is None or not net.anchored]
    cut = [([layout.cut(i, w) for i, w in enumerate(p.target)], [layout.cut(i, g) for i, g in enumerate(p.glob)],
            None if p.received is None else [layout.cut(i, x) for i, x in enumerate(p.received)]) for p in use]
    opt = Optimizer(list(net.parameters()), cfg)
    lad = cfg.ladder
    steps = seen = 0
    recon_sum = distill_sum = 0.0
    net.train()
    for _ in range(n_epochs):
        recon_sum = distill_sum = 0.0
        batches = _batches(layout, use, cfg, rng)
        for k, i, idx in batches:
            if stop.is_set():
                raise TrainingStopped
            tgt, glob, rec = cut[k]
            w = torch.from_numpy(tgt[i][idx])
            g = torch.from_numpy(glob[i][idx])
            if rec is not None:  # an integer device's received weights against its global
                x = torch.from_numpy(rec[i][idx])
                recon = (net(x, None, lad.index(use[k].bits[i])) - w).abs().mean()
                loss = recon
            else:
                q = [quantize_t(w, b, cfg.clip) for b in lad]
                recon = w.new_zeros(())
                for j in range(len(lad) - 1):
                    recon = recon + (net.step(q[j], g, j) - q[j + 1]).abs().mean()
                loss = recon
                if distill is not None and cfg.lam > 0:
                    d = _distill(net, distill, use[k], layout, i, idx, q[0], g, cfg, gen)
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


def _distill(net: SliceNet, distill: Distillation, pair: Pair, layout: SliceLayout, i: int, idx: np.ndarray,
             q0: torch.Tensor, g: torch.Tensor, cfg: DequantizerConfig, gen: torch.Generator) -> torch.Tensor:
    """eq. 5 for one batch: the model with the batch's planes of layer ``i`` dequantized
    from the lowest rung, against the true model, on the unlabeled inputs plus noise."""
    n = distill.inputs.shape[0]
    u = distill.inputs[torch.randint(n, (min(cfg.distill_batch, n),), generator=gen)]
    if cfg.noise_std > 0:
        u = u + cfg.noise_std * torch.randn(u.shape, generator=gen)
    true = [torch.from_numpy(np.asarray(w, np.float32)) for w in pair.target]
    planes = torch.from_numpy(layout.cut(i, pair.target[i]))
    deq = net(q0, g, 0)
    planes = planes.index_put((torch.from_numpy(np.asarray(idx, np.int64)),), deq)
    flat = planes.reshape(-1)
    index = layout.index[i]
    layer = flat if index is None else torch.empty_like(flat).index_put_((torch.from_numpy(index.reshape(-1)),), flat)
    weights = list(true)
    weights[i] = layer.reshape(true[i].shape)
    with torch.no_grad():
        p_true = F.softmax(spec_forward(distill.spec, true, u, distill.alphas), 1)
    p_deq = F.softmax(spec_forward(distill.spec, weights, u, distill.alphas), 1)
    return -F.cosine_similarity(p_true, p_deq, dim=1).mean()


def dequantize_layer(net: SliceNet, layout: SliceLayout, i: int, flat: np.ndarray, bits: int,
                     tables: dict[int, list[np.ndarray]] | None) -> np.ndarray | None:
    """Layer ``i`` received on the ``bits`` grid, through the steps from ``bits`` up: the
    compiled table (anchored) or the network on its planes; None when the anchored form
    has no table for it or a value is off the grid."""
    if net.anchored:
        table = (tables or {}).get(bits)
        return None if table is None else apply_table(flat, table[i], bits, net.clip)
    out = run_planes(net, layout.cut(i, flat), net.cfg.ladder.index(bits))
    return layout.paste(i, out)


def heldout_l1(net: SliceNet, layout: SliceLayout, pairs: Sequence[Pair],
               stop: threading.Event | None = None) -> dict[tuple[int, int], tuple[float, float]]:
    """(layer, entry bits) -> (plain L1, dequantized L1), mean per weight over the float32
    pairs (module docstring); rungs the anchored form has no table for are left out."""
    cfg = net.cfg
    rungs = table_rungs(cfg) if net.anchored else list(cfg.ladder[:-1])
    sums: dict[tuple[int, int], list[float]] = {}
    compiled: dict[int, dict[int, list[np.ndarray]]] = {}  # pairs of a round share its global
    for p in pairs:
        if p.received is not None:
            continue
        tables = None
        if net.anchored:
            if id(p.glob) not in compiled:
                compiled[id(p.glob)] = compile_tables(net, layout, p.glob, rungs)
            tables = compiled[id(p.glob)]
        for i, w in enumerate(p.target):
            if stop is not None and stop.is_set():
                raise TrainingStopped
            flat = np.asarray(w, np.float32).reshape(-1)
            for bits in rungs:
                x = quantize(flat, bits, cfg.clip)
                y = dequantize_layer(net, layout, i, x, bits, tables)
                acc = sums.setdefault((i, bits), [0.0, 0.0, 0.0])
                acc[0] += float(np.abs(x - flat).sum(dtype=np.float64))
                acc[1] += float(np.abs(y - flat).sum(dtype=np.float64)) if y is not None else float("inf")
                acc[2] += flat.size
    return {k: (a / max(n, 1.0), d / max(n, 1.0)) for k, (a, d, n) in sums.items()}


@dataclass
class SliceVersion:
    """A trained slice dequantizer (immutable once built; rounds read it from any thread):
    the network, the held-out verdicts ``gates``/``heldout`` ((layer, entry bits) ->
    on? / (plain L1, dequantized L1)) and training figures ``info``. The anchored form's
    tables of the round in progress are the stage's, not the version's."""

    number: int
    round_id: int
    cfg: DequantizerConfig
    net: SliceNet
    gates: dict[tuple[int, int], bool] = field(default_factory=dict)
    heldout: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    info: dict[str, float] = field(default_factory=dict)

    def is_on(self, layer: int, bits: int) -> bool:
        return self.gates.get((layer, bits), False)

    def to_state(self) -> dict[str, Any]:
        return {"number": self.number, "round_id": self.round_id,
                "params": [[n, array_to_state(a)] for n, a in get_arrays(self.net)],
                "gates": [[i, b, bool(on)] for (i, b), on in sorted(self.gates.items())],
                "heldout": [[i, b, p, d] for (i, b), (p, d) in sorted(self.heldout.items())],
                "info": {k: float(v) for k, v in self.info.items()}}

    @classmethod
    def from_state(cls, cfg: DequantizerConfig, d: dict[str, Any]) -> SliceVersion:
        """Inverse of :meth:`to_state` (ProtocolError naming what is wrong)."""
        try:
            net = build_slice_net(cfg, 0)
            set_arrays(net, [(str(n), array_from_state(a)) for n, a in d["params"]])
            net.eval()
            return cls(int(d["number"]), int(d["round_id"]), cfg, net,
                       {(int(i), int(b)): bool(on) for i, b, on in d["gates"]},
                       {(int(i), int(b)): (float(p), float(q)) for i, b, p, q in d["heldout"]},
                       {str(k): float(v) for k, v in (d.get("info") or {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"dequantizer checkpoint: {type(exc).__name__}: {exc}") from None
