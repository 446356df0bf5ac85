"""A device process drops LLVM's code and read-only data from its resident memory once its
kernels are loaded; nothing it computes changes, and LLVM still works afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from edge_client.compat import zip_strict
from edge_client.intnn.memory import compiler_mappings


def _mapping(span: str, perm: str, path: str, anonymous_kb: int) -> str:
    return (f"{span} {perm} 00000000 08:01 123 {path}\nSize:  4 kB\nRss:  4 kB\n"
            f"Anonymous:  {anonymous_kb} kB\nVmFlags: rd mr mw me\n")


LIB = "/venv/llvmlite/binding/libllvmlite.so"
SMAPS = "".join([
    _mapping("7f21cd600000-7f21cd965000", "r--p", LIB, 0),       # ELF headers, symbols
    _mapping("7f21cd965000-7f21d2994000", "r-xp", LIB, 0),       # machine code
    _mapping("7f21d6c77000-7f21d6e3c000", "r--p", LIB, 0),       # read-only data
    _mapping("7f21d6e3c000-7f21d6f00000", "r--p", LIB, 1792),    # relocated (RELRO)
    _mapping("7f21d6f00000-7f21d6f10000", "rw-p", LIB, 0),       # writable data
    _mapping("7f21e0000000-7f21e0021000", "r-xp", "/usr/lib/x86_64-linux-gnu/libc.so.6", 0),
    _mapping("7f21e1000000-7f21e1021000", "rw-p", "", 132),
])


def test_only_the_library_s_clean_read_only_mappings_are_chosen():
    assert compiler_mappings(SMAPS) == [(0x7F21CD600000, 0x7F21CD965000), (0x7F21CD965000, 0x7F21D2994000),
                                        (0x7F21D6C77000, 0x7F21D6E3C000)]
    assert compiler_mappings("") == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_released_compiler_pages_are_clean_and_come_back_when_needed():
    code = textwrap.dedent("""
        import json, numpy as np
        from numba import njit
        from edge_client.intnn import kernels as K
        from edge_client.intnn.memory import LIBRARY, release_compiler_pages

        def llvm_pages():
            out, cur = [], None
            with open("/proc/self/smaps") as f:
                for line in f:
                    p = line.split()
                    if p and "-" in p[0] and ":" not in p[0]:
                        cur = (p[1], p[5] if len(p) > 5 else "")
                    elif cur and LIBRARY in cur[1] and cur[0] in ("r-xp", "r--p") and p[0] in (
                            "Rss:", "Anonymous:"):
                        out.append((cur[0], p[0], int(p[1])))
            return out

        w = np.arange(-40, 41, dtype=np.int8)
        t = np.zeros_like(w)
        K.ternarize(w, 32, t)                       # Numba started, a kernel loaded
        before = llvm_pages()
        released = release_compiler_pages()
        after = llvm_pages()
        t2 = np.zeros_like(w)
        K.ternarize(w, 32, t2)                      # the loaded kernel still runs

        @njit
        def fresh(a):                               # and LLVM compiles a new one
            return a.sum() * 3

        print(json.dumps({"released": released, "before": before, "after": after,
                          "same": bool((t == t2).all()), "fresh": int(fresh(w))}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["released"] > 0

    def kb(pages, perm, field):
        return sum(v for p, k, v in pages if p == perm and k == field)

    code_before, code_after = kb(r["before"], "r-xp", "Rss:"), kb(r["after"], "r-xp", "Rss:")
    assert kb(r["before"], "r-xp", "Anonymous:") == 0
    assert code_before > 10_000 and code_after < code_before / 4
    # the read-only data goes too, but for the relocated part: the process's own pages
    relocated = kb(r["before"], "r--p", "Anonymous:")
    assert relocated > 0 and kb(r["after"], "r--p", "Anonymous:") == relocated
    assert kb(r["after"], "r--p", "Rss:") < kb(r["before"], "r--p", "Rss:") - relocated / 2
    assert r["same"] and r["fresh"] == 0  # sum of -40..40 is 0


def test_the_device_trainer_releases_and_trains_the_same():
    """The device runtime's trainer (pages released) and a plain one end bit-equal."""
    import numpy as np

    from edge_client.data import Dataset
    from edge_client.runtime import default_trainer_factory
    from edge_client.trainers import IntTrainer
    from firmware_models import get_spec

    spec = get_spec("digits_cnn")
    rng = np.random.default_rng(0)
    d = Dataset(rng.random((40, *spec.input_shape), dtype=np.float32),
                rng.integers(0, 10, 40).astype(np.int64))
    dev = default_trainer_factory(spec, 8, 4)
    assert dev._release_pages
    plain = IntTrainer(spec, 8, seed=4)
    for tr in (dev, plain):
        tr.train(d, steps=3, batch=16)
    for a, b in zip_strict(dev.int_weights(), plain.int_weights()):
        assert np.array_equal(a, b)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and ru_minflt are Linux's")
@pytest.mark.host
def test_kept_heap_serves_the_float_trainer_without_new_page_faults():
    """Float training allocates each step's activations anew (2.5 MB for mnist_cnn's first
    conv on 50 images); glibc's defaults hand most of them back to the kernel, so the next
    step faults them in again. After keep_freed_memory() a warm trainer faults few pages
    (none alone; a few hundred beside a busy test suite, against thousands before)."""
    code = textwrap.dedent("""
        import json, resource
        import numpy as np, torch
        from edge_client.data import Dataset
        from edge_client.intnn.memory import keep_freed_memory
        from edge_client.trainers import TorchTrainer

        torch.set_num_threads(1)
        rng = np.random.default_rng(0)
        d = Dataset(rng.integers(0, 256, (200, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, 200))
        t = TorchTrainer("mnist_cnn", seed=0)

        def faults():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t.train(d, steps=10, batch=50)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        faults()
        plain = sum(faults() for _ in range(3))
        kept = keep_freed_memory()
        faults(); faults()                      # the heap grows to the steps' peak
        print(json.dumps({"plain": plain, "kept": kept, "after": sum(faults() for _ in range(3))}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kept"], "glibc refused the settings"
    activation = 50 * 16 * 28 * 28 * 4 // 4096  # pages of the first conv's output
    assert r["plain"] > 3 * activation          # glibc's defaults: fresh pages step after step
    assert r["after"] * 4 < r["plain"], r       # kept: the warm steps mostly reuse the heap
