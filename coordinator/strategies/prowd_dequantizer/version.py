"""A finished dequantizer version: the trained network, its lookup tables, and the
held-out verdict per (layer, entry bitwidth); what a round applies to low-bit updates.

Applying the steps from a layer's entry rung to the top: a per-position network
(``kernel = 1``, two channels per block) is a function of the pair of levels (element i,
element i + H·W) of each block, so on an entry grid with few levels it is evaluated once
per level pair and applied as a table (``ladder.apply_pair_table``); any other network
runs on the layer's blocks (torch).

The gate (ProWD §4.2: the dequantizer must beat plain dequantization on held-out weights
or it is switched off for that layer): for every layer and entry rung, the L1 to the true
weights of the dequantized vs the plainly dequantized held-out weights; a layer is
dequantized only where it is lower.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coordinator.strategies.prowd_dequantizer.blocks import BlockLayout
from coordinator.strategies.prowd_dequantizer.config import DequantizerConfig
from coordinator.strategies.prowd_dequantizer.ladder import (
    apply_pair_table,
    level_max,
    pair_levels,
    quantize,
)
from coordinator.strategies.prowd_dequantizer.network import (
    ProgressiveDequantizer,
    build_network,
    get_arrays,
    set_arrays,
)
from coordinator.strategies.serialize import array_from_state, array_to_state
from edge_client.errors import ProtocolError

DIRECT_CHUNK = 1024  # blocks per network call on the direct path (bounds the memory)


def uses_tables(cfg: DequantizerConfig) -> bool:
    """Whether the network is per position with two channels (a pair table exists)."""
    return cfg.kernel == 1 and cfg.block[0] == 2


def make_tables(net: ProgressiveDequantizer, cfg: DequantizerConfig) -> dict[int, np.ndarray]:
    """Entry bitwidth -> float32 [L·L, 2] table of every level pair's output, for the
    rungs whose L·L (L = 2·m + 1 levels) is at most ``cfg.table_limit`` and whose outputs
    are all finite (what a table gives is then finite by construction)."""
    if not uses_tables(cfg):
        return {}
    tables = {}
    with torch.inference_mode():
        for j, bits in enumerate(cfg.ladder[:-1]):
            n_levels = 2 * level_max(bits, cfg.clip) + 1
            if n_levels * n_levels > cfg.table_limit:
                continue
            a, b = pair_levels(bits, cfg.clip)
            x = torch.from_numpy(np.stack([a, b])[None, :, :, None])  # [1, 2, L*L, 1]
            y = np.ascontiguousarray(net(x, j)[0, :, :, 0].numpy().T, dtype=np.float32)
            if np.all(np.isfinite(y)):  # else the network runs (and its output is checked)
                tables[bits] = y
    return tables


def run_direct(net: ProgressiveDequantizer, layout: BlockLayout, i: int, flat: np.ndarray, start: int) -> np.ndarray:
    """Layer ``i`` through steps ``start``.. of the network, block by block."""
    blocks = layout.cut(i, flat)
    out = np.empty_like(blocks)
    with torch.inference_mode():
        for s in range(0, len(blocks), DIRECT_CHUNK):
            out[s:s + DIRECT_CHUNK] = net(torch.from_numpy(blocks[s:s + DIRECT_CHUNK]), start).numpy()
    return layout.paste(i, out)


@dataclass
class Version:
    """One trained dequantizer, immutable once built (rounds read it from any thread).

    ``number``: 1, 2, ... in training order; ``round_id``: the round after which it was
    trained; ``gates``: (layer, entry bits) -> dequantize?; ``heldout``: (layer, entry
    bits) -> (plain L1, dequantized L1), mean per weight over the held-out models;
    ``info``: training figures (steps, blocks, losses, seconds, models)."""

    number: int
    round_id: int
    cfg: DequantizerConfig
    net: ProgressiveDequantizer = field(repr=False)
    tables: dict[int, np.ndarray] = field(repr=False)
    gates: dict[tuple[int, int], bool] = field(default_factory=dict)
    heldout: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    info: dict[str, float] = field(default_factory=dict)

    def dequantize(self, layout: BlockLayout, i: int, flat: np.ndarray, bits: int) -> np.ndarray:
        """Layer ``i`` (flat float32, every value on the ``bits`` grid, ``bits`` a rung
        below the top) run through the steps from ``bits`` up: a new float32 array."""
        table = self.table_for(layout, i, bits)
        if table is not None:
            c, h, w = layout.block
            return apply_pair_table(flat, h * w, bits, table, self.cfg.clip)
        return run_direct(self.net, layout, i, flat, self.cfg.ladder.index(bits))

    def table_for(self, layout: BlockLayout, i: int, bits: int) -> np.ndarray | None:
        """The table layer ``i`` entering at ``bits`` is looked up in (None: the network
        runs on its blocks)."""
        return self.tables.get(bits) if layout.perms[i] is None else None

    def is_on(self, layer: int, bits: int) -> bool:
        return self.gates.get((layer, bits), False)

    # ------------------------------------------------------------------ state
    def to_state(self) -> dict[str, Any]:
        """msgpack-able: parameters and tables as arrays, gates and held-out figures."""
        return {"number": self.number, "round_id": self.round_id,
                "params": [[n, array_to_state(a)] for n, a in get_arrays(self.net)],
                "tables": [[b, array_to_state(t)] for b, t in sorted(self.tables.items())],
                "gates": [[i, b, bool(on)] for (i, b), on in sorted(self.gates.items())],
                "heldout": [[i, b, p, d] for (i, b), (p, d) in sorted(self.heldout.items())],
                "info": {k: float(v) for k, v in self.info.items()}}

    @classmethod
    def from_state(cls, cfg: DequantizerConfig, d: dict[str, Any]) -> Version:
        """Inverse of :meth:`to_state` (ProtocolError naming what is wrong)."""
        try:
            net = build_network(cfg, 0)
            set_arrays(net, [(str(n), array_from_state(a)) for n, a in d["params"]])
            net.eval()
            tables = {int(b): array_from_state(t) for b, t in d["tables"]}
            gates = {(int(i), int(b)): bool(on) for i, b, on in d["gates"]}
            heldout = {(int(i), int(b)): (float(p), float(q)) for i, b, p, q in d["heldout"]}
            return cls(int(d["number"]), int(d["round_id"]), cfg, net, tables, gates, heldout,
                       {str(k): float(v) for k, v in (d.get("info") or {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"dequantizer checkpoint: {type(exc).__name__}: {exc}") from None


def heldout_l1(version: Version, layout: BlockLayout, models: Sequence[Sequence[np.ndarray]],
               stop: threading.Event | None = None) -> dict[tuple[int, int], tuple[float, float]]:
    """(layer, entry bits) -> (plain L1, dequantized L1), mean per weight over ``models``:
    each layer quantized to each rung below the top, compared with the top rung's weights
    (the float weights when the ladder ends at 32). ``stop``: checked before every layer."""
    from coordinator.strategies.prowd_dequantizer.train import TrainingStopped

    cfg = version.cfg
    top = cfg.ladder[-1]
    sums: dict[tuple[int, int], list[float]] = {}
    for w in models:
        for i, layer in enumerate(w):
            if stop is not None and stop.is_set():
                raise TrainingStopped
            flat = np.asarray(layer, dtype=np.float32).reshape(-1)
            target = quantize(flat, top, cfg.clip)
            for bits in cfg.ladder[:-1]:
                x = quantize(flat, bits, cfg.clip)
                y = version.dequantize(layout, i, x, bits)
                acc = sums.setdefault((i, bits), [0.0, 0.0, 0.0])
                acc[0] += float(np.abs(x - target).sum(dtype=np.float64))
                acc[1] += float(np.abs(y - target).sum(dtype=np.float64))
                acc[2] += target.size
    return {k: (p / max(n, 1.0), d / max(n, 1.0)) for k, (p, d, n) in sums.items()}


def decide_gates(heldout: dict[tuple[int, int], tuple[float, float]], margin: float) -> dict[tuple[int, int], bool]:
    """On where the dequantized L1 is below ``(1 - margin)`` times plain's (never where
    plain is already exact)."""
    return {k: bool(p > 0 and np.isfinite(d) and d < (1.0 - margin) * p) for k, (p, d) in heldout.items()}
