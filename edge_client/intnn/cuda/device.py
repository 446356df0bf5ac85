"""Where the CUDA engine's kernels run, and its arrays: one of three modes, fixed per
process.

- ``gpu``: Numba's CUDA target (``numba-cuda`` where installed, which ``numba.cuda``
  then is) on the first GPU;
- ``sim``: Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before numba is imported):
  the kernels run as Python on the CPU, so tests check them without a GPU; launches use
  few threads (each costs the simulator a Python thread), every kernel striding over its
  elements, so the results do not depend on the geometry;
- ``ptx`` (:func:`compile_only`): nothing runs; every launch compiles its kernel to PTX
  for the given compute capabilities (no GPU needed, only NVVM), the arrays are numpy's.

Every kernel is a grid over devices (``blockIdx.y``) x a grid-stride loop over one
device's elements (:func:`launch`).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import cuda

if TYPE_CHECKING:  # pragma: no cover
    from numpy.typing import DTypeLike

#: a Numba CUDA device array (a numpy array in ``ptx`` mode); numba ships no type stubs
DeviceArray = Any
#: a ``cuda.jit`` kernel (a Numba dispatcher, launched as ``kernel[grid, block](*args)``)
Kernel = Any

#: threads per block on a GPU, and blocks per device at most (times the SMs over devices)
THREADS = 256
BLOCKS_PER_SM = 8
#: the simulator's geometry: two blocks of two threads per device (parallel enough to
#: exercise the atomics and the grid-stride loops, cheap for its Python threads)
SIM_THREADS = 2
SIM_BLOCKS = 2

_mode = {"name": "sim" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "gpu",
         "ccs": (), "compiled": {}, "sms": 0}
if _mode["name"] == "sim":
    # the simulator's integer arithmetic is numpy's: SplitMix64's products wrap, as on the GPU
    warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)


def mode() -> str:
    """``"gpu" | "sim" | "ptx"``."""
    return str(_mode["name"])


def simulator() -> bool:
    return _mode["name"] == "sim"


def compile_only(ccs: tuple[tuple[int, int], ...]) -> dict[tuple[Any, ...], int]:
    """Switch this process to ``ptx`` mode for compute capabilities ``ccs``; returns the
    record it fills: ``(kernel name, signature, cc) -> PTX length``."""
    _mode["name"] = "ptx"
    _mode["ccs"] = tuple(ccs)
    _mode["compiled"] = {}
    return _mode["compiled"]  # type: ignore[return-value]


def set_mode(name: str) -> None:
    """Back to ``name`` after :func:`compile_only` (``"gpu"`` or ``"sim"``, as the process
    started)."""
    _mode["name"] = name


def _sms() -> int:
    if not _mode["sms"]:
        dev = cuda.get_current_device()
        _mode["sms"] = int(getattr(dev, "MULTIPROCESSOR_COUNT", 0) or 80)
    return int(_mode["sms"])


def launch(kernel: Kernel, per_device: int, devices: int, *args: Any) -> None:
    """Run ``kernel(*args)`` on a grid of ``devices`` rows of blocks sized for
    ``per_device`` elements each (the kernel strides over them)."""
    name = _mode["name"]
    if name == "ptx":
        _compile(kernel, args)
        return
    if per_device <= 0 or devices <= 0:
        return
    if name == "sim":
        threads = SIM_THREADS
        blocks = min(SIM_BLOCKS, -(-per_device // threads))
    else:
        threads = THREADS
        cap = max(1, (_sms() * BLOCKS_PER_SM) // devices)
        blocks = min(-(-per_device // threads), cap)
    kernel[(blocks, devices), threads](*args)


def _compile(kernel: Kernel, args: tuple[Any, ...]) -> None:
    from numba import typeof

    sig = tuple(typeof(a) for a in args)
    func = getattr(kernel, "py_func", kernel)
    for cc in _mode["ccs"]:
        key = (func.__name__, sig, cc)
        if key not in _mode["compiled"]:
            ptx, _ = cuda.compile_ptx(func, sig, cc=cc)
            _mode["compiled"][key] = len(ptx)


# ----------------------------------------------------------------------------- arrays


def zeros(shape: tuple[int, ...], dtype: DTypeLike) -> DeviceArray:
    """A zeroed array on the device."""
    host = np.zeros(shape, dtype)
    return host if _mode["name"] == "ptx" else cuda.to_device(host)


def to_device(a: np.ndarray) -> DeviceArray:
    a = np.ascontiguousarray(a)
    return a.copy() if _mode["name"] == "ptx" else cuda.to_device(a)


def upload(dst: DeviceArray, src: np.ndarray) -> None:
    """Copy host ``src`` into device array ``dst`` (same shape)."""
    src = np.ascontiguousarray(src, dtype=dst.dtype)
    if _mode["name"] == "ptx":
        dst[...] = src
    else:
        dst.copy_to_device(src)


def to_host(a: DeviceArray) -> np.ndarray:
    if _mode["name"] == "ptx":
        return np.array(a)
    return a.copy_to_host()


def synchronize() -> None:
    if _mode["name"] == "gpu":
        cuda.synchronize()
