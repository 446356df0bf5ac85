"""The line a first run prints when Numba compiles (a cold cache), and only then."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from edge_client.intnn.compile_note import MESSAGE, say_when_compiling


def test_one_line_when_a_kernel_compiles_none_when_it_loads_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "fresh_kernels.py").write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef add(x):\n    return x + 1\n\n"
        "@numba.njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lines: list[str] = []
    stop = say_when_compiling(lines.append)
    try:
        mod = importlib.import_module("fresh_kernels")
        assert mod.add(1) == 2 and mod.twice(2) == 4       # two compilations: one line
        assert lines == [MESSAGE]
        stop()
        lines.clear()
        stop = say_when_compiling(lines.append)
        del sys.modules["fresh_kernels"]
        mod = importlib.import_module("fresh_kernels")     # new dispatchers: loaded from the cache
        assert mod.add(1) == 2 and lines == []
        assert mod.add(1.5) == 2.5 and lines == [MESSAGE]  # a new signature compiles
    finally:
        stop()
        sys.modules.pop("fresh_kernels", None)
