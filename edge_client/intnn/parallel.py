"""Running kernels over disjoint parts of their work on several threads.

The training kernels release the GIL (``nogil``), so a kernel split into parts (samples,
output channels, weight rows) runs on ``threads`` cores at once: ``threads - 1`` pool
threads plus the calling one. Every part writes its own outputs and integer sums are
exact, so the result is the same bit for bit whatever the number of threads. Kernels that
do not wait on each other share one hand-off (:meth:`Splitter.run_group`: part p of each
:class:`Task` on thread p).

A part is handed over through a pair of sequence numbers per pool thread (posted, done)
that the other side waits for by spinning without the GIL (:func:`.spin.wait_for`;
waking a sleeping thread costs far more, docs/performance.md#several-cores). A pool
thread spins :data:`IDLE_SPIN_S` after its last part, then sleeps on a condition until
the next one; the caller spins up to :data:`RESULT_SPIN_S` for a part, then sleeps too.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn.spin import wait_for

MAX_THREADS = 256
#: seconds a pool thread spins for its next part before it sleeps
IDLE_SPIN_S = 0.002
#: seconds the calling thread spins for a pool thread's part before it sleeps
RESULT_SPIN_S = 0.02


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


@dataclass(eq=False)
class Task:
    """One kernel to run over disjoint parts of ``range(total)`` in a
    :meth:`Splitter.run_group`: ``kernel(*args(part, lo, hi))`` per part, boundaries
    multiples of ``align``; ``split`` off: one part, on the calling thread. ``results``:
    the kernel's return values, one per part, once the group ran. ``tag``: what the task
    belongs to (e.g. an op's index, for a profile)."""

    kernel: Callable[..., Any]
    args: Callable[[int, int, int], Sequence[Any]]
    total: int
    align: int = 1
    split: bool = True
    tag: Any = None
    results: list[Any] = field(default_factory=list)


def _spin_tries(seconds: float) -> int:
    """Reads of :func:`.spin.wait_for` that take about ``seconds`` on this machine."""
    flags = np.zeros(1, np.int64)
    wait_for(flags, 0, 1, 16)  # compiled (or loaded from the cache) before timing
    tries = 1 << 12
    t0 = time.perf_counter()
    wait_for(flags, 0, 1, tries)
    per_try = max(time.perf_counter() - t0, 1e-7) / tries
    return max(1024, int(seconds / per_try))


class _Part:
    """One pool thread and its slot: the part to run, its result, and the sequence numbers
    ``flags`` = [posted, done] both sides wait on (spinning, then sleeping on ``cond``)."""

    def __init__(self, name: str, idle_tries: int, result_tries: int) -> None:
        self.flags = np.zeros(2, np.int64)
        self.cond = threading.Condition()
        self.idle_tries, self.result_tries = idle_tries, result_tries
        self.job: tuple[Callable[..., Any], Sequence[Any]] | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.posted = 0
        self.closed = False
        self.sleeping = False  # the pool thread waits on cond (guarded by cond)
        self.waiting = False  # the caller waits on cond (guarded by cond)
        self.thread = threading.Thread(target=_Part._loop, args=(self,), name=name, daemon=True)
        self.thread.start()

    def post(self, kernel: Callable[..., Any], args: Sequence[Any]) -> None:
        """Hand ``kernel(*args)`` to the pool thread."""
        self.job = (kernel, args)
        self.posted += 1
        self.flags[0] = self.posted
        with self.cond:
            if self.sleeping:
                self.cond.notify_all()

    def take(self) -> Any:
        """The posted part's result (its exception raised here)."""
        if not wait_for(self.flags, 1, self.posted, self.result_tries):
            with self.cond:
                self.waiting = True
                while self.flags[1] != self.posted:
                    self.cond.wait()
                self.waiting = False
        error, result = self.error, self.result
        self.error = self.result = None
        if error is not None:
            try:
                raise error
            finally:  # no cycle through this frame: the error's traceback holds it
                error = None
        return result

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join()

    def _loop(self) -> None:
        seen = 0
        while True:
            if not wait_for(self.flags, 0, seen + 1, self.idle_tries):
                with self.cond:
                    self.sleeping = True
                    while self.flags[0] != seen + 1 and not self.closed:
                        self.cond.wait()
                    self.sleeping = False
                    if self.flags[0] != seen + 1:  # closed, nothing posted
                        return
            seen += 1
            kernel, args = self.job  # type: ignore[misc]
            self.job = None
            try:
                self.result = kernel(*args)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                self.error = exc
            self.flags[1] = seen
            with self.cond:
                if self.waiting:
                    self.cond.notify_all()


class Splitter:
    """Runs ``kernel(*args(part, lo, hi))`` for each part of ``range(total)``; part 0 on the
    calling thread, the others on ``threads - 1`` pool threads (started on first use,
    handed their parts as the module docstring says). ``threads == 1`` calls the kernel
    once, directly."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = check_threads(threads)
        self._parts: list[_Part] = []
        self._finalizer: weakref.finalize | None = None

    def _pool(self) -> list[_Part]:
        if not self._parts:
            idle, result = _spin_tries(IDLE_SPIN_S), _spin_tries(RESULT_SPIN_S)
            self._parts = [_Part(f"fedbit-intnn-{p}", idle, result)
                           for p in range(1, self.threads)]
            # an unclosed splitter's threads end when it is collected
            self._finalizer = weakref.finalize(self, _close_parts, list(self._parts))
        return self._parts

    def run(self, kernel: Callable[..., Any], args: Callable[[int, int, int], Sequence[Any]],
            total: int, align: int = 1, split: bool = True) -> list[Any]:
        """The kernel's results, one per part (in part order)."""
        if self.threads == 1 or not split:
            return [kernel(*args(0, 0, total))]
        parts = split_range(total, self.threads, align)
        if len(parts) <= 1:
            return [kernel(*args(0, 0, total))]
        pool = self._pool()
        for p, (lo, hi) in enumerate(parts[1:]):
            pool[p].post(kernel, args(p + 1, lo, hi))
        error: BaseException | None = None
        try:
            first = kernel(*args(0, *parts[0]))
        except BaseException as exc:  # noqa: BLE001 - after the other parts finished
            error, first = exc, None
        rest = []
        for p in range(len(parts) - 1):  # never leave a part running on buffers the
            try:                           # caller reuses
                rest.append(pool[p].take())
            except BaseException as exc:  # noqa: BLE001 - the first error wins
                error = error or exc
        if error is not None:
            try:
                raise error
            finally:  # no cycle error -> traceback -> this frame -> self to keep us alive
                error = None
        return [first] + rest

    def run_chain(self, tasks: Sequence[tuple[Callable[..., Any], Callable[[int, int, int],
                                                                    Sequence[Any]]]],
                  total: int, align: int = 1) -> None:
        """Every (kernel, args) of ``tasks`` in order on each part of ``range(total)``: one
        hand-off for the whole chain (each part's kernels read only what the same part's
        earlier kernels wrote, e.g. the layers of a forward pass over a range of
        samples)."""
        self.run_group([Task(kernel, args, total, align) for kernel, args in tasks])

    def run_group(self, tasks: Sequence[Task]) -> None:
        """Several kernels in one hand-off: part p of every task, in the tasks' order, on
        thread p; each task's results (one per part, in part order) are left in its
        ``results``. A task may read what an earlier task of the group wrote only when
        both are split alike (the same ``total`` and ``align``, both split or neither: the
        same thread then wrote it), and must not write what another task reads, unless
        split alike too. A task with fewer parts than the others (``split`` off, a small
        ``total``) leaves the threads past its last part free for the other tasks."""
        if self.threads == 1:  # each task whole, in order (the path of every emulated device)
            for t in tasks:
                t.results = [t.kernel(*t.args(0, 0, t.total))] if t.total > 0 else []
            return
        plans = [split_range(t.total, self.threads if t.split else 1, t.align) for t in tasks]
        parts = max((len(plan) for plan in plans), default=0)

        def part(p: int) -> list[Any]:
            return [t.kernel(*t.args(p, *plan[p])) if p < len(plan) else None
                    for t, plan in zip(tasks, plans)]

        done = self.run(part, lambda p, lo, hi: (lo,), parts) if parts else []
        for k, (t, plan) in enumerate(zip(tasks, plans)):
            t.results = [done[p][k] for p in range(len(plan))]

    def close(self) -> None:
        """Stop the pool threads (a later :meth:`run` starts them again)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._parts = []


def _close_parts(parts: list[_Part]) -> None:
    for part in parts:
        part.close()
