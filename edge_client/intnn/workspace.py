"""The integer buffers of an :class:`~edge_client.intnn.model.IntModel` pass
(:class:`~edge_client.intnn.ops.Workspace`), sized for a batch capacity, and the choice
of each conv's weight-gradient kernel. Allocated once per capacity and reused by every
step (``IntModel.workspace``); nothing is allocated per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn.ops import Op, Workspace, internal_shape, plane_len

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel

INT32_LIMIT = (1 << 31) - 1
INT16_LIMIT = (1 << 15) - 1
GROUP_PIXELS = 4096  # output pixels per im2col group when evaluating (memory bound)
PIXEL_BLOCK = 2048   # output pixels accumulated at a time by the conv forward (L1-sized)
PLANE_BLOCK = 1024   # plane positions accumulated at a time by the stride-1 conv forward
PLANE_GRAD_GROUP = 8  # samples per copy of plane runs in the dot-product conv gradient
# conv weight gradient from the non-zero errors when a patch row (K*C values) is at least
# this long (short rows do not vectorize: the dense dot products are faster there)
SPARSE_GRAD_MIN_ROW = 32
MAX_POOL_KERNEL = 11  # pool winners are int8 cell numbers kh * k + kw


def grad_needs_int64(model: IntModel, op: Op, batch: int) -> bool:
    """True when a sum of batch*pixels products of s-bit errors and activations may
    exceed int32."""
    pixels = int(np.prod(op.out_shape[:-1])) if op.kind == "conv" else 1
    return model.amax * model.amax * batch * pixels > INT32_LIMIT


def grad_mode(model: IntModel, op: Op, batch: int) -> str:
    """Which kernel computes this conv's weight gradient for ``batch`` samples."""
    if grad_needs_int64(model, op, batch):
        return "int64"
    if op.layer.kernel * op.layer.in_channels >= SPARSE_GRAD_MIN_ROW:
        return "sparse"
    if op.plane and model.conv_impl == "col":
        return "plane"
    return "dot"


def check_bounds(model: IntModel) -> None:
    """int32 forward/backward accumulators must not overflow for this spec and s."""
    for op in model.param_ops:
        fan_in = op.layer.fan_in
        if fan_in * model.amax > INT32_LIMIT:
            raise ConfigError(f"{op.layer.name}: fan-in {fan_in} overflows int32 at "
                              f"{model.bits} bits")
        fan_out = (op.layer.out_channels * op.layer.kernel ** 2 if op.kind == "conv"
                   else op.layer.out_features)
        if fan_out * model.amax * 4 > INT32_LIMIT:
            raise ConfigError(f"{op.layer.name}: fan-out {fan_out} overflows int32 at "
                              f"{model.bits} bits")
    for op in model.ops:
        if op.kind == "pool" and op.layer.kernel > MAX_POOL_KERNEL:
            raise ConfigError(f"{op.layer.name}: pool kernel {op.layer.kernel} > "
                              f"{MAX_POOL_KERNEL}")


class _Buffers:
    """Per-op buffer lists being filled (one entry per op, None where unused)."""

    NAMES = ("acts", "win", "eq", "err_in", "patch", "lacc", "lacc16", "a_t", "pbuf", "gacc",
             "col_t", "e_t", "pacc", "pacc16", "ptile", "plane", "offs", "a_pad", "gt")

    def __init__(self) -> None:
        for name in self.NAMES:
            setattr(self, name, [])

    def add(self, **arrays: np.ndarray | None) -> None:
        unknown = set(arrays) - set(self.NAMES)
        assert not unknown, unknown
        for name in self.NAMES:
            getattr(self, name).append(arrays.get(name))


def build_workspace(model: IntModel, capacity: int, train: bool) -> Workspace:
    """Buffers for batches of up to ``capacity`` samples (training or forward-only)."""
    check_bounds(model)
    n = capacity
    ad = model.adtype
    x = np.zeros((n, *internal_shape(model.spec.input_shape)), ad)
    buf = _Buffers()
    prev = x
    g32 = g64 = 0
    nz = n
    for op in model.ops:
        out = prev.reshape(n, *op.out_shape) if op.kind == "flatten" else \
            np.zeros((n, *op.out_shape), ad)
        is_param = op.param >= 0
        arrays: dict[str, np.ndarray | None] = {"acts": out}
        if op.kind == "pool":
            # winners are needed by backward only; evaluation passes a 1-cell dummy
            arrays["win"] = np.zeros((n, *op.out_shape) if train else (1, 1, 1, 1), np.int8)
            nz = max(nz, op.out_shape[1] * op.out_shape[2])  # backward routes a row at a time
        if train and is_param:
            arrays["eq"] = np.zeros((n, *op.out_shape), ad)
        if (train and op.needs_input_error and op.kind not in ("flatten", "relu")
                and not (op.kind == "pool" and op.fused_error)):
            arrays["err_in"] = np.zeros((n, *op.in_shape), np.int32)
        if op.kind == "conv":
            arrays.update(_conv_buffers(model, op, n, train))
            # error lists of the sparse gradient (per channel) and backward-data (per pixel)
            nz = max(nz, n * op.out_shape[0] * op.out_shape[1] + 4, op.out_shape[2] + 4)
        elif op.kind == "linear":
            n_out = op.out_shape[0]
            arrays["lacc"] = np.zeros(n_out, np.int32)
            arrays["lacc16"] = np.zeros(n_out if model.amax <= 127 else 0, np.int16)
            if train and is_param:
                arrays["a_t"] = np.zeros((op.in_shape[0], n), ad)
            nz = max(nz, op.in_shape[0])
        if train and is_param:
            size = int(np.prod(model.internal_shapes[op.param]))
            op.grad_int64 = grad_needs_int64(model, op, n)
            if op.grad_int64:
                g64 = max(g64, size)
            else:
                g32 = max(g32, size)
        buf.add(**arrays)
        prev = out
    max_param = max((int(np.prod(s)) for s in model.internal_shapes), default=0)
    return Workspace(
        capacity=n, x=x, err_out=np.zeros((n, model.spec.num_classes), np.int32) if train else
        np.zeros((0, 0), np.int32),
        nz_idx=np.zeros(nz, np.int32), nz_val=np.zeros(nz, np.int32),
        grad32=np.zeros(g32, np.int32), grad64=np.zeros(g64, np.int64),
        extra=np.zeros(max_param if train else 0, np.int64), train=train,
        **{name: getattr(buf, name) for name in _Buffers.NAMES},
    )


def _conv_buffers(model: IntModel, op: Op, n: int, train: bool) -> dict[str, np.ndarray | None]:
    """The scratch of one conv: forward blocks, plane or im2col, gradient scratch."""
    lay = op.layer
    ad = model.adtype
    is_param = op.param >= 0
    r = lay.kernel * lay.kernel * lay.in_channels
    pix = op.out_shape[0] * op.out_shape[1]
    h, w, c = op.in_shape
    pad = lay.padding
    gmode = grad_mode(model, op, n) if (train and is_param) else ""
    if gmode:
        op.grad_mode = gmode
    out: dict[str, np.ndarray | None] = {}
    if op.plane and model.conv_impl == "col":
        # the weight gradient copies runs of Ho * (W + pad) positions per sample,
        # PLANE_GRAD_GROUP samples at a time
        cols = min(n, PLANE_GRAD_GROUP) * op.out_shape[0] * (w + pad) if gmode == "plane" else 0
        block = PLANE_BLOCK
        out["plane"] = np.zeros((c, plane_len(n, h, w, pad)), ad)
        out["offs"] = np.zeros(r, np.int32)
    else:
        # training keeps the whole batch's im2col for the weight gradient
        cols = pix * (n if train else max(1, min(n, GROUP_PIXELS // pix)))
        block = min(cols, PIXEL_BLOCK)
    out["col_t"] = np.zeros((r, cols), ad)
    sparse = gmode == "sparse"
    out["a_pad"] = np.zeros((n, h + 2 * pad, w + 2 * pad, c), ad) if sparse else None
    out["gt"] = np.zeros((lay.out_channels, r), np.int32) if sparse else None
    out["pacc"] = np.zeros(block, np.int32)
    out["pacc16"] = np.zeros(block if model.amax <= 127 else 0, np.int16)
    out["ptile"] = np.zeros((lay.out_channels, block), ad)
    out["patch"] = np.zeros(lay.out_channels, np.int32)
    # backward-data scratch: int16 when sum_o |eq| <= O * amax cannot overflow it
    narrow_bd = lay.out_channels * model.amax <= INT16_LIMIT
    out["pbuf"] = np.zeros(r, np.int16 if narrow_bd else np.int32) if train else None
    if train and is_param:
        out["gacc"] = np.zeros(lay.out_channels, np.int64 if gmode == "int64" else np.int32)
        # dot-product gradients (int32) use col_t: errors of the same pixels
        out["e_t"] = (np.zeros((lay.out_channels, cols), ad) if gmode in ("plane", "dot")
                      else None)
    return out
