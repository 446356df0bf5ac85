"""Int8 dot products on x86's AVX-512 VNNI: ``vpdpbusd`` multiplies 64 unsigned by 64
signed bytes and adds them in fours to 16 int32 lanes, 64 multiply-accumulates an
instruction (four times an int32 multiply's lanes, and no widening of the bytes).

LLVM does not produce ``vpdpbusd`` from a loop by itself (Numba's loops over int8 products
become 16-lane ``vpmulld``), so :func:`_dot_block` emits it through LLVM's intrinsic: an
A x B block of dot products of byte rows, each row read once per 64 bytes for all the
products it takes part in. The unsigned operand is the activation side with its sign bit
flipped (``a ^ 0x80 = a + 128`` in [0, 255] for every int8 ``a``), so any int8 works; the
caller subtracts ``128 * sum(b)``. The instruction wraps (no saturation), so the result is
exact modulo 2^32, hence exact whenever the true sum fits in int32 (the engine's bounds).

:data:`AVAILABLE` says whether the CPU Numba compiles for has the instruction; the
kernels here are only typed and compiled when it does (``step`` picks them, the others
stay the reference and the fallback: Arm's ``sdot`` would be the same idea, not done).
Results are bit-identical to the generic kernels (tests/test_intnn_vnni.py).

- :func:`conv_weight_grad_plane_vnni`: :func:`~.conv_backward.conv_weight_grad_plane`;
- :func:`conv_forward_vnni`: the conv forward straight from the zero-padded input (no
  im2col): four input bytes broadcast x the ternary weights packed in fours per kernel
  row (:func:`pad_rows`), 4 pixels x 64 channels a block with no reduction across lanes;
  :func:`plane_for_grad` makes the planar input a stride-1 conv's VNNI gradient reads;
- :func:`conv_weight_grad_sparse_vnni`: the error-driven conv weight gradient, four errors'
  patches interleaved (:func:`_interleave4_dot`);
- :func:`linear_backward_data_vnni`: :func:`~.linear.linear_backward_data` for O >= 64;
- :func:`linear_weight_grad_vnni`: :func:`~.linear.linear_weight_grad` for O a multiple of
  64 (:func:`_outer_block`: four samples' products per instruction into 16 outputs' lanes);
  :func:`linear_grad_max_vnni` + :func:`linear_update_vnni`: the same gradient's max, then
  the stochastic update with the gradient made again two rows at a time: a 512 x 4096
  layer's 8 MB int32 gradient is never written and read back (the step is memory-bound
  there, most of all on several cores).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from edge_client.intnn.kernels.layout import _pad_nhwc, _to_plane
from edge_client.intnn.kernels.rng import _GOLDEN
from edge_client.intnn.kernels.update import _update_rows

U = np.uint64
VEC = 64  # bytes a vpdpbusd takes from each operand
DISABLE_ENV = "FEDBIT_NO_VNNI"  # "1": use the generic kernels (A/B, the fallback's tests)


def _target_has_vnni() -> bool:
    """True when Numba compiles for a CPU with AVX-512 VNNI and BW (the host, unless
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    try:
        import llvmlite.binding as llvm

        if config.CPU_FEATURES is not None:
            feats = config.CPU_FEATURES
        elif config.CPU_NAME not in (None, "host"):
            return False  # a named portable target: do not assume the instruction
        else:
            feats = llvm.get_host_cpu_features().flatten()
    except Exception:  # noqa: BLE001 (no LLVM host query: the generic kernels)
        return False
    return "+avx512vnni" in feats and "+avx512bw" in feats


AVAILABLE = _target_has_vnni()


@intrinsic
def _dot_block(typingctx, a, a_offs, b, b_offs, n64):  # pragma: no cover (compiled)
    """sum_{q < 64*n64} (a[ia + q] ^ 0x80) * b[ib + q] for every ia in a_offs x ib in
    b_offs (flat int8 arrays, UniTuples of offsets): a UniTuple(int32) in that order,
    row-major over (a_offs, b_offs), wrapped modulo 2^32."""
    if not (isinstance(a, types.Array) and isinstance(b, types.Array)
            and a.dtype == types.int8 and b.dtype == types.int8
            and isinstance(a_offs, types.UniTuple) and isinstance(b_offs, types.UniTuple)):
        return None
    na, nb = a_offs.count, b_offs.count
    ret = types.UniTuple(types.int32, na * nb)
    sig = ret(a, a_offs, b, b_offs, n64)

    def codegen(context, builder, signature, args):
        a_, ao_, b_, bo_, n_ = args
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        v64 = ir.VectorType(ir.IntType(8), VEC)
        v16 = ir.VectorType(ir.IntType(32), 16)
        a_base = builder.bitcast(context.make_array(signature.args[0])(
            context, builder, a_).data, i8p)
        b_base = builder.bitcast(context.make_array(signature.args[2])(
            context, builder, b_).data, i8p)

        def as_i64(v):
            return builder.sext(v, i64) if v.type.width < 64 else v

        a_offs_v = [as_i64(builder.extract_value(ao_, i)) for i in range(na)]
        b_offs_v = [as_i64(builder.extract_value(bo_, i)) for i in range(nb)]
        nbytes = builder.mul(as_i64(n_), ir.Constant(i64, VEC))
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.x86.avx512.vpdpbusd.512")
        red = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), [v16]), "llvm.vector.reduce.add.v16i32")
        flip = ir.Constant(v64, [0x80] * VEC)
        zero = ir.Constant(v16, None)
        pre = builder.block
        loop = builder.append_basic_block("vnni.loop")
        done = builder.append_basic_block("vnni.done")
        builder.cbranch(builder.icmp_signed(">", nbytes, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        q = builder.phi(i64)
        q.add_incoming(ir.Constant(i64, 0), pre)
        accs = []
        for _ in range(na * nb):
            p = builder.phi(v16)
            p.add_incoming(zero, pre)
            accs.append(p)

        def load(base, off):
            ptr = builder.gep(base, [builder.add(off, q)])
            return builder.load(builder.bitcast(ptr, v64.as_pointer()), align=1)

        av = [builder.bitcast(builder.xor(load(a_base, o), flip), v16) for o in a_offs_v]
        bv = [builder.bitcast(load(b_base, o), v16) for o in b_offs_v]
        new = [builder.call(dp, [accs[i * nb + j], av[i], bv[j]])
               for i in range(na) for j in range(nb)]
        q_next = builder.add(q, ir.Constant(i64, VEC))
        end = builder.block
        q.add_incoming(q_next, end)
        for p, v in zip(accs, new):
            p.add_incoming(v, end)
        builder.cbranch(builder.icmp_signed("<", q_next, nbytes), loop, done)
        builder.position_at_end(done)
        outs = []
        for v in new:
            ph = builder.phi(v16)
            ph.add_incoming(zero, pre)
            ph.add_incoming(v, end)
            outs.append(ph)
        return context.make_tuple(builder, ret, [builder.call(red, [ph]) for ph in outs])

    return sig, codegen


def padded(r: int, unit: int = VEC) -> int:
    """r rounded up to a multiple of ``unit`` (64 bytes: whole vectors)."""
    return -(-r // unit) * unit


@njit(cache=True, nogil=True)
def pad_rows(tb, tp, corr):
    """Conv ternary weights [O, K, K, C] (``tb``) packed for :func:`conv_forward_vnni`:
    each kernel row's K*C weights (kw, c) in ng = ceil(K*C / 4) groups of four, zeros past
    K*C; tp [K*ng, Op, 4] holds group g = kh*ng + q of channel o at (g, o, :) (channels
    padded with zeros to Op, a multiple of 16), and corr [Op] int32 = 128 x each channel's
    weight sum (the flip's correction)."""
    n_out = tb.shape[0]
    k = tb.shape[1]
    seg = tb.shape[2] * tb.shape[3]
    ng = tp.shape[0] // k
    n_op = tp.shape[1]
    tp[...] = 0
    corr[...] = 0
    for o in range(n_out):
        s = 0
        for kh in range(k):
            row = tb[o, kh].reshape(-1)
            for b in range(seg):
                v = row[b]
                tp[kh * ng + b // 4, o, b % 4] = v
                s += v
        corr[o] = np.int32(s * 128)
    for o in range(n_out, n_op):
        corr[o] = 0


@njit(cache=True, nogil=True)
def conv_weight_grad_plane_vnni(eqp, plane, offs, n_pos, g_out, r0, r1):
    """:func:`~.conv_backward.conv_weight_grad_plane` (same arguments, same G and max |G|)
    with vpdpbusd: two weight rows x four output channels per pass over the positions,
    the last n_pos % 64 positions in plain integers."""
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    pf = plane.reshape(-1)
    ef = eqp.reshape(-1)
    le = eqp.shape[1]
    n64 = n_pos // VEC
    tail = n64 * VEC
    corr = np.zeros(n_out, np.int32)  # 128 x each channel's error sum: the flip's correction
    for o in range(n_out):
        s = np.int32(0)
        for q in range(tail):
            s = np.int32(s + np.int32(ef[U(o * le + q)]))
        corr[o] = np.int32(s * 128)
    last = n_out - 1
    for o in range(0, n_out, 4):
        # four output channels a pass (the last pass repeats the last channel when fewer)
        oc = (o, min(o + 1, last), min(o + 2, last), min(o + 3, last))
        eo = (oc[0] * le, oc[1] * le, oc[2] * le, oc[3] * le)
        for r in range(r0, r1, 2):
            rb = min(r + 1, r1 - 1)
            pa = offs[r]
            pb = offs[rb]
            s = _dot_block(pf, (pa, pb), ef, eo, n64)
            for j in range(4):
                a = np.int32(s[j] - corr[oc[j]])
                b = np.int32(s[4 + j] - corr[oc[j]])
                for q in range(tail, n_pos):
                    x = np.int32(ef[U(eo[j] + q)])
                    a = np.int32(a + np.int32(pf[U(pa + q)]) * x)
                    b = np.int32(b + np.int32(pf[U(pb + q)]) * x)
                g2[r, oc[j]] = a
                g2[rb, oc[j]] = b
    gmax = np.int64(0)
    for r in range(r0, r1):
        for o in range(n_out):
            v = np.int64(g2[r, o])
            v = -v if v < 0 else v
            gmax = v if v > gmax else gmax
    return gmax


@njit(cache=True, nogil=True, inline="always")
def _pixel_base(p, p_last, n_pix, w_out, hp, wpp, c_in, stride):
    """Offset in the padded input of output pixel p's patch (p clamped to p_last)."""
    p = min(p, p_last)
    n = p // n_pix
    rem = p - n * n_pix
    y = rem // w_out
    x = rem - y * w_out
    return ((n * hp + y * stride) * wpp + x * stride) * c_in


@njit(cache=True, nogil=True)
def conv_forward_vnni(a, tp, corr, k, stride, pad, shift, amax, relu, out, a_pad, acc, n0, n1):
    """The conv forward (:func:`~.conv_forward.conv_forward`'s result) for samples
    n0 <= n < n1 with vpdpbusd, straight from the zero-padded input (no im2col): their
    input is first padded into ``a_pad`` ([N, H+2p, W+2p, C], zero borders; the
    error-driven weight gradient reads it too; at least 3 bytes must follow it in memory:
    a kernel row is read in groups of four), then every 4 output pixels x 64 (or 32, 16)
    channels: four input bytes broadcast x the packed weights ``tp`` [K*ng, Op, 4]
    (:func:`pad_rows`, its correction ``corr``) add into 16 channels' lanes per
    instruction, kernel row after kernel row, into ``acc`` int32 [B * Op] scratch (B
    pixels at a time, a multiple of 4); then ``clip(round_shift(sum, shift), +-amax)``
    (ReLU'd if relu) writes NHWC ``out``. A group past a kernel row's K*C bytes reads the
    next bytes of the input, whose weights are zero."""
    _pad_nhwc(a, pad, a_pad, n0, n1)
    hp = a_pad.shape[1]
    wpp = a_pad.shape[2]
    c_in = a.shape[3]
    h_out = out.shape[1]
    w_out = out.shape[2]
    n_out = out.shape[3]
    n_op = tp.shape[1]
    ng = tp.shape[0] // k
    row_bytes = wpp * c_in
    jump = row_bytes - 4 * ng  # from the end of one kernel row's groups to the next row
    block = acc.shape[0] // n_op
    tf = tp.reshape(-1)
    pf = a_pad.reshape(-1)
    of = out.reshape(-1)
    n_pix = h_out * w_out
    p_last = n1 * n_pix - 1
    o64 = n_op - n_op % 64
    lo = 0 if relu else -amax
    half = (np.int64(1) << (shift - 1)) if shift > 0 else np.int64(0)
    for p0 in range(n0 * n_pix, p_last + 1, block):
        m = min(p_last + 1, p0 + block) - p0
        for j in range(0, m, 4):  # a last group past m repeats the last pixel: not written
            q = p0 + j
            rows = (_pixel_base(q, p_last, n_pix, w_out, hp, wpp, c_in, stride),
                    _pixel_base(q + 1, p_last, n_pix, w_out, hp, wpp, c_in, stride),
                    _pixel_base(q + 2, p_last, n_pix, w_out, hp, wpp, c_in, stride),
                    _pixel_base(q + 3, p_last, n_pix, w_out, hp, wpp, c_in, stride))
            dst = (j * n_op, (j + 1) * n_op, (j + 2) * n_op, (j + 3) * n_op)
            for o in range(0, o64, 64):
                _outer_block(pf, rows, k * ng, tf, n_op * 4, (o, o + 16, o + 32, o + 48), corr,
                             acc, dst, ng, jump)
            o = o64
            if o + 32 <= n_op:
                _outer_block(pf, rows, k * ng, tf, n_op * 4, (o, o + 16), corr, acc, dst, ng,
                             jump)
                o += 32
            if o < n_op:
                _outer_block(pf, rows, k * ng, tf, n_op * 4, (o,), corr, acc, dst, ng, jump)
        for j in range(m):  # branch-free finish, as conv_forward_plane's (vectorizes)
            ob = (p0 + j) * n_out
            ab = j * n_op
            for o in range(n_out):
                v = np.int64(acc[U(ab + o)])
                if shift > 0:
                    av = -v if v < 0 else v
                    r = (av + half) >> shift
                    v = -r if v < 0 else r
                else:
                    v = v << (-shift)
                v = amax if v > amax else v
                of[U(ob + o)] = lo if v < lo else v


@njit(cache=True, nogil=True)
def plane_for_grad(a, k, pad, plane, offs, n0, n1):
    """The padded planar layout of a stride-1 conv's input (samples n0 <= n < n1) and its
    run offsets, as :func:`~.conv_forward.conv_forward_plane` leaves them for
    :func:`conv_weight_grad_plane_vnni` (the VNNI forward does not make them)."""
    c_in = a.shape[3]
    wp = a.shape[2] + pad
    lp = plane.shape[1]
    _to_plane(a, pad, plane, n0, n1)
    for kh in range(k):
        for kw in range(k):
            for c in range(c_in):
                offs[(kh * k + kw) * c_in + c] = c * lp + kh * wp + kw


@njit(cache=True, nogil=True)
def linear_backward_data_vnni(eq, t, a_in, masked, out, corr, n0, n1):
    """:func:`~.linear.linear_backward_data` (out [N, F] int32 = eq @ t.T, 0 where
    ``masked`` and a_in <= 0) with vpdpbusd, for O >= 64: four rows of t (the unsigned
    side, flipped) x two samples' errors per block, every row of t read once per call;
    the last O % 64 outputs in plain integers. corr: int32 [>= n1 - n0] scratch (128 x
    each sample's error sum: the flip's correction). Samples n0 <= n < n1."""
    n_in = t.shape[0]
    n_out = t.shape[1]
    tf = t.reshape(-1)
    ef = eq.reshape(-1)
    n64 = n_out // VEC
    tail = n64 * VEC
    for n in range(n0, n1):
        s = np.int32(0)
        for o in range(tail):
            s = np.int32(s + np.int32(ef[U(n * n_out + o)]))
        corr[n - n0] = np.int32(s * 128)
    last = n_in - 1
    for f in range(0, n_in, 4):
        fi = (f, min(f + 1, last), min(f + 2, last), min(f + 3, last))
        rows = (fi[0] * n_out, fi[1] * n_out, fi[2] * n_out, fi[3] * n_out)
        for n in range(n0, n1, 2):
            nb = min(n + 1, n1 - 1)
            s = _dot_block(tf, rows, ef, (n * n_out, nb * n_out), n64)
            for i in range(4):
                for j in range(2):
                    nn = n if j == 0 else nb
                    v = np.int32(s[2 * i + j] - corr[nn - n0])
                    for o in range(tail, n_out):
                        v = np.int32(v + np.int32(ef[U(nn * n_out + o)])
                                     * np.int32(tf[U(rows[i] + o)]))
                    if masked and a_in[nn, fi[i]] <= 0:
                        v = np.int32(0)
                    out[nn, fi[i]] = v


@intrinsic
def _outer_block(typingctx, a, a_offs, nq, e, e_stride, o_offs, corr, g, g_offs, ng, jump):
    # pragma: no cover (compiled)
    """For every row i of a_offs and column block b of o_offs (UniTuples): the 16 int32
    g[g_offs[i] + o_offs[b] + l] = sum_k dot4(a[a_offs[i] + off(k) : +4] ^ 0x80,
    e[k*e_stride + 4*(o_offs[b] + l) : +4]) - corr[o_offs[b] + l], l < 16, k < nq, each
    accumulated in the lanes of one vector (no reduction): a weight gradient's rows from
    groups of four samples (``a`` transposed [F, N], ``e`` packed [N/4, O, 4]), or a conv's
    outputs from its input (``e`` the packed weights). off(k) = 4k + jump * (k // ng): the
    groups come in segments of ng, ``jump`` bytes apart beyond their own 4*ng (a conv
    patch's kernel rows in the padded input; ng >= nq, jump 0: one contiguous run)."""
    if not (isinstance(a, types.Array) and isinstance(e, types.Array)
            and isinstance(g, types.Array) and isinstance(corr, types.Array)
            and a.dtype == types.int8 and e.dtype == types.int8 and g.dtype == types.int32
            and corr.dtype == types.int32 and isinstance(a_offs, types.UniTuple)
            and isinstance(o_offs, types.UniTuple) and isinstance(g_offs, types.UniTuple)):
        return None
    na, nb = a_offs.count, o_offs.count
    sig = types.none(a, a_offs, nq, e, e_stride, o_offs, corr, g, g_offs, ng, jump)

    def codegen(context, builder, signature, args):
        a_, ao_, nq_, e_, es_, oo_, c_, g_, go_, ng_, jump_ = args
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        i8p = ir.IntType(8).as_pointer()
        v16 = ir.VectorType(i32, 16)

        def base(k, v):
            return builder.bitcast(context.make_array(signature.args[k])(
                context, builder, v).data, i8p)

        def as_i64(v):
            return builder.sext(v, i64) if v.type.width < 64 else v

        a_base, e_base, c_base, g_base = base(0, a_), base(3, e_), base(6, c_), base(7, g_)
        a_offs_v = [as_i64(builder.extract_value(ao_, i)) for i in range(na)]
        o_offs_v = [as_i64(builder.extract_value(oo_, i)) for i in range(nb)]
        g_offs_v = [as_i64(builder.extract_value(go_, i)) for i in range(na)]
        n_groups = as_i64(nq_)
        stride = as_i64(es_)
        per_seg = as_i64(ng_)
        seg_jump = as_i64(jump_)
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.x86.avx512.vpdpbusd.512")
        zero = ir.Constant(v16, None)
        four = ir.Constant(i64, 4)
        pre = builder.block
        loop = builder.append_basic_block("outer.loop")
        done = builder.append_basic_block("outer.done")
        builder.cbranch(builder.icmp_signed(">", n_groups, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(ir.Constant(i64, 0), pre)
        pos = builder.phi(i64)  # off(k): the byte offset of group k from a row's start
        pos.add_incoming(ir.Constant(i64, 0), pre)
        left = builder.phi(i64)  # groups left in the current segment
        left.add_incoming(per_seg, pre)
        accs = []
        for _ in range(na * nb):
            p = builder.phi(v16)
            p.add_incoming(zero, pre)
            accs.append(p)
        splats = []
        for off in a_offs_v:
            ptr = builder.bitcast(builder.gep(a_base, [builder.add(off, pos)]), i32.as_pointer())
            word = builder.xor(builder.load(ptr, align=1), ir.Constant(i32, 0x80808080))
            vec = builder.insert_element(ir.Constant(v16, ir.Undefined), word,
                                         ir.Constant(i32, 0))
            splats.append(builder.shuffle_vector(vec, ir.Constant(v16, ir.Undefined),
                                                 ir.Constant(v16, [0] * 16)))
        row = builder.mul(k, stride)
        cols = []
        for off in o_offs_v:
            ptr = builder.gep(e_base, [builder.add(row, builder.mul(off, four))])
            cols.append(builder.load(builder.bitcast(ptr, v16.as_pointer()), align=1))
        new = [builder.call(dp, [accs[i * nb + j], splats[i], cols[j]])
               for i in range(na) for j in range(nb)]
        k_next = builder.add(k, ir.Constant(i64, 1))
        last = builder.icmp_signed("==", left, ir.Constant(i64, 1))
        pos_next = builder.add(builder.add(pos, four),
                               builder.select(last, seg_jump, ir.Constant(i64, 0)))
        left_next = builder.select(last, per_seg, builder.sub(left, ir.Constant(i64, 1)))
        end = builder.block
        k.add_incoming(k_next, end)
        pos.add_incoming(pos_next, end)
        left.add_incoming(left_next, end)
        for p, v in zip(accs, new):
            p.add_incoming(v, end)
        builder.cbranch(builder.icmp_signed("<", k_next, n_groups), loop, done)
        builder.position_at_end(done)
        outs = []
        for v in new:
            ph = builder.phi(v16)
            ph.add_incoming(zero, pre)
            ph.add_incoming(v, end)
            outs.append(ph)
        for i in range(na):
            for j in range(nb):
                cptr = builder.gep(c_base, [builder.mul(o_offs_v[j], four)])
                cv = builder.load(builder.bitcast(cptr, v16.as_pointer()), align=1)
                gptr = builder.gep(g_base, [builder.mul(builder.add(g_offs_v[i], o_offs_v[j]),
                                                        four)])
                builder.store(builder.sub(outs[i * nb + j], cv),
                              builder.bitcast(gptr, v16.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _pack_linear(eq, a, a_t, ep, f0, f1):
    """a_t[f, :N4] = a[:, f] (zero past N) for f0 <= f < f1, ep = eq packed [N4/4, O, 4]
    (zero past N); returns 128 x each output's error sum (int32 [O], the flip's
    correction)."""
    n_s = a.shape[0]
    n_out = eq.shape[1]
    n4 = (n_s + 3) // 4 * 4
    ef = eq.reshape(-1)
    for f in range(f0, f1):
        for n in range(n_s):
            a_t[f, n] = a[n, f]
        for n in range(n_s, n4):
            a_t[f, n] = 0
    for k in range(n4 // 4):
        for o in range(n_out):
            for j in range(4):
                n = 4 * k + j
                ep[U((k * n_out + o) * 4 + j)] = ef[U(n * n_out + o)] if n < n_s else 0
    corr = np.zeros(n_out, np.int32)
    for n in range(n_s):
        for o in range(n_out):
            corr[o] = np.int32(corr[o] + np.int32(ef[U(n * n_out + o)]))
    for o in range(n_out):
        corr[o] = np.int32(corr[o] * 128)
    return corr


@njit(cache=True, nogil=True, inline="always")
def _grad_rows(af, la, nq, ep, corr, f, fb, gf, g0, g1):
    """Rows f and fb of the gradient into gf at offsets g0 and g1 (O a multiple of 64)."""
    n_out = corr.shape[0]
    for o in range(0, n_out, 64):
        _outer_block(af, (f * la, fb * la), nq, ep, n_out * 4, (o, o + 16, o + 32, o + 48),
                     corr, gf, (g0, g1), nq, 0)


@njit(cache=True, nogil=True, inline="always")
def _max_abs_run(gf, i0, i1, m):
    for i in range(i0, i1):
        v = np.int64(gf[U(i)])
        v = -v if v < 0 else v
        m = v if v > m else m
    return m


@njit(cache=True, nogil=True)
def linear_weight_grad_vnni(eq, a, g_out, a_t, ep, f0, f1):
    """:func:`~.linear.linear_weight_grad` (int32 g_out [F, O] = a.T @ eq, rows
    f0 <= f < f1; returns their max |g|) with vpdpbusd, for O a multiple of 64: each
    instruction adds four samples' products to 16 outputs of a row, two rows x 64 outputs
    per block, so no sum is reduced across lanes. a_t: [F, >= N4] scratch (N4: N rounded
    up to 4) receives a transposed, zero past N; ep: [>= N4 * O] int8 scratch receives
    eq packed in groups of four samples ([N4/4, O, 4])."""
    n_out = g_out.shape[1]
    corr = _pack_linear(eq, a, a_t, ep, f0, f1)
    gf = g_out.reshape(-1)
    nq = (a.shape[0] + 3) // 4
    for f in range(f0, f1, 2):
        fb = min(f + 1, f1 - 1)
        _grad_rows(a_t.reshape(-1), a_t.shape[1], nq, ep, corr, f, fb, gf, f * n_out,
                   fb * n_out)
    return _max_abs_run(gf, f0 * n_out, f1 * n_out, np.int64(0))


@njit(cache=True, nogil=True)
def linear_grad_max_vnni(eq, a, a_t, ep, f0, f1):
    """The max |g| :func:`linear_weight_grad_vnni` returns, with the gradient's rows made
    two at a time in a small buffer and not stored (the update makes them again:
    :func:`linear_update_vnni`)."""
    n_out = eq.shape[1]
    corr = _pack_linear(eq, a, a_t, ep, f0, f1)
    buf = np.empty(2 * n_out, np.int32)
    nq = (a.shape[0] + 3) // 4
    m = np.int64(0)
    for f in range(f0, f1, 2):
        _grad_rows(a_t.reshape(-1), a_t.shape[1], nq, ep, corr, f, min(f + 1, f1 - 1), buf, 0,
                   n_out)
        m = _max_abs_run(buf, 0, 2 * n_out, m)
    return m


@njit(cache=True, nogil=True)
def linear_update_vnni(eq, a, a_t, ep, w, t, sh, wmax, thr, key, rows, f0, f1):
    """:func:`~.update.sgd_update` on rows f0 <= f < f1 of a linear layer ([F, O] storage,
    counters over [O, F]: ``rows`` = F) in its usual case (0 < sh <= 62, no extra term),
    each pair of gradient rows made again (:func:`linear_grad_max_vnni`) in a small
    buffer just before its weights are updated: the gradient never goes to memory."""
    n_out = eq.shape[1]
    corr = _pack_linear(eq, a, a_t, ep, f0, f1)
    buf = np.empty(2 * n_out, np.int32)
    nq = (a.shape[0] + 3) // 4
    for f in range(f0, f1, 2):
        fb = min(f + 1, f1 - 1)
        _grad_rows(a_t.reshape(-1), a_t.shape[1], nq, ep, corr, f, fb, buf, 0, n_out)
        _update_rows(w, buf, t, f * n_out, 0, n_out, sh, wmax, thr, key + (f + 1) * _GOLDEN,
                     rows * _GOLDEN)
        if fb != f:
            _update_rows(w, buf, t, fb * n_out, n_out, n_out, sh, wmax, thr,
                         key + (fb + 1) * _GOLDEN, rows * _GOLDEN)


@intrinsic
def _interleave4_dot(typingctx, g, g_off, a, a_offs, packed_e, chunks):
    # pragma: no cover (compiled)
    """g[g_off + 16c + l] += sum_i (a[a_offs[i] + 16c + l] ^ 0x80) * e_i for l < 16,
    c < chunks (g int32, a int8 flat arrays; a_offs a UniTuple of four offsets; packed_e
    the four int8 e_i in one int32, e_0 in the low byte): the four rows' bytes interleaved
    (byte l of row i at 4l + i) so that one vpdpbusd adds the four products to each of 16
    int32 lanes; the caller subtracts 128 * sum(e_i) per lane."""
    if not (isinstance(g, types.Array) and isinstance(a, types.Array)
            and g.dtype == types.int32 and a.dtype == types.int8
            and isinstance(a_offs, types.UniTuple) and a_offs.count == 4):
        return None
    sig = types.none(g, g_off, a, a_offs, packed_e, chunks)
    def codegen(context, builder, signature, args):
        g_, go_, a_, ao_, pe_, ch_ = args
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        i8p = ir.IntType(8).as_pointer()
        v16b = ir.VectorType(ir.IntType(8), 16)
        v64b = ir.VectorType(ir.IntType(8), VEC)
        v16 = ir.VectorType(i32, 16)

        def as_i64(v):
            return builder.sext(v, i64) if v.type.width < 64 else v

        def base(k, v):
            return builder.bitcast(context.make_array(signature.args[k])(
                context, builder, v).data, i8p)

        g_base, a_base = base(0, g_), base(2, a_)
        a_offs_v = [as_i64(builder.extract_value(ao_, i)) for i in range(4)]
        g_off = as_i64(go_)
        n = as_i64(ch_)
        word = builder.trunc(pe_, i32) if pe_.type.width > 32 else pe_
        e_vec = builder.shuffle_vector(
            builder.insert_element(ir.Constant(v16, ir.Undefined), word, ir.Constant(i32, 0)),
            ir.Constant(v16, ir.Undefined), ir.Constant(v16, [0] * 16))
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.x86.avx512.vpdpbusd.512")
        flip = ir.Constant(v64b, [0x80] * VEC)
        # rows 0|1 and 2|3 as 32 bytes each, then byte l of row i to position 4l + i
        pair_mask = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
        join_mask = ir.Constant(ir.VectorType(i32, VEC), list(range(VEC)))
        inter_mask = ir.Constant(ir.VectorType(i32, VEC),
                                 [16 * i + lane for lane in range(16) for i in range(4)])
        pre = builder.block
        loop = builder.append_basic_block("il4.loop")
        done = builder.append_basic_block("il4.done")
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        c = builder.phi(i64)
        c.add_incoming(ir.Constant(i64, 0), pre)
        off = builder.mul(c, ir.Constant(i64, 16))
        rows = []
        for ao in a_offs_v:
            ptr = builder.gep(a_base, [builder.add(ao, off)])
            rows.append(builder.load(builder.bitcast(ptr, v16b.as_pointer()), align=1))
        both = builder.shuffle_vector(builder.shuffle_vector(rows[0], rows[1], pair_mask),
                                      builder.shuffle_vector(rows[2], rows[3], pair_mask),
                                      join_mask)
        mixed = builder.xor(builder.shuffle_vector(both, ir.Constant(v64b, ir.Undefined),
                                                   inter_mask), flip)
        gptr = builder.bitcast(
            builder.gep(g_base, [builder.mul(builder.add(g_off, off), ir.Constant(i64, 4))]),
            v16.as_pointer())
        acc = builder.load(gptr, align=1)
        builder.store(builder.call(dp, [acc, builder.bitcast(mixed, v16), e_vec]), gptr,
                      align=1)
        c_next = builder.add(c, ir.Constant(i64, 1))
        c.add_incoming(c_next, builder.block)
        builder.cbranch(builder.icmp_signed("<", c_next, n), loop, done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def conv_weight_grad_sparse_vnni(eq, a_pad, stride, g_out, gt, pi, pv, o0, o1):
    """:func:`~.conv_backward.conv_weight_grad_sparse` (same arguments and results, an
    int32 ``gt``) with vpdpbusd: each pass's four non-zero errors, packed in one int32,
    against their four patches' bytes interleaved (:func:`_interleave4_dot`), 16
    gradient elements an instruction; the last K*C % 16 of a patch row in plain
    integers. Returns max |G| of channels o0 <= o < o1."""
    k = g_out.shape[0]
    c_in = g_out.shape[2]
    n_out = g_out.shape[3]
    g2 = g_out.reshape(-1, n_out)
    r_len = g2.shape[0]
    n_s = eq.shape[0]
    h_out = eq.shape[1]
    w_out = eq.shape[2]
    hp = a_pad.shape[1]
    wpp = a_pad.shape[2]
    kc = k * c_in
    chunks = kc // 16
    tail = chunks * 16
    rowstep = wpp * c_in
    apf = a_pad.reshape(-1)
    ef = eq.reshape(-1)
    gf = gt.reshape(-1)
    for o in range(o0, o1):
        go = o * r_len
        for r in range(r_len):
            gf[U(go + r)] = 0
        cnt = 0
        p = 0
        esum = np.int64(0)  # the flip's correction: 128 x the channel's error sum
        for n in range(n_s):
            for y in range(h_out):
                rb = (n * hp + y * stride) * rowstep
                for x in range(w_out):
                    e = ef[U(p * n_out + o)]
                    p += 1
                    pi[cnt] = rb + x * stride * c_in
                    pv[cnt] = e
                    esum += e
                    cnt += np.int64(e != 0)
        while cnt & 3:
            pi[cnt] = 0
            pv[cnt] = 0
            cnt += 1
        for j in range(0, cnt, 4):
            e1 = np.int64(pv[j])
            e2 = np.int64(pv[j + 1])
            e3 = np.int64(pv[j + 2])
            e4 = np.int64(pv[j + 3])
            packed = np.int32(np.uint32((e1 & 0xFF) | ((e2 & 0xFF) << 8) | ((e3 & 0xFF) << 16)
                                        | ((e4 & 0xFF) << 24)))
            for kh in range(k):
                s1 = pi[j] + kh * rowstep
                s2 = pi[j + 1] + kh * rowstep
                s3 = pi[j + 2] + kh * rowstep
                s4 = pi[j + 3] + kh * rowstep
                d = go + kh * kc
                _interleave4_dot(gf, d, apf, (s1, s2, s3, s4), packed, chunks)
                for jj in range(tail, kc):
                    gf[U(d + jj)] = np.int32(
                        gf[U(d + jj)] + np.int32(e1) * np.int32(apf[U(s1 + jj)])
                        + np.int32(e2) * np.int32(apf[U(s2 + jj)])
                        + np.int32(e3) * np.int32(apf[U(s3 + jj)])
                        + np.int32(e4) * np.int32(apf[U(s4 + jj)]))
        corr = np.int32(esum * 128)
        for kh in range(k):
            d = go + kh * kc
            for jj in range(tail):
                gf[U(d + jj)] = np.int32(gf[U(d + jj)] - corr)
    gmax = np.int64(0)
    for r in range(r_len):
        for o in range(o0, o1):
            v = np.int64(gt[o, r])
            g2[r, o] = v
            v = -v if v < 0 else v
            gmax = v if v > gmax else gmax
    return gmax
