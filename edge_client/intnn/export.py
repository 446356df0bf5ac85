"""The integer engine's side of the ONNX export: the arrays ``firmware_models.onnx_export``
needs, computed from an :class:`IntModel` (ternary weights, shifts, activation clip), and
the way back (an integer export -> an :class:`IntModel` that runs it in Numba).

``onnx`` is imported by the functions that build or read a graph, never at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn import kernels as K
from edge_client.intnn.model import IntModel
from edge_client.intnn.quant import DEFAULT_CLIP, alpha_shifts
from firmware_models import ModelSpec, SpecError

if TYPE_CHECKING:  # pragma: no cover
    import onnx

    from firmware_models.onnx_export import ExportInfo


def ternary_weights(model: IntModel) -> list[np.ndarray]:
    """int8 {-1, 0, 1} per parameter layer, spec layout: the weights the forward uses
    (``ternarize`` is elementwise, so it applies to the spec-layout integers as well)."""
    out = []
    for q in model.int_weights():
        t = np.empty(q.shape, np.int8)
        K.ternarize(np.ascontiguousarray(q).reshape(-1), model.thr, t.reshape(-1))
        out.append(t)
    return out


def forward_shifts(model: IntModel) -> list[int]:
    """Per parameter layer, the forward rounding shift ``1 + log2 alpha``."""
    return [int(op.shift) for op in model.param_ops]


def int_model_onnx(model: IntModel) -> onnx.ModelProto:
    """The integer ONNX graph of ``model``'s current weights (bit-exact with
    ``model.forward``)."""
    from firmware_models.onnx_export import export_integer

    try:
        return export_integer(model.spec, model.bits, ternary_weights(model),
                              forward_shifts(model), model.amax)
    except SpecError as exc:
        raise ConfigError(f"ONNX export: {exc}") from None


def shared_onnx(spec: ModelSpec, weights: Sequence[np.ndarray], bits: int,
                clip: float = DEFAULT_CLIP) -> onnx.ModelProto:
    """The ONNX graph of shared-domain weights as an s-bit device runs them (``bits`` <
    32: ``from_shared`` then the integer graph) or as float devices do (``bits == 32``)."""
    if bits == 32:
        from firmware_models.onnx_export import export_float

        try:
            return export_float(spec, [np.asarray(w, np.float32) for w in weights],
                                alpha_shifts(spec))
        except SpecError as exc:
            raise ConfigError(f"ONNX export: {exc}") from None
    model = IntModel(spec, bits, clip)
    model.load_shared(list(weights))
    return int_model_onnx(model)


def int_weights_onnx(spec: ModelSpec, int_weights: Sequence[np.ndarray], bits: int,
                     clip: float = DEFAULT_CLIP) -> onnx.ModelProto:
    """The integer ONNX graph of an s-bit device's own integers (spec layout)."""
    model = IntModel(spec, bits, clip)
    model.load_int(list(int_weights))
    return int_model_onnx(model)


def int_model_from_onnx(graph: onnx.ModelProto, info: ExportInfo) -> IntModel:
    """An :class:`IntModel` whose forward equals an integer export's.

    Its grid weights are ``t * (threshold + 1)``: they ternarize back to the exported
    ``t``, the only weights a forward pass reads. ConfigError when the export's shifts are
    not the ones this engine computes for the spec (another engine version's arithmetic).
    """
    from firmware_models.onnx_export import exported_ternary

    try:
        ts = exported_ternary(graph, info)
    except SpecError as exc:
        raise ConfigError(str(exc)) from None
    model = IntModel(info.spec, info.bits)
    if tuple(forward_shifts(model)) != tuple(info.shifts):
        raise ConfigError(f"{info.spec.name}: the export's shifts {list(info.shifts)} differ "
                          f"from this engine's {forward_shifts(model)}")
    model.load_int([t.astype(model.wdtype) * (model.thr + 1) for t in ts])
    return model
