"""Model architectures as plain data.

A :class:`ModelSpec` is an input shape plus an ordered list of layers (the kinds are in
:mod:`firmware_models.layers`, re-exported here): the one description shared by the
integer engine (``edge_client.intnn``), the torch builder of the coordinator and float
devices, and the ONNX exporter. Nothing here imports torch.

Shapes exclude the batch dimension: activations are ``[C, H, W]`` for images and ``[F]``
after :class:`Flatten`; a :class:`Conv2d` weight is ``[out_channels, in_channels, k, k]``,
a :class:`Linear` weight ``[out_features, in_features]``; no layer has a bias
(docs/algorithms.md §2). The parameter layers, in order, define the model's weight list:
``spec.param_shapes()`` is the list of weight shapes every other module of fedbit agrees
on, ``spec.param_names()`` their names (``"conv1"``, ``"fc2"``...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from firmware_models.errors import SpecError
from firmware_models.layers import (
    Conv2d,
    Flatten,
    Linear,
    MaxPool2d,
    ReLU,
    Shape,
    SpecLayer,
    WeightLayer,
)

#: any layer kind (firmware_models.layers); a layer with weights
Layer = SpecLayer
ParamLayer = WeightLayer

__all__ = ["Conv2d", "Flatten", "Layer", "Linear", "MaxPool2d", "ModelSpec", "ParamLayer", "ReLU",
           "Shape"]


#: initial weight schemes (``edge_client.intnn.init_shared``): ``wage`` (WAGE eq. 10, fedbit's
#: default), ``he`` (Kaiming/He normal on the effective weight ``W / alpha``, the FedShift
#: paper's), both clipped to the shared domain
INITS = ("wage", "he")


@dataclass(frozen=True)
class ModelSpec:
    """An architecture: input shape ``[C, H, W]`` (or ``[F]``), layers, class count, and
    the scheme of its initial weights (:data:`INITS`; not part of its identity)."""

    name: str
    input_shape: Shape
    layers: tuple[Layer, ...]
    num_classes: int
    description: str = ""
    init: str = field(default="wage", compare=False)
    _shapes: tuple[Shape, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_shapes", tuple(self._infer_shapes()))

    def _infer_shapes(self) -> list[Shape]:
        if self.init not in INITS:
            raise SpecError(f"{self.name}: init {self.init!r} is not one of {list(INITS)}")
        names = [layer.name for layer in self.layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SpecError(f"{self.name}: duplicate layer names {dupes}")
        if any(d < 1 for d in self.input_shape):
            raise SpecError(f"{self.name}: input shape {list(self.input_shape)} is not positive")
        shapes = [tuple(self.input_shape)]
        for layer in self.layers:
            shapes.append(layer.output_shape(shapes[-1]))
        if shapes[-1] != (self.num_classes,):
            raise SpecError(
                f"{self.name}: output shape {list(shapes[-1])} != [{self.num_classes}] classes"
            )
        return shapes

    @property
    def activation_shapes(self) -> tuple[Shape, ...]:
        """Shape before the first layer and after each layer (len = layers + 1)."""
        return self._shapes

    @property
    def param_layers(self) -> tuple[ParamLayer, ...]:
        return tuple(layer for layer in self.layers if layer.has_weights)

    def param_names(self) -> list[str]:
        return [layer.name for layer in self.param_layers]

    def param_shapes(self) -> list[Shape]:
        return [layer.weight_shape for layer in self.param_layers]

    def fan_ins(self) -> list[int]:
        """Per parameter layer: the number of inputs each output sums (k*k*C_in or F_in)."""
        return [layer.fan_in for layer in self.param_layers]

    @property
    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes())

    def summary(self) -> str:
        lines = [f"{self.name}: input {list(self.input_shape)}, {self.param_count:,} parameters"]
        for layer, shape in zip(self.layers, self._shapes[1:]):  # one shape per layer
            params = math.prod(layer.weight_shape) if layer.has_weights else 0
            lines.append(f"  {layer.name:<8} {type(layer).__name__:<10} -> {list(shape)}  {params:,}")
        return "\n".join(lines)
