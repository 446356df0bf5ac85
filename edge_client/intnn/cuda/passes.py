"""The CUDA engine's passes over a :class:`~edge_client.intnn.cuda.stack.Stack`: the forward
of D devices at once, and a training step of each (the CPU engine's step, ``step.py``, in
the same order: the output error; per weight layer from the last, its error masked by
its ReLU and quantized (eq. 12), the error at its input from its ternary weights before
the update, its gradient, ``max |G|``, the update (eq. 15-16) keyed by (seed, step,
layer)). Everything stays on the GPU; the host reads nothing until the caller asks
(``stack.loss``, the weights)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda import kernels as KC
from edge_client.intnn.cuda.device import DeviceArray
from edge_client.intnn.cuda.stack import DeviceRegularizers, Stack, Weights

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel


class StepValues:
    """A step's per-device values on the GPU: ``n`` (int32 [D], 0: the device sits this
    step out), ``lr_log2`` (int32 [D]), ``seed`` / ``step`` (int64 [D]: the streams' keys),
    ``y`` (labels [D, N])."""

    def __init__(self, n: DeviceArray, y: DeviceArray, lr_log2: DeviceArray,
                 seed: DeviceArray, step: DeviceArray) -> None:
        self.n, self.y, self.lr_log2, self.seed, self.step = n, y, lr_log2, seed, step


def forward(model: IntModel, st: Stack, wts: Weights, n: DeviceArray) -> DeviceArray:
    """Every op's forward; returns the logits ``[D, N, classes]`` (device array)."""
    prev = st.x
    for i, op in enumerate(model.ops):
        if not op.view:
            op.cuda_forward(model, st, wts, prev, st.acts[i], n)
        prev = st.acts[i]
    return prev


def train_step(model: IntModel, st: Stack, wts: Weights, sv: StepValues,
               regs: DeviceRegularizers) -> None:
    """One SGD step of every device with ``sv.n[d] > 0``; its loss is added to
    ``st.loss[d]``."""
    d = st.devices
    n = sv.n
    z = forward(model, st, wts, n)
    dev.launch(KC.fill, st.scal.shape[1], d, st.scal, 0)
    if model.loss == "sse":
        dev.launch(KC.sse_error, st.capacity, d, z, sv.y, model.target, st.err_out, n, st.loss)
    else:
        dev.launch(KC.softmax_error, st.capacity, d, z, sv.y, model.bits, model.ce_temp_shift,
                   st.err_out, n, st.loss)
    n_params = len(model.param_ops)
    cur = st.err_out
    for i in range(len(model.ops) - 1, -1, -1):
        op = model.ops[i]
        if op.param < 0:
            if not op.needs_input_error:
                return
            cur = op.cuda_backward(model, st, cur, n)
            continue
        p = op.param
        per = int(np.prod(op.out_shape))
        flat = st.capacity * per
        cur2 = cur.reshape(d, flat)
        dev.launch(KC.err_absmax, flat, d, cur2, st.acts[i].reshape(d, flat), op.relu, n, per,
                   st.scal, p)
        eq = st.eq[i]
        dev.launch(KC.quantize, flat, d, cur2, st.scal, p, model.bits, eq.reshape(d, flat), n, per)
        if op.needs_input_error:
            op.cuda_input_error(model, st, wts, eq, st.err_in[i], n)
        a_in = st.acts[i - 1] if i > 0 else st.x
        g = st.grads[p]
        size = int(np.prod(op.weight_shape))
        op.cuda_grad(model, st, eq, a_in, g, n)
        g2 = g.reshape(d, size)
        dev.launch(KC.grad_absmax, size, d, g2, n, st.scal, n_params + p)
        rows, cols = op.counter_layout()
        dev.launch(KC.sgd_update, size, d, wts.w[p].reshape(d, size), wts.t[p].reshape(d, size),
                   g2, st.scal, n_params + p, sv.lr_log2, model.wmax, model.thr, sv.seed, sv.step,
                   p, rows, cols, n, regs.any, regs.anchor[p], regs.step_g[p], regs.regq,
                   regs.d_shift)
        if not op.needs_input_error:
            return
        cur = st.err_in[i]
