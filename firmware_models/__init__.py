"""Model architectures as plain data, shared by the integer engine, torch and ONNX.

Importing this package never imports torch or onnx.
"""

from firmware_models.errors import SpecError
from firmware_models.files import is_model_file, load_model_file
from firmware_models.spec import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU
from firmware_models.zoo import (
    MODELS,
    digits_cnn,
    fedshift_cnn,
    get_spec,
    mlp,
    mnist_cnn,
    mnist_mlp,
    resolve_model,
    vgg7_small,
)

__all__ = [
    "MODELS", "Conv2d", "Flatten", "Linear", "MaxPool2d", "ModelSpec", "ReLU", "SpecError",
    "digits_cnn", "fedshift_cnn", "get_spec", "is_model_file", "load_model_file", "mlp", "mnist_cnn",
    "mnist_mlp", "resolve_model", "vgg7_small",
]
