"""2-D convolution: square kernel, zero padding, no bias; weights ``[O, C, K, K]``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from firmware_models.errors import SpecError
from firmware_models.layers.base import NO_PADS, REQUIRED, Shape, WeightLayer

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from types import ModuleType

    from torch import Tensor

    from firmware_models.onnx_graph import Act, Builder, IntegerGraph, QLinearGraph, WidthFold


@dataclass(frozen=True)
class Conv2d(WeightLayer):
    """2-D convolution, square kernel, zero padding, no bias."""

    file_type: ClassVar[str] = "conv2d"
    file_aliases: ClassVar[tuple[str, ...]] = ("conv",)
    name_prefix: ClassVar[str] = "conv"
    file_keys: ClassVar[Mapping[str, Any]] = {"out": REQUIRED, "kernel": REQUIRED, "stride": 1,
                                              "padding": 0, "in": None}

    name: str
    in_channels: int
    out_channels: int
    kernel: int
    stride: int = 1
    padding: int = 0

    @property
    def weight_shape(self) -> Shape:
        return (self.out_channels, self.in_channels, self.kernel, self.kernel)

    @property
    def fan_in(self) -> int:
        return self.in_channels * self.kernel * self.kernel

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 3:
            raise SpecError(f"{self.name}: Conv2d needs a [C, H, W] input, got {list(shape)}")
        c, h, w = shape
        if c != self.in_channels:
            raise SpecError(f"{self.name}: expects {self.in_channels} input channels, got {c}")
        ho = (h + 2 * self.padding - self.kernel) // self.stride + 1
        wo = (w + 2 * self.padding - self.kernel) // self.stride + 1
        if ho < 1 or wo < 1:
            raise SpecError(f"{self.name}: input {list(shape)} is smaller than the kernel")
        return (self.out_channels, ho, wo)

    @classmethod
    def from_file(cls, name: str, values: Mapping[str, Any], current: Shape, where: str
                  ) -> Conv2d:
        if len(current) != 3:
            raise SpecError(f"{where}: needs a [C, H, W] input, the previous layer gives "
                            f"{list(current)}")
        given = values["in"]
        if given is not None and given != current[0]:
            raise SpecError(f"{where}: in = {given} but the previous layer gives {current[0]} "
                            f"input channels")
        return cls(name, current[0], values["out"], values["kernel"], values["stride"],
                   values["padding"])

    def torch_forward(self, torch: ModuleType, h: Tensor, w: Tensor | None = None) -> Tensor:
        return torch.nn.functional.conv2d(h, w, stride=self.stride, padding=self.padding)

    def live_reach(self, codes: np.ndarray, pos: np.ndarray, neg: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        t = codes
        tp = (t > 0).reshape(t.shape[0], t.shape[1], -1).sum(axis=2)  # [O, C]
        tn = (t < 0).reshape(t.shape[0], t.shape[1], -1).sum(axis=2)
        return tp @ pos + tn @ neg, tn @ pos + tp @ neg

    # ONNX ---------------------------------------------------------------------------

    def qlinear_input(self, in_shape: Shape) -> tuple[int, tuple[int, int, int, int]]:
        """An image channel count that is not a multiple of QLINEAR_CHANNEL_BLOCK padded
        with zero channels (which this conv's zero weights for them ignore), and the
        spatial padding of a width-folded read (onnx_graph.QLinearGraph.input)."""
        from firmware_models.onnx_graph import QLINEAR_CHANNEL_BLOCK, width_fold

        extra = -self.in_channels % QLINEAR_CHANNEL_BLOCK
        fold = width_fold(self, in_shape, self.in_channels + extra)
        return extra, (fold.pads if fold is not None else NO_PADS)

    def onnx_float(self, b: Builder, v: str, w: np.ndarray) -> str:
        wt = b.tensor(f"{self.name}.w", w)
        s, pad = self.stride, self.padding
        return b.op("Conv", [v, wt], self.name, kernel_shape=[self.kernel] * 2,
                    strides=[s, s], pads=[pad] * 4)

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape, t: np.ndarray,
                     shift: int, relu: bool) -> Act:
        """One ``QLinearConv`` (on the width-folded input where ``width_fold`` says)."""
        from firmware_models.onnx_graph import Act, width_fold

        b = g.b
        zp, x_zp, y_scale, y_zp = g.requant(a, shift, relu)
        t = np.pad(t.astype(np.int8), ((0, 0), (0, a.extra_channels), (0, 0), (0, 0)))
        fold = width_fold(self, in_shape, t.shape[1]) if in_shape else None
        if fold is not None:
            return self._folded(g, a, t, fold, x_zp, y_scale, y_zp, zp, relu)
        w = b.tensor(f"{self.name}.w", t)
        p, s = self.padding, self.stride
        y = b.op("QLinearConv", [a.name, g.one, x_zp, w, g.one, g.wzp, y_scale, y_zp],
                 self.name, kernel_shape=[self.kernel] * 2, strides=[s, s], pads=[p] * 4)
        return Act(y, "u8", zp, relu)

    def _folded(self, g: QLinearGraph, a: Act, t: np.ndarray, fold: WidthFold, x_zp: str,
                y_scale: str, y_zp: str, zp: int, relu: bool) -> Act:
        """The conv on its width-folded input (``onnx_graph.WidthFold``): pad (unless the input
        is padded already), NHWC, fold, ``QLinearConv``, unfold, crop the extra output
        column of an odd width, NCHW. ONNX Runtime runs its int8 convs in NHWC and removes
        the transposes that meet its own, so in its graph only the pad, the transpose of
        the input (which it makes anyway) and two reshapes remain."""
        from firmware_models.onnx_graph import Act, fold_conv_weights

        b = g.b
        c, f = t.shape[1], fold.f
        x = a.name
        if a.pads != fold.pads:
            if any(a.pads):  # pragma: no cover - input() pads only for this fold
                raise ValueError(f"{self.name}: input padded {a.pads}, the fold needs "
                                 f"{fold.pads}")
            top, left, bottom, right = fold.pads
            x = b.op("Pad", [x, b.const([0, 0, top, left, 0, 0, bottom, right], np.int64),
                             x_zp], f"{self.name}_pad", mode="constant")
        x = b.op("Transpose", [x], f"{self.name}_nhwc", perm=[0, 2, 3, 1])
        x = b.op("Reshape", [x, b.const([-1, fold.height, fold.width // f, f * c], np.int64)],
                 f"{self.name}_fold")
        x = b.op("Transpose", [x], f"{self.name}_in", perm=[0, 3, 1, 2])
        w = b.tensor(f"{self.name}.w", fold_conv_weights(t, f))
        y = b.op("QLinearConv", [x, g.one, x_zp, w, g.one, g.wzp, y_scale, y_zp],
                 self.name, kernel_shape=[fold.kernel, fold.taps], strides=[1, 1],
                 pads=[0, 0, 0, 0])
        y = b.op("Transpose", [y], f"{self.name}_nhwc", perm=[0, 2, 3, 1])
        y = b.op("Reshape", [y, b.const([-1, fold.out_h, fold.blocks * f, self.out_channels],
                                        np.int64)], f"{self.name}_unfold")
        if fold.blocks * f != fold.out_w:
            y = b.op("Slice", [y, b.const([0], np.int64), b.const([fold.out_w], np.int64),
                               b.const([2], np.int64)], f"{self.name}_crop")
        y = b.op("Transpose", [y], f"{self.name}_out", perm=[0, 3, 1, 2])
        return Act(y, "u8", zp, relu)

    def onnx_integer_op(self, g: IntegerGraph, t: np.ndarray) -> Callable[[str, int], str]:
        """``ConvInteger`` with the weights as uint8 ``t + 1``, zero point 1 (ConvInteger
        takes uint8 weights in every ONNX Runtime release)."""
        b = g.b
        w = b.tensor(f"{self.name}.w", (t.astype(np.int16) + 1).astype(np.uint8))
        wz = b.const(1, np.uint8, "w_zp")
        p, s = self.padding, self.stride
        attrs = {"kernel_shape": [self.kernel] * 2, "strides": [s, s], "pads": [p] * 4}

        def run(x: str, zp: int) -> str:
            return b.op("ConvInteger", [x, w, b.const(zp, np.uint8, "x_zp"), wz], self.name,
                        **attrs)
        return run

    def exported_weights(self, a: np.ndarray) -> np.ndarray:
        """uint8 ``t + 1`` (ConvInteger) or int8 ``t`` (QLinearConv), maybe width-folded,
        maybe with the zero weights of a padded image input's channels."""
        from firmware_models.onnx_graph import unfold_conv_weights

        a = a.astype(np.int16) - (1 if a.dtype == np.uint8 else 0)
        unfolded = unfold_conv_weights(a, self.out_channels, self.kernel)
        a = a if unfolded is None else unfolded  # a width-folded conv's weights
        c = self.weight_shape[1]
        if a.ndim == 4 and a.shape[1] > c and not np.any(a[:, c:]):
            a = a[:, :c]
        return a
