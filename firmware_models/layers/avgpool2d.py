"""Average pooling over non-overlapping k x k windows (stride k, no padding; the rows and
columns past the last whole window are dropped, as torch does). The integer engine rounds
the mean half away from zero: ``sign(v) * ((|v| + k*k // 2) // (k*k))`` of the window's
sum ``v``. With ``kernel`` = the input's height and width it is a global average pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from firmware_models.errors import SpecError
from firmware_models.layers.base import REQUIRED, Shape, SpecLayer

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from torch import Tensor

    from firmware_models.onnx_graph import Act, Builder, IntegerGraph, QLinearGraph


@dataclass(frozen=True)
class AvgPool2d(SpecLayer):
    """Mean of each k x k window, windows side by side (stride k)."""

    file_type: ClassVar[str] = "avgpool2d"
    file_aliases: ClassVar[tuple[str, ...]] = ("avgpool",)
    name_prefix: ClassVar[str] = "avgpool"
    file_keys: ClassVar[Mapping[str, Any]] = {"kernel": REQUIRED}

    name: str
    kernel: int

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 3:
            raise SpecError(f"{self.name}: AvgPool2d needs a [C, H, W] input, got {list(shape)}")
        if self.kernel < 1:
            raise SpecError(f"{self.name}: kernel must be >= 1, got {self.kernel}")
        c, h, w = shape
        if h < self.kernel or w < self.kernel:
            raise SpecError(f"{self.name}: input {list(shape)} is smaller than the window")
        return (c, h // self.kernel, w // self.kernel)

    @classmethod
    def from_file(cls, name: str, values: Mapping[str, Any], current: Shape, where: str
                  ) -> AvgPool2d:
        return cls(name, values["kernel"])

    def torch_forward(self, torch: ModuleType, h: Tensor) -> Tensor:
        return torch.nn.functional.avg_pool2d(h, self.kernel)

    def torch_int_forward(self, torch: ModuleType, h: Tensor, one: float) -> Tensor:
        """The engine's rounded mean of activations on the ``1 / one`` grid: exact window
        sums of the integers, then the rounding; gradients straight through the mean."""
        mean = torch.nn.functional.avg_pool2d(h, self.kernel)
        d = self.kernel * self.kernel
        with torch.no_grad():
            v = torch.round(torch.nn.functional.avg_pool2d(h * one, self.kernel,
                                                           divisor_override=1))
            q = torch.sign(v) * torch.floor((v.abs() + float(d // 2)) / d) / one
        return mean + (q - mean).detach()

    # ONNX ---------------------------------------------------------------------------

    def onnx_float(self, b: Builder, v: str) -> str:
        k = self.kernel
        return b.op("AveragePool", [v], self.name, kernel_shape=[k, k], strides=[k, k])

    def onnx_widened(self, g: IntegerGraph, a: Act, in_shape: Shape) -> Act:
        """int32: crop to whole windows, ``ReduceSum`` of ``[N, C, Ho, k, Wo, k]`` over the
        two window axes, then the rounded division on non-negative values (integer ``Div``
        of non-negative numbers is the floor in every runtime)."""
        from firmware_models.onnx_graph import Act

        b = g.b
        k, d = self.kernel, self.kernel * self.kernel
        c, ho, wo = self.output_shape(in_shape)
        x = g.i32(a)
        v = x.name
        if (ho * k, wo * k) != tuple(in_shape[1:]):
            v = b.op("Slice", [v, b.const([0, 0], np.int64), b.const([ho * k, wo * k], np.int64),
                               b.const([2, 3], np.int64)], self.name)
        v = b.op("Reshape", [v, b.const([0, c, ho, k, wo, k], np.int64)], self.name)
        v = b.op("ReduceSum", [v, b.const([3, 5], np.int64)], self.name, keepdims=0)
        half, div, zero = b.const(d // 2, np.int32), b.const(d, np.int32), b.const(0, np.int32)

        def rounded(s: str) -> str:  # (s + d // 2) // d of s >= 0
            return b.op("Div", [b.op("Add", [s, half], self.name), div], self.name)

        if x.nonneg:
            return Act(rounded(v), "i32", 0, True)
        pos = rounded(b.op("Max", [v, zero], self.name))
        neg = rounded(b.op("Max", [b.op("Neg", [v], self.name), zero], self.name))
        return Act(b.op("Sub", [pos, neg], self.name), "i32", 0, False)

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape) -> Act:
        """The int32 form on the bytes' values, back to one byte a value."""
        from firmware_models.onnx_graph import IntegerGraph

        ints = IntegerGraph(g.b, g.bits, g.amax)
        return ints.u8(self.onnx_widened(ints, a, in_shape))
