"""The LLVM intrinsics of the VNNI kernels (:mod:`.vnni`) and whether this CPU has them.

LLVM does not produce ``vpdpbusd`` from a Numba loop (int8 products become ``vpmulld``),
so the ``@intrinsic``s here write their loops in LLVM IR around
``llvm.x86.avx512.vpdpbusd.512``: :func:`_dot_block` (a block of dot products of byte
rows), :func:`_outer_block` (four bytes broadcast x a packed operand into 16 output lanes,
optionally in segments), :func:`_interleave4_rows` (four rows interleaved against four
int8 values in one int32), :func:`_finish16` (sixteen sums rounded, clipped, narrowed),
:func:`_nonzero_mask` / :func:`_lowest_bit` (the sparse gradient's error lists).

The unsigned operand is the activation side with its sign bit flipped (``a ^ 0x80 =
a + 128``); the caller subtracts ``128 * sum(other side)``. The instruction wraps, so
results are exact whenever the true sum fits in int32 (the engine's bounds). They are only
typed, and compiled, where :data:`AVAILABLE`.
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

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


def _as_i64(builder, v):
    """An integer IR value sign-extended to i64 (as it is when already i64)."""
    return builder.sext(v, ir.IntType(64)) if v.type.width < 64 else v


def _splat(builder, v, vec_type):
    """Scalar ``v`` in every lane of ``vec_type`` (an insert and a zero-mask shuffle)."""
    lane0 = builder.insert_element(ir.Constant(vec_type, ir.Undefined), v,
                                   ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(lane0, ir.Constant(vec_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), vec_type.count),
                                              [0] * vec_type.count))


def _exit_values(builder, values, zero, pre, end):
    """After a loop that may run zero times: per loop-carried value, a phi of ``zero``
    (from ``pre``, the block before the loop) and its last value (from ``end``); all phis
    first in the exit block, as LLVM requires."""
    out = []
    for v in values:
        ph = builder.phi(v.type)
        ph.add_incoming(zero, pre)
        ph.add_incoming(v, end)
        out.append(ph)
    return out


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


        a_offs_v = [_as_i64(builder, builder.extract_value(ao_, i)) for i in range(na)]
        b_offs_v = [_as_i64(builder, builder.extract_value(bo_, i)) for i in range(nb)]
        nbytes = builder.mul(_as_i64(builder, n_), ir.Constant(i64, VEC))
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
        outs = _exit_values(builder, new, zero, pre, end)
        return context.make_tuple(builder, ret, [builder.call(red, [ph]) for ph in outs])

    return sig, codegen


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


        a_base, e_base, c_base, g_base = base(0, a_), base(3, e_), base(6, c_), base(7, g_)
        a_offs_v = [_as_i64(builder, builder.extract_value(ao_, i)) for i in range(na)]
        o_offs_v = [_as_i64(builder, builder.extract_value(oo_, i)) for i in range(nb)]
        g_offs_v = [_as_i64(builder, builder.extract_value(go_, i)) for i in range(na)]
        n_groups = _as_i64(builder, nq_)
        stride = _as_i64(builder, es_)
        per_seg = _as_i64(builder, ng_)
        seg_jump = _as_i64(builder, jump_)
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
            splats.append(_splat(builder, word, v16))
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
        outs = _exit_values(builder, new, zero, pre, end)
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


@intrinsic
def _interleave4_rows(typingctx, g, g_off, a, pi, pv, q0, q1, row_off, c_offs, bias):
    # pragma: no cover (compiled)
    """For every chunk offset c of the UniTuple ``c_offs`` and l < 16:
    g[g_off + c + l] += sum over q0 <= q < q1 of (a[pi[q] + row_off + c + l] ^ 0x80) * pv[q]
    - bias (g int32, a int8 flat; pi, pv int32: row offsets and int8 values, q1 - q0 a
    multiple of four). Per four q: their rows' 16 bytes interleaved (byte l of row i at
    4l + i, one vpermt2b) so that one vpdpbusd adds the four products to each of 16 int32
    lanes, against the four values packed in one int32; the 16 x len(c_offs) sums stay in
    registers across the list (no load and store of g per instruction). ``bias`` = 128 *
    sum(pv) makes the sums exact (the flip's correction); a caller that corrects later
    passes 0."""
    if not (isinstance(g, types.Array) and isinstance(a, types.Array)
            and isinstance(pi, types.Array) and isinstance(pv, types.Array)
            and g.dtype == types.int32 and a.dtype == types.int8
            and pi.dtype == types.int32 and pv.dtype == types.int32
            and isinstance(c_offs, types.UniTuple)):
        return None
    nc = c_offs.count
    sig = types.none(g, g_off, a, pi, pv, q0, q1, row_off, c_offs, bias)

    def codegen(context, builder, signature, args):
        g_, go_, a_, pi_, pv_, q0_, q1_, ro_, co_, bias_ = args
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        i8p = ir.IntType(8).as_pointer()
        v16b = ir.VectorType(ir.IntType(8), 16)
        v64b = ir.VectorType(ir.IntType(8), VEC)
        v16 = ir.VectorType(i32, 16)


        def data(k, v, ty):
            return builder.bitcast(context.make_array(signature.args[k])(
                context, builder, v).data, ty)

        g_base, a_base = data(0, g_, i8p), data(2, a_, i8p)
        pi_base, pv_base = data(3, pi_, i32.as_pointer()), data(4, pv_, i32.as_pointer())
        c_offs_v = [_as_i64(builder, builder.extract_value(co_, i)) for i in range(nc)]
        row_off = _as_i64(builder, ro_)
        q_end = _as_i64(builder, q1_)
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.x86.avx512.vpdpbusd.512")
        flip = ir.Constant(v64b, [0x80] * VEC)
        pair_mask = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
        # byte l of row i to 4l + i in one two-table permute of the row pairs, each pair
        # widened with an undefined upper half (joining the pairs first made LLVM 14
        # fill both halves of each pair: two more instructions per vpdpbusd)
        widen_mask = ir.Constant(ir.VectorType(i32, VEC), list(range(VEC)))
        inter_mask = ir.Constant(ir.VectorType(i32, VEC),
                                 [16 * i + lane + (32 if i >= 2 else 0)
                                  for lane in range(16) for i in range(4)])
        half_undef = ir.Constant(ir.VectorType(ir.IntType(8), 32), ir.Undefined)
        zero = ir.Constant(v16, None)
        # each chunk's base address outside the loop (LLVM 14 recomputed base + chunk
        # for every row of every step)
        chunk_bases = [builder.gep(a_base, [co]) for co in c_offs_v]
        pre = builder.block
        loop = builder.append_basic_block("il4r.loop")
        done = builder.append_basic_block("il4r.done")
        q_start = _as_i64(builder, q0_)
        builder.cbranch(builder.icmp_signed("<", q_start, q_end), loop, done)
        builder.position_at_end(loop)
        q = builder.phi(i64)
        q.add_incoming(q_start, pre)
        accs = []
        for _ in range(nc):
            p = builder.phi(v16)
            p.add_incoming(zero, pre)
            accs.append(p)
        word = ir.Constant(i32, 0)
        offs = []
        for i in range(4):
            qi = builder.add(q, ir.Constant(i64, i))
            offs.append(builder.add(_as_i64(builder, builder.load(builder.gep(pi_base, [qi]))), row_off))
            e = builder.and_(builder.load(builder.gep(pv_base, [qi])), ir.Constant(i32, 0xFF))
            word = builder.or_(word, builder.shl(e, ir.Constant(i32, 8 * i)))
        e_vec = _splat(builder, word, v16)
        new = []
        for acc, base in zip(accs, chunk_bases):
            rows = [builder.load(builder.bitcast(builder.gep(base, [o]), v16b.as_pointer()),
                                 align=1) for o in offs]
            low, high = (builder.shuffle_vector(builder.shuffle_vector(r0, r1, pair_mask),
                                                half_undef, widen_mask)
                         for r0, r1 in ((rows[0], rows[1]), (rows[2], rows[3])))
            mixed = builder.xor(builder.shuffle_vector(low, high, inter_mask), flip)
            new.append(builder.call(dp, [acc, builder.bitcast(mixed, v16), e_vec]))
        q_next = builder.add(q, ir.Constant(i64, 4))
        end = builder.block
        q.add_incoming(q_next, end)
        for p, v in zip(accs, new):
            p.add_incoming(v, end)
        builder.cbranch(builder.icmp_signed("<", q_next, q_end), loop, done)
        builder.position_at_end(done)
        totals = _exit_values(builder, new, zero, pre, end)
        g_off = _as_i64(builder, go_)
        b32 = builder.trunc(bias_, i32) if bias_.type.width > 32 else bias_
        b_vec = _splat(builder, b32, v16)
        for total, co in zip(totals, c_offs_v):
            gptr = builder.bitcast(builder.gep(g_base, [builder.mul(builder.add(g_off, co),
                                                                    ir.Constant(i64, 4))]),
                                   v16.as_pointer())
            builder.store(builder.add(builder.load(gptr, align=1), builder.sub(total, b_vec)),
                          gptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _finish16(typingctx, src, s0, dst, d0, shift, lim, amax, lo):  # pragma: no cover
    """dst[d0 + l] = clip(round_shift(src[s0 + l], shift), lo, amax) for l < 16 in int32
    lanes (int32 ``src``, int8 ``dst``): ``v`` clamped to +-``lim`` first (``lim`` =
    (amax + 1) << shift: no result changes, and |v| + 2^(shift-1) stays in int32; the
    caller checks that it fits), then half away from zero as the engine rounds. Plain
    vector IR: no VNNI needed, used by the VNNI forward's finishing step."""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array)
            and src.dtype == types.int32 and dst.dtype == types.int8):
        return None
    sig = types.none(src, s0, dst, d0, shift, lim, amax, lo)

    def codegen(context, builder, signature, args):
        src_, s0_, dst_, d0_, shift_, lim_, amax_, lo_ = args
        i32 = ir.IntType(32)
        v16 = ir.VectorType(i32, 16)
        v16b = ir.VectorType(ir.IntType(8), 16)

        def arg32(v):
            return builder.trunc(v, i32) if v.type.width > 32 else builder.sext(v, i32) \
                if v.type.width < 32 else v

        sh = arg32(shift_)
        lim = _splat(builder, arg32(lim_), v16)
        nlim = builder.neg(lim)
        hi = _splat(builder, arg32(amax_), v16)
        low = _splat(builder, arg32(lo_), v16)
        half = _splat(builder, builder.shl(ir.Constant(i32, 1), builder.sub(sh, ir.Constant(i32, 1))), v16)
        shv = _splat(builder, sh, v16)
        zero = ir.Constant(v16, None)
        sp = builder.gep(context.make_array(signature.args[0])(context, builder, src_).data,
                         [_as_i64(builder, s0_)])
        dp = builder.gep(context.make_array(signature.args[2])(context, builder, dst_).data,
                         [_as_i64(builder, d0_)])
        v = builder.load(builder.bitcast(sp, v16.as_pointer()), align=4)
        v = builder.select(builder.icmp_signed(">", v, lim), lim, v)
        v = builder.select(builder.icmp_signed("<", v, nlim), nlim, v)
        neg = builder.icmp_signed("<", v, zero)
        r = builder.ashr(builder.add(builder.select(neg, builder.neg(v), v), half), shv)
        r = builder.select(neg, builder.neg(r), r)
        r = builder.select(builder.icmp_signed(">", r, hi), hi, r)
        r = builder.select(builder.icmp_signed("<", r, low), low, r)
        builder.store(builder.trunc(r, v16b), builder.bitcast(dp, v16b.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _nonzero_mask(typingctx, a, off, width):  # pragma: no cover (compiled)
    """Bit l (l < ``width`` <= 64) set where the int8 a[off + l] is not zero, as a uint64:
    one masked 64-byte load (nothing past ``width`` is read) and one compare."""
    if not (isinstance(a, types.Array) and a.dtype == types.int8):
        return None
    sig = types.uint64(a, off, width)

    def codegen(context, builder, signature, args):
        a_, off_, w_ = args
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        i1 = ir.IntType(1)
        v64b = ir.VectorType(ir.IntType(8), VEC)
        v64m = ir.VectorType(i1, VEC)
        v64i = ir.VectorType(i32, VEC)


        ptr = builder.gep(context.make_array(signature.args[0])(context, builder, a_).data,
                          [_as_i64(builder, off_)])
        w = builder.trunc(_as_i64(builder, w_), i32)
        wv = _splat(builder, w, v64i)
        lanes = builder.icmp_unsigned("<", ir.Constant(v64i, list(range(VEC))), wv)
        vptr = builder.bitcast(ptr, v64b.as_pointer())
        load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v64b, [v64b.as_pointer(), i32, v64m, v64b]),
            "llvm.masked.load.v64i8.p0v64i8")
        v = builder.call(load, [vptr, ir.Constant(i32, 1), lanes, ir.Constant(v64b, None)])
        nz = builder.icmp_unsigned("!=", v, ir.Constant(v64b, None))
        return builder.bitcast(nz, i64)

    return sig, codegen


@intrinsic
def _lowest_bit(typingctx, x):  # pragma: no cover (compiled)
    """The index of the lowest set bit of the uint64 ``x`` (64 when x is 0), as int64."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.int64(x)

    def codegen(context, builder, signature, args):
        (x_,) = args
        i64 = ir.IntType(64)
        v = builder.zext(x_, i64) if x_.type.width < 64 else x_
        cttz = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64")
        return builder.call(cttz, [v, ir.Constant(ir.IntType(1), 0)])

    return sig, codegen


def padded(r: int, unit: int = VEC) -> int:
    """r rounded up to a multiple of ``unit`` (64 bytes: whole vectors)."""
    return -(-r // unit) * unit
