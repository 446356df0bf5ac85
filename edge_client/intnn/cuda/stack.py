"""The buffers of D devices training one model on the GPU (:class:`Stack`), their weights
(:class:`Weights`) and their FedProx / FedFOR terms (:class:`DeviceRegularizers`).

Every array has the devices first: activations ``[D, N, *shape]`` (engine layout, s-bit),
errors at layer inputs int32, quantized errors s-bit, weights and gradients ``[D,
*weight_shape]``. A single device is a stack of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda.device import DeviceArray
from edge_client.intnn.workspace import internal_shape

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel
    from edge_client.intnn.workspace import Regularizer


class Stack:
    """Buffers for batches of up to ``capacity`` samples on each of ``devices`` devices of
    ``model`` (an ``IntModel`` built for the CUDA backend: its ``ops``, formats, loss).

    ``x``: the inputs; ``acts[i]``: op i's output (a view of its input for a view op);
    training adds ``err_out`` (the loss's error, int32 [D, N, classes]), ``eq[i]`` (a weight
    op's quantized error), ``err_in[i]`` (int32 error at op i's input where it is needed),
    ``grads[p]`` (int32, int64 where a sum may not fit), ``scal`` (int64 [D, 2P]: per device
    the max |e| of each weight layer's error, then of its gradient), ``loss`` (int64 [D],
    summed over steps until zeroed); ``extra[i]``: op i's own buffers."""

    def __init__(self, model: IntModel, devices: int, capacity: int, train: bool) -> None:
        self.devices = int(devices)
        self.capacity = int(capacity)
        self.train = bool(train)
        d, cap = self.devices, self.capacity
        in_shape = internal_shape(tuple(model.spec.input_shape))
        self.x = dev.zeros((d, cap, *in_shape), model.adtype)
        self.acts: list[DeviceArray] = []
        prev = self.x
        for op in model.ops:
            shape = (d, cap, *op.out_shape)
            act = prev.reshape(shape) if op.view else dev.zeros(shape, model.adtype)
            self.acts.append(act)
            prev = act
        self.extra = [op.cuda_buffers(model, self) for op in model.ops]
        self.err_out = self.scal = self.loss = None
        self.eq: list[DeviceArray] = [None] * len(model.ops)
        self.err_in: list[DeviceArray] = [None] * len(model.ops)
        self.grads: list[DeviceArray] = []
        if not train:
            return
        self.err_out = dev.zeros((d, cap, model.spec.num_classes), np.int32)
        self.scal = dev.zeros((d, 2 * len(model.param_ops)), np.int64)
        self.loss = dev.zeros(d, np.int64)
        for i, op in enumerate(model.ops):
            if op.param >= 0:
                self.eq[i] = dev.zeros((d, cap, *op.out_shape), model.adtype)
            if op.needs_input_error and not op.view and op.has_input_error():
                self.err_in[i] = dev.zeros((d, cap, *op.in_shape), np.int32)
        for op in model.param_ops:
            wide = op.needs_int64_grad(model, cap)
            self.grads.append(dev.zeros((d, *op.weight_shape), np.int64 if wide else np.int32))


class Weights:
    """The weights of D devices on the GPU: ``w[p]`` (storage grid) and ``t[p]`` (ternary,
    int8), ``[D, *weight_shape]``."""

    def __init__(self, model: IntModel, devices: int) -> None:
        self.devices = int(devices)
        self.w = [dev.zeros((devices, *op.weight_shape), model.wdtype) for op in model.param_ops]
        self.t = [dev.zeros((devices, *op.weight_shape), np.int8) for op in model.param_ops]

    def upload(self, p: int, w: np.ndarray, t: np.ndarray) -> None:
        """Layer p's weights of every device from host arrays ``[D, *weight_shape]``."""
        dev.upload(self.w[p], w)
        dev.upload(self.t[p], t)

    def download(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        return dev.to_host(self.w[p]), dev.to_host(self.t[p])


class DeviceRegularizers:
    """The FedProx / FedFOR terms of D devices (``workspace.Regularizer`` each, or None): per
    weight layer the anchors and FedFOR steps ``[D, *weight_shape]``, and ``regq`` (int64
    [D, 4]: mu_q, alpha_q, shift, active). ``d_shift`` is the same for every device of a
    model (its grid); a stack without any term passes one-element stand-ins."""

    def __init__(self, model: IntModel, regs: Sequence[Regularizer | None]) -> None:
        d = len(regs)
        active = [r for r in regs if r is not None and r.active]
        self.any = bool(active)
        self.d_shift = int(active[0].d_shift) if active else 0
        q = np.zeros((d, 4), np.int64)
        for i, r in enumerate(regs):
            if r is not None and r.active:
                q[i] = (r.mu_q, r.alpha_q, r.shift, 1)
        self.regq = dev.to_device(q)
        self.anchor: list[DeviceArray] = []
        self.step_g: list[DeviceArray] = []
        for p, op in enumerate(model.param_ops):
            if not self.any:
                self.anchor.append(dev.zeros((1, 1), model.wdtype))
                self.step_g.append(dev.zeros((1, 1), np.int32))
                continue
            shape = (d, int(np.prod(op.weight_shape)))
            anchor = np.zeros(shape, model.wdtype)
            step_g = np.zeros(shape, np.int32)
            for i, r in enumerate(regs):
                if r is not None and r.active:
                    anchor[i] = r.anchor[p].reshape(-1)
                    step_g[i] = r.step_g[p].reshape(-1)
            self.anchor.append(dev.to_device(anchor))
            self.step_g.append(dev.to_device(step_g))
