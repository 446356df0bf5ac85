"""Model specs: parameter counts, fan-ins and end-to-end shape validation."""

from __future__ import annotations

import math

import pytest

from edge_client.compat import zip_strict
from firmware_models import (
    MODELS,
    Conv2d,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
    SpecError,
    fedshift_cnn,
    get_spec,
    vgg7_small,
)


def test_fedshift_cnn_matches_the_paper() -> None:
    spec = fedshift_cnn()
    # 3*32*25 + 32*64*25 + 4096*512 + 512*10, no biases: "about 2.16 M parameters"
    assert spec.param_count == 2400 + 51200 + 2_097_152 + 5120 == 2_155_872
    assert spec.activation_shapes[3] == (32, 16, 16)  # conv pad 1 -> 30x30, pool pad 1 -> 16x16
    assert spec.activation_shapes[7] == (4096,)
    assert spec.fan_ins() == [75, 800, 4096, 512]
    assert spec.param_names() == ["conv1", "conv2", "fc1", "fc2"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_reports_consistent_counts(name: str) -> None:
    spec = get_spec(name)
    assert spec.param_count == sum(math.prod(s) for s in spec.param_shapes()) > 0
    assert len(spec.fan_ins()) == len(spec.param_shapes()) == len(spec.param_names())
    for shape, fan_in in zip_strict(spec.param_shapes(), spec.fan_ins()):
        assert math.prod(shape[1:]) == fan_in
    assert spec.activation_shapes[-1] == (spec.num_classes,)
    assert name in spec.summary()


def test_vgg7_width_scales_channels() -> None:
    full = vgg7_small(width=1.0)
    assert full.param_shapes()[0] == (128, 3, 3, 3)
    assert full.param_shapes()[-2] == (1024, 512 * 4 * 4)
    assert vgg7_small(width=0.25).param_count < full.param_count / 10


@pytest.mark.parametrize(
    "layers,message",
    [
        ((Conv2d("c", 2, 4, 3), Flatten("f"), Linear("l", 144, 10)), "expects 2 input channels"),
        ((Flatten("f"), Linear("l", 63, 10)), "Linear expects"),
        ((Flatten("f"), Linear("l", 64, 9)), "output shape"),
        ((Conv2d("c", 1, 4, 9), Flatten("f"), Linear("l", 4, 10)), "smaller than the kernel"),
        ((MaxPool2d("p", 2, padding=2), Flatten("f"), Linear("l", 64, 10)), "padding"),
        ((ReLU("x"), ReLU("x"), Flatten("f"), Linear("l", 64, 10)), "duplicate layer names"),
        ((Linear("l", 64, 10),), "Linear expects"),
    ],
)
def test_inconsistent_specs_are_rejected(layers, message) -> None:
    with pytest.raises(SpecError, match=message):
        ModelSpec("bad", (1, 8, 8), layers, 10)


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(SpecError, match="unknown model 'resnet'.*digits_cnn.*fedshift_cnn"):
        get_spec("resnet")
