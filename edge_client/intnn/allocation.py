"""The integer buffers of an :class:`~edge_client.intnn.model.IntModel` pass on the CPU
backend (:class:`~edge_client.intnn.workspace.Workspace`), sized for a batch capacity: each
layer says which it needs (``IntLayer.buffers``), this module adds what every layer has
(outputs, input errors, quantized errors, weight gradients) and decides which layers split
over the threads. Allocated once per capacity and reused by every step
(``IntModel.workspace``); nothing is allocated per step. Buffers a kernel writes from
several threads at once (disjoint parts) are shared; scratch is per thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_client.intnn.layers.base import IntLayer, Numerics
from edge_client.intnn.workspace import Scratch, Workspace, internal_shape
from firmware_models import ModelSpec

# a layer's kernels are split over the threads when its forward does at least this many
# multiply-accumulates per batch (a split costs a few microseconds of hand-off, more of
# the parts' fixed work)
SPLIT_MIN_MACS = 1 << 20


class _PerOp:
    """Per-layer buffer lists being filled (one entry per layer, None where unused)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.lists: dict[str, list[np.ndarray | None]] = {name: [] for name in names}

    def add(self, arrays: dict[str, np.ndarray | None]) -> None:
        unknown = set(arrays) - set(self.names)
        if unknown:  # pragma: no cover - a layer naming a buffer Workspace does not have
            raise KeyError(sorted(unknown))
        for name in self.names:
            self.lists[name].append(arrays.get(name))


SHARED = ("acts", "win", "eq", "eqp", "err_in", "patch", "a_t", "gacc", "col_t", "e_t",
          "plane", "a_pad", "gt")
PER_THREAD = ("pacc", "pacc16", "ptile", "vacc", "offs", "pbuf", "lacc", "lacc16", "lep")


def build_workspace(model: Numerics, spec: ModelSpec, ops: Sequence[IntLayer], threads: int,
                    capacity: int, train: bool) -> Workspace:
    """Buffers for batches of up to ``capacity`` samples (training or forward-only) of the
    layers ``ops`` of ``spec`` run on ``threads`` threads."""
    for op in ops:
        op.check(model)
    n = capacity
    ad = model.adtype
    x = np.zeros((n, *internal_shape(spec.input_shape)), ad)
    shared = _PerOp(SHARED)
    per_thread = [_PerOp(PER_THREAD) for _ in range(threads)]
    prev = x
    g32 = g64 = 0
    grad_at: dict[int, tuple[bool, int, tuple[int, ...]]] = {}  # param -> (int64, offset, shape)
    nz = n + 4
    for i, op in enumerate(ops):
        out = prev.reshape(n, *op.out_shape) if op.view else np.zeros((n, *op.out_shape), ad)
        if op.split_like_input:
            op.split = threads > 1 and i > 0 and ops[i - 1].split
        else:
            op.split = threads > 1 and op.macs() * n >= SPLIT_MIN_MACS
        arrays, scratch, op_nz = op.buffers(model, n, train)
        arrays["acts"] = out
        nz = max(nz, op_nz)
        if train and op.needs_input_error and op.has_input_error():
            arrays["err_in"] = np.zeros((n, *op.in_shape), np.int32)
        if train and op.param >= 0:
            if op.keeps_eq(ops[i + 1] if i + 1 < len(ops) else None):
                arrays["eq"] = np.zeros((n, *op.out_shape), ad)
            shape = op.weight_shape
            op.grad_int64 = op.needs_int64_grad(model, n)
            grad_at[op.param] = (op.grad_int64, g64 if op.grad_int64 else g32, shape)
            if op.grad_int64:
                g64 += int(np.prod(shape))
            else:
                g32 += int(np.prod(shape))
        shared.add(arrays)
        for t, lists in enumerate(per_thread):
            # thread 0's scratch always; the others' (copies) only where the layer is split
            if t == 0:
                lists.add(scratch)
            else:
                lists.add({k: (None if v is None else v.copy()) for k, v in scratch.items()}
                          if op.split else {})
        prev = out
    # untouched pages cost no memory: a layer whose update makes its gradient again
    # (kernels.linear_update_vnni) leaves its region unmapped
    grad32, grad64 = np.zeros(g32, np.int32), np.zeros(g64, np.int64)
    grads = [(grad64 if wide else grad32)[at:at + int(np.prod(shape))].reshape(shape)
             for p, (wide, at, shape) in sorted(grad_at.items())]
    sizes = [int(np.prod(op.weight_shape)) for op in ops if op.param >= 0]
    extra = np.zeros(sum(sizes) if train else 0, np.int64)
    starts = np.cumsum([0, *sizes])
    extras = [extra[starts[p]:starts[p + 1]] for p in range(len(sizes))] if train else []
    return Workspace(
        capacity=n, x=x, err_out=np.zeros((n, spec.num_classes), np.int32) if train else
        np.zeros((0, 0), np.int32),
        scratch=[Scratch(nz_idx=np.zeros(nz, np.int32), nz_val=np.zeros(nz, np.int32),
                         **lists.lists) for lists in per_thread],
        grad32=grad32, grad64=grad64, extra=extra, grads=grads, extras=extras, train=train,
        **shared.lists,
    )
