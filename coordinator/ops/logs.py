"""The coordinator's progress display (plain lines, or a live rich bar on a terminal).

Logs themselves (plain text or JSON lines, the ``--log-json``/``--log-level`` options) are
set up by :mod:`edge_client.logs`, the same for devices and the coordinator.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

from edge_client.protocol import model_variant


def hide_events(logger: logging.Logger, events: Iterable[str]) -> None:
    """Leave out of ``logger``'s handlers the records whose ``event`` is in ``events``
    (what a progress display on stdout already said is not said again on stderr)."""
    hidden = frozenset(events)

    def keep(record: logging.LogRecord) -> bool:
        return getattr(record, "event", None) not in hidden

    for h in logger.handlers:
        h.addFilter(keep)


def refusal_line(f: dict[str, Any]) -> str:
    """``  rejected update from 'dev3': bad_mac (detail)`` (a ``reject`` event)."""
    what = "dropped" if f.get("dropped") else "rejected"
    detail = f" ({f['detail']})" if f.get("detail") else ""
    return f"  {what} {f.get('kind', 'message')} from {f['device']!r}: {f['reason']}{detail}"


def device_line(f: dict[str, Any]) -> str:
    """``device 'dev1' joined (raspberry-pi-4, int8, uplink int-8); 2 online`` (a ``device`` event)."""
    if f["change"] == "joined":
        variant = model_variant(int(f["compute_bits"]), str(f["trainer"]))
        return f"device {f['device']!r} joined ({f['profile']}, {variant}, uplink {f['codec']}); {f['online']} online"
    return f"device {f['device']!r} left; {f['online']} online"


class ProgressDisplay:
    """Human-readable progress of the round loop on ``stream`` (an ``on_event`` callback).

    One line per round start (with the wait for devices, apart from the round's time), a
    live ``n/m updates`` counter when ``stream`` is a TTY, one line per device joining or
    leaving and per refused message (why), and one line per completed round with accuracy,
    counts and time. The log records of the events it shows are :data:`SHOWN` (``fedbit
    serve`` leaves them out of its text log: :func:`hide_events`).
    """

    #: log ``event`` fields whose message this display already prints
    SHOWN = ("round_start", "round_end", "reject", "device_joined", "device_left", "quarantine", "release", "alert")

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
            wait = f" after waiting {f['wait_seconds']:.1f} s for devices" if f.get("wait_seconds", 0) >= 0.1 else ""
            self._print(f"round {f['round']}/{self.rounds}: {len(f['selected'])} device(s) selected{wait}{extra}")
        elif event == "update" and f.get("selected"):  # (buffered: the buffer event's line)
            self._print(f"  round {f['round']}: {f['accepted']}/{f['selected']} updates", live=True)
        elif event == "buffer":
            self._print(f"  {buffer_text(f)}", live=True)
        elif event == "reject" and not f.get("dropped"):  # (late and repeated ones: in the log)
            self._print(refusal_line(f))
        elif event == "device":
            self._print(device_line(f))
        elif event == "quarantine":
            self._print(quarantine_line(f))
        elif event == "alert":
            self._print(f"ALERT (round {f['round']}): {f['text']}")
        elif event == "devices":
            self._print(f"  round {f['round']}: {devices_text(f)}", live=True)
        elif event == "round_end":
            self._print(round_line(f, self.rounds))


def buffer_text(f: dict[str, Any]) -> str:
    """The buffered loop's state (its ``buffer`` event): version, buffer fill, devices training."""
    return f"version {f['version']}: {f['fill']}/{f['size']} updates buffered, {f['in_flight']} device(s) training"


def quarantine_line(f: dict[str, Any]) -> str:
    """``device 'd3' QUARANTINED after round 7 (...); release it with: fedbit release d3 --run DIR``
    (a ``quarantine`` event)."""
    if f["change"] != "quarantined":
        return f"device {f['device']!r} released from quarantine"
    return (f"device {f['device']!r} QUARANTINED after round {f['round']} ({'; '.join(f.get('reasons') or [])}): "
            f"not selected until released (fedbit release {f['device']} --run RUN_DIR)")


def devices_text(f: dict[str, Any]) -> str:
    """An emulator's workers during a round (its ``devices`` event): devices done of those
    started, failed ones, workers busy."""
    failed = f", {f['failed']} failed" if f.get("failed") else ""
    return f"{f['done']}/{f['started']} devices done{failed}, {f['busy']}/{f['workers']} workers busy"


def group_accuracy_text(f: dict[str, Any], key: str = "accuracy") -> str:
    """``float32 0.9610 int8 0.9060``: the accuracy of each bitwidth group's model (float32
    first), each named (``key``: that figure of each group); a record without groups names
    the float32 (global) model."""
    groups = f.get("groups") or {}
    if not groups:
        return f"float32 {_fmt(f.get('accuracy'))}"
    return " ".join(f"{g} {_fmt(v.get(key))}" for g, v in sorted(groups.items(),
                                                                  key=lambda gv: (gv[0] != "float32", gv[0])))


def round_line(f: dict[str, Any], rounds: int) -> str:
    """One line for a finished round: the accuracy of each bitwidth group's model (named),
    updates, stragglers, wall (and simulated) seconds."""
    groups = f.get("groups") or {}
    # a round before the reported ones scores no test split: its validation subsample then
    key, what = ("val_accuracy", "validation accuracy") if groups and not any(
        isinstance(v.get("accuracy"), float) for v in groups.values()) else ("accuracy", "accuracy")
    strag = f", {f['stragglers']} straggler(s)" if f.get("stragglers") else ""
    if f.get("mode") == "buffered":
        return (f"version {f['round']}/{rounds}: {what} {group_accuracy_text(f, key)}, {f['accepted']} updates "
                f"(staleness mean {f['staleness_mean']:.1f}, max {f['staleness_max']}){strag}, "
                f"{f['round_seconds']:.2f} s")
    sim = f" (simulated {f['sim_round_seconds']:.2f} s)" if isinstance(f.get("sim_round_seconds"), float) else ""
    wait = f" (+ {f['wait_seconds']:.2f} s waiting for devices)" if f.get("wait_seconds", 0) >= 0.1 else ""
    return (f"round {f['round']}/{rounds}: {what} {group_accuracy_text(f, key)}, {f['accepted']}/{f['selected']} "
            f"updates{strag}, {f['round_seconds']:.2f} s{sim}{wait}")


def final_line(history: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """``fedbit serve``'s last line (JSON): ``rounds`` completed, ``final_accuracy`` of each
    bitwidth group's model after the last round (``{"float32": 0.961, "int8": 0.906}``),
    then ``fields``."""
    last = history[-1] if history else {}
    groups = {g: v.get("accuracy") for g, v in sorted((last.get("groups") or {}).items(),
                                                      key=lambda gv: (gv[0] != "float32", gv[0]))}
    if not groups and last:
        groups = {"float32": last.get("accuracy")}
    return {"rounds": len(history), "final_accuracy": groups, **fields}


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
        if event == "device":  # (an emulated fleet's devices all join at start: no line each)
            return
        if self._plain is not None:
            self._plain(event, f)
            return
        p = self._progress
        if event == "round_start":
            p.update(self._task, description=f"round {f['round']}/{self.rounds}",
                     updates=f"0/{len(f['selected'])} updates")
        elif event == "update" and f.get("selected"):
            p.update(self._task, updates=f"{f['accepted']}/{f['selected']} updates")
        elif event == "buffer":
            p.update(self._task, description=f"version {f['version']}/{self.rounds}", updates=buffer_text(f))
        elif event == "devices":
            p.update(self._task, updates=devices_text(f))
        elif event == "reject" and not f.get("dropped"):
            p.console.print(refusal_line(f), markup=False, highlight=False)
        elif event == "round_end":
            p.console.print(round_line(f, self.rounds))
            p.update(self._task, completed=f["round"])
            if f["round"] >= self.rounds:
                p.stop()

    def close(self) -> None:
        """Leave live mode (a run that stopped early)."""
        if self._progress is not None:
            self._progress.stop()
