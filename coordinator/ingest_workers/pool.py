"""The ingest worker processes: started, read, replaced.

:class:`WorkerPool` runs ``n`` plain subprocesses (``coordinator.ingest_workers.worker``;
not ``multiprocessing``: nothing of the caller's ``__main__`` is imported again), each on
one end of a socket pair and in a process group of its own (a terminal's Ctrl-C reaches
the coordinator, which stops them). One reader thread per process hands every message to
``on_message(index, generation, msg)`` and, when the process ends, calls
``on_exit(index, generation, tag, exit code)``; a replacement (:meth:`WorkerPool.spawn`)
gets the next generation of the same index, so it reconnects under the same MQTT client
id and its broker session (with the messages in flight to its predecessor) is its own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from coordinator.ingest_workers.worker import WorkerConfig


class WorkerPool:
    """``n`` worker processes (see the module docstring)."""

    def __init__(self, n: int, config: Callable[[int], WorkerConfig],
                 on_message: Callable[[int, int, tuple], None],
                 on_exit: Callable[[int, int, str, int | None], None]) -> None:
        self.n = n
        self._config = config
        self._on_message = on_message
        self._on_exit = on_exit
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.gens = [0] * n
        self.tags = [""] * n  # the current process's inbox tag (after "ready")
        self.ready = [threading.Event() for _ in range(n)]
        self.errors = [""] * n
        self._conns: list[Connection | None] = [None] * n
        self._send_locks = [threading.Lock() for _ in range(n)]
        self.stopping = False

    def spawn(self, i: int, first: list[tuple] = ()) -> None:
        """Start (again) worker ``i``, its configuration then ``first`` sent before anything
        else (the open round's ``begin``)."""
        mine, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-c", "from coordinator.ingest_workers.worker import main; main()", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, process_group=0)
        theirs.close()
        conn = Connection(mine.detach())
        with self._send_locks[i]:
            self.gens[i] += 1
            self.procs[i], self._conns[i], self.tags[i], self.errors[i] = proc, conn, "", ""
            self.ready[i].clear()
            conn.send(("config", self._config(i)))
            for msg in first:
                conn.send(msg)
        threading.Thread(target=self._read, args=(i, self.gens[i], conn, proc), name=f"fedbit-ingest-{i}",
                         daemon=True).start()

    def _read(self, i: int, gen: int, conn: Connection, proc: subprocess.Popen) -> None:
        tag = ""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "ready":
                tag = msg[2]
                if self.gens[i] == gen:
                    self.tags[i] = tag
                    self.ready[i].set()
            elif msg[0] == "error" and self.gens[i] == gen:
                self.errors[i] = str(msg[1])
            self._on_message(i, gen, msg)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        conn.close()
        if self.gens[i] == gen:
            self.ready[i].set()  # (a wait for it ends)
        if not self.stopping:
            self._on_exit(i, gen, tag, code)

    def send(self, i: int, msg: tuple) -> bool:
        """Send ``msg`` to worker ``i``'s current process; False when it is gone."""
        with self._send_locks[i]:
            conn = self._conns[i]
            if conn is None:
                return False
            try:
                conn.send(msg)
                return True
            except (OSError, ValueError):
                return False

    def alive(self, i: int) -> bool:
        p = self.procs[i]
        return p is not None and p.poll() is None

    def pid(self, i: int) -> int | None:
        p = self.procs[i]
        return p.pid if p is not None else None

    def wait_ready(self, timeout: float) -> None:
        """Wait until every worker connected to the broker; ConnectionError naming the first
        that did not (with its error)."""
        for i in range(self.n):
            if not self.ready[i].wait(timeout) or not self.tags[i]:
                raise ConnectionError(f"ingest worker {i} did not start: {self.errors[i] or 'no answer'}")

    def kill(self, i: int) -> None:
        """SIGKILL worker ``i`` (a hung worker; tests)."""
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()

    def forget(self, i: int) -> None:
        """Worker ``i`` is not replaced: no more messages to it."""
        with self._send_locks[i]:
            self._conns[i] = None

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every worker to finish (its acks drained), then wait; SIGKILL after ``timeout``."""
        self.stopping = True
        for i in range(self.n):
            self.send(i, ("stop",))
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def describe(self) -> list[dict[str, Any]]:
        return [{"index": i, "pid": self.pid(i), "generation": self.gens[i], "alive": self.alive(i)}
                for i in range(self.n)]
