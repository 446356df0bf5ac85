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
- :func:`conv_forward_vnni`: the stride-any conv forward as a product of an im2col block
  and the ternary weights in ``[O, R]`` rows padded to 64 bytes (:func:`pad_rows`).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

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
def pad_rows(tb, tv, tsum):
    """Conv ternary weights [O, K, K, C] (``tb``) as rows tv [Op, Rp] (R = K*K*C, zeros up
    to Rp, a multiple of 64, and in the rows from O up to Op, a multiple of 4) and their
    sums tsum [Op] int32 (the flip's correction)."""
    n_out = tb.shape[0]
    t2 = tb.reshape(n_out, -1)
    r_len = t2.shape[1]
    tv[...] = 0
    tsum[...] = 0
    for o in range(n_out):
        s = 0
        for r in range(r_len):
            v = t2[o, r]
            tv[o, r] = v
            s += v
        tsum[o] = s


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
def _patches(af, h_in, w_in, c_in, k, stride, pad, h_out, w_out, p0, m, cf, rp):
    """cf[j*rp + (kh*k + kw)*C + c] = a[n, iy, ix, c] (0 where padded) for the output
    pixels p0 <= p < p0 + m (flat over samples, rows, columns)."""
    n_pix = h_out * w_out
    for j in range(m):
        p = p0 + j
        n = p // n_pix
        rem = p - n * n_pix
        y = rem // w_out
        x = rem - y * w_out
        base = j * rp
        for kh in range(k):
            iy = y * stride + kh - pad
            for kw in range(k):
                ix = x * stride + kw - pad
                d = base + (kh * k + kw) * c_in
                if iy >= 0 and iy < h_in and ix >= 0 and ix < w_in:
                    src = ((n * h_in + iy) * w_in + ix) * c_in
                    for c in range(c_in):
                        cf[U(d + c)] = af[U(src + c)]
                else:
                    for c in range(c_in):
                        cf[U(d + c)] = 0


@njit(cache=True, nogil=True)
def conv_forward_vnni(a, tv, tsum, r_len, k, stride, pad, shift, amax, relu, out, col, acc,
                      n0, n1):
    """The conv forward (:func:`~.conv_forward.conv_forward`'s result) for samples
    n0 <= n < n1 with vpdpbusd: ``col`` [B, Rp] int8 scratch (B even) receives the
    patches of B output pixels at a time ((kh, kw, c) order, zeros for padding and up to
    Rp), every pair of pixels x four output channels is a 2 x 4 block of dot products
    with ``tv`` [Op, Rp] (:func:`pad_rows`; ``tsum`` its row sums, r_len = K*K*C) into
    ``acc`` int32 [B * Op] scratch, then ``clip(round_shift(sum, shift), +-amax)`` (ReLU'd
    if relu) writes NHWC ``out``."""
    h_in = a.shape[1]
    w_in = a.shape[2]
    c_in = a.shape[3]
    h_out = out.shape[1]
    w_out = out.shape[2]
    n_out = out.shape[3]
    n_op = tv.shape[0]
    rp = tv.shape[1]
    n64 = rp // VEC
    block = col.shape[0]
    cf = col.reshape(-1)
    tf = tv.reshape(-1)
    af = a.reshape(-1)
    of = out.reshape(-1)
    n_pix = h_out * w_out
    p_end = n1 * n_pix
    for j in range(block):  # the columns past R stay zero
        for r in range(r_len, rp):
            cf[U(j * rp + r)] = 0
    corr = np.empty(n_op, np.int32)
    for o in range(n_op):
        corr[o] = np.int32(tsum[o] * 128)
    lo = 0 if relu else -amax
    half = (np.int64(1) << (shift - 1)) if shift > 0 else np.int64(0)
    for p0 in range(n0 * n_pix, p_end, block):
        m = min(p_end, p0 + block) - p0
        _patches(af, h_in, w_in, c_in, k, stride, pad, h_out, w_out, p0, m, cf, rp)
        for j in range(0, m, 2):  # an odd m's last pair reads a stale row: not written out
            for o in range(0, n_op, 4):
                s = _dot_block(cf, (j * rp, (j + 1) * rp), tf,
                               (o * rp, (o + 1) * rp, (o + 2) * rp, (o + 3) * rp), n64)
                b = j * n_op + o
                acc[b] = s[0]
                acc[b + 1] = s[1]
                acc[b + 2] = s[2]
                acc[b + 3] = s[3]
                acc[b + n_op] = s[4]
                acc[b + n_op + 1] = s[5]
                acc[b + n_op + 2] = s[6]
                acc[b + n_op + 3] = s[7]
        for j in range(m):  # branch-free finish, as conv_forward_plane's (vectorizes)
            ob = (p0 + j) * n_out
            ab = j * n_op
            for o in range(n_out):
                v = np.int64(np.int32(acc[U(ab + o)] - corr[o]))
                if shift > 0:
                    av = -v if v < 0 else v
                    r = (av + half) >> shift
                    v = -r if v < 0 else r
                else:
                    v = v << (-shift)
                v = amax if v > amax else v
                of[U(ob + o)] = lo if v < lo else v
