"""Max pooling over square windows; padded cells never win (they count as -inf, as in
torch)."""

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
class MaxPool2d(SpecLayer):
    """Max pooling; padded cells never win (they count as -inf, as in torch)."""

    file_type: ClassVar[str] = "maxpool2d"
    file_aliases: ClassVar[tuple[str, ...]] = ("maxpool",)
    name_prefix: ClassVar[str] = "pool"
    file_keys: ClassVar[Mapping[str, Any]] = {"kernel": REQUIRED, "stride": None, "padding": 0}
    commutes_with_clip: ClassVar[bool] = True

    name: str
    kernel: int
    stride: int | None = None
    padding: int = 0

    @property
    def step(self) -> int:
        return self.kernel if self.stride is None else self.stride

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 3:
            raise SpecError(f"{self.name}: MaxPool2d needs a [C, H, W] input, got {list(shape)}")
        if 2 * self.padding > self.kernel:
            raise SpecError(f"{self.name}: padding {self.padding} exceeds half the kernel")
        c, h, w = shape
        ho = (h + 2 * self.padding - self.kernel) // self.step + 1
        wo = (w + 2 * self.padding - self.kernel) // self.step + 1
        if ho < 1 or wo < 1:
            raise SpecError(f"{self.name}: input {list(shape)} is smaller than the window")
        return (c, ho, wo)

    @classmethod
    def from_file(cls, name: str, values: Mapping[str, Any], current: Shape, where: str
                  ) -> MaxPool2d:
        return cls(name, values["kernel"], values["stride"], values["padding"])

    def torch_forward(self, torch: ModuleType, h: Tensor) -> Tensor:
        """The max-pool of ``h`` [N, C, H, W]. When no gradient is recorded through it
        (evaluation), it is computed on a channels-last copy of ``h`` and returned in the
        usual layout: the same values (a maximum is exact, NaN propagates in both), and
        PyTorch's NCHW kernel is the slow one (docs/performance.md). With a gradient the
        NCHW kernel stays, so that training computes what it always did."""
        F = torch.nn.functional
        if torch.is_grad_enabled() and h.requires_grad:
            return F.max_pool2d(h, self.kernel, stride=self.step, padding=self.padding)
        h = h.contiguous(memory_format=torch.channels_last)
        return F.max_pool2d(h, self.kernel, stride=self.step, padding=self.padding).contiguous()

    # ONNX ---------------------------------------------------------------------------

    def onnx_float(self, b: Builder, v: str) -> str:
        k, s, pad = self.kernel, self.step, self.padding
        return b.op("MaxPool", [v], self.name, kernel_shape=[k, k], strides=[s, s],
                    pads=[pad] * 4)

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape) -> Act:
        """``MaxPool`` on the bytes (byte order is value order; a padded cell reads 0, the
        lowest byte, so it never exceeds the window's maximum)."""
        from firmware_models.onnx_graph import Act

        k, s, p = self.kernel, self.step, self.padding
        y = g.b.op("MaxPool", [a.name], self.name, kernel_shape=[k, k], strides=[s, s],
                   pads=[p] * 4)
        return Act(y, "u8", a.zp, a.nonneg)

    def onnx_widened(self, g: IntegerGraph, a: Act, in_shape: Shape) -> Act:
        """Non-overlapping windows (stride == kernel, the usual case), on the int32 values
        (before they become bytes: a quarter of the bytes to convert): pad (with the int32
        minimum) or crop to ``Ho*k x Wo*k``, then the elementwise ``Max`` of the k row slabs
        (``Split`` of ``[N, C, Ho, k, Wo*k]``), then of the k column slabs
        (``[N, C, Ho, Wo, k]``); ONNX Runtime's byte ``MaxPool`` is a scalar loop, and its
        ``Max`` has no byte kernel before recent releases (docs/performance.md#onnx-export).
        Overlapping windows: ``MaxPool`` on bytes, or int32 ``Pad`` + strided ``Slice`` +
        ``Max`` (no integer MaxPool kernel is wider than 8 bits)."""
        from firmware_models.onnx_graph import INT32_MIN, Act

        b = g.b
        k, s, p = self.kernel, self.step, self.padding
        c, ho, wo = self.output_shape(in_shape)
        overlapping = s != k
        x = g.u8(a) if g.bytes and overlapping else g.i32(a)

        def low() -> str:  # the pad value: 0 as a byte (below every value + zp), int32 min
            return b.const(0, np.uint8) if x.kind == "u8" else b.const(INT32_MIN, np.int32)

        if not overlapping:
            v = x.name
            h, w = in_shape[1], in_shape[2]
            # in padded coordinates the windows cover [0, Ho*k) x [0, Wo*k): pad the top
            # and left by p, the bottom and right up to that, crop what no window reads
            bottom, right = ho * k - h - p, wo * k - w - p
            if p or bottom > 0 or right > 0:
                v = b.op("Pad", [v, b.const([0, 0, p, p, 0, 0, max(0, bottom), max(0, right)],
                                            np.int64), low()], self.name, mode="constant")
            if bottom < 0 or right < 0:
                v = b.op("Slice", [v, b.const([0, 0], np.int64),
                                   b.const([ho * k, wo * k], np.int64),
                                   b.const([2, 3], np.int64)], self.name)
            if k > 1:
                # rows: [N, C, Ho, k, Wo*k] -> k slabs -> elementwise Max
                v = b.op("Reshape", [v, b.const([0, c, ho, k, wo * k], np.int64)], self.name)
                v = _max_of_split(b, v, 3, k, self.name)
                # columns: [N, C, Ho, Wo, k] -> k slabs -> elementwise Max
                v = b.op("Reshape", [v, b.const([0, c, ho, wo, k], np.int64)], self.name)
                v = _max_of_split(b, v, 4, k, self.name)
                v = b.op("Reshape", [v, b.const([0, c, ho, wo], np.int64)], self.name)
            return Act(v, x.kind, x.zp, x.nonneg)
        if g.bytes:
            y = b.op("MaxPool", [x.name], self.name, kernel_shape=[k, k], strides=[s, s],
                     pads=[p] * 4)
            return Act(y, "u8", x.zp, x.nonneg)
        v = x.name
        if p:
            v = b.op("Pad", [v, b.const([0, 0, p, p, 0, 0, p, p], np.int64), low()],
                     self.name, mode="constant")
        axes = b.const([2, 3], np.int64)
        steps = b.const([s, s], np.int64)
        cells = []
        for kh in range(k):
            for kw in range(k):
                starts = b.const([kh, kw], np.int64)
                ends = b.const([kh + s * (ho - 1) + 1, kw + s * (wo - 1) + 1], np.int64)
                cells.append(b.op("Slice", [v, starts, ends, axes, steps], self.name))
        y = cells[0] if len(cells) == 1 else b.op("Max", cells, self.name)
        return Act(y, "i32", 0, x.nonneg)


def _max_of_split(b: Builder, v: str, axis: int, k: int, hint: str) -> str:
    """Elementwise Max of the k equal parts of ``v`` along ``axis``."""
    parts = [b.name(hint) for _ in range(k)]
    b.nodes.append(b.helper.make_node("Split", [v], parts, name=f"{parts[0]}/Split", axis=axis))
    return b.op("Max", parts, hint)
