"""The layer kinds a :class:`~firmware_models.spec.ModelSpec` is built from, one module
each (its fields, shapes, model-file keys, float reference, liveness flags and ONNX
nodes; :mod:`.base` says what a kind provides). :data:`LAYER_TYPES` is the registry:
model files, the ONNX metadata's spec and ``edge_client.intnn.layers`` read it. A new
kind is a module here plus its line below (docs/architecture.md#add-a-layer-kind).
"""

from firmware_models.layers.avgpool2d import AvgPool2d
from firmware_models.layers.base import REQUIRED, Shape, SpecLayer, WeightLayer
from firmware_models.layers.conv2d import Conv2d
from firmware_models.layers.flatten import Flatten
from firmware_models.layers.linear import Linear
from firmware_models.layers.maxpool2d import MaxPool2d
from firmware_models.layers.relu import ReLU

#: every layer kind, by the name a spec's JSON gives its ``type`` (the class name)
LAYER_TYPES: dict[str, type[SpecLayer]] = {
    cls.__name__: cls for cls in (Conv2d, Linear, ReLU, MaxPool2d, Flatten, AvgPool2d)
}

__all__ = ["LAYER_TYPES", "REQUIRED", "AvgPool2d", "Conv2d", "Flatten", "Linear", "MaxPool2d", "ReLU",
           "Shape", "SpecLayer", "WeightLayer"]
