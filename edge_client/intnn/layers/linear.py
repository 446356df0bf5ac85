"""The integer engine's fully connected layer: weights stored ``[F, O]`` (input-major),
the columns after a flatten in the engine's (h, w, c) order; on the CPU its forward,
backward-data and weight gradient driven by the non-zero inputs (``kernels.linear``) or as
VNNI dot products (``kernels.vnni_linear``), and the VNNI update that makes its gradient
again instead of storing it.
"""

from __future__ import annotations

import numpy as np

from edge_client.intnn import kernels as K
from edge_client.intnn.layers.base import (
    IntLayer,
    IntWeightLayer,
    Numerics,
    ParamPass,
    implements,
    vnni_dot,
)
from edge_client.intnn.parallel import Task
from edge_client.intnn.workspace import Workspace
from firmware_models import Linear

# a VNNI linear layer with at least this many weights makes its gradient twice (its max,
# then again in the update) instead of storing it, on one thread too (docs/performance.md)
FUSED_UPDATE_MIN_WEIGHTS = 1 << 18


class IntLinear(IntWeightLayer):
    """A linear layer in the engine's layout: weights ``[F, O]``; its stochastic-rounding
    counter runs over ``[O, F]`` (the spec's order). ``perm``: after a flatten of
    [C, H, W], the spec column of each engine column."""

    layer: Linear

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.perm: np.ndarray | None = None

    def link(self, prev: IntLayer | None) -> None:
        self.perm = prev.order if prev is not None else None

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.layer.in_features, self.layer.out_features)

    @property
    def fan_out(self) -> int:
        return self.layer.out_features

    def macs(self) -> int:
        return self.in_shape[0] * self.out_shape[0]

    def to_internal(self, w: np.ndarray) -> np.ndarray:
        if self.perm is not None:
            w = w[:, self.perm]
        return np.ascontiguousarray(w.T)

    def to_spec(self, w: np.ndarray) -> np.ndarray:
        if self.perm is not None:
            out = np.empty(w.shape[::-1], w.dtype)
            out[:, self.perm] = w.T
            return out
        return np.ascontiguousarray(w.T)

    def counter_layout(self) -> tuple[int, int]:
        return self.weight_shape


@implements(Linear)
class CpuLinear(IntLinear):
    """The linear layer on the CPU backend; ``vnni_fwd``: its forward runs on VNNI."""

    vnni_fwd = False

    def bind(self, model: Numerics) -> None:
        super().bind(model)
        self.vnni_fwd = self.vnni_forward(model)

    def vnni_forward(self, model: Numerics) -> bool:
        """The forward runs on AVX-512 VNNI (``kernels.vnni_linear``): int8 activations, at
        least one 16-output block, and sums of the sign-flipped bytes that fit int32
        (F * 255 * 128 < 2^31)."""
        return (vnni_dot(model) and self.out_shape[0] >= 16
                and self.in_shape[0] * 255 * 128 < 1 << 31)

    def vnni_grad(self, model: Numerics, batch: int) -> bool:
        """The weight gradient runs on AVX-512 VNNI: int8 operands, an int32 gradient,
        outputs in whole 64-lane blocks."""
        return (vnni_dot(model) and self.out_shape[0] % 64 == 0
                and not self.needs_int64_grad(model, batch))

    def buffers(self, model: Numerics, n: int, train: bool
                ) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray | None], int]:
        n_out = self.out_shape[0]
        # the VNNI forward keeps up to FORWARD_SAMPLES samples' sums at a time
        rows = min(n, K.vnni_linear.FORWARD_SAMPLES) if self.vnni_fwd else 1
        shared: dict[str, np.ndarray | None] = {}
        scratch: dict[str, np.ndarray | None] = {
            "lacc": np.zeros(rows * n_out, np.int32),
            "lacc16": np.zeros(n_out if model.amax <= 127 else 0, np.int16)}
        if train:
            n4 = K.vnni.padded(n, 4)  # the VNNI gradient takes samples in fours
            shared["a_t"] = np.zeros((self.in_shape[0], n4), model.adtype)
            if self.vnni_grad(model, n):
                scratch["lep"] = np.zeros(n4 * n_out, model.adtype)
        return shared, scratch, self.in_shape[0] + 4  # a row's non-zero inputs, in fours

    def forward_task(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                     n: int):
        i, sc = self.index, ws.scratch
        if self.vnni_fwd:
            return K.linear_forward_vnni, lambda t, lo, hi: (
                prev, self.t, self.shift, model.amax, self.relu, out, sc[t].lacc[i],
                sc[t].nz_idx, sc[t].nz_val, lo, hi)
        return K.linear_forward, lambda t, lo, hi: (
            prev, self.t, self.shift, model.amax, self.relu, out, sc[t].lacc[i],
            sc[t].lacc16[i], sc[t].nz_idx, sc[t].nz_val, lo, hi)

    def input_error_task(self, pb: ParamPass) -> Task:
        a2 = pb.a_in.reshape(pb.n, -1)
        d2 = pb.dst.reshape(pb.n, -1)
        eq, sc = pb.eq, pb.sc
        kernel = (K.linear_backward_data_vnni
                  if vnni_dot(pb.model) and self.out_shape[0] >= K.vnni.VEC
                  else K.linear_backward_data)
        return pb.task(kernel, lambda t, lo, hi: (
            eq, self.t, a2, self.relu_in, d2, sc[t].nz_idx, lo, hi), pb.n, first=True)

    def grad_task(self, pb: ParamPass, ws: Workspace, only_max: bool) -> Task:
        i, eq, g, sc = self.index, pb.eq, pb.g, pb.sc
        a2 = pb.a_in.reshape(pb.n, -1)
        a_t = ws.a_t[i]
        if only_max:
            return pb.task(K.linear_grad_max_vnni, lambda t, lo, hi: (
                eq, a2, a_t, sc[t].lep[i], lo, hi), g.shape[0])
        if sc[0].lep[i] is not None:
            return pb.task(K.linear_weight_grad_vnni, lambda t, lo, hi: (
                eq, a2, g, a_t, sc[t].lep[i], lo, hi), g.shape[0])
        return pb.task(K.linear_weight_grad, lambda t, lo, hi: (
            eq, a2, g, sc[t].nz_idx, sc[t].nz_val, a_t, lo, hi), g.shape[0])

    def fuses_update(self, pb: ParamPass) -> bool:
        """On VNNI, split over threads or with a gradient that would not stay in the
        caches: the gradient's max, then the update makes the gradient again
        (``kernels.linear_update_vnni``) in its usual case."""
        return (pb.sc[0].lep[self.index] is not None
                and (self.split or pb.g.size >= FUSED_UPDATE_MIN_WEIGHTS))

    def fused_update_task(self, pb: ParamPass, ws: Workspace) -> Task:
        """The update with the gradient made again row by row, at the shift and key the
        step set (``pb.sh``, ``pb.key``)."""
        i, sc, model = self.index, pb.sc, pb.model
        eq, a2, a_t = pb.eq, pb.a_in.reshape(pb.n, -1), ws.a_t[i]
        rows, _ = self.counter_layout()
        return pb.task(K.linear_update_vnni, lambda t, lo, hi: (
            eq, a2, a_t, sc[t].lep[i], self.w.reshape(-1), self.t.reshape(-1),
            pb.sh, model.wmax, model.thr, pb.key, rows, lo, hi), self.w.shape[0])
