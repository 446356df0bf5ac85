"""The named architectures fedbit ships, built as :class:`ModelSpec` values, and
:func:`resolve_model`, which also accepts a user's model file."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from firmware_models.errors import SpecError
from firmware_models.files import is_model_file, load_model_file
from firmware_models.spec import Conv2d, Flatten, Layer, Linear, MaxPool2d, ModelSpec, ReLU


def digits_cnn(num_classes: int = 10) -> ModelSpec:
    """Small CNN for scikit-learn's 8x8x1 digits: 13,584 parameters."""
    layers: list[Layer] = [
        Conv2d("conv1", 1, 16, 3, padding=1), ReLU("relu1"), MaxPool2d("pool1", 2),
        Conv2d("conv2", 16, 32, 3, padding=1), ReLU("relu2"), MaxPool2d("pool2", 2),
        Flatten("flatten"),
        Linear("fc1", 128, 64), ReLU("relu3"),
        Linear("fc2", 64, num_classes),
    ]
    return ModelSpec("digits_cnn", (1, 8, 8), tuple(layers), num_classes,
                     "two 3x3 convs (16, 32), 2x2 pools, FC 128-64-10; for bundled digits")


def mnist_cnn(num_classes: int = 10) -> ModelSpec:
    """CNN for the 28x28x1 MNIST family (MNIST, Fashion-MNIST, EMNIST): 206,736 parameters.

    Two 3x3 convolutions (16, 32 channels, padding 1), each followed by ReLU and a 2x2
    max-pool (28 -> 14 -> 7), FC 1568 -> 128 -> classes; no biases.
    """
    layers: list[Layer] = [
        Conv2d("conv1", 1, 16, 3, padding=1), ReLU("relu1"), MaxPool2d("pool1", 2),
        Conv2d("conv2", 16, 32, 3, padding=1), ReLU("relu2"), MaxPool2d("pool2", 2),
        Flatten("flatten"),
        Linear("fc1", 1568, 128), ReLU("relu3"),
        Linear("fc2", 128, num_classes),
    ]
    return ModelSpec("mnist_cnn", (1, 28, 28), tuple(layers), num_classes,
                     "two 3x3 convs (16, 32), 2x2 pools, FC 1568-128-10; for 28x28 MNIST-family images")


def mnist_mlp(hidden: int = 128, num_classes: int = 10) -> ModelSpec:
    """MLP for the 28x28x1 MNIST family: flatten, FC 784 -> ``hidden`` -> classes (101,632
    parameters at 128)."""
    return _mlp("mnist_mlp", (1, 28, 28), hidden, num_classes)


def fedshift_cnn(num_classes: int = 10) -> ModelSpec:
    """The FedShift paper's CNN for 32x32x3 inputs (about 2.16 M parameters).

    Two 5x5 convolutions with 32 and 64 channels and padding 1, each followed by ReLU and
    a 2x2 max-pool with padding 1; FC 4096 -> 512 -> classes; the paper's Kaiming (He)
    initialisation (``init = "he"``). No biases (the paper's CNN has them; fedbit's shared
    parameter domain has none, docs/algorithms.md).
    """
    layers: list[Layer] = [
        Conv2d("conv1", 3, 32, 5, padding=1), ReLU("relu1"), MaxPool2d("pool1", 2, padding=1),
        Conv2d("conv2", 32, 64, 5, padding=1), ReLU("relu2"), MaxPool2d("pool2", 2, padding=1),
        Flatten("flatten"),
        Linear("fc1", 4096, 512), ReLU("relu3"),
        Linear("fc2", 512, num_classes),
    ]
    return ModelSpec("fedshift_cnn", (3, 32, 32), tuple(layers), num_classes,
                     "FedShift CNN: 5x5 convs 32/64 pad 1, 2x2 pools pad 1, FC 4096-512-10", init="he")


def vgg7_small(width: float = 0.125, num_classes: int = 10, image: int = 32) -> ModelSpec:
    """WAGE's VGG-7 (2x128C3-MP2-2x256C3-MP2-2x512C3-MP2-1024FC-10) with a width multiplier.

    ``width`` scales every channel count and the hidden FC width (1.0 is the paper's
    model, 0.125 a size an edge device trains in minutes).
    """
    if width <= 0:
        raise SpecError(f"vgg7_small: width must be > 0, got {width}")
    c1, c2, c3 = (max(1, round(c * width)) for c in (128, 256, 512))
    hidden = max(1, round(1024 * width))
    if image % 8:
        raise SpecError(f"vgg7_small: image size must be a multiple of 8, got {image}")
    side = image // 8
    layers: list[Layer] = [
        Conv2d("conv1", 3, c1, 3, padding=1), ReLU("relu1"),
        Conv2d("conv2", c1, c1, 3, padding=1), ReLU("relu2"), MaxPool2d("pool1", 2),
        Conv2d("conv3", c1, c2, 3, padding=1), ReLU("relu3"),
        Conv2d("conv4", c2, c2, 3, padding=1), ReLU("relu4"), MaxPool2d("pool2", 2),
        Conv2d("conv5", c2, c3, 3, padding=1), ReLU("relu5"),
        Conv2d("conv6", c3, c3, 3, padding=1), ReLU("relu6"), MaxPool2d("pool3", 2),
        Flatten("flatten"),
        Linear("fc1", c3 * side * side, hidden), ReLU("relu7"),
        Linear("fc2", hidden, num_classes),
    ]
    return ModelSpec("vgg7_small", (3, image, image), tuple(layers), num_classes,
                     f"WAGE VGG-7 at width x{width}")


def mlp(input_shape: tuple[int, ...] = (1, 8, 8), hidden: int = 128,
        num_classes: int = 10) -> ModelSpec:
    """Two-layer perceptron (flatten -> hidden -> classes); defaults fit the digits."""
    return _mlp("mlp", input_shape, hidden, num_classes)


def _mlp(name: str, input_shape: tuple[int, ...], hidden: int, num_classes: int) -> ModelSpec:
    if hidden < 1:
        raise SpecError(f"mlp: hidden must be >= 1, got {hidden}")
    features = 1
    for d in input_shape:
        features *= d
    layers: list[Layer] = [
        Flatten("flatten"), Linear("fc1", features, hidden), ReLU("relu1"),
        Linear("fc2", hidden, num_classes),
    ]
    return ModelSpec(name, tuple(input_shape), tuple(layers), num_classes,
                     f"MLP {features}-{hidden}-{num_classes}")


MODELS: dict[str, Callable[..., ModelSpec]] = {
    "digits_cnn": digits_cnn,
    "fedshift_cnn": fedshift_cnn,
    "vgg7_small": vgg7_small,
    "mlp": mlp,
    "mnist_cnn": mnist_cnn,
    "mnist_mlp": mnist_mlp,
}


def get_spec(name: str, **kwargs: object) -> ModelSpec:
    """Build the named architecture; unknown names list the valid ones."""
    try:
        builder = MODELS[name]
    except KeyError:
        raise SpecError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    return builder(**kwargs)


def resolve_model(ref: str, files: Mapping[str, ModelSpec] | None = None, *,
                  allow_paths: bool = True) -> ModelSpec:
    """The :class:`ModelSpec` a model reference names: a bundled model (:data:`MODELS`),
    or a user's model file (``*.toml`` / ``*.py``, :mod:`firmware_models.files`).

    ``files``: model files already loaded, by file name (a device's ``--model-file``s); a
    reference whose file name is among them gets that spec. ``allow_paths``: whether a
    reference may name a file to load (True where the reference comes from the user's own
    configuration; False on a device, where it comes from the coordinator's announcement:
    a device runs no file it was not given). SpecError naming the reference.
    """
    if not isinstance(ref, str) or not ref:
        raise SpecError(f"model reference must be a non-empty string, got {ref!r}")
    if ref in MODELS:
        return MODELS[ref]()
    if is_model_file(ref):
        known = files or {}
        base = os.path.basename(ref)
        if base in known:
            return known[base]
        if allow_paths:
            return load_model_file(ref, reserved=tuple(MODELS))
        raise SpecError(f"model {ref!r}: a model file this device was not given "
                        f"(fedbit-edge run --model-file {base})")
    raise SpecError(f"unknown model {ref!r}; known: {', '.join(sorted(MODELS))}, "
                    f"or a model file (*.toml, *.py)")
