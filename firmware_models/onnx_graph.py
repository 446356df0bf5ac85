"""Building blocks of the ONNX graphs of :mod:`firmware_models.onnx_export`: a node and
constant builder, and the integer network's layers as ONNX Runtime CPU ops (the module
docstring of ``onnx_export`` says how each piece maps and why).

``onnx`` is imported when a builder is made, never at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from firmware_models.spec import Conv2d, Linear, MaxPool2d, ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    import onnx

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

    def const(self, value: Any, dtype: Any, hint: str = "c") -> str:
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

    def integer_op(self, a: Act, layer: Conv2d | Linear, t: np.ndarray) -> str:
        """int32 ``sum t * a`` of one conv/linear layer (ConvInteger / MatMulInteger)."""
        b = self.b
        if isinstance(layer, Conv2d):
            w = b.tensor(f"{layer.name}.w", (t.astype(np.int16) + 1).astype(np.uint8))
            wz = b.const(1, np.uint8, "w_zp")
            p, s = layer.padding, layer.stride
            attrs = {"kernel_shape": [layer.kernel] * 2, "strides": [s, s], "pads": [p] * 4}

            def run(x: str, zp: int) -> str:
                return b.op("ConvInteger", [x, w, b.const(zp, np.uint8, "x_zp"), wz],
                            layer.name, **attrs)
        else:
            w = b.tensor(f"{layer.name}.w", np.ascontiguousarray(t.T.astype(np.int8)))

            def run(x: str, zp: int) -> str:
                return b.op("MatMulInteger", [x, w, b.const(zp, np.uint8, "x_zp")], layer.name)

        if self.bytes:
            x = self.u8(a)
            return run(x.name, x.zp)
        hi, lo = self.split(a)
        acc_hi = b.op("Mul", [run(hi[0], hi[1]), b.const(hi[2], np.int32)], layer.name)
        return b.op("Add", [acc_hi, run(lo[0], lo[1])], layer.name)

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

    def pool(self, a: Act, layer: MaxPool2d, shape: tuple[int, ...]) -> Act:
        """Max-pool. Non-overlapping windows (stride == kernel, the usual case), on the
        int32 values (before they become bytes: a quarter of the bytes to convert): pad
        (with the int32 minimum) or crop to ``Ho*k x Wo*k``, then the elementwise ``Max``
        of the k row slabs (``Split`` of ``[N, C, Ho, k, Wo*k]``), then of the k column
        slabs (``[N, C, Ho, Wo, k]``); ONNX Runtime's byte ``MaxPool`` is a scalar loop,
        several times slower, and its ``Max`` has no byte kernel before recent releases.
        Overlapping windows: ``MaxPool`` on bytes, or int32 ``Pad`` + strided ``Slice``
        + ``Max`` (no integer MaxPool kernel is wider than 8 bits)."""
        b = self.b
        k, s, p = layer.kernel, layer.step, layer.padding
        c, ho, wo = layer.output_shape(shape)
        overlapping = s != k
        x = self.u8(a) if self.bytes and overlapping else self.i32(a)

        def low() -> str:  # the pad value: 0 as a byte (below every value + zp), int32 min
            return b.const(0, np.uint8) if x.kind == "u8" else b.const(INT32_MIN, np.int32)

        if not overlapping:
            v = x.name
            h, w = shape[1], shape[2]
            # in padded coordinates the windows cover [0, Ho*k) x [0, Wo*k): pad the top
            # and left by p, the bottom and right up to that, crop what no window reads
            bottom, right = ho * k - h - p, wo * k - w - p
            if p or bottom > 0 or right > 0:
                v = b.op("Pad", [v, b.const([0, 0, p, p, 0, 0, max(0, bottom), max(0, right)],
                                            np.int64), low()], layer.name, mode="constant")
            if bottom < 0 or right < 0:
                v = b.op("Slice", [v, b.const([0, 0], np.int64),
                                   b.const([ho * k, wo * k], np.int64),
                                   b.const([2, 3], np.int64)], layer.name)
            if k > 1:
                # rows: [N, C, Ho, k, Wo*k] -> k slabs -> elementwise Max
                v = b.op("Reshape", [v, b.const([0, c, ho, k, wo * k], np.int64)], layer.name)
                v = self._max_of_split(v, 3, k, layer.name)
                # columns: [N, C, Ho, Wo, k] -> k slabs -> elementwise Max
                v = b.op("Reshape", [v, b.const([0, c, ho, wo, k], np.int64)], layer.name)
                v = self._max_of_split(v, 4, k, layer.name)
                v = b.op("Reshape", [v, b.const([0, c, ho, wo], np.int64)], layer.name)
            return Act(v, x.kind, x.zp, x.nonneg)
        if self.bytes:
            y = b.op("MaxPool", [x.name], layer.name, kernel_shape=[k, k], strides=[s, s],
                     pads=[p] * 4)
            return Act(y, "u8", x.zp, x.nonneg)
        v = x.name
        if p:
            v = b.op("Pad", [v, b.const([0, 0, p, p, 0, 0, p, p], np.int64), low()],
                     layer.name, mode="constant")
        axes = b.const([2, 3], np.int64)
        steps = b.const([s, s], np.int64)
        cells = []
        for kh in range(k):
            for kw in range(k):
                starts = b.const([kh, kw], np.int64)
                ends = b.const([kh + s * (ho - 1) + 1, kw + s * (wo - 1) + 1], np.int64)
                cells.append(b.op("Slice", [v, starts, ends, axes, steps], layer.name))
        y = cells[0] if len(cells) == 1 else b.op("Max", cells, layer.name)
        return Act(y, "i32", 0, x.nonneg)

    def _max_of_split(self, v: str, axis: int, k: int, hint: str) -> str:
        """Elementwise Max of the k equal parts of ``v`` along ``axis``."""
        b = self.b
        parts = [b.name(hint) for _ in range(k)]
        b.nodes.append(b.helper.make_node("Split", [v], parts, name=f"{parts[0]}/Split",
                                          axis=axis))
        return b.op("Max", parts, hint)

    def flatten(self, a: Act) -> Act:
        return Act(self.b.op("Flatten", [a.name], "flatten", axis=1), a.kind, a.zp, a.nonneg)


# requantization of QLinearConv / QLinearMatMul: ONNX Runtime computes
# nearbyint(acc * x_scale * w_scale / y_scale) (round half to even) in float32; with
# x_scale = w_scale = 1 and y_scale = 2^k / (1 + 2^-22) that is round_shift(acc, k) (half
# away from zero) for every |acc| <= 600,000 and k <= 15: the factor 1 + 2^-22 moves a
# tie away from zero, and moves nothing else across a rounding boundary (|acc| 2^-22 2^-k
# < 2^-(k+2)); tests/test_onnx_export.py checks ties of both signs and saturation.
QLINEAR_TIE_BREAK = 2.0 ** -22
QLINEAR_MAX_ACC = 600_000
#: an image input's channels are padded to a multiple of this for its first conv
QLINEAR_CHANNEL_BLOCK = 4
#: a stride-1 conv on one channel block reads this many neighbouring columns as one pixel
QLINEAR_WIDTH_FOLD = 2
#: ... when it has this many output pixels: the fold adds two reshapes (~0.3 us each a
#: call), which a small conv does not win back (digits_cnn's 8x8: batch 1 0.97x, batch 32
#: 1.02x; mnist_cnn's 28x28 1.07x / 1.14x; fedshift_cnn's 30x30 1.07x / 1.10x)
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
    4-channel tap fills a quarter of its work (fedshift_cnn's first conv 34 -> 26 us a
    sample, docs/performance.md). The input is padded once for the folded conv: the
    conv's own padding, and on the right up to ``width``."""

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
    tap then holds enough channels: fedshift_cnn's graph with its second conv folded too
    ran 0.92x); fewer than :data:`QLINEAR_FOLD_MIN_PIXELS` output pixels."""
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

    def input(self, x: str, first: Conv2d | None = None,
              shape: Sequence[int] | None = None) -> Act:
        """int8 images -> uint8 with zero point 128 (any int8 value, exactly).

        ``first``: the conv that reads them, and ``shape`` their (C, H, W). A channel count
        that is not a multiple of :data:`QLINEAR_CHANNEL_BLOCK` is padded up to one with
        zeros, which the conv's zero weights for them ignore (ONNX Runtime's int8 conv runs
        such an input faster: fedshift_cnn's 3 channels as 4 took its first conv from ~50
        to ~39 us a sample, digits_cnn's 1 as 4 +25% at batch 32); when the conv reads
        them width-folded (:func:`width_fold`) the same ``Pad`` adds its spatial padding.
        """
        b = self.b
        extra = 0 if first is None else -first.in_channels % QLINEAR_CHANNEL_BLOCK
        pads = (0, 0, 0, 0)
        if first is not None and shape is not None:
            fold = width_fold(first, shape, first.in_channels + extra)
            pads = fold.pads if fold is not None else pads
        if extra or any(pads):
            top, left, bottom, right = pads
            x = b.op("Pad", [x, b.const([0, 0, top, left, 0, extra, bottom, right], np.int64),
                             b.const(0, np.int8)], "x_pad", mode="constant")
        v = b.op("Add", [b.op("Cast", [x], "x32", to=onnx_type(np.int32)),
                         b.const(128, np.int32)], "x_off")
        return Act(b.op("Cast", [v], "x_u8", to=onnx_type(np.uint8)), "u8", 128, False, extra,
                   pads)

    def layer(self, a: Act, layer: Conv2d | Linear, t: np.ndarray, shift: int, relu: bool,
              in_shape: Sequence[int] = ()) -> Act:
        """``clip(round_shift(relu?(sum t * a), shift), +-amax)`` but the upper clip (see
        :meth:`clip`); ``in_shape``: a conv's input (C, H, W)."""
        b = self.b
        zp = 0 if relu else 128
        y_scale = b.const(np.float32(2.0 ** shift / (1.0 + QLINEAR_TIE_BREAK)), np.float32,
                          "y_scale")
        x_zp = b.const(a.zp, np.uint8, "x_zp")
        y_zp = b.const(zp, np.uint8, "y_zp")
        if isinstance(layer, Conv2d):
            t = np.pad(t.astype(np.int8), ((0, 0), (0, a.extra_channels), (0, 0), (0, 0)))
            fold = width_fold(layer, in_shape, t.shape[1]) if in_shape else None
            if fold is not None:
                return self._folded_conv(a, layer, t, fold, x_zp, y_scale, y_zp, zp, relu)
            w = b.tensor(f"{layer.name}.w", t)
            p, s = layer.padding, layer.stride
            y = b.op("QLinearConv", [a.name, self.one, x_zp, w, self.one, self.wzp, y_scale,
                                     y_zp], layer.name, kernel_shape=[layer.kernel] * 2,
                     strides=[s, s], pads=[p] * 4)
        else:
            w = b.tensor(f"{layer.name}.w", np.ascontiguousarray(t.T.astype(np.int8)))
            y = b.op("QLinearMatMul", [a.name, self.one, x_zp, w, self.one, self.wzp, y_scale,
                                       y_zp], layer.name)
        return Act(y, "u8", zp, relu)

    def _folded_conv(self, a: Act, layer: Conv2d, t: np.ndarray, fold: WidthFold, x_zp: str,
                     y_scale: str, y_zp: str, zp: int, relu: bool) -> Act:
        """The conv on its width-folded input (:class:`WidthFold`): pad (unless the input
        is padded already), NHWC, fold, ``QLinearConv``, unfold, crop the extra output
        column of an odd width, NCHW. ONNX Runtime runs its int8 convs in NHWC and removes
        the transposes that meet its own, so in its graph only the pad, the transpose of
        the input (which it makes anyway) and two reshapes remain."""
        b = self.b
        c, f = t.shape[1], fold.f
        x = a.name
        if a.pads != fold.pads:
            if any(a.pads):  # pragma: no cover - input() pads only for this fold
                raise ValueError(f"{layer.name}: input padded {a.pads}, the fold needs "
                                 f"{fold.pads}")
            top, left, bottom, right = fold.pads
            x = b.op("Pad", [x, b.const([0, 0, top, left, 0, 0, bottom, right], np.int64),
                             x_zp], f"{layer.name}_pad", mode="constant")
        x = b.op("Transpose", [x], f"{layer.name}_nhwc", perm=[0, 2, 3, 1])
        x = b.op("Reshape", [x, b.const([-1, fold.height, fold.width // f, f * c], np.int64)],
                 f"{layer.name}_fold")
        x = b.op("Transpose", [x], f"{layer.name}_in", perm=[0, 3, 1, 2])
        w = b.tensor(f"{layer.name}.w", fold_conv_weights(t, f))
        y = b.op("QLinearConv", [x, self.one, x_zp, w, self.one, self.wzp, y_scale, y_zp],
                 layer.name, kernel_shape=[fold.kernel, fold.taps], strides=[1, 1],
                 pads=[0, 0, 0, 0])
        y = b.op("Transpose", [y], f"{layer.name}_nhwc", perm=[0, 2, 3, 1])
        y = b.op("Reshape", [y, b.const([-1, fold.out_h, fold.blocks * f, layer.out_channels],
                                        np.int64)], f"{layer.name}_unfold")
        if fold.blocks * f != fold.out_w:
            y = b.op("Slice", [y, b.const([0], np.int64), b.const([fold.out_w], np.int64),
                               b.const([2], np.int64)], f"{layer.name}_crop")
        y = b.op("Transpose", [y], f"{layer.name}_out", perm=[0, 3, 1, 2])
        return Act(y, "u8", zp, relu)

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

    def pool(self, a: Act, layer: MaxPool2d) -> Act:
        """``MaxPool`` on the bytes (byte order is value order; a padded cell reads 0, the
        lowest byte, so it never exceeds the window's maximum)."""
        k, s, p = layer.kernel, layer.step, layer.padding
        y = self.b.op("MaxPool", [a.name], layer.name, kernel_shape=[k, k], strides=[s, s],
                      pads=[p] * 4)
        return Act(y, "u8", a.zp, a.nonneg)

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


def onnx_type(dtype: Any) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
