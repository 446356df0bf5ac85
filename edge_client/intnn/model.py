"""IntModel: an integer-only network built from a ``firmware_models`` spec: its weights
(storage grid and ternary copies, the engine's layouts), the list of its layers
(``edge_client.intnn.layers``: a ReLU right after a conv or linear layer fused into it)
and the backend that runs them (``backend.py``; the Numba CPU engine by default).

Formulas: docs/algorithms.md §1 (s = compute bits, S(k) = 2^(k-1), s_g = max(s, 8)):
forward ``a' = clip(round_shift(sum t*a, 1 + log2 alpha), +-(S(s)-1))`` with
``t = ternary(W)``; the loss's error (SSE against ``(S(s) - 1) * onehot``, the default,
or an integer softmax, :func:`kernels.softmax_error`), ReLU-masked and quantized to s bits
(eq. 12) at every weight layer's output; the update (eq. 15-16) stochastically rounded
from a SplitMix64 stream keyed by (seed, step, layer), its counter enumerating a layer's
weights in the engine's layout. Activations are NHWC, conv weights ``[K, K, C, O]``, the
linear layer after a flatten has its columns in (h, w, c) order: exact permutations done
at the boundary (:meth:`IntModel.load_int`, :meth:`IntModel.int_weights`).
"""

from __future__ import annotations

import numpy as np

from edge_client.compat import zip_strict
from edge_client.errors import ConfigError, TrainingError
from edge_client.intnn import kernels as K
from edge_client.intnn.backend import Backend, make_backend
from edge_client.intnn.layers import IntLayer, IntWeightLayer, build_layers
from edge_client.intnn.parallel import Splitter
from edge_client.intnn.quant import (
    DEFAULT_CLIP,
    act_dtype,
    act_max,
    alpha_shifts,
    check_bits,
    from_shared,
    storage_grid_bits,
    ternary_threshold,
    to_shared,
    weight_dtype,
    weight_max,
)
from edge_client.intnn.workspace import Regularizer, Workspace
from firmware_models import ModelSpec

DEFAULT_CE_TEMP_SHIFT = 5  # softmax temperature 2^-5 on the real logits (docs/algorithms.md §1)


class IntModel:
    """Integer weights, their ternary copies and the integer forward/backward/update.

    ``bits``: compute bitwidth s (2..16); ``clip``: weight clip in the real domain;
    ``threads``: cores a step uses (1..256; results do not depend on it).
    """

    def __init__(self, spec: ModelSpec, bits: int, clip: float = DEFAULT_CLIP,
                 conv_impl: str = "col", loss: str = "sse",
                 ce_temp_shift: int = DEFAULT_CE_TEMP_SHIFT, threads: int = 1,
                 backend: str = "cpu") -> None:
        if conv_impl not in ("col", "sparse"):
            raise ConfigError(f"conv_impl must be 'col' or 'sparse', got {conv_impl!r}")
        if loss not in ("ce", "sse"):
            raise ConfigError(f"loss must be 'ce' or 'sse', got {loss!r}")
        if not 0 <= ce_temp_shift <= 12:
            raise ConfigError(f"ce_temp_shift must be in 0..12, got {ce_temp_shift}")
        self.backend: Backend = make_backend(backend, threads)
        self.loss = loss
        self.ce_temp_shift = int(ce_temp_shift)
        self.conv_impl = conv_impl
        self.spec = spec
        self.bits = check_bits(bits)
        self.grid_bits = storage_grid_bits(bits)
        self.clip = clip
        self.amax = act_max(bits)
        self.adtype = act_dtype(bits)
        self.wdtype = weight_dtype(bits)
        self.wmax = weight_max(bits, clip)
        self.thr = ternary_threshold(bits)
        self.target = self.amax  # one-hot target: the largest activation (real ~ 1.0)
        self._alpha = alpha_shifts(spec)
        #: the layers in the engine's layout (a ReLU after a weight layer fused into it)
        self.ops: list[IntLayer] = build_layers(spec, self._alpha, self.backend.name)
        self.param_ops: list[IntWeightLayer] = [op for op in self.ops  # type: ignore[misc]
                                                if op.param >= 0]
        for op in self.param_ops:
            op.bind(self)
        self.internal_shapes = [op.weight_shape for op in self.param_ops]
        self._w = [op.w for op in self.param_ops]
        self._t = [op.t for op in self.param_ops]
        self._workspaces: dict[bool, Workspace] = {}

    @property
    def w(self) -> list[np.ndarray]:
        """Each weight layer's weights on the storage grid (the engine's layout; current:
        the backend syncs them first)."""
        self.backend.sync(self)
        return self._w

    @property
    def t(self) -> list[np.ndarray]:
        """Each weight layer's ternary copy of its weights (int8, the engine's layout)."""
        self.backend.sync(self)
        return self._t

    @property
    def splitter(self) -> Splitter:
        """The CPU backend's threads."""
        return self.backend.splitter  # type: ignore[attr-defined]

    @property
    def tv(self) -> list[np.ndarray | None]:
        """Per weight layer, its ternary weights as the VNNI forward reads them (None where
        it does not run on VNNI)."""
        return [getattr(op, "tv", None) for op in self.param_ops]

    # ------------------------------------------------------------------ weights

    def _to_internal(self, op: IntWeightLayer, w: np.ndarray) -> np.ndarray:
        """Spec layout -> storage layout (``IntWeightLayer.to_internal``)."""
        return op.to_internal(w)

    def _to_spec(self, op: IntWeightLayer, w: np.ndarray) -> np.ndarray:
        return op.to_spec(w)

    def load_int(self, int_weights: list[np.ndarray]) -> None:
        """Set the weights from integers on this device's grid, spec layout and order."""
        shapes = self.spec.param_shapes()
        if len(int_weights) != len(shapes):
            raise TrainingError(f"{self.spec.name}: expected {len(shapes)} weight tensors, "
                                f"got {len(int_weights)}")
        for i, (q, shape, op) in enumerate(zip_strict(int_weights, shapes, self.param_ops)):
            q = np.asarray(q)
            if tuple(q.shape) != tuple(shape):
                raise TrainingError(f"{self.spec.name}: weight {i} ({op.layer.name}) has shape "
                                    f"{list(q.shape)}, expected {list(shape)}")
            if q.dtype.kind not in "iu":
                raise TrainingError(f"{op.layer.name}: integer weights expected, got {q.dtype}")
            if q.size and (int(q.max()) > self.wmax or int(q.min()) < -self.wmax):
                raise TrainingError(f"{op.layer.name}: weights exceed the clip bound {self.wmax}")
            self._w[i][...] = op.to_internal(q.astype(self.wdtype))
            K.ternarize(self._w[i].reshape(-1), self.thr, self._t[i].reshape(-1))
            self.ternary_copies(i)

    def ternary_copies(self, p: int) -> None:
        """Refresh the derived copies of ternary weights p (the layer's kernels' layouts)."""
        self.param_ops[p].ternary_copies()

    def load_shared(self, weights: list[np.ndarray]) -> None:
        """Set the weights from the shared float domain (``round(W * S(s_g))``)."""
        shapes = self.spec.param_shapes()
        if len(weights) != len(shapes):
            raise TrainingError(f"{self.spec.name}: expected {len(shapes)} weight tensors, "
                                f"got {len(weights)}")
        for i, (w, shape) in enumerate(zip_strict(weights, shapes)):
            if tuple(np.shape(w)) != tuple(shape):
                raise TrainingError(f"{self.spec.name}: weight {i} has shape "
                                    f"{list(np.shape(w))}, expected {list(shape)}")
        self.load_int(from_shared(weights, self.bits, self.clip))

    def int_weights(self) -> list[np.ndarray]:
        """The device's own integers, spec layout and order (copies)."""
        return [op.to_spec(w) for op, w in zip_strict(self.param_ops, self.w)]

    def to_shared(self) -> list[np.ndarray]:
        """float32 shared-domain weights, exact on the grid."""
        return to_shared(self.int_weights(), self.bits)

    def ternary_weights(self) -> list[np.ndarray]:
        """The ternary forward weights ``t`` (int8 in {-1, 0, 1}), spec layout and order
        (copies); ``t = +1`` stands for ``quant.TERNARY_WEIGHT`` in the shared domain."""
        return [op.to_spec(t) for op, t in zip_strict(self.param_ops, self.t)]

    # ------------------------------------------------------------------ buffers

    def workspace(self, capacity: int, train: bool = True) -> Workspace:
        """Buffers for batches of up to ``capacity`` samples (cached per capacity)."""
        ws = self._workspaces.get(train)
        if ws is not None and ws.capacity == capacity:
            return ws
        self._workspaces.pop(train, None)  # one workspace per kind: release the old one
        ws = self.backend.workspace(self, capacity, train)
        self._workspaces[train] = ws
        return ws

    def eval_workspace(self, capacity: int) -> Workspace:
        """Buffers for forward passes: the training workspace when there is one (no extra
        memory), else a forward-only one for ``capacity`` samples."""
        ws = self._workspaces.get(True)
        return ws if ws is not None else self.workspace(capacity, train=False)

    def prepare_inputs(self, x: np.ndarray) -> np.ndarray:
        """float images [N, C, H, W] in [0, 1] -> s-bit integers in the engine layout.

        Data loading (the one place the integer path touches floats).
        """
        from edge_client.data import quantize_images

        expected = tuple(self.spec.input_shape)
        if tuple(x.shape[1:]) != expected:
            raise TrainingError(f"{self.spec.name}: input samples have shape "
                                f"{list(x.shape[1:])}, expected {list(expected)}")
        q = quantize_images(x, self.bits)
        if q.ndim == 4:
            return np.ascontiguousarray(q.transpose(0, 2, 3, 1))
        return np.ascontiguousarray(q)

    # ------------------------------------------------------------------ compute

    def forward(self, ws: Workspace, n: int) -> np.ndarray:
        """Run the forward pass on ``ws.x[:n]``; returns the logits view [n, classes]."""
        return self.backend.forward(self, ws, n)

    def train_step(self, ws: Workspace, y: np.ndarray, n: int, lr_log2: int, seed: int,
                   step_count: int, reg: Regularizer | None = None) -> int:
        """One SGD step on ``ws.x[:n]`` with labels ``y`` (int64 [n]); returns the integer
        loss sum (SSE, or sum of 2^15 - p_true in Q15 for the softmax loss).

        ``lr_log2``: log2 of eta in LSBs of the storage grid; ``seed``/``step_count`` key
        the stochastic rounding.
        """
        return self.backend.train_step(self, ws, y, n, lr_log2, seed, step_count, reg)

    def quantized_error(self, ws: Workspace, i: int, n: int) -> np.ndarray:
        """Op i's quantized error of the last training step, NHWC [n, H, W, C] (or [n, O]),
        whichever layout the step kept it in (inspection and tests)."""
        return self.param_ops[self.ops[i].param].quantized_error(ws, n)

    def close(self) -> None:
        """Stop the worker threads (``threads > 1``); a later step starts them again."""
        self.backend.close()
