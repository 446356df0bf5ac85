"""A process's memory: dropping the compiler's code once the kernels are loaded (devices),
keeping freed heap for reuse (the emulator's and the coordinator's processes).

Numba maps LLVM (``libllvmlite``, ~180 MB of machine code) into the process: its static
initializers touch ~35 MB of it at ``import numba``, Numba's first use (the JIT engine,
its runtime helpers compiled at start) another ~50 MB, and the kernels' cache loads a
little more. A device that has loaded its kernels runs none of that code again (until it
compiles a new kernel signature), yet those pages count in its RSS. They are clean pages
of a file: :func:`release_compiler_pages` asks the kernel to unmap them from this process
(``madvise(MADV_DONTNEED)``); they stay in the page cache (reclaimable, shared with other
processes) and fault back in from the file if LLVM runs again. Only executable
(``r-xp``) mappings of the library are touched: machine code is never written, so
nothing but a future page fault is lost. Linux only; elsewhere a no-op.

``IntTrainer(release_pages=True)`` (the device runtime's default trainer) starts Numba
before it allocates anything (so that the compiler's peak does not add to the model's and
the data's), then calls this after Numba's start, after building its model and after its
first training call.

:func:`keep_freed_memory` is for the processes that train and score float32 models over and
over (the emulator's, its device workers, ``fedbit serve``'s evaluation): glibc returns a
freed block of more than its mmap threshold (128 KiB at start) to the kernel at once, and
trims the top of the heap, so
each torch activation of a batch (a 50 x 16 x 28 x 28 float32 tensor is 2.5 MB) is
fresh memory the kernel must fault in page by page. Measured on a 2-core VM, one
``mnist_cnn`` training step of 50 images: 1.46 M minor faults in 15 s of steps before,
52 k after; the step 1.2x and the no-grad forward 1.4x as fast. Not for a
device: the heap it keeps is resident.
"""

from __future__ import annotations

import ctypes
import sys

MADV_DONTNEED = 4
LIBRARY = "libllvmlite"

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap, not from their own mapping (glibc's ceiling
#: for the threshold on 64-bit is 32 MiB)
HEAP_BLOCKS_UP_TO = 32 << 20
#: free memory at the top of the heap returned to the kernel only beyond this
TRIM_BEYOND = 1 << 30


def compiler_mappings(maps_text: str) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the executable mappings of LLVM's shared library in a
    ``/proc/<pid>/maps`` text."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "r-xp" and LIBRARY in parts[5]:
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            out.append((lo, hi))
    return out


def release_compiler_pages() -> int:
    """Unmap the resident pages of LLVM's machine code from this process (see the module
    docstring); returns the bytes of address range advised (0 when not on Linux or when
    the library is not loaded)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            ranges = compiler_mappings(f.read())
        if not ranges:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return 0
    done = 0
    for lo, hi in ranges:
        if madvise(lo, hi - lo, MADV_DONTNEED) == 0:
            done += hi - lo
    return done


def keep_freed_memory(blocks_up_to: int = HEAP_BLOCKS_UP_TO, trim_beyond: int = TRIM_BEYOND) -> bool:
    """Keep freed memory in this process for the next allocation (module docstring): blocks
    up to ``blocks_up_to`` bytes come from the heap, and the heap keeps up to
    ``trim_beyond`` bytes of free memory. Process-wide; returns whether glibc took both
    settings (False elsewhere: musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, int(blocks_up_to)) and mallopt(M_TRIM_THRESHOLD, int(trim_beyond)))
