"""The integer buffers of an :class:`~edge_client.intnn.model.IntModel` pass
(:class:`~edge_client.intnn.ops.Workspace`), sized for a batch capacity, and the choice
of each conv's weight-gradient kernel. Allocated once per capacity and reused by every
step (``IntModel.workspace``); nothing is allocated per step. Buffers a kernel writes
from several threads at once (disjoint parts) are shared; scratch is per thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn import kernels as K
from edge_client.intnn.ops import Op, Scratch, Workspace, internal_shape, plane_len

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel

INT32_LIMIT = (1 << 31) - 1
INT16_LIMIT = (1 << 15) - 1
GROUP_PIXELS = 4096  # output pixels per im2col group when evaluating (memory bound)
PIXEL_BLOCK = 2048   # output pixels accumulated at a time by the conv forward (L1-sized)
PLANE_BLOCK = 1024   # plane positions accumulated at a time by the stride-1 conv forward
VNNI_BLOCK = 64      # output pixels the VNNI conv forward sums at a time (int32 [B, Op])
# conv weight gradient from the non-zero errors when a patch row (K*C values) is at least
# this long (short rows do not vectorize: the dense dot products are faster there)
SPARSE_GRAD_MIN_ROW = 32
MAX_POOL_KERNEL = 11  # pool winners are int8 cell numbers kh * k + kw
# an op's kernels are split over the threads when its forward does at least this many
# multiply-accumulates per batch (a split costs a few microseconds of hand-off, more of
# the parts' fixed work)
SPLIT_MIN_MACS = 1 << 20


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


def vnni_forward(model: IntModel, op: Op) -> bool:
    """This conv's forward runs as int8 dot products on AVX-512 VNNI (``kernels.vnni``):
    the CPU has them, activations are int8 (s <= 8), and its weight gradient does not read
    the col forward's im2col (a strided conv with K*C < 32 takes the ``"dot"`` gradient)."""
    return (K.VNNI and model.amax <= 127 and model.conv_impl == "col" and op.kind == "conv"
            and (op.plane or op.layer.kernel * op.layer.in_channels >= SPARSE_GRAD_MIN_ROW))


def vnni_linear_grad(model: IntModel, op: Op, batch: int) -> bool:
    """This linear layer's weight gradient runs on AVX-512 VNNI: int8 operands, an int32
    gradient, outputs in whole 64-lane blocks."""
    return (K.VNNI and model.amax <= 127 and op.kind == "linear"
            and op.out_shape[0] % 64 == 0 and not grad_needs_int64(model, op, batch))


def vnni_linear_forward(model: IntModel, op: Op) -> bool:
    """This linear layer's forward runs on AVX-512 VNNI (``kernels.vnni_linear``): int8
    activations, at least one 16-output block, and sums of the sign-flipped bytes that
    fit int32 (F * 255 * 128 < 2^31)."""
    return (K.VNNI and model.amax <= 127 and op.kind == "linear" and op.out_shape[0] >= 16
            and op.in_shape[0] * 255 * 128 < 1 << 31)


def op_macs(op: Op) -> int:
    """Multiply-accumulates of one sample's forward through op (0 for ops without
    weights)."""
    if op.kind == "conv":
        lay = op.layer
        return int(np.prod(op.out_shape)) * lay.kernel * lay.kernel * lay.in_channels
    if op.kind == "linear":
        return op.in_shape[0] * op.out_shape[0]
    return 0


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


def eq_planar_from_pool(model: IntModel, i: int) -> bool:
    """Op i's quantized error is written by the max-pool after it straight into the
    plane-position layout (``eqp``) and needed in no other layout."""
    op = model.ops[i]
    return (op.grad_mode == "plane" and not op.needs_input_error and i + 1 < len(model.ops)
            and model.ops[i + 1].fused_error)


class _PerOp:
    """Per-op buffer lists being filled (one entry per op, None where unused)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.lists: dict[str, list[np.ndarray | None]] = {name: [] for name in names}

    def add(self, arrays: dict[str, np.ndarray | None]) -> None:
        unknown = set(arrays) - set(self.names)
        if unknown:  # pragma: no cover - a programming error in this module
            raise KeyError(sorted(unknown))
        for name in self.names:
            self.lists[name].append(arrays.get(name))


SHARED = ("acts", "win", "eq", "eqp", "err_in", "patch", "a_t", "gacc", "col_t", "e_t",
          "plane", "a_pad", "gt")
PER_THREAD = ("pacc", "pacc16", "ptile", "vacc", "offs", "pbuf", "lacc", "lacc16", "lep")


def vnni_padded(op: Op) -> tuple[int, int]:
    """(groups, Op) of a VNNI conv (kernels.vnni.pad_rows): its weights' groups of four
    bytes, ceil(K*C / 4) per kernel row, and its output channels in whole groups of 16."""
    lay = op.layer
    return (lay.kernel * (-(-(lay.kernel * lay.in_channels) // 4)),
            K.vnni.padded(lay.out_channels, 16))


def build_workspace(model: IntModel, capacity: int, train: bool) -> Workspace:
    """Buffers for batches of up to ``capacity`` samples (training or forward-only)."""
    check_bounds(model)
    n = capacity
    ad = model.adtype
    threads = model.splitter.threads
    x = np.zeros((n, *internal_shape(model.spec.input_shape)), ad)
    shared = _PerOp(SHARED)
    per_thread = [_PerOp(PER_THREAD) for _ in range(threads)]
    prev = x
    g32 = g64 = 0
    grad_at: dict[int, tuple[bool, int]] = {}  # param -> (int64, offset in its buffer)
    nz = n + 4
    for i, op in enumerate(model.ops):
        out = prev.reshape(n, *op.out_shape) if op.kind == "flatten" else \
            np.zeros((n, *op.out_shape), ad)
        is_param = op.param >= 0
        op.split = threads > 1 and op_macs(op) * n >= SPLIT_MIN_MACS
        arrays: dict[str, np.ndarray | None] = {"acts": out}
        scratch: dict[str, np.ndarray | None] = {}
        if op.kind == "pool":
            # winners are needed by backward only; evaluation passes a 1-cell dummy
            arrays["win"] = np.zeros((n, *op.out_shape) if train else (1, 1, 1, 1), np.int8)
            op.split = threads > 1 and model.ops[i - 1].split
            nz = max(nz, op.out_shape[1] * op.out_shape[2])  # backward routes a row at a time
        if (train and op.needs_input_error and op.kind not in ("flatten", "relu")
                and not (op.kind == "pool" and op.fused_error)):
            arrays["err_in"] = np.zeros((n, *op.in_shape), np.int32)
        if op.kind == "conv":
            conv_shared, scratch = _conv_buffers(model, op, n, train)
            arrays.update(conv_shared)
            # error lists of the sparse gradient (per channel) and backward-data (per pixel)
            nz = max(nz, n * op.out_shape[0] * op.out_shape[1] + 4, op.out_shape[2] + 4)
            if train and op.grad_mode == "sparse" and K.VNNI and model.amax <= 127:
                # the VNNI form lists up to 64 channels' errors a chunk of pixels at a time
                nz = max(nz, min(64, op.out_shape[2]) * (K.vnni.SPARSE_CHUNK + 4))
        elif op.kind == "linear":
            n_out = op.out_shape[0]
            # the VNNI forward keeps up to FORWARD_SAMPLES samples' sums at a time
            rows = min(n, K.vnni_linear.FORWARD_SAMPLES) if vnni_linear_forward(model, op) else 1
            scratch = {"lacc": np.zeros(rows * n_out, np.int32),
                       "lacc16": np.zeros(n_out if model.amax <= 127 else 0, np.int16)}
            if train and is_param:
                n4 = K.vnni.padded(n, 4)  # the VNNI gradient takes samples in fours
                arrays["a_t"] = np.zeros((op.in_shape[0], n4), ad)
                if vnni_linear_grad(model, op, n):
                    scratch["lep"] = np.zeros(n4 * n_out, ad)
            nz = max(nz, op.in_shape[0] + 4)  # a row's non-zero inputs, padded to fours
        if train and is_param:
            if not eq_planar_from_pool(model, i):
                arrays["eq"] = np.zeros((n, *op.out_shape), ad)
            size = int(np.prod(model.internal_shapes[op.param]))
            op.grad_int64 = grad_needs_int64(model, op, n)
            grad_at[op.param] = (op.grad_int64, g64 if op.grad_int64 else g32)
            if op.grad_int64:
                g64 += size
            else:
                g32 += size
        shared.add(arrays)
        for t, lists in enumerate(per_thread):
            # thread 0's scratch always; the others' (copies) only where the op is split
            if t == 0:
                lists.add(scratch)
            else:
                lists.add({k: (None if v is None else v.copy()) for k, v in scratch.items()}
                          if op.split else {})
        prev = out
    # untouched pages cost no memory: a layer whose update makes its gradient again
    # (kernels.linear_update_vnni) leaves its region unmapped
    grad32, grad64 = np.zeros(g32, np.int32), np.zeros(g64, np.int64)
    shapes = model.internal_shapes
    grads = [(grad64 if wide else grad32)[at:at + int(np.prod(shapes[p]))].reshape(shapes[p])
             for p, (wide, at) in sorted(grad_at.items())]
    sizes = [int(np.prod(s)) for s in shapes]
    extra = np.zeros(sum(sizes) if train else 0, np.int64)
    starts = np.cumsum([0, *sizes])
    extras = [extra[starts[p]:starts[p + 1]] for p in range(len(sizes))] if train else []
    return Workspace(
        capacity=n, x=x, err_out=np.zeros((n, model.spec.num_classes), np.int32) if train else
        np.zeros((0, 0), np.int32),
        scratch=[Scratch(nz_idx=np.zeros(nz, np.int32), nz_val=np.zeros(nz, np.int32),
                         **lists.lists) for lists in per_thread],
        grad32=grad32, grad64=grad64, extra=extra, grads=grads, extras=extras, train=train,
        **shared.lists,
    )


def _conv_buffers(model: IntModel, op: Op, n: int, train: bool
                  ) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray | None]]:
    """(shared, per-thread) buffers of one conv: forward blocks, plane or im2col,
    gradient scratch."""
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
    shared: dict[str, np.ndarray | None] = {}
    scratch: dict[str, np.ndarray | None] = {}
    block = VNNI_BLOCK
    if op.vnni:
        scratch["vacc"] = np.zeros(block * vnni_padded(op)[1], np.int32)
    if op.plane and model.conv_impl == "col" and (gmode == "plane" or not op.vnni):
        if not op.vnni:
            block = PLANE_BLOCK
        shared["plane"] = np.zeros((c, plane_len(n, h, w, pad)), ad)
        scratch["offs"] = np.zeros(r, np.int32)
        if gmode == "plane":
            wp = w + pad
            shared["eqp"] = np.zeros((lay.out_channels, n * (h + pad) * wp), ad)
    elif not op.vnni:
        # training keeps the whole batch's im2col for the weight gradient
        cols = pix * (n if train else max(1, min(n, GROUP_PIXELS // pix)))
        block = min(cols, PIXEL_BLOCK)
        shared["col_t"] = np.zeros((r, cols), ad)
        if gmode == "dot":
            shared["e_t"] = np.zeros((lay.out_channels, cols), ad)
    if gmode == "sparse" or op.vnni:  # the VNNI forward pads the input for the gradient
        size = n * (h + 2 * pad) * (w + 2 * pad) * c
        # VNNI reads a kernel row in groups of four bytes: up to 3 past the last row
        shared["a_pad"] = np.zeros(size + 4, ad)[:size].reshape(n, h + 2 * pad, w + 2 * pad, c)
    if gmode == "sparse":
        shared["gt"] = np.zeros((lay.out_channels, r), np.int32)
    scratch["pacc"] = np.zeros(block, np.int32)
    scratch["pacc16"] = np.zeros(block if model.amax <= 127 else 0, np.int16)
    scratch["ptile"] = np.zeros((lay.out_channels, block), ad)
    shared["patch"] = np.zeros(lay.out_channels, np.int32)
    if train:
        # backward-data scratch: int16 when sum_o |eq| <= O * amax cannot overflow it
        narrow_bd = lay.out_channels * model.amax <= INT16_LIMIT
        scratch["pbuf"] = np.zeros(r, np.int16 if narrow_bd else np.int32)
    if gmode == "int64":
        shared["gacc"] = np.zeros(lay.out_channels, np.int64)
    return shared, scratch
