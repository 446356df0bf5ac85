"""Background group commit: make persisted updates durable, then acknowledge them.

The round loop appends accepted updates to the inbox log (page cache) and hands each
handled batch to an :class:`AckCommitter`; its thread calls ``sync()`` once for every
batch queued meanwhile (one ``fdatasync`` covers all of them: group commit) and only then
acks the batch's messages, in arrival order (MQTT wants PUBACKs in order). So the sync's
I/O wait overlaps with waiting for the next device instead of stalling the loop, and the
persist-then-ack rule (DESIGN.md, "Failure semantics") still holds: nothing is acked
before the sync that covers it returned.

A failure in ``sync`` or ``ack`` (any exception, ``BaseException`` included) stops the
committer: nothing later is acked, and the exception is raised in the loop's thread by the
next :meth:`AckCommitter.submit` or :meth:`AckCommitter.drain`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

M = TypeVar("M")


class AckCommitter(Generic[M]):
    """One background thread: ``sync()`` then ``ack(m)`` for each submitted message.

    Args:
        sync: makes everything appended so far durable (called in the committer thread).
        ack: acknowledges one message (called in the committer thread, in submit order).
        idle_exit_s: the thread exits after this many idle seconds (s); restarted on demand.

    ``cpu_seconds`` accumulates the committer thread's CPU time (s).
    """

    def __init__(self, sync: Callable[[], None], ack: Callable[[M], None], *,
                 idle_exit_s: float = 1.0) -> None:
        self._sync = sync
        self._ack = ack
        self._idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._queue: deque[Sequence[M]] = deque()
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.cpu_seconds = 0.0

    def submit(self, msgs: Sequence[M]) -> None:
        """Queue a handled batch (its updates already appended); returns at once."""
        with self._cv:
            self._raise_error()
            if not msgs:
                return
            self._queue.append(msgs)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fedbit-committer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pending(self) -> int:
        """Batches queued or being committed."""
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted message is synced and acked (or raise the
        committer's error); TimeoutError after ``timeout`` s."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._queue or self._busy) and self._error is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("the committer did not finish in time")
                self._cv.wait(left)
            self._raise_error()

    def check(self) -> None:
        """Raise the committer's error, if it stopped on one."""
        with self._cv:
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue and self._error is None:
                    self._cv.wait(self._idle_exit_s)
                if not self._queue or self._error is not None:
                    return
                batches = list(self._queue)
                self._queue.clear()
                self._busy = True
            c0 = time.thread_time()
            try:
                self._sync()  # one sync covers every batch taken
                for batch in batches:
                    for m in batch:
                        self._ack(m)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread
                with self._cv:
                    self._error = exc
            finally:
                with self._cv:
                    self.cpu_seconds += time.thread_time() - c0
                    self._busy = False
                    self._cv.notify_all()
