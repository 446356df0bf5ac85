"""A process's memory: dropping the compiler's pages once the kernels are loaded (devices),
keeping freed heap for reuse (the emulator's and the coordinator's processes).

Numba maps LLVM (``libllvmlite``: its machine code and read-only data, tens of MB each)
into the process, and its start faults much of it in. A device that has loaded its kernels
runs none of that code again (until it compiles a new signature), yet those pages count
in its RSS. :func:`release_compiler_pages` asks the kernel to unmap them
(``madvise(MADV_DONTNEED)``): clean pages of the file, which stay in the page cache and
fault back in if LLVM runs again. Only the library's read-only mappings that hold no page
of the process's own are touched, so nothing but a future page fault is lost. Linux only.

How many pages a fault maps depends on the page cache (docs/performance.md#memory).
:func:`keep_freed_memory` keeps freed heap for processes that train float32 models over
and over; not for a device (the heap it keeps is resident).
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


def compiler_mappings(smaps_text: str) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the mappings of LLVM's shared library in a ``/proc/<pid>/smaps``
    text that are read-only (``r-xp``, ``r--p``) and hold no anonymous page: what
    :func:`release_compiler_pages` may drop. A read-only mapping with anonymous pages is
    the part the dynamic loader relocated (RELRO): its pages exist nowhere else."""
    out = []
    current: tuple[int, int] | None = None
    for line in smaps_text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
            current = None
            if len(parts) >= 6 and parts[1] in ("r-xp", "r--p") and LIBRARY in parts[5]:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                current = (lo, hi)
        elif parts[0] == "Anonymous:" and current is not None:
            if int(parts[1]) == 0:
                out.append(current)
            current = None
    return out


#: the library's droppable mappings, found once per process (they never change while it
#: is loaded, and a read-only mapping gains no page of its own)
_clean: list[tuple[int, int]] = []


def release_compiler_pages() -> int:
    """Unmap the resident pages of LLVM's machine code and read-only data from this process
    (see the module docstring); returns the bytes of address range advised (0 when not on
    Linux or when the library is not loaded)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        if not _clean:
            with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
                _clean.extend(compiler_mappings(f.read()))
        if not _clean:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return 0
    done = 0
    for lo, hi in _clean:
        if madvise(lo, hi - lo, MADV_DONTNEED) == 0:
            done += hi - lo
    return done


def keep_freed_memory(blocks_up_to: int = HEAP_BLOCKS_UP_TO, trim_beyond: int = TRIM_BEYOND) -> bool:
    """Keep freed memory in this process for the next allocation: blocks up to
    ``blocks_up_to`` bytes come from the heap, and the heap keeps up to ``trim_beyond``
    bytes of free memory. glibc's defaults return every freed block over 128 KiB to the
    kernel, so each float32 activation of a training step (2.5 MB for mnist_cnn's first
    conv on 50 images) is fresh memory faulted in page by page (docs/experiments.md).
    Process-wide; returns whether glibc took both settings (False elsewhere: musl, macOS,
    Windows)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, int(blocks_up_to)) and mallopt(M_TRIM_THRESHOLD, int(trim_beyond)))
