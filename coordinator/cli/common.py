"""What several ``fedbit`` commands share: stopping on a signal with one line that says
where the command stopped and how to go on (:func:`stop_on_signals`, :class:`StopPoint`,
:func:`resume_command`)."""

from __future__ import annotations

import shlex
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from types import FrameType


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (a ``KeyboardInterrupt``: every ``finally`` runs, and code
    that already handles Ctrl-C handles it). ``status`` is the shell's ``128 + signal``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def status(self) -> int:
        return 128 + self.signum


def stop_on_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM raise :class:`Interrupted` in the main thread, so the
    command unwinds (brokers and workers stopped in its ``finally`` blocks) and prints
    one line instead of a traceback."""
    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def sigterm_to_exit() -> None:
    """SIGTERM ends the command like Ctrl-C does (finally blocks run, brokers stop)."""
    stop_on_signals()


class StopPoint:
    """Where a run is, from the round loop's events (an ``on_event`` callback): the round
    in progress or the last one completed, and (``fedbit emulate``) which run of a sweep."""

    def __init__(self) -> None:
        self.completed = 0
        self.round = 0  # the round being collected (0: none)
        self.waiting = False
        self.run = ""  # "run 1/2 (strategy=fedavg, seed 0)" of an emulated sweep

    def __call__(self, event: str, f: dict[str, Any]) -> None:
        if event == "waiting":
            self.waiting = True
        elif event == "round_start":
            self.round, self.waiting = int(f.get("round", 0)), False
        elif event == "round_end":
            self.completed, self.round = int(f.get("round", 0)), 0

    def new_run(self, label: str) -> None:
        """A new run of a sweep starts (its rounds count from 1 again)."""
        self.run, self.completed, self.round, self.waiting = label, 0, 0, False

    def where(self) -> str:
        """``during round 9``, ``while waiting for devices before round 3``, ``before round
        1`` (and ``of run 1/2 (...)`` in a sweep)."""
        if self.round:
            text = f"during round {self.round}"
        elif self.waiting:
            text = f"while waiting for devices before round {self.completed + 1}"
        else:
            text = f"before round {self.completed + 1}"
        if self.completed:
            text += f" ({self.completed} round(s) complete)"
        return text + (f" of {self.run}" if self.run else "")


def resume_command(prog: str, argv: Sequence[str], add: dict[str, str] | None = None) -> str:
    """The command line that goes on with a stopped run: ``prog`` and ``argv`` as given,
    the options of ``add`` that ``argv`` lacks, and ``--resume`` (shell-quoted)."""
    args = list(argv)
    for flag, value in (add or {}).items():
        if not any(a == flag or a.startswith(flag + "=") for a in args):
            args += [flag, value]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join([*prog.split(), *args])


def stopped_line(command: str, exc: Interrupted, point: StopPoint, resume: str, note: str = "") -> str:
    """``fedbit serve: stopped by SIGINT during round 9 (8 round(s) complete); `fedbit serve
    ... --resume` goes on``."""
    return f"{command}: stopped by {exc.name} {point.where()}; `{resume}` goes on{note}"
