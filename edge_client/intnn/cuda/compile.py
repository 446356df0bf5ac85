"""The CUDA engine's kernels compiled without running them: :func:`exercise` drives a
model's forward and training steps through every kernel variant a round runs;
under :func:`~edge_client.intnn.cuda.device.compile_only` that compiles each to PTX
(``fedbit-edge doctor`` for this GPU, ``make ptx-check`` for the Jetsons' compute
capabilities and the H100's, no GPU needed)."""

from __future__ import annotations

import numpy as np

from edge_client.intnn.cuda import device as dev


def compile_engine(ccs: tuple[tuple[int, int], ...], model: str = "digits_cnn",
                   bits: tuple[int, ...] = (6, 8, 16)) -> dict[tuple, int]:
    """Compile every kernel a round of ``model`` runs at each of ``bits`` to PTX for each
    compute capability of ``ccs``, without running them; returns ``(kernel, signature,
    cc) -> PTX length``."""
    previous = dev.mode()
    record = dev.compile_only(ccs)
    try:
        exercise(model, bits)
    finally:
        dev.set_mode(previous)
    return dict(record)


def compile_for(bits: int, model: str = "digits_cnn") -> int:
    """The kernels of ``bits``-bit rounds compiled for this machine's GPU; how many."""
    gpu = dev.cuda.get_current_device()
    return len(compile_engine((tuple(gpu.compute_capability),), model, (bits,)))


def exercise(model: str = "digits_cnn", bits: tuple[int, ...] = (6, 8, 16)) -> None:
    """A forward and a training step (with the FedProx term, and each loss) of ``model`` at
    each of ``bits`` on the CUDA engine, and two devices' steps trained together (the
    fleet's gather): with :func:`device.compile_only`, every kernel variant a round runs,
    compiled."""
    from firmware_models import resolve_model

    for spec in (resolve_model(model), _other_kinds()):
        _exercise(spec, bits)


def _other_kinds():
    """The layer kinds digits_cnn lacks: an average pool, a stand-alone ReLU."""
    from firmware_models import Conv2d, Flatten, Linear, ModelSpec, ReLU
    from firmware_models.layers.avgpool2d import AvgPool2d

    return ModelSpec("kinds", (1, 4, 4), (Conv2d("c1", 1, 2, 3, padding=1), AvgPool2d("a1", 2), ReLU("r1"),
                                          Flatten("flat"), Linear("f1", 8, 4)), 4)


def _exercise(spec, bits: tuple[int, ...]) -> None:
    from edge_client.data import Dataset
    from edge_client.intnn import IntModel, init_int
    from edge_client.intnn.cuda.fleet import FleetJob, ResidentData, train_together
    from edge_client.intnn.workspace import Regularizer
    from edge_client.trainers import IntTrainer

    for b in bits:
        for loss in ("sse", "ce"):
            m = IntModel(spec, b, loss=loss, backend="cuda")
            m.load_int(init_int(spec, 0, b))
            ws = m.workspace(2)
            m.forward(ws, 2)
            reg = Regularizer(anchor=[w.copy() for w in m.w], step_g=[np.zeros(s, np.int32) for s in m.internal_shapes],
                              mu_q=1, alpha_q=1, d_shift=1, shift=3)
            for r in (None, reg):
                m.train_step(ws, np.zeros(2, np.int64), 2, 3, 0, 0, r)
            m.close()
        x = np.zeros((4, *spec.input_shape), np.float32)
        data = Dataset(x, np.zeros(4, np.int64))
        trainers = [IntTrainer(spec, b, seed=s) for s in (0, 1)]
        train_together([FleetJob(t, t.plan(data, steps=1, batch=2), np.arange(4)) for t in trainers],
                       ResidentData(x))
