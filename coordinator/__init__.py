"""fedbit coordinator: the full-precision server (round loop, strategies, brokers).

It needs Python >= 3.11, unlike the device side (>= 3.9, docs/device.md): the wheel
installs on a device's Python 3.9 or 3.10, and there the coordinator refuses to start with
a message instead of failing somewhere inside (``tomllib``, torch 2.13).
"""

import sys

__version__ = "0.1.0"

#: the oldest Python the coordinator runs on (the device side: ``edge_client.PYTHON_FLOOR``)
PYTHON_FLOOR = (3, 11)

if sys.version_info < PYTHON_FLOOR:
    _found = ".".join(map(str, sys.version_info[:3]))
    _msg = (f"the fedbit coordinator needs Python >= 3.11, this is Python {_found}; "
            "on this Python only the device side runs (fedbit-edge, edge_client), "
            "see docs/device.md")
    if sys.argv and sys.argv[0].rsplit("/", 1)[-1] == "fedbit":  # the console script
        raise SystemExit(f"fedbit: error: {_msg}")
    raise ImportError(_msg)
