"""Flatten: ``[C, H, W]`` -> ``[C * H * W]`` in (c, h, w) order, the spec's weight column
order of the linear layer after it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from firmware_models.layers.base import Shape, SpecLayer

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from torch import Tensor

    from firmware_models.onnx_graph import Act, Builder, IntegerGraph, QLinearGraph


@dataclass(frozen=True)
class Flatten(SpecLayer):
    """Everything after the batch dimension as one feature vector."""

    file_type: ClassVar[str] = "flatten"
    name_prefix: ClassVar[str] = "flatten"

    name: str

    @classmethod
    def default_name(cls, n: int) -> str:
        return "flatten" if n == 1 else f"flatten{n}"

    def output_shape(self, shape: Shape) -> Shape:
        return (math.prod(shape),)

    def torch_forward(self, torch: ModuleType, h: Tensor) -> Tensor:
        return h.flatten(1)

    def onnx_float(self, b: Builder, v: str) -> str:
        return b.op("Flatten", [v], self.name, axis=1)

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape) -> Act:
        return g.flatten(a)

    def onnx_widened(self, g: IntegerGraph, a: Act, in_shape: Shape) -> Act:
        return g.flatten(a)
