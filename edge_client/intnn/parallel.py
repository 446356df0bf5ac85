"""Running one kernel over disjoint parts of its work on several threads.

The training kernels release the GIL (``nogil``), so a kernel split into parts (samples,
output channels, weight rows) runs on ``threads`` cores at once: ``threads - 1`` pool
threads plus the calling one. Every part writes its own outputs and integer sums are
exact, so the result is the same bit for bit whatever the number of threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from edge_client.errors import ConfigError

MAX_THREADS = 256


def check_threads(threads: int) -> int:
    """Validate a thread count (1..256) and return it as an int."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
    return threads


def split_range(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``0..total`` in at most ``parts`` pieces of nearly
    equal size, every boundary but the last a multiple of ``align``; empty pieces are
    dropped."""
    if parts <= 1 or total <= align:
        return [(0, total)] if total > 0 else []
    units = -(-total // align)
    out = []
    for p in range(parts):
        lo = min(total, units * p // parts * align)
        hi = min(total, units * (p + 1) // parts * align)
        if hi > lo:
            out.append((lo, hi))
    return out


class Splitter:
    """Runs ``kernel(*args(part, lo, hi))`` for each part of ``range(total)``; part 0 on the
    calling thread, the others on a pool of ``threads - 1`` threads (created on first
    use). ``threads == 1`` calls the kernel once, directly."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = check_threads(threads)
        self._pool: ThreadPoolExecutor | None = None

    def run(self, kernel: Callable[..., Any], args: Callable[[int, int, int], Sequence[Any]],
            total: int, align: int = 1, split: bool = True) -> list[Any]:
        """The kernel's results, one per part (in part order)."""
        if self.threads == 1 or not split:
            return [kernel(*args(0, 0, total))]
        parts = split_range(total, self.threads, align)
        if len(parts) <= 1:
            return [kernel(*args(0, 0, total))]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1,
                                            thread_name_prefix="fedbit-intnn")
        futures = [self._pool.submit(kernel, *args(p, lo, hi))
                   for p, (lo, hi) in enumerate(parts) if p > 0]
        try:
            first = kernel(*args(0, *parts[0]))
        finally:  # never leave a part running on buffers the caller reuses
            rest = [f.result() for f in futures]
        return [first] + rest

    def run_chain(self, tasks: Sequence[tuple[Callable[..., Any], Callable[[int, int, int],
                                                                    Sequence[Any]]]],
                  total: int, align: int = 1) -> None:
        """Every (kernel, args) of ``tasks`` in order on each part of ``range(total)``: one
        hand-off for the whole chain (each part's kernels read only what the same part's
        earlier kernels wrote, e.g. the layers of a forward pass over a range of
        samples)."""
        def chain(part: int, lo: int, hi: int) -> None:
            for kernel, args in tasks:
                kernel(*args(part, lo, hi))

        self.run(chain, lambda part, lo, hi: (part, lo, hi), total, align)

    def close(self) -> None:
        """Stop the pool threads (a later :meth:`run` starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
