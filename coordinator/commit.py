"""Background group commit: persist accepted updates, make them durable, then acknowledge.

The round loop hands each handled batch, with the records of its accepted updates, to an
:class:`AckCommitter`, whose two threads form a pipeline: ``fedbit-persist`` appends each
batch's records to the inbox log (checksum and write release the GIL, so they run beside
the loop's decoding) and passes the batch on; ``fedbit-committer`` calls ``sync()`` once
for every batch passed on meanwhile (one ``fdatasync``: group commit) and only then acks
their messages, in arrival order (MQTT wants PUBACKs in order). Nothing is acked before
the sync that covers it returned (docs/architecture.md#failure-semantics); a crash before
that leaves the message unacked, and the broker redelivers it.

A failure in ``persist``, ``sync`` or ``ack`` (any exception, ``BaseException`` included)
stops the committer: nothing later is persisted or acked, and the exception is raised in
the loop's thread by the next :meth:`AckCommitter.submit`, :meth:`AckCommitter.check` or
:meth:`AckCommitter.drain`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

M = TypeVar("M")
R = TypeVar("R")


class AckCommitter(Generic[M, R]):
    """``persist(r)`` for each submitted record, then ``sync()``, then ``ack(m)`` for each
    submitted message, in submit order, in two background threads.

    Args:
        sync: makes everything persisted so far durable (committer thread).
        ack: acknowledges one message (committer thread, in submit order).
        persist: appends one record, not yet durable (persist thread, in submit order);
            None when records are never submitted.
        idle_exit_s: a thread exits after this many idle seconds (s); restarted on demand.

    ``cpu_seconds`` accumulates both threads' CPU time (s).
    """

    def __init__(self, sync: Callable[[], None], ack: Callable[[M], None], *,
                 persist: Callable[[R], None] | None = None, idle_exit_s: float = 1.0) -> None:
        self._sync = sync
        self._ack = ack
        self._persist = persist
        self._idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._to_persist: deque[tuple[Sequence[M], Sequence[R]]] = deque()
        self._to_sync: deque[Sequence[M]] = deque()
        self._busy = {"persist": False, "commit": False}
        self._error: BaseException | None = None
        self._threads: dict[str, threading.Thread] = {}
        self.cpu_seconds = 0.0

    def submit(self, msgs: Sequence[M], records: Sequence[R] = ()) -> None:
        """Queue a handled batch and the records to persist before its sync; returns at
        once."""
        if records and self._persist is None:
            raise ValueError("AckCommitter: records submitted but no persist function")
        with self._cv:
            self._raise_error()
            if not msgs and not records:
                return
            if records:
                self._to_persist.append((msgs, records))
                self._start("persist", self._run_persist)
            elif self._to_persist or self._busy["persist"]:  # keep the order: behind the
                # batches still queued for or being persisted
                self._to_persist.append((msgs, ()))
                self._start("persist", self._run_persist)
            else:
                self._to_sync.append(msgs)
                self._start("commit", self._run_commit)
            self._cv.notify_all()

    def pending(self) -> int:
        """Batches queued or being persisted or committed."""
        with self._cv:
            return len(self._to_persist) + len(self._to_sync) + sum(self._busy.values())

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted message is persisted, synced and acked (or raise
        the committer's error); TimeoutError after ``timeout`` s."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._in_flight() and self._error is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("the committer did not finish in time")
                self._cv.wait(left)
            self._raise_error()

    def check(self) -> None:
        """Raise the committer's error, if it stopped on one."""
        with self._cv:
            self._raise_error()

    # ------------------------------------------------------------------ threads (under _cv)

    def _in_flight(self) -> bool:
        return bool(self._to_persist or self._to_sync or any(self._busy.values()))

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _start(self, name: str, target: Callable[[], None]) -> None:
        t = self._threads.get(name)
        if t is None or not t.is_alive():
            t = threading.Thread(target=target, name=f"fedbit-{name}", daemon=True)
            self._threads[name] = t
            t.start()

    def _take(self, stage: str, queue: deque) -> list | None:
        """Wait for work in ``queue``: all of it, or None when idle for ``idle_exit_s``
        or stopped. (A wake-up meant for the other stage is not idleness: the wait goes
        on until the full idle time has passed, so a busy round keeps its two threads.)"""
        end = time.monotonic() + self._idle_exit_s
        while not queue and self._error is None:
            left = end - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        if not queue or self._error is not None:
            # forget this thread while still holding the lock, so that a submit from
            # now on starts a new one instead of relying on one that is exiting
            if self._threads.get(stage) is threading.current_thread():
                del self._threads[stage]
            return None
        items = list(queue)
        queue.clear()
        self._busy[stage] = True
        return items

    def _stage(self, stage: str, queue: deque, work: Callable[[list], None]) -> None:
        while True:
            with self._cv:
                items = self._take(stage, queue)
                if items is None:
                    return
            c0 = time.thread_time()
            try:
                work(items)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread
                with self._cv:
                    self._error = exc
            finally:
                with self._cv:
                    self.cpu_seconds += time.thread_time() - c0
                    self._busy[stage] = False
                    self._cv.notify_all()

    def _run_persist(self) -> None:
        def work(batches: list[tuple[Sequence[M], Sequence[R]]]) -> None:
            for msgs, records in batches:
                for r in records:
                    self._persist(r)  # type: ignore[misc]
                with self._cv:
                    self._to_sync.append(msgs)
                    self._start("commit", self._run_commit)
                    self._cv.notify_all()

        self._stage("persist", self._to_persist, work)

    def _run_commit(self) -> None:
        def work(batches: list[Sequence[M]]) -> None:
            self._sync()  # one sync covers every batch taken
            for msgs in batches:
                for m in msgs:
                    self._ack(m)

        self._stage("commit", self._to_sync, work)
