"""ReLU: ``max(0, x)`` elementwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from firmware_models.layers.base import Shape, SpecLayer

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from torch import Tensor

    from firmware_models.onnx_graph import Act, Builder, IntegerGraph, QLinearGraph


@dataclass(frozen=True)
class ReLU(SpecLayer):
    """``max(0, x)``; right after a weight layer, that layer computes it with its output."""

    file_type: ClassVar[str] = "relu"
    name_prefix: ClassVar[str] = "relu"
    is_relu: ClassVar[bool] = True

    name: str

    def output_shape(self, shape: Shape) -> Shape:
        return shape

    def torch_forward(self, torch: ModuleType, h: Tensor) -> Tensor:
        return torch.nn.functional.relu(h)

    def carry_live(self, pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return pos, np.zeros_like(neg)

    def onnx_float(self, b: Builder, v: str) -> str:
        return b.op("Relu", [v], self.name)

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape) -> Act:
        return g.relu(a)

    def onnx_widened(self, g: IntegerGraph, a: Act, in_shape: Shape) -> Act:
        return g.relu(a)
