"""Building blocks of the ONNX graphs of :mod:`firmware_models.onnx_export`: a node and
constant builder, the integer graphs' activation representations and the steps every
layer shares (requantization, clip, the Int16 byte split), and the width fold of a conv;
each layer kind adds its own nodes with these (``firmware_models.layers``; the module
docstring of ``onnx_export`` says how each piece maps and why).

``onnx`` is imported when a builder is made, never at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    import onnx
    from numpy.typing import ArrayLike, DTypeLike

    from firmware_models.layers.conv2d import Conv2d
    from firmware_models.spec import ModelSpec

INPUT, LOGITS, LABEL = "x", "logits", "label"
INT32_MAX = (1 << 31) - 1
INT32_MIN = -(1 << 31)


class Builder:
    """Nodes, initializers (deduplicated constants) and unique names of one graph."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value: ArrayLike, dtype: DTypeLike, hint: str = "c") -> str:
        a = np.asarray(value, dtype=dtype)
        key = (a.dtype.str, a.tobytes(), a.shape)
        if key not in self._consts:
            name = self.name(hint)
            self.inits.append(self.numpy_helper.from_array(a, name))
            self._consts[key] = name
        return self._consts[key]

    def tensor(self, name: str, a: np.ndarray) -> str:
        self.inits.append(self.numpy_helper.from_array(np.ascontiguousarray(a), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], hint: str, output: str | None = None,
           **attrs: Any) -> str:
        out = output or self.name(hint)
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out],
                                                name=f"{out}/{op_type}", **attrs))
        return out

    def model(self, spec: ModelSpec, in_dtype: np.dtype, out_dtype: np.dtype,
              meta: dict[str, str], doc: str, opset: int, ir_version: int) -> onnx.ModelProto:
        """The checked model (``onnx.checker``, full check with shape inference)."""
        import onnx

        h = self.helper
        x = h.make_tensor_value_info(INPUT, h.np_dtype_to_tensor_dtype(in_dtype),
                                     ["N", *spec.input_shape])
        logits = h.make_tensor_value_info(LOGITS, h.np_dtype_to_tensor_dtype(out_dtype),
                                          ["N", spec.num_classes])
        label = h.make_tensor_value_info(LABEL, onnx.TensorProto.INT64, ["N"])
        graph = h.make_graph(self.nodes, f"fedbit_{spec.name}", [x], [logits, label],
                             initializer=self.inits, doc_string=doc)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)],
                             producer_name="fedbit", doc_string=doc)
        model.ir_version = ir_version
        h.set_model_props(model, meta)
        onnx.checker.check_model(model, full_check=True)
        return model


@dataclass(frozen=True)
class Act:
    """An activation tensor of the integer graph: ``u8`` holds ``value + zp`` as uint8,
    ``i32`` the values as int32; ``nonneg``: known >= 0 (after a ReLU)."""

    name: str
    kind: str
    zp: int = 0
    nonneg: bool = False
    #: zero channels appended to the tensor (the next conv's weights get zero rows for them)
    extra_channels: int = 0
    #: cells of value 0 already around it (top, left, bottom, right) for the conv reading it
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)


class IntegerGraph:
    """Builds the integer graph layer by layer (see the module docstring)."""

    def __init__(self, b: Builder, bits: int, amax: int) -> None:
        self.b, self.bits, self.amax = b, bits, amax
        self.bytes = bits <= 8  # activations fit one byte

    # representations ------------------------------------------------------

    def i32(self, a: Act) -> Act:
        if a.kind == "i32":
            return a
        b = self.b
        v = b.op("Cast", [a.name], "i32", to=onnx_type(np.int32))
        if a.zp:
            v = b.op("Sub", [v, b.const(a.zp, np.int32)], "i32")
        return Act(v, "i32", 0, a.nonneg)

    def u8(self, a: Act) -> Act:
        """One byte per value (bits <= 8): zero point 0 when non-negative, else 128."""
        if a.kind == "u8":
            return a
        b = self.b
        v, zp = a.name, 0
        if not a.nonneg:
            v, zp = b.op("Add", [v, b.const(128, np.int32)], "off"), 128
        return Act(b.op("Cast", [v], "u8", to=onnx_type(np.uint8)), "u8", zp, a.nonneg)

    def split(self, a: Act) -> list[tuple[str, int, int]]:
        """Int16 values as ``[(high byte, zero point, 256), (low byte, 0, 1)]`` (uint8):
        ``a = 256 * (hi - zp) + lo``. Signed values are offset by 32768 first, so every
        Div/Mod here sees non-negative numbers."""
        b = self.b
        a = self.i32(a)
        v, zp = a.name, 0
        if not a.nonneg:
            v, zp = b.op("Add", [v, b.const(32768, np.int32)], "off"), 128
        c256 = b.const(256, np.int32)
        hi = b.op("Cast", [b.op("Div", [v, c256], "hi")], "hi8", to=onnx_type(np.uint8))
        lo = b.op("Cast", [b.op("Mod", [v, c256], "lo")], "lo8", to=onnx_type(np.uint8))
        return [(hi, zp, 256), (lo, 0, 1)]

    # layers ---------------------------------------------------------------

    def integer_sum(self, a: Act, run: Callable[[str, int], str], hint: str) -> str:
        """int32 ``sum t * a`` of one weight layer: ``run(x, zp)`` adds its integer op on a
        uint8 tensor ``x`` with zero point ``zp``; an Int16 activation is its two bytes,
        ``256 * run(hi) + run(lo)`` (exact in int32)."""
        b = self.b
        if self.bytes:
            x = self.u8(a)
            return run(x.name, x.zp)
        hi, lo = self.split(a)
        acc_hi = b.op("Mul", [run(hi[0], hi[1]), b.const(hi[2], np.int32)], hint)
        return b.op("Add", [acc_hi, run(lo[0], lo[1])], hint)

    def finish(self, acc: str, shift: int, relu: bool, hint: str) -> Act:
        """``clip(round_shift(relu?(acc), shift), +-amax)`` in int32 (see the docstring)."""
        b = self.b
        if shift > 0:
            half = 1 << (shift - 1)
            bound = min((self.amax + 1) * (1 << shift) - half - 1, INT32_MAX)
        else:
            half, bound = 0, self.amax
        zero, top = b.const(0, np.int32), b.const(bound, np.int32)

        def shifted(v: str) -> str:
            v = b.op("Clip", [v, zero, top], hint)
            if shift > 0:
                v = b.op("Add", [v, b.const(half, np.int32)], hint)
                v = b.op("Div", [v, b.const(1 << shift, np.int32)], hint)
            return v

        if relu:
            return Act(shifted(acc), "i32", 0, True)
        pos = shifted(acc)
        neg = shifted(b.op("Neg", [acc], hint))
        return Act(b.op("Sub", [pos, neg], hint), "i32", 0, False)

    def relu(self, a: Act) -> Act:
        if a.nonneg:
            return a
        a = self.i32(a)  # Max has byte kernels only in recent ONNX Runtime releases
        return Act(self.b.op("Max", [a.name, self.b.const(0, np.int32)], "relu"), "i32", 0, True)

    def flatten(self, a: Act) -> Act:
        return Act(self.b.op("Flatten", [a.name], "flatten", axis=1), a.kind, a.zp, a.nonneg)


# requantization of QLinearConv / QLinearMatMul: ONNX Runtime computes
# nearbyint(acc * x_scale * w_scale / y_scale) (round half to even) in float32; with
# x_scale = w_scale = 1 and y_scale = 2^k / (1 + 2^-22) that is round_shift(acc, k) (half
# away from zero) for every |acc| <= 600,000 and k <= 15: the factor 1 + 2^-22 moves a
# tie away from zero, and moves nothing else across a rounding boundary (|acc| 2^-22 2^-k
# < 2^-(k+2)); tests/packages/firmware_models/test_onnx_export.py checks ties of both signs and saturation.
QLINEAR_TIE_BREAK = 2.0 ** -22
QLINEAR_MAX_ACC = 600_000
#: an image input's channels are padded to a multiple of this for its first conv
QLINEAR_CHANNEL_BLOCK = 4
#: a stride-1 conv on one channel block reads this many neighbouring columns as one pixel
QLINEAR_WIDTH_FOLD = 2
#: ... when it has this many output pixels: the fold adds two reshapes, which a small conv
#: does not win back (docs/performance.md#onnx-export)
QLINEAR_FOLD_MIN_PIXELS = 256


@dataclass(frozen=True)
class WidthFold:
    """A stride-1 conv on ``[N, C, H, W]`` computed on its input folded along the width:
    ``f`` neighbouring columns as one pixel of ``f * C`` channels, which in NHWC is a
    reshape (``[N, Hp, Wp, C]`` -> ``[N, Hp, Wp / f, f * C]``, no copy). The folded conv has
    ``f * O`` output channels, phase-major (output column ``f * X + phase``), so its NHWC
    output reshapes back to ``[N, Ho, f * blocks, O]`` alike; ``kernel`` rows and ``taps``
    folded columns. Same products, same exact int32 sums, ~``f * taps / kernel`` of the
    multiply-accumulates (the zero weights of the fold), but ``f`` times the channels a
    kernel tap reads: ONNX Runtime's VNNI conv pays per output pixel and tap, and a
    4-channel tap fills a quarter of its work (docs/performance.md#onnx-export). The input
    is padded once for the folded conv: the conv's own padding, and on the right up to
    ``width``."""

    f: int
    kernel: int
    taps: int
    out_h: int
    out_w: int
    blocks: int
    height: int
    width: int
    pads: tuple[int, int, int, int]  # (top, left, bottom, right)


def width_fold(layer: Conv2d, in_shape: Sequence[int], channels: int) -> WidthFold | None:
    """The fold of a conv reading ``channels`` (padded) channels of ``in_shape`` (C, H, W),
    or None where the conv is read as it is: stride > 1; more than one channel block (a
    tap then holds enough channels); fewer than :data:`QLINEAR_FOLD_MIN_PIXELS` output
    pixels."""
    f = QLINEAR_WIDTH_FOLD
    if layer.stride != 1 or channels != QLINEAR_CHANNEL_BLOCK or f < 2:
        return None
    _, h, w = in_shape
    k, p = layer.kernel, layer.padding
    out_h, out_w = h + 2 * p - k + 1, w + 2 * p - k + 1
    if min(out_h, out_w) <= 0 or out_h * out_w < QLINEAR_FOLD_MIN_PIXELS:
        return None
    taps = (k - 1 + f - 1) // f + 1
    blocks = -(-out_w // f)
    width = (blocks + taps - 1) * f
    return WidthFold(f, k, taps, out_h, out_w, blocks, h + 2 * p, width,
                     (p, p, p, width - w - p))


def fold_conv_weights(t: np.ndarray, f: int) -> np.ndarray:
    """Conv weights ``[O, C, K, K]`` for the width-folded input (:class:`WidthFold`):
    ``[f * O, f * C, K, taps]`` with ``out[phase, o, j, c, ky, X] = t[o, c, ky, f X + j -
    phase]`` (0 outside the kernel)."""
    o, c, k, _ = t.shape
    taps = (k - 1 + f - 1) // f + 1
    out = np.zeros((f, o, f, c, k, taps), t.dtype)
    for phase in range(f):
        for j in range(f):
            for x in range(taps):
                kx = f * x + j - phase
                if 0 <= kx < k:
                    out[phase, :, j, :, :, x] = t[:, :, :, kx]
    return out.reshape(f * o, f * c, k, taps)


def unfold_conv_weights(a: np.ndarray, out_channels: int, kernel: int) -> np.ndarray | None:
    """The ``[O, C, K, K]`` weights whose :func:`fold_conv_weights` is ``a``, or None when
    ``a`` is not such a fold."""
    if a.ndim != 4 or a.shape[0] <= out_channels or a.shape[0] % out_channels:
        return None
    f = a.shape[0] // out_channels
    if a.shape[1] % f or a.shape[2] != kernel:
        return None
    c = a.shape[1] // f
    first = a[:out_channels].reshape(out_channels, f, c, kernel, a.shape[3])  # phase 0
    t = np.zeros((out_channels, c, kernel, kernel), a.dtype)
    for kx in range(kernel):
        if kx // f >= a.shape[3]:
            return None
        t[:, :, :, kx] = first[:, kx % f, :, :, kx // f]
    return t if np.array_equal(fold_conv_weights(t, f), a) else None


class QLinearGraph:
    """The integer graph at s <= 8 bits on ONNX Runtime's quantized kernels: activations
    as ``uint8`` with a zero point (0 after a ReLU, else 128), ternary weights as
    ``int8``; each conv / linear is one ``QLinearConv`` / ``QLinearMatMul`` whose output
    rounding is the engine's (see ``QLINEAR_TIE_BREAK``) and whose uint8 saturation is the
    ReLU (zero point 0) or the lower clip; the upper clip ``amax`` is a ``Clip`` on bytes,
    after the max-pool when one follows (max and clip commute): one byte per value from
    input to logits, requantization fused in the kernels."""

    def __init__(self, b: Builder, bits: int, amax: int) -> None:
        self.b, self.bits, self.amax = b, bits, amax
        self.one = b.const(1.0, np.float32, "scale")
        self.wzp = b.const(0, np.int8, "w_zp")

    def input(self, x: str, extra: int = 0, pads: tuple[int, int, int, int] = (0, 0, 0, 0)
              ) -> Act:
        """int8 images -> uint8 with zero point 128 (any int8 value, exactly).

        ``extra`` zero channels and ``pads`` cells (top, left, bottom, right) are added, as
        the first layer asks (``SpecLayer.qlinear_input``): a channel count that is not a
        multiple of :data:`QLINEAR_CHANNEL_BLOCK` padded up to one, which the conv's zero
        weights for them ignore (ONNX Runtime's int8 conv runs such an input faster,
        docs/performance.md), and a width-folded conv's spatial padding in the same ``Pad``.
        """
        b = self.b
        if extra or any(pads):
            top, left, bottom, right = pads
            x = b.op("Pad", [x, b.const([0, 0, top, left, 0, extra, bottom, right], np.int64),
                             b.const(0, np.int8)], "x_pad", mode="constant")
        v = b.op("Add", [b.op("Cast", [x], "x32", to=onnx_type(np.int32)),
                         b.const(128, np.int32)], "x_off")
        return Act(b.op("Cast", [v], "x_u8", to=onnx_type(np.uint8)), "u8", 128, False, extra,
                   pads)

    def requant(self, a: Act, shift: int, relu: bool) -> tuple[int, str, str, str]:
        """(output zero point, input zero point, output scale, output zero point's constant)
        of a ``QLinearConv`` / ``QLinearMatMul`` on ``a`` whose output is
        ``round_shift(relu?(acc), shift)`` (see ``QLINEAR_TIE_BREAK``)."""
        b = self.b
        zp = 0 if relu else 128
        y_scale = b.const(np.float32(2.0 ** shift / (1.0 + QLINEAR_TIE_BREAK)), np.float32,
                          "y_scale")
        x_zp = b.const(a.zp, np.uint8, "x_zp")
        y_zp = b.const(zp, np.uint8, "y_zp")
        return zp, x_zp, y_scale, y_zp

    def clip(self, a: Act) -> Act:
        """Values to [-amax, amax] ([0, amax] when non-negative) on the bytes."""
        b = self.b
        lo = a.zp if a.nonneg else a.zp - self.amax
        y = b.op("Clip", [a.name, b.const(lo, np.uint8), b.const(a.zp + self.amax, np.uint8)],
                 "clip")
        return Act(y, "u8", a.zp, a.nonneg)

    def relu(self, a: Act) -> Act:
        if a.nonneg:
            return a
        b = self.b
        y = b.op("Clip", [a.name, b.const(a.zp, np.uint8), b.const(255, np.uint8)], "relu")
        return Act(y, "u8", a.zp, True)

    def flatten(self, a: Act) -> Act:
        return Act(self.b.op("Flatten", [a.name], "flatten", axis=1), a.kind, a.zp, a.nonneg)

    def int8_values(self, a: Act, output: str) -> str:
        """The values as int8, named ``output`` (the logits)."""
        b = self.b
        if a.zp == 0:
            return b.op("Cast", [a.name], output, output=output, to=onnx_type(np.int8))
        v = b.op("Sub", [b.op("Cast", [a.name], "i32", to=onnx_type(np.int32)),
                         b.const(a.zp, np.int32)], "i32")
        return b.op("Cast", [v], output, output=output, to=onnx_type(np.int8))


def onnx_type(dtype: DTypeLike) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
