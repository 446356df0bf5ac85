"""``float_step = "integer"``: a float device that trains its float forward with the integer
devices' step (the mixed fleet's control that changes the optimizer, not the forward)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.data import load_digits
from edge_client.errors import ConfigError
from edge_client.hparams import round_settings
from edge_client.intnn import init_shared
from edge_client.trainers import TorchTrainer
from firmware_models import get_spec

SPEC = get_spec("digits_cnn")
DATA = load_digits("train").subset(np.arange(64))


def one_step(**kw) -> list[np.ndarray]:
    tr = TorchTrainer(SPEC, seed=0)
    tr.load_shared(init_shared(SPEC, 0))
    tr.train(DATA, steps=1, batch=32, **kw)
    return tr.to_shared()


def test_the_integer_step_on_the_float_forward_moves_each_layer_by_the_grid_step() -> None:
    w0 = init_shared(SPEC, 0)
    a = one_step(step="integer", lr_shift=3)
    b = one_step(step="integer", lr_shift=3, lr=5.0, momentum=0.0, grad_clip=0.0)  # SGD's settings: no effect
    half = one_step(step="integer", lr_shift=2)
    sgd = one_step(lr=0.5)
    for x, y, h, w in zip(a, b, half, w0, strict=True):
        np.testing.assert_array_equal(x, y)
        inside = np.abs(w) < 0.5 - 0.1  # away from the clip
        np.testing.assert_allclose((h - w)[inside], (x - w)[inside] / 2, atol=1e-7)  # 2^lr_shift LSBs
        assert 0 < np.max(np.abs(x - w)) <= 2.0 ** (3 - 7) * np.sqrt(2) + 1e-6  # the largest: ~1/16
    assert any(not np.array_equal(x, z) for x, z in zip(a, sgd, strict=True))
    with pytest.raises(ConfigError, match="step must be"):
        TorchTrainer(SPEC, step="adam")


def test_a_float_device_on_the_float_forward_takes_it_an_integer_device_ignores_it() -> None:
    st = round_settings({"float_step": "integer", "lr_shift": 2, "grad_clip": 1.0}, variant="float32",
                        codec="float32", codec_bits=32)
    assert st.float_step == "integer" and st.lr_shift == 2 and st.grad_clip is None and not st.not_applied
    sgd = round_settings({"grad_clip": 1.0, "lr_shift": 2}, variant="float32", codec="float32", codec_bits=32)
    assert sgd.float_step is None and sgd.grad_clip == 1.0 and sgd.lr_shift is None
    i8 = round_settings({"float_step": "integer"}, variant="int8", codec="int", codec_bits=8)
    assert i8.float_step is None and not i8.not_applied
    fwd = round_settings({"float_step": "sgd", "float_forward": "int8"}, variant="float32", codec="float32",
                         codec_bits=32)
    assert fwd.float_step is None and fwd.float_forward == "int8"
