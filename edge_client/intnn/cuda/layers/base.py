"""What the CUDA engine's layer classes share: :class:`CudaLayer` (the passes' calls, see
the package docstring) and :class:`CudaWeightLayer` (where a layer's weights are current:
the host's arrays, which ``IntModel`` reads and writes, or the GPU's, which a step
updates; the backend copies them across when the other side needs them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.intnn.cuda import device as dev


class CudaLayer:
    """The passes' calls of a layer on the CUDA engine. ``n``: int32 [D] samples per
    device this step; arrays ``[D, N, *shape]``."""

    def cuda_buffers(self, model: Any, stack: Any) -> dict[str, Any]:
        """Device arrays besides the activations and errors (``stack.extra[index]``)."""
        return {}

    def cuda_forward(self, model: Any, stack: Any, weights: Any, prev: Any, out: Any,
                     n: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}: no forward")

    def cuda_backward(self, model: Any, stack: Any, cur: Any, n: Any) -> Any:
        """A layer without weights: the error at its input from ``cur`` (at its output)."""
        raise NotImplementedError(f"{type(self).__name__}: no backward")


class CudaWeightLayer(CudaLayer):
    """A weight layer on the CUDA engine: ``current`` says where its weights are current,
    ``"host"`` (``op.w`` / ``op.t`` changed: ``ternary_copies``), ``"device"`` (a step
    changed the GPU's) or ``"both"``."""

    current = "host"

    def ternary_copies(self) -> None:
        self.current = "host"

    def quantized_error(self, ws: Any, n: int) -> np.ndarray:
        """The last step's quantized error at the output, [n, *out_shape] (device 0)."""
        return dev.to_host(ws.stack.eq[self.index])[0, :n].copy()

    def cuda_input_error(self, model: Any, stack: Any, weights: Any, eq: Any, dst: Any,
                         n: Any) -> None:
        """The error at the input (int32) from the quantized error ``eq``."""
        raise NotImplementedError

    def cuda_grad(self, model: Any, stack: Any, eq: Any, a_in: Any, g: Any, n: Any) -> None:
        """The weight gradient ``g`` ([D, *weight_shape]) from ``eq`` and the input
        activations ``a_in``."""
        raise NotImplementedError
