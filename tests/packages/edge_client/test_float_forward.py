"""Float devices training the integer devices' forward (issue 11, "one network").

``TorchTrainer(forward="int<s>")`` computes the s-bit integer engine's forward in float32
(0.5·ternary(W), 1/α_l, s-bit activations rounded half away from zero and clipped), with
straight-through gradients to W. Tolerance of the forward check: none. Every partial sum
is a multiple of 2^-(s+1) far below 2^24, so float32 computes it exactly and the logits
must equal the integer engine's divided by S(s) bit for bit (a conv backend that rounded
would show up here as a failure, not as noise).
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.evaluate import ModelEvaluator
from edge_client.data import digits_shard, load_digits
from edge_client.errors import ConfigError
from edge_client.hparams import round_settings, validate_hparams
from edge_client.trainers import IntTrainer, TorchTrainer
from firmware_models import get_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def batch():
    return load_digits("test").subset(np.arange(48))


def near_thresholds(spec, seed: int) -> list[np.ndarray]:
    """Weights spread over [-0.6, 0.6], many within an LSB of the ternary threshold 0.25
    and off the 8-bit grid (the float forward must ternarize them as the device does)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in spec.param_shapes():
        w = rng.uniform(-0.6, 0.6, shape).astype(np.float32)
        near = rng.random(shape) < 0.3
        w[near] = (np.sign(w[near]) * (0.25 + rng.uniform(-0.006, 0.006, int(near.sum())))).astype(np.float32)
        out.append(w)
    return out


def int_logits(spec, bits: int, weights, x) -> np.ndarray:
    it = IntTrainer(spec, bits)
    it.load_shared(weights)
    m = it.model
    ws = m.eval_workspace(len(x))
    ws.x[:len(x)] = m.prepare_inputs(x)
    return m.forward(ws, len(x)).astype(np.int64)


@pytest.mark.parametrize("model,bits", [("digits_cnn", 8), ("digits_cnn", 6), ("digits_cnn", 16), ("mlp", 8)])
def test_integer_forward_in_float_is_the_integer_engines_logits(model, bits, batch):
    import torch

    spec = get_spec(model)
    w = near_thresholds(spec, bits)
    want = int_logits(spec, bits, w, batch.x)
    tt = TorchTrainer(spec, forward=f"int{bits}")
    tt.load_shared(w)
    with torch.no_grad():
        got = tt.forward(torch.from_numpy(batch.x)).numpy().astype(np.float64) * (1 << (bits - 1))
    assert np.abs(want).max() > 0 and len(np.unique(want)) > 10  # not a degenerate network
    np.testing.assert_array_equal(got, want.astype(np.float64))
    # and the float forward of the same weights is another function
    with torch.no_grad():
        other = tt.forward(torch.from_numpy(batch.x), bits=32).numpy()
    assert not np.allclose(other * (1 << (bits - 1)), want)


def test_straight_through_gradient_reaches_every_weight(batch):
    """The forward is piecewise constant in W; its gradient is the one of the ternary
    weights, passed to W unchanged: every layer gets a non-zero gradient, and one step is
    the integer devices' (``integer_step``): W moves by ``2^(lr_shift - 7) g / 2^round(log2
    max|g|)`` per layer, the largest element by 2^lr_shift LSBs of the 8-bit grid; a few
    steps lower the SSE loss and flip ternary codes."""
    import torch

    spec = get_spec("digits_cnn")
    tt = TorchTrainer(spec, seed=3, forward="int8", lr=0.5, momentum=0.0, grad_clip=0.0)
    x, y = torch.from_numpy(batch.x), torch.from_numpy(batch.y)
    for p in tt.params:
        p.grad = None
    tt._loss(tt.forward(x), y).backward()
    grads = [p.grad.numpy().copy() for p in tt.params]
    assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in grads)
    w0 = tt.to_shared()
    tt.train(batch, steps=1, batch=len(batch), lr_shift=2)
    for a, b, g in zip(tt.to_shared(), w0, grads, strict=True):
        k = np.round(np.log2(np.abs(g).max()))
        np.testing.assert_allclose(a, np.clip(b - 2.0 ** (2 - 7 - k) * g, -0.5, 0.5), rtol=0, atol=1e-6)
    t0 = [np.abs(w) > 0.25 for w in w0]
    loss0 = tt.evaluate(batch)[0]
    tt.train(batch, steps=20, batch=len(batch))
    assert tt.evaluate(batch)[0] < 0.8 * loss0
    assert any((np.abs(w) > 0.25).ravel().tolist() != t.ravel().tolist() for w, t in zip(tt.to_shared(), t0, strict=True))


def test_a_float_device_trains_the_integer_forward_to_the_integer_engines_accuracy():
    """Trained in the Int8 forward, a float device's model is scored the same by the
    Int8 engine and by the coordinator's float32 evaluator in that forward (and trains)."""
    spec = get_spec("digits_cnn")
    data, test = digits_shard(1, 2), load_digits("test").subset(np.arange(300))
    tt = TorchTrainer(spec, seed=0, forward="int8", lr=1.0)
    tt.train(data, epochs=4, batch=32)
    w = tt.to_shared()
    res = ModelEvaluator("digits_cnn", test, float_forward="int8")({"float32": w, "int8": w})
    assert res["float32"][1] == res["int8"][1] > 0.4  # chance: 0.1
    assert ModelEvaluator("digits_cnn", test)({"float32": w})["float32"][1] != res["float32"][1]


def test_float_forward_is_an_announced_setting_with_device_rules():
    validate_hparams({"float_forward": "int8"})
    for bad in ("float", "int1", "int32", 8):
        with pytest.raises(ConfigError, match="float_forward"):
            validate_hparams({"float_forward": bad})
    with pytest.raises(ConfigError, match="forward"):
        TorchTrainer("mlp", forward="int17")
    with pytest.raises(ConfigError, match="standardization"):
        TorchTrainer("mlp", forward="int8", weight_standardization=True)
    with pytest.raises(ConfigError, match="forward"):
        ModelEvaluator("mlp", None, float_forward="float")
    st = round_settings({"float_forward": "int8"}, variant="float32", codec="float32", codec_bits=32)
    assert st.float_forward == "int8" and st.not_applied == {}
    st = round_settings({"float_forward": "int8", "ws": True}, variant="float32", codec="float32", codec_bits=32)
    assert st.float_forward == "int8" and not st.ws and set(st.not_applied) == {"ws"}
    st = round_settings({"float_forward": "int8"}, variant="int8", codec="int", codec_bits=8)
    assert st.float_forward is None and st.not_applied == {}
    st = round_settings({"float_forward": "int8"}, variant="int6", codec="int", codec_bits=8)
    assert st.float_forward is None and "int6" in st.not_applied["float_forward"]
    st = round_settings({"float_forward": "float32"}, variant="int8", codec="int", codec_bits=8)
    assert st.not_applied == {}
    # a float device on an integer forward takes the integer devices' step: lr_shift is
    # its to apply, the gradient-norm clip is not (it has no effect on a normalized step)
    hp = {"float_forward": "int8", "lr_shift": 2, "grad_clip": 1.0, "lr_scale": 0.5}
    st = round_settings(hp, variant="float32", codec="float32", codec_bits=32)
    assert (st.lr_shift, st.grad_clip, st.not_applied) == (2, None, {})
    st = round_settings(hp | {"float_forward": "float32"}, variant="float32", codec="float32", codec_bits=32)
    assert (st.lr_shift, st.grad_clip) == (None, 1.0)


def test_a_float_device_on_an_integer_forward_gets_the_integer_step_settings(tmp_path):
    """The runtime hands the float trainer lr_shift moved by round(log2 lr_scale), as an
    integer device gets it, and the lr (times lr_scale) that sets the FedProx/FedFOR step."""
    from edge_client.runtime import DeviceConfig, DeviceRuntime

    rt = DeviceRuntime(DeviceConfig("f", 32, "torch", "float32", 32, workdir=tmp_path), None, lambda **kw: None)
    tt = TorchTrainer("mlp", forward="int8")
    st = round_settings({"float_forward": "int8", "lr_scale": 0.5}, variant="float32", codec="float32",
                        codec_bits=32)
    kw = rt.train_kwargs(st, tt)
    assert (kw["lr_shift"], kw["forward"], kw["lr"]) == (2, "int8", 0.5)
    st = round_settings({"lr_scale": 0.5}, variant="float32", codec="float32", codec_bits=32)
    assert "lr_shift" not in rt.train_kwargs(st, tt)


def test_fedprox_pulls_a_float_device_on_an_integer_forward_toward_the_global_model(batch):
    """Beside the integer step, the FedProx term moves W by lr / (1 - momentum) mu (W - W_g)
    per step, as on an integer device: a strong mu keeps the round's model nearer W_g."""
    spec = get_spec("digits_cnn")
    dist = {}
    for mu in (0.0, 2.0):
        tt = TorchTrainer(spec, seed=0, forward="int8", lr=0.05, momentum=0.5)
        w0 = tt.to_shared()
        tt.train(batch, steps=30, batch=16, prox_mu=mu)
        dist[mu] = sum(float(np.sum((a - b) ** 2)) for a, b in zip(tt.to_shared(), w0, strict=True))
    assert dist[2.0] < 0.7 * dist[0.0], dist
