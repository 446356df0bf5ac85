"""The CUDA engine (``edge_client.intnn.cuda``) against the CPU engine, byte for byte:
every kernel of a training step (each layer's activations, each weight layer's quantized
error and gradient, the updated and ternary weights, the loss) at s = 6, 8, 16, on a
model with every layer kind (padded and strided convs, overlapping and padded max-pools,
an average pool, a stand-alone ReLU, a flatten, two linears), both losses, the FedProx /
FedFOR terms, evaluation through ``IntTrainer``.

The kernels run under Numba's CUDA simulator here (tests/conftest.py sets
``NUMBA_ENABLE_CUDASIM=1``; ``make gpu-check`` runs this file on a GPU): tiny shapes, few
samples, since the simulator runs every GPU thread as a Python thread.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.data import Dataset
from edge_client.errors import ConfigError
from edge_client.intnn import IntModel, init_int
from edge_client.intnn.cuda import device as dev
from edge_client.trainers import IntTrainer
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU
from firmware_models.layers.avgpool2d import AvgPool2d

# the simulator computes SplitMix64's wrapping products with numpy scalars, which warn
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def every_kind() -> ModelSpec:
    """Padded conv + fused ReLU, overlapping padded max-pool, strided conv, padded
    max-pool, stand-alone ReLU, flatten, two linears (the last without ReLU)."""
    return ModelSpec("kinds", (2, 6, 6), (
        Conv2d("c1", 2, 4, 3, padding=1), ReLU("r1"), MaxPool2d("p1", 3, 2, 1),
        Conv2d("c2", 4, 3, 3, stride=2, padding=1), MaxPool2d("p2", 2, padding=1),
        ReLU("r2"), Flatten("flat"), Linear("f1", 12, 6), ReLU("r3"), Linear("f2", 6, 5),
    ), 5)


def with_avgpool() -> ModelSpec:
    """A conv whose fused ReLU feeds an average pool, then a linear."""
    return ModelSpec("avg", (1, 4, 4), (
        Conv2d("c1", 1, 3, 3, padding=1), ReLU("r1"), AvgPool2d("a1", 2),
        Flatten("flat"), Linear("f1", 12, 4),
    ), 4)


def pair(spec: ModelSpec, bits: int, loss: str = "sse") -> tuple[IntModel, IntModel]:
    cpu = IntModel(spec, bits, loss=loss)
    gpu = IntModel(spec, bits, loss=loss, backend="cuda")
    w = init_int(spec, 3, bits)
    cpu.load_int(w)
    gpu.load_int(w)
    return cpu, gpu


def batch(spec: ModelSpec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.random((n, *spec.input_shape), dtype=np.float32),
            rng.integers(0, spec.num_classes, n).astype(np.int64))


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_every_kernel_of_a_training_step_matches_the_cpu_engine(bits: int) -> None:
    spec = every_kind()
    cpu, gpu = pair(spec, bits)
    x, y = batch(spec, 3, bits)
    wc, wg = cpu.workspace(3), gpu.workspace(3)
    wc.x[:3] = wg.x[:3] = cpu.prepare_inputs(x)
    # the second step: a short batch, another step counter (stream keys)
    for n, step in ((3, 0), (2, 5)):
        loss_c = cpu.train_step(wc, y, n, 3, 11, step)
        loss_g = gpu.train_step(wg, y, n, 3, 11, step)
        assert loss_g == loss_c
        st = wg.stack
        for i, op in enumerate(cpu.ops):
            got = dev.to_host(st.acts[i])[0, :n]
            assert np.array_equal(got, wc.acts[i][:n]), f"activations of op {i} ({op.layer.name})"
            if op.param >= 0:
                assert np.array_equal(gpu.quantized_error(wg, i, n), cpu.quantized_error(wc, i, n)), \
                    f"quantized error of {op.layer.name}"
                assert np.array_equal(dev.to_host(st.grads[op.param])[0], wc.grads[op.param]), \
                    f"gradient of {op.layer.name}"
        for a, b in zip(gpu.int_weights(), cpu.int_weights(), strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        for a, b in zip(gpu.ternary_weights(), cpu.ternary_weights(), strict=True):
            assert a.tobytes() == b.tobytes()
    assert any(np.abs(dev.to_host(st.grads[p])).max() > 0 for p in range(4))
    # the forward alone (evaluation buffers) after the updates
    assert np.array_equal(gpu.forward(gpu.workspace(3, train=False), 3),
                          cpu.forward(cpu.workspace(3, train=False), 3))


def test_softmax_loss_average_pool_and_fedprox_fedfor_through_the_trainer() -> None:
    """IntTrainer on either engine: the integer softmax loss, an average pool, the FedProx
    and FedFOR terms on their own stream, a short last batch; the same weights, reports
    and evaluation."""
    spec = with_avgpool()
    x, y = batch(spec, 5, 1)
    data = Dataset(x, y)
    step = [np.full(s, 1e-3, np.float32) * (1 - 2 * (i % 2)) for i, s in enumerate(spec.param_shapes())]
    reports = []
    for backend in ("cpu", "cuda"):
        model = IntModel(spec, 8, loss="ce", backend=backend)
        model.load_int(init_int(spec, 4, 8))
        tr = IntTrainer(model, 8, seed=9)
        rep = tr.train(data, steps=3, batch=4, prox_mu=0.5, fedfor_alpha=0.5, last_global_step=step,
                       lr=0.1, momentum=0.5)
        reports.append((rep.steps, rep.samples, rep.loss, tr.int_weights(), tr.evaluate(data)))
    (s1, n1, l1, w1, e1), (s2, n2, l2, w2, e2) = reports
    assert (s1, n1, l1, e1) == (s2, n2, l2, e2)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w1, w2, strict=True))


def test_weights_move_between_host_and_gpu_only_when_changed() -> None:
    """After a step the model's arrays are the GPU's (read through ``IntModel.w``); a
    ``load_int`` after it wins over the GPU's copy."""
    spec = with_avgpool()
    _, gpu = pair(spec, 8)
    x, y = batch(spec, 2, 2)
    ws = gpu.workspace(2)
    ws.x[:2] = gpu.prepare_inputs(x)
    before = [w.copy() for w in gpu.w]
    gpu.train_step(ws, y, 2, 3, 1, 0)
    assert all(op.current == "device" for op in gpu.param_ops)
    after = [w.copy() for w in gpu.w]  # synced from the GPU
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(op.current == "both" for op in gpu.param_ops)
    fresh = init_int(spec, 8, 8)
    gpu.load_int(fresh)
    assert all(op.current == "host" for op in gpu.param_ops)
    z1 = gpu.forward(ws, 2).copy()
    ref = IntModel(spec, 8)
    ref.load_int(fresh)
    wr = ref.workspace(2)
    wr.x[:2] = ws.x[:2]
    assert np.array_equal(z1, ref.forward(wr, 2))


def test_an_unknown_engine_and_a_bad_batch_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown engine backend 'tpu'"):
        IntModel(with_avgpool(), 8, backend="tpu")
    _, gpu = pair(with_avgpool(), 8)
    with pytest.raises(ValueError, match="batch of 3 samples for a workspace of 2"):
        gpu.forward(gpu.workspace(2), 3)
