"""Cutting a model's layers into equal weight blocks ``[C, H, W]`` and pasting them back.

ProWD appendix C: weights are cut into uniformly sized blocks so that one dequantizer
serves every layer (and every architecture). Two cuts:

- generic: a layer, flattened in ``spec.param_shapes()`` (row-major) order, is cut into
  consecutive chunks of ``D = C·H·W`` elements, the last one zero-padded; channel c of a
  block holds chunk elements ``[c·H·W, (c+1)·H·W)``. Works for any layer shape.
- modules (the paper's): a conv layer ``[64a, 64b, 3, 3]`` is cut into its a·b modules
  ``[64, 64, 3, 3]``, each reshaped to ``[64, 24, 24]`` (channel = one output filter's
  64·9 weights); other layers fall back to generic chunks of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator.strategies.prowd_dequantizer.config import PAPER_BLOCK

MODULE = 64  # channels per side of a paper module


def is_module_layer(shape: Sequence[int]) -> bool:
    """A conv weight ``[O, I, 3, 3]`` with O and I multiples of 64."""
    return (len(shape) == 4 and shape[2] == shape[3] == 3 and shape[0] % MODULE == 0
            and shape[1] % MODULE == 0 and shape[0] > 0 and shape[1] > 0)


def _module_perm(shape: Sequence[int]) -> np.ndarray:
    """Flat indices (int64 [n]) listing the layer's elements module by module."""
    o, i = shape[0], shape[1]
    idx = np.arange(o * i * 9, dtype=np.int64).reshape(o // MODULE, MODULE, i // MODULE, MODULE, 9)
    return np.ascontiguousarray(idx.transpose(0, 2, 1, 3, 4)).reshape(-1)


class BlockLayout:
    """How each layer of a model (``shapes``, spec order) is cut into ``block`` = [C, H, W].

    ``modules``: cut qualifying conv layers into the paper's modules (``block`` must be
    [64, 24, 24]). Arrays are float32; a layer is given and returned flat (1-D).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], block: Sequence[int], modules: bool = False) -> None:
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.block = tuple(int(d) for d in block)
        self.size = int(np.prod(self.block))
        use_modules = modules and self.block == PAPER_BLOCK
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        #: per layer: None (generic chunks) or the module order of its flat indices
        self.perms = [_module_perm(s) if use_modules and is_module_layer(s) else None for s in self.shapes]
        self.counts = [-(-n // self.size) for n in self.sizes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    @property
    def n_blocks(self) -> int:
        return int(sum(self.counts))

    def cut(self, i: int, flat: np.ndarray) -> np.ndarray:
        """Layer ``i`` (flat, ``sizes[i]`` elements) -> float32 [counts[i], C, H, W]."""
        flat = np.asarray(flat, dtype=np.float32).reshape(-1)
        perm = self.perms[i]
        if perm is not None:
            return flat[perm].reshape(self.counts[i], *self.block)
        out = np.zeros(self.counts[i] * self.size, np.float32)
        out[:flat.size] = flat
        return out.reshape(self.counts[i], *self.block)

    def paste(self, i: int, blocks: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`cut`: [counts[i], C, H, W] -> flat float32 layer (padding dropped)."""
        b = np.asarray(blocks, dtype=np.float32).reshape(-1)
        perm = self.perms[i]
        if perm is not None:
            out = np.empty(self.sizes[i], np.float32)
            out[perm] = b
            return out
        return b[:self.sizes[i]].copy()

    def mask(self, i: int) -> np.ndarray:
        """bool [counts[i], C, H, W]: True where a block element is a real weight."""
        m = np.zeros(self.counts[i] * self.size, bool)
        m[:self.sizes[i]] = True
        return m.reshape(self.counts[i], *self.block)

    def model_index(self, layers: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """int64 [len(layers), D]: for block ``ks[r]`` of layer ``layers[r]``, each element's
        index in the model's concatenated flat weights (spec order), -1 for padding."""
        local = ks.astype(np.int64)[:, None] * self.size + np.arange(self.size, dtype=np.int64)
        out = np.empty(local.shape, np.int64)
        for r, i in enumerate(layers):
            perm = self.perms[int(i)]
            if perm is not None:
                out[r] = perm[local[r]] + self.offsets[i]
            else:
                out[r] = np.where(local[r] < self.sizes[i], local[r] + self.offsets[i], -1)
        return out

    def cut_model(self, weights: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every layer's blocks: (blocks float32 [N, C, H, W], layer int64 [N], block
        number within its layer int64 [N]); :meth:`model_index` gives their positions."""
        blocks = np.concatenate([self.cut(i, w) for i, w in enumerate(weights)])
        layers = np.repeat(np.arange(len(self.shapes), dtype=np.int64), self.counts)
        ks = np.concatenate([np.arange(c, dtype=np.int64) for c in self.counts])
        return blocks, layers, ks
