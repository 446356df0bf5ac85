"""What the CUDA engine's layer classes share: :class:`CudaLayer` (the passes' calls, see
the package docstring) and :class:`CudaWeightLayer` (where a layer's weights are current:
the host's arrays, which ``IntModel`` reads and writes, or the GPU's, which a step
updates; the backend copies them across when the other side needs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn.cuda import device as dev

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.cuda.backend import CudaWorkspace
    from edge_client.intnn.cuda.device import DeviceArray
    from edge_client.intnn.cuda.stack import Stack, Weights
    from edge_client.intnn.model import IntModel


class CudaLayer:
    """The passes' calls of a layer on the CUDA engine. ``n``: int32 [D] samples per
    device this step; arrays ``[D, N, *shape]``."""

    def cuda_buffers(self, model: IntModel, stack: Stack) -> dict[str, DeviceArray]:
        """Device arrays besides the activations and errors (``stack.extra[index]``)."""
        return {}

    def cuda_forward(self, model: IntModel, stack: Stack, weights: Weights,
                     prev: DeviceArray, out: DeviceArray, n: DeviceArray) -> None:
        raise NotImplementedError(f"{type(self).__name__}: no forward")

    def cuda_backward(self, model: IntModel, stack: Stack, cur: DeviceArray,
                      n: DeviceArray) -> DeviceArray:
        """A layer without weights: the error at its input from ``cur`` (at its output)."""
        raise NotImplementedError(f"{type(self).__name__}: no backward")


class CudaWeightLayer(CudaLayer):
    """A weight layer on the CUDA engine: ``current`` says where its weights are current,
    ``"host"`` (``op.w`` / ``op.t`` changed: ``ternary_copies``), ``"device"`` (a step
    changed the GPU's) or ``"both"``."""

    current = "host"

    def ternary_copies(self) -> None:
        self.current = "host"

    def quantized_error(self, ws: CudaWorkspace, n: int) -> np.ndarray:
        """The last step's quantized error at the output, [n, *out_shape] (device 0)."""
        return dev.to_host(ws.stack.eq[self.index])[0, :n].copy()

    def cuda_input_error(self, model: IntModel, stack: Stack, weights: Weights,
                         eq: DeviceArray, dst: DeviceArray, n: DeviceArray) -> None:
        """The error at the input (int32) from the quantized error ``eq``."""
        raise NotImplementedError

    def cuda_grad(self, model: IntModel, stack: Stack, eq: DeviceArray, a_in: DeviceArray,
                  g: DeviceArray, n: DeviceArray) -> None:
        """The weight gradient ``g`` ([D, *weight_shape]) from ``eq`` and the input
        activations ``a_in``."""
        raise NotImplementedError
