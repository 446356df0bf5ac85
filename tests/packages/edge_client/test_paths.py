"""A device's default working directory (issue 15): the user's state directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_client.errors import ConfigError
from edge_client.paths import device_state_dir


def test_xdg_state_home_when_set_and_absolute() -> None:
    assert device_state_dir("pi-17", {"XDG_STATE_HOME": "/var/lib/x", "HOME": "/home/u"}) == \
        Path("/var/lib/x/fedbit/pi-17")


@pytest.mark.parametrize("xdg", [None, "", "relative/dir"])
def test_home_local_state_otherwise(xdg: str | None) -> None:
    env = {"HOME": "/home/u"} | ({} if xdg is None else {"XDG_STATE_HOME": xdg})
    assert device_state_dir("pi-17", env) == Path("/home/u/.local/state/fedbit/pi-17")


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x"])
def test_ids_that_would_leave_the_state_dir_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="not usable as a directory name"):
        device_state_dir(bad, {"HOME": "/home/u"})
