"""The slice dequantizer (``dequantize.block = "slices"``, ProWD's convolutional blocks over
conv slices): the planes, identity at initialization, the anchored form's compiled tables
against the network, learning on real digits weights, the stage (gates, per-round tables,
integer pairs, checkpoint). Tiny configurations: seconds in all."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.strategies import ClientUpdate
from coordinator.strategies.prowd_dequantizer import DequantizerConfig, ProwdDequantizer
from coordinator.strategies.prowd_dequantizer.ladder import quantize
from coordinator.strategies.prowd_dequantizer.slices import (
    SliceLayout,
    apply_table,
    build_slice_net,
    compile_tables,
    flat_inputs,
)
from coordinator.strategies.prowd_dequantizer.slicetrain import Pair, heldout_l1, train_slices
from edge_client.data import load_digits
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared
from edge_client.trainers import TorchTrainer
from firmware_models import MODELS, get_spec

torch = pytest.importorskip("torch")

DIGITS = get_spec("digits_cnn")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def round_weights() -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """A global digits_cnn model (2 local epochs) and four float32 devices' weights after
    one local epoch from it on their own shards, as in a federated round."""
    train = load_digits("train")
    shards = [train.subset(np.arange(k, len(train), 5)) for k in range(5)]
    t = TorchTrainer(DIGITS, seed=0)
    t.train(shards[0], epochs=2, batch=32)
    glob = t.to_shared()
    devices = []
    for k in (1, 2, 3, 4):
        d = TorchTrainer(DIGITS, seed=k, lr=0.1)
        d.load_shared(glob)
        d.train(shards[k], epochs=1, batch=32)
        devices.append(d.to_shared())
    return glob, devices


def _cfg(**kw) -> DequantizerConfig:
    return DequantizerConfig.from_params(**({"block": "slices", "ladder": (2, 4, 32), "lam": 0.0,
                                             "background": False, "growth": 4} | kw))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_planes_round_trip_for_every_model_spec(name: str) -> None:
    spec = get_spec(name)
    layout = SliceLayout(spec.param_shapes(), flat_inputs(spec))
    for i, w in enumerate(init_shared(spec, 1)):
        planes = layout.cut(i, w.reshape(-1))
        assert planes.shape == layout.planes[i]
        np.testing.assert_array_equal(layout.paste(i, planes).reshape(w.shape), w)


def test_conv_slices_tile_kernels_and_dense_layers_read_feature_maps() -> None:
    """The paper's module: a [64·a, 64, 3, 3] conv is 64·a planes of 24x24, 8x8 tiles whose
    tile (r, c) is kernel (o, 8r + c); a linear layer after a Flatten of (c, h, w) is O·c
    planes [h, w]; another linear layer is one plane."""
    layout = SliceLayout([(128, 64, 3, 3), (10, 7)])
    w = np.arange(128 * 64 * 9, dtype=np.float32)
    planes = layout.cut(0, w)
    assert layout.planes[0] == (128, 24, 24) and layout.planes[1] == (1, 10, 7)
    kernel = w.reshape(128, 64, 3, 3)
    np.testing.assert_array_equal(planes[5, 3 * 2:3 * 3, 3 * 7:3 * 8], kernel[5, 8 * 2 + 7])
    digits = SliceLayout(DIGITS.param_shapes(), flat_inputs(DIGITS))
    assert digits.planes == [(16, 3, 3), (32, 12, 12), (64 * 32, 2, 2), (1, 10, 64)]


@pytest.mark.parametrize("context", ["update", "global"])
def test_a_fresh_network_is_the_identity(context, round_weights) -> None:
    glob, devices = round_weights
    cfg = _cfg(context=context)
    net = build_slice_net(cfg, 3)
    layout = SliceLayout(DIGITS.param_shapes(), flat_inputs(DIGITS))
    for i, w in enumerate(devices[0]):
        x = torch.from_numpy(layout.cut(i, quantize(w, 2)))
        g = torch.from_numpy(layout.cut(i, glob[i]))
        with torch.inference_mode():
            assert torch.equal(net.eval()(x, g if context == "global" else None), x)


def test_compiled_tables_are_the_network(round_weights) -> None:
    """For the round's global model, looking a received layer up in the compiled table
    gives what the anchored network computes on its planes (ternary and 4-bit entries)."""
    glob, devices = round_weights
    cfg = _cfg(context="global")
    net = build_slice_net(cfg, 0)
    with torch.no_grad():  # a network that is not the identity
        for p in net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    net.eval()
    layout = SliceLayout(DIGITS.param_shapes(), flat_inputs(DIGITS))
    tables = compile_tables(net, layout, glob, [2, 4])
    for bits in (2, 4):
        for i, w in enumerate(devices[1]):
            x = quantize(w, bits).reshape(-1)
            got = apply_table(x, tables[bits][i], bits, 0.5)
            with torch.inference_mode():
                want = net(torch.from_numpy(layout.cut(i, x)), torch.from_numpy(layout.cut(i, glob[i])),
                           cfg.ladder.index(bits)).numpy()
            np.testing.assert_allclose(got, layout.paste(i, want), atol=1e-6)
            assert not np.array_equal(got, x)
    assert apply_table(np.array([0.3, 0.0], np.float32), tables[2][0][:, :2], 2, 0.5) is None  # off the grid


def test_anchored_blocks_learn_a_devices_weights_from_its_ternary_uplink(round_weights) -> None:
    """Trained on two devices' (weights, global) pairs, the anchored network's held-out
    L1 on the other two devices' ternary and 4-bit inputs is below 0.8x plain
    dequantization's; the unanchored one (the paper's: the received weights only) stays
    near 1."""
    glob, devices = round_weights
    layout = SliceLayout(DIGITS.param_shapes(), flat_inputs(DIGITS))
    train = [Pair(w, glob) for w in devices[:2]]
    held = [Pair(w, glob) for w in devices[2:]]
    ratios = {}
    for context in ("global", "update"):
        cfg = _cfg(context=context, optimizer="adam", lr=1e-2, epochs=3)
        net = build_slice_net(cfg, 0)
        train_slices(net, cfg, layout, train, None, seed=1)
        h = heldout_l1(net, layout, held)
        for bits in (2, 4):
            plain = sum(h[(i, bits)][0] * n for i, n in enumerate(layout.sizes))
            ratios[context, bits] = sum(h[(i, bits)][1] * n for i, n in enumerate(layout.sizes)) / plain
    assert ratios["global", 2] < 0.8 and ratios["global", 4] < 0.8, ratios
    assert ratios["update", 2] > 0.85, ratios


def test_the_stage_compiles_the_round_and_gates_per_layer(round_weights, tmp_path) -> None:
    """Two rounds through the stage: the first trains a version (its float32 devices
    paired with the global), the second compiles that version's tables when it opens and
    dequantizes a ternary update by lookup where the gate is on, passing the other layers
    through; the stats name every layer's ratio and gate; a checkpoint restores a version
    that dequantizes bit for bit the same."""
    glob, devices = round_weights
    params = dict(block="slices", context="global", ladder=(2, 4, 32), lam=0.0, background=False,
                  growth=4, optimizer="adam", lr=3e-3, epochs=2)
    deq = ProwdDequantizer(model="digits_cnn", **params)
    deq.begin_round(1, glob)
    for k, w in enumerate(devices):
        deq.observe(ClientUpdate(f"f{k}", 10, w, "weights", 32))
    tern = [quantize(w, 2) for w in devices[0]]
    up = ClientUpdate("i0", 10, tern, "weights", 8, True)
    deq.observe(up)
    assert deq(up) is up  # no version yet: plain
    st = deq.end_round()
    assert st["dequantizer_fallback"] == 1 and deq.version is not None
    v = deq.version
    gates = {i: v.is_on(i, 2) for i in range(4)}
    assert any(gates.values())
    deq.begin_round(2, glob)
    out = deq(up)
    for i, (a, b) in enumerate(zip(out.weights, tern, strict=True)):
        assert a.shape == b.shape and np.all(np.isfinite(a))
        assert np.array_equal(a, b) != gates[i]
    st = deq.end_round()
    for i in range(4):
        assert st[f"dequantizer_on/{i}/int2"] == int(gates[i]) and f"dequantizer_l1_ratio/{i}/int2" in st
    assert st["dequantizer_updates"] == 1 and st["dequantizer_wait_s"] >= 0.0
    again = ProwdDequantizer(model="digits_cnn", **params)
    again.load_state_dict(deq.state_dict())
    again.begin_round(3, glob)
    for a, b in zip(again(up).weights, out.weights, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError, match="made with"):
        ProwdDequantizer(model="digits_cnn", **(params | {"context": "update"})).load_state_dict(deq.state_dict())


def test_integer_pairs_train_the_unanchored_form_only(round_weights) -> None:
    """An integer device's received weights are kept (against its round's global) for the
    paper's unanchored form and trained on; the anchored form, which reads the global,
    does not keep them."""
    glob, devices = round_weights
    for context, kept in (("update", 1), ("global", 0)):
        deq = ProwdDequantizer(block="slices", context=context, ladder=(2, 32), lam=0.0, background=False, growth=4)
        deq.begin_round(1, glob)
        deq.observe(ClientUpdate("i", 10, [quantize(w, 2) for w in devices[0]], "weights", 8, True))
        assert len(deq._round.ints) == kept
    cfg = _cfg(context="update", epochs=1)
    net = build_slice_net(cfg, 0)
    layout = SliceLayout(DIGITS.param_shapes(), flat_inputs(DIGITS))
    pair = Pair(glob, glob, [quantize(w, 2) for w in devices[0]], (2, 2, 2, 2))
    st = train_slices(net, cfg, layout, [pair], None, seed=0)
    assert st.steps > 0 and st.recon > 0


def test_slice_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="context"):
        DequantizerConfig.from_params(block="slices", context="neighbours")
    with pytest.raises(ConfigError, match="slices"):
        DequantizerConfig.from_params(context="global")
    with pytest.raises(ConfigError, match="table_levels"):
        DequantizerConfig.from_params(block="slices", table_levels=2)
    cfg = DequantizerConfig.from_params(block="slices", kernel=3, ladder="paper", context="global")
    assert cfg.slices and cfg.network_key()["context"] == "global"
