"""One line when this process first compiles a Numba kernel: a cold cache.

The integer engine's kernels are compiled the first time they run and cached on disk
(:mod:`edge_client.warmup`); until then a first run is silent for a minute or more.
:func:`say_when_compiling` listens for Numba's ``numba:compile`` event (sent only when a
kernel is compiled, never when it is loaded from the cache) and writes one line then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: what the line says (how long it takes is measured in docs/performance.md)
MESSAGE = ("compiling the integer kernels (first run only, a minute or two on a desktop, minutes on a "
           "Raspberry Pi; later runs load them from the cache)")


def say_when_compiling(write: Callable[[str], None], message: str = MESSAGE) -> Callable[[], None]:
    """Call ``write(message)`` once, when the first kernel compilation of this process
    starts (any thread). Returns a function that stops listening. Without numba (a float
    device's install), nothing happens."""
    try:
        import numba.core.event as ev
    except ImportError:
        return lambda: None
    lock = threading.Lock()
    said = []

    class FirstCompile(ev.Listener):
        def on_start(self, event: object) -> None:
            with lock:
                if said:
                    return
                said.append(True)
            try:
                write(message)
            except Exception:  # noqa: BLE001 - a closed stream must not break a compilation
                pass

        def on_end(self, event: object) -> None:
            return None

    listener = FirstCompile()
    ev.register("numba:compile", listener)
    return lambda: ev.unregister("numba:compile", listener)
