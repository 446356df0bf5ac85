"""ONNX export (issue 14): the integer graph equals the Numba engine's forward bit for bit
in ONNX Runtime, the float graph the float forward within 1e-5; metadata, checker, and the
errors of bad model files and data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.data import load_digits, quantize_images
from edge_client.intnn import IntModel, init_int, init_shared
from edge_client.intnn.export import forward_shifts, int_model_onnx, shared_onnx, ternary_weights
from firmware_models import (
    Conv2d,
    Flatten,
    Linear,
    MaxPool2d,
    ModelSpec,
    ReLU,
    SpecError,
    get_spec,
)
from firmware_models.onnx_graph import (
    QLINEAR_WIDTH_FOLD,
    fold_conv_weights,
    unfold_conv_weights,
    width_fold,
)


@pytest.fixture(scope="module", autouse=True)
def _onnx(onnx_runtime) -> None:
    """Every test here needs onnx and onnxruntime (conftest.onnx_runtime)."""


def session(proto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def engine_logits(model: IntModel, x: np.ndarray) -> np.ndarray:
    """The Numba forward of integer inputs ``x`` (spec layout NCHW / [N, F])."""
    xe = np.ascontiguousarray(x.transpose(0, 2, 3, 1) if x.ndim == 4 else x)
    ws = model.workspace(min(len(x), 128), train=False)
    out = np.empty((len(x), model.spec.num_classes), model.adtype)
    for s in range(0, len(x), ws.capacity):
        n = min(ws.capacity, len(x) - s)
        ws.x[:n] = xe[s:s + n]
        out[s:s + n] = model.forward(ws, n)
    return out


def random_inputs(model: IntModel, n: int, seed: int = 0) -> np.ndarray:
    """n samples of integers in [-amax, amax] (signed too: the engine takes any s-bit input)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-model.amax, model.amax + 1, (n, *model.spec.input_shape)).astype(model.adtype)


CASES = [(name, bits) for name in ("digits_cnn", "fedshift_cnn", "mlp") for bits in (6, 8, 16)]


@pytest.fixture(scope="module")
def exported() -> dict:
    """(spec, bits) -> (IntModel with weights, its ONNX Runtime session); built once."""
    out = {}
    for name, bits in CASES:
        spec = get_spec(name)
        m = IntModel(spec, bits)
        m.load_int(init_int(spec, 7, bits))
        out[name, bits] = (m, session(int_model_onnx(m)))
    return out


@pytest.mark.parametrize("name,bits", CASES)
def test_onnxruntime_integer_logits_equal_the_numba_engine(exported, name: str, bits: int) -> None:
    model, sess = exported[name, bits]
    xs = [random_inputs(model, 1000, seed=bits)]
    if model.spec.input_shape == (1, 8, 8):
        xs.append(quantize_images(load_digits("test").x, bits))  # the digits test split
    for x in xs:
        logits, label = (np.concatenate(a) for a in zip(*(sess.run(None, {"x": x[s:s + 250]})
                                                          for s in range(0, len(x), 250)), strict=True))
        ref = engine_logits(model, x)
        assert logits.dtype == ref.dtype == model.adtype
        np.testing.assert_array_equal(logits, ref)
        np.testing.assert_array_equal(label, np.argmax(ref, axis=1))
        assert np.unique(ref).size > 10  # the comparison is not between constant outputs


def _ternary_layer_model(bits: int) -> tuple[IntModel, np.ndarray]:
    """One 64 -> 64 linear layer: rows 0..31 copy one input, rows 32..63 sum 2..64 inputs
    with alternating signs (large sums: saturation)."""
    spec = ModelSpec("one_linear", (64,), (Linear("fc", 64, 64),), 64)
    t = np.zeros((64, 64), np.int8)
    t[np.arange(32), np.arange(32)] = 1
    for o in range(32, 64):
        k = 2 * (o - 31)
        t[o, :k] = np.where(np.arange(k) % 3 == 2, -1, 1)
    m = IntModel(spec, bits)
    m.load_int([t.astype(m.wdtype) * (m.thr + 1)])
    return m, t


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_rounding_ties_go_away_from_zero_and_sums_saturate(bits: int) -> None:
    """Every input value, ties of both signs, and clipping, against a plain-numpy
    reference of clip(round_half_away(v / 2^k), +-amax)."""
    model, t = _ternary_layer_model(bits)
    (k,) = forward_shifts(model)
    amax = model.amax
    values = np.arange(-amax, amax + 1)
    rng = np.random.default_rng(bits)
    x = np.concatenate([np.resize(values, (len(values) // 64 + 1) * 64).reshape(-1, 64),
                        rng.integers(-amax, amax + 1, (200, 64))]).astype(model.adtype)
    v = x.astype(np.int64) @ t.T.astype(np.int64)
    half = 1 << (k - 1)
    want = np.clip(np.sign(v) * ((np.abs(v) + half) >> k), -amax, amax)
    ties = v % (1 << k) == half
    assert (ties & (v < 0)).any() and (ties & (v > 0)).any()
    assert (np.abs(v) > amax << k).any()  # saturation happens
    logits = session(int_model_onnx(model)).run(["logits"], {"x": x})[0]
    np.testing.assert_array_equal(engine_logits(model, x), want)
    np.testing.assert_array_equal(logits, want)


ODD_SPEC = ModelSpec("odd_orders", (2, 13, 13), (
    Conv2d("conv1", 2, 4, 3, stride=2, padding=1),       # no ReLU: signed activations
    MaxPool2d("pool1", 2),                               # 7x7 -> 3x3: the last row is cropped
    ReLU("relu1"),                                       # a ReLU on its own
    Conv2d("conv2", 4, 6, 3, padding=1),                 # no ReLU again
    MaxPool2d("pool2", 2, padding=1),                    # padded cells among signed values
    MaxPool2d("pool3", 3, stride=1, padding=1),          # overlapping windows
    Flatten("flatten"),
    Linear("fc1", 24, 8), ReLU("relu2"),                 # signed inputs
    Linear("fc2", 8, 5),
), 5)


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_signed_activations_strided_convs_and_a_lone_relu_stay_bit_exact(bits: int) -> None:
    model = IntModel(ODD_SPEC, bits)
    model.load_int(init_int(ODD_SPEC, 3, bits))
    x = random_inputs(model, 300, seed=bits)
    logits = session(int_model_onnx(model)).run(["logits"], {"x": x})[0]
    ref = engine_logits(model, x)
    np.testing.assert_array_equal(logits, ref)
    assert (ref < 0).any() and np.unique(ref).size > 10


@pytest.mark.parametrize("name,channels", [("digits_cnn", 1), ("fedshift_cnn", 3),
                                           ("odd_orders", 2)])
def test_the_first_convs_image_channels_are_padded_to_four_and_read_back(name: str,
                                                                        channels: int) -> None:
    """At Int<=8 the image's channels are padded to 4 with zeros (a Pad on the int8 input)
    and the first conv gets zero weights for them; the weights read back from the graph
    are the engine's, and padding with non-zero weights is not read back as ternary."""
    from onnx import numpy_helper

    from firmware_models.onnx_export import describe, exported_ternary

    spec = ODD_SPEC if name == "odd_orders" else get_spec(name)
    assert spec.input_shape[0] == channels
    m = IntModel(spec, 8)
    m.load_int(init_int(spec, 5, 8))
    graph = int_model_onnx(m)
    assert "Pad" in {n.op_type for n in graph.graph.node}
    inits = {t.name: t for t in graph.graph.initializer}
    w = numpy_helper.to_array(inits["conv1.w"])
    conv1 = spec.layers[0]
    unfolded = unfold_conv_weights(w, conv1.out_channels, conv1.kernel)
    assert (unfolded is not None) == (name == "fedshift_cnn")  # its 30x30 conv is folded
    w = (w if unfolded is None else unfolded).copy()
    assert w.shape[1] == 4 and not w[:, channels:].any()
    np.testing.assert_array_equal(w[:, :channels], ternary_weights(m)[0])
    info = describe(graph)
    for got, want in zip(exported_ternary(graph, info), ternary_weights(m), strict=True):
        np.testing.assert_array_equal(got, want)
    w[:, channels:] = 1  # a weight on a padded channel: not the spec's layer any more
    if unfolded is not None:
        w = fold_conv_weights(w, QLINEAR_WIDTH_FOLD)
    inits["conv1.w"].CopyFrom(numpy_helper.from_array(w, "conv1.w"))
    with pytest.raises(SpecError, match="conv1.w are not ternary"):
        exported_ternary(graph, info)
    # Int16 keeps the spec's channels (its int32 graph has no such padding)
    m16 = IntModel(spec, 16)
    m16.load_int(init_int(spec, 5, 16))
    g16 = int_model_onnx(m16)
    assert {t.name: t for t in g16.graph.initializer}["conv1.w"].dims[1] == channels


FOLD_SPEC = ModelSpec("folded", (3, 17, 17), (
    Conv2d("conv1", 3, 4, 3, padding=1),       # 17x17 out: odd width, a column cropped
    Conv2d("conv2", 4, 6, 5, padding=2),       # signed 4-channel input: padded on the bytes
    ReLU("relu1"),
    MaxPool2d("pool1", 2, padding=1),
    Conv2d("conv3", 6, 4, 3, padding=1),       # 6 channels: read as it is
    ReLU("relu2"),
    Flatten("flatten"),
    Linear("fc1", 324, 7),
), 7)


@pytest.mark.parametrize("bits", [6, 8])
def test_convs_on_one_channel_block_read_their_input_width_folded(bits: int) -> None:
    """A stride-1 conv on 4 (padded) channels with >= 256 output pixels runs on its input
    folded along the width (pairs of columns as 8-channel pixels): same logits as the
    engine for signed inputs, the folded weights in the graph, and read back."""
    from onnx import numpy_helper

    from firmware_models.onnx_export import describe, exported_ternary

    model = IntModel(FOLD_SPEC, bits)
    model.load_int(init_int(FOLD_SPEC, 11, bits))
    graph = int_model_onnx(model)
    x = random_inputs(model, 300, seed=bits)
    logits = session(graph).run(["logits"], {"x": x})[0]
    ref = engine_logits(model, x)
    np.testing.assert_array_equal(logits, ref)
    assert (ref < 0).any() and np.unique(ref).size > 10
    inits = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    convs = {n.output[0].rsplit("_", 1)[0]: n for n in graph.graph.node
             if n.op_type == "QLinearConv"}
    kernels = {k: next(list(a.ints) for a in n.attribute if a.name == "kernel_shape")
               for k, n in convs.items()}
    assert kernels == {"conv1": [3, 2], "conv2": [5, 3], "conv3": [3, 3]}
    assert inits["conv1.w"].shape == (8, 8, 3, 2) and inits["conv2.w"].shape == (12, 8, 5, 3)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("Slice") == 2 and ops.count("Pad") == 2  # odd widths; conv2's pad
    for got, want in zip(exported_ternary(graph, describe(graph)), ternary_weights(model),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_width_fold_of_conv_weights_round_trips_and_rejects_other_arrays() -> None:
    """fold_conv_weights puts t[o, c, ky, kx] at [phase * O + o, j * C + c, ky, X] with
    kx = 2X + j - phase; unfold inverts it and refuses what no fold makes."""
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 4, 5, 7):
        t = rng.integers(-1, 2, (5, 4, k, k)).astype(np.int8)
        a = fold_conv_weights(t, 2)
        taps = (k - 1 + 1) // 2 + 1
        assert a.shape == (10, 8, k, taps)
        for phase, o, j, c, ky, xb in np.ndindex(2, 5, 2, 4, k, taps):
            kx = 2 * xb + j - phase
            want = t[o, c, ky, kx] if 0 <= kx < k else 0
            assert a[phase * 5 + o, j * 4 + c, ky, xb] == want
        np.testing.assert_array_equal(unfold_conv_weights(a, 5, k), t)
        assert unfold_conv_weights(t, 5, k) is None  # not folded
        b = a.copy()
        b[5, 0, 0, 0] ^= 1  # the second phase disagrees with the first
        assert unfold_conv_weights(b, 5, k) is None
    conv = Conv2d("c", 4, 8, 3, padding=1)
    assert width_fold(conv, (4, 16, 16), 4) is not None
    assert width_fold(conv, (4, 15, 15), 4) is None                         # < 256 pixels
    assert width_fold(conv, (4, 16, 16), 8) is None                         # two blocks
    assert width_fold(Conv2d("s", 4, 8, 3, stride=2, padding=1), (4, 40, 40), 4) is None
    fold = width_fold(conv, (4, 17, 17), 4)
    assert fold is not None and (fold.out_w, fold.blocks, fold.width) == (17, 9, 20)
    assert fold.pads == (1, 1, 1, 2)


@settings(max_examples=300, deadline=None)
@given(shape=st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 6),
                       st.integers(1, 6)),
       out_channels=st.integers(1, 6), kernel=st.integers(1, 6), seed=st.integers(0, 2**16),
       fold=st.booleans())
def test_unfolding_any_weight_array_gives_its_fold_or_none(shape, out_channels: int,
                                                            kernel: int, seed: int,
                                                            fold: bool) -> None:
    """Whatever array a model file holds (any shape, any values), unfold_conv_weights
    returns weights whose fold is exactly that array, or None; never raises."""
    rng = np.random.default_rng(seed)
    if fold:  # a real fold, sometimes tampered with
        t = rng.integers(-1, 2, (out_channels, shape[1], kernel, kernel)).astype(np.int16)
        a = fold_conv_weights(t, 2)
        if seed % 3 == 0:
            a.flat[seed % a.size] += 1
    else:
        a = rng.integers(-2, 3, shape).astype(np.int16)
    got = unfold_conv_weights(a, out_channels, kernel)
    if got is not None:
        assert got.shape[0] == out_channels and got.shape[2:] == (kernel, kernel)
        np.testing.assert_array_equal(fold_conv_weights(got, a.shape[0] // out_channels), a)
    elif fold and seed % 3:
        raise AssertionError("an untampered fold was not read back")


@pytest.mark.parametrize("name", ["digits_cnn", "fedshift_cnn", "mlp"])
def test_float_export_matches_the_float_forward(name: str) -> None:
    import torch

    from edge_client.trainers import TorchTrainer

    spec = get_spec(name)
    tr = TorchTrainer(spec, seed=3)
    x = np.random.default_rng(0).random((32, *spec.input_shape), dtype=np.float32)
    with torch.no_grad():
        want = tr.forward(torch.from_numpy(x)).numpy()
    logits, label = session(shared_onnx(spec, tr.to_shared(), 32)).run(None, {"x": x})
    assert logits.dtype == np.float32
    assert np.abs(logits - want).max() <= 1e-5
    np.testing.assert_array_equal(label, np.argmax(logits, axis=1))
    assert np.abs(want).max() > 1e-2  # not a comparison of zeros


def test_every_export_passes_the_checker_and_records_opset_spec_and_bits(tmp_path) -> None:
    import onnx

    from firmware_models.onnx_export import OPSET, describe, save, spec_from_json

    spec = get_spec("digits_cnn")
    w = init_shared(spec, 0)
    for bits in (6, 8, 16, 32):
        path = tmp_path / f"m{bits}.onnx"
        save(shared_onnx(spec, w, bits), path)
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["fedbit.opset"] == str(OPSET)
        assert {o.domain: o.version for o in model.opset_import}[""] == OPSET
        assert meta["fedbit.bits"] == str(bits)
        assert meta["fedbit.variant"] == ("float32" if bits == 32 else f"int{bits}")
        assert spec_from_json(meta["fedbit.spec"]) == spec
        info = describe(model)
        assert (info.spec, info.bits, info.variant) == (spec, bits, meta["fedbit.variant"])
        if bits < 32:
            m = IntModel(spec, bits)
            m.load_shared(w)
            assert list(info.shifts) == forward_shifts(m) and info.amax == m.amax
    ops = {n.op_type for n in onnx.load(str(tmp_path / "m8.onnx")).graph.node}
    assert {"QLinearConv", "QLinearMatMul", "MaxPool", "Clip"} <= ops  # bytes throughout
    ops16 = {n.op_type for n in onnx.load(str(tmp_path / "m16.onnx")).graph.node}
    assert {"ConvInteger", "MatMulInteger", "Max"} <= ops16  # int16: byte halves, int32 sums
    for kind in (ops, ops16):  # integer only
        assert not kind & {"Conv", "MatMul", "QuantizeLinear", "DequantizeLinear"}


def test_export_refuses_weights_and_shifts_that_do_not_fit_the_spec() -> None:
    from firmware_models.onnx_export import export_float, export_integer

    spec = get_spec("mlp")
    m = IntModel(spec, 8)
    m.load_int(init_int(spec, 0, 8))
    t, k = ternary_weights(m), forward_shifts(m)
    with pytest.raises(SpecError, match="fc1 weights have shape"):
        export_integer(spec, 8, [t[0][:, :10], t[1]], k, 127)
    with pytest.raises(SpecError, match="not ternary"):
        export_integer(spec, 8, [t[0] * 2, t[1]], k, 127)
    with pytest.raises(SpecError, match="2 parameter layers"):
        export_integer(spec, 8, t, k[:1], 127)
    with pytest.raises(SpecError, match="amax 127 does not match 6 bits"):
        export_integer(spec, 6, t, k, 127)
    with pytest.raises(SpecError, match="not finite"):
        export_float(spec, [np.full(s, np.nan, np.float32) for s in spec.param_shapes()], [0, 0])
