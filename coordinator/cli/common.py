"""What several ``fedbit`` commands share."""

from __future__ import annotations

import signal
import threading
from typing import Any


def sigterm_to_exit() -> None:
    """SIGTERM ends the command like Ctrl-C does (finally blocks run, brokers stop)."""
    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
