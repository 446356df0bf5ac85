"""An integer device's ``ternary`` uplink carries its own ternary forward weights, and the
coordinator decodes them to the shared-domain weights the device computes with
(``intnn.TERNARY_WEIGHT``: ``t = +1`` stands for W = 0.5)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator.ingest import Ingest
from coordinator.strategies.decode import decode_update
from coordinator.variants import model_messages
from edge_client.codecs import decode, encode
from edge_client.data import digits_shard, load_digits
from edge_client.errors import CodecError
from edge_client.intnn import TERNARY_WEIGHT, IntModel, alpha_shifts, init_shared
from edge_client.protocol import Limits, RoundAnnouncement, decode_message, model_variant
from edge_client.runtime import DeviceConfig, DeviceRuntime
from firmware_models import Flatten, Linear, ModelSpec, get_spec


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_ternary_weight_value_is_what_the_integer_forward_computes(bits: int) -> None:
    """A one-layer network: the integer forward with ternary weights t equals the float
    forward (docs/algorithms.md §2: ``x @ W.T / alpha``) with W = TERNARY_WEIGHT * t to within
    one activation step; W = t (a factor 2 off) does not."""
    spec = ModelSpec("lin", (1, 8, 8), (Flatten("flat"), Linear("fc", 64, 10)), 10)
    model = IntModel(spec, bits)
    model.load_shared(init_shared(spec, 3))
    t = model.ternary_weights()[0]
    assert set(np.unique(t)) <= {-1, 0, 1} and np.count_nonzero(t) > 100
    x = load_digits("test").x[:64]
    ws = model.workspace(64, train=False)
    ws.x[:] = model.prepare_inputs(x)
    s = float(1 << (bits - 1))
    z_int = model.forward(ws, 64).astype(np.float64) / s
    a = np.rint(x.reshape(64, -1).astype(np.float64) * (s - 1)) / s  # the same s-bit inputs
    alpha = float(1 << alpha_shifts(spec)[0])
    inside = np.abs(z_int) < (s - 1) / s
    assert inside.mean() > 0.5 and np.abs(z_int[inside]).mean() > 8 / s
    z_half = a @ (TERNARY_WEIGHT * t.astype(np.float64)).T / alpha
    assert np.abs(z_half - z_int)[inside].max() <= 1.0 / s + 1e-12
    z_one = a @ t.astype(np.float64).T / alpha
    assert np.abs(z_one - z_int)[inside].max() > 8.0 / s


def test_int8_ternary_codes_decode_at_the_ternary_weight_value() -> None:
    """A bare int8 ternary tensor of an integer device (no scale in aux) is mapped to
    ``t * TERNARY_WEIGHT``, not to grid integers ``t / 2^(s_g-1)``; with ``scale`` the
    codes go in the float form and decode to ``scale * t``."""
    from coordinator.strategies import EncodedUpdate

    t = np.array([[1, 0, -1, 1]], np.int8)
    for bits in (6, 8, 16):
        eu = EncodedUpdate("d", 1, (encode(t, "ternary"),), "weights", bits, False)
        np.testing.assert_array_equal(decode_update(eu).weights[0], TERNARY_WEIGHT * t)
    sent = encode(t, "ternary", scale=0.25)
    assert sent.dtype == "float32" and sent.aux == {"scale": 0.25} and len(sent.data) == 1
    np.testing.assert_array_equal(decode(sent), 0.25 * t)
    with pytest.raises(CodecError, match="threshold"):  # only the scale applies to codes
        encode(t, "ternary", threshold=0.1, scale=0.5)
    with pytest.raises(CodecError, match="scale"):
        encode(t, "ternary", scale=-1.0)


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_integer_device_ternary_update_decodes_to_its_forward_weights(tmp_path, bits: int) -> None:
    """A real device loop round (IntTrainer on ``mlp``, profile codec ``ternary``): the
    payload, checked by the coordinator's ingest and decoded, equals the device's ternary
    forward weights in the shared domain (within one step of the device's storage grid:
    here exactly), for Int6, Int8 and Int16."""
    spec = get_spec("mlp")
    variant = model_variant(bits, "int")
    cfg = DeviceConfig("dev", bits, "int", "ternary", 2, workdir=tmp_path, seed=1)
    rt = DeviceRuntime(cfg, digits_shard(1, 4), connect=lambda **_kw: None)
    payloads = model_messages(1, "mlp", spec.param_names(), {variant}, weights=init_shared(spec, 0),
                              group_weights={}, server_state={}, limits=Limits())
    msg = decode_message(payloads[variant][0])
    ann = RoundAnnouncement(job="default", round_id=1, model="mlp", selected=("dev",),
                            deadline=time.time() + 60, variants={variant: msg.digest},
                            hparams={"epochs": 1, "batch": 32})
    payload = rt.train_round(ann, msg)
    trainer = rt._trainers["mlp"][1]
    update = decode_message(payload)
    assert all(t.codec == "ternary" and t.aux == {"scale": TERNARY_WEIGHT} for t in update.tensors)
    eu = Ingest("mlp", spec.param_shapes(), Limits()).encoded(update)
    got = decode_update(eu).weights
    step = 1.0 / (1 << (max(bits, 8) - 1))
    for g, t, w in zip(got, trainer.ternary_weights(), trainer.to_shared(), strict=True):
        want = TERNARY_WEIGHT * t.astype(np.float32)
        assert np.abs(g - want).max() <= step
        np.testing.assert_array_equal(g, want)
        # they are the device's forward weights: |W| > 0.25 <=> t != 0, sign(t) = sign(W)
        np.testing.assert_array_equal(t != 0, np.abs(w) > 0.25)
        assert np.all(np.sign(t[t != 0]) == np.sign(w[t != 0]))
