"""Many devices' local training at once on one GPU: :func:`train_together` runs the
``IntTrainer.train`` calls of D devices as one stack (:class:`~.stack.Stack`), every
kernel a grid over devices x samples, each device its own weights, batches (its shard of
a data set kept on the GPU, :class:`ResidentData`), step counter and stream keys. Each
trainer ends as if it had trained alone on the CPU, bit for bit (weights, step counter,
report); its ``plan`` drew its batches and its ``finish`` reports.

Devices of one model, bitwidth and loss share a stack; a stack runs as many steps as its
longest plan, a device sitting out (``n = 0``) the steps past its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.compat import zip_strict
from edge_client.data import quantize_images
from edge_client.intnn.cuda import device as dev
from edge_client.intnn.cuda import kernels as KC
from edge_client.intnn.cuda import passes
from edge_client.intnn.cuda.device import DeviceArray
from edge_client.intnn.cuda.stack import DeviceRegularizers, Stack, Weights

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.trainers.common import TrainReport
    from edge_client.trainers.integer import IntTrainer, TrainPlan


class ResidentData:
    """A data set's images on the GPU for a run, quantized once per bitwidth: ``rows(bits)``
    is ``[M, per]`` (s-bit, each sample in the engine's NHWC order). ``x``: float images
    ``[M, C, H, W]`` in [0, 1] or uint8 pixels (``Dataset.x``)."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self._rows: dict[int, DeviceArray] = {}

    def __len__(self) -> int:
        return len(self.x)

    def rows(self, bits: int) -> DeviceArray:
        if bits not in self._rows:
            q = quantize_images(np.asarray(self.x), bits)
            if q.ndim == 4:
                q = q.transpose(0, 2, 3, 1)
            self._rows[bits] = dev.to_device(np.ascontiguousarray(q).reshape(len(q), -1))
        return self._rows[bits]


@dataclass
class FleetJob:
    """One device's ``train`` call: its ``trainer`` (an ``IntTrainer``, weights loaded), the
    ``plan`` it made for the call, and ``rows``: the resident data set's row of each sample
    of the device's data (its shard)."""

    trainer: IntTrainer
    plan: TrainPlan
    rows: np.ndarray


def train_together(jobs: Sequence[FleetJob], data: ResidentData) -> list[TrainReport]:
    """Run every job; returns their ``TrainReport`` s in order (each trainer's weights and
    step counter updated as its ``train`` would have)."""
    reports: list[Any] = [None] * len(jobs)  # every slot filled below
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        m = job.trainer.model
        key = (m.spec, m.bits, m.clip, m.loss, m.ce_temp_shift)
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        for i, rep in zip_strict(idx, _train_group([jobs[i] for i in idx], data)):
            reports[i] = rep
    return reports


def _train_group(jobs: list[FleetJob], data: ResidentData) -> list[TrainReport]:
    from edge_client.intnn.model import IntModel

    t0 = time.perf_counter()
    first = jobs[0].trainer.model
    model = IntModel(first.spec, first.bits, first.clip, loss=first.loss,
                     ce_temp_shift=first.ce_temp_shift, backend="cuda")
    d = len(jobs)
    plans = [job.plan for job in jobs]
    cap = max(p.capacity for p in plans)
    steps = max(len(p.batches) for p in plans)
    idx = np.zeros((max(steps, 1), d, cap), np.int64)
    ys = np.zeros((max(steps, 1), d, cap), np.int64)
    ns = np.zeros((max(steps, 1), d), np.int32)
    step = np.zeros((max(steps, 1), d), np.int64)
    for j, (job, plan) in enumerate(zip_strict(jobs, plans)):
        for k, b in enumerate(plan.batches):
            idx[k, j, :len(b)] = job.rows[b]
            ys[k, j, :len(b)] = plan.y[b]
            ns[k, j] = len(b)
        step[:, j] = plan.step0 + np.arange(max(steps, 1))
    samples = ns.sum(axis=0)
    st = Stack(model, d, cap, train=True)
    wts = Weights(model, d)
    for p in range(len(model.param_ops)):
        wts.upload(p, np.stack([job.trainer.model.w[p] for job in jobs]),
                   np.stack([job.trainer.model.t[p] for job in jobs]))
    regs = DeviceRegularizers(model, [p.reg for p in plans])
    g_idx, g_y, g_n, g_step = (dev.to_device(a) for a in (idx, ys, ns, step))
    lr = dev.to_device(np.array([p.lr_log2 for p in plans], np.int32))
    seed = dev.to_device(np.array([job.trainer.seed for job in jobs], np.int64))
    src = data.rows(model.bits)
    x2 = st.x.reshape(d, cap * src.shape[1])
    for k in range(steps):
        n = g_n[k]
        dev.launch(KC.gather, cap * src.shape[1], d, src, g_idx[k], n, x2)
        passes.train_step(model, st, wts, passes.StepValues(n, g_y[k], lr, seed, g_step[k]), regs)
    losses = dev.to_host(st.loss)
    trained = [wts.download(p)[0] for p in range(len(model.param_ops))]
    reports = []
    for j, (job, plan) in enumerate(zip_strict(jobs, plans)):
        m = job.trainer.model
        m.load_int([op.to_spec(w[j]) for op, w in zip_strict(m.param_ops, trained)])
        reports.append(job.trainer.finish(plan, int(losses[j]), int(samples[j]), t0))
    return reports
