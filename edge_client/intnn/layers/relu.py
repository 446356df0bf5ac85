"""The integer engine's stand-alone ReLU (one right after a conv or linear layer is
fused into that layer's kernels): in place on flat views (``kernels.pool``)."""

from __future__ import annotations

import numpy as np

from edge_client.intnn import kernels as K
from edge_client.intnn.layers.base import IntLayer, Numerics, ParamPass, implements
from edge_client.intnn.workspace import Workspace
from firmware_models import ReLU


@implements(ReLU)
class CpuReLU(IntLayer):
    """``max(0, a)``; its backward zeroes the error where the output is 0, in place."""

    def link(self, prev: IntLayer | None) -> None:
        self.order = prev.order if prev is not None else None

    def relu_out(self, relu_in: bool) -> bool:
        return True

    def has_input_error(self) -> bool:
        return False

    def forward(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                n: int) -> None:
        K.relu_forward(prev.reshape(-1), out.reshape(-1))

    def backward(self, model: Numerics, ws: Workspace, cur: np.ndarray, kq: int, n: int,
                 front: ParamPass | None) -> tuple[np.ndarray, int]:
        K.relu_mask(cur.reshape(-1), ws.acts[self.index][:n].reshape(-1))
        return cur, kq
