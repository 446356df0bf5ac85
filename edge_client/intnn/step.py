"""The integer forward pass and training step of an :class:`~edge_client.intnn.model.IntModel`
(``IntModel.forward`` / ``IntModel.train_step`` call these): which kernel runs for each op,
on which buffers, split over how many threads.

Large kernels are split into disjoint parts that run at once on the model's threads
(``IntModel(threads=)``, :class:`~edge_client.intnn.parallel.Splitter`): the forward,
backward-data and pooling over samples, the error-driven conv gradient over output
channels, the dot-product conv gradient and the linear gradient over weight rows, the
update over stored weights. Every part writes its own outputs and every sum is an exact
integer one, so the results do not depend on the number of threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edge_client.intnn import kernels as K
from edge_client.intnn.ops import Op, Regularizer, Workspace

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel

UPDATE_ALIGN = 256  # canonical-order weights are updated in runs of 256 (kernels.sgd_update)


def forward(model: IntModel, ws: Workspace, n: int) -> np.ndarray:
    """Run the forward pass on ``ws.x[:n]``; returns the logits view [n, classes].

    On several threads, each run of consecutive split ops (split over samples alike; a
    flatten, a view, joins it) is one task per sample range: a thread takes its samples
    through every op of the run, one hand-off for the run instead of one per op, its
    samples staying in its caches."""
    prev = ws.x[:n]
    ops = model.ops
    i = 0
    while i < len(ops):
        tasks = []
        j = i
        p = prev
        while model.splitter.threads > 1 and j < len(ops) and (ops[j].split
                                                                or ops[j].kind == "flatten"):
            task = _forward_task(model, ws, j, ops[j], p, ws.acts[j][:n], n)
            if task is None:
                break
            tasks.append(task)
            p = ws.acts[j][:n]
            j += 1
        if len(tasks) > 1:
            model.splitter.run_chain(tasks, n)
            prev = p
            i = j
            continue
        out = ws.acts[i][:n]
        _forward_op(model, ws, i, ops[i], prev, out, n)
        prev = out
        i += 1
    return prev


def _forward_task(model: IntModel, ws: Workspace, i: int, op: Op, prev: np.ndarray,
                  out: np.ndarray, n: int):
    """(kernel, args(thread, lo, hi)) of op i's forward over samples lo..hi, or None when
    the op does not run that way (its kernel is not split over samples). A flatten is a
    view: no kernel, an empty task."""
    sc = ws.scratch
    p = op.param
    if op.kind == "conv":
        lay = op.layer
        if op.vnni:
            return K.conv_forward_vnni, lambda t, lo, hi: (
                prev, model.tv[p], model.tcorr[p], lay.kernel, lay.stride, lay.padding,
                op.shift, model.amax, op.relu, out, ws.a_pad[i], sc[t].vacc[i], lo, hi)
        if model.conv_impl == "col" and op.plane:
            return K.conv_forward_plane, lambda t, lo, hi: (
                prev, model.tlist[p], model.tcnt[p], lay.kernel, lay.padding, op.shift,
                model.amax, op.relu, out, ws.plane[i], sc[t].offs[i], sc[t].pacc[i],
                sc[t].pacc16[i], sc[t].ptile[i], lo, hi)
        return None
    if op.kind == "linear":
        return K.linear_forward, lambda t, lo, hi: (
            prev, model.t[p], op.shift, model.amax, op.relu, out, sc[t].lacc[i],
            sc[t].lacc16[i], sc[t].nz_idx, sc[t].nz_val, lo, hi)
    if op.kind == "pool":
        lay = op.layer
        win = ws.win[i][:n] if ws.train else ws.win[i]
        return K.maxpool_forward, lambda t, lo, hi: (
            prev, lay.kernel, lay.step, lay.padding, out, win, ws.train, op.relu_in, lo, hi)
    if op.kind == "flatten":
        return _no_kernel, lambda t, lo, hi: ()
    return None


def _no_kernel() -> None:
    """A flatten's task: its output is a view of its input."""


def _forward_op(model: IntModel, ws: Workspace, i: int, op: Op, prev: np.ndarray,
                out: np.ndarray, n: int) -> None:
    """Op i of the forward pass: ``out`` from ``prev`` (samples [:n])."""
    task = _forward_task(model, ws, i, op, prev, out, n)
    if task is not None:
        model.splitter.run(task[0], task[1], n, split=op.split)
        return
    sc = ws.scratch
    p = op.param
    if op.kind == "conv":
        lay = op.layer
        if model.conv_impl == "col":
            K.conv_forward_col(prev, model.tb[p], lay.stride, lay.padding, op.shift,
                               model.amax, op.relu, out, ws.col_t[i], sc[0].pacc[i],
                               sc[0].pacc16[i], sc[0].ptile[i])
        else:
            K.conv_forward(prev, model.t[p], lay.stride, lay.padding, op.shift, model.amax,
                           op.relu, out, ws.patch[i])
    elif op.kind == "relu":
        K.relu_forward(prev.reshape(-1), out.reshape(-1))


def train_step(model: IntModel, ws: Workspace, y: np.ndarray, n: int, lr_log2: int, seed: int,
               step: int, reg: Regularizer | None = None) -> int:
    """One SGD step (see ``IntModel.train_step``); returns the integer loss sum."""
    z = forward(model, ws, n)
    e = ws.err_out[:n]
    if model.loss == "sse":
        sse = K.sse_error(z, y, model.target, e)
    else:
        sse = K.softmax_error(z, y, model.bits, model.ce_temp_shift, e)
    cur = e
    eq_ready = False  # the op's quantized error was written by the max-pool after it
    for i in range(len(model.ops) - 1, -1, -1):
        op = model.ops[i]
        if op.kind == "flatten":
            cur = cur.reshape(n, *op.in_shape)
            continue
        if op.kind == "relu":
            K.relu_mask(cur.reshape(-1), ws.acts[i][:n].reshape(-1))
            continue
        if op.kind == "pool":
            lay = op.layer
            sc0 = ws.scratch[0]
            if op.fused_error:
                _pool_error(model, ws, i, cur, n)
                eq_ready = True
                continue
            if not op.needs_input_error:
                break
            dst = ws.err_in[i][:n]
            K.maxpool_backward(cur, ws.win[i][:n], lay.kernel, lay.step, lay.padding, dst,
                               sc0.nz_idx, sc0.nz_val)
            cur = dst
            continue
        cur = _param_backward(model, ws, i, cur, eq_ready, n, lr_log2, seed, step, reg)
        eq_ready = False
        if not op.needs_input_error:
            break
    return int(sse)


def _pool_error(model: IntModel, ws: Workspace, i: int, e: np.ndarray, n: int) -> None:
    """Max-pool op i's error ``e`` routed to its winners and quantized: the quantized error
    of the conv before it, NHWC (``ws.eq``) or at the plane positions (``ws.eqp``)."""
    op, conv = model.ops[i], model.ops[i - 1]
    lay = op.layer
    if ws.eq[i - 1] is not None:
        dst = ws.eq[i - 1][:n]
        h, w, c = conv.out_shape
        strides = (h * w * c, w * c, c, 1)
    else:  # the plane-position layout of the conv's input: [O, N * hs]
        dst = ws.eqp[i - 1]
        h_in, w_in, _ = conv.in_shape
        wp = w_in + conv.layer.padding
        hs = (h_in + conv.layer.padding) * wp
        strides = (hs, wp, 1, dst.shape[1])
    win = ws.win[i][:n]
    kq = K.pool_error_scale(e, win)  # the batch's scale first: then samples split
    sc = ws.scratch
    model.splitter.run(K.pool_error_route, lambda t, lo, hi: (
        e, win, lay.kernel, lay.step, lay.padding, model.bits, kq, dst, *strides,
        sc[t].nz_idx, sc[t].nz_val, lo, hi), n, split=op.split)


def _param_backward(model: IntModel, ws: Workspace, i: int, cur: np.ndarray | None,
                    eq_ready: bool, n: int, lr_log2: int, seed: int, step: int,
                    reg: Regularizer | None) -> np.ndarray | None:
    """Backward of conv/linear op i: its quantized error (unless ``eq_ready``), weight
    gradient, the error at its input (returned) and the update of its weights."""
    op = model.ops[i]
    p = op.param
    eq = ws.eq[i][:n] if ws.eq[i] is not None else None
    if not eq_ready:
        if op.relu:
            K.mask_quantize_error(cur.reshape(-1), ws.acts[i][:n].reshape(-1), model.bits,
                                  eq.reshape(-1))
        else:
            K.quantize_error(cur.reshape(-1), model.bits, eq.reshape(-1))
    a_in = ws.acts[i - 1][:n] if i > 0 else ws.x[:n]
    size = model.w[p].size
    dst = ws.err_in[i][:n] if op.needs_input_error else None
    g = (ws.grad64 if op.grad_int64 else ws.grad32)[:size].reshape(model.w[p].shape)
    if op.kind == "linear":
        a2 = a_in.reshape(n, -1)
        # VNNI on several threads: the gradient's max first, the gradient made again inside
        # the update (its memory traffic, not its arithmetic, limits a split; on one thread
        # storing it is faster: fedshift_cnn 13.2 vs 13.8 ms a step, 2 threads 9.0 vs 8.3)
        fused = (op.split and ws.scratch[0].lep[i] is not None
                 and not (reg is not None and reg.active))
        gmax = _linear_backward(model, ws, i, eq, a2, g, dst, n, fused)
        if fused and _fused_update(model, ws, i, eq, a2, gmax, lr_log2, seed, step):
            return dst
        if fused:  # not the update's usual case: the gradient is stored after all
            gmax = _linear_grad(model, ws, i, eq, a2, g)
    else:
        gmax = _conv_backward(model, ws, i, eq, a_in, g, dst, n)
    _update(model, ws, op, g, gmax, lr_log2, seed, step, reg)
    return dst


def _linear_grad(model: IntModel, ws: Workspace, i: int, eq: np.ndarray, a2: np.ndarray,
                 g: np.ndarray) -> int:
    """Linear op i's weight gradient into g; returns max |G|."""
    op = model.ops[i]
    run = model.splitter.run
    sc = ws.scratch
    if sc[0].lep[i] is not None:
        return max(run(K.linear_weight_grad_vnni, lambda t, lo, hi: (
            eq, a2, g, ws.a_t[i], sc[t].lep[i], lo, hi), g.shape[0], split=op.split))
    return max(run(K.linear_weight_grad, lambda t, lo, hi: (
        eq, a2, g, sc[t].nz_idx, sc[t].nz_val, ws.a_t[i], lo, hi), g.shape[0], split=op.split))


def _fused_update(model: IntModel, ws: Workspace, i: int, eq: np.ndarray, a2: np.ndarray,
                  gmax: int, lr_log2: int, seed: int, step: int) -> bool:
    """The update of linear op i with its gradient made again row by row
    (``kernels.linear_update_vnni``) when it is the update's usual case (a non-zero
    gradient, 0 < shift <= 62); False (nothing done) otherwise."""
    if gmax <= 0:
        return False
    sh = int(K.round_log2(gmax)) - lr_log2
    if not 0 < sh <= 62:
        return False
    op = model.ops[i]
    p = op.param
    sc = ws.scratch
    rows, _ = model.counter_layout(op)
    key = K.stream_key(seed, step, p, 0)
    wf = model.w[p].reshape(-1)
    tf = model.t[p].reshape(-1)
    model.splitter.run(K.linear_update_vnni, lambda t, lo, hi: (
        eq, a2, ws.a_t[i], sc[t].lep[i], wf, tf, sh, model.wmax, model.thr, key, rows, lo, hi),
        model.w[p].shape[0], split=op.split)
    model.ternary_copies(p)
    return True


def _linear_backward(model: IntModel, ws: Workspace, i: int, eq: np.ndarray, a2: np.ndarray,
                     g: np.ndarray, dst: np.ndarray | None, n: int, fused: bool) -> int:
    """Weight gradient (returns max |G|; when ``fused`` only its max, the gradient is made
    in the update) and, when ``dst``, the error at the input."""
    op = model.ops[i]
    run = model.splitter.run
    sc = ws.scratch
    if fused:
        gmax = max(run(K.linear_grad_max_vnni, lambda t, lo, hi: (
            eq, a2, ws.a_t[i], sc[t].lep[i], lo, hi), g.shape[0], split=op.split))
    else:
        gmax = _linear_grad(model, ws, i, eq, a2, g)
    if dst is not None:
        d2 = dst.reshape(n, -1)
        if _vnni_grad(model) and op.out_shape[0] >= K.vnni.VEC:
            run(K.linear_backward_data_vnni, lambda t, lo, hi: (
                eq, model.t[op.param], a2, op.relu_in, d2, sc[t].nz_idx, lo, hi), n,
                split=op.split)
        else:
            run(K.linear_backward_data, lambda t, lo, hi: (
                eq, model.t[op.param], a2, op.relu_in, d2, sc[t].nz_idx, lo, hi), n,
                split=op.split)
    return gmax


def _conv_backward(model: IntModel, ws: Workspace, i: int, eq: np.ndarray | None,
                   a_in: np.ndarray, g: np.ndarray, dst: np.ndarray | None, n: int) -> int:
    """Weight gradient (returns max |G|, -1 when the kernel does not report it) and, when
    ``dst``, the error at the input."""
    op = model.ops[i]
    lay = op.layer
    run = model.splitter.run
    sc = ws.scratch
    gmax = -1
    if op.grad_mode == "int64":
        K.conv_weight_grad(eq, a_in, lay.stride, lay.padding, g, ws.gacc[i])
    elif op.grad_mode == "sparse":
        if not op.vnni:  # else the forward padded the input already
            run(K.pad_nhwc, lambda t, lo, hi: (a_in, lay.padding, ws.a_pad[i][:n], lo, hi), n,
                split=op.split)
        sparse = (K.conv_weight_grad_sparse_vnni if _vnni_grad(model) and g.dtype == np.int32
                  else K.conv_weight_grad_sparse)
        gmax = max(run(sparse, lambda t, lo, hi: (
            eq, ws.a_pad[i][:n], lay.stride, g, ws.gt[i], sc[t].nz_idx, sc[t].nz_val, lo, hi),
            lay.out_channels, split=op.split))
    elif op.grad_mode == "plane":
        h_in, w_in, _ = op.in_shape
        wp = w_in + lay.padding
        hs = (h_in + lay.padding) * wp
        if op.vnni:  # the VNNI forward read the padded input: the plane is made here
            # one thread: a copy (~40 us a step) costs less than handing half of it over
            K.plane_for_grad(a_in, lay.kernel, lay.padding, ws.plane[i], sc[0].offs[i], 0, n)
        if eq is not None:  # NHWC errors to the plane positions (else the pool wrote them)
            run(K.eq_to_planar, lambda t, lo, hi: (eq, wp, hs, ws.eqp[i], lo, hi), n,
                split=op.split)
        n_pos = (n - 1) * hs + (op.out_shape[0] - 1) * wp + op.out_shape[1]
        kernel = K.conv_weight_grad_plane_vnni if _vnni_grad(model) else K.conv_weight_grad_plane
        gmax = max(run(kernel, lambda t, lo, hi: (
            ws.eqp[i], ws.plane[i], sc[0].offs[i], n_pos, g, lo, hi), g.shape[0] * g.shape[1]
            * g.shape[2], align=2, split=op.split))
    else:
        K.conv_weight_grad_dot(eq, a_in, lay.stride, lay.padding, g, ws.col_t[i], ws.e_t[i],
                               model.conv_impl == "col")
    if dst is not None:
        if _vnni_grad(model) and eq.dtype == np.int8:
            run(K.conv_backward_data_vnni, lambda t, lo, hi: (
                eq, model.tb[op.param], lay.stride, lay.padding, dst, sc[t].nz_idx,
                sc[t].nz_val, lo, hi), n, split=op.split)
        elif sc[0].pbuf[i].dtype == np.int16:
            run(K.conv_backward_data_narrow, lambda t, lo, hi: (
                eq, model.tb[op.param], lay.stride, lay.padding, dst, sc[t].pbuf[i],
                sc[t].nz_idx, sc[t].nz_val, lo, hi), n, split=op.split)
        else:
            K.conv_backward_data(eq, model.tb[op.param], lay.stride, lay.padding, dst,
                                 sc[0].pbuf[i])
    return gmax


def _vnni_grad(model: IntModel) -> bool:
    """The conv weight gradients' and a linear layer's backward-data dot products run on
    AVX-512 VNNI (int8 operands)."""
    return K.VNNI and model.amax <= 127


def _update(model: IntModel, ws: Workspace, op: Op, g: np.ndarray, gmax: int, lr_log2: int,
            seed: int, step: int, reg: Regularizer | None) -> None:
    """Eq. 15-16 on op's weights (the regularizer's term when active), then the derived
    ternary copies."""
    p = op.param
    wf = model.w[p].reshape(-1)
    tf = model.t[p].reshape(-1)
    gf = g.reshape(-1)
    size = wf.shape[0]
    key = K.stream_key(seed, step, p, 0)
    extra, extra_shift, key2 = ws.extra[:0], -1, key
    if reg is not None and reg.active:
        extra, extra_shift, key2 = ws.extra[:size], reg.shift, K.stream_key(seed, step, p, 1)
        K.regularizer_terms(wf, reg.anchor[p].reshape(-1), reg.mu_q, reg.d_shift,
                            reg.step_g[p].reshape(-1), reg.alpha_q, extra)
    if gmax < 0:
        gmax = K.grad_max(gf)
    rows, cols = model.counter_layout(op)
    model.splitter.run(K.sgd_update, lambda t, lo, hi: (
        wf, gf, gmax, lr_log2, model.wmax, model.thr, key, tf, extra, extra_shift, key2, rows,
        cols, lo, hi), size, align=cols if cols else UPDATE_ALIGN, split=size >= 1 << 16)
    model.ternary_copies(p)
