""":class:`CudaBackend`: an ``IntModel``'s kernels on the GPU (``IntModel(backend="cuda")``,
``fedbit-edge run --engine cuda``), bit for bit the CPU engine's results.

The model's weights stay where ``IntModel`` keeps them (numpy, the engine's layout); the
backend holds a copy on the GPU and moves each layer's weights only when the other side
needs them (``CudaWeightLayer.current``): up before a pass that follows ``load_int``,
down when the model reads them after a step (:meth:`CudaBackend.sync`). A step sends the
batch and five scalars up and reads its loss back (8 bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda import kernels as KC
from edge_client.intnn.cuda import layers as _layers  # noqa: F401 (the cuda layers' package)
from edge_client.intnn.cuda import passes
from edge_client.intnn.cuda.stack import DeviceRegularizers, Stack, Weights
from edge_client.intnn.workspace import Regularizer, internal_shape

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel


class CudaWorkspace:
    """Buffers of batches of up to ``capacity`` samples: ``x`` (host, the engine's input
    layout; the caller fills ``x[:n]``) and a :class:`Stack` of one device."""

    def __init__(self, model: IntModel, capacity: int, train: bool) -> None:
        self.capacity = int(capacity)
        self.train = bool(train)
        self.x = np.zeros((self.capacity, *internal_shape(tuple(model.spec.input_shape))),
                          model.adtype)
        self.stack = Stack(model, 1, self.capacity, train)
        self.n = dev.zeros(1, np.int32)
        self.y = dev.zeros((1, self.capacity), np.int64)
        self.lr_log2 = dev.zeros(1, np.int32)
        self.seed = dev.zeros(1, np.int64)
        self.step = dev.zeros(1, np.int64)
        self.values = passes.StepValues(self.n, self.y, self.lr_log2, self.seed, self.step)
        self._regs: tuple[Regularizer | None, DeviceRegularizers] | None = None

    def regularizers(self, model: IntModel, reg: Regularizer | None) -> DeviceRegularizers:
        """The step's FedProx / FedFOR terms on the GPU (made once per ``Regularizer``)."""
        if self._regs is None or self._regs[0] is not reg:
            self._regs = (reg, DeviceRegularizers(model, [reg]))
        return self._regs[1]


class CudaBackend:
    """The CUDA engine for one model (``threads`` is ignored: the GPU's)."""

    name = "cuda"

    def __init__(self, threads: int = 1) -> None:
        from edge_client.intnn.cuda.probe import usable

        ok, why = usable()
        if not ok:
            raise ConfigError(f"the cuda engine cannot run here: {why}")
        self.threads = int(threads)
        self.weights: Weights | None = None

    def workspace(self, model: IntModel, capacity: int, train: bool) -> CudaWorkspace:
        for op in model.ops:
            op.check(model)
        return CudaWorkspace(model, capacity, train)

    def _push(self, model: IntModel) -> Weights:
        """The model's weights on the GPU, each layer uploaded where the host's changed."""
        if self.weights is None:
            self.weights = Weights(model, 1)
            for op in model.param_ops:
                op.current = "host"
        for op in model.param_ops:
            if op.current == "host":
                self.weights.upload(op.param, op.w[None], op.t[None])
                op.current = "both"
        return self.weights

    def sync(self, model: IntModel) -> None:
        """The host's arrays of the weights the GPU changed, brought up to date."""
        if self.weights is None:
            return
        for op in model.param_ops:
            if op.current == "device":
                w, t = self.weights.download(op.param)
                op.w[...] = w[0]
                op.t[...] = t[0]
                op.current = "both"

    def _batch(self, ws: CudaWorkspace, n: int) -> None:
        if not 0 < n <= ws.capacity:
            raise ValueError(f"batch of {n} samples for a workspace of {ws.capacity}")
        dev.upload(ws.stack.x[0, :n], ws.x[:n])
        dev.upload(ws.n, np.array([n], np.int32))

    def forward(self, model: IntModel, ws: CudaWorkspace, n: int) -> np.ndarray:
        wts = self._push(model)
        self._batch(ws, n)
        z = passes.forward(model, ws.stack, wts, ws.n)
        return dev.to_host(z[0, :n])

    def train_step(self, model: IntModel, ws: CudaWorkspace, y: np.ndarray, n: int, lr_log2: int,
                   seed: int, step_count: int, reg: Regularizer | None) -> int:
        wts = self._push(model)
        self._batch(ws, n)
        dev.upload(ws.y[0, :n], np.asarray(y[:n], np.int64))
        dev.upload(ws.lr_log2, np.array([lr_log2], np.int32))
        dev.upload(ws.seed, np.array([seed], np.int64))
        dev.upload(ws.step, np.array([step_count], np.int64))
        st = ws.stack
        dev.launch(KC.fill, 1, 1, st.loss.reshape(1, 1), 0)
        passes.train_step(model, st, wts, ws.values, ws.regularizers(model, reg))
        for op in model.param_ops:
            op.current = "device"
        return int(dev.to_host(st.loss)[0])

    def close(self) -> None:
        self.weights = None
