"""Where a device keeps its files.

A device's working directory holds its outbox, the last completed round, its TLS files
and logs. It defaults to the user's state directory, ``$XDG_STATE_HOME/fedbit/<id>``,
else ``~/.local/state/fedbit/<id>`` (the XDG base directory rule for state that outlives
a restart but is not configuration), never the directory the device happened to be
started in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from edge_client.errors import ConfigError


def device_state_dir(device_id: str, env: Mapping[str, str] | None = None) -> Path:
    """The default working directory of device ``device_id``; ConfigError for an id that
    would leave the state directory (empty, ``.``, ``..`` or with a path separator)."""
    if not device_id or device_id in (".", "..") or "/" in device_id or os.sep in device_id:
        raise ConfigError(f"device id {device_id!r}: not usable as a directory name")
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "")
    # the spec: a relative XDG_STATE_HOME is invalid and must be ignored
    root = Path(base) if base and os.path.isabs(base) else Path(env.get("HOME") or Path.home()) / ".local" / "state"
    return root / "fedbit" / device_id
