"""The integer engine's 2-D convolution: weights ``[K, K, C, O]``, activations NHWC, and
on the CPU its forward (VNNI, planar runs or im2col), backward-data and the four
weight-gradient kernels (``kernels.conv_forward``, ``conv_backward``, ``vnni``), with the
choice of each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.intnn import kernels as K
from edge_client.intnn.layers.base import (
    INT16_LIMIT,
    IntLayer,
    IntWeightLayer,
    Numerics,
    ParamPass,
    implements,
    vnni_dot,
)
from edge_client.intnn.parallel import Task
from edge_client.intnn.workspace import Workspace, plane_len
from firmware_models import Conv2d

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

GROUP_PIXELS = 4096  # output pixels per im2col group when evaluating (memory bound)
PIXEL_BLOCK = 2048   # output pixels accumulated at a time by the conv forward (L1-sized)
PLANE_BLOCK = 1024   # plane positions accumulated at a time by the stride-1 conv forward
VNNI_BLOCK = 64      # output pixels the VNNI conv forward sums at a time (int32 [B, Op])
# conv weight gradient from the non-zero errors when a patch row (K*C values) is at least
# this long (short rows do not vectorize: the dense dot products are faster there)
SPARSE_GRAD_MIN_ROW = 32
_NO_LIST = np.zeros((1, 1), np.int32)


class IntConv2d(IntWeightLayer):
    """A conv in the engine's layout: weights ``[K, K, C, O]`` (the stochastic-rounding
    counter enumerates them in that order), ``plane``: stride 1 (computed from the
    padded planar layout, ``kernels.*_plane``)."""

    layer: Conv2d

    @property
    def plane(self) -> bool:
        return self.layer.stride == 1

    @property
    def weight_shape(self) -> tuple[int, ...]:
        lay = self.layer
        return (lay.kernel, lay.kernel, lay.in_channels, lay.out_channels)

    @property
    def fan_out(self) -> int:
        return self.layer.out_channels * self.layer.kernel ** 2

    def macs(self) -> int:
        lay = self.layer
        return int(np.prod(self.out_shape)) * lay.kernel * lay.kernel * lay.in_channels

    def grad_pixels(self) -> int:
        return int(np.prod(self.out_shape[:-1]))

    def to_internal(self, w: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w.transpose(2, 3, 1, 0))

    def to_spec(self, w: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w.transpose(3, 2, 0, 1))

    def plane_geometry(self) -> tuple[int, int]:
        """(padded row length wp, plane positions per sample hs) of the planar layout."""
        h_in, w_in, _ = self.in_shape
        wp = w_in + self.layer.padding
        return wp, (h_in + self.layer.padding) * wp


@implements(Conv2d)
class CpuConv2d(IntConv2d):
    """The conv on the CPU backend. Besides ``t`` its kernels read ``tb`` (the ternary
    weights again in ``[O, K, K, C]``, backward-data and the im2col forward), ``tlist`` /
    ``tcnt`` (a stride-1 conv's +1 then -1 weight indices per output channel) and, where
    the forward runs on VNNI (``vnni``), ``tv`` / ``tcorr`` (weights packed
    ``[K*ng, Op, 4]``, 128 x sums). ``grad_mode`` (per workspace): the weight gradient's
    kernel, ``"int64" | "sparse" | "plane" | "dot"``."""

    def __init__(self, layer: Conv2d, index: int, in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...]) -> None:
        super().__init__(layer, index, in_shape, out_shape)
        self.grad_mode = ""
        self.tb = self.tlist = self.tcnt = self.tv = self.tcorr = None

    def bind(self, model: Numerics) -> None:
        super().bind(model)
        k, _, c, o = self.weight_shape
        self.tb = np.zeros((o, k, k, c), np.int8)
        if self.plane:
            self.tlist = np.zeros((o, k * k * c + 1), np.int32)
            self.tcnt = np.zeros((o, 2), np.int32)
        self.vnni = self.vnni_forward(model)
        if self.vnni:
            self.tv = np.zeros((*self.vnni_padded(), 4), np.int8)
            self.tcorr = np.zeros(self.vnni_padded()[1], np.int32)

    def vnni_forward(self, model: Numerics) -> bool:
        """The forward runs as int8 dot products on AVX-512 VNNI (``kernels.vnni``): the CPU
        has them, activations are int8 (s <= 8), and the weight gradient does not read the
        col forward's im2col (a strided conv with K*C < 32 takes the ``"dot"`` gradient)."""
        lay = self.layer
        return (vnni_dot(model) and model.conv_impl == "col"
                and (self.plane or lay.kernel * lay.in_channels >= SPARSE_GRAD_MIN_ROW))

    def vnni_padded(self) -> tuple[int, int]:
        """(groups, Op) of a VNNI conv (kernels.vnni.pad_rows): its weights' groups of four
        bytes, ceil(K*C / 4) per kernel row, and its output channels in whole groups of 16."""
        lay = self.layer
        return (lay.kernel * (-(-(lay.kernel * lay.in_channels) // 4)),
                K.vnni.padded(lay.out_channels, 16))

    def ternary_copies(self) -> None:
        lists = self.tlist is not None and self.tv is None
        K.ternary_copies(self.t, self.tb, self.tlist if lists else _NO_LIST,
                         self.tcnt if lists else _NO_LIST, lists)
        if self.tv is not None:
            K.pad_rows(self.tb, self.tv, self.tcorr)

    def quantized_error(self, ws: Workspace, n: int) -> np.ndarray:
        """NHWC, from the plane positions where the step kept it there only."""
        if ws.eq[self.index] is not None:
            return ws.eq[self.index][:n].copy()
        h_out, w_out, c_out = self.out_shape
        wp, hs = self.plane_geometry()
        pos = ws.eqp[self.index][:, :n * hs].reshape(c_out, n, hs // wp, wp)
        return np.ascontiguousarray(pos[:, :, :h_out, :w_out].transpose(1, 2, 3, 0))

    # buffers ------------------------------------------------------------------------

    def choose_grad(self, model: Numerics, batch: int) -> str:
        """Which kernel computes the weight gradient for ``batch`` samples."""
        if self.needs_int64_grad(model, batch):
            return "int64"
        if self.layer.kernel * self.layer.in_channels >= SPARSE_GRAD_MIN_ROW:
            return "sparse"
        if self.plane and model.conv_impl == "col":
            return "plane"
        return "dot"

    def buffers(self, model: Numerics, n: int, train: bool
                ) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray | None], int]:
        """Forward blocks, plane or im2col, gradient scratch; the error lists of the sparse
        gradient (per channel) and backward-data (per pixel)."""
        lay = self.layer
        ad = model.adtype
        r = lay.kernel * lay.kernel * lay.in_channels
        pix = self.out_shape[0] * self.out_shape[1]
        h, w, c = self.in_shape
        pad = lay.padding
        gmode = self.choose_grad(model, n) if train else ""
        if gmode:
            self.grad_mode = gmode
        shared: dict[str, np.ndarray | None] = {}
        scratch: dict[str, np.ndarray | None] = {}
        block = VNNI_BLOCK
        if self.vnni:
            scratch["vacc"] = np.zeros(block * self.vnni_padded()[1], np.int32)
        if self.plane and model.conv_impl == "col" and (gmode == "plane" or not self.vnni):
            if not self.vnni:
                block = PLANE_BLOCK
            shared["plane"] = np.zeros((c, plane_len(n, h, w, pad)), ad)
            scratch["offs"] = np.zeros(r, np.int32)
            if gmode == "plane":
                wp = w + pad
                shared["eqp"] = np.zeros((lay.out_channels, n * (h + pad) * wp), ad)
        elif not self.vnni:
            # training keeps the whole batch's im2col for the weight gradient
            cols = pix * (n if train else max(1, min(n, GROUP_PIXELS // pix)))
            block = min(cols, PIXEL_BLOCK)
            shared["col_t"] = np.zeros((r, cols), ad)
            if gmode == "dot":
                shared["e_t"] = np.zeros((lay.out_channels, cols), ad)
        if gmode == "sparse" or self.vnni:  # the VNNI forward pads the input for the gradient
            size = n * (h + 2 * pad) * (w + 2 * pad) * c
            # VNNI reads a kernel row in groups of four bytes: up to 3 past the last row
            shared["a_pad"] = np.zeros(size + 4, ad)[:size].reshape(n, h + 2 * pad, w + 2 * pad, c)
        if gmode == "sparse":
            shared["gt"] = np.zeros((lay.out_channels, r), np.int32)
        scratch["pacc"] = np.zeros(block, np.int32)
        scratch["pacc16"] = np.zeros(block if model.amax <= 127 else 0, np.int16)
        scratch["ptile"] = np.zeros((lay.out_channels, block), ad)
        shared["patch"] = np.zeros(lay.out_channels, np.int32)
        if train:
            # backward-data scratch: int16 when sum_o |eq| <= O * amax cannot overflow it
            narrow_bd = lay.out_channels * model.amax <= INT16_LIMIT
            scratch["pbuf"] = np.zeros(r, np.int16 if narrow_bd else np.int32)
        if gmode == "int64":
            shared["gacc"] = np.zeros(lay.out_channels, np.int64)
        o = self.out_shape
        nz = max(n * o[0] * o[1] + 4, o[2] + 4)
        if train and self.grad_mode == "sparse" and vnni_dot(model):
            # the VNNI form lists up to 64 channels' errors a chunk of pixels at a time
            nz = max(nz, min(64, o[2]) * (K.vnni.SPARSE_CHUNK + 4))
        return shared, scratch, nz

    def keeps_eq(self, next_layer: IntLayer | None) -> bool:
        """Not when the max-pool after it writes the quantized error straight into the
        plane-position layout (``eqp``) and no other layout is needed."""
        return not (self.grad_mode == "plane" and not self.needs_input_error
                    and next_layer is not None and next_layer.fused_error)

    # forward ------------------------------------------------------------------------

    def forward_task(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                     n: int):
        lay, i, sc = self.layer, self.index, ws.scratch
        if self.vnni:
            return K.conv_forward_vnni, lambda t, lo, hi: (
                prev, self.tv, self.tcorr, lay.kernel, lay.stride, lay.padding,
                self.shift, model.amax, self.relu, out, ws.a_pad[i], sc[t].vacc[i], lo, hi)
        if model.conv_impl == "col" and self.plane:
            return K.conv_forward_plane, lambda t, lo, hi: (
                prev, self.tlist, self.tcnt, lay.kernel, lay.padding, self.shift,
                model.amax, self.relu, out, ws.plane[i], sc[t].offs[i], sc[t].pacc[i],
                sc[t].pacc16[i], sc[t].ptile[i], lo, hi)
        return None

    def forward(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                n: int) -> None:
        lay, i, sc = self.layer, self.index, ws.scratch
        if model.conv_impl == "col":
            K.conv_forward_col(prev, self.tb, lay.stride, lay.padding, self.shift,
                               model.amax, self.relu, out, ws.col_t[i], sc[0].pacc[i],
                               sc[0].pacc16[i], sc[0].ptile[i])
        else:
            K.conv_forward(prev, self.t, lay.stride, lay.padding, self.shift, model.amax,
                           self.relu, out, ws.patch[i])

    # backward -----------------------------------------------------------------------

    def eq_layout(self, pb: ParamPass, ws: Workspace) -> tuple[np.ndarray, tuple[int, ...]]:
        """Where a fused max-pool writes this conv's quantized error: (array, strides of
        sample, row, column, channel), NHWC (``eq``) or at the plane positions (``eqp``,
        [O, N * hs])."""
        if pb.eq is not None:
            h, w, c = self.out_shape
            return pb.eq, (h * w * c, w * c, c, 1)
        dst = ws.eqp[self.index]
        wp, hs = self.plane_geometry()
        return dst, (hs, wp, 1, dst.shape[1])

    def input_error_whole(self, pb: ParamPass) -> bool:
        """int32 sums without VNNI: backward-data is one whole-batch kernel."""
        return (pb.dst is not None and not (vnni_dot(pb.model) and pb.eq.dtype == np.int8)
                and pb.sc[0].pbuf[self.index].dtype != np.int16)

    def grad_input_tasks(self, pb: ParamPass, ws: Workspace) -> list[Task]:
        """The padded input (sparse), the input's plane and the errors at the plane
        positions (plane)."""
        i, n, a_in, eq, sc = self.index, pb.n, pb.a_in, pb.eq, pb.sc
        lay = self.layer
        if self.grad_mode == "sparse" and not self.vnni:  # else the forward padded it already
            a_pad = ws.a_pad[i][:n]
            return [pb.task(K.pad_nhwc, lambda t, lo, hi: (
                a_in, lay.padding, a_pad, lo, hi), n, first=True)]
        if self.grad_mode != "plane":
            return []
        wp, hs = self.plane_geometry()
        plane, eqp = ws.plane[i], ws.eqp[i]
        tasks = []
        if self.vnni:  # the VNNI forward read the padded input: the plane is made here
            tasks.append(pb.task(K.plane_for_grad, lambda t, lo, hi: (
                a_in, lay.kernel, lay.padding, plane, sc[t].offs[i], lo, hi), n,
                first=True))
        if eq is not None:  # NHWC errors to the plane positions (else the pool wrote them)
            tasks.append(pb.task(K.eq_to_planar, lambda t, lo, hi: (
                eq, wp, hs, eqp, lo, hi), n, first=True))
        return tasks

    def input_error_task(self, pb: ParamPass) -> Task:
        model, dst, eq, sc, i = pb.model, pb.dst, pb.eq, pb.sc, self.index
        lay = self.layer
        if vnni_dot(model) and eq.dtype == np.int8:
            return pb.task(K.conv_backward_data_vnni, lambda t, lo, hi: (
                eq, self.tb, lay.stride, lay.padding, dst, sc[t].nz_idx, sc[t].nz_val,
                lo, hi), pb.n, first=True)
        if sc[0].pbuf[i].dtype == np.int16:
            return pb.task(K.conv_backward_data_narrow, lambda t, lo, hi: (
                eq, self.tb, lay.stride, lay.padding, dst, sc[t].pbuf[i], sc[t].nz_idx,
                sc[t].nz_val, lo, hi), pb.n, first=True)
        return pb.task(K.conv_backward_data, lambda t, lo, hi: (
            eq, self.tb, lay.stride, lay.padding, dst, sc[0].pbuf[i]), 1, split=False)

    def grad_task(self, pb: ParamPass, ws: Workspace, only_max: bool) -> Task:
        model, i, eq, a_in, g, sc = pb.model, self.index, pb.eq, pb.a_in, pb.g, pb.sc
        lay = self.layer
        if self.grad_mode == "sparse":
            sparse = (K.conv_weight_grad_sparse_vnni if vnni_dot(model)
                      and g.dtype == np.int32 else K.conv_weight_grad_sparse)
            a_pad, gt = ws.a_pad[i][:pb.n], ws.gt[i]
            return pb.task(sparse, lambda t, lo, hi: (
                eq, a_pad, lay.stride, g, gt, sc[t].nz_idx, sc[t].nz_val, lo, hi),
                lay.out_channels)
        if self.grad_mode == "plane":
            wp, hs = self.plane_geometry()
            n_pos = (pb.n - 1) * hs + (self.out_shape[0] - 1) * wp + self.out_shape[1]
            kernel = (K.conv_weight_grad_plane_vnni if vnni_dot(model)
                      else K.conv_weight_grad_plane)
            eqp, plane = ws.eqp[i], ws.plane[i]
            return pb.task(kernel, lambda t, lo, hi: (
                eqp, plane, sc[0].offs[i], n_pos, g, lo, hi),
                g.shape[0] * g.shape[1] * g.shape[2], align=2)
        if self.grad_mode == "int64":
            gacc = ws.gacc[i]
            return pb.task(_reporting_none(K.conv_weight_grad), lambda t, lo, hi: (
                eq, a_in, lay.stride, lay.padding, g, gacc), 1, split=False)
        col_t, e_t = ws.col_t[i], ws.e_t[i]
        return pb.task(_reporting_none(K.conv_weight_grad_dot), lambda t, lo, hi: (
            eq, a_in, lay.stride, lay.padding, g, col_t, e_t, model.conv_impl == "col"), 1,
            split=False)


def _reporting_none(kernel: Callable[..., object]) -> Callable[..., int]:
    """A gradient kernel that does not report max |G|, reporting -1."""
    def run(*args: Any) -> int:
        kernel(*args)
        return -1
    return run
