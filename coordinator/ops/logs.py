"""The coordinator's progress display (plain lines, or a live rich bar on a terminal).

Logs themselves (plain text or JSON lines, the ``--log-json``/``--log-level`` options) are
set up by :mod:`edge_client.logs`, the same for devices and the coordinator.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO


class ProgressDisplay:
    """Human-readable progress of the round loop on ``stream`` (an ``on_event`` callback).

    One line per round start, a live ``n/m updates`` counter when ``stream`` is a TTY,
    and one line per completed round with accuracy, counts and time.
    """

    def __init__(self, rounds: int, stream: TextIO | None = None) -> None:
        self.rounds = rounds
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.monotonic()

    def _print(self, text: str, *, live: bool = False) -> None:
        if live:
            if self.tty:
                self.stream.write("\r" + text.ljust(78)[:78])
                self.stream.flush()
            return
        if self.tty:
            self.stream.write("\r" + " " * 78 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def __call__(self, event: str, f: dict[str, Any]) -> None:
        if event == "waiting":
            self._print(f"waiting for devices: {f['present']}/{f['need']} present")
        elif event == "round_start":
            extra = f" (resumed, {f['replayed']} update(s) from the inbox)" if f.get("resumed") else ""
            self._print(f"round {f['round']}/{self.rounds}: {len(f['selected'])} device(s) selected{extra}")
        elif event == "update":
            self._print(f"  round {f['round']}: {f['accepted']}/{f['selected']} updates", live=True)
        elif event == "reject":
            self._print(f"  rejected an update from {f['device']!r}: {f['reason']}")
        elif event == "devices":
            self._print(f"  round {f['round']}: {devices_text(f)}", live=True)
        elif event == "round_end":
            self._print(round_line(f, self.rounds))


def devices_text(f: dict[str, Any]) -> str:
    """An emulator's workers during a round (its ``devices`` event): devices done of those
    started, failed ones, workers busy."""
    failed = f", {f['failed']} failed" if f.get("failed") else ""
    return f"{f['done']}/{f['started']} devices done{failed}, {f['busy']}/{f['workers']} workers busy"


def round_line(f: dict[str, Any], rounds: int) -> str:
    """One line for a finished round: accuracy (per bitwidth group when there are several),
    updates, stragglers, wall (and simulated) seconds."""
    groups = f.get("groups") or {}
    if len(groups) > 1:
        acc_s = " ".join(f"{g} {_fmt(v.get('accuracy'))}" for g, v in sorted(groups.items()))
    else:
        acc_s = _fmt(f.get("accuracy"))
    strag = f", {f['stragglers']} straggler(s)" if f.get("stragglers") else ""
    sim = f" (simulated {f['sim_round_seconds']:.2f} s)" if isinstance(f.get("sim_round_seconds"), float) else ""
    return (f"round {f['round']}/{rounds}: accuracy {acc_s}, {f['accepted']}/{f['selected']} updates{strag}, "
            f"{f['round_seconds']:.2f} s{sim}")


def _fmt(acc: Any) -> str:
    return f"{acc:.4f}" if isinstance(acc, float) and math.isfinite(acc) else "n/a"


class LiveProgress:
    """A live progress bar of the round loop (rich) on a terminal, the plain
    :class:`ProgressDisplay` lines elsewhere; an ``on_event`` callback."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self._plain: ProgressDisplay | None = None
        self._progress: Any = None
        if not sys.stdout.isatty():
            self._plain = ProgressDisplay(rounds)
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.fields[updates]}"), transient=False)
        self._task = self._progress.add_task("waiting for devices", total=rounds, updates="")
        self._progress.start()

    def __call__(self, event: str, f: dict[str, Any]) -> None:
        if self._plain is not None:
            self._plain(event, f)
            return
        p = self._progress
        if event == "round_start":
            p.update(self._task, description=f"round {f['round']}/{self.rounds}",
                     updates=f"0/{len(f['selected'])} updates")
        elif event == "update":
            p.update(self._task, updates=f"{f['accepted']}/{f['selected']} updates")
        elif event == "devices":
            p.update(self._task, updates=devices_text(f))
        elif event == "reject":
            p.console.print(f"  rejected an update from {f['device']!r}: {f['reason']}")
        elif event == "round_end":
            p.console.print(round_line(f, self.rounds))
            p.update(self._task, completed=f["round"])
            if f["round"] >= self.rounds:
                p.stop()

    def close(self) -> None:
        """Leave live mode (a run that stopped early)."""
        if self._progress is not None:
            self._progress.stop()
