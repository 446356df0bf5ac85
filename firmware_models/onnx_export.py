"""ONNX export of a fedbit model: an integer graph that runs the integer engine's forward
pass bit for bit, and a float32 graph of the shared-domain model. It takes plain arrays
and integers (the engine computes them: ``edge_client.intnn.export``); ``onnx`` is imported
inside the functions that need it. Each layer kind adds its own nodes
(``firmware_models.layers``); this module walks the spec, checks the arguments, and writes
and reads the ``fedbit.*`` metadata (spec JSON, bitwidth, kind, opset, shifts).

**Integer graph** (:func:`export_integer`): input ``x``, the s-bit activation integers of
the images, ``int8`` (s <= 8) or ``int16`` ``[N, C, H, W]``; outputs ``logits`` (same
dtype) and ``label`` (``int64``, the first maximum). At s <= 8 one byte per activation
(``onnx_graph.QLinearGraph``: ``QLinearConv`` / ``QLinearMatMul`` whose requantization
rounds as ``round_shift``), otherwise int32 accumulators (``onnx_graph.IntegerGraph``);
how each maps and why: docs/performance.md#onnx-export. **Float graph**
(:func:`export_float`): the float forward of ``edge_client.trainers.TorchTrainer``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from firmware_models.errors import SpecError
from firmware_models.layers import LAYER_TYPES
from firmware_models.onnx_graph import (
    INPUT,
    INT32_MAX,
    LABEL,
    LOGITS,
    QLINEAR_MAX_ACC,
    Act,
    Builder,
    IntegerGraph,
    QLinearGraph,
    onnx_type,
)
from firmware_models.spec import ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    import os

    import onnx

    from firmware_models.layers.base import SpecLayer

#: the ai.onnx opset of every export (ONNX Runtime >= 1.17 reads it; the Int<=8 graph's
#: QLinearConv / QLinearMatMul are ONNX Runtime's quantized ops, not TensorRT's QDQ form)
OPSET = 17
#: IR version 8: the oldest that carries opset 17 (read by ONNX Runtime >= 1.11)
IR_VERSION = 8
#: version of the ``fedbit.*`` metadata layout
FORMAT_VERSION = 1
KIND_INTEGER, KIND_FLOAT = "integer", "float32"


# ============================================================================ spec <-> JSON


def spec_to_json(spec: ModelSpec) -> str:
    """The architecture as JSON (name, input shape, classes, layers with their fields)."""
    return json.dumps({
        "name": spec.name, "input_shape": list(spec.input_shape),
        "num_classes": spec.num_classes, "description": spec.description,
        "layers": [{"type": type(layer).__name__, **asdict(layer)} for layer in spec.layers],
    }, sort_keys=True)


def spec_from_json(text: str) -> ModelSpec:
    """Inverse of :func:`spec_to_json`; SpecError names what is wrong."""
    try:
        d = json.loads(text)
        layers = []
        for item in d["layers"]:
            fields = dict(item)
            cls = LAYER_TYPES.get(fields.pop("type", None))
            if cls is None:
                raise SpecError(f"unknown layer type {item.get('type')!r}")
            layers.append(cls(**fields))
        return ModelSpec(str(d["name"]), tuple(int(v) for v in d["input_shape"]), tuple(layers),
                         int(d["num_classes"]), str(d.get("description", "")))
    except SpecError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpecError(f"not a model spec ({type(exc).__name__}: {exc})") from None


# ============================================================================ metadata


@dataclass(frozen=True)
class ExportInfo:
    """What a fedbit ONNX file says about itself (its ``fedbit.*`` metadata).

    ``bits``: compute bitwidth s (2..16), 32 for a float export; ``shifts``: per parameter
    layer, the integer graph's rounding shift (empty for float); ``amax``: the activation
    clip ``2^(s-1) - 1`` (0 for float).
    """

    spec: ModelSpec
    bits: int
    kind: str
    opset: int
    shifts: tuple[int, ...] = ()
    amax: int = 0

    @property
    def variant(self) -> str:
        """``int<s>`` or ``float32`` (the wire protocol's variant names)."""
        return KIND_FLOAT if self.kind == KIND_FLOAT else f"int{self.bits}"


def _metadata(spec: ModelSpec, bits: int, kind: str, shifts: Sequence[int], amax: int
              ) -> dict[str, str]:
    return {
        "fedbit.format": str(FORMAT_VERSION),
        "fedbit.model": spec.name,
        "fedbit.spec": spec_to_json(spec),
        "fedbit.bits": str(bits),
        "fedbit.kind": kind,
        "fedbit.variant": KIND_FLOAT if kind == KIND_FLOAT else f"int{bits}",
        "fedbit.opset": str(OPSET),
        "fedbit.shifts": json.dumps([int(k) for k in shifts]),
        "fedbit.amax": str(amax),
    }


def _input_dtype(bits: int) -> np.dtype:
    return np.dtype(np.int8) if bits <= 8 else np.dtype(np.int16)


def describe(model: onnx.ModelProto) -> ExportInfo:
    """Read and cross-check a fedbit export's metadata against its graph.

    Raises SpecError when the model is not a fedbit export, or when its metadata and its
    graph disagree (the spec's input shape or class count, the bitwidth's input dtype,
    the opset).
    """
    from onnx import helper

    meta = {p.key: p.value for p in model.metadata_props}
    if "fedbit.spec" not in meta or "fedbit.bits" not in meta:
        raise SpecError("an ONNX model, but not a fedbit export (no fedbit.spec / fedbit.bits "
                        "metadata)")
    if meta.get("fedbit.format") != str(FORMAT_VERSION):
        raise SpecError(f"fedbit export format {meta.get('fedbit.format')!r}, this version "
                        f"reads {FORMAT_VERSION}")
    spec = spec_from_json(meta["fedbit.spec"])
    kind = meta.get("fedbit.kind", "")
    try:
        bits = int(meta["fedbit.bits"])
        shifts = tuple(int(k) for k in json.loads(meta.get("fedbit.shifts", "[]")))
        amax = int(meta.get("fedbit.amax", "0"))
        opset = int(meta.get("fedbit.opset", "0"))
    except (ValueError, TypeError) as exc:
        raise SpecError(f"unreadable fedbit metadata ({exc})") from None
    if kind == KIND_FLOAT:
        if bits != 32:
            raise SpecError(f"float32 export with fedbit.bits = {bits}")
        want_dtype = np.dtype(np.float32)
    elif kind == KIND_INTEGER:
        if not 2 <= bits <= 16:
            raise SpecError(f"integer export with fedbit.bits = {bits} (not 2..16)")
        if amax != (1 << (bits - 1)) - 1:
            raise SpecError(f"fedbit.amax {amax} does not match {bits} bits")
        if len(shifts) != len(spec.param_layers):
            raise SpecError(f"{len(shifts)} shifts for {len(spec.param_layers)} parameter layers")
        want_dtype = _input_dtype(bits)
    else:
        raise SpecError(f"unknown fedbit.kind {kind!r}")
    onnx_opset = {o.domain: o.version for o in model.opset_import}.get("", 0)
    if opset != onnx_opset:
        raise SpecError(f"fedbit.opset {opset} but the graph imports opset {onnx_opset}")
    if meta.get("fedbit.model") != spec.name:
        raise SpecError(f"fedbit.model {meta.get('fedbit.model')!r} != spec {spec.name!r}")
    inputs = list(model.graph.input)
    if len(inputs) != 1 or inputs[0].name != INPUT:
        raise SpecError(f"expected one graph input {INPUT!r}, got {[i.name for i in inputs]}")
    ttype = inputs[0].type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type))
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in ttype.shape.dim]
    if dtype != want_dtype or tuple(dims[1:]) != tuple(spec.input_shape):
        raise SpecError(f"metadata says {spec.name} at {bits} bits (input {want_dtype} "
                        f"{['N', *spec.input_shape]}), the graph input is {dtype} {dims}")
    outs = {o.name: o for o in model.graph.output}
    if LOGITS not in outs:
        raise SpecError(f"no {LOGITS!r} output")
    odims = [d.dim_value for d in outs[LOGITS].type.tensor_type.shape.dim]
    if odims[1:] != [spec.num_classes]:
        raise SpecError(f"{spec.name} has {spec.num_classes} classes, the graph's logits are "
                        f"{odims}")
    return ExportInfo(spec, bits, kind, opset, shifts, amax)


def parse(data: bytes) -> onnx.ModelProto:
    """Bytes -> ModelProto; SpecError when they are not an ONNX model."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise SpecError(f"not an ONNX model ({type(exc).__name__})") from None
    if not model.graph.node or not model.opset_import:
        raise SpecError("not an ONNX model (no graph)")
    return model


# ============================================================================ exports


def _check_integer_args(spec: ModelSpec, bits: int, ternary: Sequence[np.ndarray],
                        shifts: Sequence[int], amax: int) -> list[np.ndarray]:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 16:
        raise SpecError(f"{spec.name}: integer export needs bits in 2..16, got {bits!r}")
    if amax != (1 << (bits - 1)) - 1:
        raise SpecError(f"{spec.name}: amax {amax} does not match {bits} bits "
                        f"(2^{bits - 1} - 1 = {(1 << (bits - 1)) - 1})")
    layers = spec.param_layers
    if len(ternary) != len(layers) or len(shifts) != len(layers):
        raise SpecError(f"{spec.name}: {len(layers)} parameter layers, got {len(ternary)} "
                        f"weight tensors and {len(shifts)} shifts")
    out = []
    for layer, t, k in zip(layers, ternary, shifts):  # lengths checked above
        t = np.asarray(t)
        if tuple(t.shape) != tuple(layer.weight_shape):
            raise SpecError(f"{spec.name}: {layer.name} weights have shape {list(t.shape)}, "
                            f"expected {list(layer.weight_shape)}")
        if t.dtype.kind not in "iu" or (t.size and (int(t.min()) < -1 or int(t.max()) > 1)):
            raise SpecError(f"{spec.name}: {layer.name} weights are not ternary integers "
                            f"in {{-1, 0, 1}}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= 30:
            raise SpecError(f"{spec.name}: {layer.name} shift {k!r} is not in 0..30")
        # int32 accumulators; at Int16 the high byte's partial sum is scaled by 256
        reach = layer.fan_in * (amax if bits <= 8 else 1 << 15)
        if reach > INT32_MAX:
            raise SpecError(f"{spec.name}: {layer.name} fan-in {layer.fan_in} overflows int32 "
                            f"at {bits} bits")
        out.append(t.astype(np.int8))
    return out


def export_integer(spec: ModelSpec, bits: int, ternary: Sequence[np.ndarray],
                   shifts: Sequence[int], amax: int) -> onnx.ModelProto:
    """The integer graph of ``spec`` at ``bits`` bits (see the module docstring: one byte
    per activation and ``QLinearConv`` / ``QLinearMatMul`` at s <= 8, int32 otherwise).

    ``ternary``: per parameter layer, int8 {-1, 0, 1} in the spec's layout
    (``[O, C, K, K]``, ``[O, F]``); ``shifts``: per parameter layer, the forward rounding
    shift ``1 + log2 alpha``; ``amax``: ``2^(bits-1) - 1``. Validated by ``onnx.checker``.
    """
    ts = _check_integer_args(spec, bits, ternary, shifts, amax)
    b = Builder()
    out_dtype = _input_dtype(bits)
    if bits <= 8 and max(layer.fan_in for layer in spec.param_layers) * amax <= QLINEAR_MAX_ACC:
        z = _qlinear_layers(QLinearGraph(b, int(bits), int(amax)), spec, ts, shifts)
    else:
        z = _widened_layers(IntegerGraph(b, int(bits), int(amax)), spec, ts, shifts)
        b.op("Cast", [z], LOGITS, output=LOGITS, to=onnx_type(out_dtype))
    b.op("ArgMax", [z], LABEL, output=LABEL, axis=1, keepdims=0)
    doc = (f"fedbit {spec.name}, Int{bits} integer forward (bit-exact with the Numba engine). "
           f"Input x: {out_dtype} [N, {', '.join(map(str, spec.input_shape))}] = "
           f"round(pixel * {amax}); outputs: {LOGITS} {out_dtype}, {LABEL} int64.")
    return b.model(spec, out_dtype, out_dtype,
                   _metadata(spec, int(bits), KIND_INTEGER, shifts, int(amax)), doc,
                   OPSET, IR_VERSION)


def _qlinear_layers(g: QLinearGraph, spec: ModelSpec, ts: Sequence[np.ndarray],
                    shifts: Sequence[int]) -> str:
    """The layers at s <= 8 (``QLinearGraph``); returns the int8 logits' name
    (:data:`LOGITS`)."""
    layers = spec.layers
    shapes = spec.activation_shapes
    act = g.input(INPUT, *layers[0].qlinear_input(shapes[0]))
    p = 0
    i = 0
    while i < len(layers):
        layer = layers[i]
        if layer.has_weights:
            relu = _relu_after(layers, i)
            act = layer.onnx_qlinear(g, act, shapes[i], ts[p], int(shifts[p]), relu)
            p += 1
            i += 2 if relu else 1
            if i < len(layers) and layers[i].commutes_with_clip:
                act = layers[i].onnx_qlinear(g, act, shapes[i])  # clip a quarter of the bytes
                i += 1
            act = g.clip(act)
            continue
        act = layer.onnx_qlinear(g, act, shapes[i])
        i += 1
    return g.int8_values(act, LOGITS)


def _widened_layers(g: IntegerGraph, spec: ModelSpec, ts: Sequence[np.ndarray],
                    shifts: Sequence[int]) -> str:
    """The layers on int32 accumulators (``IntegerGraph``: ConvInteger / MatMulInteger,
    Int16 split in bytes); returns the int32 logits' name."""
    act = Act(g.b.op("Cast", [INPUT], "x32", to=onnx_type(np.int32)), "i32", 0, False)
    layers = spec.layers
    shapes = spec.activation_shapes
    p = 0
    i = 0
    while i < len(layers):
        layer = layers[i]
        if layer.has_weights:
            relu = _relu_after(layers, i)
            act = layer.onnx_widened(g, act, shapes[i], ts[p], int(shifts[p]), relu)
            p += 1
            i += 2 if relu else 1
            continue
        act = layer.onnx_widened(g, act, shapes[i])
        i += 1
    return g.i32(act).name


def _relu_after(layers: Sequence[SpecLayer], i: int) -> bool:
    """Whether a ReLU comes right after layer i (the weight layer computes it)."""
    return i + 1 < len(layers) and layers[i + 1].is_relu


def export_float(spec: ModelSpec, weights: Sequence[np.ndarray],
                 alpha_log2: Sequence[int]) -> onnx.ModelProto:
    """The float32 graph of the shared-domain model: each conv/linear output is
    ``layer(a, W) * 2^-alpha_log2[l]`` (no bias), as the float trainer computes it.

    ``weights``: float32 per parameter layer in the spec's layout and order.
    """
    layers = spec.param_layers
    if len(weights) != len(layers) or len(alpha_log2) != len(layers):
        raise SpecError(f"{spec.name}: {len(layers)} parameter layers, got {len(weights)} "
                        f"weight tensors and {len(alpha_log2)} scales")
    ws = []
    for layer, w in zip(layers, weights):  # lengths checked above
        w = np.asarray(w)
        if tuple(w.shape) != tuple(layer.weight_shape):
            raise SpecError(f"{spec.name}: {layer.name} weights have shape {list(w.shape)}, "
                            f"expected {list(layer.weight_shape)}")
        if w.dtype.kind != "f" or not np.all(np.isfinite(w)):
            raise SpecError(f"{spec.name}: {layer.name} weights are not finite floats")
        ws.append(w.astype(np.float32))
    b = Builder()
    v = INPUT
    p = 0
    for layer in spec.layers:
        if layer.has_weights:
            v = layer.onnx_float(b, v, ws[p])
            scale = np.float32(2.0 ** -int(alpha_log2[p]))
            v = b.op("Mul", [v, b.const(scale, np.float32, "scale")], layer.name)
            p += 1
        else:
            v = layer.onnx_float(b, v)
    b.op("Identity", [v], LOGITS, output=LOGITS)
    b.op("ArgMax", [v], LABEL, output=LABEL, axis=1, keepdims=0)
    doc = (f"fedbit {spec.name}, float32 shared-domain forward. Input x: float32 "
           f"[N, {', '.join(map(str, spec.input_shape))}] in [0, 1]; outputs: {LOGITS} "
           f"float32, {LABEL} int64.")
    return b.model(spec, np.dtype(np.float32), np.dtype(np.float32),
                   _metadata(spec, 32, KIND_FLOAT, (), 0), doc, OPSET, IR_VERSION)


def exported_ternary(model: onnx.ModelProto, info: ExportInfo) -> list[np.ndarray]:
    """The ternary weights of an integer export, int8 in the spec's layout (the inverse of
    the encoding :func:`export_integer` uses); SpecError when one is missing or not
    ternary."""
    from onnx import numpy_helper

    if info.kind != KIND_INTEGER:
        raise SpecError(f"{info.spec.name}: a {info.kind} export has no ternary weights")
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for layer in info.spec.param_layers:
        t = inits.get(f"{layer.name}.w")
        if t is None:
            raise SpecError(f"{info.spec.name}: no weights {layer.name}.w in the graph")
        a = layer.exported_weights(numpy_helper.to_array(t))
        if tuple(a.shape) != tuple(layer.weight_shape) or (a.size and np.abs(a).max() > 1):
            raise SpecError(f"{info.spec.name}: weights {layer.name}.w are not ternary "
                            f"{list(layer.weight_shape)}")
        out.append(np.ascontiguousarray(a.astype(np.int8)))
    return out


def save(model: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Write ``model`` to ``path`` (via a temporary file in the same folder, then rename)."""
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(model.SerializeToString())
    os.replace(tmp, path)
