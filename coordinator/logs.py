"""Structured logs (plain text or JSON lines) and the coordinator's progress display.

The ``fedbit`` loggers attach context with ``extra={"event": ..., "round": ...}``; the JSON
formatter writes those fields next to ``ts`` (Unix s), ``level``, ``logger`` and ``msg``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, TextIO

_STD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6), "level": record.levelname.lower(),
            "logger": record.name, "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(*, json_lines: bool = False, level: str = "info",
                  stream: TextIO | None = None) -> logging.Logger:
    """Configure the ``fedbit`` logger tree for a CLI process and return it."""
    logger = logging.getLogger("fedbit")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else
                         logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger


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
        elif event == "round_end":
            acc = f.get("accuracy")
            acc_s = f"{acc:.4f}" if isinstance(acc, float) and math.isfinite(acc) else "n/a"
            strag = f", {f['stragglers']} straggler(s)" if f.get("stragglers") else ""
            self._print(f"round {f['round']}/{self.rounds}: accuracy {acc_s}, "
                        f"{f['accepted']}/{f['selected']} updates{strag}, {f['round_seconds']:.2f} s")
