"""Weight Normalization on float devices (ProWD appendix B; the announced ``wn``): the float
forward uses each output channel's weights as sqrt(2)·W_c/||W_c||, it trains, the
coordinator scores the float32 group in it, and the device rules say who applies it."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.evaluate import evaluator_for
from edge_client.data import digits_shard, load_digits
from edge_client.errors import ConfigError
from edge_client.hparams import round_settings, validate_hparams
from edge_client.runtime import DeviceConfig, DeviceRuntime
from edge_client.trainers import TorchTrainer
from edge_client.trainers.floating import WN_GAIN

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def logits(tr: TorchTrainer, weights, x) -> np.ndarray:
    import torch

    from edge_client.data import float_images

    tr.load_shared(weights)
    with torch.no_grad():
        return tr.forward(torch.from_numpy(float_images(x))).numpy()


def test_the_forward_sees_each_filters_direction_only():
    """Scaling every output channel by its own positive factor (what averaging with
    integer devices' ternary levels does to a filter's norm) leaves the WN forward's logits
    unchanged; the plain float forward's change. The effective filters have norm sqrt(2)."""
    x = load_digits("test").x[:32]
    wn, plain = TorchTrainer("digits_cnn", seed=0, weight_norm=True), TorchTrainer("digits_cnn", seed=0)
    w = wn.to_shared()
    rng = np.random.default_rng(0)
    scaled = [(x_ * rng.uniform(0.2, 0.9, (x_.shape[0],) + (1,) * (x_.ndim - 1))).astype(np.float32) for x_ in w]
    np.testing.assert_allclose(logits(wn, scaled, x), logits(wn, w, x), rtol=1e-4, atol=1e-5)
    assert np.abs(logits(plain, scaled, x) - logits(plain, w, x)).max() > 0.1
    eff, _ = wn._effective(0, wn.params[0], ws=False, wn=True)
    norms = eff.detach().reshape(eff.shape[0], -1).norm(dim=1).numpy()
    np.testing.assert_allclose(norms, WN_GAIN, rtol=1e-5)


def test_wn_trains_and_the_evaluator_scores_that_forward():
    """A WN float device learns (well above chance), and the coordinator's evaluator of a
    run announcing ``wn`` scores exactly what the device computes; without ``wn`` it
    scores another function."""
    test = load_digits("test").subset(np.arange(300))
    tr = TorchTrainer("digits_cnn", seed=0, weight_norm=True, lr=0.1, momentum=0.9, grad_clip=2.0)
    _, acc0 = tr.evaluate(test)
    tr.train(digits_shard(1, 2), steps=60, batch=32)
    loss, acc = tr.evaluate(test)
    assert acc > max(0.6, acc0 + 0.3), (acc0, acc)
    w = tr.to_shared()
    assert all(np.abs(x).max() <= 0.5 for x in w)
    scored = evaluator_for("digits_cnn", test, {"wn": True})({"float32": w})["float32"]
    assert scored == pytest.approx((loss, acc), rel=1e-6)
    assert evaluator_for("digits_cnn", test, {})({"float32": w})["float32"][0] != pytest.approx(loss, rel=1e-3)


def test_announced_wn_reaches_float_devices_only():
    validate_hparams({"wn": True})
    with pytest.raises(ConfigError, match="wn"):
        validate_hparams({"wn": 1})
    st = round_settings({"wn": True}, variant="float32", codec="float32", codec_bits=32)
    assert st.wn is True and st.not_applied == {}
    st = round_settings({"wn": True}, variant="int8", codec="ternary", codec_bits=2)
    assert st.wn is None and st.not_applied == {}  # the float clients' setting: not an int8 device's
    st = round_settings({"wn": True, "ws": True}, variant="float32", codec="float32", codec_bits=32)
    assert st.ws is True and not st.wn and set(st.not_applied) == {"wn"}
    st = round_settings({"wn": True, "float_forward": "int8"}, variant="float32", codec="float32", codec_bits=32)
    assert not st.wn and "normalization" in st.not_applied["wn"]
    with pytest.raises(ConfigError, match="exclude"):
        TorchTrainer("mlp", weight_norm=True, weight_standardization=True)
    with pytest.raises(ConfigError, match="normalization"):
        TorchTrainer("mlp", weight_norm=True, forward="int8")

    def kwargs(bits: int, trainer: str) -> dict:
        cfg = DeviceConfig(f"d{bits}", bits, trainer, "float32" if bits == 32 else "ternary", 32 if bits == 32 else 2)
        rt = DeviceRuntime(cfg, None, lambda *a, **k: None)
        st = rt.round_settings(type("A", (), {"hparams": {"wn": True}})())
        return rt.train_kwargs(st, object())

    assert kwargs(32, "torch")["weight_norm"] is True
    assert "weight_norm" not in kwargs(8, "int")
