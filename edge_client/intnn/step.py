"""The CPU backend's passes: the integer forward and training step of an
:class:`~edge_client.intnn.model.IntModel` (``CpuBackend.forward`` / ``train_step``): in
which order its layers' kernels run, split over how many threads. Each layer makes its own
kernels' tasks (``edge_client.intnn.layers``); this module schedules them, quantizes each
weight layer's error (eq. 12) and updates its weights (eq. 15-16).

Large kernels are split into disjoint parts that run at once on the model's threads
(:class:`~edge_client.intnn.parallel.Splitter`). Every part writes its own outputs and
every sum is an exact integer one, so the results do not depend on the number of threads.
Kernels that do not wait on each other share a hand-off: the forward layers over the same
samples (:func:`forward`), the backward's stages of consecutive layers (:func:`_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge_client.intnn import kernels as K
from edge_client.intnn.layers.base import IntLayer, IntWeightLayer, Numerics
from edge_client.intnn.parallel import Splitter, Task
from edge_client.intnn.workspace import Regularizer, Workspace

UPDATE_ALIGN = 256  # canonical-order weights are updated in runs of 256 (kernels.sgd_update)


class Network(Numerics, Protocol):
    """What the CPU backend's passes read from a model (``IntModel``)."""

    ops: list[IntLayer]
    loss: str              # "sse" | "ce"
    target: int            # the one-hot target of the SSE loss
    ce_temp_shift: int     # the softmax loss's temperature 2^-shift


def forward(model: Network, ws: Workspace, n: int, splitter: Splitter) -> np.ndarray:
    """Run the forward pass on ``ws.x[:n]`` on ``splitter``'s threads; returns the logits
    view [n, classes].

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
        while splitter.threads > 1 and j < len(ops) and (ops[j].split or ops[j].view):
            task = ops[j].forward_task(model, ws, p, ws.acts[j][:n], n)
            if task is None:
                break
            tasks.append(task)
            p = ws.acts[j][:n]
            j += 1
        if len(tasks) > 1:
            splitter.run_chain(tasks, n)
            prev = p
            i = j
            continue
        out = ws.acts[i][:n]
        _forward_op(model, ws, i, ops[i], prev, out, n, splitter)
        prev = out
        i += 1
    return prev


def _forward_op(model: Network, ws: Workspace, i: int, op: IntLayer, prev: np.ndarray,
                out: np.ndarray, n: int, splitter: Splitter) -> None:
    """Layer i of the forward pass: ``out`` from ``prev`` (samples [:n])."""
    task = op.forward_task(model, ws, prev, out, n)
    if task is not None:
        splitter.run(task[0], task[1], n, split=op.split)
        return
    op.forward(model, ws, prev, out, n)


def train_step(model: Network, ws: Workspace, y: np.ndarray, n: int, lr_log2: int, seed: int,
               step: int, reg: Regularizer | None, splitter: Splitter) -> int:
    """One SGD step (see ``IntModel.train_step``); returns the integer loss sum."""
    z = forward(model, ws, n, splitter)
    e = ws.err_out[:n]
    if model.loss == "sse":
        sse = K.sse_error(z, y, model.target, e)
    else:
        sse = K.softmax_error(z, y, model.bits, model.ce_temp_shift, e)
    _backward(model, ws, e, n, _Step(lr_log2, seed, step, reg), splitter)
    return int(sse)


@dataclass(frozen=True)
class _Step:
    """What a training step's updates need besides the buffers."""

    lr_log2: int
    seed: int
    step: int
    reg: Regularizer | None


def _backward(model: Network, ws: Workspace, e: np.ndarray, n: int, st: _Step,
              splitter: Splitter) -> None:
    """The backward pass from the loss's error ``e`` [n, classes], in groups of tasks
    (``Splitter.run_group``: one hand-off each on several threads).

    Each weight layer's backward is a few stages (:class:`_ParamBackward`): its error
    (the max-pool's routing after it, or its error quantized before the stage; its input's
    error; the partial scales of the max-pool before it: all over samples), its weight
    gradient (in the first stage when the quantized error was ready before it), its
    update. The ops' stages overlap: the group that makes op i's error also runs the
    next stage of each op after it still running, which waits on nothing that group
    makes (docs/performance.md#several-cores). Within a group, tasks split alike
    (over the same samples) follow each other on the same thread: the max-pool's routed
    error, then the input's error from it, then the partial scales from that. The layers
    without weights (``IntLayer.backward``: ReLUs, flattens, pools whose error is not
    fused) run between groups, on the calling thread. Each layer's gradient has its own buffer (``ws.grads``): a group may
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
            if not op.needs_input_error:  # no weight layer before it
                i = -1
                break
            cur, kq = op.backward(model, ws, cur, kq, n, front)
            i -= 1
        if start is not None:
            stages = start.stages()
            running.append((stages, next(stages)))
        if not running:
            return
        splitter.run_group([t for _, tasks in running for t in tasks])
        running = [(stages, tasks) for stages, _ in running
                   if (tasks := next(stages, None)) is not None]
        if start is not None:
            front = start
            if start.dst is not None:
                cur = start.dst


class _ParamBackward:
    """The backward of weight layer i for batches of n samples as stages of tasks
    (:meth:`stages`; the layer makes its kernels' tasks, :class:`~.layers.base.ParamPass`
    is what they read here). Built once per workspace and n: the tasks hold the buffers'
    views; the weights, the error at the layer's output, the max-pool's scale and the
    step's values are read when they run (:meth:`begin` sets them). It holds no reference
    to the workspace (which holds it)."""

    def __init__(self, model: Network, ws: Workspace, i: int, n: int) -> None:
        op: IntWeightLayer = model.ops[i]  # type: ignore[assignment]
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
        # the fused max-pool reading dst (through views only): its scale in parts
        j = i - 1
        while j >= 0 and model.ops[j].view:
            j -= 1
        fused = self.dst is not None and j >= 0 and model.ops[j].fused_error
        self.scale_pool = j if fused else -1
        # the first stage's tasks follow each other over the same samples: all split, or
        # none where the input's error is one whole-batch kernel
        self.error_split = op.split and not op.input_error_whole(self)
        routed = i + 1 < len(model.ops) and model.ops[i + 1].fused_error
        self.route = model.ops[i + 1].route_task(self, ws) if routed else None
        self.prep = op.grad_input_tasks(self, ws)
        self.first = ([self.route] if self.route is not None else []) + self.prep
        self.scale: Task | None = None
        if self.dst is not None:
            self.first.append(op.input_error_task(self))
            if self.scale_pool >= 0:
                self.scale = model.ops[self.scale_pool].scale_task(self, ws)
                self.first.append(self.scale)
        self.grad = op.grad_task(self, ws, only_max=False)
        can_fuse = op.fuses_update(self)
        self.grad_max = op.grad_task(self, ws, only_max=True) if can_fuse else None
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

    def task(self, kernel: Callable[..., Any], args: Callable[[int, int, int], Sequence[Any]],
             total: int, align: int = 1, first: bool = False, split: bool | None = None,
             tag: int | None = None) -> Task:
        """A task of this layer (tagged with its index), split as the layer is (``first``:
        as its first stage is; ``split``: as given)."""
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
                self.op.ternary_copies()
                return
            grad = self.grad  # not the update's usual case: the gradient stored after all
            yield [grad]
            gmax = max(grad.results, default=-1)
        self._update_values(gmax)
        yield [self.update]
        self.op.ternary_copies()

    def _fused_update(self, ws: Workspace) -> Task:
        """The update with the gradient made again (``IntWeightLayer.fused_update_task``),
        at the shift and key :meth:`_fused_case` sets."""
        return self.op.fused_update_task(self, ws)

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
        model, op = self.model, self.op
        gf = self.g.reshape(-1)
        size = gf.shape[0]
        rows, cols = op.counter_layout()
        return self.task(K.sgd_update, lambda t, lo, hi: (
            op.w.reshape(-1), gf, self.gmax, self.st.lr_log2, model.wmax, model.thr,
            self.key, op.t.reshape(-1), self.extra_now, self.extra_shift, self.key2,
            rows, cols, lo, hi), size, cols if cols else UPDATE_ALIGN,
            split=size >= 1 << 16)

    def _update_values(self, gmax: int) -> None:
        """The update's max |G| (computed here when the gradient kernel did not report it),
        keys and the regularizer's numerators (made here, on the calling thread)."""
        st, p, w = self.st, self.p, self.op.w
        self.key = self.key2 = K.stream_key(st.seed, st.step, p, 0)
        self.extra_now, self.extra_shift = self.none, -1
        if st.reg is not None and st.reg.active:
            self.extra_now, self.extra_shift = self.extra, st.reg.shift
            self.key2 = K.stream_key(st.seed, st.step, p, 1)
            K.regularizer_terms(w.reshape(-1), st.reg.anchor[p].reshape(-1),
                                st.reg.mu_q, st.reg.d_shift, st.reg.step_g[p].reshape(-1),
                                st.reg.alpha_q, self.extra)
        self.gmax = gmax if gmax >= 0 else K.grad_max(self.g.reshape(-1))

