"""The integer engine's max-pool: winners kept as one int8 cell number per output for
the backward (``kernels.pool``). Right after a conv with a fused ReLU, windows not
overlapping, its backward routes the error to the winners and quantizes it as that conv's
(``fused_error``), in parts over samples with the conv's other first-stage tasks.
"""

from __future__ import annotations

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn import kernels as K
from edge_client.intnn.layers.base import IntLayer, Numerics, ParamPass, implements
from edge_client.intnn.parallel import Task
from edge_client.intnn.workspace import Workspace
from firmware_models import MaxPool2d

MAX_POOL_KERNEL = 11  # pool winners are int8 cell numbers kh * k + kw


@implements(MaxPool2d)
class CpuMaxPool2d(IntLayer):
    """Max-pool on NHWC activations; split over samples as the layer before it is."""

    layer: MaxPool2d
    split_like_input = True

    def link(self, prev: IntLayer | None) -> None:
        lay = self.layer
        self.fused_error = (prev is not None and prev.param >= 0 and prev.relu
                            and lay.kernel <= lay.step)

    def relu_out(self, relu_in: bool) -> bool:
        return relu_in

    def check(self, model: Numerics) -> None:
        if self.layer.kernel > MAX_POOL_KERNEL:
            raise ConfigError(f"{self.layer.name}: pool kernel {self.layer.kernel} > "
                              f"{MAX_POOL_KERNEL}")

    def buffers(self, model: Numerics, n: int, train: bool
                ) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray | None], int]:
        # winners are needed by backward only; evaluation passes a 1-cell dummy
        win = np.zeros((n, *self.out_shape) if train else (1, 1, 1, 1), np.int8)
        return {"win": win}, {}, self.out_shape[1] * self.out_shape[2]  # a row at a time

    def has_input_error(self) -> bool:
        return not self.fused_error

    def forward_task(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                     n: int):
        lay = self.layer
        win = ws.win[self.index][:n] if ws.train else ws.win[self.index]
        return K.maxpool_forward, lambda t, lo, hi: (
            prev, lay.kernel, lay.step, lay.padding, out, win, ws.train, self.relu_in, lo, hi)

    def backward(self, model: Numerics, ws: Workspace, cur: np.ndarray, kq: int, n: int,
                 front: ParamPass | None) -> tuple[np.ndarray, int]:
        """Fused: only the error's scale (the conv before routes it); else routed to the
        winners into ``err_in``."""
        win = ws.win[self.index][:n]
        if self.fused_error:
            part = front.pool_scale(self.index) if front is not None else None
            return cur, (K.pool_error_scale(cur, win) if part is None else part)
        lay = self.layer
        dst = ws.err_in[self.index][:n]
        sc0 = ws.scratch[0]
        K.maxpool_backward(cur, win, lay.kernel, lay.step, lay.padding, dst, sc0.nz_idx,
                           sc0.nz_val)
        return dst, kq

    def route_task(self, pb: ParamPass, ws: Workspace) -> Task:
        """Fused: the error at this pool's output (``pb.cur``) routed to its winners and
        quantized at scale ``pb.kq`` into the conv's quantized error (``eq_layout``)."""
        lay, n, sc, model = self.layer, pb.n, pb.sc, pb.model
        dst, strides = pb.op.eq_layout(pb, ws)
        win = ws.win[self.index][:n]
        return pb.task(K.pool_error_route, lambda t, lo, hi: (
            pb.cur, win, lay.kernel, lay.step, lay.padding, model.bits, pb.kq, dst,
            *strides, sc[t].nz_idx, sc[t].nz_val, lo, hi), n, first=True)

    def scale_task(self, pb: ParamPass, ws: Workspace) -> Task:
        """Fused, read by the weight layer after it: this pool's error scale from that
        layer's input error (``pb.dst``), in parts over samples (tagged as the conv's)."""
        win = ws.win[self.index][:pb.n]
        e = pb.dst.reshape(win.shape)
        return pb.task(K.pool_error_scale, lambda t, lo, hi: (
            e[lo:hi], win[lo:hi]), pb.n, first=True, tag=self.index - 1)
