"""The CUDA engine's kernels that no single layer kind owns: the output error (SSE or the
integer softmax), the error's ReLU mask and its quantization (eq. 12), the gradient's
``max |G|``, the stochastic-rounded update (eq. 15-16, with the FedProx / FedFOR term),
the ReLU, the gather of a batch from the data set on the GPU, and zeroing.

Shapes: ``[D, ...]`` with D devices (``blockIdx.y``); flat views ``[D, L]`` where a kernel
is elementwise. ``n`` (int32 [D]): the samples of this step per device (0: the device
does not train this step); ``per``: elements per sample. Per-device reductions go to
``scal`` (int64 [D, slots]) with atomics, so they do not depend on the launch geometry.
"""

from __future__ import annotations

import numpy as np

from edge_client.intnn.cuda.arith import (
    exp2_neg,
    round_log2,
    round_shift,
    stoch_round_shift,
    stream_key,
)
from edge_client.intnn.cuda.device import cuda


@cuda.jit(cache=True)
def fill(a2, v):
    """``a2[d, :] = v``."""
    d = cuda.blockIdx.y
    for i in range(cuda.grid(1), a2.shape[1], cuda.gridsize(1)):
        a2[d, i] = v


@cuda.jit(cache=True)
def err_absmax(e2, act2, relu, n, per, scal, slot):
    """``scal[d, slot] = max |e|`` over the device's samples, ``e`` zeroed first where the
    layer's output ``act <= 0`` (``relu``: its fused ReLU; e is left masked)."""
    d = cuda.blockIdx.y
    m = np.int64(0)
    for i in range(cuda.grid(1), n[d] * per, cuda.gridsize(1)):
        v = np.int64(e2[d, i])
        if relu and act2[d, i] <= 0:
            v = np.int64(0)
            e2[d, i] = 0
        v = -v if v < 0 else v
        m = v if v > m else m
    if m > 0:
        cuda.atomic.max(scal, (d, slot), m)


@cuda.jit(cache=True)
def quantize(e2, scal, slot, bits, eq2, n, per):
    """Eq. 12: ``eq = clip(round_shift(e, round(log2 max|e|) - (s - 1)), +-(2^(s-1) - 1))``
    at the device's scale ``scal[d, slot]`` (0 everywhere when it is 0)."""
    d = cuda.blockIdx.y
    m = scal[d, slot]
    amax = (np.int64(1) << (bits - 1)) - np.int64(1)
    sh = round_log2(m) - (bits - 1) if m > 0 else 0
    for i in range(cuda.grid(1), n[d] * per, cuda.gridsize(1)):
        v = np.int64(0)
        if m > 0:
            v = round_shift(e2[d, i], sh)
            v = amax if v > amax else v
            v = -amax if v < -amax else v
        eq2[d, i] = v


@cuda.jit(cache=True)
def grad_absmax(g2, n, scal, slot):
    """``scal[d, slot] = max |g|`` of a device that trains this step."""
    d = cuda.blockIdx.y
    if n[d] <= 0:
        return
    m = np.int64(0)
    for i in range(cuda.grid(1), g2.shape[1], cuda.gridsize(1)):
        v = np.int64(g2[d, i])
        v = -v if v < 0 else v
        m = v if v > m else m
    if m > 0:
        cuda.atomic.max(scal, (d, slot), m)


@cuda.jit(device=True, inline=True)
def _counter(i, rows, cols):
    """The stochastic-rounding counter of stored weight i (``kernels.update._counter``)."""
    if cols == 0:
        return i
    f = i // cols
    return (i - f * cols) * rows + f


@cuda.jit(cache=True)
def sgd_update(w2, t2, g2, scal, slot, lr_log2, wmax, thr, seed, step, layer, rows, cols, n,
               has_reg, anchor2, stepg2, regq, d_shift):
    """Eq. 15-16 (``kernels.update.sgd_update``) on the weights of each device that trains
    this step: ``w <- clip(w - stoch_round(g 2^lr / 2^round(log2 max|g|)) - d2, +-wmax)``,
    ``t = ternary(w)``; ``d2`` the FedProx / FedFOR term where ``regq[d, 3]`` (its numerator
    ``((mu_q (w - anchor)) << d_shift) + alpha_q g [g (w - anchor) > 0]`` over
    ``2^regq[d, 2]``, ``regq[d] = (mu_q, alpha_q, shift, active)``) on its own stream.
    ``seed``/``step`` (int64 [D]) key the streams with ``layer``; ``rows``/``cols``: the
    counter order (``IntWeightLayer.counter_layout``)."""
    d = cuda.blockIdx.y
    if n[d] <= 0:
        return
    m = scal[d, slot]
    sh = round_log2(m) - lr_log2[d] if m > 0 else 0
    key = stream_key(seed[d], step[d], layer, 0)
    reg = has_reg and regq[d, 3] != 0
    key2 = stream_key(seed[d], step[d], layer, 1)
    for i in range(cuda.grid(1), w2.shape[1], cuda.gridsize(1)):
        j = _counter(i, rows, cols)
        v = np.int64(w2[d, i])
        x = np.int64(0)
        if reg:
            a = v - np.int64(anchor2[d, i])
            x = (regq[d, 0] * a) << d_shift
            s = np.int64(stepg2[d, i])
            if regq[d, 1] != 0 and s * a > 0:
                x += regq[d, 1] * s
        if m > 0:
            v -= stoch_round_shift(g2[d, i], sh, key, j)
        if reg:
            v -= stoch_round_shift(x, regq[d, 2], key2, j)
        v = wmax if v > wmax else v
        v = -wmax if v < -wmax else v
        w2[d, i] = v
        t2[d, i] = 1 if v > thr else (-1 if v < -thr else 0)


@cuda.jit(cache=True)
def sse_error(z3, y2, target, e3, n, loss):
    """``e = z - target onehot(y)`` (int32); ``loss[d] +=`` the squared errors' sum."""
    d = cuda.blockIdx.y
    classes = z3.shape[2]
    for s in range(cuda.grid(1), n[d], cuda.gridsize(1)):
        acc = np.int64(0)
        for o in range(classes):
            v = np.int64(z3[d, s, o])
            if o == y2[d, s]:
                v -= target
            e3[d, s, o] = v
            acc += v * v
        cuda.atomic.add(loss, d, acc)


@cuda.jit(cache=True)
def softmax_error(z3, y2, bits, temp_shift, e3, n, loss):
    """The integer base-2 softmax's error in Q15 (``kernels.loss.softmax_error``);
    ``loss[d] +=`` the sum of ``2^15 - p_true``."""
    d = cuda.blockIdx.y
    classes = z3.shape[2]
    fb = bits - 1
    for s in range(cuda.grid(1), n[d], cuda.gridsize(1)):
        mx = np.int64(z3[d, s, 0])
        for o in range(1, classes):
            v = np.int64(z3[d, s, o])
            mx = v if v > mx else mx
        ssum = np.int64(0)
        for o in range(classes):
            dd = (mx - np.int64(z3[d, s, o])) << temp_shift
            q = dd >> fb
            f = dd - (q << fb)
            j = f >> (fb - 4) if fb >= 4 else f << (4 - fb)
            ssum += exp2_neg(q, j)
        acc = np.int64(0)
        for o in range(classes):
            dd = (mx - np.int64(z3[d, s, o])) << temp_shift
            q = dd >> fb
            f = dd - (q << fb)
            j = f >> (fb - 4) if fb >= 4 else f << (4 - fb)
            p = (exp2_neg(q, j) << 15) // ssum
            if o == y2[d, s]:
                acc += np.int64(32768) - p
                p -= np.int64(32768)
            e3[d, s, o] = p
        cuda.atomic.add(loss, d, acc)


@cuda.jit(cache=True)
def gather(src2, idx2, n, x2):
    """A batch from the data set on the GPU: ``x[d, s] = src[idx[d, s]]`` (rows of
    ``per = src2.shape[1]`` elements)."""
    d = cuda.blockIdx.y
    per = src2.shape[1]
    for i in range(cuda.grid(1), n[d] * per, cuda.gridsize(1)):
        s = i // per
        x2[d, i] = src2[idx2[d, s], i - s * per]


@cuda.jit(cache=True)
def relu_forward(a2, out2, n, per):
    d = cuda.blockIdx.y
    for i in range(cuda.grid(1), n[d] * per, cuda.gridsize(1)):
        v = a2[d, i]
        out2[d, i] = v if v > 0 else 0


@cuda.jit(cache=True)
def relu_mask(e2, act2, n, per):
    """Zero the error where the ReLU's output is 0, in place."""
    d = cuda.blockIdx.y
    for i in range(cuda.grid(1), n[d] * per, cuda.gridsize(1)):
        if act2[d, i] <= 0:
            e2[d, i] = 0


#: what the kernels compute with: integer arithmetic only
__all__ = ["err_absmax", "fill", "gather", "grad_absmax", "quantize", "relu_forward",
           "relu_mask", "round_shift", "sgd_update", "softmax_error", "sse_error"]
