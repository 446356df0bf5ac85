"""Logs of every fedbit process (devices and the coordinator): plain text or JSON lines on
stderr, and the ``--log-json`` / ``--log-level`` options both command lines share.

The ``fedbit`` loggers attach context with ``extra={"event": ..., "round": ...}``; the JSON
formatter writes those fields next to ``ts`` (Unix s), ``level``, ``logger`` and ``msg``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, TextIO

_STD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


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


def setup_logging(*, json_lines: bool = False, level: str = "info", stream: TextIO | None = None,
                  name: str = "fedbit") -> logging.Logger:
    """Configure the ``name`` logger tree of a CLI process (one handler on ``stream``,
    default stderr; not propagated to the root logger) and return it."""
    logger = logging.getLogger(name)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger


def add_logging_options(p: argparse.ArgumentParser, *, default_level: str = "info",
                        dest: dict[str, str] | None = None, suppress: bool = False) -> None:
    """``--log-json`` and ``--log-level`` (``dest``/``suppress`` as in
    :func:`edge_client.connection.add_connection_options`)."""
    dest = dest or {}
    json_kw: dict[str, Any] = {"action": "store_true", "help": "JSON-lines logs on stderr"}
    level_kw: dict[str, Any] = {"metavar": "LEVEL", "type": str.lower,
                                "choices": ["debug", "info", "warning", "error"],
                                "help": f"debug | info | warning | error ({default_level})"}
    if suppress:
        json_kw["default"] = level_kw["default"] = argparse.SUPPRESS
    else:
        level_kw["default"] = default_level
    p.add_argument("--log-json", dest=dest.get("json", "log_json"), **json_kw)
    p.add_argument("--log-level", dest=dest.get("level", "log_level"), **level_kw)
