"""IntModel: an integer-only network built from a ``firmware_models`` spec.

One training step (:meth:`IntModel.train_step`) runs only the integer kernels of
:mod:`edge_client.intnn.kernels` on preallocated integer buffers (a :class:`Workspace`).

Formulas (docs/algorithms.md §1, s = compute bits, S(k) = 2^(k-1), s_g = max(s, 8)):

- forward: ``a' = clip(round_shift(sum t*a, 1 + log2 alpha), +-(S(s)-1))``, ReLU fused
  when the spec has a ReLU right after the layer; ``t = ternary(W)`` (|W| > S(s_g)/4);
- loss (output error): WAGE's SSE against ``target * onehot`` with ``target = S(s) - 1``
  (real ~1.0; 96-97% on digits against 91-94% with S(s)/4 or S(s)/2), the default; or an
  integer softmax cross-entropy, NITI style (:func:`kernels.softmax_error`: base-2
  softmax at temperature 2^-5, Q15 error). Measured on digits_cnn (7 seeds, 20 epochs,
  the last 6 at eta/8; float32 98.2%): SSE 97.1/96.3/96.3% (Int8/16/6), softmax
  96.9/97.3/96.8%. The softmax ends ~0.4 points higher on average, but one round of 12
  steps on a 360-sample shard often leaves it where it started (10-29% vs SSE's 10-39%),
  and a device gets short rounds: SSE stays the default. Either way the
  error is an integer array and goes through eq. 12 like every layer's error;
- error at every conv/linear output: ReLU mask (output activation <= 0), then
  eq. 12 quantization to s bits; errors flow back through the ternary weights;
- update: eq. 15-16 with ``eta = 2^(lr_shift + s_g - 8)`` LSBs, stochastic rounding from
  a counter-based SplitMix64 stream keyed by (seed, step, layer).

Internal layouts differ from the spec (NHWC activations, ``[K, K, C, O]`` conv weights,
the Linear after a Flatten with its columns in (h, w, c) order); the conversions are
exact permutations done at the boundary (:meth:`load_int`, :meth:`int_weights`).
The stochastic-rounding counter ``j`` enumerates a layer's weights in that internal layout.
"""

from __future__ import annotations

import numpy as np

from edge_client.errors import ConfigError, TrainingError
from edge_client.intnn import kernels as K
from edge_client.intnn.ops import Op, Regularizer, Workspace, internal_shape, plane_len
from edge_client.intnn.quant import (
    DEFAULT_CLIP,
    act_dtype,
    act_max,
    alpha_shifts,
    check_bits,
    from_shared,
    storage_grid_bits,
    ternary_threshold,
    to_shared,
    weight_dtype,
    weight_max,
)
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU

INT32_LIMIT = (1 << 31) - 1
INT16_LIMIT = (1 << 15) - 1
DEFAULT_CE_TEMP_SHIFT = 5  # softmax temperature 2^-5 on the real logits (measured, see docs)
GROUP_PIXELS = 4096  # output pixels per im2col group when evaluating (memory bound)
PIXEL_BLOCK = 2048   # output pixels accumulated at a time by the conv forward (L1-sized)
PLANE_BLOCK = 1024   # plane positions accumulated at a time by the stride-1 conv forward
PLANE_GRAD_GROUP = 8  # samples per copy of plane runs in the dot-product conv gradient
# conv weight gradient from the non-zero errors when a patch row (K*C values) is at least
# this long (short rows do not vectorize: the dense dot products are faster there)
SPARSE_GRAD_MIN_ROW = 32


class IntModel:
    """Integer weights, their ternary copies and the integer forward/backward/update.

    ``bits``: compute bitwidth s (2..16); ``clip``: weight clip in the real domain.
    """

    def __init__(self, spec: ModelSpec, bits: int, clip: float = DEFAULT_CLIP,
                 conv_impl: str = "col", loss: str = "sse",
                 ce_temp_shift: int = DEFAULT_CE_TEMP_SHIFT) -> None:
        if conv_impl not in ("col", "sparse"):
            raise ConfigError(f"conv_impl must be 'col' or 'sparse', got {conv_impl!r}")
        if loss not in ("ce", "sse"):
            raise ConfigError(f"loss must be 'ce' or 'sse', got {loss!r}")
        if not 0 <= ce_temp_shift <= 12:
            raise ConfigError(f"ce_temp_shift must be in 0..12, got {ce_temp_shift}")
        self.loss = loss
        self.ce_temp_shift = int(ce_temp_shift)
        self.conv_impl = conv_impl
        self.spec = spec
        self.bits = check_bits(bits)
        self.grid_bits = storage_grid_bits(bits)
        self.clip = clip
        self.amax = act_max(bits)
        self.adtype = act_dtype(bits)
        self.wdtype = weight_dtype(bits)
        self.wmax = weight_max(bits, clip)
        self.thr = ternary_threshold(bits)
        self.target = self.amax  # one-hot target: the largest activation (real ~ 1.0)
        self._alpha = alpha_shifts(spec)
        self.ops = self._build_ops()
        self.param_ops = [op for op in self.ops if op.param >= 0]
        self.internal_shapes = [self._internal_weight_shape(op) for op in self.param_ops]
        self.w = [np.zeros(s, self.wdtype) for s in self.internal_shapes]
        self.t = [np.zeros(s, np.int8) for s in self.internal_shapes]
        # conv ternary weights again in [O, K, K, C] for backward-data (None for linear)
        self.tb = [np.zeros((s[3], s[0], s[1], s[2]), np.int8) if op.kind == "conv" else None
                   for op, s in zip(self.param_ops, self.internal_shapes, strict=True)]
        # stride-1 convs: per output channel, the indices of the +1 then the -1 weights
        self.tlist = [np.zeros((s[3], s[0] * s[1] * s[2]), np.int32) if op.plane else None
                      for op, s in zip(self.param_ops, self.internal_shapes, strict=True)]
        self.tcnt = [np.zeros((s[3], 2), np.int32) if op.plane else None
                     for op, s in zip(self.param_ops, self.internal_shapes, strict=True)]
        self._workspaces: dict[bool, Workspace] = {}

    # ------------------------------------------------------------------ structure

    def _build_ops(self) -> list[Op]:
        spec = self.spec
        layers = spec.layers
        shapes = spec.activation_shapes
        ops: list[Op] = []
        param = 0
        pending_perm: np.ndarray | None = None
        i = 0
        while i < len(layers):
            layer = layers[i]
            in_s, out_s = internal_shape(shapes[i]), internal_shape(shapes[i + 1])
            if isinstance(layer, (Conv2d, Linear)):
                relu = i + 1 < len(layers) and isinstance(layers[i + 1], ReLU)
                kind = "conv" if isinstance(layer, Conv2d) else "linear"
                op = Op(kind, layer, in_s, out_s, param=param, relu=relu,
                         shift=1 + self._alpha[param])
                if kind == "linear":
                    op.perm = pending_perm
                    pending_perm = None
                ops.append(op)
                param += 1
                i += 2 if relu else 1
                continue
            if isinstance(layer, MaxPool2d):
                ops.append(Op("pool", layer, in_s, out_s))
            elif isinstance(layer, ReLU):
                ops.append(Op("relu", layer, in_s, out_s))
            elif isinstance(layer, Flatten):
                if len(shapes[i]) == 3:
                    c, h, w = shapes[i]
                    pending_perm = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel()
                ops.append(Op("flatten", layer, in_s, out_s))
            else:  # pragma: no cover - the spec module has no other layer kinds
                raise ConfigError(f"{spec.name}: unsupported layer {layer!r}")
            i += 1
        # errors are needed at the input of every op that has a parameter op before it
        for j, op in enumerate(ops):
            op.needs_input_error = any(o.param >= 0 for o in ops[:j])
        return ops

    def _internal_weight_shape(self, op: Op) -> tuple[int, ...]:
        layer = op.layer
        if op.kind == "conv":
            return (layer.kernel, layer.kernel, layer.in_channels, layer.out_channels)
        return (layer.out_features, layer.in_features)

    # ------------------------------------------------------------------ weights

    def _to_internal(self, op: Op, w: np.ndarray) -> np.ndarray:
        if op.kind == "conv":
            return np.ascontiguousarray(w.transpose(2, 3, 1, 0))
        if op.perm is not None:
            return np.ascontiguousarray(w[:, op.perm])
        return np.ascontiguousarray(w)

    def _to_spec(self, op: Op, w: np.ndarray) -> np.ndarray:
        if op.kind == "conv":
            return np.ascontiguousarray(w.transpose(3, 2, 0, 1))
        if op.perm is not None:
            out = np.empty_like(w)
            out[:, op.perm] = w
            return out
        return w.copy()

    def load_int(self, int_weights: list[np.ndarray]) -> None:
        """Set the weights from integers on this device's grid, spec layout and order."""
        shapes = self.spec.param_shapes()
        if len(int_weights) != len(shapes):
            raise TrainingError(f"{self.spec.name}: expected {len(shapes)} weight tensors, "
                                f"got {len(int_weights)}")
        for i, (q, shape, op) in enumerate(zip(int_weights, shapes, self.param_ops, strict=True)):
            q = np.asarray(q)
            if tuple(q.shape) != tuple(shape):
                raise TrainingError(f"{self.spec.name}: weight {i} ({op.layer.name}) has shape "
                                    f"{list(q.shape)}, expected {list(shape)}")
            if q.dtype.kind not in "iu":
                raise TrainingError(f"{op.layer.name}: integer weights expected, got {q.dtype}")
            if q.size and (int(q.max()) > self.wmax or int(q.min()) < -self.wmax):
                raise TrainingError(f"{op.layer.name}: weights exceed the clip bound {self.wmax}")
            self.w[i][...] = self._to_internal(op, q.astype(self.wdtype))
            K.ternarize(self.w[i].reshape(-1), self.thr, self.t[i].reshape(-1))
            self._ternary_copies(i)

    def _ternary_copies(self, p: int) -> None:
        """Refresh the derived copies of ternary weights p (backward layout, run lists)."""
        if self.tb[p] is not None:
            K.transpose_kkco_okkc(self.t[p], self.tb[p])
            if self.tlist[p] is not None:
                K.ternary_lists(self.tb[p], self.tlist[p], self.tcnt[p])

    def load_shared(self, weights: list[np.ndarray]) -> None:
        """Set the weights from the shared float domain (``round(W * S(s_g))``)."""
        shapes = self.spec.param_shapes()
        if len(weights) != len(shapes):
            raise TrainingError(f"{self.spec.name}: expected {len(shapes)} weight tensors, "
                                f"got {len(weights)}")
        for i, (w, shape) in enumerate(zip(weights, shapes, strict=True)):
            if tuple(np.shape(w)) != tuple(shape):
                raise TrainingError(f"{self.spec.name}: weight {i} has shape "
                                    f"{list(np.shape(w))}, expected {list(shape)}")
        self.load_int(from_shared(weights, self.bits, self.clip))

    def int_weights(self) -> list[np.ndarray]:
        """The device's own integers, spec layout and order (copies)."""
        return [self._to_spec(op, w) for op, w in zip(self.param_ops, self.w, strict=True)]

    def to_shared(self) -> list[np.ndarray]:
        """float32 shared-domain weights, exact on the grid."""
        return to_shared(self.int_weights(), self.bits)

    def ternary_weights(self) -> list[np.ndarray]:
        """The ternary forward weights ``t`` (int8 in {-1, 0, 1}), spec layout and order
        (copies); ``t = +1`` stands for ``quant.TERNARY_WEIGHT`` in the shared domain."""
        return [self._to_spec(op, t) for op, t in zip(self.param_ops, self.t, strict=True)]

    # ------------------------------------------------------------------ buffers

    def grad_needs_int64(self, op: Op, batch: int) -> bool:
        """True when sum of batch*pixels products of s-bit errors and activations may
        exceed int32."""
        pixels = int(np.prod(op.out_shape[:-1])) if op.kind == "conv" else 1
        return self.amax * self.amax * batch * pixels > INT32_LIMIT

    def _grad_mode(self, op: Op, batch: int) -> str:
        """Which kernel computes this conv's weight gradient for ``batch`` samples."""
        if self.grad_needs_int64(op, batch):
            return "int64"
        if op.layer.kernel * op.layer.in_channels >= SPARSE_GRAD_MIN_ROW:
            return "sparse"
        if op.plane and self.conv_impl == "col":
            return "plane"
        return "dot"

    def workspace(self, capacity: int, train: bool = True) -> Workspace:
        """Buffers for batches of up to ``capacity`` samples (cached per capacity)."""
        ws = self._workspaces.get(train)
        if ws is not None and ws.capacity == capacity:
            return ws
        self._workspaces.pop(train, None)  # one workspace per kind: release the old one
        n = capacity
        ad = self.adtype
        x = np.zeros((n, *internal_shape(self.spec.input_shape)), ad)
        acts: list[np.ndarray] = []
        idx: list[np.ndarray | None] = []
        eq: list[np.ndarray | None] = []
        err_in: list[np.ndarray | None] = []
        patch: list[np.ndarray | None] = []
        pbuf: list[np.ndarray | None] = []
        gacc: list[np.ndarray | None] = []
        col_t: list[np.ndarray | None] = []
        pacc: list[np.ndarray | None] = []
        pacc16: list[np.ndarray | None] = []
        ptile: list[np.ndarray | None] = []
        plane: list[np.ndarray | None] = []
        offs: list[np.ndarray | None] = []
        a_pad: list[np.ndarray | None] = []
        gt: list[np.ndarray | None] = []
        e_t: list[np.ndarray | None] = []
        prev = x
        g32 = g64 = 0
        for op in self.ops:
            if op.kind == "flatten":
                out = prev.reshape(n, *op.out_shape)
            else:
                out = np.zeros((n, *op.out_shape), ad)
            acts.append(out)
            # max-pool winners are needed by backward only; evaluation passes a 1-cell dummy
            idx.append(None if op.kind != "pool" else
                       np.zeros((n, *op.out_shape) if train else (1, 1, 1, 1), np.int32))
            is_param = op.param >= 0
            eq.append(np.zeros((n, *op.out_shape), ad) if (train and is_param) else None)
            err_in.append(np.zeros((n, *op.in_shape), np.int32)
                          if (train and op.needs_input_error and op.kind != "flatten"
                              and op.kind != "relu") else None)
            use_plane = op.plane and self.conv_impl == "col"
            if op.kind == "conv":
                r = op.layer.kernel * op.layer.kernel * op.layer.in_channels
                pix = op.out_shape[0] * op.out_shape[1]
                h, w, c = op.in_shape
                pad = op.layer.padding
                gmode = self._grad_mode(op, n) if (train and is_param) else ""
                if gmode:
                    op.grad_mode = gmode
                if use_plane:
                    # the weight gradient copies runs of Ho * (W + pad) positions per sample,
                    # PLANE_GRAD_GROUP samples at a time
                    cols = (min(n, PLANE_GRAD_GROUP) * op.out_shape[0] * (w + pad)
                            if gmode == "plane" else 0)
                    block = PLANE_BLOCK
                    plane.append(np.zeros((c, plane_len(n, h, w, op.layer.padding)), ad))
                    offs.append(np.zeros(r, np.int32))
                else:
                    # training keeps the whole batch's im2col for the weight gradient
                    cols = pix * (n if train else max(1, min(n, GROUP_PIXELS // pix)))
                    block = min(cols, PIXEL_BLOCK)
                    plane.append(None)
                    offs.append(None)
                col_t.append(np.zeros((r, cols), ad))
                sparse = gmode == "sparse"
                a_pad.append(np.zeros((n, h + 2 * pad, w + 2 * pad, c), ad) if sparse else None)
                gt.append(np.zeros((op.layer.out_channels, r), np.int32) if sparse else None)
                pacc.append(np.zeros(block, np.int32))
                pacc16.append(np.zeros(block if self.amax <= 127 else 0, np.int16))
                ptile.append(np.zeros((op.layer.out_channels, block), ad))
                patch.append(np.zeros(op.layer.out_channels, np.int32))
                # backward-data scratch: int16 when sum_o |eq| <= O * amax cannot overflow it
                narrow_bd = op.layer.out_channels * self.amax <= INT16_LIMIT
                pbuf.append(np.zeros(r, np.int16 if narrow_bd else np.int32) if train else None)
            else:
                plane.append(None)
                offs.append(None)
                a_pad.append(None)
                gt.append(None)
                col_t.append(None)
                pacc.append(None)
                pacc16.append(None)
                ptile.append(None)
                # linear: int32 [N, O] dot-product accumulators of the forward
                patch.append(np.zeros((n, op.out_shape[0]), np.int32)
                             if op.kind == "linear" else None)
                pbuf.append(None)
            if train and is_param:
                size = int(np.prod(self.internal_shapes[op.param]))
                op.grad_int64 = self.grad_needs_int64(op, n)
                if op.grad_int64:
                    g64 = max(g64, size)
                else:
                    g32 = max(g32, size)
                if op.kind == "conv":
                    gacc.append(np.zeros(op.layer.out_channels,
                                         np.int64 if op.grad_int64 else np.int32))
                    # dot-product gradients (int32) use col_t: errors of the same pixels
                    e_t.append(np.zeros((op.layer.out_channels, col_t[-1].shape[1]), ad)
                               if gmode in ("plane", "dot") else None)
                else:
                    gacc.append(None)
                    e_t.append(None)
            else:
                gacc.append(None)
                e_t.append(None)
            prev = out
        max_param = max((int(np.prod(s)) for s in self.internal_shapes), default=0)
        ws = Workspace(
            capacity=n, x=x, acts=acts, idx=idx, eq=eq, err_in=err_in,
            err_out=np.zeros((n, self.spec.num_classes), np.int32) if train else
            np.zeros((0, 0), np.int32),
            patch=patch, pbuf=pbuf, gacc=gacc, col_t=col_t, e_t=e_t,
            pacc=pacc, pacc16=pacc16, ptile=ptile, plane=plane, offs=offs, a_pad=a_pad, gt=gt,
            grad32=np.zeros(g32, np.int32), grad64=np.zeros(g64, np.int64),
            extra=np.zeros(max_param if train else 0, np.int64), train=train,
        )
        self._check_bounds()
        self._workspaces[train] = ws
        return ws

    def eval_workspace(self, capacity: int) -> Workspace:
        """Buffers for forward passes: the training workspace when there is one (no extra
        memory), else a forward-only one for ``capacity`` samples."""
        ws = self._workspaces.get(True)
        return ws if ws is not None else self.workspace(capacity, train=False)

    def _check_bounds(self) -> None:
        """int32 forward/backward accumulators must not overflow for this spec and s."""
        for op in self.param_ops:
            fan_in = op.layer.fan_in
            if fan_in * self.amax > INT32_LIMIT:
                raise ConfigError(f"{op.layer.name}: fan-in {fan_in} overflows int32 at "
                                  f"{self.bits} bits")
            fan_out = (op.layer.out_channels * op.layer.kernel ** 2 if op.kind == "conv"
                       else op.layer.out_features)
            if fan_out * self.amax * 4 > INT32_LIMIT:
                raise ConfigError(f"{op.layer.name}: fan-out {fan_out} overflows int32 at "
                                  f"{self.bits} bits")

    def prepare_inputs(self, x: np.ndarray) -> np.ndarray:
        """float images [N, C, H, W] in [0, 1] -> s-bit integers in the engine layout.

        Data loading (the one place the integer path touches floats).
        """
        from edge_client.data import quantize_images

        expected = tuple(self.spec.input_shape)
        if tuple(x.shape[1:]) != expected:
            raise TrainingError(f"{self.spec.name}: input samples have shape "
                                f"{list(x.shape[1:])}, expected {list(expected)}")
        q = quantize_images(x, self.bits)
        if q.ndim == 4:
            return np.ascontiguousarray(q.transpose(0, 2, 3, 1))
        return np.ascontiguousarray(q)

    # ------------------------------------------------------------------ compute

    def forward(self, ws: Workspace, n: int) -> np.ndarray:
        """Run the forward pass on ``ws.x[:n]``; returns the logits view [n, classes]."""
        prev = ws.x[:n]
        for i, op in enumerate(self.ops):
            out = ws.acts[i][:n]
            if op.kind == "conv":
                lay = op.layer
                if self.conv_impl == "col" and op.plane:
                    K.conv_forward_plane(prev, self.tlist[op.param], self.tcnt[op.param],
                                         lay.kernel, lay.padding, op.shift, self.amax, op.relu,
                                         out, ws.plane[i], ws.offs[i], ws.pacc[i], ws.pacc16[i],
                                         ws.ptile[i])
                elif self.conv_impl == "col":
                    K.conv_forward_col(prev, self.tb[op.param], lay.stride, lay.padding,
                                       op.shift, self.amax, op.relu, out, ws.col_t[i],
                                       ws.pacc[i], ws.pacc16[i], ws.ptile[i])
                else:
                    K.conv_forward(prev, self.t[op.param], lay.stride, lay.padding, op.shift,
                                   self.amax, op.relu, out, ws.patch[i])
            elif op.kind == "linear":
                K.linear_forward(prev, self.t[op.param], op.shift, self.amax, op.relu, out,
                                 ws.patch[i])
            elif op.kind == "pool":
                lay = op.layer
                K.maxpool_forward(prev, lay.kernel, lay.step, lay.padding, out,
                                  ws.idx[i][:n] if ws.train else ws.idx[i], ws.train)
            elif op.kind == "relu":
                K.relu_forward(prev.reshape(-1), out.reshape(-1))
            prev = out
        return prev

    def train_step(self, ws: Workspace, y: np.ndarray, n: int, lr_log2: int, seed: int,
                   step: int, reg: Regularizer | None = None) -> int:
        """One SGD step on ``ws.x[:n]`` with labels ``y`` (int64 [n]); returns the integer
        loss sum (SSE, or sum of 2^15 - p_true in Q15 for the softmax loss).

        ``lr_log2``: log2 of eta in LSBs of the storage grid; ``seed``/``step`` key the
        stochastic rounding.
        """
        z = self.forward(ws, n)
        e = ws.err_out[:n]
        if self.loss == "sse":
            sse = K.sse_error(z, y, self.target, e)
        else:
            sse = K.softmax_error(z, y, self.bits, self.ce_temp_shift, e)
        cur = e
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            if op.kind == "flatten":
                cur = cur.reshape(n, *op.in_shape)
                continue
            if op.kind == "relu":
                K.relu_mask(cur.reshape(-1), ws.acts[i][:n].reshape(-1))
                continue
            if op.kind == "pool":
                if not op.needs_input_error:
                    break
                dst = ws.err_in[i][:n]
                K.maxpool_backward(cur, ws.idx[i][:n], dst)
                cur = dst
                continue
            # conv / linear
            p = op.param
            out_act = ws.acts[i][:n]
            if op.relu:
                K.relu_mask(cur.reshape(-1), out_act.reshape(-1))
            eq = ws.eq[i][:n]
            K.quantize_error(cur.reshape(-1), self.bits, eq.reshape(-1))
            a_in = ws.acts[i - 1][:n] if i > 0 else ws.x[:n]
            size = self.w[p].size
            g = (ws.grad64 if op.grad_int64 else ws.grad32)[:size].reshape(self.w[p].shape)
            if op.kind == "conv":
                lay = op.layer
                if op.grad_mode == "int64":
                    K.conv_weight_grad(eq, a_in, lay.stride, lay.padding, g, ws.gacc[i])
                elif op.grad_mode == "sparse":
                    K.conv_weight_grad_sparse(eq, a_in, lay.stride, lay.padding, g, ws.a_pad[i],
                                              ws.gt[i])
                elif op.grad_mode == "plane":
                    K.conv_weight_grad_plane(eq, a_in, lay.kernel, lay.padding, g, ws.plane[i],
                                             ws.col_t[i], ws.e_t[i], True)
                else:
                    K.conv_weight_grad_dot(eq, a_in, lay.stride, lay.padding, g, ws.col_t[i],
                                           ws.e_t[i], self.conv_impl == "col")
                if op.needs_input_error:
                    dst = ws.err_in[i][:n]
                    if ws.pbuf[i].dtype == np.int16:
                        K.conv_backward_data_narrow(eq, self.tb[p], lay.stride, lay.padding,
                                                    dst, ws.pbuf[i])
                    else:
                        K.conv_backward_data(eq, self.tb[p], lay.stride, lay.padding, dst,
                                             ws.pbuf[i])
                    cur = dst
            else:
                K.linear_weight_grad(eq, a_in.reshape(n, -1), g)
                if op.needs_input_error:
                    dst = ws.err_in[i][:n]
                    K.linear_backward_data(eq, self.t[p], dst.reshape(n, -1))
                    cur = dst
            key = K.stream_key(seed, step, p, 0)
            wf = self.w[p].reshape(-1)
            if reg is not None and reg.active:
                extra = ws.extra[:size]
                K.regularizer_terms(wf, reg.anchor[p].reshape(-1), reg.mu_q, reg.d_shift,
                                    reg.step_g[p].reshape(-1), reg.alpha_q, extra)
                K.sgd_update(wf, g.reshape(-1), lr_log2, self.wmax, self.thr, key,
                             self.t[p].reshape(-1), extra, reg.shift,
                             K.stream_key(seed, step, p, 1))
            else:
                K.sgd_update(wf, g.reshape(-1), lr_log2, self.wmax, self.thr, key,
                             self.t[p].reshape(-1), ws.extra[:0], -1, key)
            self._ternary_copies(p)
            if not op.needs_input_error:
                break
        return int(sse)
