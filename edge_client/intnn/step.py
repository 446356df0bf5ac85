"""The integer forward pass and training step of an :class:`~edge_client.intnn.model.IntModel`
(``IntModel.forward`` / ``IntModel.train_step`` call these): which kernel runs for each op,
on which buffers, split over how many threads.

Large kernels are split into disjoint parts that run at once on the model's threads
(``IntModel(threads=)``, :class:`~edge_client.intnn.parallel.Splitter`): the forward,
backward-data and pooling over samples, the error-driven conv gradient over output
channels, the dot-product conv gradient and the linear gradient over weight rows, the
update over stored weights. Every part writes its own outputs and every sum is an exact
integer one, so the results do not depend on the number of threads. Kernels that do not
wait on each other share a hand-off: the forward ops over the same samples
(:func:`forward`), the backward's stages of consecutive layers (:func:`_backward`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.intnn import kernels as K
from edge_client.intnn.ops import Op, Regularizer, Workspace
from edge_client.intnn.parallel import Task
from edge_client.intnn.workspace import vnni_linear_forward

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel

UPDATE_ALIGN = 256  # canonical-order weights are updated in runs of 256 (kernels.sgd_update)
# a VNNI linear layer with at least this many weights makes its gradient twice (its max,
# then again in the update) instead of storing it, on one thread too: fedshift_cnn's fc1
# (2M weights, an 8 MB int32 gradient) one-thread step 1.01-1.06x faster in four paired
# A/Bs; digits_cnn's fc1 (8k, 32 KB that stay in L2) 0.97x, so it stores its gradient
FUSED_UPDATE_MIN_WEIGHTS = 1 << 18


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
        if vnni_linear_forward(model, op):
            return K.linear_forward_vnni, lambda t, lo, hi: (
                prev, model.t[p], op.shift, model.amax, op.relu, out, sc[t].lacc[i],
                sc[t].nz_idx, sc[t].nz_val, lo, hi)
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
    _backward(model, ws, e, n, _Step(lr_log2, seed, step, reg))
    return int(sse)


@dataclass(frozen=True)
class _Step:
    """What a training step's updates need besides the buffers."""

    lr_log2: int
    seed: int
    step: int
    reg: Regularizer | None


def _backward(model: IntModel, ws: Workspace, e: np.ndarray, n: int, st: _Step) -> None:
    """The backward pass from the loss's error ``e`` [n, classes], in groups of tasks
    (``Splitter.run_group``: one hand-off each on several threads).

    Each conv/linear op's backward is a few stages (:class:`_ParamBackward`): its error
    (the max-pool's routing after it, or its error quantized before the stage; its input's
    error; the partial scales of the max-pool before it: all over samples), its weight
    gradient (in the first stage when the quantized error was ready before it), its
    update. The ops' stages overlap: the group that makes op i's error also runs the
    next stage of each op after it still running, which waits on nothing that group
    makes: on fedshift_cnn fc1's gradient with its error, fc1's update with conv2's
    error, conv2's gradient with conv1's, conv2's update with conv1's gradient: four
    hand-offs where one kernel a hand-off took eight. Within a group, tasks split alike
    (over the same samples) follow each other on the same thread: the max-pool's routed
    error, then the input's error from it, then the partial scales from that. ReLUs,
    flattens and the max-pools whose error is not fused run between groups, on the
    calling thread. Each layer's gradient has its own buffer (``ws.grads``): a group may
    update one layer while it makes another's gradient. The ops' tasks are built once per
    workspace and batch size (``ws.plans``) and read the step's values when they run."""
    plan = ws.plans.get(n)
    if plan is None:
        plan = ws.plans[n] = [_ParamBackward(model, ws, i, n) if op.param >= 0 else None
                              for i, op in enumerate(model.ops)]
    ops = model.ops
    running: list[tuple[Iterator[list[Task]], list[Task]]] = []
    cur: np.ndarray = e
    i = len(ops) - 1
    front: _ParamBackward | None = None  # the op whose error the last group made
    while True:
        start: _ParamBackward | None = None
        kq = -1  # the error scale of the fused max-pool after the next conv
        while i >= 0:
            op = ops[i]
            if op.param >= 0:
                start = plan[i]
                start.begin(cur, kq, st)
                i = i - 1 if op.needs_input_error else -1
                break
            if op.kind == "flatten":
                cur = cur.reshape(n, *op.in_shape)
            elif op.kind == "relu":
                K.relu_mask(cur.reshape(-1), ws.acts[i][:n].reshape(-1))
            elif op.kind == "pool":
                win = ws.win[i][:n]
                if op.fused_error:  # routed and quantized by the conv before it
                    part = front.pool_scale(i) if front is not None else None
                    kq = K.pool_error_scale(cur, win) if part is None else part
                elif not op.needs_input_error:
                    i = -1
                    break
                else:
                    lay = op.layer
                    dst = ws.err_in[i][:n]
                    sc0 = ws.scratch[0]
                    K.maxpool_backward(cur, win, lay.kernel, lay.step, lay.padding, dst,
                                       sc0.nz_idx, sc0.nz_val)
                    cur = dst
            i -= 1
        if start is not None:
            stages = start.stages()
            running.append((stages, next(stages)))
        if not running:
            return
        model.splitter.run_group([t for _, tasks in running for t in tasks])
        running = [(stages, tasks) for stages, _ in running
                   if (tasks := next(stages, None)) is not None]
        if start is not None:
            front = start
            if start.dst is not None:
                cur = start.dst


class _ParamBackward:
    """The backward of conv/linear op i for batches of n samples as stages of tasks
    (:meth:`stages`). Built once per workspace and n: the tasks hold the buffers' views;
    the weights (which loading replaces), the error at the op's output, the max-pool's
    scale and the step's values are read when they run (:meth:`begin` sets them). It
    holds no reference to the workspace (which holds it)."""

    def __init__(self, model: IntModel, ws: Workspace, i: int, n: int) -> None:
        op = model.ops[i]
        self.model, self.op, self.i, self.n, self.p = model, op, i, n, op.param
        self.sc = ws.scratch
        self.eq = ws.eq[i][:n] if ws.eq[i] is not None else None
        self.act = ws.acts[i][:n]
        self.a_in = ws.acts[i - 1][:n] if i > 0 else ws.x[:n]
        self.dst = ws.err_in[i][:n] if op.needs_input_error else None
        self.g = ws.grads[op.param]
        self.extra = ws.extras[op.param]
        self.none = ws.extra[:0]
        # the step's values, set by begin() and the stages
        self.cur: np.ndarray = self.dst if self.dst is not None else ws.err_out[:n]
        self.kq = -1
        self.st = _Step(0, 0, 0, None)
        self.sh = self.gmax = self.key = self.key2 = 0
        self.extra_now, self.extra_shift = self.none, -1
        # the fused max-pool reading dst (through flattens only): its scale in parts
        j = i - 1
        while j >= 0 and model.ops[j].kind == "flatten":
            j -= 1
        fused = self.dst is not None and j >= 0 and model.ops[j].fused_error
        self.scale_pool = j if fused else -1
        # the first stage's tasks follow each other over the same samples: all split, or
        # none where the input's error is one whole-batch kernel (int32 sums, no VNNI)
        whole = (self.dst is not None and op.kind == "conv"
                 and not (_vnni_grad(model) and self.eq.dtype == np.int8)
                 and self.sc[0].pbuf[i].dtype != np.int16)
        self.error_split = op.split and not whole
        routed = i + 1 < len(model.ops) and model.ops[i + 1].fused_error
        self.route = self._route(ws, i + 1) if routed else None
        self.prep = self._grad_inputs(ws)
        self.first = ([self.route] if self.route is not None else []) + self.prep
        self.scale: Task | None = None
        if self.dst is not None:
            self.first.append(self._input_error())
            if self.scale_pool >= 0:
                win = ws.win[self.scale_pool][:n]
                e = self.dst.reshape(win.shape)
                self.scale = self._task(K.pool_error_scale, lambda t, lo, hi: (
                    e[lo:hi], win[lo:hi]), n, first=True, tag=self.scale_pool - 1)
                self.first.append(self.scale)
        self.grad = self._grad(ws, only_max=False)
        # a VNNI linear op split over threads or whose gradient would not stay in the
        # caches: the gradient's max, then the update makes the gradient again
        # (kernels.linear_update_vnni) in its usual case
        can_fuse = (op.kind == "linear" and self.sc[0].lep[i] is not None
                    and (op.split or self.g.size >= FUSED_UPDATE_MIN_WEIGHTS))
        self.grad_max = self._grad(ws, only_max=True) if can_fuse else None
        self.fused_update = self._fused_update(ws) if can_fuse else None
        self.update = self._update()

    def begin(self, cur: np.ndarray, kq: int, st: _Step) -> None:
        """This step's error at the op's output (unused when the max-pool after the op
        routes it, at scale ``kq``) and values."""
        self.cur, self.kq, self.st = cur, kq, st

    def pool_scale(self, j: int) -> int | None:
        """The error scale of max-pool op j when this op's first stage made it in parts."""
        if j != self.scale_pool or self.scale is None:
            return None
        return max(self.scale.results, default=-1)  # round_log2 is monotone

    def _task(self, kernel: Any, args: Any, total: int, align: int = 1,
              first: bool = False, split: bool | None = None, tag: int | None = None
              ) -> Task:
        """A task of this op (tagged with its index), split as the op is (``first``: as
        its first stage is; ``split``: as given)."""
        if split is None:
            split = self.error_split if first else self.op.split
        return Task(kernel, args, total, align, split, self.i if tag is None else tag)

    def stages(self) -> Iterator[list[Task]]:
        """The op's stages, one list of tasks per group (the code between two yields runs
        on the calling thread after the group)."""
        model, op, st = self.model, self.op, self.st
        if self.route is None:
            if op.relu:
                K.mask_quantize_error(self.cur.reshape(-1), self.act.reshape(-1), model.bits,
                                      self.eq.reshape(-1))
            else:
                K.quantize_error(self.cur.reshape(-1), model.bits, self.eq.reshape(-1))
        fused = self.grad_max is not None and not (st.reg is not None and st.reg.active)
        grad = self.grad_max if fused else self.grad
        if self.route is None and not self.prep:  # the gradient reads what is ready already
            yield self.first + [grad]
        else:
            yield self.first
            yield [grad]
        gmax = max(grad.results, default=-1)
        if fused:
            if self._fused_case(gmax):
                yield [self.fused_update]
                model.ternary_copies(self.p)
                return
            grad = self.grad  # not the update's usual case: the gradient stored after all
            yield [grad]
            gmax = max(grad.results, default=-1)
        self._update_values(gmax)
        yield [self.update]
        model.ternary_copies(self.p)

    def _route(self, ws: Workspace, j: int) -> Task:
        """Max-pool op j's error (``cur``) routed to its winners and quantized at scale
        ``kq``: this op's quantized error, NHWC (``eq``) or at the plane positions
        (``ws.eqp``)."""
        model, op, n = self.model, self.op, self.n
        lay = model.ops[j].layer
        if self.eq is not None:
            dst = self.eq
            h, w, c = op.out_shape
            strides = (h * w * c, w * c, c, 1)
        else:  # the plane-position layout of the conv's input: [O, N * hs]
            dst = ws.eqp[self.i]
            h_in, w_in, _ = op.in_shape
            wp = w_in + op.layer.padding
            hs = (h_in + op.layer.padding) * wp
            strides = (hs, wp, 1, dst.shape[1])
        win = ws.win[j][:n]
        sc = self.sc
        return self._task(K.pool_error_route, lambda t, lo, hi: (
            self.cur, win, lay.kernel, lay.step, lay.padding, model.bits, self.kq, dst,
            *strides, sc[t].nz_idx, sc[t].nz_val, lo, hi), n, first=True)

    def _grad_inputs(self, ws: Workspace) -> list[Task]:
        """Tasks over samples laying out what the conv weight gradient reads: the padded
        input (sparse), the input's plane and the errors at the plane positions (plane)."""
        i, n, op, a_in, eq, sc = self.i, self.n, self.op, self.a_in, self.eq, self.sc
        lay = op.layer
        if op.grad_mode == "sparse" and not op.vnni:  # else the forward padded it already
            a_pad = ws.a_pad[i][:n]
            return [self._task(K.pad_nhwc, lambda t, lo, hi: (
                a_in, lay.padding, a_pad, lo, hi), n, first=True)]
        if op.grad_mode != "plane":
            return []
        h_in, w_in, _ = op.in_shape
        wp = w_in + lay.padding
        hs = (h_in + lay.padding) * wp
        plane, eqp = ws.plane[i], ws.eqp[i]
        tasks = []
        if op.vnni:  # the VNNI forward read the padded input: the plane is made here
            tasks.append(self._task(K.plane_for_grad, lambda t, lo, hi: (
                a_in, lay.kernel, lay.padding, plane, sc[t].offs[i], lo, hi), n,
                first=True))
        if eq is not None:  # NHWC errors to the plane positions (else the pool wrote them)
            tasks.append(self._task(K.eq_to_planar, lambda t, lo, hi: (
                eq, wp, hs, eqp, lo, hi), n, first=True))
        return tasks

    def _input_error(self) -> Task:
        """The error at the op's input (``dst``) over samples."""
        model, op, dst, eq, a_in, sc, i, p = (self.model, self.op, self.dst, self.eq,
                                              self.a_in, self.sc, self.i, self.p)
        if op.kind == "linear":
            a2 = a_in.reshape(self.n, -1)
            d2 = dst.reshape(self.n, -1)
            kernel = (K.linear_backward_data_vnni
                      if _vnni_grad(model) and op.out_shape[0] >= K.vnni.VEC
                      else K.linear_backward_data)
            return self._task(kernel, lambda t, lo, hi: (
                eq, model.t[p], a2, op.relu_in, d2, sc[t].nz_idx, lo, hi), self.n,
                first=True)
        lay = op.layer
        if _vnni_grad(model) and eq.dtype == np.int8:
            return self._task(K.conv_backward_data_vnni, lambda t, lo, hi: (
                eq, model.tb[p], lay.stride, lay.padding, dst, sc[t].nz_idx, sc[t].nz_val,
                lo, hi), self.n, first=True)
        if sc[0].pbuf[i].dtype == np.int16:
            return self._task(K.conv_backward_data_narrow, lambda t, lo, hi: (
                eq, model.tb[p], lay.stride, lay.padding, dst, sc[t].pbuf[i], sc[t].nz_idx,
                sc[t].nz_val, lo, hi), self.n, first=True)
        return self._task(K.conv_backward_data, lambda t, lo, hi: (
            eq, model.tb[p], lay.stride, lay.padding, dst, sc[0].pbuf[i]), 1, split=False)

    def _grad(self, ws: Workspace, only_max: bool) -> Task:
        """The weight gradient into ``g`` (or, ``only_max``, its max only: a linear op whose
        update makes it again); its results: max |G| per part, or -1 where the kernel does
        not report it."""
        model, i, op, eq, a_in, g, sc = (self.model, self.i, self.op, self.eq, self.a_in,
                                         self.g, self.sc)
        if op.kind == "linear":
            a2 = a_in.reshape(self.n, -1)
            a_t = ws.a_t[i]
            if only_max:
                return self._task(K.linear_grad_max_vnni, lambda t, lo, hi: (
                    eq, a2, a_t, sc[t].lep[i], lo, hi), g.shape[0])
            if sc[0].lep[i] is not None:
                return self._task(K.linear_weight_grad_vnni, lambda t, lo, hi: (
                    eq, a2, g, a_t, sc[t].lep[i], lo, hi), g.shape[0])
            return self._task(K.linear_weight_grad, lambda t, lo, hi: (
                eq, a2, g, sc[t].nz_idx, sc[t].nz_val, a_t, lo, hi), g.shape[0])
        lay = op.layer
        if op.grad_mode == "sparse":
            sparse = (K.conv_weight_grad_sparse_vnni if _vnni_grad(model)
                      and g.dtype == np.int32 else K.conv_weight_grad_sparse)
            a_pad, gt = ws.a_pad[i][:self.n], ws.gt[i]
            return self._task(sparse, lambda t, lo, hi: (
                eq, a_pad, lay.stride, g, gt, sc[t].nz_idx, sc[t].nz_val, lo, hi),
                lay.out_channels)
        if op.grad_mode == "plane":
            h_in, w_in, _ = op.in_shape
            wp = w_in + lay.padding
            hs = (h_in + lay.padding) * wp
            n_pos = (self.n - 1) * hs + (op.out_shape[0] - 1) * wp + op.out_shape[1]
            kernel = (K.conv_weight_grad_plane_vnni if _vnni_grad(model)
                      else K.conv_weight_grad_plane)
            eqp, plane = ws.eqp[i], ws.plane[i]
            return self._task(kernel, lambda t, lo, hi: (
                eqp, plane, sc[0].offs[i], n_pos, g, lo, hi),
                g.shape[0] * g.shape[1] * g.shape[2], align=2)
        if op.grad_mode == "int64":
            gacc = ws.gacc[i]
            return self._task(_reporting_none(K.conv_weight_grad), lambda t, lo, hi: (
                eq, a_in, lay.stride, lay.padding, g, gacc), 1, split=False)
        col_t, e_t = ws.col_t[i], ws.e_t[i]
        return self._task(_reporting_none(K.conv_weight_grad_dot), lambda t, lo, hi: (
            eq, a_in, lay.stride, lay.padding, g, col_t, e_t, model.conv_impl == "col"), 1,
            split=False)

    def _fused_update(self, ws: Workspace) -> Task:
        """The update of a linear op with its gradient made again row by row
        (``kernels.linear_update_vnni``), at the shift and key :meth:`_fused_case` set."""
        model, i, p, sc = self.model, self.i, self.p, self.sc
        eq, a2, a_t = self.eq, self.a_in.reshape(self.n, -1), ws.a_t[i]
        rows, _ = model.counter_layout(self.op)
        return self._task(K.linear_update_vnni, lambda t, lo, hi: (
            eq, a2, a_t, sc[t].lep[i], model.w[p].reshape(-1), model.t[p].reshape(-1),
            self.sh, model.wmax, model.thr, self.key, rows, lo, hi), model.w[p].shape[0])

    def _fused_case(self, gmax: int) -> bool:
        """Whether this step's update is the fused one's usual case (a non-zero gradient,
        0 < shift <= 62); if so its shift and key are set."""
        if gmax <= 0:
            return False
        st = self.st
        sh = int(K.round_log2(gmax)) - st.lr_log2
        if not 0 < sh <= 62:
            return False
        self.sh, self.key = sh, K.stream_key(st.seed, st.step, self.p, 0)
        return True

    def _update(self) -> Task:
        """Eq. 15-16 on the op's weights (with the regularizer's term when active), at the
        values :meth:`_update_values` set."""
        model, op, p = self.model, self.op, self.p
        gf = self.g.reshape(-1)
        size = gf.shape[0]
        rows, cols = model.counter_layout(op)
        return self._task(K.sgd_update, lambda t, lo, hi: (
            model.w[p].reshape(-1), gf, self.gmax, self.st.lr_log2, model.wmax, model.thr,
            self.key, model.t[p].reshape(-1), self.extra_now, self.extra_shift, self.key2,
            rows, cols, lo, hi), size, cols if cols else UPDATE_ALIGN,
            split=size >= 1 << 16)

    def _update_values(self, gmax: int) -> None:
        """The update's max |G| (computed here when the gradient kernel did not report it),
        keys and the regularizer's numerators (made here, on the calling thread)."""
        model, st, p = self.model, self.st, self.p
        self.key = self.key2 = K.stream_key(st.seed, st.step, p, 0)
        self.extra_now, self.extra_shift = self.none, -1
        if st.reg is not None and st.reg.active:
            self.extra_now, self.extra_shift = self.extra, st.reg.shift
            self.key2 = K.stream_key(st.seed, st.step, p, 1)
            K.regularizer_terms(model.w[p].reshape(-1), st.reg.anchor[p].reshape(-1),
                                st.reg.mu_q, st.reg.d_shift, st.reg.step_g[p].reshape(-1),
                                st.reg.alpha_q, self.extra)
        self.gmax = gmax if gmax >= 0 else K.grad_max(self.g.reshape(-1))


def _reporting_none(kernel: Any) -> Any:
    """A gradient kernel that does not report max |G|, reporting -1."""
    def run(*args: Any) -> int:
        kernel(*args)
        return -1
    return run


def _vnni_grad(model: IntModel) -> bool:
    """The conv weight gradients' and a linear layer's backward-data dot products run on
    AVX-512 VNNI (int8 operands)."""
    return K.VNNI and model.amax <= 127
