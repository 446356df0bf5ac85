"""Model architectures as plain data, shared by the integer engine, torch and ONNX.

Importing this package never imports torch or onnx.
"""

from firmware_models.errors import SpecError
from firmware_models.spec import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU
from firmware_models.zoo import MODELS, digits_cnn, fedshift_cnn, get_spec, mlp, vgg7_small

__all__ = [
    "MODELS", "Conv2d", "Flatten", "Linear", "MaxPool2d", "ModelSpec", "ReLU", "SpecError",
    "digits_cnn", "fedshift_cnn", "get_spec", "mlp", "vgg7_small",
]
