"""The integer engine's layers: one module per layer kind of ``firmware_models.layers``
(the same module name), whose classes :func:`~.base.implements` it on a backend, imported
when a model first needs that kind (:func:`layer_class`; a device loads only its model's).
:func:`build_layers` makes a model's list.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from edge_client.errors import ConfigError
from edge_client.intnn.layers.base import PACKAGES, REGISTRY, IntLayer, IntWeightLayer, implements
from edge_client.intnn.workspace import internal_shape
from firmware_models import ModelSpec

PACKAGES["cpu"] = __name__


def layer_class(spec_type: type, backend: str = "cpu") -> type[IntLayer]:
    """The engine class that runs ``spec_type`` layers on ``backend``: registered by the
    module of the backend's package named as the kind's ``firmware_models.layers`` module."""
    cls = REGISTRY.get((backend, spec_type))
    if cls is None and backend in PACKAGES:
        module = f"{PACKAGES[backend]}.{spec_type.__module__.rsplit('.', 1)[-1]}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
        cls = REGISTRY.get((backend, spec_type))
    if cls is None:
        raise ConfigError(f"the {backend} engine has no {spec_type.__name__} layer")
    return cls


def load_all(backend: str = "cpu") -> None:
    """Import every layer module of ``backend`` (its whole registry: tests, listings)."""
    import pkgutil

    package = importlib.import_module(PACKAGES[backend])
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "base":
            importlib.import_module(f"{package.__name__}.{info.name}")


def build_layers(spec: ModelSpec, alpha: Sequence[int], backend: str = "cpu"
                 ) -> list[IntLayer]:
    """The engine's layers of ``spec``: one per spec layer, but a ReLU right after a weight
    layer is fused into it; ``alpha``: per weight layer, log2 of its forward scale."""
    layers = spec.layers
    shapes = spec.activation_shapes
    ops: list[IntLayer] = []
    param = 0
    i = 0
    while i < len(layers):
        layer = layers[i]
        op = layer_class(type(layer), backend)(layer, len(ops), internal_shape(shapes[i]),
                                               internal_shape(shapes[i + 1]))
        if layer.has_weights:
            op.param, op.shift = param, 1 + alpha[param]
            param += 1
            op.relu = i + 1 < len(layers) and layers[i + 1].is_relu
            i += 1 if op.relu else 0
        ops.append(op)
        i += 1
    relu_in = False
    for j, op in enumerate(ops):
        # errors are needed at the input of every layer that has a weight layer before it
        op.needs_input_error = any(o.param >= 0 for o in ops[:j])
        op.relu_in = relu_in
        relu_in = op.relu_out(relu_in)
        op.link(ops[j - 1] if j else None)
    return ops


__all__ = ["PACKAGES", "REGISTRY", "IntLayer", "IntWeightLayer", "build_layers", "implements",
           "layer_class", "load_all"]
