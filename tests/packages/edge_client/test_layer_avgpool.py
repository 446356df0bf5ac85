"""The average-pool layer kind (firmware_models/layers/avgpool2d.py,
edge_client/intnn/layers/avgpool2d.py): its spec and model-file form, the integer
engine's forward and training step bit for bit against a plain-numpy reference, the float
reference of the integer forward, and both ONNX exports against the engine."""

from __future__ import annotations

import numpy as np
import pytest
from test_intnn_reference import (
    nchw,
    ref_conv,
    ref_conv_back_data,
    ref_conv_wgrad,
    ref_finish,
    ref_quantize_error,
    ref_stream_key,
    ref_ternary,
    ref_update,
    to_kernel_layout,
)

import edge_client.intnn.allocation as W
from edge_client.intnn import IntModel, act_max, alpha_shifts, grid_scale, init_shared, weight_max
from edge_client.intnn.layers import avgpool2d as engine_avgpool
from edge_client.intnn.liveness import liveness
from firmware_models import Conv2d, Flatten, Linear, ModelSpec, ReLU, SpecError
from firmware_models.files import spec_from_table
from firmware_models.layers import AvgPool2d


def spec_a() -> ModelSpec:
    """conv + ReLU, a 2x2 mean that drops the odd last row and column (9 -> 4), linear."""
    return ModelSpec("avg_a", (3, 9, 9), (
        Conv2d("conv1", 3, 8, 3, padding=1), ReLU("relu1"), AvgPool2d("avg1", 2),
        Flatten("flatten"), Linear("fc1", 128, 10)), 10)


def spec_b() -> ModelSpec:
    """A mean of signed values (no ReLU before it), a ReLU after it, a global mean."""
    return ModelSpec("avg_b", (1, 12, 12), (
        Conv2d("conv1", 1, 4, 3, padding=1), AvgPool2d("avg1", 3), ReLU("relu1"),
        Conv2d("conv2", 4, 8, 3, padding=1), ReLU("relu2"), AvgPool2d("gap", 4),
        Flatten("flatten"), Linear("fc1", 8, 10)), 10)


def ref_avgpool(a: np.ndarray, k: int) -> np.ndarray:
    """NCHW integers: the window sums, rounded half away from zero after dividing by k*k."""
    n, c, h, w = a.shape
    ho, wo = h // k, w // k
    v = a[:, :, :ho * k, :wo * k].astype(np.int64).reshape(n, c, ho, k, wo, k).sum(axis=(3, 5))
    return np.sign(v) * ((np.abs(v) + k * k // 2) // (k * k))


def ref_avgpool_back(e: np.ndarray, k: int, in_shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(in_shape, np.int64)
    ho, wo = e.shape[2], e.shape[3]
    out[:, :, :ho * k, :wo * k] = e.repeat(k, axis=2).repeat(k, axis=3)
    return out


def ref_step(spec: ModelSpec, bits: int, weights: list[np.ndarray], x: np.ndarray,
             y: np.ndarray, lr_log2: int, seed: int, step: int) -> dict:
    """One SSE training step in NCHW of a spec made of conv, linear, ReLU, flatten and
    average pools (test_intnn_reference's formulas, plus the pool's)."""
    amax, wmax, thr = act_max(bits), weight_max(bits), grid_scale(bits) // 4
    alphas = alpha_shifts(spec)
    tern = [ref_ternary(w.astype(np.int64), thr) for w in weights]
    acts = [x.astype(np.int64)]
    pidx: dict[int, int] = {}
    for i, layer in enumerate(spec.layers):
        a = acts[-1]
        if isinstance(layer, (Conv2d, Linear)):
            p = pidx[i] = len(pidx)
            acc = (ref_conv(a, tern[p], layer.stride, layer.padding) if isinstance(layer, Conv2d)
                   else a @ tern[p].T)
            acts.append(ref_finish(acc, 1 + alphas[p], amax, False))
        elif isinstance(layer, ReLU):
            acts.append(np.maximum(a, 0))
        elif isinstance(layer, AvgPool2d):
            acts.append(ref_avgpool(a, layer.kernel))
        else:
            acts.append(a.reshape(a.shape[0], -1))
    e = acts[-1].copy()
    e[np.arange(len(y)), y] -= amax
    sse = int((e * e).sum())
    new_w = [w.astype(np.int64).copy() for w in weights]
    eqs = {}
    for i in range(len(spec.layers) - 1, min(pidx) - 1, -1):
        layer = spec.layers[i]
        if isinstance(layer, ReLU):
            e = np.where(acts[i + 1] > 0, e, 0)
        elif isinstance(layer, Flatten):
            e = e.reshape(acts[i].shape)
        elif isinstance(layer, AvgPool2d):
            e = ref_avgpool_back(e, layer.kernel, acts[i].shape)
        else:
            p = pidx[i]
            eq = eqs[p] = ref_quantize_error(e, bits)
            perm = None
            if isinstance(layer, Conv2d):
                g = ref_conv_wgrad(eq, acts[i], layer.stride, layer.padding, layer.kernel)
                e = ref_conv_back_data(eq, tern[p], layer.stride, layer.padding, acts[i].shape)
                kind = "conv"
            else:
                g, e, kind = eq.T @ acts[i], eq @ tern[p], "linear"
                if acts[i - 1].ndim == 4:
                    c, h, w = acts[i - 1].shape[1:]
                    perm = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel()
            gk, wk = to_kernel_layout(kind, g, perm), to_kernel_layout(kind, new_w[p], perm)
            upd = ref_update(wk.ravel(), gk.ravel(), lr_log2, wmax,
                             ref_stream_key(seed, step, p, 0)).reshape(wk.shape)
            if kind == "conv":
                new_w[p] = upd.transpose(3, 2, 0, 1)
            elif perm is not None:
                new_w[p] = np.empty_like(upd)
                new_w[p][:, perm] = upd
            else:
                new_w[p] = upd
    return {"sse": sse, "eq": eqs, "weights": new_w}


def test_the_spec_and_a_model_file_describe_an_average_pool() -> None:
    from firmware_models.onnx_export import spec_from_json, spec_to_json

    assert AvgPool2d("p", 2).output_shape((3, 9, 9)) == (3, 4, 4)
    assert AvgPool2d("gap", 7).output_shape((5, 7, 7)) == (5, 1, 1)
    with pytest.raises(SpecError, match="smaller than the window"):
        AvgPool2d("p", 4).output_shape((3, 3, 8))
    with pytest.raises(SpecError, match=r"needs a \[C, H, W\] input"):
        AvgPool2d("p", 2).output_shape((12,))
    for spec in (spec_a(), spec_b()):
        assert spec_from_json(spec_to_json(spec)) == spec
    spec = spec_from_table({"input": [3, 9, 9], "layers": [
        {"type": "conv2d", "out": 8, "kernel": 3, "padding": 1}, {"type": "relu"},
        {"type": "avgpool", "kernel": 2}, {"type": "flatten"}, {"type": "linear", "out": 10}]})
    assert spec.layers[2] == AvgPool2d("avgpool1", 2) and spec.activation_shapes[3] == (8, 4, 4)
    with pytest.raises(SpecError, match="needs 'kernel'"):
        spec_from_table({"input": [3, 9, 9], "layers": [{"type": "avgpool2d"}]})
    with pytest.raises(SpecError, match="unknown key 'stride'"):
        spec_from_table({"input": [3, 9, 9], "layers": [{"type": "avgpool2d", "kernel": 2,
                                                         "stride": 1}]})


@pytest.mark.parametrize("bits", [8, 16])
def test_the_forward_kernel_rounds_the_mean_half_away_from_zero(bits: int) -> None:
    amax = act_max(bits)
    rng = np.random.default_rng(bits)
    for k, h in ((2, 9), (3, 7), (4, 8)):
        a = rng.integers(-amax, amax + 1, (5, h, h, 6)).astype(np.int8 if bits <= 8 else np.int16)
        a[0, :k, :k, 0] = [[1] * k] + [[0] * k] * (k - 1)  # tiny means: 1/k^2 rounds to 0
        a[1, :2, :2, 1] = [[1, 1], [0, 0]] if k == 2 else a[1, :2, :2, 1]  # a tie: 2/4
        a[1, :2, :2, 2] = [[-1, -1], [0, 0]] if k == 2 else a[1, :2, :2, 2]
        out = np.zeros((5, h // k, h // k, 6), a.dtype)
        engine_avgpool.avgpool_forward(a, k, out, 0, 5)
        want = ref_avgpool(a.transpose(0, 3, 1, 2), k).transpose(0, 2, 3, 1)
        np.testing.assert_array_equal(out, want)
        if k == 2:
            assert out[1, 0, 0, 1] == 1 and out[1, 0, 0, 2] == -1  # ties away from zero


@pytest.mark.parametrize("bits,threads", [(8, 1), (6, 2), (16, 1)])
@pytest.mark.parametrize("make", [spec_a, spec_b])
def test_a_training_step_matches_the_numpy_reference(monkeypatch, make, bits: int,
                                                     threads: int) -> None:
    monkeypatch.setattr(W, "SPLIT_MIN_MACS", 0)  # on two threads every layer splits
    spec = make()
    model = IntModel(spec, bits, threads=threads)
    model.load_shared(init_shared(spec, bits))
    rng = np.random.default_rng(bits)
    n = 8
    x = rng.integers(0, model.amax + 1, (n, *spec.input_shape))
    y = rng.integers(0, 10, n).astype(np.int64)
    ref = ref_step(spec, bits, model.int_weights(), x, y, 3, 11, 2)
    ws = model.workspace(n)
    ws.x[:n] = x.transpose(0, 2, 3, 1)
    try:
        assert model.train_step(ws, y, n, 3, 11, 2) == ref["sse"]
        for op in model.param_ops:
            got = model.quantized_error(ws, model.ops.index(op), n)
            np.testing.assert_array_equal(nchw(got) if got.ndim == 4 else got, ref["eq"][op.param])
        for got, want in zip(model.int_weights(), ref["weights"], strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        model.close()
    assert any(np.abs(e).max() > 0 for e in ref["eq"].values())  # errors did flow back
    for kernel in engine_avgpool.KERNELS:  # integer arguments only, as every training kernel
        assert kernel.signatures
        for sig in kernel.signatures:
            assert all(str(t).startswith(("int", "uint", "array(int", "bool")) for t in sig), sig


@pytest.mark.parametrize("bits", [6, 8])
def test_the_float_reference_of_the_integer_forward_is_the_engines(bits: int) -> None:
    import torch

    from edge_client.trainers import TorchTrainer

    rng = np.random.default_rng(bits)
    for spec in (spec_a(), spec_b()):
        w = init_shared(spec, 5)
        x = rng.random((16, *spec.input_shape), dtype=np.float32)
        m = IntModel(spec, bits)
        m.load_shared(w)
        ws = m.workspace(16, train=False)
        ws.x[:] = m.prepare_inputs(x)
        want = m.forward(ws, 16).astype(np.float64)
        tt = TorchTrainer(spec, forward=f"int{bits}")
        tt.load_shared(w)
        with torch.no_grad():
            got = tt.forward(torch.from_numpy(x)).numpy().astype(np.float64) * (1 << (bits - 1))
        assert np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)
        assert [r.units for r in liveness(spec, w, bits)] == [s[0] for s in spec.param_shapes()]


def test_the_onnx_exports_compute_the_engines_forward(onnx_runtime) -> None:
    import onnxruntime as ort
    import torch

    from edge_client.intnn.export import int_model_onnx, shared_onnx
    from edge_client.trainers import TorchTrainer

    def run(proto, x):
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        return ort.InferenceSession(proto.SerializeToString(), so).run(None, {"x": x})[0]

    rng = np.random.default_rng(0)
    for spec in (spec_a(), spec_b()):
        w = init_shared(spec, 3)
        for bits in (6, 8, 16):  # the byte graph, and the int32 one
            m = IntModel(spec, bits)
            m.load_shared(w)
            x = rng.integers(-m.amax, m.amax + 1, (32, *spec.input_shape)).astype(m.adtype)
            ws = m.workspace(32, train=False)
            ws.x[:] = x.transpose(0, 2, 3, 1)
            want = m.forward(ws, 32)
            assert np.unique(want).size > 5
            np.testing.assert_array_equal(run(int_model_onnx(m), x), want)
        xf = rng.random((8, *spec.input_shape), dtype=np.float32)
        tt = TorchTrainer(spec)
        tt.load_shared(w)
        with torch.no_grad():
            want = tt.forward(torch.from_numpy(xf)).numpy()
        assert np.abs(run(shared_onnx(spec, w, 32), xf) - want).max() <= 1e-5
