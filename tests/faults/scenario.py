"""One fault-injection run: a real mosquitto, real coordinator and device processes
(``harness.py``), kills, restarts, and the checks every fault must pass:

- the run completes: one metrics line per round, rounds 1..R, none repeated or skipped;
- every round counted every device exactly once (``accepted_ids``);
- the final model is exactly ``w_0 + R * Σ n_k s_k / Σ n_k`` (an update lost or counted
  twice would move it).

``FEDBIT_FAULT_TRIALS`` (default 1) repeats each fault with other kill points (``make
faults``); ``FEDBIT_FAULT_REPORT`` names a JSON-lines file each trial's outcome is added to.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

import harness
import numpy as np

from coordinator.state import RunState
from edge_client.intnn import init_shared
from firmware_models import get_spec

#: processes are forked from the test process: real processes (own PID, sockets, files;
#: SIGKILL is a real kill -9) that start in milliseconds, the imports and compiled
#: kernels already in memory, instead of seconds each on a loaded 2-core machine
_FORK = multiprocessing.get_context("fork")
#: (device id, shift, samples)
DEVICES = [("dev1", 0.01, 30), ("dev2", -0.02, 10)]


def trials() -> int:
    return max(1, int(os.environ.get("FEDBIT_FAULT_TRIALS", "1")))


def _child(argv: list[str], out: str, err: str) -> None:
    """The forked process: stdout/stderr to files, then the harness."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(harness.main(argv))


class Proc:
    """A forked harness process (``wait``/``poll``/``send_signal`` like ``Popen``)."""

    def __init__(self, argv: list[str], out: Path, err: Path) -> None:
        # a thread inside a network call while we fork (getaddrinfo's lock, paho's) would
        # leave the child waiting forever: fork before any client thread starts
        busy = [t.name for t in threading.enumerate() if t.name.startswith(("paho", "Thread-"))]
        assert not busy, f"fork with live network threads {busy}: start the processes first"
        self.log = err
        self.out = out
        self._p = _FORK.Process(target=_child, args=(argv, str(out), str(err)), daemon=False)
        self._p.start()
        self.pid = self._p.pid

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)


class Run:
    """The processes and files of one trial; every process is ended by PID in ``close``."""

    def __init__(self, tmp: Path, url: str, *, job: str, rounds: int = 3,
                 devices: list[tuple[str, float, int]] = DEVICES, coordinator_args: tuple[str, ...] = (),
                 device_args: dict[str, list[str]] | None = None, coordinator_url: str = "") -> None:
        self.tmp = tmp
        self.url = url
        self.coordinator_url = coordinator_url or url  # (a secured broker: the coordinator's own listener)
        self.job = job
        self.rounds = rounds
        self.devices = devices
        self.coordinator_args = list(coordinator_args)
        self.device_args = device_args or {}
        self.out = tmp / "run"
        self.procs: list[Proc] = []
        self.n = 0

    def _start(self, name: str, *args: str) -> Proc:
        self.n += 1
        p = Proc(list(args), self.tmp / f"{self.n:02d}-{name}.out", self.tmp / f"{self.n:02d}-{name}.err")
        self.procs.append(p)
        return p

    def coordinator(self, fault: str | None = None, *, resume: bool = False,
                    round_timeout: float = 20.0) -> Proc:
        args = ["coordinator", "--broker", self.coordinator_url, "--out", str(self.out), "--rounds", str(self.rounds),
                "--devices", str(len(self.devices)), "--round-timeout", str(round_timeout)]
        args += ["--job", self.job, *self.coordinator_args]
        if fault:
            args += ["--fault", fault]
        if resume:
            args.append("--resume")
        return self._start("coord", *args)

    def device(self, dev: str, fault: str | None = None, delay: float = 0.0) -> Proc:
        _, shift, n = next(d for d in self.devices if d[0] == dev)
        args = ["device", "--broker", self.url, "--id", dev, "--shift", str(shift), "--samples", str(n),
                "--workdir", str(self.tmp / dev), "--delay", str(delay), "--job", self.job,
                *self.device_args.get(dev, [])]
        if fault:
            args += ["--fault", fault]
        return self._start(dev, *args)

    def all_devices(self, **delays: float) -> list[Proc]:
        return [self.device(d, delay=delays.get(d, 0.0)) for d, _, _ in self.devices]

    @staticmethod
    def killed(p: Proc, timeout: float = 60) -> None:
        """Wait for ``p`` to die of its own SIGKILL (its fault point was reached)."""
        try:
            rc = p.wait(timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"never reached its fault point:\n{p.log.read_text()[-3000:]}") from None
        assert rc == -signal.SIGKILL, (rc, p.log.read_text()[-3000:])

    def finish(self, coord: Proc, devices: list[Proc], timeout: float = 90) -> None:
        try:
            rc = coord.wait(timeout=timeout)
        except TimeoutError:
            raise AssertionError("coordinator did not finish:\n" + coord.log.read_text()[-3000:]) from None
        assert rc == 0, coord.log.read_text()[-3000:]
        for d in devices:
            assert d.wait(timeout=30) == 0, d.log.read_text()[-2000:]

    def result(self, p: Proc) -> dict:
        """The JSON line a finished harness process printed last (its counts)."""
        return json.loads(p.out.read_text().strip().splitlines()[-1])

    def logs(self, name: str = "coord") -> list[dict]:
        """JSON log records of every process called ``name``."""
        out = []
        for f in sorted(self.tmp.glob(f"*-{name}.err")):
            out += [json.loads(ln) for ln in f.read_text(errors="replace").splitlines() if ln.startswith("{")]
        return out

    def check(self, samples: dict[str, int] | None = None) -> dict[str, int]:
        """The checks of the module docstring (``samples``: the weights the coordinator
        should have used, where they differ from what devices report); returns the summed
        per-round counts."""
        st = RunState(self.out)
        lines = st.read_metrics()
        want = sorted(d for d, _, _ in self.devices)
        assert [m["round"] for m in lines] == list(range(1, self.rounds + 1)), lines
        for m in lines:
            assert m["accepted_ids"] == want and m["accepted"] == len(want), m
        ck = st.load_checkpoint()
        assert ck is not None and ck.completed_round == self.rounds
        ns = [(samples or {}).get(d, n) for d, _, n in self.devices]
        step = sum(n * s for n, (_, s, _) in zip(ns, self.devices, strict=True)) / sum(ns)
        for w, w0 in zip(ck.weights, init_shared(get_spec("mlp"), 0), strict=True):
            np.testing.assert_allclose(w, w0 + self.rounds * step, atol=1e-5, rtol=0)
        total: dict[str, int] = {}
        for m in lines:
            for k, v in m["counts"].items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except TimeoutError:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)


def report(fault: str, trial: int, outcome: str, lost: int = 0, **extra) -> None:
    """Add one trial's line to ``FEDBIT_FAULT_REPORT`` (when set)."""
    path = os.environ.get("FEDBIT_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"fault": fault, "trial": trial, "outcome": outcome, "lost": lost, **extra}) + "\n")
