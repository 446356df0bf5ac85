"""Waiting for another thread's sequence number without the GIL and without sleeping.

:func:`wait_for` spins (a ``nogil`` Numba loop) until ``flags[i] == value`` or a number
of tries has passed. The loop reads the flag with an atomic acquire load (a plain Numba
read may be hoisted out of the loop by LLVM, and would never see the other thread's
write) and yields the core between reads (x86 ``pause``, Arm ``yield``: a spinning
thread leaves its sibling hyper-thread the execution units).
:class:`~edge_client.intnn.parallel.Splitter` hands a part of a kernel to its pool threads
through such flags (why not a sleeping wait: docs/performance.md#several-cores).
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_MACHINE = platform.machine().lower()


@intrinsic
def _load_acquire(typingctx, flags, i):  # pragma: no cover (compiled)
    """``flags[i]`` (int64 array) by an atomic load with acquire ordering."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(i, types.Integer)):
        return None
    sig = types.int64(flags, i)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        idx = args[1]
        if idx.type.width < 64:
            idx = builder.sext(idx, ir.IntType(64))
        return builder.load_atomic(builder.gep(arr.data, [idx]), "acquire", 8)

    return sig, codegen


@intrinsic
def _pause(typingctx):  # pragma: no cover (compiled)
    """A spin-wait hint: ``pause`` on x86, ``yield`` on Arm, nothing elsewhere."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        if _MACHINE in ("x86_64", "amd64", "i686", "x86"):
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(
                ir.VoidType(), []))
            builder.call(fn, [])
        elif _MACHINE in ("aarch64", "arm64"):
            fn = builder.module.declare_intrinsic("llvm.aarch64.hint", fnty=ir.FunctionType(
                ir.VoidType(), [ir.IntType(32)]))
            builder.call(fn, [ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def wait_for(flags, i, value, tries):
    """True as soon as ``flags[i] == value`` (int64 ``flags``), False after ``tries``
    reads that did not find it. Runs without the GIL."""
    for _ in range(tries):
        if _load_acquire(flags, i) == value:
            return True
        _pause()
    return False
